"""``PerDeviceUpdater``: MXNet's optimizer updater, one device per call;
``adam_step``: one device's Adam update of many parameters in one pass.

Reference: MXNet 1.9.1 ``python/mxnet/optimizer/updater.py`` (``Updater.__call__``
and its ``MXNET_OPTIMIZER_AGGREGATION_SIZE`` fusion) and ``optimizer.py``
(``Adam.update``).
"""
import ctypes
import math

import numpy as np
import mxnet as mx
from mxnet.base import _LIB, OpHandle, c_str, check_call
from mxnet.ndarray import NDArray
from mxnet.ndarray._internal import _imperative_invoke

from ..base.compat import updates_by_device

__all__ = []

_OPS = {}


def _op(name):
    """The handle of MXNet's operator ``name``, looked up once."""
    if name not in _OPS:
        handle = OpHandle()
        check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
        _OPS[name] = handle.value
    return _OPS[name]


def adam_step(updater, indices, grads, weights):
    """One device's Adam update of ``weights`` by ``grads``: bit for bit what
    ``updater(indices, grads, weights)`` computes and records, in one pass.

    MXNet 1.9.1's ``Adam`` has no multi-tensor form (its ``aggregate_num`` is
    0; ``_multi_adamw_update`` rounds its moments differently), so the
    ``Updater`` runs ``Adam.update`` once a parameter, each building its
    arguments and calling ``adam_update`` through the generated Python
    function. Here the counts are advanced, the learning rates and weight
    decays read once for all ``indices``, and ``adam_update`` invoked by its
    operator handle on each parameter with the arguments ``Adam.update``
    gives it (the same values, written as the same strings).

    Args:
        updater: an ``mx.optimizer.Updater`` (what ``mx.optimizer.get_updater``
            returns), whose states are read and whose optimizer's counts advance.
        indices, grads, weights: one device's parameters, as ``Updater`` takes
            them in a list call.

    Returns:
        True where it updated them; False, having done nothing, where the
        updater is to run the call itself: its optimizer is not exactly
        ``mx.optimizer.Adam``, has a learning-rate schedule (read by each
        parameter's count in turn), an index has no state yet or one to move
        to its device, or an array is not a dense float32 ``NDArray``.
    """
    opt = getattr(updater, 'optimizer', None)
    if type(opt) is not mx.optimizer.Adam or opt.lr_scheduler is not None or not indices:
        return False
    states, synced = updater.states, updater.states_synced
    for index, grad, weight in zip(indices, grads, weights):
        if not synced.get(index) or type(weight) is not NDArray or type(grad) is not NDArray:
            return False
        if weight.dtype != np.float32 or weight.stype != 'default' or grad.stype != 'default':
            return False
    opt._set_current_context(weights[0].context.device_id)  # pylint: disable=protected-access
    opt._update_count(indices)  # pylint: disable=protected-access
    lrs = opt._get_lrs(indices)  # pylint: disable=protected-access
    wds = opt._get_wds(indices)  # pylint: disable=protected-access
    counts = opt._index_update_count  # pylint: disable=protected-access
    keys = ['lr', 'wd', 'beta1', 'beta2', 'epsilon', 'rescale_grad', 'lazy_update']
    fixed = [str(opt.beta1), str(opt.beta2), str(opt.epsilon), str(opt.rescale_grad),
             str(opt.lazy_update)]
    if opt.clip_gradient:
        keys.append('clip_gradient')
        fixed.append(str(opt.clip_gradient))
    handle = _op('adam_update')
    for index, grad, weight, lr, wd in zip(indices, grads, weights, lrs, wds):
        t = counts[index]
        coef1 = 1. - opt.beta1**t
        coef2 = 1. - opt.beta2**t
        lr *= math.sqrt(coef2)/coef1
        mean, var = states[index]
        _imperative_invoke(handle, [weight, grad, mean, var], keys, [str(lr), str(wd)] + fixed,
                           weight, False, False)
    return True


class PerDeviceUpdater:
    """Wraps an ``mx.optimizer.Updater`` so each call updates one device's arrays.

    MXNet's Updater fuses up to ``MXNET_OPTIMIZER_AGGREGATION_SIZE`` (4)
    parameters into one ``multi_*_update`` op, grouping them by dtype only:
    handed the parameters of several devices at once (as ``Module.update``
    does), one op would run on one device over another device's weights. This
    splits each call by device and keeps the fusion within a device
    (:func:`mp_symbolic.core.base.compat.updates_by_device`); each device's Adam
    update runs in one pass (:func:`adam_step`), its result the updater's.
    """

    def __init__(self, updater):
        self.updater = updater

    def __call__(self, index, grad, weight):
        if not isinstance(index, (list, tuple)):
            return self.updater(index, grad, weight)
        for indices, grads, weights in updates_by_device(index, grad, weight):
            if not adam_step(self.updater, indices, grads, weights):
                self.updater(indices, grads, weights)
        return None

    def __getattr__(self, name):  # get_states, set_states, optimizer, states, ...
        return getattr(self.updater, name)
