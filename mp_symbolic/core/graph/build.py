"""The Pipeline's graphs, functions of a
:class:`~mp_symbolic.core.placement.place.Placement`: its one labelled graph
(every node tagged with its stage's ``ctx_group``) on micro-batches split
and joined, and read from a caller's inputs."""
import mxnet as mx

from . import nesting, passes
from ..base.compat import error_line, fresh_variables
from .ir import PlacedGraph
from .names import DATA_NAME, stage_name

__all__ = []


def chain(blocks, inputs):
    """The blocks one after the other on the Symbols ``inputs`` (a block's
    outputs all passed to the next); several outputs at the end grouped,
    flattened in order."""
    x = list(inputs)
    for block in blocks:
        x = block(*x)
        x = list(x) if isinstance(x, (list, tuple)) else [x]
    x, _ = nesting.flatten(x)
    return x[0] if len(x) == 1 else mx.sym.Group(x)


def build(placement, data_names, chunks, unsplit=False):
    """The network of ``placement`` on inputs named ``data_names`` (one per
    input, in order): its labelled graph on ``chunks`` micro-batches split on
    ``placement.batch_axis`` and joined on the last stage; with ``unsplit``,
    its tensor-parallel layers unsplit (the graph a checkpoint holds).
    Returns a :class:`~mp_symbolic.core.graph.ir.PlacedGraph`."""
    if placement.shard_of and unsplit:
        labelled = placement.unsplit_labelled()
    else:
        labelled = placement.labelled(placement.mirror)
    names = placement.input_names
    graph = passes.replicate_chunks(labelled, names, chunks, placement.plan.num_stages - 1,
                                    placement.batch_axis)
    rename = dict(zip(names, data_names))  # each input variable takes the caller's name
    if all(k == v for k, v in rename.items()):
        return graph
    return graph.but([n.but(name=rename[n.name]) if n.is_variable and n.name in rename
                      else n for n in graph.nodes])


def on_inputs(graph, data, placement):
    """``graph`` (:func:`build`'s) read from ``data``, a caller's Symbols (one
    per input): variables rename its inputs; ops are composed in front of it,
    those without a ``ctx_group`` on the first stage. Returns a
    :class:`~mp_symbolic.core.graph.ir.PlacedGraph`.

    Raises:
        ValueError: a node names a ``ctx_group`` the plan does not have.
    """
    inner = PlacedGraph.from_symbol(data[0] if len(data) == 1 else mx.sym.Group(data))
    groups = set(placement.plan.group2ctx)
    for node in inner.nodes:
        if node.group is not None and node.group not in groups:
            raise ValueError('x: expected the input symbol\'s nodes in no ctx_group or in one '
                             'of the Pipeline\'s (%s), found %r in %r'
                             % (', '.join(sorted(groups)), node.name, node.group))
    names = placement.input_names
    if all(d.list_arguments() == [d.name] and len(d.get_internals()) == 1 for d in data):
        rename = {n: d.name for n, d in zip(names, data)}  # each input variable takes the caller's
        return graph.but([n.but(name=rename[n.name]) if n.is_variable and n.name in rename
                          else n for n in graph.nodes])
    inner = inner.but([n.but(group=n.group or stage_name(0)) for n in inner.nodes])
    return graph.compose(inner, {n: k for k, n in enumerate(names)})


def infer_shapes(blocks, data_shape, data_name=DATA_NAME):
    """Fills in the parameter shapes of ``blocks`` (in order, each feeding the
    next) from one input shape, and returns ``{name: shape}``.

    Args:
        data_shape, data_name: The input's shape and name; for several inputs,
            a tuple of shapes and one of names (nested for nested inputs:
            ``('data0', ['data1', 'data2'])``, the shapes in flat order).

    Raises:
        ValueError: MXNet cannot infer the shapes, or the network takes
            another number of inputs.
    """
    names = tuple(nesting.flat_names(data_name))
    shapes = (tuple(data_shape),) if isinstance(data_name, str) else tuple(map(tuple, data_shape))
    inputs = (data_name,) if isinstance(data_name, str) else data_name
    with fresh_variables(blocks):
        try:
            sym = chain(blocks, nesting.map_names(mx.sym.var, inputs))
        except TypeError as err:
            if 'argument' not in str(err):
                raise
            # the network takes another number of inputs than the sample has
            raise ValueError('sample: expected one batch or shape per input of the network, '
                             'found %d (%s)' % (len(shapes), err)) from None
        given = 'input shape%s %s' % ('s' if len(shapes) > 1 else '',
                                      ', '.join(str(s) for s in shapes))
        try:
            arg_shapes, _, aux_shapes = sym.infer_shape(**dict(zip(names, shapes)))
        except Exception as err:  # pylint: disable=broad-except
            # MXNetError, or a bare Exception for a tensor over MXNet's size limit
            raise ValueError('sample: cannot infer the network\'s shapes from %s: %s'
                             % (given, error_line(err))) from None
        if arg_shapes is None:  # MXNet's answer where a size is 0 (unknown to it)
            raise ValueError('sample: cannot infer the network\'s shapes from %s: some stay '
                             'unknown (a size of 0 is unknown to MXNet)' % given)
    shapes = dict(zip(sym.list_arguments(), arg_shapes))
    shapes.update(zip(sym.list_auxiliary_states(), aux_shapes))
    for block in blocks:
        for param in block.collect_params().values():
            if param.name in shapes:
                param.shape = shapes[param.name]
    return shapes


