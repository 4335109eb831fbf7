"""``StagedModule``: the Module of a Pipeline whose micro-batches run on the
stage runtime (:mod:`~mp_symbolic.core.engine.stages`) in the order of a schedule
(``Pipeline(..., schedule='1f1b')``, or ``'interleaved'``: several stages
per device, each its own executors).

It is a :class:`~mp_symbolic.core.engine.module.PipelineModule` (so ``fit``,
``score``, ``predict``, ``save_checkpoint``, ``get_params``/``set_params``,
optimizer state by name, kvstore and per-device updates are its own) that
binds no executor of its own: the weights, gradients and auxiliary states
its stage executors bind are held where Module keeps its executor group
(an :class:`~mp_symbolic.core.engine.runtime.ArrayGroup`), and Module's own code
reads them there. ``forward`` runs the whole schedule, the micro-batches'
forwards and backwards together (that is what 1F1B is); ``backward`` then
has nothing left to do.
"""
from collections import OrderedDict

import mxnet as mx

from . import buckets as bucketing
from ..transport import nodes as node_processes
from ..transport.comm import Route, open_transport
from ..graph.layouts import batch_axis_of, batch_descs, layout_of, output_batch_axes
from .module import PipelineModule, shape_pair
from .runtime import ArrayGroup, grad_requests
from .. import schedule as schedules
from ..graph.passes import cut
from .stages import StageRuntime, boundary_specs, links, variable_specs

__all__ = []

KEPT_BINDS = 4  # batch sizes whose stage executors stay bound at once


class StagedModule(PipelineModule):
    """A :class:`PipelineModule` run stage by stage in the Pipeline's schedule.

    Each input and label is split into micro-batches and replicas on its own
    batch axis (the ``N`` of its ``DataDesc`` layout, or the Pipeline's
    ``batch_axis``: :func:`~mp_symbolic.core.graph.layouts.batch_descs`), and each
    output joined on the axis where its size follows the batch (axis 0 for
    one that does not), as the one graph does.

    ``grad_req`` (``'write'``, ``'add'``, ``'null'`` or by name) and
    ``inputs_need_grad`` are Module's: the stage runtime adds the batch's
    gradients to what a parameter's array holds where its request is
    ``'add'``, and joins each input's gradient over the micro-batches and
    replicas (:meth:`get_input_grads`).

    Raises:
        ValueError: (at ``bind``) a batch that is not a multiple of ``chunks
            x replicas``, a layout that cannot hold (as ``batch_descs``
            says), ``inputs_need_grad`` over node processes, or a
            ``shared_module`` that is not a bound, initialised StagedModule.
    """

    def _graph(self):
        """One micro-batch's training graph: the stages cut it, the runtime repeats it."""
        pipeline = self.pipeline
        return pipeline.training_graph(self.loss, self.data_name, self.label_name, chunks=1,
                                       output=self.output,
                                       shares=pipeline.chunks * pipeline.replicas)

    def _whole_graph(self):
        return self._full

    def _held(self, placed, symbol, label_names):
        """The graph of this process's weights, gradients and auxiliary
        states (the Module's parameters): the whole graph in one process;
        over nodes, this node's stage graphs alone (their inputs from other
        stages as data), so a node holds only its stages' parameters."""
        self._inputs = self.pipeline.data_names(self.data_name)
        self._all_labels = tuple(label_names)  # what a metric reads, held here or not
        self._full = symbol
        self._stages = cut(placed, self.pipeline.plan.num_stages)
        if self.pipeline.nodes is None:
            return symbol, self._inputs, label_names
        local = [self._stages[s].symbol for s in self.pipeline.local_stages]
        held = local[0] if len(local) == 1 else mx.sym.Group(local)
        arguments = held.list_arguments()
        received = [name for s in self.pipeline.local_stages
                    for name, _, _ in self._stages[s].receives]
        data = [n for n in self._inputs if n in arguments] + received
        return held, data, tuple(n for n in label_names if n in arguments)

    def bind(self, data_shapes, label_shapes=None, for_training=True,
             inputs_need_grad=False, force_rebind=False, shared_module=None, grad_req='write'):
        """Binds the stage executors for a batch of ``data_shapes``.

        Raises:
            ValueError: see the class.
        """
        if self.binded and not force_rebind:
            self.logger.warning('Already bound, ignoring bind()')
            return
        if inputs_need_grad and self.pipeline.nodes is not None:
            raise ValueError('inputs_need_grad: expected False over node processes (an input\'s '
                             'gradient stays on the node of the stage reading it), found True')
        axis = self.pipeline.batch_axis
        descs = batch_descs(data_shapes, axis, 1) + \
            batch_descs(label_shapes or (), axis, 1, labels=True)
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
        self._varying = {}  # input name -> the axes its buckets' shapes vary on
        self._steps = 0  # batches run since bind (over nodes, the step every node agrees on)
        self._runtimes = self._runtimes_for(batch, for_training)
        self._trained = False
        self._apply_pending()

    def _own_arrays(self, for_training, inputs_need_grad, force_rebind, shared_module,
                    grad_req):
        """What ``mx.mod.Module.bind`` does after its checks, with the
        arrays the runtimes bind (an :class:`~mp_symbolic.core.engine.runtime.ArrayGroup`)
        where it binds an executor group: values carried over on a rebind,
        a host copy made only with ``host_copy``."""
        if force_rebind:
            self._reset_bind()
        self.for_training = for_training
        self.inputs_need_grad = inputs_need_grad and for_training
        self._grad_req = grad_req
        data_shapes, label_shapes = self._full_shapes
        self._data_shapes = [_desc(n, s, self._axes[n]) for n, s in data_shapes]
        self._label_shapes = [_desc(n, s, self._axes[n]) for n, s in label_shapes]
        pipe = self.pipeline
        micro = self.batch_size // (pipe.chunks * pipe.replicas)
        shapes = {n: _resized(s, self._axes[n], micro) for n, s in data_shapes + label_shapes}
        specs = variable_specs(self._full, shapes, {n: 'float32' for n in shapes})
        inputs = list(self._data_names) + list(self._label_names)
        requests = grad_requests(self._symbol.list_arguments(), self._param_names, inputs,
                                 grad_req, self._fixed_param_names or (), for_training,
                                 self.inputs_need_grad)
        shared = None
        if shared_module is not None:
            if not (isinstance(shared_module, StagedModule) and shared_module.binded and
                    shared_module.params_initialized):
                raise ValueError('shared_module: expected a bound and initialised StagedModule, '
                                 'found %s' % type(shared_module).__name__)
            shared = shared_module._exec_group
        self._exec_group = ArrayGroup(self._symbol, self.pipeline.plan.group2ctxs,
                                      self._param_names, specs, requests, self.batch_size,
                                      for_training, self.inputs_need_grad, shared)
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
        """The stage runtimes (one per replica) that run a batch of ``batch``
        examples: the schedule's ``chunks`` micro-batches, or for inference
        on a batch they do not divide, one micro-batch per replica (the
        forwards need no schedule). Bound on first use, kept for the last
        :data:`KEPT_BINDS` sizes (``fit`` with ``eval_data``, ``score`` and
        ``predict`` of other batch sizes).

        Args:
            bucket: ``(data shapes, label shapes)`` (``[(name, shape)]``) of
                a bucket's batch: its runtimes, bound at those shapes, are
                the caller's to keep (:meth:`_bucket_runtimes`); ``None``:
                the bound shapes, at ``batch``.

        Raises:
            ValueError: a batch the replicas (or, to train, ``chunks x
                replicas``) do not divide.
        """
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
        micro = batch // (chunks * replicas)
        shapes = {n: _resized(s, self._axes[n], micro) for n, s in data_shapes + label_shapes}
        specs = variable_specs(self._full, shapes, {n: 'float32' for n in shapes})
        boundary = boundary_specs(self._stages, specs)
        plan, nodes = pipe.plan, pipe.nodes
        schedule = pipe.run_schedule() if chunks == pipe.chunks else \
            schedules.gpipe(plan.num_stages, 1)
        every = links(self._stages)
        requests = self._exec_group.grad_req
        accumulate = {n for n, r in requests.items() if r == 'add'}
        input_grads = self._inputs if self.inputs_need_grad else ()

        def transport(replica):
            return open_transport(pipe.transport, Route(
                nodes, tuple(plan.node_of_stage), tuple(every), chunks, replica))

        # a bucket's executors share the memory pools of the bound shapes' (never run together)
        shared = self._bound_at.get((self.batch_size, bool(train))) if bucket is not None \
            and chunks == pipe.chunks else None
        runtimes = [
            StageRuntime(self._stages, plan.group2ctxs[r], exe.arg_dict, exe.grad_dict,
                         exe.aux_dict, shapes, schedule, train and self.for_training,
                         specs=specs, boundary=boundary, local=pipe.local_stages,
                         transport=transport(r), axes=self._axes, output_axes=self._out_axes,
                         batchnorm=pipe.batchnorm, accumulate=accumulate,
                         input_grads=input_grads, shared=shared[r] if shared else None)
            for r, exe in enumerate(self._exec_group.execs)]
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

    def _bucket_runtimes(self, key, data_batch, batch, train):
        """The stage runtimes of bucket ``key``: bound at the batch's shapes
        on the key's first batch of those shapes (for training, and for
        forwards alone, each on first use; a key's batch of another size,
        such as a bucket's last, binds its own), on the Module's parameter,
        gradient and auxiliary arrays, with receive buffers of their own;
        the bound shapes' where the batch has them.

        Raises:
            ValueError: ``key`` not among ``buckets``; a batch that cannot
                be split as :meth:`_runtimes_for` says.
        """
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
        _, shapes, _ = self._full.infer_shape(**{
            n: _resized(s, self._axes[n], 1) for n, s in data_shapes + label_shapes})
        return [(n, _resized(s, self._out_axis(i), self.batch_size))
                for i, (n, s) in enumerate(zip(self._full.list_outputs(), shapes))]

    def install_monitor(self, mon):
        """Installs ``mon`` (an ``mx.monitor.Monitor``) on every executor of
        the runtimes bound so far (each stage's, one per micro-batch in
        flight): the Module's own arrays run in no executor of their own."""
        assert self.binded
        for runtimes in self._bound_at.values():
            for runtime in runtimes:
                for slots in runtime.slots:
                    for slot in slots:
                        mon.install(slot.executor)

    @property
    def runtimes(self):
        """The :class:`~mp_symbolic.core.engine.runtime.Runtime` of each replica
        that ran the last batch (the bound batch size's before any)."""
        return list(self._runtimes) if self.binded else []

    def input_arrays(self):
        """The arrays the runtimes of the last batch size read a batch's
        inputs and labels into: each stage executor's own (one per
        micro-batch it holds in flight), on its stage's device."""
        names, found = set(self._inputs) | set(self._all_labels), {}
        for runtime in self._runtimes:
            for slots in runtime.slots:
                for slot in slots:
                    for name, array in slot.executor.arg_dict.items():
                        if name in names:
                            found.setdefault(id(array), array)
        return list(found.values())

    def _out_axis(self, i):
        """The batch axis of output ``i`` (0 for one whose size does not follow the batch)."""
        return self._out_axes[i] if i < len(self._out_axes) else 0

    def forward(self, data_batch, is_train=None):
        """Runs the batch through the stages: with ``is_train``, every
        micro-batch's forward and backward in the schedule's order (the
        gradients of the whole batch, summed); otherwise the forwards.

        A batch of another size than the bound one runs on runtimes bound
        for it (:meth:`_runtimes_for`); a batch with a ``bucket_key``, on
        that key's (:meth:`_bucket_runtimes`).

        Over node processes, every node first checks that the others run
        the same step with the same ``bucket_key`` (``None`` included),
        before any tensor of the batch crosses
        (:func:`~mp_symbolic.core.transport.nodes.agree_key`).

        Raises:
            ValueError: a batch that cannot be split as :meth:`_runtimes_for`
                says, or a ``bucket_key`` not among ``buckets``; (``NodeError``)
                over nodes, another node's key or step differs.
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
        """Nothing left to do: :meth:`forward` ran the schedule's backwards.

        Raises:
            ValueError: ``out_grads`` given (the loss is the last stage's head).
            RuntimeError: no training forward came first.
        """
        if out_grads is not None:
            raise ValueError('out_grads: expected None under schedule=%r (the loss head is in '
                             'the last stage), found them given' % self.pipeline.schedule)
        if not self._trained:
            raise RuntimeError('backward: expected forward(is_train=True) first under '
                               'schedule=%r, found none' % self.pipeline.schedule)

    def get_outputs(self, merge_multi_context=True):
        """The outputs of the last batch, each over the whole batch (on the
        first replica's device with ``merge_multi_context``). Over nodes,
        on every node: the node of the stage that computes an output sends
        it to the others within the batch's schedule, once every
        micro-batch's is computed."""
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
        order of the data names (joined over the replicas on its batch axis,
        on the first replica's device, with ``merge_multi_context``).

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
        """``eval_metric`` on each replica's part of the outputs and labels
        (as MXNet's executor group slices them); a loss on one of several
        outputs is read from the head's output. Over nodes, every node
        holds the outputs (the node of the last stage sends them) and reads
        the labels given, also a node whose stages read none."""
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
        """Binds the runtimes for batches of ``data_shapes`` now (a batch of
        another size is bound at its first :meth:`forward` anyway).

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
    """Part ``index`` of ``array``'s batch, ``size`` long on ``axis`` (a view on axis 0)."""
    if not axis:
        return array[index * size:(index + 1) * size]
    return mx.nd.slice_axis(array, axis=axis, begin=index * size, end=(index + 1) * size)
