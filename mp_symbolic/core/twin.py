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

Operations are issued in GPipe's order (clock ``k`` runs stage ``k - m`` of
micro-batch ``m``) and return at once; MXNet's dependency engine runs stage
``s`` of one micro-batch while stage ``s + 1`` works on the previous one, as
in the symbolic graph of :meth:`Pipeline.training_symbol`. Both forms take
that one schedule: a block list's stage runs its blocks (Gluon's own forward,
so blocks that run only on NDArrays, and layers that learn their input size
on the first pass, need no Symbol); a whole network's stage runs its ops of
the labelled graph, each on its group's device
(:class:`~mp_symbolic.core.graphcut.GraphRun`).

Reference: torchgpipe's ``microbatch.scatter``/``gather`` and its clock
schedule; Gluon's ``split_and_load`` for the replicas.
"""
import mxnet as mx

from . import graphcut
from .compat import read_on
from .names import GROUP_ATTR

__all__ = []


def _check_batch(placement, xs):
    if len(xs) != len(placement.input_names):
        raise TypeError('inputs: expected %d (%s), found %d'
                        % (len(placement.input_names), ', '.join(placement.input_names), len(xs)))
    parts = placement.replicas * placement.chunks
    for name, x in zip(placement.input_names, xs):
        if not isinstance(x, mx.nd.NDArray):
            raise TypeError('%s: expected an NDArray (or a Symbol), found %s'
                            % ('x' if len(xs) == 1 else name, type(x).__name__))
        if not x.shape or x.shape[0] % parts or x.shape[0] != xs[0].shape[0]:
            raise ValueError('batch size: expected a multiple of chunks x replicas (%d x %d = %d)'
                             '%s, found %s' % (placement.chunks, placement.replicas, parts,
                                               ', the same for every input' if len(xs) > 1
                                               else '', x.shape[0] if x.shape else 'a scalar'))
    return xs[0].shape[0] // parts


def forward(placement, *xs):
    """The inputs ``xs`` through ``placement``'s stages on every replica; the
    whole batch's output on the last stage of replica 0 (a tuple for several).

    Raises:
        TypeError: an input is not an NDArray, or not one per input name.
        ValueError: the batch does not split into ``chunks x replicas``
            equal parts.
    """
    size = _check_batch(placement, xs)
    plan = placement.plan
    num_stages, chunks = plan.num_stages, placement.chunks
    # micro[r][m]: micro-batch m of replica r, as far as it has gone (a list:
    # the values a stage passes on)
    micro = [[[x if size == x.shape[0] else
               mx.nd.slice_axis(x, axis=0, begin=(r * chunks + m) * size,
                                end=(r * chunks + m + 1) * size) for x in xs]
              for m in range(chunks)] for r in range(placement.replicas)]
    ops = None
    if placement.cut is not None:  # a cut graph runs op by op, each op on its stage's device
        graph = placement.labelled()
        ops = ops_of_stages(placement, graph)
        micro = [[start_graph(placement, graph, [h.as_in_context(devices[0]) for h in hs], r)
                  for hs in shares]
                 for r, (devices, shares) in enumerate(zip(plan.replica_devices, micro))]
    for clock in range(chunks + num_stages - 1):
        for r, devices in enumerate(plan.replica_devices):
            for m in range(max(0, clock - num_stages + 1), min(chunks, clock + 1)):
                stage = clock - m
                if ops is not None:
                    micro[r][m].run(ops[stage])
                    continue
                hs = [h.as_in_context(devices[stage]) for h in micro[r][m]]  # recorded by autograd
                micro[r][m] = run_stage(placement, stage, hs, devices)
    if ops is not None:
        micro = [[_as_list(run.outputs()) for run in runs] for runs in micro]
    outputs = [[h.as_in_context(plan.last_device) for h in hs]
               for shares in micro for hs in shares]
    joined = [parts[0] if len(parts) == 1 else mx.nd.concat(*parts, dim=0)
              for parts in zip(*outputs)]
    return joined[0] if len(joined) == 1 else tuple(joined)


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
    ops = [[] for _ in range(placement.plan.num_stages)]
    for i, node in enumerate(graph['nodes']):
        if node['op'] != 'null':
            ops[placement.stage_of_group[node['attrs'][GROUP_ATTR]]].append(i)
    return ops


def start_graph(placement, graph, xs, replica):
    """A run of the labelled ``graph`` on the inputs ``xs`` with replica
    ``replica``'s parameters (:class:`~mp_symbolic.core.graphcut.GraphRun`),
    its stages run one :meth:`~mp_symbolic.core.graphcut.GraphRun.run` at a time."""
    inputs = {name: param.data(placement.device_of(name, replica))
              for name, param in placement.collect_params().items()}
    inputs.update(zip(placement.input_names, xs))
    return graphcut.GraphRun(graph, inputs, placement.plan.group2ctxs[replica])
