"""The per-device updater's one-pass Adam step (core/optim/updater.py:adam_step)
against MXNet's own Updater: the same weights, moments and counts, bit for bit."""
import mxnet as mx
import numpy as np
import pytest

from mp_symbolic.core.base import compat
from mp_symbolic.core.base.compat import updates_by_device
from conftest import bert_batch, small_bert
from mp_symbolic.core import kernels
from mp_symbolic.core.optim import updater as updater_module
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


@pytest.fixture(params=['fused', 'one op a parameter'])
def fused(request, monkeypatch):
    """adam_step with the project's fused_adam_update (where its library
    loads), then as where it does not: one adam_update a parameter."""
    if request.param == 'fused':
        loaded, why = kernels.library()
        if not loaded:
            pytest.skip(why)
    else:
        monkeypatch.setitem(updater_module._OPS, kernels.FUSED_ADAM, None)
    return request.param == 'fused'


@pytest.mark.parametrize('kwargs', [{}, {'wd': 1e-2, 'clip_gradient': 0.5}],
                         ids=['plain', 'weight decay and clipping'])
def test_adam_step_equals_mxnets_adam_bit_for_bit(kwargs, fused):
    """Three steps over parameters on two devices (per-parameter learning
    rate and weight-decay multipliers among them): every weight, both
    moments and each device's counts as MXNet's Updater leaves them, with
    the fused op and without it."""
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


def test_adam_step_updates_without_adams_per_parameter_update(monkeypatch, fused):
    """Once the states exist, a list call runs in one pass: Adam.update is
    never called. Where the fused op loads, it updates each device's
    weights of rank 1 in one call, and those of rank 2 too once they are
    declared plain (no op lays them out anew); each other parameter, and
    every one where the op does not load, is one adam_update."""
    updater = PerDeviceUpdater(mx.optimizer.get_updater(_optimizer()))
    devices = [mx.cpu(0), mx.cpu(1)]
    weights = _arrays(0, devices)   # cpu(0): (166, 64), (192, 64), (1,); cpu(1): (64,), (64, 256)
    indices = list(range(len(SHAPES)))
    updater(indices, _arrays(1, devices), weights)   # the states are made
    calls, invoked, invoke = [], [], updater_module._imperative_invoke
    adam = updater_module._op('adam_update')
    monkeypatch.setattr(mx.optimizer.Adam, 'update', lambda *a: calls.append(a))
    monkeypatch.setattr(updater_module, '_imperative_invoke',
                        lambda handle, arrays, *a: invoked.append(
                            ('adam_update' if handle == adam else 'fused', len(arrays))) or
                        invoke(handle, arrays, *a))
    updater(indices, _arrays(2, devices), weights)
    one_each = [('adam_update', 4)] * len(SHAPES)
    assert calls == [] and invoked == ([('fused', 4)] + one_each[:2] + [('fused', 4)] +
                                       one_each[:1] if fused else one_each)
    invoked.clear()
    updater.plain(weights)
    updater(indices, _arrays(3, devices), weights)
    assert calls == [] and invoked == ([('fused', 12), ('fused', 8)] if fused else one_each)


def test_adam_step_follows_a_learning_rate_schedule_as_mxnets_adam_bit_for_bit(monkeypatch,
                                                                               fused):
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
    _equal_bit_for_bit(ours, theirs)


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
    for a, b in zip(expected, _run_contiguous(ours, 3, devices)):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    _assert_same_states(theirs, ours, 3)


def _run_contiguous(updater, steps, devices):
    """``_run``'s steps with the parameters held as views of one array a
    device (``updater.hold``): the weights after them."""
    weights, grads, flats = _contiguous(_arrays(0, devices), devices)
    updater.hold(flats)
    for step in range(steps):
        for grad, value in zip(grads, _arrays(1 + step, devices)):
            value.copyto(grad)
        updater(list(range(len(SHAPES))), grads, weights)
    return weights


def test_adam_over_contiguous_arrays_follows_a_learning_rate_schedule_bit_for_bit(monkeypatch):
    """Four steps of a warmup and a cosine over parameters on two devices
    held as views of one array a device: every weight, moment and count as
    the same steps on arrays of their own, each step one adam_update a run
    of views (Adam.update and adam_step never called)."""
    from mp_symbolic.core.optim import updater as module  # pylint: disable=import-outside-toplevel

    def schedule():
        return mx.lr_scheduler.CosineScheduler(4, base_lr=3e-3, final_lr=3e-4, warmup_steps=1)

    devices = [mx.cpu(0), mx.cpu(1)]
    off = PerDeviceUpdater(mx.optimizer.get_updater(_optimizer(lr_scheduler=schedule())))
    expected = _run(off, 4, devices)
    monkeypatch.setattr(mx.optimizer.Adam, 'update', lambda *a: pytest.fail('Adam.update'))
    monkeypatch.setattr(module, 'adam_step', lambda *a: pytest.fail('adam_step'))
    on = PerDeviceUpdater(mx.optimizer.get_updater(_optimizer(lr_scheduler=schedule())))
    for a, b in zip(expected, _run_contiguous(on, 4, devices)):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    _assert_same_states(off.updater, on, 4)


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


def _passes_on_views(symbol, data_shapes, views, train, req):
    """Three passes of ``symbol`` bound on cpu(0) (a backward after each in
    training, gradients asked for by ``req``), its parameters arrays of
    their own or views of one :class:`Contiguous` with a sentinel of 16
    values before, between and after them: ``(outputs, gradients, weights,
    the sentinels' weight and gradient values)``."""
    rng = np.random.default_rng(0)
    shapes = dict(zip(symbol.list_arguments(), symbol.infer_shape(**data_shapes)[0]))
    aux = [mx.nd.array(rng.uniform(0.5, 1.5, size=s))
           for s in symbol.infer_shape(**data_shapes)[2]]
    params = [n for n in symbol.list_arguments() if n not in data_shapes]
    values = {n: rng.normal(size=shapes[n]).astype(np.float32) for n in shapes}
    if views:
        names = ['sentinel'] + [n for p in params for n in (p, 'sentinel')]
        flat = Contiguous(names, [shapes.get(n, (16,)) for n in names], mx.cpu(0), 'float32')
        flat.weight[:] = 7
        flat.grad[:] = 9
        args, grads = dict(zip(names, flat.weights)), dict(zip(names, flat.grads))
    else:
        args = {n: mx.nd.zeros(shapes[n]) for n in params}
        grads = {n: mx.nd.zeros(shapes[n]) for n in params}
    for name in params:
        args[name][:] = values[name]
        grads[name][:] = 0.25
    args.update({name: mx.nd.array(values[name]) for name in data_shapes})
    exe = symbol.bind(mx.cpu(0), {n: args[n] for n in shapes},
                      args_grad={n: grads[n] for n in params}, grad_req=req, aux_states=aux)
    outputs = []
    for _ in range(3):
        outputs += [o.asnumpy() for o in exe.forward(is_train=train)]
        if train:
            exe.backward([mx.nd.ones_like(o) for o in exe.outputs])
    sentinels = [a.asnumpy() for k, a in enumerate(flat.weights + flat.grads)
                 if names[k % len(names)] == 'sentinel'] if views else []
    return (outputs, [grads[n].asnumpy() for n in params], [args[n].asnumpy() for n in params],
            sentinels)


def _rnn():
    """A two-layer bidirectional LSTM over (7, 3, 5): 2 x 4 x 6 x (5 + 6 + 2)
    and 2 x 4 x 6 x (12 + 6 + 2) parameters in one array."""
    x = mx.sym.var('data')
    return mx.sym.RNN(x, mx.sym.var('rnn_parameters', shape=(2 * 4 * 6 * 13 + 2 * 4 * 6 * 20,)),
                      mx.sym.var('rnn_state', shape=(4, 3, 6)),
                      mx.sym.var('rnn_cell', shape=(4, 3, 6)),
                      state_size=6, num_layers=2, mode='lstm', bidirectional=True, name='rnn')


VIEW_OPS = [  # the ops whose parameters the bundled networks hold as views
    ('FullyConnected', lambda x: mx.sym.FullyConnected(x, num_hidden=16, name='fc'), (4, 3, 8)),
    ('FullyConnected, not flattened',
     lambda x: mx.sym.FullyConnected(x, num_hidden=16, flatten=False, name='fc'), (4, 3, 8)),
    ('BatchNorm', lambda x: mx.sym.BatchNorm(x, fix_gamma=False, name='bn'), (4, 8, 5, 5)),
    ('BatchNorm, fixed gamma', lambda x: mx.sym.BatchNorm(x, name='bn'), (4, 8)),
    ('LayerNorm', lambda x: mx.sym.LayerNorm(x, name='ln'), (4, 8)),
    ('Embedding', lambda x: mx.sym.Embedding(x, input_dim=10, output_dim=6, name='emb'), (4, 3)),
    ('RNN', lambda x: _rnn(), (7, 3, 5)),
]


@pytest.mark.parametrize('make, shape', [op[1:] for op in VIEW_OPS],
                         ids=[op[0] for op in VIEW_OPS])
@pytest.mark.parametrize('train, req', [(True, 'write'), (True, 'add'), (False, 'write')],
                         ids=['training', 'training, gradients added', 'inference'])
def test_parameters_as_views_compute_as_their_own_arrays_and_leave_their_neighbours_alone(
        make, shape, train, req):
    """The ops whose parameters can be views of one array (none of
    runtime.RELAYOUT_OPS), in training and inference: outputs, gradients and
    weights bit for bit those of arrays of their own, and no value of the
    array outside the views they read or write changed."""
    symbol = make(mx.sym.var('data'))
    data = {'data': shape}
    own, views = (_passes_on_views(symbol, data, v, train, req) for v in (False, True))
    for a, b in zip(own[:3], views[:3]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    half = len(views[3]) // 2
    assert all((s == 7).all() for s in views[3][:half]) and \
        all((s == 9).all() for s in views[3][half:])


def test_a_convolution_at_inference_lays_a_weight_view_out_anew_over_its_neighbours():
    """Why runtime.RELAYOUT_OPS keeps a convolution's inputs out of views:
    at inference oneDNN reorders the weight's array in place to its blocked
    layout, from the start of the whole array, so the values next to a
    weight view change and the outputs differ from the weight's own array."""
    if not compat.onednn_active():
        pytest.skip('without oneDNN no weight is laid out anew')
    symbol = mx.sym.Convolution(mx.sym.var('data'), num_filter=16, kernel=(3, 3), name='conv')
    own, views = (_passes_on_views(symbol, {'data': (2, 8, 8, 8)}, v, False, 'write')
                  for v in (False, True))
    assert not all((s == 7).all() for s in views[3][:len(views[3]) // 2])
    assert not np.array_equal(own[0][-1], views[0][-1])


def test_the_fused_update_leaves_weights_an_op_may_lay_out_anew_to_adam_update():
    """At inference oneDNN lays a convolution's weight out anew in its
    array, and MXNet refuses a library's op an output in that layout (a
    failure at the next read of the weights). runtime.plain_names leaves out
    every weight a convolution or FullyConnected reads, so such a weight
    goes to adam_update, which takes it; the other weights to the fused op.
    Two updates right after an inference pass leave every weight equal to
    MXNet's Updater's, bit for bit."""
    if not compat.onednn_active():
        pytest.skip('without oneDNN no weight is laid out anew')
    loaded, why = kernels.library()
    if not loaded:
        pytest.skip(why)
    from mp_symbolic.core.engine.runtime import plain_names  # pylint: disable=import-outside-toplevel
    data = mx.sym.var('data')
    conv = mx.sym.Convolution(data, num_filter=16, kernel=(3, 3), no_bias=True, name='conv')
    scaled = mx.sym.broadcast_mul(mx.sym.flatten(conv), mx.sym.var('scale', shape=(1, 576)))
    symbol = mx.sym.FullyConnected(scaled, num_hidden=4, name='fc')
    names = [n for n in symbol.list_arguments() if n != 'data']
    assert plain_names(symbol, names) == ['scale']
    rng = np.random.default_rng(6)
    results = []
    for ours in (True, False):
        executor = symbol.simple_bind(mx.cpu(0), data=(2, 8, 8, 8), grad_req='write')
        for name in names:
            executor.arg_dict[name][:] = rng.normal(size=executor.arg_dict[name].shape) \
                if ours else results[0][1][name]
        executor.arg_dict['data'][:] = 1.0
        executor.forward(is_train=False)   # the convolution's weight laid out anew
        executor.outputs[0].wait_to_read()
        updater = mx.optimizer.get_updater(_optimizer())
        if ours:
            updater = PerDeviceUpdater(updater)
            updater.plain([executor.arg_dict[n] for n in plain_names(symbol, names)])
        start = {n: executor.arg_dict[n].asnumpy() for n in names}
        for step in range(2):
            grads = [mx.nd.array(np.full(executor.arg_dict[n].shape, 0.1 * (step + 1)))
                     for n in names]
            updater(list(range(len(names))), grads, [executor.arg_dict[n] for n in names])
        results.append(({n: executor.arg_dict[n].asnumpy() for n in names}, start))
    for name in names:
        np.testing.assert_array_equal(results[0][0][name], results[1][0][name])


def _fused_calls(monkeypatch):
    """``[whether it was the fused op]`` of each op the updater invokes from
    now on (skips where the library does not load)."""
    loaded, why = kernels.library()
    if not loaded:
        pytest.skip(why)
    calls, invoke = [], updater_module._imperative_invoke
    fused = updater_module._fused_adam()
    monkeypatch.setattr(updater_module, '_imperative_invoke',
                        lambda handle, *a: calls.append(handle == fused) or invoke(handle, *a))
    return calls


def _equal_bit_for_bit(ours, theirs):
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


def _mobilenet_adam(steps_before, steps_after):
    """GluonCV's MobileNetV2 (random values) split over two devices, trained
    with Adam: ``steps_before`` steps, one inference pass (which lays its
    convolutions' weights out anew), ``steps_after`` more; its Module, and
    every parameter after."""
    # pylint: disable=import-outside-toplevel
    model_zoo = pytest.importorskip('gluoncv.model_zoo')
    from mp_symbolic import Pipeline
    from mp_symbolic.training import loop
    net = model_zoo.get_model('mobilenetv2_0.25', pretrained=False, classes=10,
                              prefix='mobilenet_')
    sample = (8, 3, 32, 32)
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=sample, chunks=2, schedule='1f1b')
    arg_params, aux_params = loop.initial_values(pipe, seed=0)
    mod = pipe.module(loss='softmax')
    mod.bind(data_shapes=[('data', sample)], label_shapes=[('softmax_label', (8,))])
    mod.init_params(arg_params={k: mx.nd.array(v) for k, v in arg_params.items()},
                    aux_params={k: mx.nd.array(v) for k, v in aux_params.items()})
    mod.init_optimizer(kvstore=None, optimizer='adam', optimizer_params={'learning_rate': 1e-3})
    rng = np.random.default_rng(7)

    def batch():
        return mx.io.DataBatch([mx.nd.array(rng.normal(size=sample).astype(np.float32))],
                               [mx.nd.array(rng.integers(0, 10, 8).astype(np.float32))])
    for _ in range(steps_before):
        mod.forward_backward(batch())
        mod.update()
    mod.forward(batch(), is_train=False)
    mod.get_outputs()[0].wait_to_read()
    for _ in range(steps_after):
        mod.forward_backward(batch())
        mod.update()
    args, _ = mod.get_params()
    return mod, {n: a.asnumpy() for n, a in args.items()}


def test_a_gluoncv_network_trains_with_the_fused_update_as_with_adams_own_bit_for_bit(
        monkeypatch):
    """MobileNetV2 over two devices: after an inference pass has laid its
    convolutions' weights out anew, Adam's steps with the fused op (its
    BatchNorms' and biases' parameters, no convolution's or dense layer's
    weight) leave every parameter as one adam_update a parameter does."""
    calls = _fused_calls(monkeypatch)
    mod, ours = _mobilenet_adam(2, 2)
    group = mod._exec_group  # pylint: disable=protected-access
    plain = {id(a) for a in group.plain}
    for name, arrays in zip(group.param_names, group.param_arrays):
        if name.endswith('weight') and len(arrays[0].shape) > 1:   # convolutions, the dense layer
            assert id(arrays[0]) not in plain, name
    assert any(calls) and not all(calls)
    monkeypatch.setitem(updater_module._OPS, kernels.FUSED_ADAM, None)
    _, theirs = _mobilenet_adam(2, 2)
    _equal_bit_for_bit(ours, theirs)


def _bert_adam_steps(steps=3):
    """GluonNLP's BERT (two small layers) split over two devices, ``steps``
    Adam steps of mp_symbolic.Trainer on its classifier's loss; every
    parameter after."""
    # pylint: disable=import-outside-toplevel
    from mxnet import autograd, gluon
    from mp_symbolic import Pipeline, Trainer
    xs = bert_batch()
    pipe = Pipeline(small_bert(), 'cpu:0,cpu:1', sample=tuple(xs))
    pipe.initialize()
    trainer = Trainer(pipe.collect_params(), 'adam', {'learning_rate': 1e-2})
    label = mx.nd.array([0, 1, 1, 0]).as_in_context(pipe.plan.last_device)
    for _ in range(steps):
        with autograd.record():
            loss = gluon.loss.SoftmaxCrossEntropyLoss()(
                pipe(*[mx.nd.array(x, ctx=mx.cpu(0)) for x in xs])[2], label)
        loss.backward()
        trainer.step(len(xs[0]))
    return {n: p.data(p.list_ctx()[0]).asnumpy() for n, p in pipe.collect_params().items()}


def test_gluonnlps_bert_trains_with_the_fused_update_as_with_adams_own_bit_for_bit(monkeypatch):
    """BERT through the project's Trainer (Gluon's own API): its LayerNorms'
    and biases' updates go to the fused op, and three Adam steps leave every
    parameter as one adam_update a parameter does."""
    calls = _fused_calls(monkeypatch)
    ours = _bert_adam_steps()
    assert any(calls)
    monkeypatch.setitem(updater_module._OPS, kernels.FUSED_ADAM, None)
    theirs = _bert_adam_steps()
    _equal_bit_for_bit(ours, theirs)
