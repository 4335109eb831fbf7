"""``Pipeline``: any Gluon network split into stages on several devices.

Every op, parameter variable and auxiliary state of stage ``s`` is tagged
``ctx_group='stage<s>'`` (shard ``i`` of a tensor-parallel layer
``stage<s>_shard<i>``), and MXNet's graph executor, bound with
``group2ctx``, puts each stage on its device and copies between them
(docs/how-it-works.md). The same object is the imperative twin, a Gluon
``Block`` (:mod:`~mp_symbolic.core.engine.twin`). The plan is one frozen
:class:`~mp_symbolic.core.placement.place.Placement`; the graphs are built
from it (:mod:`~mp_symbolic.core.graph.build`).
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
from .placement.place import check_parameter_names, place, replica_devices, sample_inputs
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
        blocks: ``HybridBlock`` s in order (or a ``HybridSequential``), each
            taking one input and returning one output; or one ``HybridBlock`` of
            any shape, whose traced graph is cut into one range of ops a stage.
        devices: ``'cpu:0,cpu:1'`` or a list of ``mx.Context``: one device per
            stage, times ``replicas``; a stage of several devices (its
            tensor-parallel shards): ``'cpu:0+cpu:1,cpu:2'``, or a tuple in the
            list.
        balance: ``None`` (by parameter count), blocks (ops, for a whole
            network) per stage, each at least 1, or ``'time'`` (by each block's
            or op's forward and backward time on ``sample``). A whole network's
            cut is, among those within 10% of the best balance, the one with
            the fewest activation bytes crossing.
        sample: A batch or its shape, for ``balance='time'`` and shapes not known
            yet; several inputs as a tuple (``data0``, ``data1``, ...), a list
            input (GluonNLP's ``begin_state``) as a list: ``sample=(x, [h0, c0])``
            then ``pipe(x, [h, c])``. Needed for a whole network whose shapes
            are not known; sizes at least 1, lists at most 32 deep.
        chunks: Micro-batches per batch (GPipe); the batch size must be a
            multiple of ``chunks * replicas``.
        replicas: Data-parallel copies; ``devices`` lists ``replicas x stages``
            devices, replica by replica.
        mirror: ``True`` or stage indices whose outputs the backward pass
            recomputes (MXNet's ``__force_mirroring__``).
        tied: ``{parameter name: stage}`` to hold a parameter several stages
            read (default the first); the others read it through an
            ``identity`` there, its gradient the sum over its uses.
        tensor_parallel: ``None`` (only the network's own tensor-parallel
            layers), ``'auto'`` (its ``Dense`` layers and attention blocks
            sharded over a stage's devices Megatron-LM's way:
            :mod:`~mp_symbolic.core.parallel.autotp`) or ``{fnmatch pattern:
            'column' | 'row' | 'vocab' | 'replicate'}`` over block or parameter
            names, the first match deciding. ``blocks`` is changed in place,
            names and values kept; ``print(pipe)`` says what was sharded.
        schedule: The training step's order: ``'gpipe'`` (every forward, then
            every backward), ``'1f1b'`` (stage ``s`` of ``K`` keeps at most
            ``K - s`` micro-batches), ``'interleaved'`` (Megatron-LM's,
            ``chunks`` a multiple of the ``K`` devices), or a function of
            ``(num_stages, microbatches)`` returning one list of
            :class:`~mp_symbolic.Action` s per device, checked as
            :func:`~mp_symbolic.core.schedule.make` says. The twin runs its
            forwards in its order.
        virtual: Stages per device (default 2 under ``'interleaved'``, 1 under a
            function; refused under the others): the network is cut into
            ``virtual x K`` stages, stage ``s`` on device ``s mod K``.
        nodes: ``None`` or 1: one process. ``N``: each replica's devices dealt
            evenly and in order over N node processes, each binding and holding
            only its stages (``gpu:0`` of node 1 is node 1's GPU), boundary
            tensors crossing by torch.distributed
            (:mod:`~mp_symbolic.core.transport.nodes`). Each node builds the same
            Pipeline, its rank and rendezvous from torchrun's variables
            (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``); the
            Module's outputs and metric are the last node's.
        node_timeout: Seconds a node waits on another before it ends (300).
        batch_axis: The batch's axis in every input and output, a non-negative
            integer: 0, or 1 for GluonNLP's ``TNC`` layout; micro-batches and
            replicas split and join on it everywhere.
        batchnorm: ``'micro-batch'`` (the Module's step updates BatchNorm's
            running statistics per micro-batch) or ``'deferred'`` (once per
            batch with the whole batch's, as torchgpipe's
            ``deferred_batch_norm``: :mod:`~mp_symbolic.core.graph.batchnorm`;
            the twin does not train with it and several chunks).
        transport: The stage runtime's transport
            (:mod:`~mp_symbolic.core.transport.comm`): ``None`` (``'local'`` in
            one process, ``'gloo'`` over nodes) or a registered name; only
            ``'local'`` under ``'gpipe'`` in one process.
        shard_optimizer: A bool, ZeRO-1 (:mod:`~mp_symbolic.core.optim.zero`):
            each of a stage's replicas (times the ``dist_sync`` workers) updates
            the optimizer state of its share of the parameters and sends the
            values to the others, bit for bit the unsharded run's; checkpoints
            hold the whole state.
        plan: ``None``, or ``'auto'``: the planner chooses the devices used,
            ``balance``, ``chunks``, ``replicas``, ``mirror``, ``schedule``,
            ``virtual`` and ``shard_optimizer`` from the memory estimate and
            stage times measured on ``devices``, for a softmax head and SGD with
            momentum (a :class:`~mp_symbolic.core.planning.planner.Planner`: for
            its loss, optimizer and space); those arguments left at their
            defaults (``tensor_parallel``: ``None`` or ``'auto'``), ``sample``
            given. Scoring the candidates leaves ``blocks`` as they are.
        memory_per_device: With ``plan``, the bytes a device may hold (an int,
            ``'2GiB'``, ``'512MB'``); ``None``: the fastest plan.

    Attributes:
        blocks, placement: The blocks in order; the
            :class:`~mp_symbolic.core.placement.place.Placement` (what runs where,
            which the attributes read).
        plan: The :class:`~mp_symbolic.core.placement.devices.DevicePlan`.
        balance, tied, whole, cut, sharding, inputs: Blocks (ops) per stage;
            ``{parameter: (owning stage, readers)}``; whether a whole network was
            cut, and its :class:`~mp_symbolic.core.graph.graphcut.Cut`; what
            ``tensor_parallel`` did, or ``None``; the inputs as nested names.
        chunks, replicas, schedule, virtual, batch_axis: As given or defaulted.
        batchnorm, transport, shard_optimizer: As given or defaulted.
        planned: With ``plan``, the candidates'
            :class:`~mp_symbolic.core.planning.planner.Ranking`, else ``None``.

    Raises:
        TypeError: a block is not a ``HybridBlock``.
        ValueError: an argument that cannot work as its entry above says, in
            one line naming it; ``DeviceSpecError``, ``BalanceError``,
            ``ScheduleError``, ``NodeError`` (no rendezvous, more nodes than
            devices per replica, a device twice on a node, ``balance='time'``,
            plans that differ) and ``PlanError`` (no candidate fits the budget)
            among them.
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
        # the one check of virtual, before any node waits: the stages per device
        per_device = schedules.check_spec(schedule, virtual)
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
        split = replica_devices(devices, replicas, self.nodes)
        devices_per_replica = len(split[0][0])
        self.placement = place(self.blocks, whole, split,
                               schedules.round_robin(devices_per_replica, per_device),
                               balance, sample, chunks, replicas, mirror, tied, batch_axis,
                               sample_checked=tensor_parallel is not None, virtual=per_device)
        # made once, with its virtual stages; a schedule that cannot run is refused here
        self._schedule = schedules.make(schedule, devices_per_replica * per_device, chunks,
                                        per_device)
        self._forwards = self._schedule.forwards()
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
        """The plan, one line per stage: its device(s), blocks (ops) and parameter
        counts; for a whole network, its ops and parameters, and the activation
        bytes per sample that cross to the next stage."""
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
        """The graph with its loss head (:func:`mp_symbolic.core.graph.heads.make_head`).

        Args:
            loss: A loss head; ``None``: the network's outputs, no label.
            chunks: Micro-batches; ``None``: the Pipeline's.
            output: For several outputs, the one a named loss reads; the graph's
                outputs are then the head and the others in order, through
                ``BlockGrad``. A callable loss receives them all.
            unsplit: Tensor-parallel layers unsplit, with their unsplit parameter
                names and shapes: the graph a checkpoint holds.

        Raises:
            ValueError: ``output`` missing or out of range for several outputs,
                or given for one.
        """
        return self.training_graph(loss, data_name, label_name, chunks, output,
                                   unsplit).to_symbol()

    @symbol_safe
    def training_graph(self, loss, data_name=DATA_NAME, label_name=LABEL_NAME, chunks=None,
                       output=None, unsplit=False, shares=1):
        """:meth:`training_symbol`'s graph, a
        :class:`~mp_symbolic.core.graph.ir.PlacedGraph`; ``shares``: the parts of a
        step's batch it is bound to, which divide the ``grad_scale`` of a head whose
        gradient divides by the batch
        (:func:`~mp_symbolic.core.graph.heads.scaled_heads`): its gradients are then
        one device's on the unsplit batch. Raises as :meth:`training_symbol`."""
        chunks = self.chunks if chunks is None else chunks
        placed = graph.build(self.placement, self.data_names(data_name), chunks, unsplit)
        if loss is not None:
            placed = with_head(placed, loss, label_name, output,
                               stage_name(self.plan.num_stages - 1),
                               shares=shares, batch_axis=self.batch_axis)
        return passes.finish(placed, self.placement)

    @property
    def devices_per_replica(self):
        """``K``: the distinct devices of one replica's stages (its schedule's
        device lists)."""
        return len(self._schedule)

    @property
    def virtual(self):
        """Stages per device: the schedule's."""
        return self._schedule.virtual

    def run_schedule(self):
        """The :class:`~mp_symbolic.core.schedule.Schedule` each replica runs
        (``'gpipe'``'s fused graph leaves its order to MXNet's engine), made
        once when the Pipeline is: a schedule function is called once."""
        return self._schedule

    def module(self, loss='softmax', data_name=DATA_NAME, label_name=LABEL_NAME, output=None,
               host_copy=False, **kwargs):
        """An ``mx.mod.Module`` on the stages' devices
        (:class:`~mp_symbolic.core.engine.module.PipelineModule`): ``fit``,
        ``score``, ``predict``, ``save_checkpoint`` work as on any Module.

        Args:
            loss: ``'l2'``, ``'softmax'``, ``'logistic'``, a callable ``(prediction,
                label) -> Symbol`` (``(outputs, label)`` for several), or ``None``:
                an inference module, no label, the network's outputs.
            data_name, label_name: The input's and label's names (default
                ``mx.io.NDArrayIter``'s); several inputs are ``data0``, ``data1``, ...
            output: For several outputs, the one the loss reads
                (:meth:`training_symbol`).
            host_copy: Keep ``mx.mod.Module``'s copy of every parameter on
                ``cpu(0)``; otherwise ``get_params`` and checkpoints gather one.
            buckets: The bucket keys taken (another is refused), or ``None`` (any):
                a batch's ``bucket_key`` and ``provide_data`` run on executors bound
                at its shapes, sharing the default bucket's parameters, gradients
                and optimizer (:mod:`~mp_symbolic.core.engine.buckets`).
            **kwargs: Passed to ``mx.mod.Module`` (``logger``,
                ``fixed_param_names``, ``compression_params``, ...).
        """
        from .engine.module import PipelineModule  # pylint: disable=import-outside-toplevel
        return PipelineModule(self, loss=loss, data_name=data_name, label_name=label_name,
                              output=output, host_copy=host_copy, **kwargs)

    def infer_shape(self, data_shape, data_name=DATA_NAME):
        """Fills in parameter shapes not known yet from one input shape.

        Raises:
            ValueError: MXNet cannot infer them from ``data_shape``.
        """
        return graph.infer_shapes(self.blocks, data_shape, data_name)

    # -- imperative twin -----------------------------------------------------

    @symbol_safe
    def forward(self, x, *more):  # pylint: disable=arguments-differ
        """The imperative twin's forward pass (:func:`mp_symbolic.core.engine.twin.forward`):
        the batch's output on the first replica's last stage, nested as the network
        returns it. Several inputs are given as ``sample`` nests them
        (``pipe(x, [h, c])``). On a Symbol: the tagged inference graph of one chunk,
        its own nodes on the first stage unless they name one.

        Raises:
            TypeError: ``x`` is neither an NDArray nor a Symbol, or the inputs are
                nested otherwise than ``sample``.
            ValueError: a batch not a multiple of ``chunks x replicas``; a Symbol's
                node naming a ``ctx_group`` the plan lacks; training with
                ``batchnorm='deferred'`` and ``chunks > 1``.
            NodeError: a Pipeline over nodes (it trains through :meth:`module`).
            RuntimeError: on NDArrays, a parameter not initialised.
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
        """Raises RuntimeError in one line while a parameter has neither values nor
        a deferred initialisation (Gluon's own error spans several lines)."""
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
        """The leaves of ``args`` in order, checked to nest as :attr:`inputs` (a flat
        network's count is the twin's to check): TypeError where they nest
        otherwise, ValueError deeper than
        :data:`~mp_symbolic.core.graph.nesting.MAX_DEPTH` or a list holding itself."""
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
        """Initialises each parameter on its stage's device, one copy per replica;
        one initialised already keeps its values and moves there, and a layer
        without its input size finishes on the first forward pass. Each value
        drawn depends only on MXNet's random state at the call and the
        parameter's unsplit name (:mod:`~mp_symbolic.core.optim.initial`).

        Raises:
            ValueError: ``ctx`` is given (the plan places the parameters).
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
        """Places the values, each parameter on its stage's device(s).

        Args:
            arg_params, aux_params: Name -> NDArray or numpy array, as
                ``mx.model.load_checkpoint`` returns them; tensor-parallel
                parameters by their unsplit names and shapes, or by shard.
            allow_missing: Set those given; the others keep their values (they
                must be initialised).

        Raises:
            ValueError: a parameter without a value (unless ``allow_missing``),
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
        """``(arg_params, aux_params)`` on ``cpu()``, tensor-parallel parameters
        gathered to their unsplit names and shapes.

        Args:
            lazy: Each value a function making that one numpy array when called,
                so that a caller holds one at a time.
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
        """``values`` with each unsplit tensor-parallel parameter split into shards
        (:meth:`gather_params`'s inverse).

        Raises:
            ValueError: an unsplit value of another shape than its layer's.
        """
        return tensor_parallel.split_params(values, self.sharded)

    def __repr__(self):
        lines = self.describe() + (self.sharding.lines() if self.sharding else [])
        return 'Pipeline(\n  %s\n)' % '\n  '.join(lines)
