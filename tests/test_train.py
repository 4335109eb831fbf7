"""Model-parallel training: placement, gradient flow, equivalence of the
variants, convergence. The structure follows MXNet 1.9.1's
``test_model_parallel.py`` / ``test_multi_device_exec.py``: bind the split
graph and the one-device graph, compare outputs and every gradient, and check
every array's ``.context``."""
import json
import os

import mxnet as mx
from mxnet import autograd, gluon
import numpy as np
import pytest

from mp_symbolic.checkpoint import load_checkpoint
from mp_symbolic.config import TrainConfig
from mp_symbolic.data import batches
from mp_symbolic.metrics import AGREE_ATOL, AGREE_RTOL, forward_numpy
from mp_symbolic.model import build_net
from mp_symbolic.placement import make_plan
from mp_symbolic.train import initial_params, make_stepper, train

from conftest import THREE_DEVICES

VARIANTS = [('symbolic', 'module'), ('symbolic', 'executor'), ('imperative', 'module')]


def _stepper(small_data, variant, api, devices, **cfg_fields):
    X, _ = small_data
    cfg = TrainConfig(variant=variant, api=api, devices=devices, num_examples=len(X),
                      batch_size=50, progress=False, **cfg_fields)
    plan, _ = make_plan(cfg.num_layers, devices)
    return make_stepper(cfg, plan, initial_params(cfg.widths, cfg.seed)), plan, cfg


@pytest.mark.parametrize('variant, api', VARIANTS)
@pytest.mark.parametrize('devices', [THREE_DEVICES, 'cpu:1,cpu:2'])
def test_every_array_and_gradient_sits_on_its_stage_device(small_data, variant, api, devices):
    stepper, plan, _ = _stepper(small_data, variant, api, devices)
    placement = {name: (ctx, grad_ctx) for name, ctx, grad_ctx in stepper.placement()}
    for layer in range(3):
        for kind in ('weight', 'bias'):
            ctx, grad_ctx = placement['layer%d_%s' % (layer, kind)]
            assert ctx == plan.device_of_layer(layer)
            assert grad_ctx == plan.device_of_layer(layer)
    if variant == 'symbolic':
        assert placement['data'][0] == plan.first_device
        assert placement['label'][0] == plan.last_device


@pytest.mark.parametrize('variant, api', VARIANTS)
def test_gradients_reach_every_layer_after_one_step(small_data, variant, api):
    """The seed's bug: gradients never reached the first two layers."""
    stepper, _, cfg = _stepper(small_data, variant, api, THREE_DEVICES)
    X_batch, y_batch = next(batches(*small_data, cfg.batch_size, epoch=0))
    before = stepper.params()
    stepper.step(X_batch, y_batch)
    after = stepper.params()
    for name, grad in stepper.grads().items():
        assert np.abs(grad).max() > 1e-3, name
        assert not np.allclose(before[name], after[name]), name


def _run_steps(stepper, small_data, batch_size, num_steps):
    losses = []
    for step, (X_batch, y_batch) in enumerate(batches(*small_data, batch_size, epoch=0)):
        if step == num_steps:
            break
        losses.append(stepper.step(X_batch, y_batch).asscalar())
    return np.array(losses), stepper.grads(), stepper.params()


def test_symbolic_matches_one_device_and_imperative_after_several_steps(small_data):
    """Same initial parameters and batches, SGD with momentum (so optimizer
    state matters): the model-parallel graph (Module and executor), the same
    graph on one device and the imperative twin agree on every loss, every
    gradient of the last step, and every parameter after it."""
    runs = {}
    for label, variant, api, devices in [
            ('module, 3 devices', 'symbolic', 'module', THREE_DEVICES),
            ('executor, 3 devices', 'symbolic', 'executor', THREE_DEVICES),
            ('module, 1 device', 'symbolic', 'module', 'cpu:0'),
            ('imperative, 3 devices', 'imperative', 'module', THREE_DEVICES)]:
        stepper, _, cfg = _stepper(small_data, variant, api, devices, momentum=0.9, lr=0.01)
        runs[label] = _run_steps(stepper, small_data, cfg.batch_size, num_steps=8)
    ref_losses, ref_grads, ref_params = runs.pop('module, 3 devices')
    assert len(ref_losses) == 8 and ref_losses[-1] < ref_losses[0]
    for label, (losses, grads, params) in runs.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=AGREE_RTOL, atol=AGREE_ATOL,
                                   err_msg=label)
        for name in ref_params:
            np.testing.assert_allclose(grads[name], ref_grads[name], rtol=AGREE_RTOL,
                                       atol=AGREE_ATOL, err_msg='%s grad %s' % (label, name))
            np.testing.assert_allclose(params[name], ref_params[name], rtol=AGREE_RTOL,
                                       atol=AGREE_ATOL, err_msg='%s param %s' % (label, name))


def test_adam_variants_agree(small_data):
    """Adam keeps two state arrays per parameter: every variant must keep them
    apart per parameter and device, and agree on losses, gradients and
    parameters."""
    results = []
    for variant, api in VARIANTS:
        stepper, _, cfg = _stepper(small_data, variant, api, THREE_DEVICES,
                                   optimizer='adam', lr=0.01)
        results.append(_run_steps(stepper, small_data, cfg.batch_size, num_steps=5))
    ref_losses, ref_grads, ref_params = results[0]
    for losses, grads, params in results[1:]:
        np.testing.assert_allclose(losses, ref_losses, rtol=AGREE_RTOL, atol=AGREE_ATOL)
        for name in ref_params:
            np.testing.assert_allclose(grads[name], ref_grads[name], rtol=AGREE_RTOL,
                                       atol=AGREE_ATOL)
            np.testing.assert_allclose(params[name], ref_params[name], rtol=AGREE_RTOL,
                                       atol=AGREE_ATOL)


def _optimizer_states(stepper, variant, api):
    """``[(weight device, [state devices])]`` of every parameter's optimizer state."""
    # pylint: disable=protected-access
    if variant == 'imperative':
        pairs = []
        for trainer in stepper.trainers:
            for updater in trainer._updaters:
                pairs += [(trainer._params[i].list_data()[0].context, state)
                          for i, state in updater.states.items()]
        return [(ctx, _state_devices(state)) for ctx, state in pairs]
    updater = stepper.module._updater if api == 'module' else stepper._updater
    weights = stepper.module._exec_group.param_arrays if api == 'module' else [
        stepper._exec.arg_dict[n] for n in stepper.param_names]
    contexts = [w[0].context if isinstance(w, list) else w.context for w in weights]
    return [(contexts[i], _state_devices(state)) for i, state in updater.states.items()]


def _state_devices(state):
    if state is None:
        return []
    if isinstance(state, (list, tuple)):
        return sum((_state_devices(s) for s in state), [])
    return [state.context]


@pytest.mark.parametrize('variant, api', VARIANTS)
def test_optimizer_state_lives_on_its_parameter_device(small_data, variant, api):
    stepper, _, cfg = _stepper(small_data, variant, api, THREE_DEVICES, optimizer='adam')
    stepper.step(*next(batches(*small_data, cfg.batch_size, epoch=0)))
    states = _optimizer_states(stepper, variant, api)
    assert len(states) == 6
    assert {ctx for ctx, _ in states} == {mx.cpu(0), mx.cpu(1), mx.cpu(2)}
    for ctx, state_devices in states:
        assert len(state_devices) == 2  # Adam: mean and variance
        assert set(state_devices) == {ctx}


def test_backward_inside_or_outside_record_gives_the_same_gradients():
    """The seed asks where ``backward()`` goes: either place works."""
    init = initial_params((2, 2, 2, 1))
    X = mx.nd.array(np.arange(8, dtype=np.float32).reshape(4, 2) / 8, ctx=mx.cpu(0))
    y = mx.nd.ones((4, 1), ctx=mx.cpu(2))
    grads = []
    for inside in (True, False):
        net = build_net()
        for i, layer in enumerate(net):
            for name, p in layer.collect_params().items():
                p.initialize(ctx=mx.cpu(i))
                p.set_data(mx.nd.array(init[name]))
        with autograd.record():
            loss = gluon.loss.L2Loss()(net(X), y)
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append({n: p.grad().asnumpy() for n, p in net.collect_params().items()})
    for name in grads[0]:
        np.testing.assert_array_equal(grads[0][name], grads[1][name])
        assert np.abs(grads[0][name]).max() > 0


def _net_on_three_devices():
    net = build_net()
    for i, layer in enumerate(net):
        layer.collect_params().initialize(ctx=mx.cpu(i))
    return net


def test_one_trainer_refuses_parameters_on_different_devices():
    with pytest.raises(AssertionError, match='same set of contexts'):
        gluon.Trainer(_net_on_three_devices().collect_params(), 'sgd', {'learning_rate': 0.1})


def test_hybridized_net_ignores_ctx_group_and_refuses_split_parameters():
    """CachedOp runs the whole graph on the input's device."""
    net = _net_on_three_devices()
    net.hybridize()
    with pytest.raises(mx.base.MXNetError, match='CachedOp requires all inputs to live on '
                                                 'the same context'):
        net(mx.nd.ones((4, 2), ctx=mx.cpu(0))).wait_to_read()


@pytest.mark.parametrize('variant, api', [('symbolic', 'module'), ('imperative', 'module')])
def test_short_training_converges_and_writes_a_loadable_checkpoint(tmp_path, variant, api):
    cfg = TrainConfig(variant=variant, api=api, devices=THREE_DEVICES, num_epochs=2,
                      progress=False, out=str(tmp_path))
    lines = []
    result = train(cfg, log=lines.append)
    assert result.final_mse <= 1e-5
    assert result.map_error < 1e-2
    np.testing.assert_allclose(result.learned_w, [[2.0, -3.4]], atol=1e-2)
    np.testing.assert_allclose(result.learned_b, [4.2], atol=1e-2)
    assert any(line.startswith('full-data MSE: ') for line in lines)
    assert any('layer2_weight' in line and 'cpu(2)' in line for line in lines)
    summary = json.loads((tmp_path / 'summary.json').read_text())
    assert summary['final_mse'] == result.final_mse
    assert summary['devices'] == ['cpu:0', 'cpu:1', 'cpu:2']
    symbol, arg_params, _ = load_checkpoint(result.files['symbol'], result.files['params'])
    assert os.path.basename(result.files['params']) == 'regression-0002.params'
    assert symbol.attr_dict()['layer1_weight']['__ctx_group__'] == 'stage1'
    X = np.random.default_rng(3).normal(size=(5, 2))
    np.testing.assert_allclose(
        forward_numpy({k: v.asnumpy() for k, v in arg_params.items()}, X),
        forward_numpy(result.params, X))
    assert not [p for p in os.listdir(tmp_path) if p.endswith('.tmp')]


def _update_calls(optimizer, calls):
    """Records the devices of the weights in each of ``optimizer``'s update calls."""
    update = optimizer.update_multi_precision

    def recording(index, weight, grad, state):
        weights = weight if isinstance(weight, (list, tuple)) else [weight]
        calls.append({w.context for w in weights})
        return update(index, weight, grad, state)
    optimizer.update_multi_precision = recording


@pytest.mark.parametrize('variant, api', VARIANTS)
def test_every_update_runs_on_one_device(small_data, variant, api):
    """MXNet's Updater would fuse parameters of several devices into one
    multi_sgd_update op; each update must touch one device's weights only."""
    stepper, _, cfg = _stepper(small_data, variant, api, THREE_DEVICES)
    if variant == 'imperative':
        optimizers = [t._optimizer for t in stepper.trainers]  # pylint: disable=protected-access
    elif api == 'module':
        optimizers = [stepper.module._optimizer]  # pylint: disable=protected-access
    else:
        optimizers = [stepper._updater.optimizer]  # pylint: disable=protected-access
    calls = []
    for optimizer in optimizers:
        _update_calls(optimizer, calls)
    stepper.step(*next(batches(*small_data, cfg.batch_size, epoch=0)))
    assert calls and all(len(devices) == 1 for devices in calls), calls
    assert set().union(*calls) == {mx.cpu(0), mx.cpu(1), mx.cpu(2)}


def test_cli_train_writes_checkpoint_profile_and_removes_a_stale_pair(tmp_path, capsys):
    """The CLI end to end: exit 0, a Chrome trace whose rows include the stage
    devices, and no params file of an earlier run left beside the new symbol."""
    from mp_symbolic.cli import main  # pylint: disable=import-outside-toplevel
    (tmp_path / 'regression-0009.params').write_bytes(b'an earlier run')
    assert main(['train', '--no-progress', '--epochs', '1', '--num-examples', '500',
                 '--devices', THREE_DEVICES, '--out', str(tmp_path), '--profile']) == 0
    out = capsys.readouterr().out
    assert 'full-data MSE: ' in out and 'removed ' in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        'profile-stats.txt', 'profile.json', 'regression-0001.params',
        'regression-symbol.json', 'summary.json']
    trace = json.loads((tmp_path / 'profile.json').read_text())
    rows = {e['args']['name'] for e in trace['traceEvents']
            if e.get('ph') == 'M' and e.get('name') == 'process_name'}
    assert {'cpu/0', 'cpu/1'} <= rows, rows
    assert 'FullyConnected' in (tmp_path / 'profile-stats.txt').read_text()


def test_diverged_training_exits_1_and_writes_no_checkpoint(tmp_path, capsys):
    from mp_symbolic.cli import main  # pylint: disable=import-outside-toplevel
    assert main(['train', '--no-progress', '--epochs', '1', '--num-examples', '500',
                 '--lr', '100', '--devices', THREE_DEVICES, '--out', str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'error: training diverged (full-data MSE nan' in err
    assert not list(tmp_path.iterdir())
