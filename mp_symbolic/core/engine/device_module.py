"""``DeviceModule``: ``mx.mod.Module`` whose parameters live on their devices
only, without MXNet's host copy of every parameter on ``cpu(0)``
(docs/pipelining.md, "A Module's memory from Python").

What the host copy did is done from the devices, with MXNet's own code
where it has some: ``init_params`` fills one host array at a time and
copies it to the devices; ``get_params`` (and ``save_params``,
``save_checkpoint``, ``fit``'s callbacks) returns a fresh copy gathered as
MXNet gathers its own; a kvstore and a rebind start from a fresh copy,
dropped after. ``host_copy=True`` keeps MXNet's behaviour. MXNet 1.9.1's
``tests/python/unittest/test_module.py`` passes against this class
(``tests/upstream/conftest.py``).
"""
import warnings

import mxnet as mx
from mxnet.initializer import InitDesc

from ..base.compat import write_into
import numpy as np

__all__ = []


class DeviceModule(mx.mod.Module):
    """``mx.mod.Module`` without the host copy of its parameters.

    Args:
        symbol, data_names, label_names, ...: As ``mx.mod.Module`` takes them.
        host_copy: Keep MXNet's host copy of every parameter: ``get_params``
            then returns the same arrays each time, brought up to date.

    Attributes:
        host_copy: Whether the Module keeps the host copy.
    """

    def __init__(self, *args, host_copy=False, **kwargs):
        self.host_copy = bool(host_copy)
        self._kept = [None, None]  # the host copy, (arg, aux); MXNet's __init__ sets it to None
        super().__init__(*args, **kwargs)

    @staticmethod
    def load(prefix, epoch, load_optimizer_states=False, **kwargs):
        """``mx.mod.Module.load``: a DeviceModule holding the checkpoint's values
        until it is bound."""
        symbol, arg_params, aux_params = mx.model.load_checkpoint(prefix, epoch)
        mod = DeviceModule(symbol=symbol, **kwargs)
        mod._arg_params, mod._aux_params = arg_params, aux_params
        mod.params_initialized = True
        if load_optimizer_states:
            mod._preload_opt_states = '%s-%04d.states' % (prefix, epoch)
        return mod

    # MXNet's own code reads and writes the host copy under these two names.
    @property
    def _arg_params(self):
        return self._host_values(0)

    @_arg_params.setter
    def _arg_params(self, value):
        self._kept[0] = value

    @property
    def _aux_params(self):
        return self._host_values(1)

    @_aux_params.setter
    def _aux_params(self, value):
        self._kept[1] = value

    @property
    def host_params(self):
        """``(arg_params, aux_params)`` kept on the host: ``(None, None)`` unless
        ``host_copy`` (or :meth:`load` read them and the Module is not bound yet)."""
        return tuple(self._kept)

    def _host_values(self, which):
        if self._kept[which] is not None or self.host_copy or \
                not (self.binded and self.params_initialized):
            return self._kept[which]
        return self._from_devices()[which]  # read by code that expects the copy: a fresh one

    def _from_devices(self):
        """A fresh host copy ``(arg_params, aux_params)``, filled as MXNet's
        ``_sync_params_from_devices`` fills its own."""
        group = self._exec_group
        arg = {name: mx.nd.zeros(a[0].shape, dtype=a[0].dtype, stype=a[0].stype)
               for name, a in zip(self._param_names, group.param_arrays)}
        aux = {name: mx.nd.zeros(a[0].shape, dtype=a[0].dtype)
               for name, a in zip(self._aux_names, group.aux_arrays)}
        if len(self._context) == 1 and all(a[0].stype == 'default'
                                           for a in group.param_arrays):
            aux_written(group)
            # one replica: its values copied straight, the bits MXNet's average
            # of one gives (sum([copy]) / 1), without its temporaries per array
            for target, arrays in ((arg, group.param_arrays), (aux, group.aux_arrays)):
                for value, block in zip(target.values(), arrays):
                    block[0].copyto(value)
            return arg, aux
        kept, dirty = self._kept, self._params_dirty
        self._kept = [arg, aux]
        try:
            aux_written(group)
            super()._sync_params_from_devices()  # MXNet's own, on the fresh copy
        finally:
            self._kept, self._params_dirty = kept, dirty
        return arg, aux

    def _sync_params_from_devices(self):
        if self._kept[0] is None:  # no copy to bring up to date: each read makes its own
            self._params_dirty = False
            return
        aux_written(self._exec_group)
        super()._sync_params_from_devices()

    def _reset_bind(self):
        # a rebind: MXNet's bind copies the host copy into the new executors
        if not self.host_copy and self._kept[0] is None and self.binded and \
                self.params_initialized:
            self._kept = list(self._from_devices())
        super()._reset_bind()

    def bind(self, data_shapes, label_shapes=None, for_training=True, inputs_need_grad=False,
             force_rebind=False, shared_module=None, grad_req='write'):
        """``mx.mod.Module.bind``; then, unless ``host_copy``, no host copy is kept."""
        if self.host_copy:
            super().bind(data_shapes, label_shapes, for_training, inputs_need_grad,
                         force_rebind, shared_module, grad_req)
            return
        empty = not self.params_initialized and shared_module is None and \
            (force_rebind or not self.binded)
        if empty:  # as if initialised with nothing: MXNet then copies nothing in
            self._kept, self.params_initialized = [{}, {}], True
        try:
            super().bind(data_shapes, label_shapes, for_training, inputs_need_grad,
                         force_rebind, shared_module, grad_req)
        finally:
            if empty:
                self._kept, self.params_initialized = [None, None], False
        # (a failed rebind keeps the copy it carried: the values have nowhere else)
        self._kept = [None, None]

    def init_params(self, initializer=mx.init.Uniform(0.01), arg_params=None, aux_params=None,
                    allow_missing=False, force_init=False, allow_extra=False):
        """``mx.mod.Module.init_params``, each value written to the devices' arrays:
        an initialised one through a host array of its own, in MXNet's order,
        dropped before the next is made; a given one copied straight. Without
        ``initializer`` a parameter missing from ``arg_params`` keeps its devices'
        value."""
        if self.host_copy:
            super().init_params(initializer, arg_params, aux_params, allow_missing, force_init,
                                allow_extra)
            return
        if self.params_initialized and not force_init:
            warnings.warn('Parameters already initialized and force_init=False. '
                          'init_params call ignored.', stacklevel=2)
            return
        assert self.binded, 'call bind before initializing the parameters'
        group, attrs = self._exec_group, self._symbol.attr_dict()
        first = not self.params_initialized
        for names, blocks, given, sparse in ((self._param_names, group.param_arrays,
                                              arg_params, True),
                                             (self._aux_names, group.aux_arrays, aux_params,
                                              False)):
            for name, block in sorted(zip(names, blocks), key=lambda item: item[0]):
                if given is not None and name in given:
                    value = given[name]
                elif given is not None and not allow_missing:
                    raise RuntimeError('%s is not presented' % name)
                elif initializer is None and not first:
                    continue
                else:
                    stype = {'stype': block[0].stype} if sparse else {}
                    value = mx.nd.zeros(block[0].shape, dtype=block[0].dtype, **stype)
                    if initializer is not None:
                        initializer(InitDesc(name, attrs.get(name, None)), value)
                for array in block:
                    if isinstance(value, np.ndarray):
                        write_into(array, value)  # also where oneDNN keeps its own layout
                    elif value is not array:
                        value.copyto(array)
                if given is None or name not in given:
                    # the host array is let go before the next is made: one at a time
                    for array in block:
                        array.wait_to_read()
        self.params_initialized = True
        self._params_dirty = False

    def get_params(self):
        """``mx.mod.Module.get_params``: unless ``host_copy``, a fresh host copy of
        the devices' values (replicas averaged, as MXNet does), not kept."""
        if self.host_copy or self._kept[0] is not None:
            return super().get_params()
        assert self.params_initialized
        return self._from_devices()

    def init_optimizer(self, kvstore='local', optimizer='sgd',
                       optimizer_params=(('learning_rate', 0.01),), force_init=False):
        """``mx.mod.Module.init_optimizer``; a kvstore starts from a fresh host copy,
        dropped after."""
        if self.host_copy or self._kept[0] is not None or \
                not (self.binded and self.params_initialized) or \
                self.optimizer_initialized and not force_init:
            super().init_optimizer(kvstore, optimizer, optimizer_params, force_init)
            return
        # MXNet makes a kvstore (and reads the copy) unless told none, or
        # given a name of a local one with one replica (model._create_kvstore)
        local = kvstore is None or isinstance(kvstore, str) and len(self._context) == 1 and \
            'dist' not in kvstore
        self._params_dirty = False
        self._kept = [{}, {}] if local else list(self._from_devices())
        try:
            super().init_optimizer(kvstore, optimizer, optimizer_params, force_init)
        finally:
            self._kept = [None, None]


def aux_written(group):
    """Waits until every operation queued on the auxiliary states of ``group``
    (an executor group), and those reading them, is done: MXNet 1.9.1's
    BatchNorm backward writes its running statistics through inputs it
    declares read-only, so no later read is ordered after that write."""
    waited = False
    for block in group.aux_arrays:
        for array in block:
            mx.base.check_call(mx.base._LIB.MXNDArrayWaitToWrite(array.handle))  # pylint: disable=protected-access
            waited = True
    if waited:
        mx.nd.waitall()
