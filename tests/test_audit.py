"""The output folders, the lock, the commit and the launcher under the second
audit's faults: an export aimed at a training folder or a snapshot, a symlink
planted at ``.lock``, a file-size limit during a commit, a worker that fails
alone in a ``dist_sync`` job. Each test reproduces one defect: it failed
before the fix (data lost, a file truncated, a truncated commit, a hang)."""
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mp_symbolic.tools.store import FolderInUse, Store, StoreError, WrongFolder
from conftest import cli_status, file_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')
PYTHON = sys.executable
TRAIN = ['--epochs', '2', '--num-examples', '200', '--devices', 'cpu:0,cpu:1', '--no-progress',
         '--no-memory']


def run(argv, timeout=120, **kwargs):
    return subprocess.run([PYTHON] + argv, cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout, check=False, **kwargs)


snapshot_files = file_tree


def train_in_process(out):
    """``python -m mp_symbolic train --out OUT`` + ``TRAIN`` through the
    command's ``main`` in this process (the folder it writes is the same; no
    2-3 s MXNet start)."""
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    assert cli_status(main, ['train', '--out', str(out)] + TRAIN) == 0


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A training folder of the regression, 2 epochs."""
    out = tmp_path_factory.mktemp('audit') / 'run'
    train_in_process(out)
    return out


def export_main(argv, capsys):
    from export.__main__ import main  # pylint: disable=import-outside-toplevel
    status = main(argv)
    return status, capsys.readouterr().err


# -- 1. an export never replaces or enters a training folder -----------------------------

@pytest.mark.parametrize('out', ['{run}', '{run}/current', '{run}/sub', '{run}/current/x', ''])
def test_export_refuses_a_training_folder_or_a_place_inside_it(trained, out, capsys):
    before = snapshot_files(trained)
    status, err = export_main(['--checkpoint', str(trained / 'current' / 'regression'),
                               '--epoch', '2', '--out', out.format(run=trained)], capsys)
    assert status == 2
    assert err.startswith('error: --out: expected ') and err.count('\n') == 1, err
    assert snapshot_files(trained) == before  # the training snapshot is untouched
    assert Store(str(trained)).current() is not None


def test_export_refuses_a_training_folder_written_before_folders_had_kinds(trained, tmp_path,
                                                                            capsys):
    old = tmp_path / 'old-run'
    shutil.copytree(trained, old, symlinks=True)
    os.remove(old / '.kind')  # as a training folder of an earlier version
    before = snapshot_files(old)
    status, err = export_main(['--checkpoint', str(old / 'current' / 'regression'), '--epoch',
                               '2', '--out', str(old)], capsys)
    assert (status, err.split(' at ')[0]) == (
        2, 'error: --out: expected an export folder (or a new one), found a training folder')
    assert snapshot_files(old) == before


def test_training_refuses_an_export_folder(tmp_path, capsys):
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    export_dir = tmp_path / 'exported'
    with Store(str(export_dir)).locked() as store:  # told by its manifest, as exports were
        store.commit(lambda folder: open(os.path.join(folder, 'm.onnx'), 'w').close(),
                     {'kind': 'export'})
    before = snapshot_files(export_dir)
    capsys.readouterr()
    assert cli_status(main, ['train', '--out', str(export_dir)] + TRAIN) == 2
    assert capsys.readouterr().err == (
        'error: --out: expected a training folder (or a new one), found an export folder at '
        '%s; choose another folder\n' % export_dir)
    assert snapshot_files(export_dir) == before


def test_store_of_one_kind_refuses_the_other_and_nesting(tmp_path):
    with Store(str(tmp_path / 'a'), kind='training').locked() as store:
        assert not (tmp_path / 'a' / '.kind').exists()  # a failed first save leaves no mark
        store.commit(lambda folder: open(os.path.join(folder, 'f'), 'w').close())
    assert (tmp_path / 'a' / '.kind').read_text() == 'training\n'
    with pytest.raises(WrongFolder, match='expected an export folder'):
        with Store(str(tmp_path / 'a'), kind='export').locked():
            pass
    with pytest.raises(WrongFolder, match='inside a training folder'):
        with Store(str(tmp_path / 'a' / 'inner')).locked():
            pass
    assert not (tmp_path / 'a' / 'inner').exists()


# -- 2. the lock file is never followed through a symlink, nor truncated ----------------

@pytest.mark.parametrize('target_exists', [True, False])
def test_symlink_at_the_lock_is_refused_and_its_target_untouched(tmp_path, target_exists):
    victim = tmp_path / 'victim.txt'
    if target_exists:
        victim.write_text('precious\n')
    folder = tmp_path / 'out'
    folder.mkdir()
    os.symlink(str(victim), str(folder / '.lock'))
    with pytest.raises(StoreError, match='found a symlink; refusing to follow it'):
        with Store(str(folder)).locked():
            pass
    assert victim.read_text() == 'precious\n' if target_exists else not victim.exists()


def test_hard_link_at_the_lock_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / 'victim.txt'
    victim.write_text('precious\n')
    folder = tmp_path / 'out'
    folder.mkdir()
    os.link(str(victim), str(folder / '.lock'))
    with pytest.raises(StoreError, match='a file with 2 links'):
        with Store(str(folder)).locked():
            pass
    assert victim.read_text() == 'precious\n'


def test_lock_is_not_truncated_and_names_its_holder(tmp_path):
    folder = tmp_path / 'out'
    with Store(str(folder)).locked():
        with pytest.raises(FolderInUse, match=r'\(pid %d\)' % os.getpid()):
            with Store(str(folder)).locked():
                pass
    assert (folder / '.lock').read_text().split() == [str(os.getpid())]


# -- 3. a commit whose files do not read back as written is not made ------------------

def _file_size_limit(limit):
    def limit_writes():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return limit_writes


def test_file_size_limit_during_a_commit_exits_1_and_commits_nothing(tmp_path):
    out = tmp_path / 'run'
    # 3 KiB, as `ulimit -f 3`: the regression's symbol JSON (about 3.8 KiB) is cut short.
    result = run(['-m', 'mp_symbolic', 'train', '--out', str(out)] + TRAIN,
                 preexec_fn=_file_size_limit(3 * 1024))
    assert result.returncode == 1, result.stderr
    assert result.stderr.count('\n') == 1 and 'regression-symbol.json: expected the' \
        in result.stderr, result.stderr
    assert Store(str(out)).current() is None
    assert sorted(os.listdir(out)) == ['.lock']


def test_params_that_cannot_be_written_raise_one_line():
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.checkpoint import save_params  # pylint: disable=import-outside-toplevel
    with pytest.raises(OSError, match='/dev/full: cannot write the parameters') as err:
        save_params('/dev/full', {'w': mx.nd.ones((64, 64))})
    assert '\n' not in str(err.value)


# -- 4. a worker that fails alone ends the job, without ps-lite's barrier -----------------

def _launch(command, timeout=90):
    """``launch --workers 2 --servers 1 -- COMMAND``: (status, stdout, stderr).
    A job still running after ``timeout`` (a worker held in ps-lite's barrier)
    is stopped (SIGTERM to the launcher, which stops its processes) and
    reported as status None."""
    launcher = subprocess.Popen(
        [PYTHON, '-m', 'mp_symbolic', 'launch', '--workers', '2', '--servers', '1', '--']
        + command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
        status = launcher.returncode
    except subprocess.TimeoutExpired:
        launcher.terminate()
        stdout, stderr = launcher.communicate(timeout=30)
        status = None
    return status, stdout, stderr


# A worker that reports its error and returns a status, as the command line
# does: by then the exception, and with it the kvstore, is released.
FAILING_WORKER = """
import sys
import mxnet as mx
from mp_symbolic.tools.launch import abort_on_error, hold_kvstore

def work():
    kv = mx.kv.create('dist_sync')
    hold_kvstore(kv)
    if kv.rank == 1:
        raise ValueError('rank 1 fails alone')
    kv.init(0, mx.nd.zeros(1))
    kv.push(0, mx.nd.ones(1))

def main():
    try:
        work()
    except ValueError as err:
        print('error: %s' % err, file=sys.stderr)
        return 2
    return 0

with abort_on_error():
    sys.exit(main())
"""


def test_a_worker_of_another_rank_failing_alone_ends_the_job_by_its_own_exit():
    """Not by a timeout: the failing worker exits (status 2) instead of waiting
    in ps-lite's barrier, and the launcher then stops the rest (status None:
    the test's timeout stopped a job that never ended)."""
    status, stdout, stderr = _launch([PYTHON, '-c', FAILING_WORKER])
    assert status == 1, stdout[-2000:] + stderr[-2000:]
    assert 'error: rank 1 fails alone' in stderr
    assert 'exited with status 2; stopped the other 3 processes' in stderr.splitlines()[-1]


def test_worker_0_failing_alone_ends_the_job_by_its_own_exit(tmp_path):
    out = tmp_path / 'busy'
    out.mkdir()
    # Another process holds the folder: the worker that writes checkpoints fails, the
    # other one is already waiting for it in the kvstore's start-up barrier.
    holder = subprocess.Popen([PYTHON, '-c', 'import fcntl, os, sys, time\n'
                               'fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n'
                               'fcntl.flock(fd, fcntl.LOCK_EX)\nprint(1, flush=True)\n'
                               'time.sleep(300)\n', str(out / '.lock')],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == '1\n'
        status, stdout, stderr = _launch(['train', '--out', str(out)] + TRAIN)
    finally:
        holder.kill()
        holder.wait()
    assert status == 1, stdout[-2000:] + stderr[-2000:]
    assert 'is in use by another process (pid' in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith('error: worker ') and 'exited with status 2; stopped the other' \
        in last, last  # the failing worker's own exit ended the job, not a timeout


# -- 5. tracebacks that are one line now ------------------------------------------------

def _catches_sigterm(pid):
    """Whether the process has a handler for SIGTERM (Python has none of its own):
    the entry point's first statement has run."""
    with open('/proc/%d/status' % pid) as f:
        caught = next(line for line in f if line.startswith('SigCgt:')).split()[1]
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def _signal_after(argv, signum, delay):
    """Starts ``argv``, waits until it handles signals, then ``delay`` seconds
    more (into the imports), and sends ``signum``."""
    proc = subprocess.Popen([PYTHON] + argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not _catches_sigterm(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    return proc.returncode, stdout, stderr


@pytest.mark.parametrize('argv, signum, delay', [
    (['-m', 'mp_symbolic', 'train', '--out', '{tmp}/run'] + TRAIN, signal.SIGINT, 0.0),
    (['-m', 'mp_symbolic', 'train', '--out', '{tmp}/run'] + TRAIN, signal.SIGINT, 0.8),
    (['-m', 'mp_symbolic', 'train', '--out', '{tmp}/run'] + TRAIN, signal.SIGTERM, 0.4),
    # an export of a real run: a missing one is refused before the signal lands
    (['-m', 'export', '--checkpoint', '{tmp}/run', '--out', '{tmp}/e'], signal.SIGINT, 0.0),
], ids=['train-at-once', 'train-0.8s', 'train-sigterm', 'export'])
def test_signal_while_starting_is_one_line(tmp_path, argv, signum, delay):
    if argv[1] == 'export':
        train_in_process(tmp_path / 'run')
    status, _, stderr = _signal_after([a.format(tmp=tmp_path) for a in argv], signum, delay)
    assert status == 128 + signum, stderr
    assert stderr.startswith('error: ') and stderr.count('\n') == 1, stderr


def test_launch_interrupted_while_starting_ends_in_one_line_of_its_own(tmp_path):
    status, _, stderr = _signal_after(
        ['-m', 'mp_symbolic', 'launch', '--workers', '1', '--servers', '1', '--', 'train',
         '--out', str(tmp_path / 'run')] + TRAIN, signal.SIGINT, 0.3)
    assert status == 130, stderr
    assert 'Traceback' not in stderr
    own = [line for line in stderr.splitlines() if not line.startswith('[')]
    assert len(own) == 1 and own[0].startswith('error: '), stderr


def test_sigterm_while_training_is_one_line_and_keeps_the_checkpoint(tmp_path):
    out = tmp_path / 'run'
    proc = subprocess.Popen([PYTHON, '-m', 'mp_symbolic', 'train', '--out', str(out),
                             '--epochs', '100000', '--num-examples', '200', '--devices',
                             'cpu:0,cpu:1', '--no-progress', '--no-memory'], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while Store(str(out)).current() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # until the first checkpoint is committed
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert stderr == ('error: terminated (SIGTERM); the last committed checkpoint in %s is '
                      'kept\n' % out)
    assert Store(str(out)).current() is not None


@pytest.mark.parametrize('delay', [0.0, 0.1])
def test_sigint_while_a_finished_run_exits_is_no_traceback_and_no_silent_death(tmp_path,
                                                                               delay):
    proc = subprocess.Popen([PYTHON, '-m', 'mp_symbolic', 'train', '--out', str(tmp_path / 'r')]
                            + TRAIN, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith('checkpoint:'):  # the run's last line: all is written
            break
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode in (0, 130), (proc.returncode, stderr)  # not killed by SIGINT
    assert 'Traceback' not in stderr and stderr.count('\n') <= 1, stderr
    assert Store(str(tmp_path / 'r')).current() is not None


def _commit_forged(trained, dst, summary_text):
    """A copy of ``trained``'s snapshot with ``summary.json`` replaced, committed
    so that its manifest matches (a forger can do the same)."""
    from mp_symbolic.tools.checkpoint import SUMMARY_NAME  # pylint: disable=import-outside-toplevel
    snap = Store(str(trained)).current()

    def write(folder):
        for name in snap.files:
            if name != SUMMARY_NAME:
                shutil.copy(os.path.join(snap.folder, name), folder)
        with open(os.path.join(folder, SUMMARY_NAME), 'w') as f:
            f.write(summary_text)

    with Store(str(dst), kind='training').locked() as store:
        store.commit(write, snap.meta)


@pytest.mark.parametrize('text, message', [
    ('[' * 100000 + ']' * 100000, 'nested too deeply'),
    ('{"epoch": 2', 'expected a training summary (JSON)'),
    ('[1, 2]', 'expected a JSON object, found list'),
    ('{"epoch_losses": ["x"]}', 'expected "epoch_losses" to be a list of numbers'),
    ('{"config": 5}', 'expected "config" to be an object, found 5'),
], ids=['nested', 'broken', 'list', 'losses', 'config'])
def test_forged_summary_is_one_line_naming_the_file(trained, tmp_path, capsys, text, message):
    forged = tmp_path / 'forged'
    _commit_forged(trained, forged, text)
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    status = main(['train', '--resume', str(forged), '--epochs', '4', '--no-progress',
                   '--devices', 'cpu:0,cpu:1'])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count('\n') == 1 and message in err and 'summary.json' in err, err


def test_deeply_nested_manifest_is_one_line(tmp_path):
    with Store(str(tmp_path / 'out')).locked() as store:
        snap = store.commit(lambda folder: open(os.path.join(folder, 'f'), 'w').close())
    os.chmod(snap.folder, 0o755)
    with open(os.path.join(snap.folder, 'MANIFEST.json'), 'w') as f:
        f.write('{"format": ' + '[' * 100000 + ']' * 100000 + '}')
    with pytest.raises(StoreError, match='nested too deeply'):
        Store(str(tmp_path / 'out')).current()


def _forged_npy(path, shape):
    import numpy as np  # pylint: disable=import-outside-toplevel
    header = np.lib.format.header_data_from_array_1_0(np.ones((3, 2), np.float32))
    header['shape'] = shape
    with open(path, 'wb') as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(np.ones((3, 2), np.float32).tobytes())
    return str(path)


@pytest.mark.parametrize('shape, message', [
    ((10 ** 12, 2), 'expected the 8000000000000 bytes its header claims'),
    ((-3, 2), 'found shape (-3, 2) in its header'),
], ids=['10**12 rows', 'negative'])
def test_npy_header_that_lies_is_refused_before_reading(tmp_path, shape, message):
    from export.errors import InputError  # pylint: disable=import-outside-toplevel
    from export.tables import read_features  # pylint: disable=import-outside-toplevel
    with pytest.raises(InputError) as err:
        read_features(_forged_npy(tmp_path / 'x.npy', shape), 2)
    assert message in str(err.value)
    assert read_features(_forged_npy(tmp_path / 'ok.npy', (3, 2)), 2).shape == (3, 2)


def test_csv_field_over_the_csv_limit_is_one_line(tmp_path):
    from export.errors import InputError  # pylint: disable=import-outside-toplevel
    from export.tables import read_features  # pylint: disable=import-outside-toplevel
    path = tmp_path / 'x.csv'
    path.write_text('1,2\n1,' + '9' * 200000 + '\n')
    with pytest.raises(InputError, match='field larger than field limit .* in line 2 of'):
        read_features(str(path), 2)


def test_hostfile_that_never_ends_is_refused(tmp_path):
    from mp_symbolic.tools.launch import read_hostfile  # pylint: disable=import-outside-toplevel
    with pytest.raises(ValueError, match='^--hostfile: expected a regular file of host names, '
                                         'found /dev/zero, which is a character device$'):
        read_hostfile('/dev/zero')
    big = tmp_path / 'hosts'
    big.write_bytes(b'# ' + b'x' * (1 << 20) + b'\n')
    with pytest.raises(ValueError, match='--hostfile: expected a list of hosts of at most'):
        read_hostfile(str(big))


# -- 6. the smaller ones ------------------------------------------------------------------

def test_empty_resume_names_the_flag(capsys):
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    assert main(['train', '--resume', '']) == 2
    assert capsys.readouterr().err == ('error: --resume: expected a training folder, found an '
                                       'empty string\n')


def test_widths_on_a_resume_of_a_run_without_widths_says_so():
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.config import TrainConfig, resume_config
    saved = TrainConfig(task='digits').to_dict()
    with pytest.raises(ValueError) as err:
        resume_config(saved, {'task_args': {'widths': (2, 2, 2, 1)}})
    assert str(err.value) == ("widths: expected none with resume (the checkpoint's digits task "
                              "does not take it), found (2, 2, 2, 1)")
