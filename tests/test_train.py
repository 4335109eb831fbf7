"""Model-parallel training: placement, gradient flow, transparency of the
split (the same computation as one device and as the imperative twin, with
and without micro-batches), convergence, and the command line. The structure
follows MXNet 1.9.1's ``test_model_parallel.py``: bind the split graph and
the one-device graph, compare outputs and every gradient, and check every
array's ``.context``; and torchgpipe's transparency test."""
import json
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from mp_symbolic.training.cli import main
from mp_symbolic.training.data import staged_batches
from mp_symbolic.training.metrics import AGREE_ATOL, AGREE_RTOL
from mp_symbolic.training.tasks import digits, regression
from mp_symbolic.training.loop import CHECK_EVERY, build_pipeline, initial_values, make_stepper, train

from conftest import ROOT, THREE_DEVICES, load_config, make_config

VARIANTS = [('symbolic', 'module'), ('symbolic', 'executor'), ('imperative', 'module')]


def _stepper(data, variant, api, devices, task='regression', **fields):
    X, y = data[0], data[1]
    if task == 'regression':
        fields.setdefault('num_examples', len(X))
        fields.setdefault('batch_size', 40)
    task, cfg = load_config(task=task, variant=variant, api=api, devices=devices,
                            progress=False, **fields)
    pipe, _ = build_pipeline(cfg, task)
    stepper = make_stepper(cfg, pipe, task, initial_values(pipe, cfg.seed), y.shape[1:])
    return stepper, pipe, cfg


def _batches(stepper, data, epoch=0):
    return stepper.batches(data[0], data[1], epoch)


@pytest.mark.parametrize('variant, api', VARIANTS)
@pytest.mark.parametrize('task, devices', [('regression', THREE_DEVICES),
                                           ('regression', 'cpu:1,cpu:2'),
                                           ('digits', THREE_DEVICES)])
def test_every_array_gradient_and_statistic_sits_on_its_stage_device(
        small_data, digits_data, variant, api, task, devices):
    data = small_data if task == 'regression' else digits_data
    stepper, pipe, _ = _stepper(data, variant, api, devices, task)
    placement = {name: (ctx, grad_ctx) for name, ctx, grad_ctx in stepper.placement()}
    checked = 0
    for block, stage in zip(pipe.blocks, pipe.plan.stage_of_layer):
        for param in block.collect_params().values():
            ctx, grad_ctx = placement[param.name]
            assert ctx == pipe.plan.devices[stage], param.name
            if param.grad_req != 'null':
                assert grad_ctx == pipe.plan.devices[stage], param.name
            checked += 1
    assert checked == len(placement) - (0 if variant == 'imperative' else 2)
    if task == 'digits':
        assert placement['bn1_running_var'][0] == pipe.plan.devices[
            pipe.plan.stage_of_layer[5]]
    if variant == 'symbolic':
        label = 'label' if task == 'regression' else 'softmax_label'
        assert placement['data'][0] == pipe.plan.first_device
        assert placement[label][0] == pipe.plan.last_device


@pytest.mark.parametrize('variant, api', VARIANTS)
def test_gradients_reach_every_layer_after_one_step(small_data, variant, api):
    """The seed's bug: gradients never reached the first two layers."""
    stepper, _, _ = _stepper(small_data, variant, api, THREE_DEVICES)
    before = stepper.params()
    stepper.step(*next(iter(_batches(stepper, small_data))))
    after = stepper.params()
    for name, grad in stepper.grads().items():
        assert np.abs(grad).max() > 1e-3, name
        assert not np.allclose(before[name], after[name]), name


def _run_steps(stepper, data, num_steps):
    losses = []
    for step, batch in enumerate(_batches(stepper, data)):
        if step == num_steps:
            break
        losses.append(stepper.step(*batch).asscalar())
    return np.array(losses), stepper.grads(), stepper.params(), stepper.aux()


def _assert_runs_agree(runs, reference):
    ref_losses, ref_grads, ref_params, ref_aux = runs.pop(reference)
    assert ref_losses[-1] < ref_losses[0]
    for label, (losses, grads, params, aux) in runs.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=AGREE_RTOL, atol=AGREE_ATOL,
                                   err_msg=label)
        for name in ref_params:
            np.testing.assert_allclose(grads[name], ref_grads[name], rtol=AGREE_RTOL,
                                       atol=AGREE_ATOL, err_msg='%s grad %s' % (label, name))
            np.testing.assert_allclose(params[name], ref_params[name], rtol=AGREE_RTOL,
                                       atol=AGREE_ATOL, err_msg='%s param %s' % (label, name))
        for name in ref_aux:
            np.testing.assert_allclose(aux[name], ref_aux[name], rtol=AGREE_RTOL,
                                       atol=AGREE_ATOL, err_msg='%s aux %s' % (label, name))


def test_split_equals_one_device_and_imperative_on_an_uneven_plan(small_data):
    """Four layers on two devices (2 + 2 by parameter count is not what a
    count split gives), SGD with momentum so optimizer state matters: every
    loss, the last step's gradients and every parameter agree."""
    runs = {}
    for label, variant, api, devices in [
            ('module, 2 devices', 'symbolic', 'module', 'cpu:0,cpu:1'),
            ('executor, 2 devices', 'symbolic', 'executor', 'cpu:0,cpu:1'),
            ('module, 1 device', 'symbolic', 'module', 'cpu:0'),
            ('imperative, 2 devices', 'imperative', 'module', 'cpu:0,cpu:1')]:
        stepper, pipe, _ = _stepper(small_data, variant, api, devices, widths=(2, 4, 3, 2, 1),
                                    momentum=0.9, lr=0.01)
        runs[label] = _run_steps(stepper, small_data, num_steps=8)
    assert pipe.plan.num_stages == 2 and len(pipe.blocks) == 4
    _assert_runs_agree(runs, 'module, 2 devices')


def test_split_cnn_equals_one_device_and_imperative(digits_data):
    """The CNN (convolution, BatchNorm, pooling, dense) on three devices:
    losses, gradients, parameters and BatchNorm statistics agree."""
    runs = {}
    for label, variant, api, devices in [
            ('module, 3 devices', 'symbolic', 'module', THREE_DEVICES),
            ('module, 1 device', 'symbolic', 'module', 'cpu:0'),
            ('imperative, 3 devices', 'imperative', 'module', THREE_DEVICES)]:
        stepper, _, _ = _stepper(digits_data, variant, api, devices, 'digits', batch_size=32)
        runs[label] = _run_steps(stepper, digits_data, num_steps=4)
    _assert_runs_agree(runs, 'module, 3 devices')


@pytest.mark.parametrize('api', ['module', 'executor'])
def test_micro_batches_leave_losses_gradients_and_parameters_unchanged(small_data, api):
    """GPipe's transparency: gradients summed over M chunks are the whole
    batch's, for M in 1, 2, 4, 5 (batch 40), on a model without BatchNorm."""
    runs = {}
    for chunks in (1, 2, 4, 5):
        stepper, _, _ = _stepper(small_data, 'symbolic', api, THREE_DEVICES, chunks=chunks,
                                 widths=(2, 8, 8, 1), momentum=0.9, lr=0.01)
        runs['M=%d' % chunks] = _run_steps(stepper, small_data, num_steps=6)
    _assert_runs_agree(runs, 'M=1')


@pytest.mark.parametrize('optimizer', ['sgd', 'adam'])
def test_replicas_sum_gradients_to_the_one_replica_result(small_data, optimizer):
    """Two replicas of a 2-stage pipeline (4 devices) on the same global batch
    equal one replica: the kvstore sums the halves' gradients."""
    runs = {}
    for replicas, devices in ((1, 'cpu:0,cpu:1'), (2, 'cpu:0,cpu:1,cpu:2,cpu:3')):
        stepper, pipe, _ = _stepper(small_data, 'symbolic', 'module', devices,
                                    replicas=replicas, optimizer=optimizer, lr=0.01)
        runs['R=%d' % replicas] = _run_steps(stepper, small_data, num_steps=6)
    assert pipe.plan.replica_devices == ((mx.cpu(0), mx.cpu(1)), (mx.cpu(2), mx.cpu(3)))
    _assert_runs_agree(runs, 'R=1')


def _optimizer_states(stepper, variant, api):
    """``[(weight device, [state devices])]`` of every parameter's optimizer state."""
    # pylint: disable=protected-access
    if variant == 'imperative':
        params = stepper.trainer._params
        return [(params[i].list_data()[0].context, _state_devices(state))
                for updater in stepper.trainer._updaters for i, state in updater.states.items()]
    updater = stepper.module._updater if api == 'module' else stepper._updater
    weights = stepper.module._exec_group.param_arrays if api == 'module' else [
        stepper.runtime.parameters[0][n] for n in stepper.param_names]
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
    stepper, _, _ = _stepper(small_data, variant, api, THREE_DEVICES, optimizer='adam')
    stepper.step(*next(iter(_batches(stepper, small_data))))
    states = _optimizer_states(stepper, variant, api)
    assert len(states) == 6
    assert {ctx for ctx, _ in states} == {mx.cpu(0), mx.cpu(1), mx.cpu(2)}
    for ctx, state_devices in states:
        assert len(state_devices) == 2  # Adam: mean and variance
        assert set(state_devices) == {ctx}


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
    stepper, _, _ = _stepper(small_data, variant, api, THREE_DEVICES)
    # pylint: disable=protected-access
    if variant == 'imperative':
        optimizer = stepper.trainer.optimizer
    elif api == 'module':
        optimizer = stepper.module._optimizer
    else:
        optimizer = stepper._optimizer
    calls = []
    _update_calls(optimizer, calls)
    stepper.step(*next(iter(_batches(stepper, small_data))))
    assert calls and all(len(devices) == 1 for devices in calls), calls
    assert set().union(*calls) == {mx.cpu(0), mx.cpu(1), mx.cpu(2)}


def test_staged_batches_follow_the_epoch_order_and_split_across_workers():
    X = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10, dtype=np.float32).reshape(10, 1)
    whole = [b[1].asnumpy().ravel().tolist()
             for b in staged_batches(X, y, 4, 3, 7, mx.cpu(0), mx.cpu(1))]
    halves = [[b[1].asnumpy().ravel().tolist()
               for b in staged_batches(X, y, 4, 3, 7, mx.cpu(0), mx.cpu(1), shard=(r, 2))]
              for r in range(2)]
    assert len(whole) == 2  # 10 // 4; the last 2 examples are dropped
    for step, batch in enumerate(whole):
        assert halves[0][step] + halves[1][step] == batch


@pytest.mark.parametrize('variant, api', [('symbolic', 'module'), ('imperative', 'module')])
def test_short_training_converges_and_commits_a_loadable_checkpoint(tmp_path, variant, api):
    cfg = make_config(variant=variant, api=api, devices=THREE_DEVICES, num_epochs=2,
                      progress=False, out=str(tmp_path))
    lines = []
    result = train(cfg, log=lines.append)
    assert result.final_mse <= 1e-5
    assert result.map_error < 1e-2
    np.testing.assert_allclose(result.learned_w, [[2.0, -3.4]], atol=1e-2)
    np.testing.assert_allclose(result.learned_b, [4.2], atol=1e-2)
    assert any(line.startswith('full-data MSE: ') for line in lines)
    assert any('layer2_weight' in line and 'cpu(2)' in line for line in lines)
    summary = json.loads((tmp_path / 'current' / 'summary.json').read_text())
    assert summary['final_mse'] == result.final_mse and summary['complete'] is True
    assert summary['devices'] == ['cpu:0', 'cpu:1', 'cpu:2']
    symbol, arg_params, _ = mx.model.load_checkpoint(str(tmp_path / 'current' / 'regression'),
                                                     2)
    assert symbol.attr_dict()['layer1_weight']['__ctx_group__'] == 'stage1'
    X = np.random.default_rng(3).normal(size=(5, 2))
    np.testing.assert_allclose(
        regression.forward_numpy({k: v.asnumpy() for k, v in arg_params.items()}, X),
        regression.forward_numpy(result.params, X))
    assert sorted(os.listdir(tmp_path))[:3] == ['.kind', '.lock', 'current']


def test_digits_reaches_the_target_accuracy_with_bn_statistics_placed(tmp_path):
    result = train(make_config(task='digits', devices=THREE_DEVICES, progress=False,
                               out=str(tmp_path)), log=lambda line: None)
    assert result.held_out_accuracy >= digits.TARGET_ACCURACY
    placed = {n: d for n, d, _ in result.placement}
    assert placed['bn0_running_mean'] == mx.cpu(0) and placed['dense1_weight'] == mx.cpu(2)


@pytest.mark.slow
def test_batchnorm_with_micro_batches_trains_from_the_command_line_with_a_quiet_stderr(tmp_path):
    """BatchNorm computes its statistics per chunk, as in GPipe, with oneDNN on
    (the default cut ends stage 0 with bn1, where MXNet's copy used to fail).
    In a process of its own, so that MXNet's once-per-process messages (the
    storage fallback blocks oneDNN off used to cause) would show."""
    out = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'train', '--task', 'digits',
                          '--chunks', '4', '--epochs', '6', '--no-progress', '--devices',
                          THREE_DEVICES, '--out', str(tmp_path), '--no-memory'],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert 'Storage type fallback' not in out.stderr, out.stderr[:2000]
    assert out.stderr.strip() == '', out.stderr[:2000]
    assert '4 micro-batches per batch' in out.stdout
    accuracy = float(out.stdout.split('held-out accuracy: ')[1].split('%')[0])
    assert accuracy >= 90.0


def test_cli_train_profiles_and_commits(tmp_path, capsys):
    """The CLI end to end: exit 0, a Chrome trace whose rows include the stage
    devices, and a committed snapshot."""
    assert main(['train', '--no-progress', '--epochs', '1', '--num-examples', '500',
                 '--devices', THREE_DEVICES, '--out', str(tmp_path), '--profile', '--no-memory']) == 0
    out = capsys.readouterr().out
    assert 'full-data MSE: ' in out
    assert {'profile-stats.txt', 'profile.json', 'current'} <= set(os.listdir(tmp_path))
    trace = json.loads((tmp_path / 'profile.json').read_text())
    rows = {e['args']['name'] for e in trace['traceEvents']
            if e.get('ph') == 'M' and e.get('name') == 'process_name'}
    assert {'cpu/0', 'cpu/1'} <= rows, rows
    assert 'FullyConnected' in (tmp_path / 'profile-stats.txt').read_text()


@pytest.mark.slow
def test_a_second_profile_in_one_process_is_a_complete_trace_with_its_device_rows(tmp_path):
    """MXNet writes the trace's header and device rows on a process's first
    dump only: the second --profile of one process still writes a trace that
    loads and names its devices."""
    code = (
        "import json, sys\n"
        "from mp_symbolic.training.cli import main\n"
        "for out in sys.argv[1:]:\n"
        "    assert main(['train', '--no-progress', '--epochs', '1', '--num-examples', '200',\n"
        "                 '--devices', %r, '--out', out, '--profile', '--no-memory']) == 0\n"
        % THREE_DEVICES)
    outs = [str(tmp_path / 'first'), str(tmp_path / 'second')]
    run = subprocess.run([sys.executable, '-c', code] + outs, capture_output=True, text=True,
                         timeout=300, check=False, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    for out in outs:
        trace = json.loads((tmp_path / out / 'profile.json').read_text())
        rows = {e['args']['name'] for e in trace['traceEvents']
                if e.get('ph') == 'M' and e.get('name') == 'process_name'}
        assert {'cpu/0', 'cpu/1'} <= rows, (out, rows)
        assert any(e.get('cat') == 'operator' and e.get('pid') == 1
                   for e in trace['traceEvents']), out


def test_divergence_stops_within_its_epoch_and_writes_no_profile(tmp_path):
    """--lr 100 diverges in the first epoch's first steps: the run stops
    there (not after every epoch), exits 1 with one line naming epoch and
    step, and commits nothing; a profile is not written. (A process of its
    own: MXNet's profiler cannot start again in a process that dumped once.)"""
    out = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'train', '--no-progress',
                          '--epochs', '20', '--num-examples', '2000', '--lr', '100',
                          '--devices', THREE_DEVICES, '--out', str(tmp_path), '--profile', '--no-memory'],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 1, out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: training diverged: batch loss ')
    assert 'at epoch 1, step ' in err[0]
    assert 'epoch 1/20' not in out.stdout
    assert not (tmp_path / 'profile.json').exists()
    assert not (tmp_path / 'current').exists()


@pytest.mark.slow
def test_a_failed_profiled_run_removes_no_file_but_its_own(tmp_path):
    """MXNet's profiler unlinks the file set_config names: a failed run
    drops its trace without naming any file of the system's (it named
    os.devnull, which a run as root removed)."""
    keep = tmp_path / 'devnull'
    keep.write_text('kept')
    code = ("import os, sys\n"
            "os.devnull = %r\n"
            "from mp_symbolic.training.cli import main\n"
            "sys.exit(main(['train', '--no-progress', '--epochs', '2', '--num-examples', "
            "'2000', '--lr', '100', '--devices', %r, '--out', %r, '--profile', "
            "'--no-memory']))\n" % (str(keep), THREE_DEVICES, str(tmp_path / 'out')))
    run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=300, check=False, cwd=ROOT)
    assert run.returncode == 1, run.stderr[-2000:]
    assert 'training diverged' in run.stderr
    assert keep.read_text() == 'kept'
    assert not (tmp_path / 'out' / 'profile.json').exists()


def test_divergence_in_a_later_epoch_keeps_the_last_committed_checkpoint(tmp_path, capsys,
                                                                         monkeypatch):
    """A NaN appearing in epoch 3 stops epoch 3; epoch 2's checkpoint stays current."""
    from mp_symbolic.training import symbolic  # pylint: disable=import-outside-toplevel
    step = symbolic.ModuleStepper.step
    calls = []

    def poisoned(self, X, y):
        calls.append(1)
        loss = step(self, X, y)
        return loss * float('nan') if len(calls) == 2 * 40 + 3 else loss
    monkeypatch.setattr(symbolic.ModuleStepper, 'step', poisoned)
    assert main(['train', '--no-progress', '--epochs', '6', '--num-examples', '4000',
                 '--devices', THREE_DEVICES, '--out', str(tmp_path), '--no-memory']) == 1
    err = capsys.readouterr().err
    assert 'error: training diverged: batch loss nan at epoch 3, step 3' in err
    # 40 steps per epoch: stopped within two check blocks of the bad step
    assert len(calls) <= 2 * 40 + 3 + 2 * CHECK_EVERY
    summary = json.loads((tmp_path / 'current' / 'summary.json').read_text())
    assert summary['epoch'] == 2 and summary['complete'] is False


def test_a_run_that_does_not_learn_exits_1_and_keeps_its_last_epoch_marked_incomplete(
        tmp_path, capsys):
    assert main(['train', '--no-progress', '--epochs', '2', '--num-examples', '500',
                 '--lr', '1e-30', '--checkpoint-every', '5', '--devices', THREE_DEVICES,
                 '--out', str(tmp_path), '--no-memory']) == 1
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith(
        'error: training did not improve the model (MSE: '), err
    assert 'its last epoch is kept in %s, marked incomplete' % (tmp_path / 'current') in err
    summary = json.loads((tmp_path / 'current' / 'summary.json').read_text())
    assert (summary['epoch'], summary['complete'], summary['improved']) == (2, False, False)
    assert summary['score_name'] == 'MSE' and summary['score_after'] >= summary['score_before']


def test_mirroring_recomputes_ops_and_changes_no_result(small_data):
    """MXNet's mirroring (``__force_mirroring__`` on every stage's ops): the
    bound graph recomputes forward ops in the backward pass, and losses,
    gradients and parameters stay those of the plain graph."""
    runs, recomputed = {}, {}
    for mirror in (False, True):
        stepper, _, _ = _stepper(small_data, 'symbolic', 'executor', THREE_DEVICES,
                                 widths=(2, 8, 8, 1), mirror=mirror)
        recomputed[mirror] = sum(line.startswith('Op:') and line.endswith('_mirror')
                                 for exe in stepper.runtime.executors
                                 for line in exe.debug_str().splitlines())
        runs['mirror=%s' % mirror] = _run_steps(stepper, small_data, num_steps=5)
    assert recomputed[False] == 0 and recomputed[True] > 0
    _assert_runs_agree(runs, 'mirror=False')
