"""The inference graph: the training symbol with its loss heads replaced by
their inference forms, its inputs and their shapes, and the pipeline stages
its ``ctx_group`` attributes describe.

A training graph's outputs may end in one of MXNet's loss heads, which have
no ONNX converter: ``LinearRegressionOutput`` (its forward pass is the
identity), ``SoftmaxOutput`` (softmax) or ``LogisticRegressionOutput``
(sigmoid), or the ops of the ``'log_softmax'`` head (softmax). Each head is
replaced by that form, built under the head's own
``ctx_group``; every other op and variable keeps the attributes it was
trained with, and every output stays an output, in order.

The inputs are named as ``HybridBlock.export`` names them: ``data`` for one
input, ``data0``, ``data1``, ... for several.
"""
from collections import OrderedDict
import ast
import json
import re

import mxnet as mx
from mxnet.ndarray.ndarray import _DTYPE_MX_TO_NP, _DTYPE_NP_TO_MX
import numpy as np

from mp_symbolic.core import kernels
from mp_symbolic.core.base.checks import excerpt
from mp_symbolic.core.base.compat import error_line
from mp_symbolic.core.graph.heads import INFERENCE_FORMS, head_at, inference_of
from mp_symbolic.core.graph.ir import PlacedGraph
from mp_symbolic.core.graph.names import (DATA_NAME, DTYPE_ATTR, DYNAMIC_ATTR,
                                    LAYOUT_ATTR, SHAPE_ATTR, other_output_index, parse_group,
                                    stage_name)

from .errors import ExportError
from .tables import features  # pylint: disable=unused-import  (its home is tables)

__all__ = ['LOSS_HEADS', 'inference_graph', 'network_order', 'stage_layout',
           'input_names', 'sample_shape', 'sample_shapes', 'output_shape',
           'output_shapes', 'parse_shape', 'parse_input_shapes', 'activation_bytes',
           'with_input_dtypes', 'input_dtypes', 'with_dynamic_axes', 'dynamic_axes', 'bindable',
           'input_layouts', 'batch_axes', 'output_batch_axes', 'batch_first', 'as_laid_out']

# MXNet's loss-head ops, each replaced by its inference form.
LOSS_HEADS = tuple(INFERENCE_FORMS)
# Ops that only make sense in a training graph: a graph ending in one cannot be exported.
_TRAINING_ONLY = ('MakeLoss', 'make_loss', 'BlockGrad', 'softmax_cross_entropy')

# Several inputs are data0, data1, ... (HybridBlock.export's names).
_NUMBERED_INPUT_RE = re.compile(r'^%s(\d+)$' % DATA_NAME)


def input_names(symbol):
    """The graph's inputs: ``['data']``, or ``['data0', 'data1', ...]`` in
    number order (MXNet lists arguments in the order the graph reads them)."""
    arguments = symbol.list_arguments()
    numbered = sorted((a for a in arguments if _NUMBERED_INPUT_RE.match(a)),
                      key=lambda a: int(_NUMBERED_INPUT_RE.match(a).group(1)))
    return ([DATA_NAME] if DATA_NAME in arguments else []) + numbered


def _inference_output(output):
    """One output of the training graph as the prediction it stands for."""
    graph = PlacedGraph.from_symbol(output)
    head = graph.output_node(0)
    if head_at(graph, head) is not None:
        with mx.AttrScope(ctx_group=head.group):
            return inference_of(output)
    if head.op == 'BlockGrad':  # an output a loss on another one left without gradient
        return output.get_children()[0]
    if head.op in _TRAINING_ONLY:
        raise ExportError('expected a graph ending in a known loss head (%s) or in its '
                          'prediction, found %s %r: export the prediction symbol instead'
                          % (', '.join(LOSS_HEADS), head.op, head.name))
    return output


def network_order(symbol):
    """Where each of the network's outputs is among ``symbol``'s: output ``k``
    of the network is ``symbol[network_order(symbol)[k]]``.

    A module with its loss on output ``i`` (``pipe.module(loss, output=i)``)
    lists the loss head first and the network's other outputs after it, each
    through a ``BlockGrad`` named by its index (:func:`other_output_name`):
    the head goes back to place ``i``. Other graphs keep their order.
    """
    graph = PlacedGraph.from_symbol(symbol)
    count = len(graph.heads)
    heads = [graph.output_node(i) for i in range(count)]
    others = [other_output_index(h.name) if h.op == 'BlockGrad' else None for h in heads[1:]]
    missing = sorted(set(range(count)) - set(o for o in others if o is not None))
    if not others or None in others or head_at(graph, heads[0]) is None or len(missing) != 1 \
            or sorted(others + missing) != list(range(count)):
        return list(range(count))
    order = [0] * count
    for position, index in enumerate(others, start=1):
        order[index] = position
    return order


def inference_graph(symbol):
    """``symbol`` with every loss head replaced by its inference form
    (unchanged if it has none), and the project's own operators by MXNet's
    (:func:`mp_symbolic.core.kernels.with_mxnet_ops`: a runtime without the
    project's library loads the files).

    Args:
        symbol: A symbol of one or several outputs, as trained or already
            stripped.

    Returns:
        The symbol whose outputs are the predictions, in order, e.g.
        ``layer2_fwd_output`` or ``softmax_out_output``.

    Raises:
        ExportError: an output ends in a training-only op, or the graph
            reads no input named ``data`` (or ``data0``, ``data1``, ...), or
            both kinds.
    """
    graph = PlacedGraph.from_symbol(symbol)
    plain = kernels.with_mxnet_ops(graph)
    if plain is not graph:  # MXNet's ops in place of the project's
        symbol = plain.to_symbol()
    outputs = [_inference_output(symbol[i]) for i in range(len(symbol.list_outputs()))]
    outputs = [outputs[i] for i in network_order(symbol)]
    symbol = outputs[0] if len(outputs) == 1 else mx.sym.Group(outputs)
    inputs = input_names(symbol)
    if not inputs or (DATA_NAME in inputs and len(inputs) > 1):
        raise ExportError("expected the graph to read an input named %r (or inputs %s0, %s1, "
                          "... for several), found inputs %s"
                          % (DATA_NAME, DATA_NAME, DATA_NAME, ', '.join(symbol.list_arguments())))
    return symbol


def stage_layout(symbol):
    """The pipeline stages of ``symbol``, from its ``ctx_group`` attributes.

    Returns:
        ``OrderedDict`` ``{'stage0': {'layers': ['layer0'], 'ops': [...],
        'variables': [...]}, ...}`` in stage order.

    Raises:
        ExportError: a node has no ``ctx_group``, or the groups are not
            ``stage0 .. stage<N-1>``.
    """
    groups = {}
    for node in PlacedGraph.from_symbol(symbol).nodes:
        if node.group is None:
            raise ExportError("expected a ctx_group attribute on every op and variable, "
                              "found none on %s %r" % (node.op, node.name))
        entry = groups.setdefault(node.group, {'layers': [], 'ops': [], 'variables': []})
        if node.is_variable:
            entry['variables'].append(node.name)
        else:
            entry['ops'].append(node.name)
            layer = _layer_of(node.name, entry['layers'])
            if layer not in entry['layers']:
                entry['layers'].append(layer)
    expected = [stage_name(s) for s in range(len(groups))]
    if sorted(groups, key=_stage_key) != expected:
        raise ExportError('expected ctx_group names %s, found %s'
                          % (', '.join(expected), ', '.join(sorted(groups))))
    return OrderedDict((name, groups[name]) for name in expected)


def _layer_of(op_name, known):
    """The layer (block) an op belongs to, from Gluon's naming: a block's ops
    are called ``<prefix><op>`` (``conv0_fwd``, ``dense0_relu_fwd``), so the
    name less its last part, or a known layer it extends."""
    base = op_name.rsplit('_', 1)[0] if '_' in op_name else op_name
    for layer in known:
        if base.startswith(layer + '_'):
            return layer
    return base


def _stage_key(name):
    parsed = parse_group(name)  # an exported graph has no shards: stage<s> alone
    return (0, parsed[0]) if parsed is not None and not parsed[1] else (1, name)


def parse_shape(text, flag='--input-shape'):
    """``'1,8,8'`` or ``'(1, 8, 8)'`` -> ``(1, 8, 8)``.

    Raises:
        ExportError: not positive integers.
    """
    try:
        shape = tuple(int(d) for d in str(text).strip('()[] ').split(',') if d.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise ExportError('%s: expected the shape of one sample as positive '
                          'integers such as 1,8,8, found %s' % (flag, excerpt(repr(text))))
    return shape


def parse_input_shapes(items):
    """``--input-shape`` values -> one sample's shape, or ``{name: shape}``.

    ``['1,8,8']`` (the one input's shape) -> ``(1, 8, 8)``;
    ``['data0=16', 'data1=16', 'data2=']`` -> ``{'data0': (16,), 'data1': (16,),
    'data2': ()}`` (``data2`` holds one number per sample).

    Raises:
        ExportError: a shape is not positive integers, a name is given
            twice, or both forms are mixed.
    """
    named, plain = OrderedDict(), []
    for item in items:
        name, sep, shape = str(item).partition('=')
        if not sep:
            plain.append(parse_shape(item))
            continue
        name = name.strip()
        if not name.isidentifier() or name in named:
            raise ExportError('--input-shape: expected NAME=D1,D2 with a distinct input name '
                              'such as data0=16, found %r' % (item,))
        # NAME= (nothing after it): one number per sample, such as a sequence's length
        named[name] = parse_shape(shape, '--input-shape %s' % name) if shape.strip() else ()
    if plain and (named or len(plain) > 1):
        raise ExportError('--input-shape: expected one D1,D2 shape, or NAME=D1,D2 for each '
                          'input, found %d values: %s' % (len(items), ' '.join(items)))
    return plain[0] if plain else named


def input_layouts(symbol):
    """``{input name: layout}`` of the inputs whose layout the graph records
    (``__layout__``: a Pipeline module records it for an input whose batch
    is not on axis 0, such as ``'TN'`` for ``(T, N)`` tokens)."""
    inputs = set(input_names(symbol))
    found = {}
    for node in PlacedGraph.from_symbol(symbol).variables:
        layout = node.attrs.get(LAYOUT_ATTR)
        if node.name in inputs and isinstance(layout, str) and layout.count('N') == 1:
            found[node.name] = layout
    return found


def batch_axes(symbol):
    """``{input name: its batch axis}``: the ``N`` of its recorded layout
    (:func:`input_layouts`), else 0."""
    layouts = input_layouts(symbol)
    return OrderedDict((name, layouts[name].find('N') if name in layouts else 0)
                       for name in input_names(symbol))


def batch_first(X, axis):
    """``X`` (numpy) with its batch ``axis`` moved to the front."""
    return np.moveaxis(X, axis, 0) if axis else X


def as_laid_out(X, axis):
    """``X`` (numpy, batch first) with its batch moved to ``axis``, as the model lays it out."""
    return np.ascontiguousarray(np.moveaxis(X, 0, axis)) if axis else X


def _with_batch(shape, axis, size):
    shape = tuple(shape)
    return shape[:axis] + (size,) + shape[axis:]


def _recorded_shape(node):
    """The per-sample shape a Pipeline module records on an input
    (``__shape__`` ``(0, 1, 8, 8)``; the 0 at the ``N`` of its recorded
    layout, ``(5, 0)`` for ``'TN'``), or ``None``."""
    attrs = node.attrs
    recorded = attrs.get(SHAPE_ATTR)
    if not recorded:
        return None
    try:
        shape = tuple(ast.literal_eval(recorded))
    except (ValueError, SyntaxError, TypeError):
        return None
    layout = attrs.get(LAYOUT_ATTR)
    axis = layout.find('N') if isinstance(layout, str) and layout.count('N') == 1 else 0
    if len(shape) <= axis or shape[axis] != 0:
        return None
    shape = shape[:axis] + shape[axis + 1:]
    if all(isinstance(d, int) and d > 0 for d in shape):
        return shape  # () for an input of one number per sample, such as a length
    return None


def sample_shapes(symbol, arg_params, given=None):
    """The shape of one sample of each input, batch dimension left out.

    For each input (:func:`input_names`), from, in order: ``given``; the
    ``__shape__`` attribute a Pipeline module records on it
    (``(0, 1, 8, 8)``); for one input, the input width of a
    ``FullyConnected`` layer reading it directly.

    Args:
        given: ``{name: shape}``, or one shape for a graph of one input.

    Returns:
        ``OrderedDict`` ``{input name: shape}`` in input order.

    Raises:
        ExportError: none of these says an input's shape, or ``given``
            names an input the graph does not read.
    """
    inputs = input_names(symbol)
    if given is not None and not isinstance(given, dict):
        if len(inputs) != 1:
            raise ExportError('--input-shape: expected NAME=D1,D2 for each of the inputs %s, '
                              'found one shape %s' % (', '.join(inputs), tuple(given)))
        given = {inputs[0]: tuple(given)}
    given = dict(given or {})
    unknown = sorted(set(given) - set(inputs))
    if unknown:
        raise ExportError('--input-shape: expected the names of the inputs (%s), found %s'
                          % (', '.join(inputs), ', '.join(unknown)))
    graph = PlacedGraph.from_symbol(symbol)
    ids = {n.name: n.index for n in graph.variables}
    layouts = input_layouts(symbol)
    shapes = OrderedDict()
    missing = []
    for name in inputs:
        shape = given[name] if name in given else _recorded_shape(graph.nodes[ids[name]])
        if shape is None and len(inputs) == 1:
            shape = _dense_width(graph, ids[name], arg_params)
        if shape is None:
            missing.append(name)
            continue
        shapes[name] = tuple(int(d) for d in shape)
    if missing and any(name in layouts for name in missing):
        raise ExportError('expected the per-sample shapes of %s recorded, found none: give '
                          'each with --input-shape NAME=SHAPE, its shape without the batch '
                          'axis N of its layout (e.g. --input-shape %s=%s), or --sample '
                          'FILE.npz holding each input as its layout lays it out'
                          % (', '.join('%s (layout %s)' % (n, layouts[n]) if n in layouts
                                       else '%s (batch first)' % n for n in missing),
                             missing[0], ','.join(
                                 '8' for _ in range(max(len(layouts.get(missing[0], 'NC'))
                                                        - 1, 1)))))
    if missing:
        name = missing[0]
        raise ExportError('expected the per-sample input shape recorded on %r (a Pipeline '
                          'module checkpoint records it), found none: give it with '
                          '--input-shape, e.g. --input-shape %s1,8,8 (or --sample FILE.npz)'
                          % (name, '' if len(inputs) == 1 else name + '='))
    return shapes


def _dense_width(graph, data_id, arg_params):
    for node in graph.ops:
        inputs = [entry.node for entry in node.inputs]
        if node.op == 'FullyConnected' and inputs and inputs[0] == data_id:
            weight = graph.nodes[inputs[1]].name
            if weight in arg_params and len(arg_params[weight].shape) == 2:
                return (int(arg_params[weight].shape[1]),)
    return None


def sample_shape(symbol, arg_params, given=None):
    """The shape of one sample of a graph of one input (see :func:`sample_shapes`).

    Raises:
        ExportError: the graph has several inputs, or its shape is unknown.
    """
    shapes = sample_shapes(symbol, arg_params, given)
    if len(shapes) != 1:
        raise ExportError('expected a graph of one input, found %d: %s'
                          % (len(shapes), ', '.join(shapes)))
    return next(iter(shapes.values()))


def _known_shapes(symbol, arg_params, aux_params):
    shapes = {name: value.shape for name, value in arg_params.items()
              if name in symbol.list_arguments()}
    shapes.update({name: value.shape for name, value in aux_params.items()
                   if name in symbol.list_auxiliary_states()})
    return shapes


def _batched(shapes, batch_size=1, axes=None):
    """``{input name: shape}`` of a batch of ``batch_size``, each on its batch
    axis (``axes``: ``{input name: axis}``, 0 where not given)."""
    if not isinstance(shapes, dict):  # one input's shape
        shapes = {DATA_NAME: shapes}
    axes = axes or {}
    return {name: _with_batch(shape, axes.get(name, 0), batch_size)
            for name, shape in shapes.items()}


def output_batch_axes(symbol, arg_params, aux_params, shapes):
    """The batch axis of each output: the axis whose size doubles from a
    batch of 1 to one of 2 (inputs on their :func:`batch_axes`), 0 for an
    output whose size does not follow the batch.

    Raises:
        ExportError: the arrays and ``shapes`` do not fit the graph.
    """
    axes = batch_axes(symbol)
    known = _known_shapes(symbol, arg_params, aux_params)
    found = []
    for batch_size in (1, 2):
        try:
            _, out_shapes, _ = symbol.infer_shape(**_batched(shapes, batch_size, axes), **known)
        except mx.base.MXNetError as err:
            raise ExportError('the arrays do not fit together with inputs of shape %s: %s'
                              % (_describe_shapes(shapes), error_line(err))) from None
        found.append(out_shapes)
    result = []
    for one, two in zip(*found):
        grown = [i for i, (a, b) in enumerate(zip(one, two)) if b == 2 * a and a]
        result.append(grown[0] if grown else 0)
    return result


def output_shapes(symbol, arg_params, aux_params, shapes):
    """Shape of one sample of each output, from MXNet's shape inference:
    each output's batch axis (:func:`output_batch_axes`) left out.

    Args:
        shapes: ``{input name: per-sample shape}`` (or one shape, for ``data``).

    Raises:
        ExportError: the arrays and ``shapes`` do not fit the graph.
    """
    try:
        _, out_shapes, _ = symbol.infer_shape(**_batched(shapes, 1, batch_axes(symbol)),
                                              **_known_shapes(symbol, arg_params, aux_params))
    except mx.base.MXNetError as err:
        raise ExportError('the arrays do not fit together with inputs of shape %s: %s'
                          % (_describe_shapes(shapes), error_line(err))) from None
    out_axes = output_batch_axes(symbol, arg_params, aux_params, shapes) \
        if any(batch_axes(symbol).values()) else [0] * len(out_shapes)
    return [tuple(int(d) for i, d in enumerate(out) if i != axis)
            for out, axis in zip(out_shapes, out_axes)]


def output_shape(symbol, arg_params, aux_params, shape):
    """Shape of one sample of the first output (see :func:`output_shapes`)."""
    return output_shapes(symbol, arg_params, aux_params, shape)[0]


def _describe_shapes(shapes):
    if not isinstance(shapes, dict):
        return str(tuple(shapes))
    if list(shapes) == [DATA_NAME]:
        return str(tuple(shapes[DATA_NAME]))
    return ', '.join('%s %s' % (name, tuple(shape)) for name, shape in shapes.items())


def with_input_dtypes(symbol, dtypes):
    """``symbol`` with each input's dtype of ``dtypes`` other than float32
    recorded as MXNet records ``mx.sym.var(name, dtype=...)`` (``__dtype__``),
    so that the pair binds with it again."""
    graph = PlacedGraph.from_symbol(symbol)
    nodes = []
    for node in graph.nodes:
        dtype = np.dtype(dtypes.get(node.name, np.float32)) if node.is_variable else None
        if dtype is not None and dtype != np.float32:
            node = node.but(attrs=dict(node.attrs, **{
                DTYPE_ATTR: str(_DTYPE_NP_TO_MX[dtype.type])}))
        nodes.append(node)
    return graph.but(nodes).to_symbol()


def with_dynamic_axes(symbol, spec):
    """``symbol`` with each input's dynamic axes (``{input name: {axis:
    name}}``) recorded on its variable (``__dynamic_axes__``, JSON), so that
    the pair binds at other sizes of them again (:func:`dynamic_axes`)."""
    graph = PlacedGraph.from_symbol(symbol)
    return graph.but([node.but(attrs=dict(node.attrs, **{DYNAMIC_ATTR: json.dumps(
        {str(axis): name for axis, name in spec[node.name].items()}, sort_keys=True)}))
                      if node.is_variable and node.name in spec else node
                      for node in graph.nodes]).to_symbol()


def bindable(symbol):
    """``symbol`` without the attributes the export records for itself
    (:data:`~mp_symbolic.core.graph.names.DYNAMIC_ATTR`), which MXNet reads none
    of: the graph to bind; ``symbol`` itself where it has none."""
    graph = PlacedGraph.from_symbol(symbol)
    if not any(DYNAMIC_ATTR in n.attrs for n in graph.nodes):
        return symbol
    return graph.but([n.but(attrs={k: v for k, v in n.attrs.items() if k != DYNAMIC_ATTR})
                      for n in graph.nodes]).to_symbol()


def dynamic_axes(symbol):
    """``{input name: {axis: name}}`` as :func:`with_dynamic_axes` recorded
    it (empty for a pair exported without ``--dynamic``; a record that is
    not ``{axis: name}`` is ignored)."""
    attrs = symbol.attr_dict()
    found = OrderedDict()
    for name in input_names(symbol):
        try:
            record = json.loads(attrs.get(name, {}).get(DYNAMIC_ATTR, '{}'))
            axes = {int(axis): str(dim) for axis, dim in record.items()}
        except (ValueError, TypeError, AttributeError, RecursionError):
            continue
        if axes:
            found[name] = dict(sorted(axes.items()))
    return found


def input_dtypes(symbol):
    """``{input name: numpy dtype}`` of each input, float32 unless recorded."""
    attrs = symbol.attr_dict()
    found = {}
    for name in input_names(symbol):
        code = attrs.get(name, {}).get(DTYPE_ATTR)
        found[name] = np.dtype(_DTYPE_MX_TO_NP.get(int(code), np.float32)
                               if code and code.lstrip('-').isdigit() else np.float32)
    return found


def activation_bytes(symbol, arg_params, aux_params, shapes, dtypes=None):
    """Bytes of every op's outputs per sample, by MXNet's shape inference.

    What the internal outputs (less the parameters and the inputs) grow by
    from a batch of 1 to a batch of 2: what an executor would allocate per
    sample if it shared no memory between ops, so an upper bound of a
    batch's activations per sample (executors and onnxruntime reuse
    buffers). An output whose size does not follow the batch, computed from
    the parameters alone (the weights a tensor-parallel layer reassembles
    from its shards: 256 MB of BERT-base's 382 MB at a batch of 1), is there
    once whatever the batch, so it is not counted.

    Raises:
        ExportError: the arrays and ``shapes`` do not fit the graph.
    """
    internals = symbol.get_internals()
    known = _known_shapes(symbol, arg_params, aux_params)
    variables = set(symbol.list_arguments()) | set(symbol.list_auxiliary_states())
    totals = []
    for batch_size in (1, 2):
        try:
            _, out_shapes, _ = internals.infer_shape_partial(
                **_batched(shapes, batch_size, batch_axes(symbol)), **known)
            _, out_types, _ = internals.infer_type_partial(**{
                name: np.dtype((dtypes or {}).get(name, np.float32))
                for name in _batched(shapes)})
        except mx.base.MXNetError as err:
            raise ExportError('the arrays do not fit together with inputs of shape %s: %s'
                              % (_describe_shapes(shapes), error_line(err))) from None
        totals.append({name: int(np.prod(shape)) * (np.dtype(dtype).itemsize
                                                      if dtype is not None else 4)
                       for name, shape, dtype in zip(internals.list_outputs(), out_shapes,
                                                     out_types)
                       if name not in variables and shape})
    one, two = totals
    return sum(max(0, two.get(name, 0) - size) for name, size in one.items())
