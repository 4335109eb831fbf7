"""The exported model in its two deployment runtimes, behind one interface.

* :class:`MXNetPredictor` binds the ``-symbol.json`` / ``.params`` pair with
  ``simple_bind(group2ctx=...)``: MXNet places every op and every argument
  array by the ``ctx_group`` attribute kept in the file, on devices chosen at
  load time through :func:`mp_symbolic.core.placement.devices.make_plan`.
* :class:`OnnxPredictor` runs the ``.onnx`` file in onnxruntime.

Both run every input and every output of the graph (:meth:`run`: one array
per input, in input order, batch first; a list of outputs of any shape), and
``predict`` takes a float32 batch of a one-input model, ``(samples,
features)`` or ``(samples,) + sample_shape`` (the model's own rank), and
returns its first output, ``(samples, ...)`` of any rank (the contract of
``python -m export.predict``); :func:`load_predictor` picks one by file name. A file
that is not what its name says, or a model that fails while it runs, raises
:class:`~export.errors.ModelFileError` naming the file; messages quote at
most a short excerpt of what the file holds.

Importing this module, and everything :class:`OnnxPredictor` does, needs
numpy and onnxruntime only: MXNet and the modules built on it are imported
by :class:`MXNetPredictor` when it is used, so that a host without MXNet
predicts from the ``.onnx`` file, without MXNet's seconds of import.
"""
import glob
import json
import os
import re

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from mp_symbolic.core.base.checks import DeviceSpecError
from mp_symbolic.core.graph.ir import PlacedGraph
from mp_symbolic.core.graph.names import GROUP_KEY
from mp_symbolic.tools.files import what_is
from mp_symbolic.tools.store import check_committed_file

from .errors import (InputError, ModelFileError, describe_start, describe_undecodable, excerpt,
                     library_message)
from .tables import features

__all__ = ['MXNetPredictor', 'OnnxPredictor', 'load_predictor', 'params_beside',
           'check_symbol_file', 'SYMBOL_SUFFIX', 'ONNX_SUFFIX']

SYMBOL_SUFFIX = '-symbol.json'
ONNX_SUFFIX = '.onnx'
_EPOCH_RE = re.compile(r'-(\d{4})\.params$')
# What onnxruntime raises for a file it cannot load or a graph that fails as
# it runs (none derive from a common base other than Exception).
_ORT_ERRORS = (ort_state.InvalidProtobuf, ort_state.InvalidGraph, ort_state.Fail,
               ort_state.NoSuchFile, ort_state.InvalidArgument, ort_state.NotImplemented,
               ort_state.RuntimeException, ort_state.EPFail)
_ORT_STATUS_RE = re.compile(r'^\[ONNXRuntimeError\] : \d+ : ')
_MAX_SYMBOL_BYTES = 64 << 20  # a symbol file is a graph description, not weights
# Ops on the longest path from an input: a bundled network has a few hundred;
# MXNet's Python side walks a graph recursively, and 100,000 ends in a RecursionError.
# (JSON nested 100,000 deep, `[[[...]]]`, is another RecursionError, in Python's
# own JSON reader: check_symbol_file catches that one.)
_MAX_GRAPH_DEPTH = 4000
# MXNet's JSON reader quotes the file where it stopped: "around ^`...`".
_MXNET_QUOTE_RE = re.compile(r',?\s*around \^`.*`', re.S)


# onnxruntime's input types, as numpy dtypes
_ORT_DTYPES = {'tensor(float)': np.float32, 'tensor(double)': np.float64,
               'tensor(int32)': np.int32, 'tensor(int64)': np.int64}


def _check_batch(X, shape, dynamic_axes=(), dtype=np.float32, name=None):
    """``(samples, features)`` or ``(samples,) + shape`` -> ``(samples,) + shape``
    of ``dtype``; the axes of this input in ``dynamic_axes`` (axis 1: the
    first after the batch; a tuple, or the keys of ``{axis: name}``) may have
    any size."""
    X = np.asarray(X)
    width = features(shape)
    if dynamic_axes and X.ndim == len(shape) + 1 and all(
            X.shape[i + 1] == d or (i + 1 in dynamic_axes and X.shape[i + 1] >= 1)
            for i, d in enumerate(shape)):
        return np.ascontiguousarray(X, dtype=dtype)
    if X.ndim == 2 and X.shape[1] == width and len(shape) > 1:
        X = X.reshape((len(X),) + tuple(shape))
    elif X.ndim < 1 or X.shape[1:] != tuple(shape):
        raise InputError('%sexpected an array of shape (samples, %d)%s, found shape %s'
                         % ('%s: ' % name if name else '', width,
                            '' if len(shape) == 1 else ' or (samples,) + %s' % (tuple(shape),),
                            X.shape))
    return np.ascontiguousarray(X, dtype=dtype)


def _dynamic_spec(dynamic_axes, names):
    """``{input name: {axis: name}}`` from the axes of the first input
    (``(1,)``, the form of a graph of one input) or ``{input name: axes}``
    (``{axis: name}``, or axes alone); an axis without a name (``None``)
    varies on its own."""
    if not isinstance(dynamic_axes, dict):
        dynamic_axes = {names[0]: dynamic_axes} if dynamic_axes else {}
    spec = {}
    for name, axes in dynamic_axes.items():
        axes = axes if isinstance(axes, dict) else {axis: None for axis in axes}
        if axes:
            spec[name] = dict(sorted(axes.items()))
    return spec


def _check_inputs(arrays, names, shapes, dtypes, dynamic_axes=None):
    """One batch per input -> the arrays as the graph takes them.

    ``dynamic_axes`` is ``{input name: {axis: name}}``: those axes may have
    any size, the same size for every axis of one name.

    Raises:
        InputError: not one array per input, an array of another shape,
            batches of different sizes, or axes of one name of different
            sizes.
    """
    if len(arrays) != len(names):
        raise InputError('expected %d input arrays (%s), found %d'
                         % (len(names), ', '.join(names), len(arrays)))
    dynamic_axes = dynamic_axes or {}
    checked = [_check_batch(X, shapes[name], dynamic_axes.get(name, ()), dtypes[name],
                            name if len(names) > 1 else None)
               for X, name in zip(arrays, names)]
    if len({len(X) for X in checked}) > 1:
        raise InputError('expected the same number of samples in every input, found %s'
                         % ', '.join('%s %d' % (n, len(X)) for n, X in zip(names, checked)))
    sizes = {}  # name -> [(input, axis, size)]
    for X, name in zip(checked, names):
        for axis, dim in dynamic_axes.get(name, {}).items():
            if dim is not None:
                sizes.setdefault(dim, []).append((name, axis, X.shape[axis]))
    for dim, found in sizes.items():
        if len({size for _, _, size in found}) > 1:
            raise InputError('expected the axes named %s of one size, found %s' % (dim, ', '.join(
                '%s axis %d of %d' % entry for entry in found)))
    return checked


def params_beside(sym_path):
    """The params file of the pair ``sym_path`` belongs to.

    ``<prefix>-symbol.json`` pairs with ``<prefix>-NNNN.params``; if several
    epochs are there, the highest one.

    Raises:
        ModelFileError: ``sym_path`` does not end in ``-symbol.json``, or no
            params file is beside it.
    """
    if not sym_path.endswith(SYMBOL_SUFFIX):
        raise ModelFileError('expected a symbol file ending in %s, found %s'
                             % (SYMBOL_SUFFIX, sym_path))
    prefix = sym_path[:-len(SYMBOL_SUFFIX)]
    found = sorted(p for p in glob.glob(glob.escape(prefix) + '-*.params')
                   if _EPOCH_RE.search(p) and p[:-len('-0000.params')] == prefix)
    if not found:
        raise ModelFileError('expected a params file %s-NNNN.params beside %s, found none'
                             % (prefix, sym_path))
    if len(found) > 1:  # which one belongs to the symbol is not for a guess to decide
        raise ModelFileError('expected one params file beside %s, found %d (%s); export the '
                             'checkpoint with python -m export and use its files'
                             % (sym_path, len(found), ', '.join(os.path.basename(p)
                                                                for p in found)))
    return found[0]


def check_symbol_file(path):
    """Raises unless ``path`` holds the JSON graph MXNet writes for a symbol.

    MXNet's own reader reports undecodable bytes as a ``utf-8 codec`` error
    and a JSON error by quoting the file; this says what the file is instead.

    Raises:
        ModelFileError: the file is unreadable, binary, not JSON (or JSON
            nested too deeply to read), or JSON without MXNet's ``nodes``,
            ``arg_nodes`` and ``heads`` lists.
    """
    what = '%s is not an MXNet symbol file' % path
    try:
        with open(path, 'rb') as f:
            data = f.read(_MAX_SYMBOL_BYTES + 1)
    except OSError as err:
        raise ModelFileError('%s is not a readable file: %s'
                             % (path, err.strerror or err)) from None
    if len(data) > _MAX_SYMBOL_BYTES:
        raise ModelFileError('%s: expected a graph of at most %d MiB, found a larger file'
                             % (what, _MAX_SYMBOL_BYTES >> 20))
    try:
        graph = json.loads(data.decode('utf-8'))
    except UnicodeDecodeError as err:
        raise ModelFileError('%s: expected UTF-8 JSON text (a symbol JSON), found %s'
                             % (what, describe_undecodable(data, err))) from None
    except ValueError as err:  # json.JSONDecodeError: its message is a position, no quote
        found = ('invalid JSON (%s)' % err if data.lstrip()[:1] in (b'{', b'[')
                 else describe_start(data[:64]))
        raise ModelFileError('%s: expected a symbol JSON, found %s' % (what, found)) from None
    except RecursionError:  # [[[...]]] 100,000 deep: Python's reader recurses per level
        raise ModelFileError('%s: expected a symbol JSON, found JSON nested too deeply to read '
                             '(arrays or objects inside one another, thousands deep)'
                             % what) from None
    keys = ('nodes', 'arg_nodes', 'heads')
    if not isinstance(graph, dict) or not all(isinstance(graph.get(k), list) for k in keys):
        if isinstance(graph, dict):
            found = 'an object with keys %s' % excerpt(', '.join(sorted(graph)))
        else:
            found = 'a JSON %s' % {list: 'array', str: 'string'}.get(type(graph), 'value')
        raise ModelFileError('%s: expected a JSON object with lists %s, found %s'
                             % (what, ', '.join(keys), found))
    bad = next((i for i, node in enumerate(graph['nodes'])
                if not (isinstance(node, dict) and isinstance(node.get('op'), str)
                        and isinstance(node.get('name'), str)
                        and isinstance(node.get('inputs'), list))), None)
    if bad is not None:
        raise ModelFileError("%s: expected every node to have 'op', 'name' and 'inputs', "
                             'found node %d without' % (what, bad))
    depth = []  # MXNet writes nodes in topological order: inputs come first
    for i, node in enumerate(graph['nodes']):
        try:
            depth.append(1 + max((depth[edge[0]] for edge in node['inputs']
                                  if 0 <= edge[0] < i), default=0))
        except (TypeError, IndexError, KeyError):
            raise ModelFileError('%s: expected node inputs [node, output, version] of earlier '
                                 'nodes, found %s at node %d'
                                 % (what, excerpt(str(node['inputs']), 40), i)) from None
        if depth[-1] > _MAX_GRAPH_DEPTH:
            raise ModelFileError('%s: expected a graph at most %d ops deep, found node %d (%s) '
                                 '%d deep' % (what, _MAX_GRAPH_DEPTH, i,
                                              excerpt(node['name'], 40), depth[-1]))


def _check_states_beside_their_ops(symbol, where):
    """Raises unless every auxiliary state (BatchNorm's running mean and
    variance) is in its op's ``ctx_group``: MXNet updates a state in place on
    its op's device and refuses a split bind otherwise ("mutable state cannot
    go across device", inside a multi-line RuntimeError)."""
    placed = PlacedGraph.from_symbol(symbol)
    for node in placed.ops:
        for entry in node.inputs:
            state = placed.source(entry)
            if state.role == 'state' and state.group != node.group:
                raise ModelFileError(
                    '%s: expected the state %s of %s %s on its op\'s device group %s, found it '
                    'in %s' % (where, excerpt(state.name, 60), node.op, excerpt(node.name, 60),
                               node.group, state.group))


class MXNetPredictor:
    """An inference symbol bound model-parallel by its ``ctx_group`` attributes.

    Args:
        symbol: The exported inference symbol (a training symbol works too:
            its loss head is dropped).
        arg_params: Parameter name -> NDArray.
        aux_params: Auxiliary state name -> NDArray (none for this network).
        devices: A ``--devices`` string or list of contexts. One device per
            ``ctx_group`` keeps the model-parallel split; fewer devices take
            contiguous groups each (one device: every group on it). ``None``:
            one device per group, GPUs if MXNet sees enough, else CPUs.
        shape: One sample's shape, where the symbol does not record it.
        dynamic_axes: Axes (1: the first after the batch) of the first
            input whose size may differ from ``shape``, or ``{input name:
            {axis: name}}`` (axes of one name take one size); ``None``: as
            the export recorded them (``python -m export --dynamic``). The
            graph is bound again for each new input shape.

    Attributes:
        group2ctx: ``{'stage0': ctx, ...}`` as passed to ``simple_bind``.
        output_ndim: Dimensions of the first output, the batch's included
            (``None`` if shape inference cannot tell before a batch runs).
        dynamic_axes: ``{input name: {axis: name}}`` of the inputs with
            axes of any size.
        note: A line saying which default devices were chosen, or ``None``.
        path, params_path: The files, if loaded with :meth:`from_files`.

    Raises:
        ExportError: the symbol lacks ``ctx_group`` attributes or has no
            ``data`` input.
        DeviceSpecError: ``devices`` cannot be mapped onto the groups.
    """

    def __init__(self, symbol, arg_params, aux_params=None, devices=None, shape=None,
                 dynamic_axes=None, dtypes=None):
        # pylint: disable=import-outside-toplevel  (MXNet's path only; see the module docstring)
        from mp_symbolic.core.placement.devices import make_plan
        from .inference import dynamic_axes as recorded_dynamic_axes
        from .inference import (batch_axes, inference_graph, input_dtypes, input_names,
                                sample_shapes, stage_layout)
        self.symbol = inference_graph(symbol)
        self.batch_axes = batch_axes(self.symbol)  # where the graph lays out each batch
        self._output_axes = None
        self.stages = stage_layout(self.symbol)
        _check_states_beside_their_ops(self.symbol, 'the graph')
        self.arg_params = {k: v for k, v in arg_params.items()
                           if k in self.symbol.list_arguments()}
        self.aux_params = dict(aux_params or {})
        try:
            plan, self.note = make_plan(len(self.stages), devices)
        except DeviceSpecError as err:
            raise DeviceSpecError('%s (the model has %d stages: %s)'
                                  % (err, len(self.stages), ', '.join(self.stages))) from None
        # Groups play the part of layers here: make_plan gives contiguous groups
        # to each device, so fewer devices than groups merge neighbouring stages.
        self.group2ctx = {group: plan.device_of_layer(i) for i, group in enumerate(self.stages)}
        self.input_names = input_names(self.symbol)
        self.dynamic_axes = _dynamic_spec(recorded_dynamic_axes(self.symbol)
                                          if dynamic_axes is None else dynamic_axes,
                                          self.input_names)
        self.sample_shapes = sample_shapes(self.symbol, self.arg_params, shape)
        recorded = input_dtypes(self.symbol)  # float32 unless the export recorded another
        self.dtypes = {name: np.dtype((dtypes or {}).get(name, recorded[name]))
                       for name in self.input_names}
        self.sample_shape = self.sample_shapes[self.input_names[0]]  # of the first input
        self.input_width = features(self.sample_shape)
        self.num_outputs = len(self.symbol.list_outputs())
        self.output_ndim = self._output_ndim()
        self.path = None  # the symbol file, when loaded by from_files
        self.params_path = None  # and its params file
        self._exec = None
        self._bound_symbol = None  # the graph bind binds, made once

    def _output_ndim(self):
        """Dimensions of the first output, the batch's included, by MXNet's
        shape inference at batch size 1; ``None`` if it cannot tell."""
        import mxnet as mx  # pylint: disable=import-outside-toplevel
        shapes = {name: _batched(shape, self.batch_axes[name], 1)
                  for name, shape in self.sample_shapes.items()}
        shapes.update({name: value.shape for name, value in self.arg_params.items()})
        try:
            _, out_shapes, _ = self.symbol.infer_shape_partial(**shapes)
        except (mx.base.MXNetError, TypeError, ValueError):
            return None
        return len(out_shapes[0]) if out_shapes and out_shapes[0] else None

    @classmethod
    def from_files(cls, sym_path, params_path=None, devices=None, shape=None, dynamic_axes=None,
                   dtypes=None):
        """Loads a pair; ``params_path`` defaults to :func:`params_beside`.

        Raises:
            ModelFileError: no params file beside ``sym_path``, or
                ``sym_path`` is not a symbol file (:func:`check_symbol_file`).
            CheckpointError: a file is missing or corrupt, or the arrays do
                not fit the symbol.
            ExportError, DeviceSpecError: see the class.
        """
        if not os.path.isfile(sym_path):
            raise ModelFileError('expected an MXNet symbol file at %s, found %s'
                                 % (sym_path, what_is(sym_path, 'none')))
        if params_path is None:
            params_path = params_beside(sym_path)
        check_symbol_file(sym_path)
        for path in (sym_path, params_path):
            try:
                path.encode('utf-8')
            except UnicodeEncodeError:  # a name that is not UTF-8: MXNet cannot open it
                raise ModelFileError('expected a file name MXNet can open (UTF-8), found %s'
                                     % path) from None
        # pylint: disable=import-outside-toplevel  (MXNet's path only; see the module docstring)
        from mp_symbolic.tools.checkpoint import CheckpointError, load_checkpoint
        try:
            symbol, arg_params, aux_params = load_checkpoint(sym_path, params_path)
        except CheckpointError as err:
            raise CheckpointError(library_message(_MXNET_QUOTE_RE.sub('', str(err)), 300)) from None
        _check_states_beside_their_ops(symbol, sym_path)  # the message names the file
        predictor = cls(symbol, arg_params, aux_params, devices, shape, dynamic_axes, dtypes)
        predictor.path, predictor.params_path = sym_path, params_path
        return predictor

    def bind(self, batch_size, sample_shape=None):
        """The executor for ``batch_size`` samples of ``sample_shape`` (by
        default the model's; ``{input name: shape}`` for several inputs; the
        last executor is reused)."""
        # pylint: disable=import-outside-toplevel
        from mp_symbolic.core.base.compat import split_bind
        from .inference import bindable
        shapes = dict(self.sample_shapes)
        if isinstance(sample_shape, dict):
            shapes.update(sample_shape)
        elif sample_shape is not None:
            shapes[self.input_names[0]] = tuple(sample_shape)
        shapes = {name: _batched(shape, self.batch_axes[name], batch_size)
                  for name, shape in shapes.items()}
        if self._exec is None or any(self._exec.arg_dict[name].shape != shape
                                     for name, shape in shapes.items()):
            first = self.input_names[0]
            data_ctx = self.group2ctx[self.symbol.get_internals()[first].attr(GROUP_KEY)]
            self._exec = None  # the old executor's memory goes before the new one's is taken
            if self._bound_symbol is None:
                self._bound_symbol = bindable(self.symbol)  # MXNet's attributes only
            with split_bind(self.group2ctx, self._bound_symbol, training=False):
                self._exec = self._bound_symbol.simple_bind(
                    ctx=data_ctx, group2ctx=self.group2ctx, grad_req='null',
                    type_dict=dict(self.dtypes), **shapes)
            for name, value in self.arg_params.items():
                value.copyto(self._exec.arg_dict[name])
            for name, value in self.aux_params.items():
                value.copyto(self._exec.aux_dict[name])
        return self._exec

    def _outputs_batch_axes(self):
        """Each output's batch axis (0 unless an input's batch is elsewhere)."""
        if self._output_axes is None:
            self._output_axes = [0] * self.num_outputs
            if any(self.batch_axes.values()):
                from .inference import output_batch_axes  # pylint: disable=import-outside-toplevel
                self._output_axes = output_batch_axes(self.symbol, self.arg_params,
                                                      self.aux_params, self.sample_shapes)
        return self._output_axes

    def placement(self):
        """``{argument name: context}`` of the current executor, as MXNet reports it."""
        if self._exec is None:
            self.bind(1)
        return {name: array.context for name, array in self._exec.arg_dict.items()}

    def run(self, *arrays):
        """One batch per input (in input order) -> every output, a list of
        numpy arrays ``(samples, ...)``.

        Raises:
            InputError: not one array per input, or one of another shape.
            ModelFileError: MXNet fails to run the graph.
        """
        import mxnet as mx  # pylint: disable=import-outside-toplevel
        arrays = _check_inputs(arrays, self.input_names, self.sample_shapes, self.dtypes,
                               self.dynamic_axes)
        shapes = {name: X.shape[1:] for name, X in zip(self.input_names, arrays)}
        laid_out = [_laid_out(X, self.batch_axes[name]) for name, X in zip(self.input_names,
                                                                           arrays)]
        try:
            executor = self.bind(len(arrays[0]), shapes)
            executor.forward(is_train=False, **dict(zip(self.input_names, laid_out)))
            return [_batch_first(out.asnumpy(), axis)
                    for out, axis in zip(executor.outputs, self._outputs_batch_axes())]
        except (mx.base.MXNetError, RuntimeError) as err:  # simple_bind wraps its errors
            raise ModelFileError('%s failed in MXNet on a batch of %d samples: %s' % (
                self.path or 'the graph', len(arrays[0]), library_message(err))) from None

    def predict(self, X):
        """``(samples, features)`` or ``(samples,) + sample_shape`` ->
        ``(samples, ...)`` float32 numpy array: the first output of a
        one-input model, of its own rank.

        Raises:
            InputError: ``X`` is neither ``(samples, input_width)`` nor
                ``(samples,) + sample_shape``, or the model reads several
                inputs (use :meth:`run`).
            ModelFileError: MXNet fails to run the graph.
        """
        if len(self.input_names) != 1:
            raise InputError('expected a model of one input, found %d: %s'
                             % (len(self.input_names), ', '.join(self.input_names)))
        return self.run(X)[0]


class OnnxPredictor:
    """An ``.onnx`` file in an onnxruntime CPU session.

    A model whose batch dimension is fixed (say to 1) is run in batches of
    that size; the number of samples must be a multiple of it.

    An input axis besides the batch may be dynamic too (``python -m export
    --dynamic 1=seq``, ``--dynamic data0:1=seq --dynamic data1:1=seq``):
    ``sample_shapes`` then gives the size each input was traced at (the
    ``sample_shapes`` metadata; ``sample_shape``, of the first input, in
    files written before it), inputs may have any size along it (the same
    size on every axis of one name).

    Args:
        path: The ``.onnx`` file.
        table: Whether to hold the model to ``python -m export.predict``'s
            contract (one float32 input; a first output of shape
            ``(batch, ...)``, of any rank). ``False``: any number of inputs
            of fixed per-sample dimensions (float32, float64, int32 or
            int64), any outputs.

    Attributes:
        batch_size: The fixed batch size, or ``None`` if any is accepted.
        dynamic_axes: ``{input name: {axis: name}}`` of the input axes
            (1: the first after the batch) of any size, named as in the file.
        input_names, sample_shapes, dtypes: The inputs, in order, one
            sample's shape and the numpy dtype of each.
        output_ndim: Dimensions of the first output as the file declares
            it, the batch's included.

    Raises:
        ModelFileError: the file is missing, not a model onnxruntime can
            load, or not inputs of shape (batch, ...) with fixed per-sample
            dimensions (or dynamic axes and their traced sizes), or (with
            ``table``) not one float32 input and a first output of shape
            ``(batch, ...)``.
    """

    def __init__(self, path, table=True):
        if not os.path.isfile(path):
            raise ModelFileError('expected an ONNX model file at %s, found %s'
                                 % (path, what_is(path, 'none')))
        self.path = path
        try:
            # Opened from its path, BERT-base's session holds 0.8 GB; from the file's bytes,
            # 1.2 GB. A path that is not UTF-8 onnxruntime cannot open: that file is read here.
            source = os.fspath(path)
            try:
                source.encode('utf-8')  # (bytes: onnxruntime would take them for the model)
            except (UnicodeEncodeError, AttributeError):
                source = None
            with open(path, 'rb') as f:  # readable: onnxruntime's message would not say why not
                source = f.read() if source is None else source
            self.session = ort.InferenceSession(source, providers=['CPUExecutionProvider'])
            del source
        except OSError as err:
            raise ModelFileError('%s is not a readable file: %s'
                                 % (path, err.strerror or err)) from None
        except _ORT_ERRORS as err:
            raise ModelFileError('%s is not a loadable ONNX model: %s'
                                 % (path, _ort_message(err))) from None
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        # axes after the batch that a name makes dynamic, sized as traced
        traced = _traced_shapes(self.session.get_modelmeta().custom_metadata_map, inputs)
        self.dynamic_axes = {}
        shapes = []
        # each input's and output's batch: the axis named BATCH_DIM (the first without one)
        self._axes = [_named_axis(i.shape) for i in inputs]
        self._output_axes = [_named_axis(o.shape) for o in outputs]
        for i, axis in zip(inputs, self._axes):
            dims = (list(i.shape[:axis]) + list(i.shape[axis + 1:])
                    if isinstance(i.shape, list) else [])
            axes = {a + 1: d for a, d in enumerate(dims) if isinstance(d, str)}
            if axes:
                self.dynamic_axes[i.name] = axes
                sizes = traced.get(i.name)
                if sizes is not None and len(sizes) == len(dims):
                    dims = [t if isinstance(d, str) else d for d, t in zip(dims, sizes)]
            shapes.append(dims)
        if not inputs or any(len(i.shape) < 1 or not all(isinstance(d, int) for d in shape)
                             for i, shape in zip(inputs, shapes)):
            raise ModelFileError('%s: expected inputs of shape (batch, ...) with fixed '
                                 'per-sample dimensions, found %s'
                                 % (path, _describe_args(inputs) or 'none'))
        if any(i.type not in _ORT_DTYPES for i in inputs):
            raise ModelFileError('%s: expected a float32 input (tensor(float)), found %s'
                                 % (path, _describe_args(inputs)))
        self.table = False
        if table:
            self.check_table()
        self.input_names = [i.name for i in inputs]
        self.sample_shapes = {i.name: tuple(shape) for i, shape in zip(inputs, shapes)}
        self.dtypes = {i.name: np.dtype(_ORT_DTYPES[i.type]) for i in inputs}
        self.input_name = inputs[0].name
        self.sample_shape = tuple(shapes[0])
        self.input_width = features(self.sample_shape)
        self.output_width = outputs[0].shape[1] if len(outputs[0].shape) == 2 else None
        self.output_ndim = len(outputs[0].shape) if isinstance(outputs[0].shape, list) else None
        self.num_outputs = len(outputs)
        batch = inputs[0].shape[self._axes[0]] if len(inputs[0].shape) > self._axes[0] else None
        self.batch_size = batch if isinstance(batch, int) and batch > 0 else None
        # A failing run is reported by the exception; onnxruntime would also log it.
        self._quiet = ort.RunOptions()
        self._quiet.log_severity_level = 4  # fatal only

    def check_table(self):
        """Holds the model to ``python -m export.predict``'s contract for a
        table (``.npy`` or CSV): one float32 input of shape ``(batch,
        ...)`` with at least one axis after the batch, and a first output
        of shape ``(batch, ...)``; :attr:`table` is then true.

        Raises:
            ModelFileError: it is not.
        """
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or len(inputs[0].shape) < 2:
            raise ModelFileError('%s: expected one input of shape (batch, ...) with fixed '
                                 'per-sample dimensions, found %s'
                                 % (self.path, _describe_args(inputs) or 'none'))
        if inputs[0].type != 'tensor(float)':
            raise ModelFileError('%s: expected a float32 input (tensor(float)), found %s'
                                 % (self.path, _describe_args(inputs)))
        if isinstance(outputs[0].shape, list) and len(outputs[0].shape) < 1:
            raise ModelFileError('%s: expected its first output to be of shape (batch, ...), '
                                 'found %s' % (self.path, _describe_args(outputs[:1])))
        self.table = True

    def run(self, *arrays):
        """One batch per input (in input order) -> every output, a list of
        numpy arrays ``(samples, ...)``.

        Raises:
            InputError: not one array per input, one of another shape, or
                samples that are not a multiple of a fixed batch size.
            ModelFileError: onnxruntime fails to run the model, or an output
                is not ``(samples, ...)`` numbers.
        """
        arrays = _check_inputs(arrays, self.input_names, self.sample_shapes, self.dtypes,
                               self.dynamic_axes)
        count = len(arrays[0])
        step = self.batch_size or count
        if count % step:
            raise InputError('%s runs batches of exactly %d samples (its input is %s); expected '
                             'a multiple of %d samples, found %d'
                             % (self.path, step, _describe_args(self.session.get_inputs()),
                                step, count))
        parts = [self._run([X[i:i + step] for X in arrays]) for i in range(0, count, step)]
        return [np.concatenate(outs) for outs in zip(*parts)]

    def predict(self, X):
        """``(samples, features)`` or ``(samples,) + sample_shape`` ->
        ``(samples, ...)`` float32 numpy array: the first output of a
        one-input model, of its own rank.

        Raises:
            InputError: ``X`` is neither ``(samples, input_width)`` nor
                ``(samples,) + sample_shape``, or its samples are not a
                multiple of a fixed batch size, or the model reads several
                inputs (use :meth:`run`).
            ModelFileError: onnxruntime fails to run the model, or its output
                is not ``(samples, ...)`` numbers.
        """
        if len(self.input_names) != 1:
            raise InputError('expected a model of one input, found %d: %s'
                             % (len(self.input_names), ', '.join(self.input_names)))
        return self.run(X)[0]

    def _run(self, arrays):
        count = len(arrays[0])
        try:
            outputs = self.session.run(None, dict(zip(self.input_names, [
                _laid_out(X, axis) for X, axis in zip(arrays, self._axes)])), self._quiet)
        except _ORT_ERRORS as err:
            raise ModelFileError('%s failed in onnxruntime on a batch of %d samples: %s'
                                 % (self.path, count, _ort_message(err))) from None
        checked = []
        for i, Y in enumerate(outputs):
            Y = np.asarray(Y)
            if Y.ndim > self._output_axes[i]:
                Y = _batch_first(Y, self._output_axes[i])
            if Y.ndim < 1 or len(Y) != count or not np.issubdtype(Y.dtype, np.number):
                raise ModelFileError('%s: expected (%d, ...) numbers from a batch of %d samples, '
                                     'found %s of shape %s'
                                     % (self.path, count, count, Y.dtype, Y.shape))
            checked.append(Y.astype(np.float32, copy=False))
        return checked


BATCH_DIM = 'batch'  # the ONNX dimension name of the batch (export.onnx_export's)


def _named_axis(shape):
    """The axis of an ONNX input or output named :data:`BATCH_DIM` (0 without one)."""
    return shape.index(BATCH_DIM) if isinstance(shape, list) and BATCH_DIM in shape else 0


def _batched(shape, axis, size):
    """One sample's ``shape`` with ``size`` samples at the batch ``axis``."""
    return tuple(shape[:axis]) + (size,) + tuple(shape[axis:])


def _laid_out(X, axis):
    """A batch-first array with its batch moved to ``axis``, as the model lays it out."""
    return np.ascontiguousarray(np.moveaxis(X, 0, axis)) if axis else X


def _batch_first(X, axis):
    """A model's array with its batch ``axis`` moved to the front."""
    return np.moveaxis(X, axis, 0) if axis else X


def _traced_shapes(metadata, inputs):
    """``{input name: [per-sample dims]}`` as traced: the ``sample_shapes``
    metadata, or, in files written before it, ``sample_shape`` (of the
    first input); what does not read as lists of integers is left out."""
    try:
        traced = json.loads(metadata['sample_shapes'])
    except (KeyError, ValueError, TypeError, RecursionError):
        try:
            traced = {inputs[0].name: json.loads(metadata['sample_shape'])} if inputs else {}
        except (KeyError, ValueError, TypeError, RecursionError):
            traced = {}
    found = {}
    for name, dims in (traced.items() if isinstance(traced, dict) else ()):
        if isinstance(dims, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                          for d in dims):
            found[name] = dims
    return found


def _describe_args(args):
    """``data['batch', 2] tensor(float)``, ...: names and shapes as the file gives them."""
    return excerpt(', '.join('%s%s %s' % (a.name, a.shape, a.type) for a in args), 120)[1:-1]


def _ort_message(err):
    """onnxruntime's message without its status prefix, as one short line."""
    return library_message(_ORT_STATUS_RE.sub('', str(err)))


def load_predictor(path, devices=None, table=True):
    """The predictor for an exported file, chosen by its name.

    Args:
        path: ``<name>.onnx``, or ``<name>-symbol.json`` with its params file
            beside it.
        devices: MXNet pair only; see :class:`MXNetPredictor`.
        table: ONNX only: hold the model to the contract of a table's
            predictions (:meth:`OnnxPredictor.check_table`); ``False``: a
            model of any inputs, run by name (:meth:`OnnxPredictor.run`).

    Raises:
        ModelFileError: the name is neither kind, or the file is missing or
            corrupt.
        CheckpointError: the pair's arrays do not fit its symbol.
        DeviceSpecError: ``devices`` given for an ONNX model, or unusable.
    """
    check_committed_file(path)  # a file of OUT/current/ must match its commit
    if path.endswith(ONNX_SUFFIX):
        if devices is not None:
            raise DeviceSpecError('expected --devices only with an MXNet pair (%s), '
                                  'found an ONNX model %s' % (SYMBOL_SUFFIX, path))
        return OnnxPredictor(path, table)
    if path.endswith(SYMBOL_SUFFIX):
        return MXNetPredictor.from_files(path, devices=devices)
    raise ModelFileError('expected a model file ending in %s or %s, found %s'
                         % (ONNX_SUFFIX, SYMBOL_SUFFIX, path))

