"""The inference graph: the training symbol with its loss head replaced by
the head's inference form, and the pipeline stages its ``ctx_group``
attributes describe.

A training graph ends in one of MXNet's loss heads, which have no ONNX
converter: ``LinearRegressionOutput`` (its forward pass is the identity),
``SoftmaxOutput`` (softmax) or ``LogisticRegressionOutput`` (sigmoid). The
head is replaced by that form, built under the head's own ``ctx_group``;
every other op and variable keeps the attributes it was trained with.
"""
from collections import OrderedDict
import ast
import json
import re

import mxnet as mx
import numpy as np

from mp_symbolic.core.compat import error_line
from mp_symbolic.core.heads import INFERENCE_FORMS, inference_form
from mp_symbolic.core.pipeline import DATA_NAME
from mp_symbolic.core.names import GROUP_ATTR, stage_name

from .errors import ExportError

__all__ = ['LOSS_HEADS', 'inference_graph', 'stage_layout', 'sample_shape', 'output_shape',
           'parse_shape']

# MXNet's loss-head ops, each replaced by its inference form.
LOSS_HEADS = tuple(INFERENCE_FORMS)
# Ops that only make sense in a training graph: a graph ending in one cannot be exported.
_TRAINING_ONLY = ('MakeLoss', 'make_loss', 'BlockGrad', 'softmax_cross_entropy')

_STAGE_RE = re.compile(r'^stage(\d+)$')


def _nodes(symbol):
    return json.loads(symbol.tojson())['nodes']


def inference_graph(symbol):
    """``symbol`` without its loss head (unchanged if it has none).

    Args:
        symbol: A one-output symbol, as trained or already stripped.

    Returns:
        The symbol whose output is the prediction, e.g. ``layer2_fwd_output``
        or ``softmax_out_output``.

    Raises:
        ExportError: the symbol has several outputs, ends in a training-only
            op, or ``data`` is not one of the inference graph's arguments.
    """
    if len(symbol.list_outputs()) != 1:
        raise ExportError('expected a symbol with one output, found %d: %s'
                          % (len(symbol.list_outputs()), ', '.join(symbol.list_outputs())))
    head = _nodes(symbol)[-1]
    if head['op'] in LOSS_HEADS:
        attrs = head.get('attrs', {})
        with mx.AttrScope(ctx_group=attrs.get(GROUP_ATTR)):
            symbol = inference_form(head['op'], attrs, symbol.get_children()[0])
    elif head['op'] in _TRAINING_ONLY:
        raise ExportError('expected a graph ending in a known loss head (%s) or in its '
                          'prediction, found %s %r: export the prediction symbol instead'
                          % (', '.join(LOSS_HEADS), head['op'], head['name']))
    if DATA_NAME not in symbol.list_arguments():
        raise ExportError("expected the graph to read an input named %r, found inputs %s"
                          % (DATA_NAME, ', '.join(symbol.list_arguments())))
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
    for node in _nodes(symbol):
        group = node.get('attrs', {}).get(GROUP_ATTR)
        if group is None:
            raise ExportError("expected a ctx_group attribute on every op and variable, "
                              "found none on %s %r" % (node['op'], node['name']))
        entry = groups.setdefault(group, {'layers': [], 'ops': [], 'variables': []})
        if node['op'] == 'null':
            entry['variables'].append(node['name'])
        else:
            entry['ops'].append(node['name'])
            layer = _layer_of(node['name'], entry['layers'])
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
    match = _STAGE_RE.match(name)
    return (0, int(match.group(1))) if match else (1, name)


def parse_shape(text):
    """``'1,8,8'`` or ``'(1, 8, 8)'`` -> ``(1, 8, 8)``.

    Raises:
        ExportError: not positive integers.
    """
    try:
        shape = tuple(int(d) for d in str(text).strip('()[] ').split(',') if d.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise ExportError('--input-shape: expected the shape of one sample as positive '
                          'integers such as 1,8,8, found %r' % (text,))
    return shape


def sample_shape(symbol, arg_params, given=None):
    """The shape of one input sample, batch dimension left out.

    From, in order: ``given``; the ``__shape__`` attribute a Pipeline module
    records on ``data`` (``(0, 1, 8, 8)``); the input width of a
    ``FullyConnected`` layer reading ``data`` directly.

    Raises:
        ExportError: none of these says it.
    """
    if given is not None:
        return tuple(given)
    nodes = _nodes(symbol)
    data_ids = {i for i, n in enumerate(nodes) if n['op'] == 'null' and n['name'] == DATA_NAME}
    for i in data_ids:
        recorded = nodes[i].get('attrs', {}).get('__shape__')
        if recorded:
            try:
                shape = tuple(ast.literal_eval(recorded))[1:]
            except (ValueError, SyntaxError, TypeError):
                shape = ()
            if shape and all(isinstance(d, int) and d > 0 for d in shape):
                return shape
    for node in nodes:
        inputs = [entry[0] for entry in node['inputs']]
        if node['op'] == 'FullyConnected' and inputs and inputs[0] in data_ids:
            weight = nodes[inputs[1]]['name']
            if weight in arg_params and len(arg_params[weight].shape) == 2:
                return (int(arg_params[weight].shape[1]),)
    raise ExportError('expected the per-sample input shape recorded on %r (a Pipeline module '
                      'checkpoint records it), found none: give it with --input-shape, e.g. '
                      '--input-shape 1,8,8' % DATA_NAME)


def output_shape(symbol, arg_params, aux_params, shape):
    """Shape of one sample's output, from MXNet's shape inference.

    Raises:
        ExportError: the arrays and ``shape`` do not fit the graph.
    """
    shapes = {name: value.shape for name, value in arg_params.items()
              if name in symbol.list_arguments()}
    shapes.update({name: value.shape for name, value in aux_params.items()
                   if name in symbol.list_auxiliary_states()})
    try:
        _, out_shapes, _ = symbol.infer_shape(**{DATA_NAME: (1,) + tuple(shape)}, **shapes)
    except mx.base.MXNetError as err:
        raise ExportError('the arrays do not fit together with inputs of shape %s: %s'
                          % (tuple(shape), error_line(err))) from None
    return tuple(int(d) for d in out_shapes[0][1:])


def features(shape):
    """Numbers per sample: the product of its shape."""
    return int(np.prod(shape))
