"""``PerDeviceUpdater``: MXNet's optimizer updater, one device per call.

Reference: MXNet 1.9.1 ``python/mxnet/optimizer/updater.py`` (``Updater.__call__``
and its ``MXNET_OPTIMIZER_AGGREGATION_SIZE`` fusion).
"""
from .compat import updates_by_device

__all__ = []


class PerDeviceUpdater:
    """Wraps an ``mx.optimizer.Updater`` so each call updates one device's arrays.

    MXNet's Updater fuses up to ``MXNET_OPTIMIZER_AGGREGATION_SIZE`` (4)
    parameters into one ``multi_*_update`` op, grouping them by dtype only:
    handed the parameters of several devices at once (as ``Module.update``
    does), one op would run on one device over another device's weights. This
    splits each call by device and keeps the fusion within a device
    (:func:`mp_symbolic.core.compat.updates_by_device`).
    """

    def __init__(self, updater):
        self.updater = updater

    def __call__(self, index, grad, weight):
        if not isinstance(index, (list, tuple)):
            return self.updater(index, grad, weight)
        for indices, grads, weights in updates_by_device(index, grad, weight):
            self.updater(indices, grads, weights)
        return None

    def __getattr__(self, name):  # get_states, set_states, optimizer, states, ...
        return getattr(self.updater, name)
