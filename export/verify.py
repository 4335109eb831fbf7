"""Checks an exported model before it is committed, and the report they make.

The report (a JSON-ready dict) holds

* ``checks``: ONNX checker (``full_check=True``), strict shape inference,
  the declared opset, weights kept out of the graph inputs, metadata present,
  onnxruntime loading without a word on stderr, and MXNet placing every
  argument of the re-bound pair on its stage's device;
* ``parity``: the largest absolute difference between each runtime's output
  and the training checkpoint itself, bound on one device with MXNet (its
  loss head's forward pass, label unused) at batch sizes :data:`BATCH_SIZES`
  (with a dynamic axis besides the batch, :data:`DYNAMIC_BATCH_SIZES` at
  sizes 1, about half and all of that axis as traced); each must be within
  :data:`TOLERANCE` (absolute, plus the same relative to the reference).
  Inputs are normal noise, or token ids below the vocabulary size where an
  ``Embedding`` reads the input.
"""
from collections import OrderedDict
import json

import numpy as np
import onnx
import onnxruntime as ort

import mxnet as mx

from mp_symbolic.tools.checkpoint import input_names
from mp_symbolic.core.pipeline import DATA_NAME
from mp_symbolic.core.devices import format_device
from mp_symbolic.core.scoped import captured_stderr

from .onnx_export import BATCH_DIM, ONNX_IR_VERSION, ONNX_OPSET
from .runtimes import MXNetPredictor, OnnxPredictor

__all__ = ['BATCH_SIZES', 'DYNAMIC_BATCH_SIZES', 'TOLERANCE', 'REQUIRED_METADATA',
           'verify_export', 'format_report', 'failed_checks', 'OneDeviceReference']

BATCH_SIZES = (1, 7, 1000)
# With a dynamic axis besides the batch (a sequence length): smaller batches,
# each at several sizes of that axis.
DYNAMIC_BATCH_SIZES = (1, 7, 64)
TOLERANCE = 1e-5
REQUIRED_METADATA = ('producer', 'producer_version', 'mxnet_version', 'input_names',
                     'input_shapes', 'output_names', 'output_shapes', 'stages',
                     'source_params_sha256')
_SEED = 20240601


def _check(name, ok, detail):
    return OrderedDict([('name', name), ('ok', bool(ok)), ('detail', detail)])


def _onnx_checks(model, onnx_path, out_dims):
    checks = []
    try:
        onnx.checker.check_model(onnx_path, full_check=True)
        checks.append(_check('onnx checker (full_check)', True, 'valid'))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        checks.append(_check('onnx checker (full_check)', False, str(err).splitlines()[0]))
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        output = inferred.graph.output[0]
        dims = [d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim]
        checks.append(_check('shape inference (strict)', dims == [BATCH_DIM] + out_dims[1:],
                             '%s: %s' % (output.name, dims)))
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


def _placement_check(predictor):
    placement = predictor.placement()
    wrong = []
    for name, ctx in placement.items():
        group = predictor.symbol.get_internals()[name].attr('ctx_group')
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
    """

    def __init__(self, symbol, arg_params, aux_params, shape):
        self.symbol, self.arg_params, self.aux_params = symbol, arg_params, aux_params
        self.shape = tuple(shape)

    def __call__(self, X):
        arg_shapes, _, _ = self.symbol.infer_shape_partial(**{DATA_NAME: X.shape})
        inputs = set(input_names(self.symbol))
        shapes = {name: shape for name, shape in zip(self.symbol.list_arguments(), arg_shapes)
                  if name in inputs}
        exe = self.symbol.simple_bind(ctx=mx.cpu(0), grad_req='null', **shapes)
        exe.copy_params_from(self.arg_params, self.aux_params)
        exe.forward(is_train=False, **{DATA_NAME: X})
        return exe.outputs[0].asnumpy()


def verify_export(onnx_path, sym_path, params_path, reference):
    """Runs every check on freshly written export files.

    Args:
        onnx_path: The ``.onnx`` file.
        sym_path, params_path: The MXNet pair.
        reference: A callable ``X -> outputs`` the runtimes must match
            (:class:`OneDeviceReference` of the training checkpoint).

    Returns:
        The report; ``report['ok']`` is whether every check passed.

    Raises:
        ModelFileError, CheckpointError, ExportError: a file cannot be
            loaded at all.
    """
    model = onnx.load(onnx_path)
    with captured_stderr() as ort_log:
        onnx_runtime = OnnxPredictor(onnx_path)
    checks = _onnx_checks(model, onnx_path, list(onnx_runtime.session.get_outputs()[0].shape))
    checks.append(_check('onnxruntime loads without warnings', not ort_log,
                         ort_log[0] if ort_log else 'nothing logged at default severity'))
    runtimes = [onnx_runtime]
    dynamic = onnx_runtime.dynamic_axes
    # one device per stage (the model-parallel split), then every stage on cpu(0)
    for spec in (None, 'cpu:0'):
        mxnet_runtime = MXNetPredictor.from_files(sym_path, params_path, devices=spec,
                                                  shape=onnx_runtime.sample_shape,
                                                  dynamic_axes=dynamic)
        checks.append(_placement_check(mxnet_runtime))
        runtimes.append(mxnet_runtime)

    rng = np.random.default_rng(_SEED)
    parity = []
    vocab = _token_range(reference.symbol)
    for batch_size, shape in _parity_shapes(onnx_runtime.sample_shape, dynamic):
        if vocab:  # token ids for an Embedding (normal noise would index out of range)
            X = rng.integers(0, vocab, (batch_size,) + shape).astype(np.float32)
        else:
            X = rng.normal(0.0, 1.0, (batch_size,) + shape).astype(np.float32)
        expected = reference(X)
        for runtime in runtimes:
            got = runtime.predict(X).reshape(expected.shape)
            diff = float(np.max(np.abs(got - expected)))
            ok = bool(np.allclose(got, expected, rtol=TOLERANCE, atol=TOLERANCE))
            parity.append(OrderedDict([('runtime', _describe(runtime)),
                                       ('batch_size', batch_size), ('shape', list(X.shape)),
                                       ('max_abs_diff', diff), ('ok', ok)]))
    ok = all(c['ok'] for c in checks) and all(p['ok'] for p in parity)
    return OrderedDict([('ok', ok), ('tolerance', TOLERANCE), ('checks', checks),
                        ('dynamic_axes', list(dynamic)), ('parity', parity)])


def _parity_shapes(sample_shape, dynamic_axes):
    """``[(batch size, sample shape)]`` to compare at: :data:`BATCH_SIZES`,
    or with dynamic axes :data:`DYNAMIC_BATCH_SIZES` at sizes 1, about half
    and all of each dynamic axis as traced."""
    if not dynamic_axes:
        return [(b, tuple(sample_shape)) for b in BATCH_SIZES]
    sizes = [lambda d: 1, lambda d: d // 2 + 1, lambda d: d]
    shapes = []
    for batch_size in DYNAMIC_BATCH_SIZES:
        for size in sizes:
            shape = tuple(size(d) if i + 1 in dynamic_axes else d
                          for i, d in enumerate(sample_shape))
            if (batch_size, shape) not in shapes:
                shapes.append((batch_size, shape))
    return shapes


def _token_range(symbol):
    """The smallest ``input_dim`` of the Embeddings that read ``data``, or
    ``None``: then the input is not token ids."""
    nodes = json.loads(symbol.tojson())['nodes']
    data = {i for i, n in enumerate(nodes) if n['op'] == 'null' and n['name'] == DATA_NAME}
    dims = [int(n['attrs']['input_dim']) for n in nodes
            if n['op'] == 'Embedding' and n['inputs'] and n['inputs'][0][0] in data]
    return min(dims) if dims else None


def format_report(report):
    """The report as lines of text."""
    lines = ['verification: %s' % ('PASSED' if report['ok'] else 'FAILED')]
    for check in report['checks']:
        lines.append('  [%s] %s: %s' % ('ok' if check['ok'] else 'FAIL', check['name'],
                                        check['detail']))
    lines.append('  parity with the training checkpoint bound on one device (max |difference|, '
                 'tolerance %g abs + %g rel):' % (report['tolerance'], report['tolerance']))
    for row in report['parity']:
        size = 'input %-8s' % 'x'.join(str(d) for d in row['shape']) \
            if report.get('dynamic_axes') else 'batch %4d' % row['batch_size']
        lines.append('    [%s] %-52s %s: %.2e' % ('ok' if row['ok'] else 'FAIL',
                                                  row['runtime'], size, row['max_abs_diff']))
    return lines


def failed_checks(report):
    """Names of the checks and parity rows that failed."""
    names = [c['name'] for c in report['checks'] if not c['ok']]
    names += ['parity %s batch %d (%.2e)' % (p['runtime'], p['batch_size'], p['max_abs_diff'])
              for p in report['parity'] if not p['ok']]
    return names
