"""``PipelineModule``: an ``mx.mod.Module`` for a :class:`~mp_symbolic.Pipeline`.

It is MXNet's own Module (``fit``, ``score``, ``predict``, ``save_checkpoint``
work unchanged), built from the Pipeline's tagged training graph and bound to
its stages' devices through ``group2ctxs`` (one dict per replica), with two
differences that model parallelism needs:

* every optimizer update runs on the device of the parameter it updates
  (:class:`PerDeviceUpdater`);
* the kvstore, where there is one, only sums gradients (across replicas or
  worker processes); each replica then updates its own copy on its own
  devices, so optimizer state stays beside its weights and can be saved by
  parameter name.

References: MXNet 1.9.1 ``python/mxnet/module/module.py``,
``tests/python/unittest/test_module.py::test_module_ctx_group``.
"""
from collections import OrderedDict
import json

import mxnet as mx

from .placement import split_bind
from .scoped import environ

__all__ = ['PipelineModule', 'PerDeviceUpdater', 'with_input_shape']


class PerDeviceUpdater:
    """Wraps an ``mx.optimizer.Updater`` so each call updates one device's arrays.

    MXNet's Updater fuses up to ``MXNET_OPTIMIZER_AGGREGATION_SIZE`` (4)
    parameters into one ``multi_*_update`` op, grouping them by dtype only:
    handed the parameters of several devices at once (as ``Module.update``
    does), one op would run on one device over another device's weights. This
    splits each call by device and keeps the fusion within a device.
    """

    def __init__(self, updater):
        self.updater = updater

    def __call__(self, index, grad, weight):
        if not isinstance(index, (list, tuple)):
            return self.updater(index, grad, weight)
        by_device = OrderedDict()
        for i, g, w in zip(index, grad, weight):
            by_device.setdefault(w.context, []).append((i, g, w))
        for items in by_device.values():
            indices, grads, weights = zip(*items)
            self.updater(list(indices), list(grads), list(weights))
        return None

    def __getattr__(self, name):  # get_states, set_states, optimizer, states, ...
        return getattr(self.updater, name)


def with_input_shape(symbol, data_name, sample_shape):
    """``symbol`` with ``(0,) + sample_shape`` recorded on its data variable.

    MXNet reads a 0 dimension as unknown, so the graph still binds at any
    batch size; an exporter reads the per-sample shape back from the file.
    """
    graph = json.loads(symbol.tojson())
    for node in graph['nodes']:
        if node['op'] == 'null' and node['name'] == data_name:
            node.setdefault('attrs', {})['__shape__'] = str((0,) + tuple(sample_shape))
    return mx.sym.load_json(json.dumps(graph))


class PipelineModule(mx.mod.Module):
    """MXNet's Module over a Pipeline's stages (use :meth:`Pipeline.module`).

    Args:
        pipeline: The :class:`~mp_symbolic.Pipeline`.
        loss: See :func:`mp_symbolic.heads.make_head`.
        data_name, label_name: Input and label variable names.
        **kwargs: Passed to ``mx.mod.Module``.

    Attributes:
        pipeline: The Pipeline.
        export_symbol: The training graph without micro-batches, which
            :meth:`save_checkpoint` writes (chunks are a training schedule,
            not part of the model).
    """

    def __init__(self, pipeline, loss='softmax', data_name='data', label_name='softmax_label',
                 **kwargs):
        for key in ('context', 'group2ctxs', 'data_names', 'label_names'):
            if key in kwargs:
                raise ValueError('%s: expected it from the Pipeline (its devices and names), '
                                 'found it given' % key)
        self.pipeline = pipeline
        self.loss = loss
        self.data_name, self.label_name = data_name, label_name
        symbol = pipeline.training_symbol(loss, data_name, label_name)
        self.export_symbol = symbol if pipeline.chunks == 1 else \
            pipeline.training_symbol(loss, data_name, label_name, chunks=1)
        arguments = symbol.list_arguments()
        label_names = (label_name,) if label_name in arguments else ()
        plan = pipeline.plan
        super().__init__(symbol, data_names=(data_name,), label_names=label_names,
                         context=[devices[0] for devices in plan.replica_devices],
                         group2ctxs=plan.group2ctxs, **kwargs)
        self.sample_shape = None

    def bind(self, data_shapes, label_shapes=None, for_training=True,
             inputs_need_grad=False, force_rebind=False, shared_module=None, grad_req='write'):
        """``mx.mod.Module.bind``, after checking the batch splits into
        ``replicas x chunks`` equal parts.

        Raises:
            ValueError: it does not.
        """
        first = data_shapes[0]
        shape = tuple(first.shape if hasattr(first, 'shape') else first[1])
        parts = self.pipeline.chunks * self.pipeline.replicas
        if shape and shape[0] % parts:
            raise ValueError('batch size: expected a multiple of chunks x replicas (%d x %d = %d),'
                             ' found %d' % (self.pipeline.chunks, self.pipeline.replicas, parts,
                                            shape[0]))
        self.sample_shape = shape[1:]
        with split_bind(self._devices()):
            super().bind(data_shapes, label_shapes, for_training, inputs_need_grad,
                         force_rebind, shared_module, grad_req)

    def reshape(self, data_shapes, label_shapes=None):
        """``mx.mod.Module.reshape`` (called by ``forward`` on a batch of
        another shape), bound as :meth:`bind` binds."""
        with split_bind(self._devices()):
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
        # Module decides update_on_kvstore from this variable when it creates the
        # kvstore; 0 makes the kvstore sum gradients and leaves the update local.
        with environ(MXNET_UPDATE_ON_KVSTORE='0'):
            super().init_optimizer(kvstore, optimizer, optimizer_params, force_init=force_init)
        if self._updater is not None and not isinstance(self._updater, PerDeviceUpdater):
            self._updater = PerDeviceUpdater(self._updater)
        self._update_args = None
        if self._kvstore is not None and 'dist' in self._kvstore.type:
            # every worker starts from the values the kvstore holds (worker 0's)
            for i, (name, arrays) in enumerate(zip(self._exec_group.param_names,
                                                   self._exec_group.param_arrays)):
                self._kvstore.pull(name, out=arrays, priority=-i)
            self._params_dirty = True

    def update(self):
        """``mx.mod.Module.update``; without a kvstore, one call of the
        per-device updater with argument lists made once (MXNet's loop
        rebuilds them in Python every step)."""
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

    @property
    def kvstore(self):
        """The kvstore summing gradients, or ``None``."""
        return self._kvstore

    @property
    def updater(self):
        """The :class:`PerDeviceUpdater` (``None`` before ``init_optimizer``)."""
        return self._updater

    def save_checkpoint(self, prefix, epoch, save_optimizer_states=False, remove_amp_cast=True):
        """Writes ``prefix-symbol.json`` and ``prefix-%04d.params`` as
        ``mx.mod.Module.save_checkpoint`` does, with the graph without
        micro-batches and the per-sample input shape recorded on ``data``."""
        symbol = self.export_symbol
        if self.sample_shape is not None:
            symbol = with_input_shape(symbol, self.data_name, self.sample_shape)
        symbol.save('%s-symbol.json' % prefix, remove_amp_cast=remove_amp_cast)
        self.save_params('%s-%04d.params' % (prefix, epoch))
        if save_optimizer_states:
            self.save_optimizer_states('%s-%04d.states' % (prefix, epoch))
