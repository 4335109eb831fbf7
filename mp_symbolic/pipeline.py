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

The same object is the imperative twin: a Gluon ``Block`` whose parameters
live on their stage's device and whose forward pass moves activations between
devices (autograd records those copies, so gradients flow back across them);
with replicas and chunks too (:mod:`~mp_symbolic.twin`), trained by
:class:`~mp_symbolic.Trainer`.

Why the tagging happens here: ``mx.AttrScope(ctx_group=...)`` inside
``hybrid_forward`` tags the ops but not the parameter variables (Gluon creates
those before ``hybrid_forward`` runs), and the split graph then fails to bind
for training. The scope must enclose the whole call of each block, and Gluon
caches each parameter's variable, so the cache is cleared before every build.
"""
import json
import os

import mxnet as mx
from mxnet import gluon

from . import balance as balancing
from . import twin
from .heads import make_head
from .placement import (DeviceSpecError, DevicePlan, resolve_devices, split_replicas,
                        stage_name)

__all__ = ['Pipeline', 'DATA_NAME', 'LABEL_NAME']

DATA_NAME = 'data'             # mx.io.NDArrayIter's default data name
LABEL_NAME = 'softmax_label'   # mx.io.NDArrayIter's default label name


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
            a ``HybridSequential``. Each block takes one input and returns one
            output.
        devices: ``'cpu:0,cpu:1,cpu:2'`` (the ``--devices`` form) or a list of
            ``mx.Context``; one device per stage, times ``replicas``.
        balance: ``None``: balance the stages by parameter count; a list of
            ints: blocks per stage (one entry per device, each at least 1,
            summing to the number of blocks); ``'time'``: balance by each
            block's measured forward + backward time on ``sample``.
        sample: A batch (numpy or NDArray) or its shape, for ``balance='time'``
            and for parameter shapes not known yet (layers without their input
            size).
        chunks: Micro-batches per batch (GPipe), in the symbolic graph and in
            the imperative twin; the batch size must be a multiple of
            ``chunks * replicas``.
        replicas: Data-parallel copies of the pipeline; ``devices`` then lists
            ``replicas x stages`` devices, replica by replica.
        mirror: Re-materialisation: ``True`` (every stage) or stage indices
            whose ops carry MXNet's ``__force_mirroring__``, so the backward
            pass recomputes their outputs instead of keeping them (compute
            traded for activation memory; see the README for what it measured).

    Attributes:
        blocks: The blocks, in order.
        plan: The :class:`~mp_symbolic.placement.DevicePlan`.
        balance: Blocks per stage.
        chunks, replicas: As given.

    Raises:
        TypeError: a block is not a ``HybridBlock``.
        ValueError: (``DeviceSpecError``, ``BalanceError``) devices, balance,
            chunks or replicas that cannot work; a parameter shared by blocks
            of two stages.
    """

    def __init__(self, blocks, devices, balance=None, sample=None, chunks=1, replicas=1,
                 mirror=False):
        super().__init__(prefix='pipeline_')
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
        self.plan = DevicePlan(replica_devices[0],
                               balancing.stage_of_block(
                                   self._solve_balance(balance, num_stages, sample)),
                               replica_devices)
        self._check_no_shared_params()
        self._check_onednn_batchnorm()

    # -- planning ------------------------------------------------------------

    def _solve_balance(self, balance, num_stages, sample):
        if num_stages > len(self.blocks):
            raise DeviceSpecError('too many devices for the blocks (devices per replica: %d, '
                                  'blocks: %d); expected at most one device per block'
                                  % (num_stages, len(self.blocks)))
        if balance is None:
            return balancing.solve(balancing.param_counts(self.blocks), num_stages)
        if isinstance(balance, str):
            if balance != 'time':
                raise balancing.BalanceError("balance: expected None, 'time' or a list of "
                                             'blocks per stage, found %r' % balance)
            if sample is None:
                raise balancing.BalanceError("balance='time': expected sample= (a batch or "
                                             'its shape) to time the blocks on, found none')
            self.costs = balancing.forward_backward_times(self.blocks, self._sample_shape,
                                                          mx.cpu(0))
            return balancing.solve(self.costs, num_stages)
        return balancing.check_balance(balance, len(self.blocks), num_stages)

    @property
    def balance(self):
        """Blocks per stage."""
        return self.plan.balance

    @property
    def stages(self):
        """The blocks of each stage: ``stages[s]`` is a list."""
        return [[b for b, st in zip(self.blocks, self.plan.stage_of_block) if st == s]
                for s in range(self.plan.num_stages)]

    def _params_of_stage(self):
        """``[(stage, param)]`` for every parameter, in block order."""
        out = []
        for block, stage in zip(self.blocks, self.plan.stage_of_block):
            out += [(stage, p) for p in block.collect_params().values()]
        return out

    def _check_no_shared_params(self):
        stage_of = {}
        for stage, param in self._params_of_stage():
            if stage_of.setdefault(param.name, stage) != stage:
                raise ValueError('parameter %s is shared by blocks of %s and %s; expected each '
                                 'parameter in one stage (it lives on one device)'
                                 % (param.name, stage_name(stage_of[param.name]),
                                    stage_name(stage)))

    def _check_onednn_batchnorm(self):
        # MXNet 1.9.1's oneDNN BatchNorm backward fails on some micro-batched
        # graphs split across devices ("The size of NDArray doesn't match the
        # requested MKLDNN memory desc"); its reference kernel does not.
        if self.chunks == 1 or self.plan.num_stages == 1 or not onednn_active():
            return
        ops = {n['op'] for n in json.loads(self.symbol().tojson())['nodes']}
        if 'BatchNorm' in ops:
            raise ValueError('chunks: expected MXNET_MKLDNN_ENABLED=0 in the environment '
                             'before the first operator runs, for BatchNorm with chunks > 1 '
                             "(MXNet 1.9.1's oneDNN BatchNorm fails on micro-batched graphs "
                             'split across devices), found oneDNN enabled')

    def describe(self):
        """The plan, one line per stage, with block names and parameter counts."""
        lines = []
        for s, blocks in enumerate(self.stages):
            devices = ', '.join(str(d[s]) for d in self.plan.replica_devices)
            names = ', '.join(b.name for b in blocks)
            try:
                count = '%d parameters' % sum(balancing.param_counts(blocks))
            except balancing.BalanceError:
                count = 'parameter count not known yet'
            lines.append('%s -> %s: %s (%s)' % (stage_name(s), devices, names, count))
        return lines

    # -- symbolic ------------------------------------------------------------

    def _reset_variables(self):
        # Gluon caches each parameter's variable with the attributes in force
        # when it was first made: a second build (another plan) would keep the
        # first plan's ctx_group.
        for param in self.collect_params().values():
            param._var = None  # pylint: disable=protected-access

    def _build(self, data, chunks):
        """``data`` through every stage, tagged; chunks joined on the last stage."""
        self._reset_variables()
        first, last = stage_name(0), stage_name(self.plan.num_stages - 1)
        if chunks > 1:
            with mx.AttrScope(ctx_group=first):
                parts = list(mx.sym.split(data, num_outputs=chunks, axis=0, name='chunk'))
        else:
            parts = [data]
        outputs = []
        for x in parts:
            for s, blocks in enumerate(self.stages):
                extra = {'force_mirroring': 'True'} if s in self.mirror else {}
                with mx.AttrScope(ctx_group=stage_name(s), **extra):
                    for block in blocks:
                        x = block(x)
            outputs.append(x)
        if chunks == 1:
            return outputs[0]
        with mx.AttrScope(ctx_group=last):
            return mx.sym.concat(*outputs, dim=0, name='join')

    def _data(self, data_name):
        with mx.AttrScope(ctx_group=stage_name(0)):
            return mx.sym.var(data_name)

    def symbol(self, data_name=DATA_NAME):
        """The inference graph: ``data`` -> prediction, every node tagged."""
        return _finish(self._build(self._data(data_name), 1), self)

    def training_symbol(self, loss, data_name=DATA_NAME, label_name=LABEL_NAME, chunks=None):
        """The graph with its loss head (see :func:`mp_symbolic.heads.make_head`).

        Args:
            chunks: Micro-batches; ``None``: the Pipeline's ``chunks``.
        """
        chunks = self.chunks if chunks is None else chunks
        prediction = self._build(self._data(data_name), chunks)
        with mx.AttrScope(ctx_group=stage_name(self.plan.num_stages - 1)):
            head = make_head(loss, prediction, mx.sym.var(label_name))
        return _finish(head, self)

    def module(self, loss='softmax', data_name=DATA_NAME, label_name=LABEL_NAME, **kwargs):
        """An ``mx.mod.Module`` bound to the stages' devices (see
        :class:`~mp_symbolic.module.PipelineModule`); ``fit``, ``score``,
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
        self._reset_variables()
        sym = mx.sym.var(data_name)
        for block in self.blocks:
            sym = block(sym)
        try:
            arg_shapes, _, aux_shapes = sym.infer_shape(**{data_name: tuple(data_shape)})
        except mx.base.MXNetError as err:
            raise ValueError('sample: cannot infer the network\'s shapes from input shape %s: %s'
                             % (tuple(data_shape), _last_line(err))) from None
        shapes = dict(zip(sym.list_arguments(), arg_shapes))
        shapes.update(zip(sym.list_auxiliary_states(), aux_shapes))
        for param in self.collect_params().values():
            if param.name in shapes:
                param.shape = shapes[param.name]
        self._reset_variables()
        return shapes

    # -- imperative twin -----------------------------------------------------

    def forward(self, x):  # pylint: disable=arguments-differ
        """Runs the blocks stage by stage, moving ``x`` to each stage's device;
        with replicas, each replica a share of the batch, with chunks, as
        micro-batches (see :func:`mp_symbolic.twin.forward`). Returns the
        whole batch's output on the last stage of the first replica.

        On a Symbol, returns the tagged inference graph (one chunk).

        Raises:
            TypeError: ``x`` is neither an NDArray nor a Symbol.
            ValueError: the batch is not a multiple of ``chunks x replicas``.
        """
        if isinstance(x, mx.sym.Symbol):
            return _finish(self._build(x, 1), self)
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
        for stage, param in self._params_of_stage():
            devices = twin.stage_devices(self.plan, stage)
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
                ``mx.model.load_checkpoint`` returns them).

        Raises:
            ValueError: a parameter has no value, or a value of another shape.
        """
        values = dict(arg_params)
        values.update(aux_params or {})
        for stage, param in self._params_of_stage():
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
            devices = twin.stage_devices(self.plan, stage)
            if not _is_initialized(param):
                param.shape = value.shape
                param.initialize(None, ctx=devices, default_init=mx.init.Zero())
            elif param.list_ctx() != devices:
                param.reset_ctx(devices)
            param.set_data(value.astype(param.dtype))

    def get_params(self):
        """``(arg_params, aux_params)`` of the initialised parameters, on ``cpu()``.

        Auxiliary states are those the symbol lists as such (BatchNorm's
        running statistics).
        """
        aux_names = set(self.symbol().list_auxiliary_states())
        arg_params, aux_params = {}, {}
        for param in self.collect_params().values():
            value = param.data(param.list_ctx()[0]).copyto(mx.cpu())
            (aux_params if param.name in aux_names else arg_params)[param.name] = value
        return arg_params, aux_params

    def __repr__(self):
        return 'Pipeline(\n  %s\n)' % '\n  '.join(self.describe())


def onednn_active():
    """Whether MXNet runs CPU operators through oneDNN (MKLDNN) in this process."""
    if os.environ.get('MXNET_MKLDNN_ENABLED', '1').lower() in ('0', 'false'):
        return False
    return mx.runtime.Features().is_enabled('MKLDNN')


def _is_initialized(param):
    try:
        param.list_ctx()
        return True
    except RuntimeError:
        return False


def _finish(symbol, pipeline):
    """Checks every node carries a stage; gives chunk copies of ops unique names."""
    graph = json.loads(symbol.tojson())
    groups = {stage_name(s) for s in range(pipeline.plan.num_stages)}
    seen = {}
    for node in graph['nodes']:
        group = node.get('attrs', {}).get('__ctx_group__')
        if group not in groups:  # an internal invariant: every node is built in a scope
            raise AssertionError('node %s has ctx_group %r, expected one of %s'
                                 % (node['name'], group, sorted(groups)))
        if node['op'] != 'null':
            count = seen.get(node['name'], 0)
            seen[node['name']] = count + 1
            if count:
                node['name'] = '%s_chunk%d' % (node['name'], count)
    if not any(count > 1 for count in seen.values()):
        return symbol
    return mx.sym.load_json(json.dumps(graph))


def _last_line(err):
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
