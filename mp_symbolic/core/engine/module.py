"""``PipelineModule``: an ``mx.mod.Module`` for a :class:`~mp_symbolic.Pipeline`.

It is MXNet's own Module (``fit``, ``score``, ``predict``, ``save_checkpoint``
work unchanged), built from the Pipeline's tagged training graph and bound to
its stages' devices through ``group2ctxs`` (one dict per replica). Gluon's
fixed parameters (``grad_req='null'``: constants made with
``params.get_constant`` and layers frozen with
``collect_params().setattr('grad_req', 'null')``) are the Module's
``fixed_param_names``, with any the caller names: they get no gradient, no
update and no optimizer state. Five more differences are what model
parallelism needs:

* the stages' devices hold the only copy of the parameters: MXNet's Module
  keeps another of all of them on the host (``cpu(0)``), here made only for
  ``get_params`` and checkpoints and not kept, unless ``host_copy=True``
  (:class:`~mp_symbolic.core.engine.device_module.DeviceModule`);
* every optimizer update runs on the device of the parameter it updates
  (:class:`PerDeviceUpdater`);
* the kvstore, where there is one, only sums gradients (across replicas or
  worker processes); each replica then updates its own copy on its own
  devices, so optimizer state stays beside its weights and can be saved by
  parameter name;
* a tensor-parallel layer's parameters go in and out by their unsplit names
  and shapes (``get_params``, ``set_params``, ``init_params(arg_params=...)``,
  checkpoints, optimizer state): the module splits them into its shards on
  the way in and gathers them on the way out, so values move between plans
  of any number of shards;
* ``init_params`` draws each value from MXNet's random state at the call
  and the parameter's (unsplit) name only, a tensor-parallel one whole and
  then sliced (:mod:`~mp_symbolic.core.optim.initial`): every plan, node count
  and shard count starts from the same values.

References: MXNet 1.9.1 ``python/mxnet/module/module.py``,
``tests/python/unittest/test_module.py::test_module_ctx_group``.
"""
from collections import OrderedDict

import mxnet as mx
import numpy as np

from ..graph import batchnorm as batchnorms
from . import buckets as bucketing
from ..graph import layouts
from .device_module import DeviceModule, aux_written
from ..base.compat import gradient_only_kvstore, split_bind
from ..graph.heads import HEADS, class_axis, head_of
from ..optim.initial import Drawn
from ..graph.ir import PlacedGraph
from ..graph.names import DATA_NAME, LABEL_NAME, LAYOUT_ATTR, SHAPE_ATTR
from ..optim.optstate import FORMAT as STATES_FORMAT, drop_states, encode_state, gather_states, \
    set_states_by_name, split_states, states_by_name
from .runtime import FusedRuntime
from ..optim.updater import PerDeviceUpdater
from ..optim.zero import owners

__all__ = []


def with_input_shape(symbol, data_name, sample_shape, input_layouts=None):
    """``symbol`` (a Symbol, or a :class:`~mp_symbolic.core.graph.ir.PlacedGraph`)
    as a Symbol with ``(0,) + sample_shape`` recorded on its data variable
    (``data_name`` and ``sample_shape`` may be ``{name: sample shape}`` and
    ``None`` for several inputs); an input of ``input_layouts`` (``{name:
    layout}``, its batch at the layout's ``N``: ``'TN'``, ``'TNC'``) has the
    layout recorded (``__layout__``), and its shape with the 0 there.

    MXNet reads a 0 dimension as unknown, so the graph still binds at any
    batch size; an exporter reads the per-sample shape and where the batch
    is back from the file.
    """
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
    """The arguments of ``symbol`` whose Gluon parameter has ``grad_req='null'``.

    Gluon leaves such parameters alone (``gluon.Trainer`` skips them), but a
    Symbol carries no ``grad_req``: ``mx.mod.Module`` trains every argument
    that is not data, a label or in its ``fixed_param_names``. Auxiliary
    states (also ``'null'`` in Gluon) are not arguments, and MXNet never
    hands them to an optimizer.
    """
    arguments = set(symbol.list_arguments())
    return [name for name, param in pipeline.collect_params().items()
            if param.grad_req == 'null' and name in arguments]


def match_parameters(saved, ours, values, shapes):
    """``{saved name: our name}`` for a checkpoint's parameters.

    Equal name sets match by name. Otherwise (Gluon's automatic names count
    blocks per process, so the same network built elsewhere may be
    ``dense5_weight`` where it was ``dense2_weight``) parameters match by
    their place in the graph's argument order, which the architecture alone
    decides, with every known shape checked.

    Args:
        saved, ours: Parameter names in graph order (arguments, then
            auxiliary states).
        values: Saved name -> array.
        shapes: Our name -> shape (``None`` or zeros where not known yet).

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
    yet: the parameters (taken once bound with parameters) and the
    optimizer state (taken once the optimizer exists), each taken once."""

    def __init__(self, params=None, states=None):
        self.params, self.states = params, states

    def take(self, what):
        value = getattr(self, what)
        setattr(self, what, None)
        return value


class PipelineModule(DeviceModule):
    """MXNet's Module over a Pipeline's stages (use :meth:`Pipeline.module`).

    Args:
        pipeline: The :class:`~mp_symbolic.Pipeline`.
        loss: See :func:`mp_symbolic.core.graph.heads.make_head`; ``None``: an
            inference module with no label (the network's outputs).
        data_name, label_name: Input and label variable names (a network of
            several inputs takes ``data0``, ``data1``, ...).
        output: For a network of several outputs, the one the loss reads
            (:meth:`~mp_symbolic.Pipeline.training_symbol`).
        host_copy: Keep MXNet's host copy of every parameter (on MXNet's
            default context, ``cpu(0)``), as ``mx.mod.Module`` does. By
            default the stages' devices hold the only copy, and
            ``get_params`` returns a fresh host copy each time
            (:class:`~mp_symbolic.core.engine.device_module.DeviceModule`).
        buckets: ``None``: a batch with a ``bucket_key`` runs on executors
            bound at its shapes on the key's first batch, sharing the
            parameters, gradients, auxiliary states and optimizer with the
            default bucket (:mod:`~mp_symbolic.core.engine.buckets`); or the keys
            the Module takes, declared ahead (another key is refused).
        **kwargs: Passed to ``mx.mod.Module``.

    Raises:
        ValueError: ``buckets`` that are not keys (as
            :class:`~mp_symbolic.core.engine.buckets.Buckets` says); at ``forward``,
            a ``bucket_key`` not declared.

    Attributes:
        pipeline: The Pipeline.
        host_copy: Whether the Module keeps the host copy.
        input_shapes: ``{input name: one sample's shape}`` once bound.
        export_symbol: The training graph without micro-batches and with
            tensor-parallel layers unsplit, which :meth:`save_checkpoint`
            writes (chunks and shards are a training schedule, not part of
            the model); :attr:`export_graph` typed.
    """

    _statistics = ()  # batchnorm='deferred': the statistics the one graph outputs
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
        self._placed = placed  # the graph of self._symbol, typed (read by binds)
        self.sample_shape = None
        self.input_shapes = {}
        self._batch_axes = {}  # input name -> its batch axis, once bound
        self._laid_out = False  # whether the outputs' nodes carry layouts
        self._update_args = None
        self._owners = None
        self._zero_keys = False  # whether the kvstore has the keys of gathered states
        # what restore() read, until bind/init_params and init_optimizer take it
        self._pending = _Restored()

    def _held(self, placed, symbol, label_names):  # pylint: disable=unused-argument
        """``(symbol, data names, label names)`` of the Module's own
        executors: here the graph itself (``symbol``, ``placed`` written)."""
        return symbol, self.pipeline.data_names(self.data_name), label_names

    def _graph(self):
        """The graph this Module binds: the Pipeline's training graph, its
        micro-batches in one graph; with ``batchnorm='deferred'`` and
        several chunks, its BatchNorm ops at momentum 1 and their
        micro-batches' statistics as outputs after the network's
        (:func:`~mp_symbolic.core.graph.batchnorm.deferred_graph`), which the
        Module does not return. A :class:`~mp_symbolic.core.graph.ir.PlacedGraph`."""
        placed = self.pipeline.training_graph(self.loss, self.data_name, self.label_name,
                                              output=self.output,
                                              shares=self.pipeline.replicas)
        self._statistics, self._own_outputs = [], None
        if self.pipeline.batchnorm == 'deferred' and self.pipeline.chunks > 1:
            count = len(placed.heads)
            placed, self._statistics = batchnorms.deferred_graph(placed)
            self._own_outputs = count if self._statistics else None
        return placed

    def _set_export(self, placed, symbol):
        """Keeps the graph a checkpoint holds: ``placed`` (``symbol``
        written) without micro-batches and with tensor-parallel layers
        unsplit, its head as one device trains it, built now and written on
        first use (:attr:`export_symbol`)."""
        pipeline = self.pipeline
        as_one = pipeline.batch_axis == 0 or pipeline.replicas == 1
        if pipeline.chunks == 1 and not pipeline.sharded and as_one:
            self._export, self._export_symbol = placed, symbol
        else:
            self._export = pipeline.training_graph(self.loss, self.data_name, self.label_name,
                                                   chunks=1, output=self.output, unsplit=True)
            self._export_symbol = None

    @property
    def export_graph(self):
        """:attr:`export_symbol`'s graph, typed (a
        :class:`~mp_symbolic.core.graph.ir.PlacedGraph`)."""
        return self._export

    @property
    def export_symbol(self):
        """The training graph without micro-batches and with tensor-parallel
        layers unsplit, which :meth:`save_checkpoint` writes (chunks and
        shards are a training schedule, not part of the model)."""
        if self._export_symbol is None:
            self._export_symbol = self._export.to_symbol()
        return self._export_symbol

    def _fit_head(self, data_shapes, label_shapes, force_rebind):
        """``loss='softmax'``: its classes on the axis the labels leave in the
        outputs (:func:`~mp_symbolic.core.graph.heads.class_axis`: axis 1 for ``(N,
        C, H, W)`` outputs with ``(N, H, W)`` labels, MXNet's ``multi_output``),
        the graph rebuilt where it has the other; its names stay."""
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
        self._placed = placed

    def _whole_graph(self):
        """The training graph of every stage (whichever this process binds)."""
        return self._symbol

    def bind(self, data_shapes, label_shapes=None, for_training=True,
             inputs_need_grad=False, force_rebind=False, shared_module=None, grad_req='write'):
        """``mx.mod.Module.bind``, after checking the batch splits into
        ``replicas x chunks`` equal parts; ``loss='softmax'`` takes its
        classes on the axis the labels leave. Each input's and label's batch
        is on the axis of ``N`` in its ``DataDesc`` layout, or on the
        Pipeline's ``batch_axis`` (:func:`~mp_symbolic.core.graph.layouts.batch_descs`);
        each output's, where its size follows the batch.

        Raises:
            ValueError: it does not, or a layout that cannot be honoured.
        """
        placement = self.pipeline.placement
        if not self.binded or force_rebind:
            data_shapes = layouts.batch_descs(data_shapes, placement.batch_axis, placement.chunks)
            if label_shapes:
                label_shapes = layouts.batch_descs(label_shapes, placement.batch_axis,
                                                   placement.chunks, labels=True)
        self._fit_head(data_shapes, label_shapes, force_rebind)
        axes = [layouts.batch_axis_of(d) for d in data_shapes]
        first = data_shapes[0]
        shape = tuple(first.shape if hasattr(first, 'shape') else first[1])
        if shape:
            placement.micro_batch(shape[axes[0]])
        self.sample_shape = shape[:axes[0]] + shape[axes[0] + 1:]
        self.input_shapes, self._batch_axes = {}, {}
        for desc, axis in zip(data_shapes, axes):
            name, shape = shape_pair(desc)
            self.input_shapes[name] = shape[:axis] + shape[axis + 1:] if axis >= 0 else shape
            self._batch_axes[name] = axis
        if not self.binded or force_rebind:
            self._lay_out_outputs(data_shapes + list(label_shapes or ()))
        with split_bind(self._devices(), self._placed, for_training and grad_req != 'null',
                        self._fixed_param_names or ()):
            super().bind(data_shapes, label_shapes, for_training, inputs_need_grad,
                         force_rebind, shared_module, grad_req)
        self._update_args = None  # a new executor group: update() lists its arrays anew
        self._default_group = self._exec_group  # the default bucket's
        self._buckets.clear()
        self._varying = {}  # input name -> the axes its buckets' shapes vary on
        self._owners = None
        self._apply_pending()

    def forward(self, data_batch, is_train=None):
        """``mx.mod.Module.forward``; a batch with a ``bucket_key`` runs on
        that key's executor group, bound at the batch's shapes on its first
        batch with the default bucket's as its shared group (its
        parameters, gradients and auxiliary states; :mod:`~mp_symbolic.core.engine.buckets`),
        a batch without on the default bucket's.

        Raises:
            ValueError: a ``bucket_key`` not among ``buckets``, or a batch
                that does not split into ``chunks x replicas`` equal parts.
        """
        assert self.binded and self.params_initialized
        key = bucketing.bucket_key(data_batch)
        group = self._default_group if key is None else \
            self._buckets.get(key, lambda: self._bucket_group(data_batch))
        if group is not self._exec_group:
            self._exec_group = group
            self._data_shapes, self._label_shapes = group.data_shapes, group.label_shapes
            self._update_args = None
        super().forward(data_batch, is_train)

    def _bucket_group(self, data_batch):
        """The executor group of a bucket's first batch: the default
        bucket's where the shapes are its, otherwise one bound at the
        batch's shapes sharing the default's arrays
        (:func:`~mp_symbolic.core.engine.buckets.shared_group`)."""
        placement, default = self.pipeline.placement, self._default_group
        data, labels = bucketing.batch_shapes(data_batch, self._data_names, self._label_names)
        if self._label_names and self.for_training:
            labels = bucketing.with_labels(self._symbol, data, labels, self._label_names)
        data = layouts.batch_descs(data, placement.batch_axis, placement.chunks)
        labels = layouts.batch_descs(labels, placement.batch_axis, placement.chunks,
                                     labels=True) if labels else None
        if [tuple(d.shape) for d in data] == [tuple(d.shape) for d in default.data_shapes]:
            return default
        self._note_bucket([(d.name, tuple(d.shape)) for d in data])
        first = data[0]
        placement.micro_batch(first.shape[layouts.batch_axis_of(first)])
        with split_bind(self._devices(), self._placed, self.for_training,
                        self._fixed_param_names or ()):
            return bucketing.shared_group(self, data, labels, default)[0]

    def _lay_out_outputs(self, descs):
        """Each output of the graph joined over the replicas on its batch
        axis: where an input's batch is not on axis 0, each output's node
        carries its layout (:func:`~mp_symbolic.core.graph.layouts.output_batch_axes`)."""
        if not self._laid_out and all(layouts.batch_axis_of(d) == 0 for d in descs):
            return
        axes = layouts.output_batch_axes(self._symbol, descs)
        self._placed = layouts.with_output_layouts(self._placed, axes)
        self._symbol = self._placed.to_symbol()
        self._laid_out = axes is not None

    def recorded_shapes(self):
        """``{input name: one sample's shape}`` that a checkpoint records (on
        the graph's input variables), for the inputs of more than one axis
        whose batch is on axis 0 (the recorded shape is ``(0,) + one
        sample's``)."""
        return {n: s for n, s in self.input_shapes.items()
                if s and self._batch_axes.get(n, 0) == 0}

    def recorded_layouts(self):
        """``{input name: layout}`` that a checkpoint records (``__layout__``)
        for the inputs whose batch is not on axis 0 (``'TN'`` for ``(T,
        N)`` tokens, ``'TNC'`` for ``(L, N, C)`` states): an exporter reads
        each input's batch there; and for an input of batch axis 0 whose
        buckets bound it at several sizes of one other axis, a layout with
        ``T`` there (``'NT'`` for ``(N, T)`` tokens), which an exporter
        reads as the sequence, dynamic."""
        found = {n: layouts.layout_of(a, len(self.input_shapes[n]) + 1)
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

    def update_metric(self, eval_metric, labels, pre_sliced=False):
        """``mx.mod.Module.update_metric``; with a loss on one of several
        outputs, the metric reads the head's output (the first), as it would
        on a network of one output."""
        group = self._exec_group
        names = group.output_names
        if self._head_first:
            group.output_names = names[:1]  # the executor group zips names with outputs
        elif self._own_outputs:
            group.output_names = names[:self._own_outputs]
        try:
            super().update_metric(eval_metric, labels, pre_sliced)
        finally:
            group.output_names = names

    def backward(self, out_grads=None):
        """``mx.mod.Module.backward``; with ``batchnorm='deferred'``, then
        one update of each BatchNorm's running statistics per replica, with
        the whole batch's (:func:`~mp_symbolic.core.graph.batchnorm.update`)."""
        super().backward(out_grads)
        if self._statistics:
            for executor in self._exec_group.execs:
                batchnorms.update(self._statistics, executor.aux_dict, executor.outputs)

    def get_outputs(self, merge_multi_context=True):
        """``mx.mod.Module.get_outputs``: the network's (or its loss head's)
        outputs, not the statistics ``batchnorm='deferred'`` reads."""
        outputs = super().get_outputs(merge_multi_context)
        return outputs[:self._own_outputs] if self._own_outputs else outputs

    @property
    def output_names(self):
        names = super().output_names
        return names[:self._own_outputs] if self._own_outputs else names

    @property
    def output_shapes(self):
        shapes = super().output_shapes
        return shapes[:self._own_outputs] if self._own_outputs else shapes

    def reshape(self, data_shapes, label_shapes=None):
        """``mx.mod.Module.reshape`` (called by ``forward`` on a batch of
        another shape: ``score``, ``predict``, ``fit``'s ``eval_data``), bound
        as :meth:`bind` binds. A batch without labels (``predict``) keeps
        labels of the new batch size, unread: the graph's loss head has them.

        Raises:
            ValueError: the batch does not split into ``chunks x replicas``
                equal parts (the one graph holds that many copies).
        """
        placement = self.pipeline.placement
        data_shapes = layouts.batch_descs(data_shapes, placement.batch_axis, placement.chunks)
        first = data_shapes[0]
        batch = shape_pair(first)[1][layouts.batch_axis_of(first)]
        placement.micro_batch(batch)
        if not label_shapes and self._label_shapes:
            label_shapes = []
            for desc in self._label_shapes:
                shape, axis = list(desc.shape), layouts.batch_axis_of(desc)
                shape[axis] = batch
                label_shapes.append(mx.io.DataDesc(desc.name, tuple(shape), desc.dtype,
                                                   desc.layout))
        elif label_shapes:
            label_shapes = layouts.batch_descs(label_shapes, placement.batch_axis,
                                               placement.chunks, labels=True)
        with split_bind(self._devices(), self._placed, self.for_training,
                        self._fixed_param_names or ()):
            super().reshape(data_shapes, label_shapes)

    def _devices(self):
        return {i: d for i, d in enumerate(self.pipeline.plan.all_devices)}

    def init_optimizer(self, kvstore='local', optimizer='sgd',
                       optimizer_params=(('learning_rate', 0.01),), force_init=False):
        """``mx.mod.Module.init_optimizer`` with per-device updates.

        With several replicas or a ``dist_*`` kvstore, the kvstore sums the
        gradients and every replica updates its own copy; the replicas then
        start from the kvstore's values (worker 0's, across processes).

        Raises:
            ValueError: ``kvstore=None`` with several replicas (they would
                drift apart silently).
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
        """``mx.mod.Module.update``; without a kvstore, one call of the
        per-device updater with argument lists made once (MXNet's loop
        rebuilds them in Python every step); with the optimizer state
        sharded (:meth:`optimizer_owners`), each parameter updated by its
        owner alone, then copied to the other replicas."""
        if self.optimizer_owners() is not None:
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
            ``None`` when the state is not sharded (``shard_optimizer``
            off, or one replica in all); else ``{parameter name: (worker,
            replica)}``: the ``dist_sync`` worker's rank (0 without one)
            and the replica of that worker whose copy owns it.
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
        """One update with the optimizer state sharded: the summed gradient
        pulled into the owner's copy only, each owner's updates in one
        per-device updater call per replica (as MXNet orders them), then
        each updated value copied to the other replicas (over ``dist_sync``
        workers, pushed by its owner and summed with the other workers'
        zeros: a non-owner's first gradient array, no longer read, is
        zeroed for it; every worker pushes every key in the same order)."""
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
        for i, name, worker, k, arrays, grads in moves:
            if kvstore is not None and 'dist' in kvstore.type:
                if worker == rank:
                    kvstore.push(name, arrays[k], priority=-i)
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
        """``{parameter name: MXNet's updater index of the copy whose state
        is read}``: Module's updater indexes parameter ``i`` of replica
        ``k`` as ``i * replicas + k``; replica 0's copy, or with the state
        sharded the owner's (a parameter another worker owns is left out)."""
        replicas, found = len(self._context), self.optimizer_owners()
        if found is None:
            return OrderedDict((n, i * replicas)
                               for i, n in enumerate(self._exec_group.param_names))
        rank = self._kvstore.rank if 'dist' in self._kvstore.type else 0
        return OrderedDict((n, i * replicas + found[n][1])
                           for i, n in enumerate(self._exec_group.param_names)
                           if n in found and found[n][0] == rank)

    def optimizer_states(self, lazy=False):
        """The optimizer state by parameter name, device-free (replica 0's;
        the replicas' are equal; with the state sharded, each owner's: over
        ``dist_sync`` workers, this worker's share), as
        :mod:`~mp_symbolic.core.optim.optstate` saves it.

        Args:
            lazy: Each of ``'arrays'`` a function of no arguments making
                that one array on the host when called (for a writer that
                holds one at a time), not the array.

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
        """Whether the optimizer state is sharded over ``dist_sync`` workers
        (each holds its share only): :meth:`optimizer_states` is then
        gathered from every worker, and every worker must call it at the
        same point."""
        found = self.optimizer_owners()
        return found is not None and 'dist' in self._kvstore.type and \
            self._kvstore.num_workers > 1

    def _gathered_states(self):
        """Every parameter's optimizer state, from the workers that own
        them: each state array (and the update count) pushed by its owner
        and as zeros by the others, the sum (the owner's) pulled by every
        worker into arrays of its own. Every worker calls it at the same
        point (a checkpoint's commit); the kvstore's keys are made on the
        first call, together."""
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
        """Puts :meth:`optimizer_states` output back, each state on its
        parameter's device, for every replica (with the state sharded, for
        its owner alone: the whole state, from any number of replicas,
        taken by name).

        A state of a fixed parameter (saved by a run that trained it) is
        dropped: the parameter is never updated, so it would never be read.

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
        on this module's plan: parameters, and the optimizer state once the
        optimizer exists (``fit`` then picks both up).

        Names are matched as saved; where Gluon's automatic names differ (the
        blocks were built in another order or process), parameters are
        matched by their place in the graph, shapes checked.

        Args:
            checkpoint: A :class:`~mp_symbolic.tools.checkpoint.Checkpoint`.

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
        checkpoint's values unless others are given. Tensor-parallel
        parameters may come by their unsplit names and shapes.

        Each value ``initializer`` draws is a function of MXNet's random
        state at the call and the parameter's (unsplit) name only, the same
        on any plan and any node (:mod:`~mp_symbolic.core.optim.initial`)."""
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
        """:meth:`get_params`'s names and values, each value a function of
        no arguments that makes that one array on the host (numpy) when
        called, from the devices (the replicas averaged as MXNet averages
        them; a tensor-parallel layer's shards joined): a caller writing
        them one at a time holds one array at a time.

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
        """The bound executors, one per replica (MXNet keeps them in the
        Module's private executor group): each holds its replica's parameter,
        gradient and auxiliary arrays (``arg_dict``, ``grad_dict``,
        ``aux_dict``) on their stages' devices; on the stage runtime, the
        arrays its stages' executors share. ``[]`` before ``bind``."""
        return list(self._exec_group.execs) if self.binded else []

    @property
    def runtimes(self):
        """The :class:`~mp_symbolic.core.engine.runtime.Runtime` of each replica:
        here its one graph's executor as a
        :class:`~mp_symbolic.core.engine.runtime.FusedRuntime`. ``[]`` before ``bind``."""
        return [FusedRuntime(e, statistics=self._statistics, own_outputs=self._own_outputs)
                for e in self.executors]

    def save_checkpoint(self, prefix, epoch, save_optimizer_states=False, remove_amp_cast=True):
        """Writes ``prefix-symbol.json`` and ``prefix-%04d.params`` as
        ``mx.mod.Module.save_checkpoint`` does, with the graph without
        micro-batches and the per-sample input shape recorded on ``data``."""
        symbol = with_input_shape(self.export_graph, self.recorded_shapes(), None,
                                  self.recorded_layouts())
        symbol.save('%s-symbol.json' % prefix, remove_amp_cast=remove_amp_cast)
        self.save_params('%s-%04d.params' % (prefix, epoch))
        if save_optimizer_states:
            self.save_optimizer_states('%s-%04d.states' % (prefix, epoch))


# the kvstore keys of the optimizer state gathered from dist_sync workers
ZERO_KEY = 'optimizer_state:'


def _map_state(state, make):
    """``state`` (an NDArray, a tuple or list of them, nested, or None) with
    each NDArray replaced by ``make(array)``, in order."""
    if state is None:
        return None
    if isinstance(state, mx.nd.NDArray):
        return make(state)
    return type(state)(_map_state(s, make) for s in state)


def shape_pair(desc):
    """``(name, shape)`` of an ``mx.io.DataDesc`` or a pair."""
    return (desc.name, tuple(desc.shape)) if hasattr(desc, 'name') else (desc[0], tuple(desc[1]))
