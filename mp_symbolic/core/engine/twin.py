"""The imperative twin's forward pass: a Pipeline run by Gluon and autograd,
each parameter with one copy per replica on that replica's device of its
stage. The batch is split into ``replicas`` shares of ``chunks``
micro-batches, run through each replica's stages in the schedule's order
and joined on replica 0's last stage; :class:`~mp_symbolic.Trainer` sums a
parameter's copies, so one step equals one replica on the whole batch."""
import mxnet as mx

from ..graph import graphcut, nesting
from ..base.compat import read_on

__all__ = []


def _check_batch(placement, xs):
    if len(xs) != len(placement.input_names):
        raise TypeError('inputs: expected %d (%s), found %d'
                        % (len(placement.input_names), ', '.join(placement.input_names), len(xs)))
    axis = placement.batch_axis
    sizes = {}
    for name, x in zip(placement.input_names, xs):
        if not isinstance(x, mx.nd.NDArray):
            raise TypeError('%s: expected an NDArray (or a Symbol), found %s'
                            % ('x' if len(xs) == 1 else name, type(x).__name__))
        if axis and len(x.shape) <= axis:
            raise ValueError('%s: expected an array with the batch on axis %d (batch_axis), '
                             'found shape %s' % ('x' if len(xs) == 1 else name, axis, x.shape))
        sizes[name] = x.shape[axis] if x.shape else None
    return placement.micro_batch_of(sizes)


def forward(placement, *xs, order):
    """The inputs ``xs`` (the leaves of the network's inputs, in order) through
    ``placement``'s stages on every replica, split and joined on
    ``placement.batch_axis``; the output on the last stage of replica 0 (a
    tuple for several, nested as the network returns them).

    Args:
        order: The forward :class:`~mp_symbolic.core.schedule.Action` s in
            issue order: the schedule's
            (:meth:`~mp_symbolic.core.schedule.Schedule.forwards`).

    Raises:
        TypeError: an input is not an NDArray, or not one per input name.
        ValueError: the batch does not split into ``chunks x replicas`` equal
            parts.
    """
    size = _check_batch(placement, xs)
    plan, axis = placement.plan, placement.batch_axis
    chunks = placement.chunks
    # runs[r][m]: micro-batch m of replica r, run one stage at a time
    whole = chunks * placement.replicas == 1  # one part: every input goes whole
    runs = [[_start(placement, [x if whole or size == x.shape[axis] else
                                mx.nd.slice_axis(x, axis=axis, begin=(r * chunks + m) * size,
                                                 end=(r * chunks + m + 1) * size) for x in xs], r)
             for m in range(chunks)] for r in range(placement.replicas)]
    for stage, m, _ in order:
        for shares in runs:
            shares[m].run(stage)
    return _join([run.outputs() for shares in runs for run in shares], plan.last_device, axis)


def _join(outputs, device, axis):
    """Each run's outputs joined on ``axis`` on ``device``: one output alone,
    several as a tuple."""
    flat = [nesting.flatten(list(out)) for out in outputs]
    parts = zip(*[[h.as_in_context(device) for h in leaves] for leaves, _ in flat])
    joined = [p[0] if len(p) == 1 else mx.nd.concat(*p, dim=axis) for p in parts]
    nested = flat[0][1]
    value = nesting.unflatten(nested, joined)
    return value[0] if len(value) == 1 and nested[1][0] is nesting.LEAF else tuple(value)


def _start(placement, xs, replica):
    """A run of one micro-batch ``xs`` through replica ``replica``'s stages: its
    Gluon blocks for a block list, its ops of the labelled graph for a cut
    network."""
    if placement.cut is None:
        return _BlockRun(placement, xs, replica)
    return _OpRun(placement, xs, replica)


class _BlockRun:
    """A micro-batch through a block list's stages, one stage per :meth:`run`."""

    def __init__(self, placement, xs, replica):
        self.placement = placement
        self.values = list(nesting.unflatten(nesting.flatten(
            placement.positional_inputs, lambda v: isinstance(v, str))[1], xs))
        self.devices = placement.plan.replica_devices[replica]

    def run(self, stage):
        device = self.devices[stage]
        hs = nesting.map_leaves(lambda h: h.as_in_context(device), self.values)
        self.values = run_stage(self.placement, stage, hs, self.devices)

    def outputs(self):
        return self.values


class _OpRun:
    """A micro-batch through a cut network's stages, one stage's ops of the
    labelled graph per :meth:`run`."""

    def __init__(self, placement, xs, replica):
        self.nesting = placement.outputs
        graph = placement.run_graph
        self.ops = placement.run_ops
        first = placement.plan.replica_devices[replica][0]
        self.graph_run = start_graph(placement, graph, [h.as_in_context(first) for h in xs],
                                     replica)

    def run(self, stage):
        self.graph_run.run(self.ops[stage])

    def outputs(self):
        leaves = _as_list(self.graph_run.outputs())
        if self.nesting is None or nesting.count(self.nesting) != len(leaves) or \
                nesting.is_flat(self.nesting):
            return leaves
        return list(nesting.unflatten(self.nesting, leaves))  # as the network returns them


def run_stage(placement, stage, xs, devices):
    """Stage ``stage``'s blocks on the values ``xs`` (a list) on one replica's
    ``devices``; a tied parameter of another stage (or shard) is read through
    a copy autograd records."""
    stage_devices = placement.plan.stage_devices[placement.plan.replica_devices.index(devices)]
    reads = [(p, stage_devices[owner][shard],
              stage_devices[stage][shard if len(stage_devices[stage]) > 1 else 0])
             for p, owner, shard in placement.borrowed[stage]]
    with read_on(reads, devices[stage]):
        for block in placement.stages[stage]:
            xs = block(*xs)
            xs = list(xs) if isinstance(xs, (list, tuple)) else [xs]
    return xs


def _as_list(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def ops_of_stages(placement, graph):
    """The op nodes of each stage of the labelled ``graph``, in order."""
    return graph.op_indices_by_stage(placement.plan.num_stages)


def start_graph(placement, graph, xs, replica):
    """A :class:`~mp_symbolic.core.graph.graphcut.GraphRun` of the labelled
    ``graph`` on ``xs`` with replica ``replica``'s parameters."""
    inputs = {name: param.data(placement.device_of(name, replica))
              for name, param in placement.collect_params().items()}
    inputs.update(zip(placement.input_names, xs))
    return graphcut.GraphRun(graph, inputs, placement.plan.group2ctxs[replica])
