"""Checks an exported model before it is committed, and the report they make.

The report (a JSON-ready dict) holds

* ``checks``: ONNX checker (``full_check=True``, on the file's path, so a
  model with external data is checked with its data file), strict shape
  inference (on the graph without the weights' values), the declared opset,
  weights kept out of the graph inputs, the weights in external data (where
  they are: each in the one data file, within it, none overlapping), metadata present,
  onnxruntime loading without a word on stderr, and MXNet placing every
  argument of the re-bound pair on its stage's device;
* ``parity``: for each runtime, batch size and output, the largest absolute
  difference between the runtime's output and the training checkpoint
  itself, bound on one device with MXNet (its loss head's forward pass, label
  unused), that output's scale: the largest absolute value the checkpoint
  gives on that batch, and its float32 ``sensitivity`` on that batch (below).
  A row passes when the difference is at most ``allowed``:

      allowed = max(TOLERANCE x scale,
                    min(SENSITIVITY_FACTOR x sensitivity,
                        SENSITIVITY_LIMIT x TOLERANCE x scale))

  (:func:`allowed_difference`; 1e-4, 10 and 100). With ``--tolerance T``
  the rule is ``T x scale`` alone, as before the sensitivity existed.

**The float32 sensitivity.** A fraction of the scale fits an output whose
float32 rounding is a fraction of its own size. It does not fit a softmax
that saturates: on logits near 1000 its output is at most 1, but on a
sample near a tie of two classes it moves with the difference of the two
logits, whose rounding is 1e-7 of 1000 and more, so two correct float32
runtimes differ by more than 1e-4 of the scale (GluonCV's ResNet-18 and
MobileNetV3). What two correct runtimes may differ by is what backward
error analysis says: a float32 dot product of ``n`` terms is the exact one
of weights off by at most ``n`` rounding units (Higham, *Accuracy and
Stability of Numerical Algorithms*, 3.1), so another summation order,
kernel or fusion is the same graph with its parameters moved by a few
ulps. The sensitivity is measured that way: the checkpoint runs again with
every nonzero finite floating-point parameter and state one ulp up or down
at random (:func:`perturbed_params`), :data:`PERTURBATIONS` times with
fixed seeds, each bound afresh (MXNet's oneDNN FullyConnected keeps the
weights of its first forward pass when others are copied into its
executor), and an output's sensitivity is the largest ``|perturbed -
checkpoint|`` over its elements and those runs: how much the network
itself amplifies float32 rounding on that batch, through whatever
saturates or cancels. It costs two more forward passes of the checkpoint
per batch, one at a time. The inputs are left as they are (token ids and
lengths must stay whole; an input one ulp off is its first layer's weights
one ulp off); ``TOLERANCE x scale`` stays the floor, for the rounding of
the output itself and of ops without parameters. (The checkpoint in float64
would measure its float32 error once per batch, at ten times the cost of a
convolution: MXNet has no oneDNN kernel in float64.)

Measured on 212 runtime-batch pairs where the difference exceeds 1e-5 of
the scale (ResNet-18 with logits near 500 and 1000, MobileNetV3-small near
1000, a small CNN near 1000; batches of 7 to 1000 rows): correct runtimes
differ from the checkpoint by 0.78 times the sensitivity (median), 2.7
times at most, so :data:`SENSITIVITY_FACTOR` leaves a margin of 3.7; a
defect must move the output by 10 times what float32 itself does.
:data:`SENSITIVITY_LIMIT` keeps the default from passing an output that
float32 cannot resolve to 1e-3 of its scale. On the saturated ResNet-18 of
``tests/test_export_tolerance.py`` (batch 796, the batch of the default
rule) onnxruntime differs by 1.8e-4 and the split MXNet pair by 2.0e-4,
which the rule of the scale alone refused, with a sensitivity of 1.7e-4:
allowed 1.7e-3, passed; a classifier weight off by 1e-3 of itself moves
the output by 2.2e-2 against an allowed 2.3e-3, and two convolutions'
weights swapped by 1.0: both fail.

The batch sizes (:func:`verification_batches`): 1, 7 and the largest up to
1000 whose activations fit :data:`MEMORY_BUDGET`, by the model's activation
bytes per sample (:func:`export.inference.activation_bytes`); with a dynamic
axis besides the batch, the same rule over :data:`DYNAMIC_BATCH_SIZES` at
sizes 1, about half and all of that axis as traced (the axes of one name, on
any input, together). Inputs are the rows of a given sample (``--sample``),
cycled to the batch size and cut to the varied sizes, or else normal noise,
or token ids below the vocabulary size where an ``Embedding`` reads the input
(directly or through a ``transpose``, ``reshape`` or the like). With dynamic
axes, an input of one number per sample that may be a length along one
(BERT's ``valid_length``; see :func:`_length_inputs`) is kept from 0 to that
axis's varied size.
"""
from collections import OrderedDict
import gc
import os

import numpy as np
import onnx
import onnxruntime as ort

import mxnet as mx

from mp_symbolic.tools.checkpoint import input_names as checkpoint_inputs
from mp_symbolic.core.base.checks import excerpt
from mp_symbolic.core.base.compat import write_into
from mp_symbolic.core.placement.devices import format_device
from mp_symbolic.core.graph.ir import PlacedGraph
from mp_symbolic.core.graph.names import GROUP_KEY
from mp_symbolic.core.base.scoped import captured_stderr

from . import MEMORY_BUDGET, PERTURBATIONS, SENSITIVITY_FACTOR, SENSITIVITY_LIMIT, TOLERANCE
from .errors import ExportError
from .inference import (as_laid_out, batch_axes, batch_first, input_names, network_order,
                        output_batch_axes)
from .onnx_export import (BATCH_DIM, ONNX_IR_VERSION, ONNX_OPSET, external_data_name,
                          without_weight_values)
from .runtimes import MXNetPredictor, OnnxPredictor

__all__ = ['BATCH_SIZES', 'DYNAMIC_BATCH_SIZES', 'TOLERANCE', 'MEMORY_BUDGET',
           'SENSITIVITY_FACTOR', 'SENSITIVITY_LIMIT', 'PERTURBATIONS',
           'REQUIRED_METADATA', 'verification_batches', 'largest_batch', 'check_batches',
           'parse_batches', 'within_tolerance', 'allowed_difference', 'perturbed_params',
           'verify_export', 'format_report', 'failed_checks', 'OneDeviceReference']

# The batch sizes verification runs at, where the activations fit MEMORY_BUDGET.
BATCH_SIZES = (1, 7, 1000)
# With a dynamic axis besides the batch (a sequence length): smaller batches,
# each at several sizes of that axis.
DYNAMIC_BATCH_SIZES = (1, 7, 64)
REQUIRED_METADATA = ('producer', 'producer_version', 'mxnet_version', 'input_names',
                     'input_shapes', 'output_names', 'output_shapes', 'stages',
                     'source_params_sha256')
_SEED = 20240601


def verification_batches(bytes_per_sample, candidates=BATCH_SIZES, budget=MEMORY_BUDGET):
    """The batch sizes to verify at: each of ``candidates`` whose activations
    fit ``budget``, and, if the largest does not, the largest batch that does.

    ``bytes_per_sample`` 162 MB (ResNet-50 v1d at 3x224x224) and the defaults
    give ``[1, 7, 13]``, 500 MB ``[1, 4]``; 20 KB gives ``[1, 7, 1000]``. A batch of 1 is always
    verified, whatever the budget.

    Raises:
        ExportError: ``bytes_per_sample`` is not a positive number.
    """
    fits = largest_batch(bytes_per_sample, budget)
    batches = sorted({b for b in candidates if b <= fits} | {1})
    if max(candidates) > fits and fits not in batches:
        batches.append(fits)
    return batches


def largest_batch(bytes_per_sample, budget=MEMORY_BUDGET):
    """The largest batch whose activations fit ``budget`` (at least 1).

    Raises:
        ExportError: ``bytes_per_sample`` is not a positive number.
    """
    if not bytes_per_sample > 0:
        raise ExportError('activation bytes per sample: expected a positive number, found %r'
                          % (bytes_per_sample,))
    return max(1, int(budget // bytes_per_sample))


def check_batches(batch_sizes, bytes_per_sample, budget=MEMORY_BUDGET):
    """Raises unless every one of ``batch_sizes`` (``--verify-batches``)
    fits ``budget`` by :func:`largest_batch`: each is held in every runtime
    in turn, and a batch of 10**10 would be an allocation of that many
    samples, not a check.

    Raises:
        ExportError: a batch size above the largest; the message says it.
    """
    fits = largest_batch(bytes_per_sample, budget)
    if max(batch_sizes) > fits:
        raise ExportError('--verify-batches: expected batch sizes of at most %d (the largest '
                          'whose activations, %d bytes per sample, fit the %d MiB memory '
                          'budget), found %d' % (fits, bytes_per_sample, budget >> 20,
                                                 max(batch_sizes)))


def parse_batches(text):
    """``'1,7'`` -> ``[1, 7]`` (``--verify-batches``).

    Raises:
        ExportError: not distinct positive integers.
    """
    try:
        batches = [int(b) for b in str(text).split(',')]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1 or len(set(batches)) != len(batches):
        raise ExportError('--verify-batches: expected distinct positive batch sizes such as '
                          '1,7, found %s' % excerpt(repr(text)))
    return batches


def allowed_difference(scale, tolerance, sensitivity=None):
    """The largest ``max |runtime - checkpoint|`` an output may have:
    ``tolerance x scale``, or, with a ``sensitivity`` (the checkpoint's own
    float32 sensitivity on the batch, see the module's docstring), up to
    :data:`SENSITIVITY_FACTOR` times it where that is larger, but at most
    :data:`SENSITIVITY_LIMIT` times ``tolerance x scale``.

    ``allowed_difference(1.0, 1e-4)`` is 1e-4; with ``sensitivity=3e-5`` it
    is 3e-4; with ``sensitivity=1e-2``, 1e-2. A sensitivity that is not a
    finite number counts as none; a negative ``tolerance`` allows nothing.
    """
    allowed = tolerance * scale
    if sensitivity is not None and np.isfinite(sensitivity):
        allowed = max(allowed, min(SENSITIVITY_FACTOR * sensitivity,
                                   SENSITIVITY_LIMIT * tolerance * scale))
    return float(allowed)


def within_tolerance(got, expected, tolerance, sensitivity=None):
    """``(ok, max |got - expected|, scale)`` for one output: ``ok`` when the
    difference is at most ``tolerance`` times ``scale``, the largest
    ``|expected|`` (an output of zeros must be matched exactly), or, given
    the checkpoint's float32 ``sensitivity`` on the batch, at most
    :func:`allowed_difference`. NaN anywhere fails."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    if got.shape != expected.shape:
        return False, float('inf'), float(np.max(np.abs(expected))) if expected.size else 0.0
    if not expected.size:
        return True, 0.0, 0.0
    diff = float(np.max(np.abs(got - expected)))
    scale = float(np.max(np.abs(expected)))
    ok = bool(np.isfinite(diff) and diff <= allowed_difference(scale, tolerance, sensitivity))
    return ok, diff, scale


def perturbed_params(params, seed):
    """``{name: NDArray}`` -> a copy with every nonzero finite value of a
    floating-point array moved one ulp up or down in magnitude, at random by
    ``seed`` (names in sorted order); zeros, infinities, NaN, the largest
    finite values moved up, and integer arrays as they are."""
    rng = np.random.default_rng(seed)
    moved = {}
    for name in sorted(params):
        value = _one_ulp_off(params[name].asnumpy(), rng)
        moved[name] = mx.nd.array(value, dtype=value.dtype)
    return moved


def _one_ulp_off(value, rng):
    """One array of :func:`perturbed_params`, as numpy."""
    if not np.issubdtype(value.dtype, np.floating) or not value.size:
        return value
    # one ulp in magnitude is one step of the IEEE bit pattern, read as an integer
    bits = np.unpackbits(np.frombuffer(rng.bytes((value.size + 7) // 8), np.uint8),
                         count=value.size).reshape(value.shape)
    step = bits.astype(np.dtype('i%d' % value.itemsize)) * 2 - 1
    step *= np.isfinite(value) & (value != 0)
    value = np.ascontiguousarray(value)
    changed = (value.view(step.dtype) + step).view(value.dtype)
    past = ~np.isfinite(changed)  # the largest finite value, moved up
    changed[past] = value[past]
    return changed


def _moved(array, value, off):
    """What :func:`_put_back` needs to turn ``array``, holding ``off``
    (:func:`_one_ulp_off` of ``value``), back into ``value``: which elements
    moved and which of them moved up, one bit each (the bit patterns, read
    as integers, moved by one)."""
    ints = np.dtype('i%d' % value.itemsize)
    before, after = np.ascontiguousarray(value).view(ints), off.view(ints)
    return array, np.packbits(before != after), np.packbits(after > before)


def _put_back(array, moved, up):
    """``array`` as it was before :func:`_moved` recorded it: each moved
    element's bit pattern one step back."""
    value = array.asnumpy()
    ints = value.view(np.dtype('i%d' % value.itemsize)).reshape(-1)
    count = ints.size
    step = np.unpackbits(up, count=count).astype(ints.dtype) * 2 - 1
    step *= np.unpackbits(moved, count=count).astype(ints.dtype)
    ints -= step
    write_into(array, value)


def _check(name, ok, detail):
    return OrderedDict([('name', name), ('ok', bool(ok)), ('detail', detail)])


def _onnx_checks(model, onnx_path, declared):
    checks = []
    try:
        onnx.checker.check_model(onnx_path, full_check=True)
        checks.append(_check('onnx checker (full_check)', True, 'valid'))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        checks.append(_check('onnx checker (full_check)', False, str(err).splitlines()[0]))
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        found = [[d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim]
                 for output in inferred.graph.output]
        ok = len(found) == len(declared) and all(
            dims == (list(out) if BATCH_DIM in out else [BATCH_DIM] + list(out[1:]))
            for dims, out in zip(found, declared))
        checks.append(_check('shape inference (strict)', ok, '; '.join(
            '%s: %s' % (output.name, dims) for output, dims in zip(inferred.graph.output, found))))
    except onnx.shape_inference.InferenceError as err:
        checks.append(_check('shape inference (strict)', False, str(err).splitlines()[0]))
    opsets = [(o.domain, o.version) for o in model.opset_import]
    checks.append(_check('opset declared', opsets == [('', ONNX_OPSET)]
                         and model.ir_version == ONNX_IR_VERSION,
                         'opset %s, IR version %d' % (opsets, model.ir_version)))
    weights = {init.name for init in model.graph.initializer}
    inputs = [value.name for value in model.graph.input]
    checks.append(_check('weights not graph inputs', not weights & set(inputs),
                         'inputs %s; %d initializers' % (inputs, len(weights))))
    props = {p.key for p in model.metadata_props}
    missing = [key for key in REQUIRED_METADATA if key not in props]
    checks.append(_check('metadata_props', not missing,
                         'missing %s' % ', '.join(missing) if missing
                         else '%d entries' % len(props)))
    return checks


def _external_data_check(tensors, onnx_path):
    """The check of the initializers whose values are kept beside the model
    (ONNX's external data): each in the one data file the export writes
    (:func:`export.onnx_export.external_data_name`), its ``length`` the
    bytes of its shape and type, within the file, none overlapping."""
    expected = os.path.basename(external_data_name(onnx_path))
    data_path = os.path.join(os.path.dirname(onnx_path), expected)
    size = os.path.getsize(data_path) if os.path.isfile(data_path) else None
    wrong, spans = [], []
    for tensor in tensors:
        fields = {entry.key: entry.value for entry in tensor.external_data}
        values = int(np.prod(tensor.dims, dtype=np.int64)) * np.dtype(
            onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
        offset, length = int(fields.get('offset', 0)), int(fields.get('length', -1))
        if fields.get('location') != expected or length != values or size is None \
                or offset + length > size:
            wrong.append('%s: %s at %d, %d bytes' % (tensor.name, fields.get('location'),
                                                     offset, length))
        spans.append((offset, offset + length, tensor.name))
    spans.sort()
    wrong += ['%s overlaps %s' % (b[2], a[2]) for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    if size is None:
        wrong.insert(0, '%s missing' % expected)
    return _check('weights in external data', not wrong, '; '.join(wrong[:3]) or
                  '%d initializers, %d bytes in %s' % (len(tensors), size, expected))


def _placement_check(predictor):
    placement = predictor.placement()
    wrong = []
    for name, ctx in placement.items():
        group = predictor.symbol.get_internals()[name].attr(GROUP_KEY)
        if ctx != predictor.group2ctx[group]:
            wrong.append('%s on %s, %s is on %s' % (name, ctx, group, predictor.group2ctx[group]))
    return _check('%s: arrays on their stage devices' % _describe(predictor), not wrong,
                  '; '.join(wrong) or '%d arguments placed by ctx_group' % len(placement))


def _describe(predictor):
    if isinstance(predictor, OnnxPredictor):
        return 'onnxruntime %s' % ort.__version__
    return 'mxnet ' + ', '.join('%s->%s' % (g, format_device(c))
                                for g, c in predictor.group2ctx.items())


class OneDeviceReference:
    """The training checkpoint bound on ``cpu(0)`` alone, as the truth to match.

    Every ``ctx_group`` is ignored (no ``group2ctx``), labels are zeros (a
    loss head's forward pass does not read them), ``is_train=False``.

    Args:
        symbol, arg_params, aux_params: The training checkpoint.
        shapes: ``{input name: per-sample shape}`` (or one shape for ``data``).
        dtypes: ``{input name: numpy dtype}``; float32 where not given.

    Its inputs and outputs are batch first; an input whose batch the graph
    lays out elsewhere (a recorded layout: :func:`~export.inference.batch_axes`)
    is moved there, and each output's batch back to the front.
    """

    def __init__(self, symbol, arg_params, aux_params, shapes, dtypes=None):
        self.symbol, self.arg_params, self.aux_params = symbol, arg_params, aux_params
        names = input_names(symbol)
        if not isinstance(shapes, dict):
            shapes = {names[0]: tuple(shapes)}
        self.input_names = names
        self.shapes = OrderedDict((name, tuple(shapes[name])) for name in names)
        self.shape = self.shapes[names[0]]  # of the first input
        self.dtypes = {name: np.dtype((dtypes or {}).get(name, np.float32)) for name in names}
        self.axes = batch_axes(symbol)
        self.output_axes = (output_batch_axes(symbol, arg_params, aux_params, self.shapes)
                            if any(self.axes.values()) else None)

    def __call__(self, *arrays):
        """One batch per input -> every output of the graph, as numpy arrays, in
        the network's order (:func:`~export.inference.network_order`); the
        executor reads the checkpoint's own arrays (bound, not copied)."""
        return self._outputs(arrays)

    def sensitivity(self, arrays, expected, perturbations=PERTURBATIONS, seed=_SEED):
        """The checkpoint's float32 sensitivity on one batch: for each
        output, the largest ``|perturbed - expected|`` over its elements and
        ``perturbations`` runs with every parameter and state one ulp off
        (see the module's docstring), or ``None`` where that is not a
        finite number.

        Args:
            arrays: One batch per input, as ``__call__`` takes them.
            expected: What ``__call__`` gave on them.
            perturbations: Runs; run ``k`` takes ``perturbed_params(arg_params,
                (seed, k, 0))`` and ``perturbed_params(aux_params, (seed, k, 1))``
                (:func:`perturbed_params`).
            seed: See ``perturbations``.
        """
        found = [0.0] * len(expected)
        for k in range(perturbations):
            outputs = self._outputs(arrays, perturbation=(seed, k))
            for i, (got, want) in enumerate(zip(outputs, expected)):
                if got.size:
                    moved = float(np.max(np.abs(np.asarray(got, np.float64)
                                                - np.asarray(want, np.float64))))
                    found[i] = moved if not moved <= found[i] else found[i]  # NaN stays
            del outputs
        # an output that overflows or turns NaN one ulp off has no sensitivity to speak of
        return [s if np.isfinite(s) else None for s in found]

    def _outputs(self, arrays, perturbation=None):
        """The outputs on ``arrays``, the executor bound on the checkpoint's
        own arrays (not copied). With ``perturbation`` ``(seed, run)``, those
        arrays hold ``perturbed_params(params, perturbation + (0 or 1,))``
        (args, aux) for the run, written in place one array at a time and put
        back bit for bit after it (:func:`_put_back`): no second copy of the
        parameters. Bound afresh each time: a bound oneDNN FullyConnected
        keeps the weights of its first forward pass when others are copied in."""
        assert self.arg_params is not None, 'the reference was released'
        cpu = mx.cpu(0)
        arrays = [as_laid_out(np.asarray(X), self.axes[name])
                  for name, X in zip(self.input_names, arrays)]
        given = {name: X.shape for name, X in zip(self.input_names, arrays)}
        arg_shapes, _, _ = self.symbol.infer_shape_partial(**given)
        arg_types, _, _ = self.symbol.infer_type_partial(**dict(self.dtypes))
        inputs = set(checkpoint_inputs(self.symbol)) | set(self.input_names)
        values = dict(zip(self.input_names, arrays))
        args = {}
        for name, shape, dtype in zip(self.symbol.list_arguments(), arg_shapes, arg_types):
            if name in values:
                args[name] = mx.nd.array(values[name], ctx=cpu, dtype=self.dtypes[name])
            elif name in inputs:  # a label: zeros, which the forward pass does not read
                args[name] = mx.nd.zeros(shape, ctx=cpu, dtype=dtype or np.float32)
            else:
                args[name] = self.arg_params[name].as_in_context(cpu)
        aux = {name: self.aux_params[name].as_in_context(cpu)
               for name in self.symbol.list_auxiliary_states()}
        moved = []  # (array, which elements moved, which of them up), to put back
        try:
            if perturbation is not None:
                for part, (params, into) in enumerate(((self.arg_params, args),
                                                       (self.aux_params, aux))):
                    rng = np.random.default_rng(tuple(perturbation) + (part,))
                    for name in sorted(params):  # as perturbed_params, in place
                        value = params[name].asnumpy()
                        off = _one_ulp_off(value, rng)
                        if off is not value:
                            moved.append(_moved(into[name], value, off))
                            write_into(into[name], off)
                        del value, off
            exe = self.symbol.bind(ctx=cpu, args=args, grad_req='null', aux_states=aux)
            exe.forward(is_train=False)
            outputs = [batch_first(exe.outputs[i].asnumpy(),
                                   self.output_axes[i] if self.output_axes else 0)
                       for i in network_order(self.symbol)]
            del exe  # its memory is back before the runtimes bind
        finally:
            for record in moved:
                _put_back(*record)
        del args, aux
        return outputs

    def release(self):
        """Lets go of the checkpoint's arrays (freed once nothing else holds
        them); the reference cannot run after."""
        self.arg_params = self.aux_params = None


def verify_export(onnx_path, sym_path, params_path, reference, batch_sizes=None,
                  tolerance=None, sample=None, bytes_per_sample=None):
    """Runs every check on freshly written export files.

    onnxruntime opens the file first (what it logs, and the outputs it
    declares) and is let go; the reference runs on every batch, and only its
    outputs are kept; then one runtime at a time, each let go before the
    next loads (each holds a copy of the weights): onnxruntime again, then
    the MXNet pair on one device per stage and on ``cpu(0)``.

    Args:
        onnx_path: The ``.onnx`` file.
        sym_path, params_path: The MXNet pair.
        reference: A callable ``(X0, X1, ...) -> [outputs]`` the runtimes
            must match (:class:`OneDeviceReference` of the training
            checkpoint). Its ``release()``, if it has one, is called once
            its outputs are computed.
        batch_sizes: The batch sizes to compare at; ``None``:
            :func:`verification_batches` of ``bytes_per_sample``.
        tolerance: ``None``: the rule of :func:`allowed_difference` with
            :data:`TOLERANCE` and the checkpoint's float32 sensitivity
            (where ``reference`` measures one: ``reference.sensitivity``);
            a number: ``max |difference| <= tolerance x scale``, nothing else.
        sample: ``{input name: array}``, batch first: the data to compare
            on (its rows cycled to each batch size); ``None``: noise, or
            token ids.
        bytes_per_sample: Activation bytes per sample
            (:func:`export.inference.activation_bytes`); ``None``: no
            memory bound.

    Returns:
        The report; ``report['ok']`` is whether every check passed.

    Raises:
        ModelFileError, CheckpointError, ExportError: a file cannot be
            loaded at all.
    """
    float32_aware = tolerance is None
    tolerance = TOLERANCE if tolerance is None else tolerance
    measures = callable(getattr(reference, 'sensitivity', None))
    with captured_stderr() as ort_log:
        onnx_runtime = OnnxPredictor(onnx_path, table=False)
    declared = [list(o.shape) for o in onnx_runtime.session.get_outputs()]
    dynamic = onnx_runtime.dynamic_axes
    shapes = reference.shapes
    if batch_sizes is None:
        candidates = DYNAMIC_BATCH_SIZES if dynamic else BATCH_SIZES
        batch_sizes = (verification_batches(bytes_per_sample, candidates)
                       if bytes_per_sample else list(candidates))
    output_names = [o.name for o in onnx_runtime.session.get_outputs()]
    # Its session holds a copy of the weights: let go while the reference runs on the
    # checkpoint's own, and loaded again once those are released.
    del onnx_runtime
    gc.collect()

    rng = np.random.default_rng(_SEED)
    parity = []
    vocab = {name: _token_range(reference.symbol, name) for name in reference.input_names}
    lengths = _length_inputs(sample, shapes, dynamic)
    batches = []
    for batch_size, sizes in _parity_shapes(shapes, dynamic, batch_sizes):
        arrays = []
        for name in reference.input_names:
            X = _inputs(rng, batch_size, sizes[name], reference.dtypes[name], vocab[name],
                        None if sample is None else sample[name])
            if name in lengths:  # a length along a dynamic axis stays within its size
                along, axis = lengths[name]
                X = np.clip(X, 0, sizes[along][axis - 1]).astype(X.dtype)
            arrays.append(X)
        batches.append((batch_size, arrays))
    expected_outputs = [reference(*arrays) for _, arrays in batches]
    # the checkpoint's own float32 sensitivity on each batch, while it is here
    sensitivities = [reference.sensitivity(arrays, expected) if measures
                     else [None] * len(expected)
                     for (_, arrays), expected in zip(batches, expected_outputs)]
    if callable(getattr(reference, 'release', None)):
        reference.release()  # the checkpoint's arrays go before onnxruntime loads its own
    checks = []
    runtimes = ['onnx', None, 'cpu:0']  # onnxruntime, then the MXNet pair's devices, in turn
    blocks = {}  # (batch, runtime) -> its rows, compared runtime after runtime
    for number in range(len(runtimes)):
        runtime, runtimes[number] = runtimes[number], None
        if not number:
            runtime = OnnxPredictor(onnx_path, table=False)
        else:
            if number == 1:  # the file's checks, on its graph without the weights' values
                # (a model with external data is read without it: the weights stay on disk)
                model = onnx.load(onnx_path, load_external_data=False)
                outside = [init for init in model.graph.initializer
                           if init.data_location == onnx.TensorProto.EXTERNAL]
                model = without_weight_values(model)
                checks.extend(_onnx_checks(model, onnx_path, declared))
                if outside:
                    checks.append(_external_data_check(outside, onnx_path))
                del model, outside
                checks.append(_check('onnxruntime loads without warnings', not ort_log,
                                     ort_log[0] if ort_log
                                     else 'nothing logged at default severity'))
            # one device per stage (the model-parallel split), then every stage on cpu(0)
            runtime = MXNetPredictor.from_files(sym_path, params_path, devices=runtime,
                                                shape=dict(shapes), dynamic_axes=dynamic,
                                                dtypes=reference.dtypes)
            checks.append(_placement_check(runtime))
        for batch, ((batch_size, arrays), expected) in enumerate(zip(batches, expected_outputs)):
            first = len(parity)
            batch_sensitivities = sensitivities[batch]
            outputs = runtime.run(*arrays)
            for index, (got, want) in enumerate(zip(outputs, expected)):
                sensitivity = batch_sensitivities[index]
                ok, diff, scale = within_tolerance(got.reshape(want.shape)
                                                   if got.size == want.size else got,
                                                   want, tolerance,
                                                   sensitivity if float32_aware else None)
                row = OrderedDict([('runtime', _describe(runtime)), ('batch_size', batch_size),
                                   ('shape', list(arrays[0].shape))])
                if len(arrays) > 1 and dynamic:
                    row['shapes'] = {n: list(X.shape) for n, X in zip(reference.input_names,
                                                                      arrays)}
                if len(expected) > 1:
                    row['output'] = output_names[index]
                allowed = allowed_difference(scale, tolerance,
                                             sensitivity if float32_aware else None)
                row.update([('max_abs_diff', diff), ('scale', scale),
                            ('sensitivity', sensitivity), ('allowed', allowed), ('ok', ok)])
                parity.append(row)
            del outputs
            blocks[batch, number] = parity[first:]
        del runtime
        gc.collect()  # an executor's memory goes with its last reference
    parity[:] = [row for key in sorted(blocks) for row in blocks[key]]  # batch after batch
    ok = all(c['ok'] for c in checks) and all(p['ok'] for p in parity)
    rule = ('max |difference| <= tolerance x scale (the largest |value| of that output on that '
            'batch)')
    if float32_aware:
        rule = ('max |difference| <= max(tolerance x scale, min(%g x sensitivity, %g x tolerance '
                'x scale)), scale the largest |value| of that output on that batch, sensitivity '
                'the checkpoint\'s own float32 sensitivity there (the largest change of that '
                'output over %d runs with every parameter one ulp off)'
                % (SENSITIVITY_FACTOR, SENSITIVITY_LIMIT, PERTURBATIONS))
    return OrderedDict([('ok', ok), ('tolerance', tolerance),
                        ('tolerance_rule', rule),
                        ('sensitivity_factor', SENSITIVITY_FACTOR if float32_aware else None),
                        ('sensitivity_limit', SENSITIVITY_LIMIT if float32_aware else None),
                        ('perturbations', PERTURBATIONS if measures else 0),
                        ('batch_sizes', list(batch_sizes)),
                        ('activation_bytes_per_sample', bytes_per_sample),
                        ('memory_budget', MEMORY_BUDGET), ('checks', checks),
                        # the first input's dynamic axes, then every input's, by name
                        ('dynamic_axes', list(dynamic.get(reference.input_names[0], ()))),
                        ('dynamic_inputs', {n: {str(a): d for a, d in axes.items()}
                                            for n, axes in dynamic.items()}),
                        ('parity', parity)])


def _inputs(rng, batch_size, shape, dtype, vocab, sample):
    """One input's batch: ``sample``'s rows cycled (cut along the other
    axes to ``shape``), or noise, or token ids below ``vocab``."""
    if sample is not None:
        rows = np.take(sample, np.arange(batch_size) % len(sample), axis=0)
        return np.ascontiguousarray(rows[(slice(None),) + tuple(slice(0, d) for d in shape)],
                                    dtype=dtype)
    if vocab:  # token ids for an Embedding (normal noise would index out of range)
        return rng.integers(0, vocab, (batch_size,) + tuple(shape)).astype(dtype)
    return rng.normal(0.0, 1.0, (batch_size,) + tuple(shape)).astype(dtype)


def _parity_shapes(shapes, dynamic_axes, batch_sizes):
    """``[(batch size, {input name: sample shape})]`` to compare at: each of
    ``batch_sizes``, with the dynamic axes (``{input name: {axis: name}}``)
    at sizes 1, about half and all of each as traced; the axes of one name
    change together (they are traced at one size)."""
    if not dynamic_axes:
        return [(b, dict(shapes)) for b in batch_sizes]
    sizes = [lambda d: 1, lambda d: d // 2 + 1, lambda d: d]
    found = []
    for batch_size in batch_sizes:
        for size in sizes:
            varied = {name: tuple(size(d) if i + 1 in dynamic_axes.get(name, ()) else d
                                  for i, d in enumerate(shape))
                      for name, shape in shapes.items()}
            if (batch_size, varied) not in found:
                found.append((batch_size, varied))
    return found


def _length_inputs(sample, shapes, dynamic_axes):
    """``{input name: (input name, axis)}`` of the inputs that may hold a
    length along a dynamic axis, to be kept from 0 to its size (BERT's
    ``valid_length``: MXNet 1.9.1 runs GluonNLP's BERT out of bounds,
    corrupting memory, at a length above the sequence or below -1): inputs of one number per sample whose sample values are
    whole numbers from 0 to that axis's traced size (the dynamic axis of
    the largest traced size if several fit), or, without a sample, every
    input of one number per sample, along the axis of the smallest traced
    size (noise is noise at any bound)."""
    if not dynamic_axes:
        return {}
    axes = sorted((shapes[n][a - 1], n, a) for n, spec in dynamic_axes.items() for a in spec)
    found = {}
    for name, shape in shapes.items():
        if shape:
            continue
        if sample is None:
            found[name] = axes[0][1:]
            continue
        X = np.asarray(sample[name])
        if not X.size or np.any(X != np.round(X)) or X.min() < 0:
            continue
        fits = [(size, n, a) for size, n, a in axes if X.max() <= size]
        if fits:
            found[name] = max(fits)[1:]
    return found


# Ops that move or reshape their input's values without computing new ones:
# an Embedding after them still reads token ids.
_VALUE_KEEPING = ('transpose', 'reshape', 'Reshape', 'SwapAxis', 'swapaxes', 'expand_dims',
                  'squeeze', 'Flatten', 'flatten', 'slice', 'slice_axis', 'slice_like', 'Cast',
                  'cast', '_copy', 'identity', 'BlockGrad', 'reshape_like')


def _token_range(symbol, name):
    """The smallest ``input_dim`` of the Embeddings that read input ``name``
    (directly or through ops that only move its values, such as a
    ``transpose`` to ``(T, N)``), or ``None``: then the input is not token ids."""
    graph = PlacedGraph.from_symbol(symbol)
    reached = {n.index for n in graph.variables if n.name == name}
    dims = []
    for node in graph.ops:  # in graph order: every input before its readers
        first = node.inputs[0].node if node.inputs else None
        if first not in reached:
            continue
        if node.op == 'Embedding':
            dims.append(int(node.attrs['input_dim']))
        elif node.op in _VALUE_KEEPING:
            reached.add(node.index)
    return min(dims) if dims else None


def format_report(report):
    """The report as lines of text."""
    lines = ['verification: %s' % ('PASSED' if report['ok'] else 'FAILED')]
    for check in report['checks']:
        lines.append('  [%s] %s: %s' % ('ok' if check['ok'] else 'FAIL', check['name'],
                                        check['detail']))
    float32_aware = report.get('sensitivity_factor') is not None
    lines.append('  parity with the training checkpoint bound on one device (max |difference|, '
                 'tolerance %g of each output\'s largest |value|%s):'
                 % (report['tolerance'], ', or %g times its float32 sensitivity where larger, up '
                    'to %g of it' % (report['sensitivity_factor'],
                                     report['sensitivity_limit'] * report['tolerance'])
                    if float32_aware else ''))
    for row in report['parity']:
        size = 'input %-8s' % 'x'.join(str(d) for d in row['shape']) \
            if report.get('dynamic_axes') or report.get('dynamic_inputs') \
            else 'batch %4d' % row['batch_size']
        if 'output' in row:
            size += ' %s' % row['output']
        line = '    [%s] %-52s %s: %.2e' % ('ok' if row['ok'] else 'FAIL', row['runtime'], size,
                                              row['max_abs_diff'])
        if float32_aware and row.get('allowed', 0) > report['tolerance'] * row['scale']:
            line += ' (float32 sensitivity %.2e, allowed %.2e)' % (row['sensitivity'],
                                                                  row['allowed'])
        lines.append(line)
    return lines


def failed_checks(report):
    """Names of the checks and parity rows that failed."""
    names = [c['name'] for c in report['checks'] if not c['ok']]
    names += ['parity %s batch %d%s (%.2e of scale %.2e%s)'
              % (p['runtime'], p['batch_size'], ' %s' % p['output'] if 'output' in p else '',
                 p['max_abs_diff'], p['scale'],
                 ', allowed %.2e' % p['allowed'] if 'allowed' in p else '')
              for p in report['parity'] if not p['ok']]
    return names
