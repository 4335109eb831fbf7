"""The per-device updater's one-pass Adam step (core/optim/updater.py:adam_step)
against MXNet's own Updater: the same weights, moments and counts, bit for bit."""
import mxnet as mx
import numpy as np
import pytest

from mp_symbolic.core.base.compat import updates_by_device
from mp_symbolic.core.optim.updater import Contiguous, PerDeviceUpdater, adam_step

SHAPES = [(166, 64), (64,), (192, 64), (64, 256), (1,)]


def _arrays(seed, devices):
    rng = np.random.default_rng(seed)
    return [mx.nd.array(rng.normal(size=s).astype(np.float32), ctx=devices[k % len(devices)])
            for k, s in enumerate(SHAPES)]


def _run(updater, steps, devices):
    weights = _arrays(0, devices)
    for step in range(steps):
        updater(list(range(len(SHAPES))), _arrays(1 + step, devices), weights)
    mx.nd.waitall()
    return weights


def _optimizer(**kwargs):
    opt = mx.optimizer.Adam(learning_rate=3e-3, rescale_grad=1 / 16., **kwargs)
    opt.set_lr_mult({1: 0.5})
    opt.set_wd_mult({3: 0.0})
    return opt


@pytest.mark.parametrize('kwargs', [{}, {'wd': 1e-2, 'clip_gradient': 0.5}],
                         ids=['plain', 'weight decay and clipping'])
def test_adam_step_equals_mxnets_adam_bit_for_bit(kwargs):
    """Three steps over parameters on two devices (per-parameter learning
    rate and weight-decay multipliers among them): every weight, both
    moments and each device's counts as MXNet's Updater leaves them."""
    devices = [mx.cpu(0), mx.cpu(1)]
    theirs = mx.optimizer.get_updater(_optimizer(**kwargs))
    ours = PerDeviceUpdater(mx.optimizer.get_updater(_optimizer(**kwargs)))
    expected = _run(lambda i, g, w: [theirs(*part) for part in updates_by_device(i, g, w)],
                    3, devices)
    found = _run(ours, 3, devices)
    for a, b in zip(expected, found):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    _assert_same_states(theirs, ours, 3)


def _assert_same_states(theirs, ours, steps):
    """Both updaters hold equal Adam states and update counts after ``steps``."""
    assert sorted(theirs.states) == sorted(ours.states)
    for index, (mean, var) in theirs.states.items():
        np.testing.assert_array_equal(mean.asnumpy(), ours.states[index][0].asnumpy())
        np.testing.assert_array_equal(var.asnumpy(), ours.states[index][1].asnumpy())
    # pylint: disable=protected-access
    assert theirs.optimizer._all_index_update_counts == ours.optimizer._all_index_update_counts
    assert theirs.optimizer.num_update == ours.optimizer.num_update == steps


def test_adam_step_updates_without_adams_per_parameter_update(monkeypatch):
    """Once the states exist, a list call runs in one pass: Adam.update is
    never called."""
    updater = PerDeviceUpdater(mx.optimizer.get_updater(_optimizer()))
    weights = _arrays(0, [mx.cpu(0)])
    indices = list(range(len(SHAPES)))
    updater(indices, _arrays(1, [mx.cpu(0)]), weights)   # the states are made
    calls = []
    monkeypatch.setattr(mx.optimizer.Adam, 'update', lambda *a: calls.append(a))
    updater(indices, _arrays(2, [mx.cpu(0)]), weights)
    assert calls == []


def test_adam_step_follows_a_learning_rate_schedule_as_mxnets_adam_bit_for_bit(monkeypatch):
    """Four steps of a warmup and a cosine over parameters on two devices:
    every weight, moment and count as MXNet's Updater leaves them, and after
    the first step Adam.update is never called."""
    def schedule():
        return mx.lr_scheduler.CosineScheduler(4, base_lr=3e-3, final_lr=3e-4, warmup_steps=1)

    devices = [mx.cpu(0), mx.cpu(1)]
    theirs = mx.optimizer.get_updater(_optimizer(lr_scheduler=schedule()))
    ours = PerDeviceUpdater(mx.optimizer.get_updater(_optimizer(lr_scheduler=schedule())))
    expected = _run(lambda i, g, w: [theirs(*part) for part in updates_by_device(i, g, w)],
                    4, devices)
    calls, update = [], mx.optimizer.Adam.update
    monkeypatch.setattr(mx.optimizer.Adam, 'update',
                        lambda self, i, *a: calls.append(i) or update(self, i, *a))
    found = _run(ours, 4, devices)
    for a, b in zip(expected, found):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    _assert_same_states(theirs, ours, 4)
    assert sorted(calls) == list(range(len(SHAPES)))   # once each: the step making the states


def test_adam_step_leaves_other_optimizers_and_parameters_without_state_to_the_updater():
    """SGD, a parameter without state: nothing is done and False is
    returned, so the updater runs the call."""
    weights, grads = _arrays(0, [mx.cpu(0)]), _arrays(1, [mx.cpu(0)])
    indices = list(range(len(SHAPES)))
    sgd = mx.optimizer.get_updater(mx.optimizer.SGD(learning_rate=0.1))
    fresh = mx.optimizer.get_updater(_optimizer())
    sgd(indices, grads, weights)   # states made
    before = [w.asnumpy() for w in weights]
    assert not any(adam_step(u, indices, grads, weights) for u in (sgd, fresh))
    for a, b in zip(before, weights):
        np.testing.assert_array_equal(a, b.asnumpy())


def _trainer_steps(steps=3):
    # pylint: disable=import-outside-toplevel
    from mxnet import autograd, gluon
    from mp_symbolic import Pipeline, Trainer
    from mp_symbolic.training.tasks import regression
    pipe = Pipeline(regression.build_blocks(), 'cpu:0,cpu:1,cpu:2')
    mx.random.seed(0)
    pipe.initialize()
    trainer = Trainer(pipe.collect_params(), 'adam', {'learning_rate': 0.01})
    for step in range(steps):
        X, y = (mx.nd.array(a) for a in regression.make_dataset(32, step))
        with autograd.record():
            loss = gluon.loss.L2Loss()(pipe(X), y.as_in_context(pipe.plan.last_device))
        loss.backward()
        trainer.step(32)
    return {n: p.data().asnumpy() for n, p in pipe.collect_params().items()}


def test_trainers_adam_step_equals_its_updaters_bit_for_bit(monkeypatch):
    """mp_symbolic.Trainer on three devices: each device's Adam update in one
    pass leaves the parameters MXNet's Updater leaves, and calls no
    Adam.update."""
    from mp_symbolic.core.optim import trainer  # pylint: disable=import-outside-toplevel
    calls = []
    update = mx.optimizer.Adam.update
    monkeypatch.setattr(mx.optimizer.Adam, 'update',
                        lambda *a: calls.append(1) or update(*a))
    ours = _trainer_steps()
    assert len(calls) == len(ours)   # the first step only, which makes the states
    monkeypatch.setattr(trainer, 'adam_step', lambda *a: False)
    theirs = _trainer_steps()
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


def _contiguous(values, devices):
    """The arrays of ``values`` as views of one Contiguous a device (the
    parameters of each device in order), and ``{id(view): place}``."""
    flats = []
    for device in devices:
        ks = [k for k in range(len(values)) if k % len(devices) == devices.index(device)]
        flat = Contiguous(['p%d' % k for k in ks], [SHAPES[k] for k in ks], device, 'float32')
        for k, view in zip(ks, flat.weights):
            values[k].copyto(view)
        flats.append((ks, flat))
    weights, grads = [None] * len(values), [None] * len(values)
    for ks, flat in flats:
        for j, k in enumerate(ks):
            weights[k], grads[k] = flat.weights[j], flat.grads[j]
    return weights, grads, [flat for _, flat in flats]


@pytest.mark.parametrize('kwargs', [{}, {'wd': 1e-2, 'clip_gradient': 0.5}],
                         ids=['plain', 'weight decay and clipping'])
def test_adam_over_contiguous_arrays_equals_mxnets_adam_bit_for_bit(kwargs):
    """Three steps over parameters on two devices held as views of one array
    a device (per-parameter learning-rate and weight-decay multipliers
    among them): every weight, both moments and each device's counts as
    MXNet's Updater leaves them on arrays of their own."""
    devices = [mx.cpu(0), mx.cpu(1)]
    theirs = mx.optimizer.get_updater(_optimizer(**kwargs))
    expected = _run(lambda i, g, w: [theirs(*part) for part in updates_by_device(i, g, w)],
                    3, devices)
    ours = PerDeviceUpdater(mx.optimizer.get_updater(_optimizer(**kwargs)))
    weights, grads, flats = _contiguous(_arrays(0, devices), devices)
    ours.hold(flats)
    for step in range(3):
        for grad, value in zip(grads, _arrays(1 + step, devices)):
            value.copyto(grad)
        ours(list(range(len(SHAPES))), grads, weights)
    for a, b in zip(expected, weights):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    _assert_same_states(theirs, ours, 3)


def test_contiguous_parameters_update_in_one_call_a_run_of_equal_settings(monkeypatch):
    """On one device, parameters 0..4 with a learning-rate multiplier on 1
    and weight decay off on 3: the runs [0], [1], [2], [3], [4] of equal
    settings under weight decay, and, without weight decay, [0], [1],
    [2 3 4]: one adam_update a run, never Adam.update."""
    from mp_symbolic.core.optim import updater as module  # pylint: disable=import-outside-toplevel
    calls = []
    invoke = module._imperative_invoke   # pylint: disable=protected-access
    monkeypatch.setattr(module, '_imperative_invoke',
                        lambda *a: calls.append(a[1][0].size) or invoke(*a))
    monkeypatch.setattr(mx.optimizer.Adam, 'update', lambda *a: calls.append('Adam.update'))
    sizes = [int(np.prod(s)) for s in SHAPES]
    for kwargs, runs in (({'wd': 1e-2}, sizes), ({}, [sizes[0], sizes[1], sum(sizes[2:])])):
        ours = PerDeviceUpdater(mx.optimizer.get_updater(_optimizer(**kwargs)))
        weights, grads, flats = _contiguous(_arrays(0, [mx.cpu(0)]), [mx.cpu(0)])
        ours.hold(flats)
        del calls[:]
        ours(list(range(len(SHAPES))), grads, weights)
        assert calls == runs


def test_contiguous_update_takes_a_state_put_in_its_place():
    """A state set in the updater's place (a checkpoint's, set_states) is
    copied into the contiguous moments on the next update: the weights
    after it are those of MXNet's Updater that kept its own state."""
    devices = [mx.cpu(0)]
    indices = list(range(len(SHAPES)))
    theirs = mx.optimizer.get_updater(_optimizer())
    expected = _arrays(0, devices)
    for step in range(2):
        theirs(indices, _arrays(1 + step, devices), expected)
    ours = PerDeviceUpdater(mx.optimizer.get_updater(_optimizer()))
    weights, grads, flats = _contiguous(_arrays(0, devices), devices)
    ours.hold(flats)
    for grad, value in zip(grads, _arrays(1, devices)):
        value.copyto(grad)
    ours(indices, grads, weights)
    ours.set_states(theirs.get_states(dump_optimizer=True))   # theirs, one update more
    for w, value in zip(weights, expected):
        value.copyto(w)
    theirs(indices, _arrays(3, devices), expected)
    for grad, value in zip(grads, _arrays(3, devices)):
        value.copyto(grad)
    ours(indices, grads, weights)
    assert all(ours.states[i][0] is flats[0].means[i] for i in indices)
    for a, b in zip(expected, weights):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def test_weights_a_onednn_op_may_lay_out_anew_are_not_views():
    """A convolution's inputs (oneDNN lays its weight out anew in its
    array's whole storage at inference), a large FullyConnected weight
    (BRGEMM) and a float16 one stay arrays of their own; the others are
    views of one array."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.engine.runtime import contiguous_names
    x = mx.sym.var('data')
    h = mx.sym.Convolution(x, num_filter=4, kernel=(3, 3), name='conv')
    h = mx.sym.FullyConnected(h, num_hidden=1024, name='big')
    h = mx.sym.FullyConnected(h, num_hidden=8, name='fc')
    h = mx.sym.Cast(h, dtype='float16') * mx.sym.var('half', dtype='float16')
    shapes = dict(zip(h.list_arguments(), h.infer_shape(data=(2, 3, 8, 8))[0]))
    types = dict(zip(h.list_arguments(), h.infer_type(data='float32')[0]))
    shapes['big_weight'] = (1024, 1024)   # what a wider input would make it
    names = [n for n in h.list_arguments() if n != 'data']
    assert contiguous_names(h, names, shapes, types) == ['big_bias', 'fc_weight', 'fc_bias']
