"""BatchNorm's running statistics over a batch's micro-batches.

``batchnorm='micro-batch'`` (the default): each micro-batch updates them in
turn, as MXNet's BatchNorm does. ``batchnorm='deferred'``: the bound graphs'
BatchNorm ops run at momentum 1 (the statistics unchanged) and output each
micro-batch's mean and inverse standard deviation (:func:`deferred_graph`);
:func:`update` then applies one update with the whole batch's. MXNet is
imported only when a graph or an update needs it.
"""
from collections import OrderedDict, namedtuple

__all__ = ['MODES', 'DEFAULT', 'check_mode', 'deferred_graph', 'update']

DEFAULT = 'micro-batch'
MODES = (DEFAULT, 'deferred')

# One BatchNorm's running statistics: their names, the op's momentum and
# eps, and per micro-batch copy of the op the graph outputs that hold its
# mean and inverse standard deviation.
Statistics = namedtuple('Statistics', 'mean var momentum eps outputs')


def check_mode(batchnorm):
    """``batchnorm`` if it is one of :data:`MODES`; raises ValueError otherwise."""
    if not isinstance(batchnorm, str) or batchnorm not in MODES:
        raise ValueError('batchnorm: expected one of %s, found %r'
                         % (', '.join(repr(m) for m in MODES), batchnorm))
    return batchnorm


def _true(value):
    return str(value).lower() in ('true', '1')


def deferred_graph(placed):
    """``placed`` with every BatchNorm that updates running statistics at
    momentum 1 and its mean and inverse standard deviation as two more outputs
    (through ``BlockGrad``, on the op's group), after the graph's own.

    Returns:
        ``(graph, statistics)``: the graph (``placed`` itself where no
        BatchNorm updates statistics; its own outputs keep their indices), and
        one :class:`Statistics` per pair of running statistics in graph order,
        its ``outputs`` ``[(mean output, inverse std output)]`` one pair per op
        (per micro-batch copy) that updates them.
    """
    from .ir import make_node  # pylint: disable=import-outside-toplevel
    nodes = list(placed.nodes)
    heads = list(placed.heads)
    found = OrderedDict()
    extra = []
    for node in placed.nodes:
        if node.op != 'BatchNorm' or _true(node.attrs.get('use_global_stats', False)):
            continue
        mean, var = (nodes[e.node].name for e in node.inputs[3:5])
        attrs = dict(node.attrs)
        momentum = float(attrs.get('momentum', 0.9))
        eps = float(attrs.get('eps', 1e-3))
        attrs.update(momentum='1', output_mean_var='True')
        nodes[node.index] = node.but(attrs=attrs)
        entry = found.setdefault(mean, Statistics(mean, var, momentum, eps, []))
        pair = []
        for output, what in ((1, 'mean'), (2, 'invstd')):
            extra.append(make_node(len(nodes) + len(extra), '%s_batch_%s' % (node.name, what),
                                   'BlockGrad', [(node.index, output, 0)], node.group))
            pair.append(len(heads) + len(extra) - 1)
        entry.outputs.append(tuple(pair))
    if not found:
        return placed, []
    nodes += extra
    heads += [(n.index, 0, 0) for n in extra]
    return placed.but(nodes, heads), list(found.values())


def update(statistics, aux, outputs):
    """One update of each BatchNorm's running statistics with the whole batch's
    mean and biased variance (from the micro-batches', of one size), computed
    as MXNet's kernel does, on the statistics' device.

    Args:
        statistics: :func:`deferred_graph`'s, or several graphs' together.
        aux: ``{name: NDArray}``: the running statistics, updated in place.
        outputs: ``outputs[k]``: graph output ``k``, an NDArray or a list of
            one per micro-batch.
    """
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    for stat in statistics:
        moving_mean, moving_var = aux[stat.mean], aux[stat.var]
        device = moving_mean.context
        means, variances = [], []
        for mean_k, invstd_k in stat.outputs:
            for mean, invstd in zip(_each(outputs[mean_k]), _each(outputs[invstd_k])):
                invstd = invstd.as_in_context(device).astype('float64')
                means.append(mean.as_in_context(device).astype('float64'))
                variances.append(1.0 / (invstd * invstd) - stat.eps)
        whole_mean = mx.nd.add_n(*means) / len(means) if len(means) > 1 else means[0]
        whole_var = mx.nd.add_n(*[v + mx.nd.square(m - whole_mean)
                                  for m, v in zip(means, variances)]) / len(means)
        momentum = np.float32(stat.momentum)
        rest = float(np.float32(1) - momentum)
        for moving, whole in ((moving_mean, whole_mean), (moving_var, whole_var)):
            moving[:] = moving * float(momentum) + whole.astype(moving.dtype) * rest


def _each(value):
    return value if isinstance(value, (list, tuple)) else [value]
