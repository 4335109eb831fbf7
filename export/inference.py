"""The inference graph: the training symbol without its loss head, and the
pipeline stages its ``ctx_group`` attributes describe.

The training symbol ends in ``LinearRegressionOutput(data=prediction,
label=label)``. Its data input is the prediction, so the inference graph is
that input, taken from the loaded graph itself: every op and variable keeps
the attributes it was trained with, ``ctx_group`` included.
"""
from collections import OrderedDict
import json
import re

from mp_symbolic.model import DATA_NAME, stage_name

from .errors import ExportError

__all__ = ['LOSS_HEADS', 'inference_graph', 'stage_layout', 'input_width', 'output_width']

# MXNet's loss-head ops: forward passes the prediction through, and there is
# no ONNX converter for any of them in MXNet 1.9.
LOSS_HEADS = ('LinearRegressionOutput', 'LogisticRegressionOutput',
              'MAERegressionOutput', 'SoftmaxOutput')

_STAGE_RE = re.compile(r'^stage(\d+)$')
_LAYER_RE = re.compile(r'^layer(\d+)_')


def _nodes(symbol):
    return json.loads(symbol.tojson())['nodes']


def inference_graph(symbol):
    """``symbol`` without its loss head (unchanged if it has none).

    Args:
        symbol: A one-output symbol, as trained or already stripped.

    Returns:
        The symbol whose output is the prediction, e.g. ``layer2_fc_output``.

    Raises:
        ExportError: the symbol has several outputs, or ``data`` is not one
            of the inference graph's arguments.
    """
    if len(symbol.list_outputs()) != 1:
        raise ExportError('expected a symbol with one output, found %d: %s'
                          % (len(symbol.list_outputs()), ', '.join(symbol.list_outputs())))
    if _nodes(symbol)[-1]['op'] in LOSS_HEADS:
        symbol = symbol.get_children()[0]
    if DATA_NAME not in symbol.list_arguments():
        raise ExportError("expected the graph to read an input named %r, found inputs %s"
                          % (DATA_NAME, ', '.join(symbol.list_arguments())))
    return symbol


def stage_layout(symbol):
    """The pipeline stages of ``symbol``, from its ``ctx_group`` attributes.

    Returns:
        ``OrderedDict`` ``{'stage0': {'layers': [0], 'ops': [...],
        'variables': [...]}, ...}`` in stage order.

    Raises:
        ExportError: a node has no ``ctx_group``, or the groups are not
            ``stage0 .. stage<N-1>``.
    """
    groups = {}
    for node in _nodes(symbol):
        group = node.get('attrs', {}).get('__ctx_group__')
        if group is None:
            raise ExportError("expected a ctx_group attribute on every op and variable, "
                              "found none on %s %r" % (node['op'], node['name']))
        entry = groups.setdefault(group, {'layers': [], 'ops': [], 'variables': []})
        if node['op'] == 'null':
            entry['variables'].append(node['name'])
        else:
            entry['ops'].append(node['name'])
            match = _LAYER_RE.match(node['name'])
            if match and int(match.group(1)) not in entry['layers']:
                entry['layers'].append(int(match.group(1)))
    expected = [stage_name(s) for s in range(len(groups))]
    if sorted(groups, key=_stage_key) != expected:
        raise ExportError('expected ctx_group names %s, found %s'
                          % (', '.join(expected), ', '.join(sorted(groups))))
    return OrderedDict((name, groups[name]) for name in expected)


def _stage_key(name):
    match = _STAGE_RE.match(name)
    return (0, int(match.group(1))) if match else (1, name)


def input_width(symbol, arg_params):
    """Features per sample: the input width of the op that reads ``data``.

    ``FullyConnected`` cannot infer its data shape from its weight, so the
    width is read off the weight array (``(units, in_units)``).

    Raises:
        ExportError: ``data`` is not read by a ``FullyConnected`` op whose
            weight is in ``arg_params``.
    """
    nodes = _nodes(symbol)
    data_ids = {i for i, n in enumerate(nodes) if n['op'] == 'null' and n['name'] == DATA_NAME}
    for node in nodes:
        inputs = [entry[0] for entry in node['inputs']]
        if node['op'] == 'FullyConnected' and inputs and inputs[0] in data_ids:
            weight = nodes[inputs[1]]['name']
            if weight in arg_params and len(arg_params[weight].shape) == 2:
                return int(arg_params[weight].shape[1])
    raise ExportError("expected %r to feed a FullyConnected layer with a 2-D weight, "
                      "found no such layer" % DATA_NAME)


def output_width(symbol, arg_params, width):
    """Outputs per sample, from MXNet's shape inference on a batch of one."""
    shapes = {name: value.shape for name, value in arg_params.items()
              if name in symbol.list_arguments()}
    _, out_shapes, _ = symbol.infer_shape(**{DATA_NAME: (1, width)}, **shapes)
    return int(out_shapes[0][1])
