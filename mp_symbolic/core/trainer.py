"""``Trainer``: ``gluon.Trainer``'s interface for parameters on different devices.

``gluon.Trainer`` is built for data parallelism: it expects every parameter on
the same set of devices and refuses a model-parallel network at construction
("All Parameters must be initialized on the same set of contexts", apache/mxnet
#18406 asks for this class). This one takes parameters that each live on one
device, keeps one optimizer over all of them, and updates each parameter on
its own device, fusing updates only within a device
(:class:`~mp_symbolic.core.module.PerDeviceUpdater`). Its optimizer state is saved
by parameter name, on the CPU, so it loads onto any other placement.
"""
from collections import OrderedDict

import mxnet as mx

from .updater import PerDeviceUpdater
from .optstate import load_states, save_states, states_by_name, set_states_by_name

__all__ = []


class Trainer:
    """Applies an optimizer to parameters that live on different devices.

    Args:
        params: A ``ParameterDict`` (``net.collect_params()``), a dict, or a
            list of ``Parameter`` s; each initialised on exactly one device.
        optimizer: An ``mx.optimizer.Optimizer`` or its name (``'sgd'``, ...).
        optimizer_params: Keyword arguments of the optimizer, when given by
            name (``{'learning_rate': 0.1}``).

    Raises:
        ValueError: a parameter is on several devices (use ``gluon.Trainer``
            for data parallelism), or is listed twice.
    """

    def __init__(self, params, optimizer, optimizer_params=None):
        if isinstance(params, (dict, mx.gluon.ParameterDict)):
            params = list(params.values())
        self._params = list(params)
        names = [p.name for p in self._params]
        if len(set(names)) != len(names):
            raise ValueError('params: expected each parameter once, found %s twice'
                             % next(n for n in names if names.count(n) > 1))
        param_dict = {i: p for i, p in enumerate(self._params)}
        if isinstance(optimizer, mx.optimizer.Optimizer):
            if optimizer_params:
                raise ValueError('optimizer_params: expected none with an Optimizer instance '
                                 '(set them on it), found %r' % (optimizer_params,))
            self._optimizer = optimizer
            self._optimizer.param_dict = param_dict
        else:
            self._optimizer = mx.optimizer.create(optimizer, param_dict=param_dict,
                                                  **dict(optimizer_params or {}))
        self._scale = self._optimizer.rescale_grad
        self._updater = PerDeviceUpdater(mx.optimizer.get_updater(self._optimizer))

    @property
    def optimizer(self):
        return self._optimizer

    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    def set_learning_rate(self, lr):
        """Sets the learning rate (also under an ``lr_scheduler``, as Gluon does)."""
        self._optimizer.set_learning_rate(lr)

    def _device_of(self, param):
        ctxs = param.list_ctx()
        if len(ctxs) != 1:
            raise ValueError('expected each parameter on one device (model parallelism), '
                             'found %s on %s; use gluon.Trainer for data parallelism'
                             % (param.name, ', '.join(str(c) for c in ctxs)))
        return ctxs[0]

    def allreduce_grads(self):
        """Nothing to do: each parameter has one copy, so one gradient.

        Kept so that code written for ``gluon.Trainer`` runs unchanged.
        """

    def step(self, batch_size, ignore_stale_grad=False):
        """One update of every parameter, gradients scaled by ``1 / batch_size``.

        Raises:
            UserWarning: as ``gluon.Trainer`` does, a parameter whose gradient
                was not computed since the last step (unless
                ``ignore_stale_grad``).
        """
        self._optimizer.rescale_grad = self._scale / batch_size
        self._update(ignore_stale_grad)

    def update(self, batch_size, ignore_stale_grad=False):
        """Same as :meth:`step` (there is no gradient reduction to skip)."""
        self.step(batch_size, ignore_stale_grad)

    def _update(self, ignore_stale_grad):
        indices, grads, weights = [], [], []
        for i, param in enumerate(self._params):
            if param.grad_req == 'null':
                continue
            self._device_of(param)
            data = param.list_data()[0]
            if not data._fresh_grad:  # pylint: disable=protected-access
                if ignore_stale_grad:
                    continue
                raise UserWarning(
                    'Gradient of Parameter `%s` on context %s has not been updated by backward '
                    'since last `step`. This could mean a bug in your model that made it only '
                    'use a subset of the Parameters (Blocks) for this iteration. If you are '
                    'intentionally only using a subset, call step with ignore_stale_grad=True '
                    'to suppress this warning and skip updating of Parameters with stale '
                    'gradient' % (param.name, data.context))
            indices.append(i)
            grads.append(param.list_grad()[0])
            weights.append(data)
            data._fresh_grad = False  # pylint: disable=protected-access
        if indices:
            self._updater(indices, grads, weights)

    def states(self):
        """Optimizer state by parameter name, as numpy (see :mod:`~mp_symbolic.core.optstate`)."""
        names = OrderedDict((i, p.name) for i, p in enumerate(self._params))
        return states_by_name(self._updater, self._optimizer, names)

    def set_states(self, states):
        """Restores :meth:`states`; each state goes to its parameter's device."""
        targets = OrderedDict((p.name, (i, self._device_of(p)))
                              for i, p in enumerate(self._params))
        set_states_by_name(self._updater, self._optimizer, states, targets)

    def save_states(self, fname):
        """Saves the optimizer state (by parameter name, device-free) to ``fname``."""
        save_states(fname, self.states())

    def load_states(self, fname):
        """Loads :meth:`save_states` output; works on any placement of the parameters."""
        self.set_states(load_states(fname))
