"""Training folders that survive: every checkpoint committed as one unit,
one writer per folder, resume on the same or another device plan, and a
training killed mid-run leaving a whole, exportable checkpoint.
(mp_symbolic/store.py's own fault tests are in test_store.py.)"""
import contextlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mp_symbolic.tools.checkpoint import read_checkpoint
from mp_symbolic.training.cli import main
from mp_symbolic.training.config import resume_config
from mp_symbolic.training.metrics import AGREE_ATOL, AGREE_RTOL
from mp_symbolic.tools.store import FolderInUse, Store
from mp_symbolic.training.loop import params_digest, train

from export.__main__ import main as export_main

from conftest import THREE_DEVICES, make_config

QUIET = dict(log=lambda line: None)


def _run(out, devices=THREE_DEVICES, epochs=4, **fields):
    cfg = make_config(devices=devices, num_epochs=epochs, progress=False, out=str(out),
                      num_examples=1000, **fields)
    return train(cfg, **QUIET)


@pytest.mark.parametrize('optimizer, fields', [('sgd', {'momentum': 0.9, 'lr': 0.01}),
                                               ('adam', {'lr': 0.01})])
def test_resume_on_the_same_plan_equals_an_uninterrupted_run_bitwise(tmp_path, optimizer,
                                                                     fields):
    whole = _run(tmp_path / 'whole', optimizer=optimizer, **fields)
    _run(tmp_path / 'part', epochs=2, optimizer=optimizer, **fields)
    resumed = train(make_config(devices=THREE_DEVICES, num_epochs=4, progress=False,
                                num_examples=1000, optimizer=optimizer,
                                resume=str(tmp_path / 'part'), **fields), **QUIET)
    for name, value in whole.params.items():
        np.testing.assert_array_equal(resumed.params[name], value, err_msg=name)
    assert resumed.epoch_losses == whole.epoch_losses
    assert read_checkpoint(str(tmp_path / 'part')).epoch == 4


def test_resume_without_the_plans_flags_takes_the_checkpoints_plan_and_equals_the_whole_run(
        tmp_path, capsys):
    """A run on 2 devices under 1f1b with 2 micro-batches, resumed with
    --resume and --epochs alone: the checkpoint's plan, not the defaults
    (GPipe, 1 chunk, 3 devices), bitwise equal to the uninterrupted run."""
    plan = dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2, optimizer='sgd',
                momentum=0.9, lr=0.01)
    whole = _run(tmp_path / 'whole', **plan)
    _run(tmp_path / 'part', epochs=2, **plan)
    capsys.readouterr()
    assert main(['train', '--resume', str(tmp_path / 'part'), '--epochs', '4', '--no-progress',
                 '--no-memory']) == 0
    out = capsys.readouterr().out
    assert 'parameters sha256: %s' % params_digest(whole.params) in out.splitlines()
    assert 'plan changed' not in out
    config = read_checkpoint(str(tmp_path / 'part')).summary['config']
    assert {k: config[k] for k in ('devices', 'schedule', 'chunks')} == {
        'devices': 'cpu:0,cpu:1', 'schedule': '1f1b', 'chunks': 2}


def test_a_resume_that_changes_the_plan_says_what_changed_in_one_line(tmp_path, capsys):
    _run(tmp_path / 'part', epochs=2, devices='cpu:0,cpu:1', balance=(2, 1), mirror=True)
    capsys.readouterr()
    assert main(['train', '--resume', str(tmp_path / 'part'), '--epochs', '3', '--no-progress',
                 '--no-memory', '--devices', THREE_DEVICES, '--no-mirror']) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('resume:')]
    assert lines == ["resume: plan changed from the checkpoint's: --devices cpu:0,cpu:1,cpu:2 "
                     "(was cpu:0,cpu:1); --balance by parameter count (was 2,1); --mirror off "
                     "(was on)"]
    config = read_checkpoint(str(tmp_path / 'part')).summary['config']
    assert (config['devices'], config['balance'], config['mirror']) == (THREE_DEVICES, None,
                                                                        False)


def test_a_resume_leaves_to_its_default_what_goes_with_a_changed_flag():
    saved = make_config(num_epochs=2, batch_size=96, optimizer='sgd', lr=0.02, momentum=0.0,
                        devices='cpu:0,cpu:1,cpu:2,cpu:3', schedule='interleaved', virtual=2,
                        chunks=4, replicas=2, kvstore='device', balance=(2, 1)).to_dict()
    same = resume_config(saved, {'num_epochs': 3})
    assert (same.devices, same.schedule, same.virtual, same.chunks, same.replicas, same.kvstore,
            same.balance) == ('cpu:0,cpu:1,cpu:2,cpu:3', 'interleaved', 2, 4, 2, 'device', (2, 1))
    other = resume_config(saved, {'num_epochs': 3, 'schedule': '1f1b', 'replicas': 1,
                                  'devices': 'cpu:0,cpu:1'})
    assert (other.virtual, other.kvstore, other.balance, other.chunks) == (None, None, None, 4)
    launched = resume_config(dict(saved, kvstore='dist_sync'), {'num_epochs': 3})
    assert launched.kvstore == 'local'  # the launcher gives dist_sync; 2 replicas sum locally


@pytest.mark.parametrize('optimizer', ['sgd', 'adam'])
def test_resume_onto_other_plans_moves_weights_and_optimizer_state(tmp_path, optimizer):
    """3 devices -> 2 -> 1 -> back to 3, one epoch each, equals one run on 3."""
    fields = {'momentum': 0.9, 'lr': 0.01} if optimizer == 'sgd' else {'lr': 0.01}
    whole = _run(tmp_path / 'whole', epochs=4, optimizer=optimizer, **fields)
    _run(tmp_path / 'hop', epochs=1, optimizer=optimizer, **fields)
    for epochs, devices in ((2, 'cpu:1,cpu:0'), (3, 'cpu:2'), (4, THREE_DEVICES)):
        saved = read_checkpoint(str(tmp_path / 'hop')).summary['config']
        result = train(resume_config(saved, {'devices': devices, 'num_epochs': epochs,
                                             'progress': False,
                                             'resume': str(tmp_path / 'hop')}), **QUIET)
        assert {str(d) for _, d, _ in result.placement} == {
            'cpu(%s)' % d.split(':')[1] for d in devices.split(',')}
    for name, value in whole.params.items():
        np.testing.assert_allclose(result.params[name], value, rtol=AGREE_RTOL, atol=AGREE_ATOL,
                                   err_msg=name)


@pytest.mark.parametrize('argv, message', [
    (['--widths', '2,4,1'], "--widths: expected the checkpoint's (2, 2, 2, 1) with resume"),
    (['--variant', 'imperative'], "--variant: expected the checkpoint's 'symbolic'"),
    (['--epochs', '2'], '--epochs: expected more than the 2 epochs of the checkpoint'),
])
def test_a_resume_that_cannot_work_is_one_line(tmp_path, capsys, argv, message):
    _run(tmp_path / 'run', epochs=2)
    capsys.readouterr()
    assert main(['train', '--no-progress', '--resume', str(tmp_path / 'run')] + argv) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and message in err, err


def test_train_refuses_a_config_that_is_not_the_checkpoints_run(tmp_path):
    _run(tmp_path / 'run', epochs=2)
    with pytest.raises(ValueError, match="lr: expected the checkpoint's 0.02"):
        train(make_config(devices=THREE_DEVICES, num_epochs=3, num_examples=1000, lr=0.5,
                          progress=False, resume=str(tmp_path / 'run')), **QUIET)


def test_resume_without_a_committed_checkpoint_is_refused(tmp_path, capsys):
    assert main(['train', '--no-progress', '--resume', str(tmp_path)]) == 2
    assert 'expected a training run in %s (its current/ snapshot), found none; train one ' \
        'first, e.g. python -m mp_symbolic train --out %s' % (tmp_path, tmp_path) \
        in capsys.readouterr().err


def test_resume_from_a_folder_of_other_files_suggests_no_training_into_it(capsys):
    assert main(['train', '--no-progress', '--resume', '/']) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: expected a training run in / (its current/ snapshot), found '
                          'a folder of ') and err.endswith(' entries without it\n'), err
    assert 'train --out' not in err


def test_resume_with_the_optimizer_state_missing_is_refused(tmp_path, capsys):
    _run(tmp_path / 'run', epochs=2)
    states = read_checkpoint(str(tmp_path / 'run')).states_path
    os.remove(states)
    assert main(['train', '--no-progress', '--epochs', '3', '--resume',
                 str(tmp_path / 'run')]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and os.path.basename(states) in err


def test_a_second_training_into_a_folder_in_use_is_refused_at_once(tmp_path, capsys):
    out = tmp_path / 'run'
    with Store(str(out)).locked():  # another writer holds the folder
        # it returns while this process holds the lock: a writer that waited would never return
        assert main(['train', '--no-progress', '--out', str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'is in use by another process (pid %d)' % os.getpid() in err
    with Store(str(out)).locked():
        with pytest.raises(FolderInUse):
            train(make_config(devices=THREE_DEVICES, progress=False, out=str(out)), **QUIET)


def test_export_into_a_folder_in_use_is_refused(tmp_path, capsys):
    _run(tmp_path / 'run', epochs=1)
    with Store(str(tmp_path / 'out')).locked():
        assert export_main(['--checkpoint', str(tmp_path / 'run'), '--out',
                            str(tmp_path / 'out')]) == 2
    assert 'is in use by another process' in capsys.readouterr().err


@contextlib.contextmanager
def _running_until(argv, prefix):
    """``argv`` in a process of its own, once it has printed a line starting
    with ``prefix``; killed on the way out if still running (a signal that
    never arrives, a failed assertion), so that no process outlives its test."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith(prefix):
                break
        else:
            pytest.fail('%s ended before printing %r: %s' % (argv[0], prefix, proc.stderr.read()))
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def _training_until(out, epoch):
    """A long training into ``out`` (see :func:`_running_until`), once it has
    printed epoch ``epoch``'s line."""
    return _running_until([sys.executable, '-m', 'mp_symbolic', 'train', '--no-progress',
                           '--epochs', '400', '--num-examples', '2000', '--out', str(out),
                           '--devices', THREE_DEVICES, '--no-memory'], 'epoch %d/' % epoch)


def test_a_process_started_for_a_test_ends_with_the_test_when_the_signal_never_comes():
    with pytest.raises(RuntimeError):
        with _running_until(['sh', '-c', 'echo epoch 1/5; exec sleep 600'], 'epoch 1/') as proc:
            raise RuntimeError('the test fails before it signals the process')
    assert proc.poll() == -signal.SIGKILL


@pytest.mark.slow
def test_a_training_killed_mid_run_leaves_a_whole_checkpoint_that_exports(tmp_path):
    """SIGKILL while epochs are being committed: the folder holds one whole
    checkpoint (verified file by file), and it exports."""
    out = tmp_path / 'run'
    with _training_until(out, 5) as proc:
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    checkpoint = read_checkpoint(str(out))
    assert checkpoint.epoch >= 4 and checkpoint.meta['complete'] is False
    assert export_main(['--checkpoint', str(out), '--out', str(tmp_path / 'export')]) == 0


def test_ctrl_c_exits_130_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    out = tmp_path / 'run'
    with _training_until(out, 3) as proc:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert err.strip().splitlines() == [
        'error: interrupted; the last committed checkpoint in %s is kept' % out]
    assert read_checkpoint(str(out)).epoch >= 2


def test_a_path_the_terminal_cannot_show_is_printed_escaped(tmp_path):
    """Under an ASCII stdout a Unicode --out trains, commits and exits 0."""
    out = tmp_path / 'r\u00e9sultat'
    done = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'train', '--no-progress',
                           '--epochs', '1', '--num-examples', '500', '--out', str(out),
                           '--devices', THREE_DEVICES, '--no-memory'], capture_output=True,
                          env=dict(os.environ, PYTHONIOENCODING='ascii'), timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert b'r\\xe9sultat' in done.stdout and read_checkpoint(str(out)).epoch == 1


# -- a commit's files are read back one array at a time ----------------------------

# Writes a commit's file of four arrays of 64 MB (held by the caller) and
# prints how far the process's resident peak rose above what it held before.
READ_BACK_PEAK = r'''
import sys
import mxnet as mx
import numpy as np
from mp_symbolic.core.optim.optstate import FORMAT
from mp_symbolic.tools.checkpoint import _save_states, save_params

def status(field):
    with open('/proc/self/status') as lines:
        return next(int(l.split()[1]) * 1024 for l in lines if l.startswith(field + ':'))

which, path = sys.argv[1], sys.argv[2]
arrays = [np.full(1 << 24, i + 1, dtype=np.float32) for i in range(4)]
if which == 'params':
    arrays = {'w%d' % i: mx.nd.array(a, dtype=a.dtype) for i, a in enumerate(arrays)}
    mx.nd.waitall()
    write = lambda: save_params(path, arrays)
else:
    states = {'format': FORMAT, 'optimizer': 'sgd', 'num_update': 1, 'arrays': arrays,
              'params': {'w%d' % i: {'count': 1, 'state': {'t': 'nd', 'a': i}}
                         for i in range(4)}}
    write = lambda: _save_states(path, states)
with open('/proc/self/clear_refs', 'w') as out:
    out.write('5')  # VmHWM := VmRSS
before = status('VmRSS')
write()
print(status('VmHWM') - before)
'''


@pytest.mark.slow
@pytest.mark.parametrize('which', ['params', 'states'])
def test_a_commits_file_is_written_and_read_back_holding_one_array_at_a_time(tmp_path, which):
    """Writing a 256 MB params (or optimizer-state) file of arrays the caller
    holds, and reading it back to check it, raises the process's peak by
    less than half the file: one array at a time, never the whole file (as
    ``mx.nd.load`` of it, or an ``.npz`` made in a buffer and read back)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = str(tmp_path / ('m-0001.' + which))
    done = subprocess.run([sys.executable, '-c', READ_BACK_PEAK, which, path], cwd=root,
                          env=dict(os.environ, PYTHONPATH=root), capture_output=True,
                          text=True, timeout=300, check=True)
    size = os.path.getsize(path)
    assert size > 4 << 26
    assert int(done.stdout.split()[-1]) < size // 2, (done.stdout, size)


def _flipping(created):
    """``parts._created`` whose file changes one byte of each large write."""
    class Flipping(created):  # pylint: disable=too-few-public-methods
        def __enter__(self):
            f = super().__enter__()
            write = f.write

            def flipped(data):
                data = bytes(data)
                if len(data) >= 1024:
                    data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
                return write(data)
            f.write = flipped
            return f
    return Flipping


@pytest.mark.parametrize('which', ['params', 'states'])
def test_a_file_whose_bytes_differ_from_those_written_is_refused_in_one_line(
        tmp_path, monkeypatch, which):
    """Names, shapes and types read back as written, but one bit of the data
    differs: the read-back (sha256 of each array) refuses it."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.optim.optstate import FORMAT  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.base import parts
    from mp_symbolic.tools import checkpoint  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(parts, '_created', _flipping(parts._created))  # pylint: disable=protected-access
    path = str(tmp_path / ('m-0001.' + which))
    with pytest.raises(OSError, match='expected .* read back') as err:
        if which == 'params':
            checkpoint.save_params(path, {'w': mx.nd.ones((64, 64))})
        else:
            checkpoint._save_states(path, {  # pylint: disable=protected-access
                'format': FORMAT, 'optimizer': 'sgd', 'num_update': 1,
                'params': {'w': {'count': 1, 'state': {'t': 'nd', 'a': 0}}},
                'arrays': [np.ones((64, 64), dtype=np.float32)]})
    assert path in str(err.value) and '\n' not in str(err.value)


@pytest.mark.parametrize('variant, api', [('symbolic', 'executor'), ('imperative', 'module')])
def test_executor_and_imperative_resume_of_a_cnn_equals_an_uninterrupted_run_bitwise(
        tmp_path, variant, api):
    # the digits CNN's convolution weights sit in oneDNN's layout after a step
    plan = dict(task='digits', devices='cpu:0,cpu:1', variant=variant, api=api,
                optimizer='sgd', momentum=0.9, lr=0.05)
    whole = train(make_config(num_epochs=2, progress=False, memory=False,
                              out=str(tmp_path / 'whole'), **plan), **QUIET)
    train(make_config(num_epochs=1, progress=False, memory=False, out=str(tmp_path / 'part'),
                      **plan), **QUIET)
    resumed = train(make_config(num_epochs=2, progress=False, memory=False,
                                resume=str(tmp_path / 'part'), **plan), **QUIET)
    assert list(resumed.params) == list(whole.params)
    for name, value in whole.params.items():
        np.testing.assert_array_equal(resumed.params[name], value, err_msg=name)
    assert resumed.epoch_losses == whole.epoch_losses
