"""``PerDeviceUpdater``: MXNet's optimizer updater, one device per call, with
Adam's update of one device in one pass (``adam_step``: one
``fused_adam_update`` of the project's library, else one ``adam_update`` a
parameter) or one ``adam_update`` a run of parameters held as views of one
array (``Contiguous``, ``adam_contiguous``).
"""
import ctypes
import math

import numpy as np
import mxnet as mx
from mxnet.base import _LIB, OpHandle, c_str, check_call
from mxnet.ndarray import NDArray
from mxnet.ndarray._internal import _imperative_invoke

from .. import kernels
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


def _fused_adam():
    """The handle of the project's ``fused_adam_update`` where it is to run
    (:func:`~mp_symbolic.core.kernels.use_fused_adam`: its library loads in
    this process, and ``MP_SYMBOLIC_FUSED_ADAM`` is not ``0``), else None;
    asked once a process."""
    if kernels.FUSED_ADAM not in _OPS:
        _OPS[kernels.FUSED_ADAM] = _op(kernels.FUSED_ADAM) if kernels.use_fused_adam() else None
    return _OPS[kernels.FUSED_ADAM]


def _adam_arguments(opt):
    """``adam_update``'s keyword names and the values every parameter shares
    (after ``lr`` and ``wd``), written as ``Adam.update`` writes them."""
    keys = ['lr', 'wd', 'beta1', 'beta2', 'epsilon', 'rescale_grad', 'lazy_update']
    fixed = [str(opt.beta1), str(opt.beta2), str(opt.epsilon), str(opt.rescale_grad),
             str(opt.lazy_update)]
    if opt.clip_gradient:
        keys.append('clip_gradient')
        fixed.append(str(opt.clip_gradient))
    return keys, fixed


def adam_step(updater, indices, grads, weights, plain=()):
    """One device's Adam update of ``weights`` by ``grads`` (as ``Updater``
    takes them in a list call): bit for bit what ``updater(indices, grads,
    weights)`` computes and records (its states, and its optimizer's counts
    advanced). Where the parameters are on one CPU device and the project's
    library loads, one ``fused_adam_update`` updates those it may write with
    the arguments ``Adam.update`` gives ``adam_update`` (the same strings,
    read and computed as that op does: MXNet 1.9.1's Adam has no
    multi-tensor form of the same rounding); ``adam_update`` is invoked by
    its handle on each other parameter with them. The fused op may write a
    weight of rank 1, or one whose ``id`` is in ``plain`` (weights no op
    lays out anew in oneDNN's layout, which MXNet refuses a library's op as
    an output: :func:`~mp_symbolic.core.engine.runtime.plain_names`).

    With a learning-rate schedule, each parameter's rate is the schedule's
    at the count the step reaches, as ``Adam.update`` asks it.

    Returns:
        True where it updated them; False, having done nothing, where the
        updater is to run the call itself: an optimizer not exactly
        ``mx.optimizer.Adam``, an index with no state yet or one to move to
        its device, or an array not a dense float32 ``NDArray``.
    """
    opt = getattr(updater, 'optimizer', None)
    if type(opt) is not mx.optimizer.Adam or not indices:
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
    for k, index in enumerate(indices):
        t = counts[index]
        coef1 = 1. - opt.beta1**t
        coef2 = 1. - opt.beta2**t
        lrs[k] *= math.sqrt(coef2)/coef1
    keys, fixed = _adam_arguments(opt)
    rest = range(len(weights))
    fused = _fused_adam()
    device = weights[0].context
    if fused is not None and device.device_type == 'cpu':
        mine = [k for k, (g, w) in enumerate(zip(grads, weights))
                if (w.ndim == 1 or id(w) in plain) and w.context == device and g.context == device]
        if mine:
            arrays = []
            for k in mine:
                arrays.extend((weights[k], grads[k]) + tuple(states[indices[k]]))
            keep = [j for j, key in enumerate(keys) if key not in ('lr', 'wd', 'lazy_update')]
            _imperative_invoke(fused, arrays,
                               ['num_weights', 'lrs', 'wds'] + [keys[j] for j in keep],
                               [str(len(mine)), ','.join(str(lrs[k]) for k in mine),
                                ','.join(str(wds[k]) for k in mine)]
                               + [fixed[j - 2] for j in keep], [weights[k] for k in mine],
                               False, True)
            taken = set(mine)
            rest = [k for k in rest if k not in taken]
    handle = _op('adam_update')
    for k in rest:
        mean, var = states[indices[k]]
        _imperative_invoke(handle, [weights[k], grads[k], mean, var], keys,
                           [str(lrs[k]), str(wds[k])] + fixed, weights[k], False, False)
    return True


class Contiguous:
    """Parameters of one device laid out one after the other in one array
    each: weights in ``weight``, gradients in ``grad`` and, once
    :meth:`moments` makes them, Adam's moments in ``mean`` and ``var``.

    Args:
        names, shapes: The parameters and their shapes, in layout order.
        device, dtype: Every array's.

    Attributes:
        weights, grads: Views of ``weight`` / ``grad`` in each parameter's
            shape, in ``names``' order: the arrays a graph binds.
        means, variances: The same of ``mean`` and ``var`` (empty before
            :meth:`moments`).
        pairs: ``(mean view, var view)`` of each parameter: its updater state.
    """

    def __init__(self, names, shapes, device, dtype):
        self.names = list(names)
        self.device, self.dtype = device, np.dtype(dtype)
        self.bounds, start = [], 0
        for shape in shapes:
            size = int(np.prod(shape, dtype=np.int64))
            self.bounds.append((start, start + size, tuple(shape)))
            start += size
        self.weight = mx.nd.zeros((start,), device, dtype=dtype)
        self.grad = mx.nd.zeros((start,), device, dtype=dtype)
        self.weights, self.grads = self._views(self.weight), self._views(self.grad)
        self.mean = self.var = None
        self.means, self.variances, self.pairs = [], [], []
        self._spans = {}

    def _views(self, flat):
        return [flat[a:b].reshape(shape) for a, b, shape in self.bounds]

    def moments(self):
        """Makes ``mean`` and ``var`` (zeros) and their views, once."""
        if self.mean is None:
            self.mean = mx.nd.zeros(self.weight.shape, self.device, dtype=self.dtype)
            self.var = mx.nd.zeros(self.weight.shape, self.device, dtype=self.dtype)
            self.means, self.variances = self._views(self.mean), self._views(self.var)
            self.pairs = list(zip(self.means, self.variances))

    def span(self, first, last):
        """``(weight, grad, mean, var)`` over the parameters at positions
        ``first`` to ``last`` (inclusive), made once (the arrays themselves where
        they span them all)."""
        key = (first, last)
        if key not in self._spans:
            a, b = self.bounds[first][0], self.bounds[last][1]
            flats = (self.weight, self.grad, self.mean, self.var)
            self._spans[key] = flats if b - a == self.weight.size else \
                tuple(flat[a:b] for flat in flats)
        return self._spans[key]


def adam_contiguous(updater, indices, grads, weights, where):
    """One device's Adam update of ``weights`` by ``grads``, views of
    :class:`Contiguous` arrays: one ``adam_update`` call over each run of
    adjacent parameters of the same learning rate and weight decay, bit for
    bit what :func:`adam_step` computes (the update is elementwise). With a
    learning-rate schedule, each parameter's rate is the schedule's at the
    count the step reaches, as ``Adam.update`` asks it. The
    updater's ``states`` become views of the :class:`Contiguous`' moments; a
    state put in their place (``set_states``) is copied into them on the next
    call.

    Args:
        updater: An ``mx.optimizer.Updater`` whose states are read and replaced
            and whose optimizer's counts advance.
        indices, grads, weights: One device's parameters, as ``Updater`` takes
            them in a list call.
        where: ``{id(weight view): (Contiguous, position)}``
            (:meth:`PerDeviceUpdater.hold`).

    Returns:
        True where it updated them; False, having changed nothing, where the
        optimizer is not exactly ``mx.optimizer.Adam``, a weight or gradient
        is not a float32 view a :class:`Contiguous` holds at the same
        position, the update counts differ, or a state is not a pair of
        dense arrays of the weight's shape and dtype.
    """
    opt = getattr(updater, 'optimizer', None)
    if type(opt) is not mx.optimizer.Adam or not indices:
        return False
    places = []
    for grad, weight in zip(grads, weights):
        place = where.get(id(weight))
        if place is None or place[0].dtype != np.float32 or \
                place[0].weights[place[1]] is not weight or place[0].grads[place[1]] is not grad:
            return False
        places.append(place)
    opt._set_current_context(weights[0].context.device_id)  # pylint: disable=protected-access
    counts = opt._index_update_count  # pylint: disable=protected-access
    if len({counts.get(i, opt.begin_num_update) for i in indices}) != 1:
        return False
    states, adopt = updater.states, []
    for index, weight, (flat, k) in zip(indices, weights, places):
        state = states.get(index)
        if flat.pairs and state is flat.pairs[k]:   # the moments' own views
            continue
        if state is not None and not (
                isinstance(state, (tuple, list)) and len(state) == 2 and
                all(isinstance(s, NDArray) and s.shape == weight.shape and s.dtype == weight.dtype
                    and s.stype == 'default' for s in state)):
            return False
        adopt.append((index, state, flat, k))
    for index, state, flat, k in adopt:
        flat.moments()
        mine = flat.pairs[k]
        if state is not None:  # another state put in place: its values kept
            state[0].copyto(mine[0])
            state[1].copyto(mine[1])
        else:
            mine[0][:] = 0
            mine[1][:] = 0
        states[index] = mine
        updater.states_synced[index] = True
    opt._update_count(indices)  # pylint: disable=protected-access
    lrs = opt._get_lrs(indices)  # pylint: disable=protected-access
    wds = opt._get_wds(indices)  # pylint: disable=protected-access
    t = counts[indices[0]]
    coef1 = 1. - opt.beta1**t
    coef2 = 1. - opt.beta2**t
    keys, fixed = _adam_arguments(opt)
    handle = _op('adam_update')
    start = 0
    for end in range(1, len(indices) + 1):
        if end < len(indices) and places[end][0] is places[start][0] and \
                places[end][1] == places[end - 1][1] + 1 and \
                lrs[end] == lrs[start] and wds[end] == wds[start]:
            continue
        lr = lrs[start] * (math.sqrt(coef2)/coef1)
        weight, grad, mean, var = places[start][0].span(places[start][1], places[end - 1][1])
        _imperative_invoke(handle, [weight, grad, mean, var], keys,
                           [str(lr), str(wds[start])] + fixed, weight, False, False)
        start = end
    return True


class PerDeviceUpdater:
    """Wraps an ``mx.optimizer.Updater`` so each call updates one device's arrays.

    MXNet's Updater fuses up to ``MXNET_OPTIMIZER_AGGREGATION_SIZE`` parameters
    into one ``multi_*_update`` op by dtype alone, so a call over several
    devices (as ``Module.update`` makes) would run one op across devices. Each
    call is split by device
    (:func:`~mp_symbolic.core.base.compat.updates_by_device`); Adam runs as
    :func:`adam_contiguous` on the arrays :meth:`hold` names, else as
    :func:`adam_step`, else as the updater. Other attributes are the updater's.

    Args:
        updater: The ``mx.optimizer.Updater`` wrapped.
    """

    def __init__(self, updater):
        self.updater = updater
        self._held, self._where = None, {}
        self._plain_held, self._plain = None, frozenset()
        self._split = (None, None)   # the last call's arrays, and their split by device

    def hold(self, contiguous):
        """Updates the parameters viewed in ``contiguous`` (a list of
        :class:`Contiguous`, kept by reference; ``None`` or empty: none) in
        one call a run of them from now on."""
        if contiguous is not self._held:
            self._held = contiguous
            self._where = {id(w): (flat, k) for flat in contiguous or ()
                           for k, w in enumerate(flat.weights)}

    def plain(self, weights):
        """Lets :func:`adam_step`'s fused op write ``weights`` (a list, kept
        by reference; ``None`` or empty: weights of rank 1 only): arrays no
        op lays out anew in oneDNN's layout
        (:attr:`~mp_symbolic.core.engine.runtime.ArrayGroup.plain`)."""
        if weights is not self._plain_held:
            self._plain_held = weights
            self._plain = frozenset(map(id, weights or ()))

    def _by_device(self, index, grad, weight):
        """``updates_by_device``'s split, kept while the same arrays come (the
        split holds them, so their ids stay theirs)."""
        key = (tuple(index), tuple(map(id, grad)), tuple(map(id, weight)))
        if self._split[0] != key:
            self._split = (key, updates_by_device(index, grad, weight))
        return self._split[1]

    def __call__(self, index, grad, weight):
        if not isinstance(index, (list, tuple)):
            return self.updater(index, grad, weight)
        for indices, grads, weights in self._by_device(index, grad, weight):
            if not (self._where and adam_contiguous(self.updater, indices, grads, weights,
                                                    self._where)) and \
                    not adam_step(self.updater, indices, grads, weights, self._plain):
                self.updater(indices, grads, weights)
        return None

    def __getattr__(self, name):  # get_states, set_states, optimizer, states, ...
        return getattr(self.updater, name)
