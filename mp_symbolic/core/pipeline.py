"""``Pipeline``: any Gluon network split into stages on several devices.

Modelled on torchgpipe's ``GPipe(module, balance, devices, chunks)``, but on
MXNet's own machinery: the Pipeline tags every op, parameter variable and
auxiliary state of stage ``s`` with ``ctx_group='stage<s>'``, and MXNet's
graph executor, bound with ``group2ctx``, places each stage on its device and
inserts the cross-device copies (``Module(group2ctxs=...)``,
``Symbol.simple_bind(group2ctx=...)``). With ``chunks=M`` the graph splits each
batch into M micro-batches that run through the stages with shared weights
(GPipe); MXNet's dependency engine then runs stage ``s`` on chunk ``m`` while
stage ``s+1`` works on chunk ``m-1``, with no scheduler of ours.

One ``HybridBlock`` of any shape (residuals, branches) is split whole: its
traced graph is cut into one contiguous range of ops per stage and relabelled
(:mod:`~mp_symbolic.core.graph.graphcut`). A parameter read by several stages (tied
weights) lives on one stage and the others read it through an ``identity``
op there.

A stage may hold several devices (``'cpu:0+cpu:1,cpu:2'``): its
tensor-parallel layers (:mod:`~mp_symbolic.core.parallel.tensor_parallel`) then put
shard ``i`` on the stage's device ``i``, in ``ctx_group``
``stage<s>_shard<i>``; everything else in the stage runs on its first device.
Where users see parameters (``get_params``, ``set_params``, checkpoints) a
split layer has its unsplit names and shapes.

The same object is the imperative twin: a Gluon ``Block`` whose parameters
live on their stage's device and whose forward pass moves activations between
devices (autograd records those copies, so gradients flow back across them);
with replicas and chunks too (:mod:`~mp_symbolic.core.engine.twin`), trained by
:class:`~mp_symbolic.Trainer`.

This module is the Gluon block and the entry point: the plan is one frozen
:class:`~mp_symbolic.core.placement.place.place.Placement` made by
:func:`~mp_symbolic.core.placement.place.place.place`; the graphs are built from it in
:mod:`~mp_symbolic.core.graph.build.build` and the imperative forward pass runs on it in
:mod:`~mp_symbolic.core.engine.twin`.
"""
import mxnet as mx
from mxnet import gluon

from .parallel import autotp, tensor_parallel
from .transport import comm
from .graph import build as graph, nesting, passes
from .optim import initial, zero
from .engine import runtime, twin
from .base.checks import excerpt
from .base.compat import initialized, symbol_safe
from .graph.heads import with_head
from .graph.names import DATA_NAME, LABEL_NAME, input_names, stage_name
from .placement.place import check_parameter_names, place, sample_inputs
from .transport import nodes as node_processes
from .graph import batchnorm as batchnorms
from . import schedule as schedules

__all__ = []


def _as_blocks(blocks):
    if isinstance(blocks, gluon.nn.HybridSequential):
        blocks = list(blocks._children.values())  # pylint: disable=protected-access
    elif isinstance(blocks, gluon.Block) and not isinstance(blocks, gluon.nn.Sequential):
        blocks = [blocks]
    try:
        blocks = list(blocks)
    except TypeError:
        raise TypeError('blocks: expected a list of Gluon HybridBlocks or a HybridSequential, '
                        'found %s' % type(blocks).__name__) from None
    if not blocks:
        raise ValueError('blocks: expected at least one HybridBlock, found none')
    for i, block in enumerate(blocks):
        if not isinstance(block, gluon.HybridBlock):
            raise TypeError('blocks: expected Gluon HybridBlocks (they can be bound as a '
                            'symbol), found %s at position %d'
                            % (type(block).__name__, i))
    return blocks


class Pipeline(gluon.Block):
    """A network of Gluon blocks, split into contiguous stages, one device each.

    Args:
        blocks: Gluon ``HybridBlock`` s in order (``Dense``, ``Conv2D``,
            ``BatchNorm``, pooling, ``Flatten``, ``Dropout``, your own ...), or
            a ``HybridSequential``; each block takes one input and returns one
            output. Or ONE ``HybridBlock`` of any shape (residuals, branches,
            concatenations: ``vision.resnet18_v1(classes=10)``): its traced
            graph is cut into one contiguous range of ops per stage
            (:mod:`~mp_symbolic.core.graph.graphcut`).
        devices: ``'cpu:0,cpu:1,cpu:2'`` (the ``--devices`` form) or a list of
            ``mx.Context``; one device per stage, times ``replicas``. A stage
            of several devices, for tensor-parallel layers: ``'cpu:0+cpu:1,cpu:2'``
            or a tuple of contexts in the list.
        balance: ``None``: balance the stages by parameter count; a list of
            ints: blocks per stage (one entry per device, each at least 1,
            summing to the number of blocks; ops per stage for one whole
            network); ``'time'``: balance by each block's (op's) measured
            forward + backward time on ``sample``. For a whole network, among
            cuts within 10% of the best balance the one with the fewest
            activation bytes crossing the boundaries wins.
        sample: A batch (numpy or NDArray) or its shape, for ``balance='time'``
            and for parameter shapes not known yet (layers without their input
            size); for a whole network it also gives the bytes crossing each
            boundary. A tuple of batches (or of shapes), one per positional
            input, for a network of several inputs: they are then named
            ``data0``, ``data1``, ... (``input_names``). A positional input
            that is a list (GluonNLP's ``begin_state``): a list of batches
            in its place, ``sample=(x, [h0, c0])``; its leaves are inputs in
            order (``data0`` for ``x``, ``data1``, ``data2`` for the states)
            and ``pipe(x, [h, c])`` takes them nested the same way.
        chunks: Micro-batches per batch (GPipe), in the symbolic graph and in
            the imperative twin; the batch size must be a multiple of
            ``chunks * replicas``.
        replicas: Data-parallel copies of the pipeline; ``devices`` then lists
            ``replicas x stages`` devices, replica by replica.
        mirror: Re-materialisation: ``True`` (every stage) or stage indices
            whose ops carry MXNet's ``__force_mirroring__``, so the backward
            pass recomputes their outputs instead of keeping them (compute
            traded for activation memory; see the README for what it measured).
        tied: ``{parameter name: stage}`` for parameters read by several
            stages (tied weights) that should live on another stage than the
            first that reads them. Other stages read such a parameter through
            an ``identity`` op in its stage (a copy, in the imperative twin);
            its gradient is the sum over its uses.
        tensor_parallel: ``None``: only the tensor-parallel layers the network
            is written with are sharded. ``'auto'``: its ``Dense`` layers and
            attention blocks are swapped for tensor-parallel ones over the
            devices of a stage, each MLP and self-attention Megatron-LM's way
            (:mod:`~mp_symbolic.core.parallel.autotp`); ``{pattern: 'column' | 'row' |
            'vocab' | 'replicate'}``: the layers whose block or parameter name
            matches an ``fnmatch`` pattern (the first that matches decides).
            Swapped layers keep their parameter names and values; the network
            given is changed in place. ``print(pipe)`` says what was sharded.
        schedule: The order of the micro-batches in the Module's training
            step: ``'gpipe'`` (fill and drain: every forward, then every
            backward), ``'1f1b'`` (each stage one forward and one backward
            in turn, so stage ``s`` of ``K`` keeps at most ``K - s``
            micro-batches' activations: :mod:`~mp_symbolic.core.engine.stages`),
            ``'interleaved'`` (Megatron-LM's interleaved 1F1B: ``virtual``
            stages per device, so a step's idle fraction falls from
            ``(K-1)/(M+K-1)`` to ``(K-1)/(vM+K-1)``; ``chunks`` a multiple
            of the ``K`` devices), or a function ``(num_stages,
            microbatches) -> one list of actions per device``
            (:class:`~mp_symbolic.Action` ``(stage, microbatch, kind)``,
            kind ``'F'`` or ``'B'``), checked here: each action once, on its
            stage's device, in an order the devices can run; the function
            runs in a thread of its own and must return, and its lists be
            read, within ``schedule.TIME_LIMIT`` seconds (10), at most ``2
            x stages x micro-batches`` actions a device. The imperative
            twin runs the schedule's forwards in its order.
        virtual: Stages per device (default 2 under ``'interleaved'``, 1
            under a function; the other names run one): ``devices`` lists
            each device once and the network is cut into ``virtual x K``
            stages, stage ``s`` on device ``s mod K`` (with 2 devices and
            ``virtual=2``: stages 0, 1, 2, 3 on devices 0, 1, 0, 1). An
            argument of its own rather than ``schedule='interleaved:2'``: the
            schedule stays a value, and the count is checked as the other
            counts are. Each virtual stage binds its own executors, as many
            as the schedule keeps micro-batches in flight on it.
        nodes: ``None`` or 1: every stage in this process. ``N``: the stages
            divided over N node processes (on one host or several), each
            replica's devices evenly and in order, each node binding only its
            stages on its own devices (``gpu:0`` of node 1 is node 1's GPU; a
            device may be listed once per node) and holding only their
            parameters, gradients and optimizer state; the boundary tensors
            cross by torch.distributed (:mod:`~mp_symbolic.core.transport.nodes`). Every
            node process builds the same Pipeline; its rank and the rendezvous
            come from torchrun's variables (``MASTER_ADDR``, ``MASTER_PORT``,
            ``RANK``, ``WORLD_SIZE``; ``python -m mp_symbolic launch --nodes N``
            sets them too). The Module (``pipe.module()``) trains as on one
            host; its outputs and metric are the last node's.
        node_timeout: Seconds a node waits on another (a tensor, a commit)
            before it ends (a stopped or wedged node); default 300.
        batch_axis: The axis of the batch in every input and output of the
            network: 0 (batch first), or 1 for GluonNLP's ``TNC`` layout
            (tokens ``(T, N)``, states ``(L, N, C)``, outputs ``(T, N, V)``).
            The micro-batches and the replicas split every input on it and
            join every output on it, in the twin and the Module (whose
            inputs and labels then carry layouts with ``N`` there), on
            every schedule and over nodes.
        batchnorm: How the Module's training step updates BatchNorm's
            running statistics with micro-batches: ``'micro-batch'`` (each
            micro-batch in turn, in micro-batch order, under every schedule),
            or ``'deferred'`` (torchgpipe's ``deferred_batch_norm``: once per
            batch, with the whole batch's mean and variance, as one device
            running the whole batch; each replica its own, each node its
            stages'; :mod:`~mp_symbolic.core.graph.batchnorm`). With one chunk both
            are MXNet's own update. :meth:`training_symbol` is the graph
            of the default rule; the imperative twin refuses to train with
            ``'deferred'`` and several chunks.
        transport: The name of the transport that carries the boundary
            tensors on the stage runtime (:mod:`~mp_symbolic.core.transport.comm`):
            ``None`` for ``'local'`` in one process and ``'gloo'`` over
            nodes, or a name given to
            :func:`~mp_symbolic.core.transport.comm.register_transport`.
        shard_optimizer: ZeRO stage 1 (:mod:`~mp_symbolic.core.optim.zero`): each
            of a stage's replicas (times the ``dist_sync`` workers) holds
            and updates the optimizer state of its share of the stage's
            parameters (whole parameters, balanced by bytes), and the
            updated values go to the other replicas; the values are the
            unsharded run's, bit for bit. With one replica there is nothing
            to share: the run is the unsharded one. The Module's training
            step does it (``pipe.module()``); checkpoints hold the whole
            state by name, as without.
        plan: ``None``: the plan is the arguments given. ``'auto'``: the
            planner chooses ``balance``, ``chunks``, ``replicas``,
            ``mirror``, ``schedule`` and ``virtual`` (and which of
            ``devices`` to use, in order, and how many to a stage: the
            shards of the network's tensor-parallel layers, or with
            ``tensor_parallel='auto'`` the shards it makes, 1 among them;
            ``shard_optimizer`` where it is
            needed to fit) from the memory estimate and a
            simulation of the schedule over stage times measured on
            ``devices`` (:mod:`~mp_symbolic.core.planning.planner`), for a softmax
            head and SGD with momentum; a
            :class:`~mp_symbolic.core.planning.planner.Planner` plans for its loss,
            optimizer and space. Those arguments must then be left at their
            defaults (``tensor_parallel``: ``None`` or ``'auto'``), and
            ``sample`` given. Scoring the candidates leaves ``blocks`` as
            they are; ``tensor_parallel='auto'`` then shards them in place
            for the plan chosen, as without a plan.
        memory_per_device: With ``plan``: the bytes each device may hold
            (an int, or ``'2GiB'``, ``'512MB'``, ``'1.5G'``); ``None``: no
            budget (the fastest plan).

    Attributes:
        blocks: The blocks, in order.
        placement: The :class:`~mp_symbolic.core.placement.place.place.Placement`: what
            runs where (the attributes below read it).
        plan: The :class:`~mp_symbolic.core.placement.devices.DevicePlan`.
        balance: Blocks per stage (ops per stage for a whole network).
        chunks, replicas, schedule, virtual, batchnorm, shard_optimizer: As
            given (``virtual`` 1 but under ``'interleaved'``).
        transport: The transport's name (``'local'``, ``'gloo'`` or as given).
        planned: With ``plan``: the :class:`~mp_symbolic.core.planning.planner.Ranking`
            of the candidates (``planned.best``: the plan built), else ``None``.
        whole: Whether one whole network was cut (then ``cut`` is its
            :class:`~mp_symbolic.core.graph.graphcut.Cut`).
        tied: ``{parameter name: (owning stage, stages that read it)}``.
        sharding: What ``tensor_parallel`` did, layer by layer
            (:class:`~mp_symbolic.core.parallel.autotp.Sharding`), or ``None``.
        inputs: The positional inputs as nested names (``('data0',
            ['data1', 'data2'])``); ``input_names`` are their leaves.
        batch_axis: As given.

    Raises:
        TypeError: a block is not a ``HybridBlock``.
        ValueError: (``DeviceSpecError``, ``BalanceError``) devices, balance,
            chunks or replicas that cannot work; an unknown ``schedule``, or
            a function's that cannot run (``ScheduleError``); ``virtual``
            not a positive integer, or given with a named schedule of one
            stage per device; under ``'interleaved'``, ``chunks`` not a
            multiple of the devices; (``NodeError``) nodes without a
            rendezvous, more nodes than devices per replica, a device twice
            on one node, ``balance='time'`` with nodes, or nodes whose plans
            differ; a
            ``tied`` entry that is not a parameter and a stage; a whole network without ``sample``
            whose shapes are not known; a ``sample`` with a size below 1,
            more elements in an input than MXNet takes in one tensor, or
            lists nested deeper than 32 or holding themselves; a stage of several devices whose
            count is not the shards of a tensor-parallel layer in it; a
            ``tensor_parallel`` plan that cannot hold (the layer, its shapes
            and the shard count named); ``batch_axis`` not a non-negative
            integer; ``batchnorm`` not one of
            :data:`~mp_symbolic.core.graph.batchnorm.MODES`; ``shard_optimizer``
            not a bool; ``transport`` not
            a registered name, one within a process with nodes, or other
            than ``'local'`` on MXNet's one graph (``schedule='gpipe'`` in
            one process); (``PlanError``) with ``plan``, a budget no
            candidate fits (its one line names the smallest memory one
            needs), a size that cannot be read, or a plan argument given
            too; ``memory_per_device`` without ``plan``.
    """

    @symbol_safe
    def __init__(self, blocks, devices, balance=None, sample=None, chunks=1, replicas=1,
                 mirror=False, tied=None, tensor_parallel=None, schedule=schedules.DEFAULT,
                 virtual=None, nodes=None, node_timeout=None, batch_axis=0,
                 batchnorm=batchnorms.DEFAULT, transport=None, shard_optimizer=False,
                 plan=None, memory_per_device=None):
        super().__init__(prefix='pipeline_')
        self.planned = None
        if plan is not None:
            from .planning.planner import plan_arguments  # pylint: disable=import-outside-toplevel
            self.planned, chosen = plan_arguments(
                plan, memory_per_device, blocks, devices, sample, batch_axis,
                dict(balance=balance, chunks=chunks, replicas=replicas, mirror=mirror,
                     schedule=schedule, virtual=virtual, nodes=nodes,
                     tensor_parallel=tensor_parallel, shard_optimizer=shard_optimizer))
            devices, balance, chunks, replicas = (chosen['devices'], chosen['balance'],
                                                  chosen['chunks'], chosen['replicas'])
            mirror, schedule, virtual = chosen['mirror'], chosen['schedule'], chosen['virtual']
            shard_optimizer = chosen.get('shard_optimizer', False)
            tensor_parallel = chosen.get('tensor_parallel')
        elif memory_per_device is not None:
            raise ValueError("memory_per_device: expected it with plan='auto' (the budget the "
                             "planner holds each device to), found it without a plan")
        self.batchnorm = batchnorms.check_mode(batchnorm)
        self.shard_optimizer = zero.check(shard_optimizer)
        self.virtual = schedules.check_spec(schedule, virtual)
        self.schedule = schedule
        self.nodes = None
        if nodes is not None and nodes != 1:
            self.nodes = node_processes.from_environment(nodes, node_timeout)
            if isinstance(balance, str):
                raise node_processes.NodeError(
                    "balance: expected blocks per stage or None with nodes (each node would "
                    "time the network on its own and cut it its own way), found %r; time it "
                    "in one process (Pipeline(..., balance='time').balance) and give that"
                    % balance)
        self.transport = comm.check_transport(transport, self.nodes)
        if self.transport != comm.LOCAL and runtime.fused(self):
            raise ValueError('transport: expected %r under schedule=%r in one process (MXNet\'s '
                             'one graph copies between the devices itself), found %r'
                             % (comm.LOCAL, schedule, self.transport))
        # One HybridBlock (not a HybridSequential) is split by a graph cut.
        whole = isinstance(blocks, gluon.HybridBlock) and \
            not isinstance(blocks, gluon.nn.HybridSequential)
        blocks = _as_blocks(blocks)
        check_parameter_names(blocks, whole)
        self.sharding = None
        if tensor_parallel is not None:
            shapes, nested = sample_inputs(sample)
            names = tuple(input_names(1 if shapes is None else len(shapes)))
            names = names if nested is None else nesting.unflatten(nested, names)
            if shapes is not None:
                graph.infer_shapes(blocks, shapes, names)
            blocks, self.sharding = autotp.apply(blocks, tensor_parallel, devices, names)
        self.blocks = tuple(blocks)
        for i, block in enumerate(self.blocks):
            self.register_child(block, 'block%d' % i)
        self.placement = place(self.blocks, whole, devices, balance, sample, chunks, replicas,
                               mirror, tied, self.virtual, self.nodes, batch_axis,
                               sample_checked=tensor_parallel is not None)
        # a schedule that cannot run is refused here, not at bind
        self._forwards = self.run_schedule().forwards()
        if self.nodes is not None:  # every check above is done: now wait for the others
            node_processes.join(self.nodes, gpus=any(
                d.device_type == 'gpu' for s in self.local_stages
                for devices in self.plan.stage_devices for d in devices[s]))
            comm.control(self.nodes, 'compare their plans',
                         self.plan.node_of_stage).agree(self._plan_facts())

    def _plan_facts(self):
        """What every node must have alike to run one pipeline."""
        params = self.collect_params()
        return {'devices per replica': self.devices_per_replica, 'replicas': self.replicas,
                'balance': list(self.balance), 'chunks': self.chunks,
                'schedule': self.run_schedule().name, 'virtual': self.virtual,
                'batchnorm': self.batchnorm, 'transport': self.transport,
                'shard_optimizer': self.shard_optimizer,
                'inputs': list(self.input_names), 'stages': self.stage_names,
                'parameters': [[n, list(p.shape or ())] for n, p in params.items()]}

    @property
    def local_stages(self):
        """The stages this process runs: every stage, or this node's."""
        if self.nodes is None:
            return tuple(range(self.plan.num_stages))
        return self.plan.stages_of_node(self.nodes.rank)

    # -- the placement, as attributes ---------------------------------------

    plan = property(lambda self: self.placement.plan, doc='The device plan.')
    whole = property(lambda self: self.placement.whole,
                     doc='Whether one whole network was cut (then ``cut`` is its Cut).')
    cut = property(lambda self: self.placement.cut, doc='The graph cut of a whole network.')
    chunks = property(lambda self: self.placement.chunks, doc='Micro-batches per batch.')
    replicas = property(lambda self: self.placement.replicas,
                        doc='Data-parallel copies of the pipeline.')
    mirror = property(lambda self: self.placement.mirror,
                      doc='Stages whose ops are recomputed in the backward pass.')
    sharded = property(lambda self: self.placement.sharded, doc='The tensor-parallel layout.')

    @property
    def tied(self):
        """``{parameter name: (owning stage, [stages that read it])}`` of every
        parameter read by more than one stage."""
        return self.placement.tied

    @property
    def balance(self):
        """Blocks per stage (ops per stage for a whole network)."""
        return self.plan.balance

    @property
    def stages(self):
        """The blocks of each stage: ``stages[s]`` is a list (op names for a
        whole network)."""
        return self.placement.stages

    @property
    def stage_names(self):
        """Names of each stage's blocks (of its ops, for a whole network)."""
        return [[b if isinstance(b, str) else b.name for b in stage] for stage in self.stages]

    def _params_of_stage(self):
        """``[(owning stage, param)]`` for every parameter once, in block order."""
        owner = self.placement.owner
        return [(owner[name], param) for name, param in self.collect_params().items()]

    def describe(self):
        """The plan, one line per stage, with block names and parameter counts.

        For a whole network: per stage, its device(s), op count and parameter
        count, then its ops and its parameters, and after each stage but the
        last the activation bytes per sample that cross to the next.
        """
        return self.placement.describe()

    # -- symbolic ------------------------------------------------------------

    @property
    def input_names(self):
        """The inputs' names: ``('data',)`` for one, ``('data0', 'data1', ...)``
        for several (as ``HybridBlock.export`` names them)."""
        return self.placement.input_names

    def data_names(self, data_name=DATA_NAME):
        """The data variables of the graphs: ``(data_name,)`` for one input,
        :attr:`input_names` for several."""
        return (data_name,) if len(self.input_names) == 1 else self.input_names

    @symbol_safe
    def symbol(self, data_name=DATA_NAME):
        """The inference graph: the inputs -> the network's output(s), every node tagged."""
        return self.training_graph(None, data_name, chunks=1).to_symbol()

    @symbol_safe
    def training_symbol(self, loss, data_name=DATA_NAME, label_name=LABEL_NAME, chunks=None,
                        output=None, unsplit=False):
        """The graph with its loss head (see :func:`mp_symbolic.core.graph.heads.make_head`).

        Args:
            loss: A loss head; ``None``: no head, the network's outputs (an
                inference graph with no label).
            chunks: Micro-batches; ``None``: the Pipeline's ``chunks``.
            output: For a network of several outputs, the one a named loss
                reads; the graph's outputs are then the head, then the other
                outputs in order (through ``BlockGrad``: no gradient flows
                from them). A callable loss receives the list of outputs.
            unsplit: Tensor-parallel layers unsplit (one op each, with the
                unsplit layer's parameter names and shapes): the graph a
                checkpoint holds, whatever the shards it was trained on.

        Raises:
            ValueError: ``output`` is missing or out of range for a network
                of several outputs, or given for one of a single output.
        """
        return self.training_graph(loss, data_name, label_name, chunks, output,
                                   unsplit).to_symbol()

    @symbol_safe
    def training_graph(self, loss, data_name=DATA_NAME, label_name=LABEL_NAME, chunks=None,
                       output=None, unsplit=False, shares=1):
        """:meth:`training_symbol`'s graph, typed (a
        :class:`~mp_symbolic.core.graph.ir.PlacedGraph`): the network's graph
        (:func:`~mp_symbolic.core.graph.build.build.build`), the loss head
        (:func:`~mp_symbolic.core.graph.heads.with_head`) and
        :func:`~mp_symbolic.core.graph.passes.finish`, passes on one typed graph.

        Args:
            shares: The parts of a step's batch the graph is bound to (a
                replica's share, times ``chunks`` where each micro-batch is
                bound alone): the ``grad_scale`` of a head whose gradient
                divisor holds the batch is divided by it
                (:func:`~mp_symbolic.core.graph.heads.scaled_heads`), so that its
                gradients are those of one device's unsplit batch; 1 (the
                default): the head as one device trains it.

        Raises:
            ValueError: as :meth:`training_symbol`.
        """
        chunks = self.chunks if chunks is None else chunks
        placed = graph.build(self.placement, self.data_names(data_name), chunks, unsplit)
        if loss is not None:
            placed = with_head(placed, loss, label_name, output,
                               stage_name(self.plan.num_stages - 1),
                               shares=shares, batch_axis=self.batch_axis)
        return passes.finish(placed, self.placement)

    @property
    def devices_per_replica(self):
        """``K``: the distinct devices of one replica's stages (the stages
        over ``virtual``)."""
        return self.plan.num_stages // self.virtual

    def run_schedule(self):
        """The :class:`~mp_symbolic.core.schedule.Schedule` the stage runtime
        runs on each replica (under ``'gpipe'``, fill and drain as data: the
        one graph's Module leaves the order to MXNet's engine instead).

        Raises:
            ValueError: (``ScheduleError``) a schedule function whose
                actions cannot run; under ``'interleaved'``, ``chunks`` not a
                multiple of the devices.
        """
        return schedules.make(self.schedule, self.plan.num_stages, self.chunks, self.virtual)

    def module(self, loss='softmax', data_name=DATA_NAME, label_name=LABEL_NAME, output=None,
               host_copy=False, **kwargs):
        """An ``mx.mod.Module`` bound to the stages' devices (see
        :class:`~mp_symbolic.core.engine.module.PipelineModule`); ``fit``, ``score``,
        ``predict`` and ``save_checkpoint`` work as on any Module.

        Args:
            loss: ``'l2'``, ``'softmax'``, ``'logistic'``, a callable
                ``(prediction, label) -> Symbol`` (for several outputs:
                ``(outputs, label)``), or ``None`` for an inference module
                with no label whose outputs are the network's, in order.
            data_name, label_name: Names of the input and label variables
                (default: ``mx.io.NDArrayIter``'s ``data`` and ``softmax_label``);
                a network of several inputs takes ``data0``, ``data1``, ...
            output: For a network of several outputs, the one the loss reads
                (see :meth:`training_symbol`).
            host_copy: Keep ``mx.mod.Module``'s host copy of every parameter
                (on ``cpu(0)``). By default the stages' devices hold the only
                copy; ``get_params`` and checkpoints gather a fresh one.
            buckets: The bucket keys the Module takes, declared ahead (a
                batch of another ``bucket_key`` is refused), or ``None``
                (any): a batch with a ``bucket_key`` and ``provide_data``,
                as ``mx.mod.BucketingModule`` reads it, runs on executors
                bound at its shapes on the key's first batch, sharing the
                default bucket's parameters, gradients and optimizer
                (:mod:`~mp_symbolic.core.engine.buckets`).
            **kwargs: Passed to ``mx.mod.Module`` (``logger``,
                ``fixed_param_names``, ``compression_params``, ...).
        """
        from .engine.module import PipelineModule  # pylint: disable=import-outside-toplevel
        return PipelineModule(self, loss=loss, data_name=data_name, label_name=label_name,
                              output=output, host_copy=host_copy, **kwargs)

    def infer_shape(self, data_shape, data_name=DATA_NAME):
        """Fills in parameter shapes not known yet from one input shape.

        Raises:
            ValueError: MXNet cannot infer the shapes from ``data_shape``.
        """
        return graph.infer_shapes(self.blocks, data_shape, data_name)

    # -- imperative twin -----------------------------------------------------

    @symbol_safe
    def forward(self, x, *more):  # pylint: disable=arguments-differ
        """Runs the blocks stage by stage, moving ``x`` to each stage's device;
        with replicas, each replica a share of the batch, with chunks, as
        micro-batches (see :func:`mp_symbolic.core.engine.twin.forward`). Returns the
        whole batch's output on the last stage of the first replica (a tuple,
        for a network of several outputs, nested as the network returns
        them: GluonNLP's language model gives ``(out, [h, c])``). A network
        of several inputs takes them all: ``pipe(x0, x1, ...)``, each batch
        on ``batch_axis``, nested as ``sample`` was (``pipe(x, [h, c])``).

        On a Symbol, returns the tagged inference graph (one chunk); the
        Symbol's own nodes go to the first stage unless they name a stage.

        Raises:
            TypeError: ``x`` is neither an NDArray nor a Symbol, or the
                inputs are not nested as the sample was.
            ValueError: the batch is not a multiple of ``chunks x replicas``,
                or a node of the Symbol names a ``ctx_group`` the plan lacks;
                in training, ``batchnorm='deferred'`` with ``chunks > 1``.
            RuntimeError: on NDArrays, a parameter not initialised yet
                (neither :meth:`initialize` nor :meth:`set_params` called).
        """
        placement = self.placement
        if self.nodes is not None and not isinstance(x, mx.sym.Symbol):
            raise node_processes.NodeError(
                'nodes: expected the imperative twin in one process, found a Pipeline over %d '
                'nodes (train it through pipe.module(...))' % self.nodes.count)
        leaves = self._input_leaves((x,) + more)
        if isinstance(x, mx.sym.Symbol):
            placed = graph.on_inputs(graph.build(placement, placement.input_names, 1), leaves,
                                     placement)
            return passes.finish(placed, placement).to_symbol()
        self._check_initialized()
        if self.batchnorm != batchnorms.DEFAULT and placement.chunks > 1 and \
                mx.autograd.is_training():
            raise ValueError("batchnorm: expected %r for the imperative twin in training with "
                             "chunks > 1 (it updates the statistics per micro-batch), found %r; "
                             "train it through pipe.module(...)" % (batchnorms.DEFAULT,
                                                                     self.batchnorm))
        return twin.forward(placement, *leaves, order=self._forwards)

    def _check_initialized(self):
        """Raises RuntimeError in one line while a parameter has no values
        (nor a deferred initialisation) on any device, where Gluon would
        raise its own of several lines from inside the first stage."""
        if getattr(self, '_ready', False):
            return
        params = list(self.collect_params().values())
        missing = [param.name for param in params if not initialized(param)]
        if missing:
            raise RuntimeError('parameters: expected them initialized before the twin runs '
                               '(call pipe.initialize(), or pipe.set_params(arg_params, '
                               'aux_params) with saved values), found %d of %d not initialized '
                               '(%s)' % (len(missing), len(params),
                                         excerpt(', '.join(missing))))
        self._ready = True

    @property
    def inputs(self):
        """The positional inputs as nested names, as the network takes them:
        ``('data',)`` for one input, ``('data0', ['data1', 'data2'])`` for
        GluonNLP's ``(inputs, begin_state)``."""
        return self.placement.positional_inputs

    @property
    def batch_axis(self):
        """The axis of the batch in every input and output (as given)."""
        return self.placement.batch_axis

    def _input_leaves(self, args):
        """The leaves of the positional ``args``, in order, checked to be
        nested as :attr:`inputs` (a flat network's count is the twin's to
        check, in its own words).

        Raises:
            TypeError: they are nested otherwise.
            ValueError: they nest deeper than
                :data:`~mp_symbolic.core.graph.nesting.MAX_DEPTH`, or a list holds itself.
        """
        nesting.check(tuple(args), 'inputs')
        leaves, given = nesting.flatten(tuple(args))
        _, expected = nesting.flatten(self.inputs, lambda v: isinstance(v, str))
        if nesting.alike(given, expected) or nesting.is_flat(expected) and nesting.is_flat(given):
            return leaves
        raise TypeError('inputs: expected %s, nested as %s, found %s'
                        % (nesting.describe(expected, iter(self.input_names)),
                           'one input without sample=' if self.placement.sample_shapes is None
                           else 'sample= has them', nesting.describe_value(tuple(args))))

    def initialize(self, init=mx.init.Uniform(), ctx=None, verbose=False,
                   force_reinit=False):
        """Initialises (or moves) each parameter on its stage's device, one
        copy per replica.

        Parameters already initialised elsewhere keep their values and move.
        Layers without their input size finish on the first forward pass.
        Each value drawn is a function of MXNet's random state at the call
        and the parameter's (unsplit) name only, as ``init_params`` draws it
        (:mod:`~mp_symbolic.core.optim.initial`).

        Raises:
            ValueError: ``ctx`` is given (the plan decides placement).
        """
        if ctx is not None:
            raise ValueError('ctx: expected None (a Pipeline places each stage on its own '
                             'device), found %r' % (ctx,))
        drawn = initial.Drawn(mx.init.create(init), self.sharded)
        try:
            for _, param in self._params_of_stage():
                devices = self.placement.devices_of(param.name)
                if not force_reinit and initialized(param):
                    if param.list_ctx() != devices:
                        param.reset_ctx(devices)
                    continue
                param.initialize(None, ctx=devices, default_init=drawn,
                                 force_reinit=force_reinit)
        finally:
            drawn.close()
        if verbose:
            for line in self.describe():
                print(line)

    def set_params(self, arg_params, aux_params=None, allow_missing=False):
        """Places the given values: each parameter on its stage's device (on
        each replica's).

        Args:
            arg_params, aux_params: Name -> NDArray or numpy array (as
                ``mx.model.load_checkpoint`` returns them); a tensor-parallel
                layer's parameters by their unsplit names and shapes (or by
                their shard names).
            allow_missing: Set those given only; the other parameters keep
                their values (they must be initialised).

        Raises:
            ValueError: a parameter has no value (without ``allow_missing``),
                or a value of another shape.
        """
        values = dict(arg_params)
        values.update(aux_params or {})
        values = tensor_parallel.split_params(values, self.sharded)
        for _, param in self._params_of_stage():
            if param.name not in values and allow_missing:
                continue
            if param.name not in values:
                raise ValueError('expected a value for every parameter, found none for %s'
                                 % param.name)
            value = values[param.name]
            value = value if isinstance(value, mx.nd.NDArray) else mx.nd.array(value)
            known = param.shape
            if known is not None and any(known) and (
                    len(known) != len(value.shape)
                    or any(k not in (0, v) for k, v in zip(known, value.shape))):
                raise ValueError('%s: expected shape %s, found %s'
                                 % (param.name, known, value.shape))
            devices = self.placement.devices_of(param.name)
            if not initialized(param):
                param.shape = value.shape
                param.initialize(None, ctx=devices, default_init=mx.init.Zero())
            elif param.list_ctx() != devices:
                param.reset_ctx(devices)
            param.set_data(value.astype(param.dtype))

    def get_params(self, lazy=False):
        """``(arg_params, aux_params)`` of the initialised parameters, on ``cpu()``.

        Auxiliary states are those the symbol lists as such (BatchNorm's
        running statistics). A tensor-parallel layer's parameters are
        gathered: their unsplit names and shapes, whatever the shards.

        Args:
            lazy: Each value a function of no arguments making that one
                array on the host (numpy, the same bits) when called, not
                the array: a caller taking them one at a time holds one
                array at a time.
        """
        aux_names = set(self.symbol().list_auxiliary_states())
        arg_params, aux_params = {}, {}
        for param in self.collect_params().values():
            data = param.data(param.list_ctx()[0])
            value = data.asnumpy if lazy else data.copyto(mx.cpu())
            (aux_params if param.name in aux_names else arg_params)[param.name] = value
        if lazy:
            if aux_params:  # the running statistics' last update done before they are read
                mx.nd.waitall()
            return tensor_parallel.gather_made(arg_params, self.sharded), aux_params
        return tensor_parallel.gather_params(arg_params, self.sharded), aux_params

    def gather_params(self, values):
        """``values`` (name -> array) with the shards of each tensor-parallel
        parameter joined into the unsplit parameter (on ``cpu()``)."""
        return tensor_parallel.gather_params(values, self.sharded)

    def split_params(self, values):
        """``values`` with each unsplit tensor-parallel parameter split into
        this Pipeline's shards (the inverse of :meth:`gather_params`).

        Raises:
            ValueError: an unsplit value of another shape than its layer's.
        """
        return tensor_parallel.split_params(values, self.sharded)

    def __repr__(self):
        lines = self.describe() + (self.sharding.lines() if self.sharding else [])
        return 'Pipeline(\n  %s\n)' % '\n  '.join(lines)
