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
(:mod:`~mp_symbolic.core.graphcut`). A parameter read by several stages (tied
weights) lives on one stage and the others read it through an ``identity``
op there.

A stage may hold several devices (``'cpu:0+cpu:1,cpu:2'``): its
tensor-parallel layers (:mod:`~mp_symbolic.core.tensor_parallel`) then put
shard ``i`` on the stage's device ``i``, in ``ctx_group``
``stage<s>_shard<i>``; everything else in the stage runs on its first device.
Where users see parameters (``get_params``, ``set_params``, checkpoints) a
split layer has its unsplit names and shapes.

The same object is the imperative twin: a Gluon ``Block`` whose parameters
live on their stage's device and whose forward pass moves activations between
devices (autograd records those copies, so gradients flow back across them);
with replicas and chunks too (:mod:`~mp_symbolic.core.twin`), trained by
:class:`~mp_symbolic.Trainer`.

This module validates and holds the plan; the graphs are built in
:mod:`~mp_symbolic.core.graph`, the imperative forward pass runs in
:mod:`~mp_symbolic.core.twin`, blocks are balanced by
:mod:`~mp_symbolic.core.balance` and devices resolved by
:mod:`~mp_symbolic.core.devices`.
"""
import json

import mxnet as mx
from mxnet import gluon
import numpy as np

from . import balance as balancing
from . import graph, graphcut, tensor_parallel, twin
from .graph import DATA_NAME, LABEL_NAME
from .compat import symbol_safe
from .heads import make_head
from .devices import (DeviceSpecError, DevicePlan, resolve_devices, shard_group,
                      split_replicas, stage_name)

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
            (:mod:`~mp_symbolic.core.graphcut`).
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
            boundary.
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

    Attributes:
        blocks: The blocks, in order.
        plan: The :class:`~mp_symbolic.core.devices.DevicePlan`.
        balance: Blocks per stage (ops per stage for a whole network).
        chunks, replicas: As given.
        whole: Whether one whole network was cut (then ``cut`` is its
            :class:`~mp_symbolic.core.graphcut.Cut`).
        tied: ``{parameter name: (owning stage, stages that read it)}``.

    Raises:
        TypeError: a block is not a ``HybridBlock``.
        ValueError: (``DeviceSpecError``, ``BalanceError``) devices, balance,
            chunks or replicas that cannot work; a ``tied`` entry that is
            not a parameter and a stage; a whole network without ``sample``
            whose shapes are not known; a stage of several devices whose
            count is not the shards of a tensor-parallel layer in it.
    """

    @symbol_safe
    def __init__(self, blocks, devices, balance=None, sample=None, chunks=1, replicas=1,
                 mirror=False, tied=None):
        super().__init__(prefix='pipeline_')
        # One HybridBlock (not a HybridSequential) is split by a graph cut.
        self.whole = isinstance(blocks, gluon.HybridBlock) and \
            not isinstance(blocks, gluon.nn.HybridSequential)
        self.cut = None
        self.blocks = tuple(_as_blocks(blocks))
        for i, block in enumerate(self.blocks):
            self.register_child(block, 'block%d' % i)
        if devices is None:
            raise DeviceSpecError("devices: expected a device list such as 'cpu:0,cpu:1' or a "
                                  'list of mx.Context, found None')
        replica_devices = split_replicas(resolve_devices(devices), replicas)
        num_stages = len(replica_devices[0])
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError('chunks: expected a positive integer, found %r' % (chunks,))
        self.chunks, self.replicas = chunks, replicas
        self.mirror = tuple(range(num_stages)) if mirror is True else tuple(mirror or ())
        if any(not isinstance(st, int) or not 0 <= st < num_stages for st in self.mirror):
            raise ValueError('mirror: expected True or stage indices below %d, found %r'
                             % (num_stages, mirror))
        self._sample_shape = None
        if sample is not None:
            self._sample_shape = tuple(sample) if isinstance(sample, (tuple, list)) \
                else tuple(sample.shape)
            self.infer_shape(self._sample_shape)
        if self.whole:
            self.cut = self._cut_graph(balance, num_stages, tied)
            stage_of = self.cut.stage_of_op
        else:
            stage_of = balancing.stage_of_block(
                self._solve_balance(balance, num_stages, sample, replica_devices[0]))
        self.plan = DevicePlan(replica_devices[0], stage_of, replica_devices)
        self._owner = self._owners(tied)
        self._borrowed = None  # {stage: [(tied parameter, owning stage)]}, made on first use
        self.sharded = tensor_parallel.layout(self.blocks)
        self._shard_of = self._shard_devices()

    # -- planning ------------------------------------------------------------

    def _solve_balance(self, balance, num_stages, sample, devices):
        if num_stages > len(self.blocks):
            raise DeviceSpecError('too many devices for the blocks (devices per replica: %d, '
                                  'blocks: %d); expected at most one device per block'
                                  % (num_stages, len(self.blocks)))
        if balance is None:
            return balancing.balance_by_size(self.blocks, num_stages)
        if isinstance(balance, str):
            if balance != 'time':
                raise balancing.BalanceError("balance: expected None, 'time' or a list of "
                                             'blocks per stage, found %r' % balance)
            if sample is None:
                raise balancing.BalanceError("balance='time': expected sample= (a batch or "
                                             'its shape) to time the blocks on, found none')
            # timed on the first stage's device: the kind of device the stages run on
            return balancing.balance_by_time(self.blocks, self._sample_shape, devices[0],
                                             partitions=num_stages)
        return balancing.check_balance(balance, len(self.blocks), num_stages)

    def _cut_graph(self, balance, num_stages, tied):
        self._reset_variables()
        with tensor_parallel.mark_shards():
            symbol = self.blocks[0](mx.sym.var(DATA_NAME))
        self._reset_variables()
        shapes = {name: param.shape for name, param in self.collect_params().items()}
        if self._sample_shape is None and any(
                shape is None or not all(shape) for shape in shapes.values()):
            raise ValueError('sample: expected a batch or its shape to split a whole network '
                             'whose parameter shapes are not known yet, found none')
        try:
            return graphcut.Cut(symbol, num_stages, balance, self._sample_shape, shapes,
                                tied, DATA_NAME)
        except graphcut.CutError as err:
            if 'too many devices' in str(err):
                raise DeviceSpecError(str(err)) from None
            raise balancing.BalanceError(str(err)) from None

    def _shard_devices(self):
        """``{parameter name: index of its device in its stage}`` for the
        shards of tensor-parallel layers; others are on the stage's first."""
        widths = [self.plan.width(s) for s in range(self.plan.num_stages)]
        shard_of = {}
        if self.whole:
            try:
                graph = self._labelled()
            except ValueError as err:
                raise DeviceSpecError(str(err)) from None
            groups = {shard_group(s, i): (s, i) for s, w in enumerate(widths) for i in range(w)}
            for node in graph['nodes']:
                attrs = node.get('attrs', {})
                if node['op'] == 'null' and tensor_parallel.SHARD_ATTR in attrs \
                        and node['name'] in self._owner:
                    # a shard's weight goes where shard_groups put its layer
                    self._owner[node['name']], shard_of[node['name']] = \
                        groups[attrs[graphcut.GROUP_ATTR]]
            return shard_of
        for block, stage in zip(self.blocks, self.plan.stage_of_block):
            for layer in tensor_parallel.sharded_blocks(block):
                try:
                    indices = layer.device_indices(widths[stage])
                except ValueError as err:
                    raise DeviceSpecError('%s in %s: %s' % (layer.name, stage_name(stage), err)) \
                        from None
                for index, params in zip(indices, layer._shard_params):  # pylint: disable=protected-access
                    for param in params.values():
                        # a tied parameter sits where its owning stage puts it
                        if self._owner[param.name] == stage or param.name not in shard_of:
                            shard_of[param.name] = index
        return shard_of

    def _labelled(self, mirror=()):
        """The cut graph labelled by stage, each tensor-parallel shard in its group
        (weights that moved away from a reader then read through an identity)."""
        graph = self.cut.labelled(mirror)
        if not any(tensor_parallel.SHARD_ATTR in n.get('attrs', {}) for n in graph['nodes']):
            return graph
        return graphcut.tie_parameters(tensor_parallel.shard_groups(
            graph, [self.plan.width(s) for s in range(self.plan.num_stages)]))

    def _unsplit_labelled(self):
        """The whole network traced with its tensor-parallel layers unsplit (as
        checkpoints hold it), each node in the stage its split form has: by
        name, and a layer's unsplit ops and weights in its shards' stage."""
        self._reset_variables()
        with tensor_parallel.unsplit():
            graph = json.loads(self.blocks[0](mx.sym.var(DATA_NAME)).tojson())
        self._reset_variables()
        split = self._labelled()['nodes']
        stage = {shard_group(s, i): s for s in range(self.plan.num_stages)
                 for i in range(self.plan.width(s))}
        stage_of = {n['name']: stage[n['attrs'][graphcut.GROUP_ATTR]] for n in split}
        layers = {}
        for node in split:
            mark = node.get('attrs', {}).get(tensor_parallel.SHARD_ATTR)
            if mark is not None:
                layers.setdefault(mark.split('/', 2)[2] + '_', stage_of[node['name']])
        for node in graph['nodes']:
            name = node['name']
            where = stage_of.get(name)
            if where is None:
                where = next((s for layer, s in layers.items() if name.startswith(layer)), 0)
            node.setdefault('attrs', {})[graphcut.GROUP_ATTR] = stage_name(where)
        return graphcut.tie_parameters(graph)

    def _cut_layout(self):
        """``(op names of each stage, {variable: stages whose ops read it})`` of
        the labelled cut graph (shards moved to their layer's stage)."""
        if not self._shard_of:
            return ([self.cut.ops_of_stage(s) for s in range(self.plan.num_stages)],
                    self.cut.readers)
        nodes = self._labelled()['nodes']
        stage = {shard_group(s, i): s for s in range(self.plan.num_stages)
                 for i in range(self.plan.width(s))}
        ops, readers = [[] for _ in range(self.plan.num_stages)], {}
        for node in nodes:
            if node['op'] == 'null':
                continue
            st = stage[node['attrs'][graphcut.GROUP_ATTR]]
            if not node['name'].endswith('_tied'):
                ops[st].append(node['name'])
            for src, _, _ in node['inputs']:
                source = nodes[src]
                if source['op'] == 'null':
                    readers.setdefault(source['name'], [])
                    if st not in readers[source['name']]:
                        readers[source['name']].append(st)
        return ops, readers

    def _device_of(self, name, replica=0):
        """Device of parameter ``name`` in replica ``replica``: its stage's, or
        its shard's."""
        stage = self._owner[name]
        return self.plan.stage_devices[replica][stage][self._shard_of.get(name, 0)]

    def _devices_of(self, name):
        """The devices of parameter ``name``'s copies, one per replica."""
        return [self._device_of(name, r) for r in range(self.plan.num_replicas)]

    def _owners(self, tied):
        """``{parameter name: owning stage}``: the first stage that reads it,
        unless ``tied`` says otherwise."""
        if self.whole:
            owner = {n: s for n, s in self.cut.owner.items() if n != DATA_NAME}
            for name in self.collect_params():
                owner.setdefault(name, 0)  # a parameter the forward pass does not use
            return owner
        owner = {}
        for block, stage in zip(self.blocks, self.plan.stage_of_block):
            for name in block.collect_params():
                owner.setdefault(name, stage)
        for name, stage in (tied or {}).items():
            if name not in owner:
                raise ValueError('tied: expected parameter names of the blocks, found %r'
                                 % (name,))
            if not isinstance(stage, int) or isinstance(stage, bool) or \
                    not 0 <= stage < self.plan.num_stages:
                raise ValueError('tied: expected a stage index below %d for %s, found %r'
                                 % (self.plan.num_stages, name, stage))
            owner[name] = stage
        return owner

    @property
    def tied(self):
        """``{parameter name: (owning stage, [stages that read it])}`` of every
        parameter read by more than one stage."""
        readers = {}
        if self.whole:
            readers = {n: list(r) for n, r in self._cut_layout()[1].items() if n != DATA_NAME}
        else:
            for block, stage in zip(self.blocks, self.plan.stage_of_block):
                for name in block.collect_params():
                    readers.setdefault(name, [])
                    if stage not in readers[name]:
                        readers[name].append(stage)
        return {n: (self._owner[n], sorted(r)) for n, r in readers.items()
                if len(set(r) | {self._owner[n]}) > 1}

    @property
    def balance(self):
        """Blocks per stage (ops per stage for a whole network)."""
        return self.plan.balance

    @property
    def stages(self):
        """The blocks of each stage: ``stages[s]`` is a list (op names for a
        whole network)."""
        if self.whole:
            return self._cut_layout()[0]
        return [[b for b, st in zip(self.blocks, self.plan.stage_of_block) if st == s]
                for s in range(self.plan.num_stages)]

    @property
    def stage_names(self):
        """Names of each stage's blocks (of its ops, for a whole network)."""
        return [[b if isinstance(b, str) else b.name for b in stage] for stage in self.stages]

    def _params_of_stage(self):
        """``[(owning stage, param)]`` for every parameter once, in block order."""
        return [(self._owner[name], param) for name, param in self.collect_params().items()]

    def describe(self):
        """The plan, one line per stage, with block names and parameter counts.

        For a whole network: per stage, its device(s), op count and parameter
        count, then its ops and its parameters, and after each stage but the
        last the activation bytes per sample that cross to the next.
        """
        if self.whole:
            return self._describe_cut()
        lines = []
        for s, blocks in enumerate(self.stages):
            devices = self.plan.stage_label(s)
            names = ', '.join(b.name for b in blocks)
            # each parameter once, on the stage it lives on (a tied one on its owner's)
            params = {n: p for b in blocks for n, p in b.collect_params().items()
                      if self._owner.get(n, s) == s}
            shapes = [p.shape for p in params.values()]
            if all(shape and all(d > 0 for d in shape) for shape in shapes):
                count = '%d parameters' % sum(int(np.prod(shape)) for shape in shapes)
            else:
                count = 'parameter count not known yet'
            lines.append('%s -> %s: %s (%s)' % (stage_name(s), devices, names, count))
        lines += ['tied: %s lives on %s, read by %s' % (
            name, stage_name(owner), ', '.join(stage_name(r) for r in readers))
                  for name, (owner, readers) in sorted(self.tied.items())]
        return lines

    def _describe_cut(self):
        cut, params = self.cut, self.collect_params()
        lines = []
        for s in range(self.plan.num_stages):
            devices = self.plan.stage_label(s)
            ops = self._cut_layout()[0][s]
            names = [n for n in params if self._owner.get(n) == s]
            count = sum(int(np.prod(params[n].shape)) for n in names)
            lines.append('%s -> %s: %d ops, %d parameter values' % (stage_name(s), devices,
                                                                    len(ops), count))
            lines.append('  ops: ' + ', '.join(ops))
            lines.append('  parameters: ' + (', '.join(names) or 'none'))
            if s + 1 < self.plan.num_stages:
                crossing = 'not known (no sample)' if cut.boundary_bytes is None else \
                    '%d bytes per sample' % cut.boundary_bytes[s]
                lines.append('  %s -> %s: %s' % (stage_name(s), stage_name(s + 1), crossing))
        lines += ['tied: %s lives on %s, read by %s' % (
            name, stage_name(owner), ', '.join(stage_name(r) for r in readers))
                  for name, (owner, readers) in sorted(self.tied.items())]
        return lines

    # -- symbolic ------------------------------------------------------------

    def _reset_variables(self):
        graph.reset_variables(self)

    @symbol_safe
    def symbol(self, data_name=DATA_NAME):
        """The inference graph: ``data`` -> prediction, every node tagged."""
        return graph.finish(graph.build(self, graph.data_variable(data_name), 1), self)

    @symbol_safe
    def training_symbol(self, loss, data_name=DATA_NAME, label_name=LABEL_NAME, chunks=None):
        """The graph with its loss head (see :func:`mp_symbolic.core.heads.make_head`).

        Args:
            chunks: Micro-batches; ``None``: the Pipeline's ``chunks``.
        """
        chunks = self.chunks if chunks is None else chunks
        prediction = graph.build(self, graph.data_variable(data_name), chunks)
        with mx.AttrScope(ctx_group=stage_name(self.plan.num_stages - 1)):
            head = make_head(loss, prediction, mx.sym.var(label_name))
        return graph.finish(head, self)

    def module(self, loss='softmax', data_name=DATA_NAME, label_name=LABEL_NAME, **kwargs):
        """An ``mx.mod.Module`` bound to the stages' devices (see
        :class:`~mp_symbolic.core.module.PipelineModule`); ``fit``, ``score``,
        ``predict`` and ``save_checkpoint`` work as on any Module.

        Args:
            loss: ``'l2'``, ``'softmax'``, ``'logistic'`` or a callable
                ``(prediction, label) -> Symbol``.
            data_name, label_name: Names of the input and label variables
                (default: ``mx.io.NDArrayIter``'s ``data`` and ``softmax_label``).
            **kwargs: Passed to ``mx.mod.Module`` (``logger``,
                ``fixed_param_names``, ``compression_params``, ...).
        """
        from .module import PipelineModule  # pylint: disable=import-outside-toplevel
        return PipelineModule(self, loss=loss, data_name=data_name, label_name=label_name,
                              **kwargs)

    def infer_shape(self, data_shape, data_name=DATA_NAME):
        """Fills in parameter shapes not known yet from one input shape.

        Raises:
            ValueError: MXNet cannot infer the shapes from ``data_shape``.
        """
        return graph.infer_shapes(self, data_shape, data_name)

    # -- imperative twin -----------------------------------------------------

    @symbol_safe
    def forward(self, x):  # pylint: disable=arguments-differ
        """Runs the blocks stage by stage, moving ``x`` to each stage's device;
        with replicas, each replica a share of the batch, with chunks, as
        micro-batches (see :func:`mp_symbolic.core.twin.forward`). Returns the
        whole batch's output on the last stage of the first replica.

        On a Symbol, returns the tagged inference graph (one chunk); the
        Symbol's own nodes go to the first stage unless they name a stage.

        Raises:
            TypeError: ``x`` is neither an NDArray nor a Symbol.
            ValueError: the batch is not a multiple of ``chunks x replicas``,
                or a node of the Symbol names a ``ctx_group`` the plan lacks.
        """
        if isinstance(x, mx.sym.Symbol):
            return graph.finish(graph.build(self, graph.on_first_stage(x, self), 1), self)
        return twin.forward(self, x)

    def initialize(self, init=mx.init.Uniform(), ctx=None, verbose=False,
                   force_reinit=False):
        """Initialises (or moves) each parameter on its stage's device, one
        copy per replica.

        Parameters already initialised elsewhere keep their values and move.
        Layers without their input size finish on the first forward pass.

        Raises:
            ValueError: ``ctx`` is given (the plan decides placement).
        """
        if ctx is not None:
            raise ValueError('ctx: expected None (a Pipeline places each stage on its own '
                             'device), found %r' % (ctx,))
        for _, param in self._params_of_stage():
            devices = self._devices_of(param.name)
            if not force_reinit and _is_initialized(param):
                if param.list_ctx() != devices:
                    param.reset_ctx(devices)
                continue
            param.initialize(None, ctx=devices, default_init=init, force_reinit=force_reinit)
        if verbose:
            for line in self.describe():
                print(line)

    def set_params(self, arg_params, aux_params=None):
        """Places the given values: each parameter on its stage's device (on
        each replica's).

        Args:
            arg_params, aux_params: Name -> NDArray or numpy array (as
                ``mx.model.load_checkpoint`` returns them); a tensor-parallel
                layer's parameters by their unsplit names and shapes (or by
                their shard names).

        Raises:
            ValueError: a parameter has no value, or a value of another shape.
        """
        values = dict(arg_params)
        values.update(aux_params or {})
        values = tensor_parallel.split_params(values, self.sharded)
        for _, param in self._params_of_stage():
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
            devices = self._devices_of(param.name)
            if not _is_initialized(param):
                param.shape = value.shape
                param.initialize(None, ctx=devices, default_init=mx.init.Zero())
            elif param.list_ctx() != devices:
                param.reset_ctx(devices)
            param.set_data(value.astype(param.dtype))

    def get_params(self):
        """``(arg_params, aux_params)`` of the initialised parameters, on ``cpu()``.

        Auxiliary states are those the symbol lists as such (BatchNorm's
        running statistics). A tensor-parallel layer's parameters are
        gathered: their unsplit names and shapes, whatever the shards.
        """
        aux_names = set(self.symbol().list_auxiliary_states())
        arg_params, aux_params = {}, {}
        for param in self.collect_params().values():
            value = param.data(param.list_ctx()[0]).copyto(mx.cpu())
            (aux_params if param.name in aux_names else arg_params)[param.name] = value
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
        return 'Pipeline(\n  %s\n)' % '\n  '.join(self.describe())


def _is_initialized(param):
    try:
        param.list_ctx()
        return True
    except RuntimeError:
        return False


