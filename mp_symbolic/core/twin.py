"""The imperative twin's forward pass: a Pipeline run by Gluon and autograd,
with replicas (data parallelism) and micro-batches (GPipe).

Each parameter has one copy per replica, on that replica's device of its
stage (``plan.replica_devices[r][stage]``). ``forward`` splits the batch into
``replicas`` equal shares and each share into ``chunks`` micro-batches, runs
every micro-batch through the stages of its replica, moving activations from
device to device (autograd records those copies, so gradients flow back across
them, to each replica's own copies), and joins the outputs on the last stage
of replica 0. :class:`~mp_symbolic.Trainer` then sums the gradients of a
parameter's copies, so one step equals one replica on the whole batch.

Operations are issued in the order of the Pipeline's schedule
(:mod:`~mp_symbolic.core.schedule`), its forward actions: under GPipe clock
``k`` runs stage ``k - m`` of micro-batch ``m``. They return at once; MXNet's
dependency engine runs stage ``s`` of one micro-batch while stage ``s + 1``
works on the previous one, as the stage runtime does. The backward pass is
autograd's, one ``loss.backward()``. Both forms take that one order, each
micro-batch one run of its stages: a block list's
stage runs its blocks (Gluon's own forward, so blocks that run only on
NDArrays, and layers that learn their input size on the first pass, need no
Symbol); a whole network's stage runs its ops of the labelled graph (made
once per placement), each on its group's device
(:class:`~mp_symbolic.core.graphcut.GraphRun`).

Reference: torchgpipe's ``microbatch.scatter``/``gather`` and its clock
schedule; Gluon's ``split_and_load`` for the replicas.
"""
import mxnet as mx

from . import graphcut
from .compat import read_on
from .ir import PlacedGraph
from .schedule import gpipe, issue_order

__all__ = []


def _check_batch(placement, xs):
    if len(xs) != len(placement.input_names):
        raise TypeError('inputs: expected %d (%s), found %d'
                        % (len(placement.input_names), ', '.join(placement.input_names), len(xs)))
    for name, x in zip(placement.input_names, xs):
        if not isinstance(x, mx.nd.NDArray):
            raise TypeError('%s: expected an NDArray (or a Symbol), found %s'
                            % ('x' if len(xs) == 1 else name, type(x).__name__))
        batch = x.shape[0] if x.shape else None
        placement.micro_batch(batch, of_several=len(xs) > 1,
                              refuse=batch is not None and batch != xs[0].shape[0])
    return placement.micro_batch(xs[0].shape[0])


def forward(placement, *xs, order=None):
    """The inputs ``xs`` through ``placement``'s stages on every replica; the
    whole batch's output on the last stage of replica 0 (a tuple for several).

    Args:
        order: The forward :class:`~mp_symbolic.core.schedule.Action` s in
            the order to issue them (each ``(stage, micro-batch)`` once, a
            stage after the one before it); ``None``: GPipe's.

    Raises:
        TypeError: an input is not an NDArray, or not one per input name.
        ValueError: the batch does not split into ``chunks x replicas``
            equal parts.
    """
    size = _check_batch(placement, xs)
    plan = placement.plan
    num_stages, chunks = plan.num_stages, placement.chunks
    # runs[r][m]: micro-batch m of replica r, run one stage at a time
    runs = [[_start(placement, [x if size == x.shape[0] else
                                mx.nd.slice_axis(x, axis=0, begin=(r * chunks + m) * size,
                                                 end=(r * chunks + m + 1) * size) for x in xs], r)
             for m in range(chunks)] for r in range(placement.replicas)]
    if order is None:
        order = forwards(gpipe(num_stages, chunks))
    for stage, m, _ in order:
        for shares in runs:
            shares[m].run(stage)
    outputs = [[h.as_in_context(plan.last_device) for h in run.outputs()]
               for shares in runs for run in shares]
    joined = [parts[0] if len(parts) == 1 else mx.nd.concat(*parts, dim=0)
              for parts in zip(*outputs)]
    return joined[0] if len(joined) == 1 else tuple(joined)


def forwards(schedule):
    """The forward actions of ``schedule`` in the order one thread issues them."""
    return [a for a in issue_order(schedule) if a.kind == 'F']


def _start(placement, xs, replica):
    """A run of one micro-batch ``xs`` through replica ``replica``'s stages.

    The one branch on the form of the network, and why it stays: a block
    list's stage runs its Gluon blocks (blocks that run only on NDArrays,
    and layers that learn their input size on the first pass, have no graph
    to run); a cut network has no blocks per stage, and runs its stage's ops
    of the labelled graph."""
    if placement.cut is None:
        return _BlockRun(placement, xs, replica)
    return _OpRun(placement, xs, replica)


class _BlockRun:
    """A micro-batch through a block list's stages, each :meth:`run` one
    stage's blocks on its device (autograd records the copies between)."""

    def __init__(self, placement, xs, replica):
        self.placement, self.values = placement, xs
        self.devices = placement.plan.replica_devices[replica]

    def run(self, stage):
        hs = [h.as_in_context(self.devices[stage]) for h in self.values]
        self.values = run_stage(self.placement, stage, hs, self.devices)

    def outputs(self):
        return self.values


class _OpRun:
    """A micro-batch through a cut network's stages, each :meth:`run` one
    stage's ops of the labelled graph (made once per placement:
    :attr:`~mp_symbolic.core.placement.Placement.run_graph`)."""

    def __init__(self, placement, xs, replica):
        graph = placement.run_graph
        self.ops = placement.run_ops
        first = placement.plan.replica_devices[replica][0]
        self.graph_run = start_graph(placement, graph, [h.as_in_context(first) for h in xs],
                                     replica)

    def run(self, stage):
        self.graph_run.run(self.ops[stage])

    def outputs(self):
        return _as_list(self.graph_run.outputs())


def run_stage(placement, stage, xs, devices):
    """Stage ``stage``'s blocks on the values ``xs`` (a list: a block of
    several outputs passes them all on), on one replica's ``devices``. A
    tied parameter owned by another stage is read through a copy from its
    owner's device (a shard's: from its shard's device, onto this stage's
    device of that shard), recorded by autograd (its gradient sums every use)."""
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
    """The op nodes of each stage in the labelled ``graph`` (a shard's in
    its stage), in the graph's order."""
    return PlacedGraph.from_json(graph).op_indices_by_stage(placement.plan.num_stages)


def start_graph(placement, graph, xs, replica):
    """A run of the labelled ``graph`` on the inputs ``xs`` with replica
    ``replica``'s parameters (:class:`~mp_symbolic.core.graphcut.GraphRun`),
    its stages run one :meth:`~mp_symbolic.core.graphcut.GraphRun.run` at a time."""
    inputs = {name: param.data(placement.device_of(name, replica))
              for name, param in placement.collect_params().items()}
    inputs.update(zip(placement.input_names, xs))
    return graphcut.GraphRun(graph, inputs, placement.plan.group2ctxs[replica])
