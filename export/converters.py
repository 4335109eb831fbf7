"""What MXNet 1.9.1's ONNX converter lacks, added through its own registry, and
the context every conversion here runs in.

MXNet's converter (``mxnet.onnx.mx2onnx``) maps each op of a symbol to ONNX
nodes with the function registered for it in ``MXNetGraph.registry_``
(``@mx_op.register(op, opset)``; the newest registration at or below the
requested opset wins). This module

* registers, at :data:`OPSET` (13, the opset the export declares), a
  ``GroupNorm`` converter (MXNet has none), a ``BatchNorm`` converter that
  honours ``fix_gamma`` (MXNet's reads the stored gamma), and ``Convolution`` and
  ``Pooling`` converters that also take the 1-D layout
  ``NCW`` of Gluon's ``Conv1D``, ``MaxPool1D``, ``AvgPool1D``,
  ``GlobalMaxPool1D`` and ``GlobalAvgPool1D`` (MXNet's converters refuse any
  layout but ``NCHW`` and ``NCDHW``; ONNX's ``Conv``, ``MaxPool``,
  ``AveragePool`` and the global pools take ``(N, C, W)`` as they are).
  Every other layout is handed to MXNet's own converter unchanged;
* provides :func:`conversion_context`, in which MXNet's final
  ``onnx.checker.check_graph`` checks the graph against the opset and IR
  version the model declares. MXNet calls it without a checker context, so
  onnx checks against its own newest opset (19 for onnx 1.14), where
  ``ReduceMean`` and its kin no longer take an ``axes`` attribute: every
  graph with a ``LayerNorm``, a ``mean`` or a ``max`` reduction failed with
  ``Unrecognized attribute: axes for operator ReduceMean`` although it is
  valid at opset 13. The same context turns a converter's refusal into one
  line naming the op and the block it belongs to;
* registers, at :data:`OPSET`, the converter of the weights (``null``
  nodes) that MXNet's converter runs inside :func:`conversion_context`: there
  MXNet's ``convert_weights_to_numpy`` copied every parameter to numpy up
  front and its ``null`` converter copied each again into a Python list of
  floats (about 32 bytes a value) for ``make_tensor``: the export of
  BERT-base (438 MB of weights) peaked at 3.35 GB there. Here each weight
  becomes an initializer of its name, type and shape only, checked without
  its values, and :func:`fill_weights` writes the values into the finished
  model, one weight at a time. Outside the context MXNet's own converter
  runs.

References: MXNet 1.9.1 ``python/mxnet/onnx/mx2onnx/_export_onnx.py``
(``MXNetGraph.register``, ``convert_layer``, ``create_onnx_graph_proto``) and
``_op_translations/_op_translations_opset12.py`` (``convert_convolution``,
``convert_pooling``); ONNX's ``InstanceNormalization`` for GroupNorm.
"""
from collections.abc import Mapping
import contextlib
import copy
import re
import threading

from mxnet.onnx.mx2onnx._export_onnx import MXNetGraph
from mxnet.onnx.mx2onnx._op_translations import _op_translations_opset12 as _mx12
import numpy as np
import onnx
import onnx.checker
from onnx.helper import make_node

from mp_symbolic.core.graph.ir import Node, PlacedGraph
from mp_symbolic.core.graph.names import DATA_NAME, GROUP_ATTR

from .errors import ExportError
from .inference import batch_axes

__all__ = []

OPSET = 13  # the opset the export declares (export.onnx_export.ONNX_OPSET)
_ONE_D = 'NCW'
# Lowest MXNet translations used: the opset-12 table is the fallback for 13.
_LOWEST_OPSET = 12
_lock = threading.Lock()
# MXNet's converters that read an initializer's values (scalar_op_helper folds
# the scalar into a weight read directly): its values are written before they run.
_READS_WEIGHT_VALUES = ('_mul_scalar', '_minus_scalar', '_rminus_scalar', '_plus_scalar',
                        '_div_scalar', '_rdiv_scalar', '_power_scalar')


def _as_2d_layout_call(convert):
    """A converter that hands an ``NCW`` node to ``convert`` as if it were
    ``NCHW``: MXNet's ``convert_convolution`` and ``convert_pooling`` build
    their ONNX attributes from the kernel, stride, pad and dilation tuples,
    whose length (1 here) is what ONNX reads the spatial rank from; the
    layout string only gates them."""
    def converter(node, **kwargs):
        attrs = node.get('attrs', {})
        if attrs.get('layout') == _ONE_D:
            node = copy.deepcopy(node)
            node['attrs']['layout'] = 'NCHW'
        return convert(node, **kwargs)
    converter.__name__ = '%s_ncw' % convert.__name__
    converter.__doc__ = '%s, and the 1-D layout NCW.' % convert.__name__
    return converter


MXNetGraph.register('Convolution', OPSET)(_as_2d_layout_call(_mx12.convert_convolution))
MXNetGraph.register('Pooling', OPSET)(_as_2d_layout_call(_mx12.convert_pooling))


@MXNetGraph.register('BatchNorm', OPSET)
def convert_batchnorm(node, **kwargs):
    """MXNet's ``BatchNorm`` converter, with ``fix_gamma`` honoured.

    With ``fix_gamma=True`` (Gluon's ``BatchNorm(scale=False)``, and
    ``mx.sym.BatchNorm``'s default) MXNet computes with a gamma of ones
    whatever the stored gamma holds (weight decay moves it off 1); MXNet's
    converter passes the stored gamma. Here the node reads ones instead.
    """
    nodes = _mx12.convert_batchnorm(node, **kwargs)
    if node.get('attrs', {}).get('fix_gamma', 'True') not in ('True', 'true', '1'):
        return nodes
    norm = nodes[-1]
    gamma = kwargs['weights'].get(norm.input[1])
    if gamma is None:
        raise NotImplementedError('fix_gamma=True with a gamma that is not a parameter')
    ones = norm.name + '_fixed_gamma'
    _mx12.create_tensor(np.ones(gamma.shape), ones, kwargs['initializer'], dtype=gamma.dtype)
    norm.input[1] = ones
    return nodes


@MXNetGraph.register('GroupNorm', OPSET)
def convert_group_norm(node, **kwargs):
    """MXNet's ``GroupNorm`` (Gluon's ``GroupNorm``) as ONNX nodes.

    MXNet 1.9.1 normalises each of the ``num_groups`` groups of channels of
    a sample over its channels and positions (biased variance, ``eps``
    inside the square root), then scales and shifts it by the group's
    ``gamma`` and ``beta`` (both of shape ``(num_groups,)``). That is ONNX's
    ``InstanceNormalization`` on the input reshaped to ``(N, num_groups,
    -1)``, reshaped back.
    """
    name, (data, gamma, beta), attrs = _mx12.get_inputs(node, kwargs)
    groups = int(attrs.get('num_groups', 1))
    eps = float(attrs.get('eps', 1e-5))
    _mx12.create_tensor([0, groups, -1], name + '_grouped_shape', kwargs['initializer'])
    return [
        make_node('Shape', [data], [name + '_shape']),
        make_node('Reshape', [data, name + '_grouped_shape'], [name + '_grouped']),
        make_node('InstanceNormalization', [name + '_grouped', gamma, beta],
                  [name + '_normed'], epsilon=eps),
        make_node('Reshape', [name + '_normed', name + '_shape'], [name], name=name),
    ]


class Weights(Mapping):
    """The ``weights`` MXNet's converters read (name -> numpy array), each
    copied from its NDArray when read and not kept, in place of the dict of
    numpy copies MXNet's ``convert_weights_to_numpy`` makes up front.

    Attributes:
        params: Name -> NDArray, as given to the converter.
        deferred: Names of the initializers the ``null`` converter made
            without their values (:func:`fill_weights` writes them).
    """

    def __init__(self, params):
        self.params = {k.replace('arg:', '').replace('aux:', ''): v for k, v in params.items()}
        self.deferred = set()

    def __getitem__(self, name):
        return self.params[name].asnumpy()

    def __iter__(self):
        return iter(self.params)

    def __len__(self):
        return len(self.params)


@MXNetGraph.register('null', OPSET)
def convert_weights_and_inputs(node, **kwargs):
    """MXNet's ``null`` converter; a weight read through :class:`Weights`
    becomes an initializer of its name, type and shape, its values left for
    :func:`fill_weights`."""
    weights = kwargs.get('weights')
    if kwargs.get('is_input') or not isinstance(weights, Weights):
        return _mx12.convert_weights_and_inputs(node, **kwargs)
    name = node['name']
    value = weights.params[name]
    dtype = np.dtype(value.dtype)
    data_type = onnx.helper.np_dtype_to_tensor_dtype(dtype)
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=value.shape)
    kwargs['initializer'].append(tensor)
    weights.deferred.add(name)
    return [onnx.helper.make_tensor_value_info(name, data_type, value.shape)], (dtype,)


def fill_weights(tensors, weights, names=None):
    """Writes the values of the initializers among ``tensors`` (a graph's
    ``initializer`` field, or a list) that :class:`Weights` left without
    them, one weight at a time, as raw little-endian data; ``names``: only
    those."""
    for tensor in tensors:
        if tensor.name in weights.deferred and (names is None or tensor.name in names):
            value = weights[tensor.name]
            tensor.raw_data = np.ascontiguousarray(
                value, dtype=value.dtype.newbyteorder('<')).tobytes()
            weights.deferred.discard(tensor.name)
            del value


def has_translation(op, opset=OPSET):
    """Whether MXNet's converter (with the converters above) has a function
    for ``op`` at ``opset`` or below."""
    return any(op in MXNetGraph.registry_.get(version, {})
               for version in range(opset, _LOWEST_OPSET - 1, -1))


def block_of(node_name, op=None):
    """The Gluon block an op node comes from: its name without the op's own
    part (Gluon names ops ``<block prefix><op>``, e.g. ``conv0_fwd`` of
    ``conv0``, ``pipeline_mean0_mean0`` of ``pipeline_mean0``, and
    ``yolov30_box_nms0`` of ``yolov30`` for op ``_contrib_box_nms``)."""
    if op:
        short = op[len('_contrib_'):] if op.startswith('_contrib_') else op
        match = re.match(r'^(.+)_%s\d*$' % re.escape(short), node_name)
        if match:
            return match.group(1)
    head, sep, _ = node_name.rpartition('_')
    return head if sep and head else node_name


def refusal(op, node, reason):
    """The one-line error for an op that cannot be exported (``node``: a
    typed node, :class:`~mp_symbolic.core.graph.ir.Node`, or the JSON node MXNet's
    converter hands a translation)."""
    if isinstance(node, Node):
        group, name = node.group, node.name
    else:
        group, name = node.get('attrs', {}).get(GROUP_ATTR), node['name']
    return ExportError('cannot export op %s of block %s%s: %s'
                       % (op, block_of(name, op), ' (%s)' % group if group else '', reason))


def _input_shape(shapes, graph, entry):
    """Shape of the tensor a node input ``(node, output, ...)`` of ``graph`` reads."""
    source = graph.source(entry)
    if source.is_variable:
        return shapes.get(source.name)
    return shapes.get('%s_output' % source.name,
                      shapes.get('%s_output%d' % (source.name, entry[1])))


def check_translations(symbol, arg_shapes, sample_shape, opset=OPSET):
    """Raises for the first op MXNet's converter cannot translate.

    That is an op with no converter function at ``opset``, or a known gap
    where MXNet's converter would write a graph that onnxruntime rejects: its
    ``RNN`` converter with ``num_layers=2`` reads the first layer's weights as
    if the input size were the hidden size.

    Args:
        symbol: The inference symbol.
        arg_shapes: Argument and auxiliary state name -> shape.
        sample_shape: One input sample's shape (batch left out), or
            ``{input name: shape}``.

    Raises:
        ExportError: one line naming the op, its block and its stage.
    """
    graph = PlacedGraph.from_symbol(symbol)
    for node in graph.ops:
        if not has_translation(node.op, opset):
            raise refusal(node.op, node, "MXNet's ONNX converter has no translation for it")
    for node in graph.ops:
        attrs = node.attrs
        if node.op == '_contrib_box_nms' and int(attrs.get('id_index', '-1')) != -1 and \
                attrs.get('force_suppress', 'False') in ('False', 'false', '0'):
            # ONNX's NonMaxSuppression has no classes: MXNet's converter
            # suppresses across them and only logs a warning (YOLOv3: other
            # boxes and ids in onnxruntime than in MXNet).
            raise refusal(node.op, node, "MXNet's ONNX converter suppresses boxes across "
                          'classes (ONNX NonMaxSuppression has none), found force_suppress=%s, '
                          'id_index=%s' % (attrs.get('force_suppress', 'False'),
                                           attrs.get('id_index', '-1')))
    rnns = [node for node in graph.ops if node.op == 'RNN'
            and int(node.attrs.get('num_layers', '1')) > 1]
    if not rnns:
        return
    internals = symbol.get_internals()
    known = {name: shape for name, shape in arg_shapes.items()
             if name in internals.list_inputs()}
    inputs = sample_shape if isinstance(sample_shape, dict) else {DATA_NAME: sample_shape}
    axes = batch_axes(symbol)  # a batch of one on each input's batch axis
    known.update({name: tuple(shape)[:axes.get(name, 0)] + (1,) + tuple(shape)[axes.get(name, 0):]
                  for name, shape in inputs.items()})
    _, out_shapes, _ = internals.infer_shape_partial(**known)
    shapes = dict(zip(internals.list_outputs(), out_shapes))
    for node in rnns:
        data_shape = _input_shape(shapes, graph, node.inputs[0])  # (T, N, C)
        hidden = int(node.attrs['state_size'])
        if data_shape and data_shape[-1] != hidden:
            raise refusal('RNN', node, "MXNet's ONNX converter handles num_layers=%s only with "
                          'an input size equal to the hidden size, found input size %d, '
                          'hidden size %d' % (node.attrs['num_layers'], data_shape[-1],
                                              hidden))


def _check_graph_at(opset, ir_version, state=None):
    """onnx's ``check_graph`` at ``opset`` and ``ir_version``; the
    initializers ``state.weights`` left without values (graph inputs as
    well, in MXNet's graph) are left out of it, their values being
    checked in the finished model."""
    context = onnx.checker.C.CheckerContext()
    context.ir_version = ir_version
    context.opset_imports = {'': opset}

    def check_graph(graph, ctx=None):
        weights = getattr(state, 'weights', None)
        if weights is not None and weights.deferred:
            light = onnx.GraphProto()
            light.CopyFrom(graph)  # small: the weights hold no values yet
            kept = [t for t in light.initializer if t.name not in weights.deferred]
            del light.initializer[:]
            light.initializer.extend(kept)
            graph = light
        onnx.checker.C.check_graph(graph.SerializeToString(), ctx or context)
    return check_graph


class _Conversion:
    """What :func:`conversion_context` yields: ``weights``, the
    :class:`Weights` of the conversion (``None`` until it starts)."""
    weights = None


@contextlib.contextmanager
def conversion_context(opset, ir_version):
    """Around ``MXNetGraph().create_onnx_graph_proto(...)``: its graph check
    at ``opset`` and ``ir_version``, and each converter's refusal
    (``NotImplementedError``, ``AttributeError``, ``AssertionError``) as an
    :class:`ExportError` naming the op and its block.

    Its weights are read through :class:`Weights` (the initializers of
    parameters hold no values until :func:`fill_weights` writes them into
    the finished graph: ``with conversion_context(...) as conversion``, then
    ``fill_weights(model.graph.initializer, conversion.weights)``), except
    where a converter reads them (MXNet's scalar ops on a weight).

    The three library functions are replaced for the duration only, under a
    lock, and restored even when the conversion fails.
    """
    convert_layer = MXNetGraph.__dict__['convert_layer']
    to_numpy = MXNetGraph.__dict__['convert_weights_to_numpy']
    check_graph = onnx.checker.check_graph
    state = _Conversion()

    def lazily(params):
        state.weights = Weights(params)
        return state.weights

    def converting(node, **kwargs):
        try:
            if node['op'] in _READS_WEIGHT_VALUES and isinstance(kwargs.get('weights'), Weights):
                _, inputs, _ = _mx12.get_inputs(node, kwargs)
                fill_weights(kwargs['initializer'], kwargs['weights'], set(inputs))
            return convert_layer.__func__(node, **kwargs)
        except (NotImplementedError, AttributeError, AssertionError) as err:
            reason = ' '.join(str(err).split()) or type(err).__name__
            raise refusal(node['op'], node, "MXNet's ONNX converter refused it (%s)"
                          % reason) from None

    with _lock:
        MXNetGraph.convert_layer = staticmethod(converting)
        MXNetGraph.convert_weights_to_numpy = staticmethod(lazily)
        onnx.checker.check_graph = _check_graph_at(opset, ir_version, state)
        try:
            yield state
        finally:
            MXNetGraph.convert_layer = convert_layer
            MXNetGraph.convert_weights_to_numpy = to_numpy
            onnx.checker.check_graph = check_graph
