"""The exported model in its two deployment runtimes, behind one interface.

* :class:`MXNetPredictor` binds the ``-symbol.json`` / ``.params`` pair with
  ``simple_bind(group2ctx=...)``: MXNet places every op and every argument
  array by the ``ctx_group`` attribute kept in the file, on devices chosen at
  load time through :func:`mp_symbolic.core.devices.make_plan`.
* :class:`OnnxPredictor` runs the ``.onnx`` file in onnxruntime.

Both take a float32 ``(samples, features)`` array and return
``(samples, outputs)``; :func:`load_predictor` picks one by file name. A file
that is not what its name says, or a model that fails while it runs, raises
:class:`~export.errors.ModelFileError` naming the file; messages quote at
most a short excerpt of what the file holds.
"""
import glob
import json
import os
import re

import mxnet as mx
import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from mp_symbolic.tools.checkpoint import CheckpointError, load_checkpoint
from mp_symbolic.core.pipeline import DATA_NAME
from mp_symbolic.core.compat import split_bind
from mp_symbolic.core.devices import DeviceSpecError, make_plan
from mp_symbolic.tools.files import what_is
from mp_symbolic.tools.store import check_committed_file

from .errors import (InputError, ModelFileError, describe_start, describe_undecodable, excerpt,
                     library_message)
from .inference import features, inference_graph, sample_shape, stage_layout

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
_MAX_GRAPH_DEPTH = 4000
# MXNet's JSON reader quotes the file where it stopped: "around ^`...`".
_MXNET_QUOTE_RE = re.compile(r',?\s*around \^`.*`', re.S)


def _check_batch(X, shape, dynamic_axes=()):
    """``(samples, features)`` or ``(samples,) + shape`` -> ``(samples,) + shape``
    float32; the input axes in ``dynamic_axes`` (axis 1: the first after the
    batch) may have any size."""
    X = np.asarray(X)
    width = features(shape)
    if dynamic_axes and X.ndim == len(shape) + 1 and all(
            X.shape[i + 1] == d or (i + 1 in dynamic_axes and X.shape[i + 1] >= 1)
            for i, d in enumerate(shape)):
        return np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim == 2 and X.shape[1] == width:
        X = X.reshape((len(X),) + tuple(shape))
    elif X.shape[1:] != tuple(shape):
        raise InputError('expected an array of shape (samples, %d)%s, found shape %s'
                         % (width, '' if len(shape) == 1 else ' or (samples,) + %s'
                            % (tuple(shape),), X.shape))
    return np.ascontiguousarray(X, dtype=np.float32)


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
        ModelFileError: the file is unreadable, binary, not JSON, or JSON
            without MXNet's ``nodes``, ``arg_nodes`` and ``heads`` lists.
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
    aux = set(symbol.list_auxiliary_states())
    nodes = json.loads(symbol.tojson())['nodes']
    for node in nodes:
        group = node.get('attrs', {}).get('__ctx_group__')
        for edge in node['inputs']:
            state = nodes[edge[0]]
            if state['name'] in aux and state.get('attrs', {}).get('__ctx_group__') != group:
                raise ModelFileError(
                    '%s: expected the state %s of %s %s on its op\'s device group %s, found it '
                    'in %s' % (where, excerpt(state['name'], 60), node['op'],
                               excerpt(node['name'], 60), group,
                               state.get('attrs', {}).get('__ctx_group__')))


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
        dynamic_axes: Input axes (1: the first after the batch) whose size
            may differ from ``shape``; the graph is bound again for each
            new input shape.

    Attributes:
        group2ctx: ``{'stage0': ctx, ...}`` as passed to ``simple_bind``.
        note: A line saying which default devices were chosen, or ``None``.
        path, params_path: The files, if loaded with :meth:`from_files`.

    Raises:
        ExportError: the symbol lacks ``ctx_group`` attributes or has no
            ``data`` input.
        DeviceSpecError: ``devices`` cannot be mapped onto the groups.
    """

    def __init__(self, symbol, arg_params, aux_params=None, devices=None, shape=None,
                 dynamic_axes=()):
        self.symbol = inference_graph(symbol)
        self.dynamic_axes = tuple(dynamic_axes)  # input axes that may take any size
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
        self.sample_shape = sample_shape(self.symbol, self.arg_params, shape)
        self.input_width = features(self.sample_shape)
        self.path = None  # the symbol file, when loaded by from_files
        self.params_path = None  # and its params file
        self._exec = None

    @classmethod
    def from_files(cls, sym_path, params_path=None, devices=None, shape=None, dynamic_axes=()):
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
        try:
            symbol, arg_params, aux_params = load_checkpoint(sym_path, params_path)
        except CheckpointError as err:
            raise CheckpointError(library_message(_MXNET_QUOTE_RE.sub('', str(err)), 300)) from None
        _check_states_beside_their_ops(symbol, sym_path)  # the message names the file
        predictor = cls(symbol, arg_params, aux_params, devices, shape, dynamic_axes)
        predictor.path, predictor.params_path = sym_path, params_path
        return predictor

    def bind(self, batch_size, sample_shape=None):
        """The executor for ``batch_size`` samples of ``sample_shape`` (by
        default the model's; the last executor is reused)."""
        shape = (batch_size,) + tuple(sample_shape or self.sample_shape)
        if self._exec is None or self._exec.arg_dict[DATA_NAME].shape != shape:
            data_ctx = self.group2ctx[self.symbol.get_internals()[DATA_NAME].attr('ctx_group')]
            with split_bind(self.group2ctx):
                self._exec = self.symbol.simple_bind(
                    ctx=data_ctx, group2ctx=self.group2ctx, grad_req='null',
                    **{DATA_NAME: shape})
            for name, value in self.arg_params.items():
                value.copyto(self._exec.arg_dict[name])
            for name, value in self.aux_params.items():
                value.copyto(self._exec.aux_dict[name])
        return self._exec

    def placement(self):
        """``{argument name: context}`` of the current executor, as MXNet reports it."""
        if self._exec is None:
            self.bind(1)
        return {name: array.context for name, array in self._exec.arg_dict.items()}

    def predict(self, X):
        """``(samples, features)`` -> ``(samples, outputs)`` float32 numpy array.

        Raises:
            InputError: ``X`` is not ``(samples, input_width)``.
            ModelFileError: MXNet fails to run the graph.
        """
        X = _check_batch(X, self.sample_shape, self.dynamic_axes)
        try:
            executor = self.bind(len(X), X.shape[1:])
            executor.forward(is_train=False, **{DATA_NAME: X})
            return executor.outputs[0].asnumpy()
        except (mx.base.MXNetError, RuntimeError) as err:  # simple_bind wraps its errors
            raise ModelFileError('%s failed in MXNet on a batch of %d samples: %s' % (
                self.path or 'the graph', len(X), library_message(err))) from None


class OnnxPredictor:
    """An ``.onnx`` file in an onnxruntime CPU session.

    A model whose batch dimension is fixed (say to 1) is run in batches of
    that size; the number of samples must be a multiple of it.

    An input axis besides the batch may be dynamic too (``python -m export
    --dynamic 1=seq``): ``sample_shape`` then gives the size the graph was
    traced at (the ``sample_shape`` metadata), inputs may have any size along
    it, and the output may have more than two dimensions.

    Attributes:
        batch_size: The fixed batch size, or ``None`` if any is accepted.
        dynamic_axes: Input axes (1: the first after the batch) of any size.

    Raises:
        ModelFileError: the file is missing, not a model onnxruntime can
            load, or not one float32 input of shape (batch, features) with a
            fixed feature count (or dynamic axes and their traced sizes) and
            a 2-D first output (any, with dynamic axes).
    """

    def __init__(self, path):
        if not os.path.isfile(path):
            raise ModelFileError('expected an ONNX model file at %s, found %s'
                                 % (path, what_is(path, 'none')))
        self.path = path
        try:
            with open(path, 'rb') as f:
                data = f.read()  # onnxruntime reads it whole too; its path may not be UTF-8
            self.session = ort.InferenceSession(data, providers=['CPUExecutionProvider'])
        except OSError as err:
            raise ModelFileError('%s is not a readable file: %s'
                                 % (path, err.strerror or err)) from None
        except _ORT_ERRORS as err:
            raise ModelFileError('%s is not a loadable ONNX model: %s'
                                 % (path, _ort_message(err))) from None
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        # axes after the batch that a name makes dynamic, sized as traced
        traced = self.session.get_modelmeta().custom_metadata_map.get('sample_shape')
        dims = list(inputs[0].shape[1:]) if inputs else []
        self.dynamic_axes = tuple(i + 1 for i, d in enumerate(dims) if not isinstance(d, int))
        if self.dynamic_axes and traced:
            try:
                traced = [int(d) for d in json.loads(traced)]
            except (ValueError, TypeError):
                traced = []
            if len(traced) == len(dims):
                dims = [d if isinstance(d, int) else t for d, t in zip(dims, traced)]
        if len(inputs) != 1 or len(inputs[0].shape) < 2 or not all(
                isinstance(d, int) for d in dims):
            raise ModelFileError('%s: expected one input of shape (batch, ...) with fixed '
                                 'per-sample dimensions, found %s' % (path, _describe_args(inputs)))
        if inputs[0].type != 'tensor(float)':
            raise ModelFileError('%s: expected a float32 input (tensor(float)), found %s'
                                 % (path, _describe_args(inputs)))
        if len(outputs[0].shape) != 2 and not self.dynamic_axes:
            raise ModelFileError('%s: expected its first output to be of shape (batch, outputs), '
                                 'found %s' % (path, _describe_args(outputs[:1])))
        self.input_name = inputs[0].name
        self.sample_shape = tuple(dims)
        self.input_width = features(self.sample_shape)
        self.output_width = outputs[0].shape[1] if len(outputs[0].shape) == 2 else None
        batch = inputs[0].shape[0]
        self.batch_size = batch if isinstance(batch, int) and batch > 0 else None
        # A failing run is reported by the exception; onnxruntime would also log it.
        self._quiet = ort.RunOptions()
        self._quiet.log_severity_level = 4  # fatal only

    def predict(self, X):
        """``(samples, features)`` -> ``(samples, outputs)`` float32 numpy array.

        Raises:
            InputError: ``X`` is not ``(samples, input_width)``, or its
                samples are not a multiple of a fixed batch size.
            ModelFileError: onnxruntime fails to run the model, or its output
                is not ``(samples, outputs)`` numbers.
        """
        X = _check_batch(X, self.sample_shape, self.dynamic_axes)
        step = self.batch_size or len(X)
        if len(X) % step:
            raise InputError('%s runs batches of exactly %d samples (its input is %s); expected '
                             'a multiple of %d samples, found %d'
                             % (self.path, step, _describe_args(self.session.get_inputs()),
                                step, len(X)))
        return np.concatenate([self._run(X[i:i + step]) for i in range(0, len(X), step)])

    def _run(self, X):
        try:
            Y = self.session.run(None, {self.input_name: X}, self._quiet)[0]
        except _ORT_ERRORS as err:
            raise ModelFileError('%s failed in onnxruntime on a batch of %d samples: %s'
                                 % (self.path, len(X), _ort_message(err))) from None
        Y = np.asarray(Y)
        if (Y.ndim != 2 and not self.dynamic_axes) or len(Y) != len(X) or \
                not np.issubdtype(Y.dtype, np.number):
            raise ModelFileError('%s: expected (%d, outputs) numbers from a batch of %d samples, '
                                 'found %s of shape %s' % (self.path, len(X), len(X), Y.dtype,
                                                           Y.shape))
        return Y.astype(np.float32, copy=False)


def _describe_args(args):
    """``data['batch', 2] tensor(float)``, ...: names and shapes as the file gives them."""
    return excerpt(', '.join('%s%s %s' % (a.name, a.shape, a.type) for a in args), 120)[1:-1]


def _ort_message(err):
    """onnxruntime's message without its status prefix, as one short line."""
    return library_message(_ORT_STATUS_RE.sub('', str(err)))


def load_predictor(path, devices=None):
    """The predictor for an exported file, chosen by its name.

    Args:
        path: ``<name>.onnx``, or ``<name>-symbol.json`` with its params file
            beside it.
        devices: MXNet pair only; see :class:`MXNetPredictor`.

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
        return OnnxPredictor(path)
    if path.endswith(SYMBOL_SUFFIX):
        return MXNetPredictor.from_files(path, devices=devices)
    raise ModelFileError('expected a model file ending in %s or %s, found %s'
                         % (ONNX_SUFFIX, SYMBOL_SUFFIX, path))

