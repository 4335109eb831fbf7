"""``PipelineModule``: an ``mx.mod.Module`` for a :class:`~mp_symbolic.Pipeline`,
the one of every schedule (docs/how-it-works.md, "Symbolic training"; MXNet
1.9.1's ``python/mxnet/module/module.py``)."""
from collections import OrderedDict

import mxnet as mx
import numpy as np

from ..graph import batchnorm as batchnorms
from . import buckets as bucketing
from ..transport import nodes as node_processes
from .. import schedule as schedules
from ..transport.comm import Route, open_transport
from .device_module import DeviceModule, aux_written
from ..base.compat import gradient_only_kvstore
from ..graph.heads import HEADS, class_axis, head_of
from ..optim.initial import Drawn
from ..graph.ir import PlacedGraph
from ..graph.names import DATA_NAME, LABEL_NAME, LAYOUT_ATTR, SHAPE_ATTR
from ..optim.optstate import FORMAT as STATES_FORMAT, drop_states, encode_state, gather_states, \
    set_states_by_name, split_states, states_by_name
from ..graph.layouts import batch_axis_of, batch_descs, layout_of, output_batch_axes
from ..graph.passes import cut
from .runtime import ArrayGroup, bind_fused, fused, grad_requests
from .stages import StageRuntime, boundary_specs, links, variable_specs
from ..optim.updater import PerDeviceUpdater
from ..optim.zero import owners

__all__ = []


def with_input_shape(symbol, data_name, sample_shape, input_layouts=None):
    """``symbol`` (a Symbol or a :class:`~mp_symbolic.core.graph.ir.PlacedGraph`)
    as a Symbol with ``(0,) + sample_shape`` recorded on variable ``data_name``
    (or ``data_name`` ``{name: sample shape}``, ``sample_shape`` ``None``); an
    input of ``input_layouts`` (``{name: layout}``) has its layout recorded
    and the 0 at the layout's ``N``. MXNet reads a 0 dimension as unknown, so
    the graph binds at any batch size."""
    shapes = data_name if isinstance(data_name, dict) else {data_name: sample_shape}
    input_layouts = dict(input_layouts or {})

    def recorded(name, attrs):
        if name in input_layouts:
            attrs = dict(attrs, **{LAYOUT_ATTR: input_layouts[name]})
        if name in shapes:
            shape, axis = tuple(shapes[name]), max(input_layouts.get(name, 'N').find('N'), 0)
            attrs = dict(attrs, **{SHAPE_ATTR: str(shape[:axis] + (0,) + shape[axis:])})
        return attrs

    graph = symbol if isinstance(symbol, PlacedGraph) else PlacedGraph.from_symbol(symbol)
    return graph.but([
        n.but(attrs=recorded(n.name, n.attrs))
        if n.is_variable and (n.name in shapes or n.name in input_layouts) else n
        for n in graph.nodes]).to_symbol()


def fixed_param_names(pipeline, symbol):
    """The arguments of ``symbol`` whose Gluon parameter has ``grad_req='null'``
    (a Symbol carries no ``grad_req``: ``mx.mod.Module`` trains every argument
    not in its ``fixed_param_names``)."""
    arguments = set(symbol.list_arguments())
    return [name for name, param in pipeline.collect_params().items()
            if param.grad_req == 'null' and name in arguments]


def match_parameters(saved, ours, values, shapes):
    """``{saved name: our name}`` for a checkpoint's parameters: by name where
    the name sets are equal, otherwise (Gluon's automatic names count blocks
    per process) by their place in graph order, every known shape checked.

    Args:
        saved, ours: Parameter names in graph order (arguments, then
            auxiliary states).
        values, shapes: Saved name -> array; our name -> shape (``None`` or
            zeros where not known yet).

    Raises:
        ValueError: the parameters differ in number or shape.
    """
    if set(saved) == set(ours):
        return {n: n for n in saved}
    if len(saved) != len(ours):
        raise ValueError('checkpoint: expected the %d parameters of this network, found %d '
                         '(another architecture?)' % (len(ours), len(saved)))
    for old, new in zip(saved, ours):
        shape = shapes.get(new)
        if shape and all(shape) and tuple(shape) != tuple(values[old].shape):
            raise ValueError('checkpoint: expected %s of shape %s (matched by its place in the '
                             'graph, names differ), found %s of shape %s'
                             % (new, tuple(shape), old, tuple(values[old].shape)))
    return dict(zip(saved, ours))


class _Shape:  # pylint: disable=too-few-public-methods
    """An array's shape without its values."""

    def __init__(self, shape):
        self.shape = tuple(shape)


class _Restored:
    """What :meth:`PipelineModule.restore` read and the module has not taken
    yet: the parameters and the optimizer state, each taken once."""

    def __init__(self, params=None, states=None):
        self.params, self.states = params, states

    def take(self, what):
        value = getattr(self, what)
        setattr(self, what, None)
        return value


class PipelineModule(DeviceModule):
    """MXNet's Module over a Pipeline's stages (use :meth:`Pipeline.module`):
    ``fit``, ``score``, ``predict`` and ``save_checkpoint`` are Module's, and
    so are ``grad_req`` and ``inputs_need_grad``. It differs from Module where
    model parallelism needs it:

    * it binds no executor group: the weights, gradients and auxiliary states
      are held in an :class:`~mp_symbolic.core.engine.runtime.ArrayGroup`
      (one set per replica), and each replica's batch runs on a
      :class:`~mp_symbolic.core.engine.runtime.Runtime` bound on them (GPipe
      in one process on its fused graph, other schedules and node processes
      on the stage runtime); ``forward`` runs the batch's forwards and, in
      training, its backwards, and ``backward`` has nothing left to do;
    * each input and label is split into replicas and micro-batches on its
      own batch axis (the ``N`` of its ``DataDesc`` layout, or the Pipeline's
      ``batch_axis``), each output joined on the axis where its size follows
      the batch (else 0);
    * Gluon's fixed parameters (``grad_req='null'``) are in
      ``fixed_param_names``: no gradient, no update, no optimizer state;
    * the stages' devices hold the only copy of the parameters, unless
      ``host_copy``;
    * every update runs on its parameter's device (:class:`PerDeviceUpdater`)
      and the kvstore only sums gradients;
    * tensor-parallel parameters go in and out (parameters, checkpoints,
      optimizer state) by their unsplit names and shapes, whatever the shards;
    * ``init_params`` draws each value from MXNet's random state at the call
      and the parameter's unsplit name only, the same on every plan.

    Args:
        pipeline: The :class:`~mp_symbolic.Pipeline`.
        loss: See :func:`mp_symbolic.core.graph.heads.make_head`; ``None``: an
            inference module with no label.
        data_name, label_name: Input and label variable names (a network of
            several inputs takes ``data0``, ``data1``, ...).
        output: For a network of several outputs, the one the loss reads
            (:meth:`~mp_symbolic.Pipeline.training_symbol`).
        host_copy: Keep MXNet's host copy of every parameter on ``cpu(0)``,
            as ``mx.mod.Module`` does; by default ``get_params`` returns a
            fresh host copy each time.
        buckets: ``None``: a batch with a ``bucket_key`` runs on runtimes bound
            at its shapes on the key's first batch, on the default bucket's
            arrays and optimizer; or the keys the Module takes, declared ahead.
        **kwargs: Passed to ``mx.mod.Module``.

    Raises:
        ValueError: ``buckets`` that are not keys; ``context``,
            ``group2ctxs``, ``data_names`` or ``label_names`` given; at
            ``bind``, a batch that is not a multiple of ``chunks x
            replicas``, a layout that cannot hold
            (:func:`~mp_symbolic.core.graph.layouts.batch_descs`),
            ``inputs_need_grad`` over node processes, or a ``shared_module``
            that is not a bound, initialised PipelineModule; at ``forward``,
            a ``bucket_key`` not declared.

    Attributes:
        pipeline: The Pipeline.
        host_copy: Whether the Module keeps the host copy.
        input_shapes: ``{input name: one sample's shape}`` once bound.
        export_symbol: What :meth:`save_checkpoint` writes (typed:
            :attr:`export_graph`).
    """

    _statistics = ()  # batchnorm='deferred': the statistics the fused graph outputs
    _own_outputs = None  # then the count of the network's own outputs, before them

    def __init__(self, pipeline, loss='softmax', data_name=DATA_NAME, label_name=LABEL_NAME,
                 output=None, host_copy=False, buckets=None, **kwargs):
        self._buckets = bucketing.Buckets(buckets)
        for key in ('context', 'group2ctxs', 'data_names', 'label_names'):
            if key in kwargs:
                raise ValueError('%s: expected it from the Pipeline (its devices and names), '
                                 'found it given' % key)
        self.pipeline = pipeline
        self.loss = loss
        self._head_name = loss if isinstance(loss, str) else None  # fitted at bind
        self._head_fitted = False
        self.data_name, self.label_name, self.output = data_name, label_name, output
        # the runtime every batch runs on: GPipe's fused graph, or the stages
        self._fused = fused(pipeline)
        self._in_graph = pipeline.chunks if self._fused else 1  # micro-batches a graph holds
        placed = self._graph()
        symbol = placed.to_symbol()
        self._set_export(placed, symbol)
        arguments = symbol.list_arguments()
        label_names = (label_name,) if label_name in arguments else ()
        # a named loss on one of several outputs: the head first, the others after
        self._head_first = loss is not None and len(symbol.list_outputs()) > 1 and \
            output is not None
        plan = pipeline.plan
        symbol, data_names, label_names = self._held(placed, symbol, label_names)
        given = list(kwargs.pop('fixed_param_names', None) or ())
        fixed = given + [n for n in fixed_param_names(pipeline, symbol) if n not in given]
        first = pipeline.local_stages[0]
        super().__init__(symbol, data_names=data_names, label_names=label_names,
                         context=[devices[first] for devices in plan.replica_devices],
                         group2ctxs=plan.group2ctxs, fixed_param_names=fixed or None,
                         host_copy=host_copy, **kwargs)
        self.sample_shape = None
        self.input_shapes = {}
        self._batch_axes = {}  # input name -> its batch axis, once bound
        self._varying = {}  # input name -> the axes its buckets' shapes vary on
        self._bound_at = OrderedDict()  # (batch, training) -> its runtimes, newest last
        self._runtimes = []
        self._trained = False
        self._update_args = None
        self._owners = None
        self._zero_keys = False  # whether the kvstore has the keys of gathered states
        # what restore() read, until bind/init_params and init_optimizer take it
        self._pending = _Restored()

    def _graph(self):
        """The :class:`~mp_symbolic.core.graph.ir.PlacedGraph` the runtimes bind:
        staged, one micro-batch's; fused, every micro-batch's in one graph, and
        with ``batchnorm='deferred'`` and several chunks the BatchNorm
        statistics (:func:`~mp_symbolic.core.graph.batchnorm.deferred_graph`)
        as outputs the Module does not return."""
        pipeline = self.pipeline
        self._whole_batch = None  # fused: the graph of a batch run whole, made on first use
        if not self._fused:
            return pipeline.training_graph(self.loss, self.data_name, self.label_name,
                                           chunks=1, output=self.output,
                                           shares=pipeline.chunks * pipeline.replicas)
        placed = pipeline.training_graph(self.loss, self.data_name, self.label_name,
                                         output=self.output, shares=pipeline.replicas)
        self._statistics, self._own_outputs = [], None
        if pipeline.batchnorm == 'deferred' and pipeline.chunks > 1:
            count = len(placed.heads)
            placed, self._statistics = batchnorms.deferred_graph(placed)
            self._own_outputs = count if self._statistics else None
        return placed

    def _unsplit_graph(self):
        """Fused: ``(symbol, placed graph)`` of one micro-batch per replica, for
        an inference batch that ``chunks x replicas`` does not divide."""
        if self._whole_batch is None:
            placed = self.pipeline.training_graph(self.loss, self.data_name, self.label_name,
                                                  chunks=1, output=self.output,
                                                  shares=self.pipeline.replicas)
            self._whole_batch = (placed.to_symbol(), placed)
        return self._whole_batch

    def _held(self, placed, symbol, label_names):
        """``(symbol, data names, label names)`` of the parameters this process
        holds: the whole graph; over nodes, this node's stage graphs alone
        (their inputs from other stages as data)."""
        self._inputs = self.pipeline.data_names(self.data_name)
        self._all_labels = tuple(label_names)  # what a metric reads, held here or not
        self._full, self._full_graph = symbol, placed
        self._specs = None  # the last (input shapes, variable_specs) of this graph
        self._stages = None if self._fused else cut(placed, self.pipeline.plan.num_stages)
        if self.pipeline.nodes is None:
            return symbol, self._inputs, label_names
        local = [self._stages[s].symbol for s in self.pipeline.local_stages]
        held = local[0] if len(local) == 1 else mx.sym.Group(local)
        arguments = held.list_arguments()
        received = [name for s in self.pipeline.local_stages
                    for name, _, _ in self._stages[s].receives]
        data = [n for n in self._inputs if n in arguments] + received
        return held, data, tuple(n for n in label_names if n in arguments)

    def _set_export(self, placed, symbol):
        """Keeps :attr:`export_graph`: ``placed`` (``symbol`` written) where it
        is already without micro-batches and with tensor-parallel layers
        unsplit; otherwise that graph is built on its first read."""
        pipeline = self.pipeline
        as_one = pipeline.batch_axis == 0 or pipeline.replicas == 1
        if pipeline.chunks == 1 and not pipeline.sharded and as_one:
            self._export, self._export_symbol = placed, symbol
        else:
            self._export = self._export_symbol = None

    @property
    def export_graph(self):
        """:attr:`export_symbol`'s graph, typed (a
        :class:`~mp_symbolic.core.graph.ir.PlacedGraph`), built on first read."""
        if self._export is None:
            self._export = self.pipeline.training_graph(
                self.loss, self.data_name, self.label_name, chunks=1, output=self.output,
                unsplit=True)
        return self._export

    @property
    def export_symbol(self):
        """The training graph without micro-batches and with tensor-parallel
        layers unsplit, which :meth:`save_checkpoint` writes."""
        if self._export_symbol is None:
            self._export_symbol = self.export_graph.to_symbol()
        return self._export_symbol

    def _fit_head(self, data_shapes, label_shapes, force_rebind):
        """``loss='softmax'``: its classes on the axis the labels leave in the
        outputs (:func:`~mp_symbolic.core.graph.heads.class_axis`), the graph
        rebuilt where it has the other; its names stay."""
        head = HEADS.get(self._head_name)
        if head is None or not head.classes or self.binded and not force_rebind:
            return
        label = dict(shape_pair(d) for d in label_shapes or ()).get(self.label_name)
        if label is None and self._head_fitted:
            return  # a bind to predict keeps the axis its labels picked
        try:
            _, outputs, _ = self._whole_graph().infer_shape_partial(
                **dict(shape_pair(d) for d in data_shapes))
        except mx.base.MXNetError:
            return  # bind says what does not fit
        if not outputs or not outputs[0]:
            return
        axis = class_axis(outputs[0], label)
        if axis is None:
            return  # labels that fit no axis: bind refuses them
        self._head_fitted = label is not None
        if head.on_axis(axis) == head_of(self.loss):
            return
        self.loss = head.on_axis(axis)
        placed = self._graph()
        symbol = placed.to_symbol()
        self._set_export(placed, symbol)
        self._symbol = self._held(placed, symbol, (self.label_name,) if self.label_name in
                                  symbol.list_arguments() else ())[0]


    def _whole_graph(self):
        """The graph of every stage (whichever this process binds)."""
        return self._full

    def bind(self, data_shapes, label_shapes=None, for_training=True,
             inputs_need_grad=False, force_rebind=False, shared_module=None, grad_req='write'):
        """Binds the runtimes for a batch of ``data_shapes``, on the arrays
        the Module holds.

        Raises:
            ValueError: see the class.
        """
        if self.binded and not force_rebind:
            self.logger.warning('Already bound, ignoring bind()')
            return
        if inputs_need_grad and self.pipeline.nodes is not None:
            raise ValueError('inputs_need_grad: expected False over node processes (an input\'s '
                             'gradient stays on the node of the stage reading it), found True')
        # the fused graph splits every input into micro-batches on the Pipeline's batch_axis
        axis, split = self.pipeline.batch_axis, self._in_graph
        descs = batch_descs(data_shapes, axis, split) + \
            batch_descs(label_shapes or (), axis, split, labels=True)
        self._axes = {d.name: batch_axis_of(d) for d in descs}  # each one's batch axis
        data_shapes = [shape_pair(d) for d in data_shapes]
        label_shapes = [shape_pair(d) for d in label_shapes or ()]
        self._fit_head(data_shapes, label_shapes, force_rebind)
        first = data_shapes[0][0]
        batch = data_shapes[0][1][self._axes[first]]
        self.pipeline.placement.micro_batch(batch)
        self.input_shapes = {n: _without(s, self._axes[n]) for n, s in data_shapes}
        self.sample_shape = self.input_shapes[first]
        self._batch_axes = {n: self._axes[n] for n, _ in data_shapes}
        self.batch_size = self._batch = batch
        self._out_axes = [max(a, 0) for a in output_batch_axes(self._full, [
            d for d in descs if d.name in self._full.list_arguments()]) or ()]
        self._full_shapes = (data_shapes, label_shapes)
        self._own_arrays(for_training, inputs_need_grad, force_rebind, shared_module, grad_req)
        self._update_args = None
        self._owners = None
        self._bound_at = OrderedDict()  # (batch, training) -> its runtimes, newest last
        self._buckets.clear()
        self._varying = {}
        self._steps = 0  # batches run since bind (over nodes, the step every node agrees on)
        self._runtimes = self._runtimes_for(batch, for_training)
        self._trained = False
        self._apply_pending()

    def _own_arrays(self, for_training, inputs_need_grad, force_rebind, shared_module,
                    grad_req):
        """``mx.mod.Module.bind`` after its checks, with an
        :class:`~mp_symbolic.core.engine.runtime.ArrayGroup` where it binds an
        executor group; a host copy made only with ``host_copy``."""
        if force_rebind:
            self._reset_bind()
        self.for_training = for_training
        self.inputs_need_grad = inputs_need_grad and for_training
        self._grad_req = grad_req
        data_shapes, label_shapes = self._full_shapes
        self._data_shapes = [_desc(n, s, self._axes[n]) for n, s in data_shapes]
        self._label_shapes = [_desc(n, s, self._axes[n]) for n, s in label_shapes]
        pipe = self.pipeline
        micro = self._graph_batch(self.batch_size, pipe.chunks)
        shapes = {n: _resized(s, self._axes[n], micro) for n, s in data_shapes + label_shapes}
        specs = self._variable_specs(shapes)
        inputs = list(self._data_names) + list(self._label_names)
        requests = grad_requests(self._symbol.list_arguments(), self._param_names, inputs,
                                 grad_req, self._fixed_param_names or (), for_training,
                                 self.inputs_need_grad)
        shared = None
        if shared_module is not None:
            if not (isinstance(shared_module, PipelineModule) and shared_module.binded and
                    shared_module.params_initialized):
                raise ValueError('shared_module: expected a bound and initialised PipelineModule, '
                                 'found %s' % type(shared_module).__name__)
            shared = shared_module._exec_group
        self._exec_group = ArrayGroup(self._symbol, self.pipeline.plan.group2ctxs,
                                      self._param_names, specs, requests, self.batch_size,
                                      for_training, self.inputs_need_grad, shared,
                                      graph=self._full_graph)
        if shared_module is not None:
            self.params_initialized = True
            self._arg_params, self._aux_params = shared_module._arg_params, \
                shared_module._aux_params
        elif self.params_initialized:  # a rebind: the values carried over
            self._exec_group.set_params(self._arg_params, self._aux_params,
                                        allow_extra=self._other_nodes)
        elif self.host_copy:
            group = self._exec_group
            self._arg_params = {n: mx.nd.zeros(a[0].shape, dtype=a[0].dtype)
                                for n, a in zip(self._param_names, group.param_arrays)}
            self._aux_params = {n: mx.nd.zeros(a[0].shape, dtype=a[0].dtype)
                                for n, a in zip(self._aux_names, group.aux_arrays)}
        if not self.host_copy:
            self._kept = [None, None]
        if shared_module is not None and shared_module.optimizer_initialized:
            self.borrow_optimizer(shared_module)
        self.binded = True

    def _runtimes_for(self, batch, train, bucket=None):
        """The runtimes (one per replica) for a batch of ``batch`` examples in
        the schedule's micro-batches, or, for inference of a batch they do not
        divide, one per replica; bound on first use and kept for the last
        :data:`KEPT_BINDS` sizes. ``bucket``: ``(data shapes, label shapes)``
        of a bucket's batch, whose runtimes the caller keeps. Raises
        ValueError for a batch the replicas (to train, ``chunks x replicas``)
        do not divide."""
        key = (batch, bool(train))
        if bucket is None and key in self._bound_at:
            self._bound_at.move_to_end(key)
            return self._bound_at[key]
        pipe = self.pipeline
        chunks, replicas = pipe.chunks, pipe.replicas
        if train:
            pipe.placement.micro_batch(batch)
        elif batch % replicas:
            raise ValueError('batch size: expected a multiple of the replicas (%d) to predict, '
                             'found %d' % (replicas, batch))
        if batch % (chunks * replicas):
            chunks = 1  # inference of a batch the micro-batches do not divide
        data_shapes, label_shapes = self._full_shapes if bucket is None else bucket
        micro = self._graph_batch(batch, chunks)
        shapes = {n: _resized(s, self._axes[n], micro) for n, s in data_shapes + label_shapes}
        symbol, placed = (self._full, self._full_graph) if chunks == pipe.chunks or \
            not self._fused else self._unsplit_graph()
        specs = self._variable_specs(shapes, symbol)
        requests = self._exec_group.grad_req
        input_grads = self._inputs if self.inputs_need_grad else ()
        # a bucket's executors share the memory pools of the bound shapes' (never run together)
        shared = self._bound_at.get((self.batch_size, bool(train))) if bucket is not None \
            and chunks == pipe.chunks else None
        if self._fused:
            groups = {n.name: n.group for n in placed.variables}
            statistics, own = (self._statistics, self._own_outputs) if symbol is self._full \
                else ((), None)
            runtimes = [
                bind_fused(symbol, self._context[r], pipe.plan.group2ctxs[r],
                           (exe.arg_dict, exe.grad_dict, exe.aux_dict), shapes, specs[1],
                           groups, requests, train and self.for_training, self._devices(),
                           input_grads, statistics, own, self._fixed_param_names or (),
                           shared[r] if shared else None, placed)
                for r, exe in enumerate(self._exec_group.execs)]
        else:
            runtimes = self._stage_runtimes(shapes, specs, chunks, train, input_grads, shared)
        if bucket is not None:
            return runtimes
        self._bound_at[key] = runtimes
        while len(self._bound_at) > KEPT_BINDS:
            oldest = next(iter(self._bound_at))
            if oldest == (self.batch_size, self.for_training):  # the bound size stays
                self._bound_at.move_to_end(oldest)
                oldest = next(iter(self._bound_at))
            del self._bound_at[oldest]
        return runtimes

    def _stage_runtimes(self, shapes, specs, chunks, train, input_grads, shared):
        """One :class:`~mp_symbolic.core.engine.stages.StageRuntime` per replica
        for one micro-batch's ``shapes`` in ``chunks`` micro-batches."""
        pipe = self.pipeline
        boundary = boundary_specs(self._stages, specs)
        plan, nodes = pipe.plan, pipe.nodes
        schedule = pipe.run_schedule() if chunks == pipe.chunks else \
            schedules.whole_batch(plan.num_stages)
        every = links(self._stages)
        accumulate = {n for n, r in self._exec_group.grad_req.items() if r == 'add'}

        def transport(replica):
            return open_transport(pipe.transport, Route(
                nodes, tuple(plan.node_of_stage), tuple(every), chunks, replica))

        return [
            StageRuntime(self._stages, plan.group2ctxs[r], exe.arg_dict, exe.grad_dict,
                         exe.aux_dict, shapes, schedule, train and self.for_training,
                         specs=specs, boundary=boundary, local=pipe.local_stages,
                         transport=transport(r), axes=self._axes, output_axes=self._out_axes,
                         batchnorm=pipe.batchnorm, accumulate=accumulate,
                         input_grads=input_grads, shared=shared[r] if shared else None)
            for r, exe in enumerate(self._exec_group.execs)]

    def _variable_specs(self, shapes, symbol=None):
        """:func:`~mp_symbolic.core.engine.stages.variable_specs` of ``symbol``
        (default: the bound graph) for ``shapes``, the last ones kept."""
        symbol = self._full if symbol is None else symbol
        key = (symbol is self._full, tuple(sorted(shapes.items())))
        if self._specs is None or self._specs[0] != key:
            self._specs = (key, variable_specs(symbol, shapes, {n: 'float32' for n in shapes}))
        return self._specs[1]

    def _graph_batch(self, batch, chunks):
        """The examples one replica's graph takes of ``batch`` in ``chunks``:
        fused, the replica's whole part; staged, one micro-batch."""
        return batch // (chunks * self.pipeline.replicas) * (chunks if self._fused else 1)

    def _bucket_runtimes(self, key, data_batch, batch, train):
        """The runtimes of bucket ``key`` at ``data_batch``'s shapes, bound on
        their first batch on the Module's arrays (the bound shapes' where the
        batch has them). Raises ValueError for a ``key`` not among ``buckets``
        and a batch :meth:`_runtimes_for` refuses."""
        form = self._buckets.get(key, dict)  # (training, data shapes) -> runtimes
        data, labels = bucketing.batch_shapes(data_batch, self._inputs, self._all_labels)
        shapes = (bool(train), tuple(s for _, s in data))
        if shapes not in form:
            if self._all_labels:
                labels = bucketing.with_labels(self._full, data, labels, self._all_labels)
            if [s for _, s in data] == [s for _, s in self._full_shapes[0]]:
                form[shapes] = None  # the bound shapes: the runtimes kept by batch size
            else:
                self._note_bucket(data)
                form[shapes] = self._runtimes_for(batch, train, (data, labels))
        return form[shapes] if form[shapes] is not None else self._runtimes_for(batch, train)

    @property
    def data_shapes(self):
        return [_desc(n, s, self._axes[n]) for n, s in self._full_shapes[0]] \
            if self.binded else None

    @property
    def label_shapes(self):
        return [_desc(n, s, self._axes[n]) for n, s in self._full_shapes[1]] \
            if self.binded else None

    @property
    def output_shapes(self):
        assert self.binded
        data_shapes, label_shapes = self._full_shapes
        pipe = self.pipeline
        unit = self._graph_batch(pipe.chunks * pipe.replicas, pipe.chunks)  # its smallest
        names = self._full.list_outputs()
        _, shapes, _ = self._full.infer_shape(**{
            n: _resized(s, self._axes[n], unit) for n, s in data_shapes + label_shapes})
        return [(n, _resized(s, self._out_axis(i), self.batch_size))
                for i, (n, s) in enumerate(zip(names[:self._own_outputs], shapes))]

    @property
    def output_names(self):
        names = super().output_names
        return names[:self._own_outputs] if self._own_outputs else names

    def install_monitor(self, mon):
        """Installs ``mon`` (an ``mx.monitor.Monitor``) on every executor of the
        runtimes bound so far."""
        assert self.binded
        for runtimes in self._bound_at.values():
            for runtime in runtimes:
                for executor in runtime.all_executors:
                    mon.install(executor)

    @property
    def runtimes(self):
        """The :class:`~mp_symbolic.core.engine.runtime.Runtime` of each replica
        that ran the last batch (the bound batch size's before any)."""
        return list(self._runtimes) if self.binded else []

    def input_arrays(self):
        """The arrays the runtimes of the last batch size read a batch's
        inputs and labels into, each executor's own."""
        names, found = set(self._inputs) | set(self._all_labels), {}
        for runtime in self._runtimes:
            for executor in runtime.all_executors:
                for name, array in executor.arg_dict.items():
                    if name in names:
                        found.setdefault(id(array), array)
        return list(found.values())

    def _out_axis(self, i):
        """The batch axis of output ``i`` (0 for one whose size does not follow the batch)."""
        return self._out_axes[i] if i < len(self._out_axes) else 0

    def forward(self, data_batch, is_train=None):
        """Runs the batch on each replica's runtime: with ``is_train``, every
        micro-batch's forward and backward (the whole batch's gradients,
        summed); otherwise the forwards. A batch of another size, or with a
        ``bucket_key``, runs on runtimes bound for it. Over node processes,
        every node first checks that the others run the same step with the
        same ``bucket_key`` (:func:`~mp_symbolic.core.transport.nodes.agree_key`).

        Raises:
            ValueError: a batch :meth:`_runtimes_for` refuses, a ``bucket_key``
                not among ``buckets``; (``NodeError``) another node's key or step.
            RuntimeError: (``NodeFailure``) over nodes, a node died or did
                not answer.
        """
        assert self.binded and self.params_initialized
        is_train = self.for_training if is_train is None else is_train
        data = list(data_batch.data)
        batch = data[0].shape[self._axes[self._inputs[0]]]
        train = is_train and self.for_training
        # the bound runtimes run the bound size, forwards alone too
        train_form = train or batch == self.batch_size and self.for_training
        key = bucketing.bucket_key(data_batch)
        if self.pipeline.nodes is not None:  # every node's batch of this step has this key
            node_processes.agree_key(self.pipeline.nodes, self._steps, key,
                                     self.pipeline.plan.node_of_stage)
        self._steps += 1
        if key is None:
            self._runtimes = self._runtimes_for(batch, train_form)
        else:
            self._runtimes = self._bucket_runtimes(key, data_batch, batch, train_form)
        self._batch = batch
        labels = list(data_batch.label or ()) if self._label_names else []
        names = list(self._inputs) + list(self._label_names[:len(labels)])
        part = batch // len(self._runtimes)
        if not train:
            # oneDNN's inference convolution reorders its weight into its own
            # layout in place; queued behind an update of that weight, it
            # left NaN in the weights now and then (a score or predict right
            # after fit's last step): the updates are done first
            for arrays in self._exec_group.param_arrays:
                for array in arrays:
                    array.wait_to_read()
        for r, runtime in enumerate(self._runtimes):
            inputs = {n: _part(a, self._axes[n], r, part) for n, a in zip(names, data + labels)}
            runtime.run(inputs, train=is_train and self.for_training)
        self._trained = is_train and self.for_training

    def backward(self, out_grads=None):
        """Nothing left to do: :meth:`forward` ran the batch's backwards.

        Raises:
            ValueError: ``out_grads`` given (the loss is the graph's head).
            RuntimeError: no training forward came first.
        """
        if out_grads is not None:
            raise ValueError('out_grads: expected None under schedule=%r (the loss head is in '
                             'the graph), found them given' % self.pipeline.schedule)
        if not self._trained:
            raise RuntimeError('backward: expected forward(is_train=True) first under '
                               'schedule=%r, found none' % self.pipeline.schedule)

    def get_outputs(self, merge_multi_context=True):
        """The outputs of the last batch, each over the whole batch (on the
        first replica's device with ``merge_multi_context``); over nodes, on
        every node."""
        parts = [runtime.outputs for runtime in self._runtimes]
        per_output = [list(p) for p in zip(*parts)]
        if not merge_multi_context:
            return per_output
        keys = self._runtimes[0].output_keys
        return [p[0] if len(p) == 1 else
                mx.nd.concat(*[a.as_in_context(p[0].context) for a in p],
                             dim=self._out_axis(keys[i]))
                for i, p in enumerate(per_output)]

    def get_input_grads(self, merge_multi_context=True):
        """The gradient of each input over the last training batch, in the
        order of the data names (joined on its batch axis, on the first
        replica's device, with ``merge_multi_context``).

        Raises:
            ValueError: bound without ``inputs_need_grad``, or no training
                batch run since.
        """
        if not self.inputs_need_grad:
            raise ValueError('get_input_grads: expected bind(..., inputs_need_grad=True), '
                             'found it bound without')
        if not self._trained:
            raise ValueError('get_input_grads: expected forward(is_train=True) first, '
                             'found none')
        per_input = [[runtime.input_grads[n] for runtime in self._runtimes]
                     for n in self._inputs]
        if not merge_multi_context:
            return per_input
        return [p[0] if len(p) == 1 else
                mx.nd.concat(*[a.as_in_context(p[0].context) for a in p],
                             dim=self._axes.get(n, 0))
                for n, p in zip(self._inputs, per_input)]

    def update_metric(self, eval_metric, labels, pre_sliced=False):
        """``eval_metric`` on each replica's part of the outputs and labels, as
        MXNet's executor group slices them (a loss on one of several outputs
        read from the head's output); over nodes, on every node."""
        names = self._full.list_outputs()  # the network's (a node's executors hold its stages')
        if self._head_first:
            names = names[:1]
        part = self._batch // len(self._runtimes)
        for r, runtime in enumerate(self._runtimes):
            sliced = labels[r] if pre_sliced else [
                _part(l, self._axes.get(n, 0), r, part) for n, l in zip(self._all_labels, labels)]
            eval_metric.update_dict(OrderedDict(zip(self._all_labels, sliced)),
                                    OrderedDict(zip(names, runtime.outputs)))

    def reshape(self, data_shapes, label_shapes=None):
        """Binds the runtimes for batches of ``data_shapes`` now (another size
        is bound at its first :meth:`forward` anyway).

        Raises:
            ValueError: see :meth:`_runtimes_for`, or other per-sample shapes.
        """
        data_shapes = [shape_pair(d) for d in data_shapes]
        bound = [_without(s, self._axes[n]) for n, s in self._full_shapes[0]]
        given = [_without(s, self._axes.get(n, 0)) for n, s in data_shapes]
        if given != bound:
            raise ValueError('data_shapes: expected the bound per-sample shapes %s, found %s'
                             % (bound, given))
        name, shape = data_shapes[0]
        self._runtimes_for(shape[self._axes.get(name, 0)], self.for_training)


    def recorded_shapes(self):
        """``{input name: one sample's shape}`` a checkpoint records, for the
        inputs of more than one axis whose batch is on axis 0."""
        return {n: s for n, s in self.input_shapes.items()
                if s and self._batch_axes.get(n, 0) == 0}

    def recorded_layouts(self):
        """``{input name: layout}`` a checkpoint records (``__layout__``): for an
        input whose batch is not on axis 0, ``N`` there (``'TN'``, ``'TNC'``);
        for one of batch axis 0 whose buckets vary one other axis, ``T`` there
        (``'NT'``), which an exporter reads as a dynamic sequence."""
        found = {n: layout_of(a, len(self.input_shapes[n]) + 1)
                 for n, a in self._batch_axes.items() if a > 0}
        for name, axes in getattr(self, '_varying', {}).items():
            if name not in found and len(axes) == 1 and self._batch_axes.get(name) == 0:
                ndim, axis = len(self.input_shapes[name]) + 1, next(iter(axes))
                rest = iter('CHWD')
                found[name] = ''.join('N' if i == 0 else 'T' if i == axis else next(rest, 'C')
                                      for i in range(ndim))
        return found

    def _note_bucket(self, data_shapes):
        """Notes the axes (other than the batch's) where a bucket's input
        shapes (``[(name, shape)]``) differ from the bound ones."""
        varying = self.__dict__.setdefault('_varying', {})
        for name, shape in data_shapes:
            axis, bound = self._batch_axes.get(name), self.input_shapes.get(name)
            if axis is None or axis < 0 or bound is None:
                continue
            sample = tuple(shape[:axis]) + tuple(shape[axis + 1:])
            if len(sample) == len(bound):
                varying.setdefault(name, set()).update(
                    i + (i >= axis) for i, (a, b) in enumerate(zip(sample, bound)) if a != b)


    def _devices(self):
        return {i: d for i, d in enumerate(self.pipeline.plan.all_devices)}


    def init_optimizer(self, kvstore='local', optimizer='sgd',
                       optimizer_params=(('learning_rate', 0.01),), force_init=False):
        """``mx.mod.Module.init_optimizer`` with per-device updates: the kvstore
        only sums gradients, every replica updates its own copy, and over
        ``dist_*`` workers they start from worker 0's values.

        Raises:
            ValueError: ``kvstore=None`` with several replicas.
        """
        if kvstore is None and len(self._context) > 1:
            raise ValueError('kvstore: expected one (local, device or dist_sync) to sum the '
                             'gradients of the %d replicas, found None (each replica would '
                             'train on its own and drift apart)' % len(self._context))
        if self.optimizer_initialized and not force_init:
            self.logger.warning('optimizer already initialized, ignoring...')
            return
        with gradient_only_kvstore():
            super().init_optimizer(kvstore, optimizer, optimizer_params, force_init=force_init)
        if self._updater is not None and not isinstance(self._updater, PerDeviceUpdater):
            self._updater = PerDeviceUpdater(self._updater)
        self._update_args = None
        self._owners = None
        self._zero_keys = False  # a new kvstore: the gathered states' keys made anew
        states = self._pending.take('states')
        if states is not None:
            self.set_optimizer_states(states)
        if self._kvstore is not None and 'dist' in self._kvstore.type:
            # every worker starts from the values the kvstore holds (worker 0's)
            for i, (name, arrays) in enumerate(zip(self._exec_group.param_names,
                                                   self._exec_group.param_arrays)):
                self._kvstore.pull(name, out=arrays, priority=-i)
            self._params_dirty = True

    def update(self):
        """``mx.mod.Module.update``; without a kvstore, one per-device updater
        call on argument lists made once; with the state sharded
        (:meth:`optimizer_owners`), each parameter updated by its owner alone,
        then copied to the other replicas (Adam's moments then each its own
        array, made for the parameters the replica owns alone)."""
        sharded = self.optimizer_owners() is not None
        if self._updater is not None:
            self._updater.hold(None if sharded else self._exec_group.contiguous)
            self._updater.plain(self._exec_group.plain)
        if sharded:
            self._update_sharded()
            return
        if self._kvstore is not None or self._update_on_kvstore:
            super().update()
            return
        assert self.binded and self.params_initialized and self.optimizer_initialized
        self._params_dirty = True
        if getattr(self, '_update_args', None) is None:
            group, replicas = self._exec_group, len(self._context)
            indices, grads, weights = [], [], []
            for i, (arrays, grad_arrays) in enumerate(zip(group.param_arrays,
                                                          group.grad_arrays)):
                if grad_arrays[0] is None:  # a fixed parameter
                    continue
                for k in range(replicas):
                    indices.append(i * replicas + k)  # MXNet's index of replica k's copy
                    grads.append(grad_arrays[k])
                    weights.append(arrays[k])
            self._update_args = (indices, grads, weights)
        self._updater(*self._update_args)

    def optimizer_owners(self):
        """Where each trained parameter's optimizer state lives under
        ``Pipeline(..., shard_optimizer=True)`` (:mod:`~mp_symbolic.core.optim.zero`).

        Returns:
            ``None`` when the state is not sharded (``shard_optimizer`` off,
            or one replica in all); else ``{parameter name: (worker rank,
            replica)}``, the rank 0 without ``dist_sync``.
        """
        if not (self.pipeline.shard_optimizer and self.binded and self.optimizer_initialized):
            return None
        workers, rank = 1, 0
        if self._kvstore is not None and 'dist' in self._kvstore.type:
            workers, rank = self._kvstore.num_workers, self._kvstore.rank
        local = len(self._context)
        if workers * local == 1:
            return None
        if self._owners is None or self._owners[0] != (workers, rank):
            group = self._exec_group
            params = [(n, str(a[0].context), a[0].size * np.dtype(a[0].dtype).itemsize)
                      for n, a, g in zip(group.param_names, group.param_arrays,
                                         group.grad_arrays) if g[0] is not None]
            self._owners = ((workers, rank), OrderedDict(
                (n, divmod(o, local)) for n, o in owners(params, workers * local).items()))
        return self._owners[1]

    def _update_sharded(self):
        """One sharded update: the summed gradient pulled into the owner's copy,
        one updater call per replica, each new value copied to the other
        replicas (over ``dist_sync`` workers, the owner's value, in the default
        layout the dist kvstore reads, summed with the others' zeros)."""
        assert self.binded and self.params_initialized and self.optimizer_initialized
        self._params_dirty = True
        group, local, kvstore = self._exec_group, len(self._context), self._kvstore
        found = self.optimizer_owners()
        rank = kvstore.rank if kvstore is not None and 'dist' in kvstore.type else 0
        updates, moves = [[] for _ in range(local)], []
        for i, (name, arrays, grads) in enumerate(zip(group.param_names, group.param_arrays,
                                                      group.grad_arrays)):
            if grads[0] is None:  # a fixed parameter
                continue
            worker, k = found[name]
            if kvstore is not None:
                kvstore.push(name, grads, priority=-i)
                if worker == rank:
                    kvstore.pull(name, out=grads[k], priority=-i)
            if worker == rank:
                updates[k].append((i * local + k, grads[k], arrays[k]))
            moves.append((i, name, worker, k, arrays, grads))
        for replica in updates:
            if replica:
                indices, grads, weights = zip(*replica)
                self._updater(list(indices), list(grads), list(weights))
        if kvstore is not None and 'dist' in kvstore.type:
            # A worker that pulls nothing back would push a key's second value
            # before its first is merged; the servers count pushes, not workers.
            mx.nd.waitall()
        for i, name, worker, k, arrays, grads in moves:
            if kvstore is not None and 'dist' in kvstore.type:
                if worker == rank:  # the dist kvstore reads the buffer as it is laid out
                    arrays[k].copyto(grads[k])
                    kvstore.push(name, grads[k], priority=-i)
                else:
                    grads[0][:] = 0
                    kvstore.push(name, grads[0], priority=-i)
                kvstore.pull(name, out=list(arrays), priority=-i)
            else:
                for j, array in enumerate(arrays):
                    if j != k:
                        arrays[k].copyto(array)

    # -- optimizer state by parameter name, and restoring a checkpoint --------

    def _state_index(self):
        """``{parameter name: updater index of the copy whose state is read}``
        (Module's ``i * replicas + k``): replica 0's, or with the state
        sharded the owner's (another worker's left out)."""
        replicas, found = len(self._context), self.optimizer_owners()
        if found is None:
            return OrderedDict((n, i * replicas)
                               for i, n in enumerate(self._exec_group.param_names))
        rank = self._kvstore.rank if 'dist' in self._kvstore.type else 0
        return OrderedDict((n, i * replicas + found[n][1])
                           for i, n in enumerate(self._exec_group.param_names)
                           if n in found and found[n][0] == rank)

    def optimizer_states(self, lazy=False):
        """The optimizer state by parameter name, device-free, as
        :mod:`~mp_symbolic.core.optim.optstate` saves it: replica 0's, or with
        the state sharded each owner's (gathered over ``dist_sync`` workers).

        Args:
            lazy: Each of ``'arrays'`` a function of no arguments making that
                one array on the host when called, not the array.

        Raises:
            RuntimeError: the optimizer is not initialised.
        """
        if not self.optimizer_initialized:
            raise RuntimeError('optimizer_states: expected init_optimizer() (or fit) first, '
                               'found no optimizer')
        if self.states_over_workers():
            return gather_states(self._gathered_states(), self.pipeline.sharded)
        states = states_by_name(self._updater, self._optimizer,
                                OrderedDict((i, n) for n, i in self._state_index().items()),
                                lazy=lazy)
        return gather_states(states, self.pipeline.sharded)

    def states_over_workers(self):
        """Whether the optimizer state is sharded over ``dist_sync`` workers:
        every worker must then call :meth:`optimizer_states` at the same
        point."""
        found = self.optimizer_owners()
        return found is not None and 'dist' in self._kvstore.type and \
            self._kvstore.num_workers > 1

    def _gathered_states(self):
        """Every parameter's optimizer state, from the workers that own them:
        each state array and update count pushed by its owner and as zeros by
        the others, the sum pulled by every worker. Collective: every worker
        calls it at the same point."""
        group, local, kvstore = self._exec_group, len(self._context), self._kvstore
        found, rank = self.optimizer_owners(), kvstore.rank
        made, sums = [], OrderedDict()
        for i, (name, arrays) in enumerate(zip(group.param_names, group.param_arrays)):
            if name not in found:
                continue
            worker, k = found[name]
            index = i * local + k
            mine = worker == rank
            made_yet = mine and index in self._updater.states
            # the owner's state, or the optimizer's fresh one (its shapes) as zeros
            state = self._updater.states[index] if made_yet else \
                self._optimizer.create_state_multi_precision(index, arrays[k])
            # the update count, -1 for a state never made (summed with the others' zeros)
            count = mx.nd.array([self._count(index) if made_yet else -1 if mine else 0],
                                dtype='float64')
            pairs = []
            out = _map_state(state, lambda a, pairs=pairs: pairs.append(a) or
                             mx.nd.zeros(a.shape, a.context, a.dtype))
            outs = []
            _map_state(out, lambda a, outs=outs: outs.append(a) or a)
            for j, (sent, into) in enumerate(zip(pairs + [count],
                                                 outs + [mx.nd.zeros(1, dtype='float64')])):
                made.append(('%s%s:%d' % (ZERO_KEY, name, j), sent if mine else
                             mx.nd.zeros(sent.shape, sent.context, sent.dtype), into))
            sums[name] = (out, made[-1][2])
        if not self._zero_keys:  # collective: every worker makes them, worker 0's values
            kvstore.init([key for key, _, _ in made], [into for _, _, into in made])
            self._zero_keys = True
        for n, (key, sent, into) in enumerate(made):
            kvstore.push(key, sent, priority=-n)
            kvstore.pull(key, out=into, priority=-n)
        arrays, params = [], OrderedDict()
        for name, (state, count) in sums.items():
            count = int(count.asscalar())
            if count >= 0:  # a parameter never updated has no entry
                params[name] = {'count': count, 'state': encode_state(state, arrays)}
        return {'format': STATES_FORMAT, 'optimizer': type(self._optimizer).__name__.lower(),
                'num_update': self._optimizer.num_update, 'params': params, 'arrays': arrays}

    def _count(self, index):
        """The optimizer's update count of ``index`` (0 if never updated)."""
        # pylint: disable=protected-access
        for counts in self._optimizer._all_index_update_counts.values():
            if index in counts:
                return counts[index]
        return 0

    def set_optimizer_states(self, states):
        """Puts :meth:`optimizer_states` output back by name, each state on its
        parameter's device, for every replica (with the state sharded, its
        owner alone); a fixed parameter's state is dropped.

        Raises:
            OptimizerStateError: the states are of another optimizer or name
                parameters this module does not have.
        """
        states = drop_states(split_states(states, self.pipeline.sharded),
                             self._fixed_param_names or ())
        if self._other_nodes:  # the whole network's: this node takes its own
            held = set(self._exec_group.param_names)
            states = drop_states(states, [n for n in states['params'] if n not in held])
        if self.optimizer_owners() is not None:
            index, ours = self._state_index(), set(self._exec_group.param_names)
            # another replica's or worker's share is dropped; another model's is refused
            states = drop_states(states, [n for n in states['params']
                                          if n in ours and n not in index])
            replicas = len(self._context)
            targets = {n: (i, self._exec_group.execs[i % replicas].arg_dict[n].context)
                       for n, i in index.items()}
            set_states_by_name(self._updater, self._optimizer, states, targets)
            return
        for k, exe in enumerate(self._exec_group.execs):
            targets = {n: (i + k, exe.arg_dict[n].context)
                       for n, i in self._state_index().items()}
            set_states_by_name(self._updater, self._optimizer, states, targets)

    def restore(self, checkpoint):
        """Continues a committed checkpoint (:func:`mp_symbolic.read_checkpoint`)
        (a :class:`~mp_symbolic.tools.checkpoint.Checkpoint`) on this module's
        plan: parameters, matched as :func:`match_parameters` says, and the
        optimizer state once the optimizer exists (``fit`` picks both up).

        Raises:
            ValueError: the checkpoint's parameters do not fit this network.
        """
        symbol, _, _ = checkpoint.load(names=())  # checked; no array read yet
        stored = {key[4:]: shape for key, (shape, _, _) in checkpoint.index().items()}
        saved_args = {key[4:] for key in checkpoint.index() if key.startswith('arg:')}
        shapes = {p.name: p.shape for p in self.pipeline.collect_params().values()}
        ours = [a for a in self.export_symbol.list_arguments()
                if a not in self.pipeline.data_names(self.data_name) and a != self.label_name]
        rename = match_parameters(
            [a for a in symbol.list_arguments() if a in saved_args] +
            symbol.list_auxiliary_states(), ours + self.export_symbol.list_auxiliary_states(),
            {k: _Shape(v) for k, v in stored.items()}, shapes)
        names = None
        if self._other_nodes:  # this node reads its own stages' arrays only
            unsplit = {n: p.name for p in self.pipeline.sharded.values() for n in p.names}
            held = {unsplit.get(n, n) for n in list(self._param_names) + list(self._aux_names)}
            names = [k for k, v in rename.items() if v in held]
        _, arg_params, aux_params = checkpoint.load(names)
        arg_params = {rename[k]: v for k, v in arg_params.items()}
        aux_params = {rename[k]: v for k, v in aux_params.items()}
        states = checkpoint.load_states(names)
        states['params'] = {rename.get(k, k): v for k, v in states['params'].items()}
        if not states['params']:
            states = None  # saved before its optimizer existed
        self._pending = _Restored((arg_params, aux_params), states)
        self._apply_pending()
        if self.optimizer_initialized and self._pending.states is not None:
            self.set_optimizer_states(self._pending.take('states'))

    def _apply_pending(self):
        if self._pending.params is not None and self.binded and self.params_initialized:
            arg_params, aux_params = self._pending.take('params')
            self.set_params(arg_params, aux_params, allow_missing=False, force_init=True)

    def init_params(self, initializer=mx.init.Uniform(0.01), arg_params=None, aux_params=None,
                    allow_missing=False, force_init=False, allow_extra=False):
        """``mx.mod.Module.init_params``; after :meth:`restore`, the
        checkpoint's values unless others are given; tensor-parallel
        parameters by their unsplit names and shapes. Each drawn value is a
        function of MXNet's random state at the call and the parameter's
        unsplit name only (:mod:`~mp_symbolic.core.optim.initial`)."""
        if self._pending.params is not None and arg_params is None and aux_params is None:
            arg_params, aux_params = self._pending.take('params')
            allow_missing, force_init = False, True
        if arg_params is not None:
            arg_params = self.pipeline.split_params(arg_params)
        drawn = None if initializer is None else Drawn(initializer, self.pipeline.sharded)
        try:
            super().init_params(drawn, arg_params, aux_params, allow_missing, force_init,
                                allow_extra or self._other_nodes)
        finally:
            if drawn is not None:
                drawn.close()

    def set_params(self, arg_params, aux_params, allow_missing=False, force_init=True,
                   allow_extra=False):
        """``mx.mod.Module.set_params``; tensor-parallel parameters by their
        unsplit names and shapes (or their shard names)."""
        super().set_params(self.pipeline.split_params(arg_params), aux_params, allow_missing,
                           force_init, allow_extra or self._other_nodes)

    @property
    def _other_nodes(self):
        """Whether other node processes hold some of the parameters: values
        of the whole network are then given, and this node takes its own."""
        return self.pipeline.nodes is not None

    def get_params(self):
        """``mx.mod.Module.get_params``, each tensor-parallel parameter
        gathered: the unsplit layer's names and shapes, whatever the shards."""
        arg_params, aux_params = super().get_params()
        return self.pipeline.gather_params(arg_params), aux_params

    def lazy_params(self):
        """:meth:`get_params`'s names and values, each value a function making
        that one array on the host (numpy) when called.

        Returns:
            ``(arg_params, aux_params)``: ``{name: function}`` each.
        """
        assert self.binded and self.params_initialized
        group = self._exec_group
        aux_written(group)  # the running statistics' last update done before they are read

        def host(block):
            if len(block) == 1 and block[0].stype == 'default':
                return block[0].asnumpy  # get_params' bits, without its temporaries
            return lambda: (sum(w.copyto(mx.cpu()) for w in block) / len(block)).asnumpy()

        def joined(param, made):
            return lambda: np.concatenate([made[n]() for n in param.names], axis=param.axis)

        made = OrderedDict((n, host(b)) for n, b in zip(self._param_names, group.param_arrays))
        arg_params, shard_of = OrderedDict(), {n: p for p in self.pipeline.sharded.values()
                                               for n in p.names}
        for name, make in made.items():
            param = shard_of.get(name)
            if param is None:
                arg_params[name] = make
            elif param.name not in arg_params and all(n in made for n in param.names):
                arg_params[param.name] = joined(param, made)
        aux_params = OrderedDict((n, host(b)) for n, b in zip(self._aux_names, group.aux_arrays))
        return arg_params, aux_params

    @property
    def kvstore(self):
        """The kvstore summing gradients, or ``None``."""
        return self._kvstore

    @property
    def updater(self):
        """The :class:`PerDeviceUpdater` (``None`` before ``init_optimizer``)."""
        return self._updater

    @property
    def executors(self):
        """Each replica's :class:`~mp_symbolic.core.engine.runtime.ReplicaArrays`
        (``arg_dict``, ``grad_dict``, ``aux_dict``, on their stages' devices),
        which its runtimes' executors bind; ``[]`` before ``bind``."""
        return list(self._exec_group.execs) if self.binded else []

    def save_checkpoint(self, prefix, epoch, save_optimizer_states=False, remove_amp_cast=True):
        """``mx.mod.Module.save_checkpoint`` of :attr:`export_symbol`, each
        input's per-sample shape or layout recorded on it."""
        symbol = with_input_shape(self.export_graph, self.recorded_shapes(), None,
                                  self.recorded_layouts())
        symbol.save('%s-symbol.json' % prefix, remove_amp_cast=remove_amp_cast)
        self.save_params('%s-%04d.params' % (prefix, epoch))
        if save_optimizer_states:
            self.save_optimizer_states('%s-%04d.states' % (prefix, epoch))


KEPT_BINDS = 4  # batch sizes whose runtimes stay bound at once

# the kvstore keys of the optimizer state gathered from dist_sync workers
ZERO_KEY = 'optimizer_state:'


def _map_state(state, make):
    """``state`` (an NDArray, nested tuples or lists of them, or None) with
    each NDArray replaced by ``make(array)``, in order."""
    if state is None:
        return None
    if isinstance(state, mx.nd.NDArray):
        return make(state)
    return type(state)(_map_state(s, make) for s in state)


def shape_pair(desc):
    """``(name, shape)`` of an ``mx.io.DataDesc`` or a pair."""
    return (desc.name, tuple(desc.shape)) if hasattr(desc, 'name') else (desc[0], tuple(desc[1]))


def _without(shape, axis):
    """``shape`` without its batch ``axis``: one sample's."""
    return tuple(shape[:axis]) + tuple(shape[axis + 1:])


def _resized(shape, axis, size):
    """``shape`` with ``size`` on its batch ``axis``."""
    return tuple(shape[:axis]) + (size,) + tuple(shape[axis + 1:])


def _desc(name, shape, axis):
    """A ``DataDesc`` of ``shape`` whose layout puts ``N`` at ``axis`` (MXNet's
    default layout for axis 0)."""
    if not axis:
        return mx.io.DataDesc(name, shape)
    return mx.io.DataDesc(name, shape, layout=layout_of(axis, len(shape)))


def _part(array, axis, index, size):
    """Part ``index`` of ``array``'s batch, ``size`` long on ``axis``."""
    if not index and array.shape[axis] == size:
        return array
    if not axis:
        return array[index * size:(index + 1) * size]
    return mx.nd.slice_axis(array, axis=axis, begin=index * size, end=(index + 1) * size)
