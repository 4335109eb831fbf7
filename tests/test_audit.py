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

from mp_symbolic.store import FolderInUse, Store, StoreError, WrongFolder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')
PYTHON = sys.executable
TRAIN = ['--epochs', '2', '--num-examples', '200', '--devices', 'cpu:0,cpu:1', '--no-progress',
         '--no-memory']


def run(argv, timeout=120, **kwargs):
    return subprocess.run([PYTHON] + argv, cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout, check=False, **kwargs)


def snapshot_files(folder):
    """Every path under ``folder`` with its bytes (links as their target)."""
    found = {}
    for base, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                found[rel] = 'link:' + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, 'rb') as f:
                    found[rel] = f.read()
    return found


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A training folder of the regression, 2 epochs."""
    out = tmp_path_factory.mktemp('audit') / 'run'
    result = run(['-m', 'mp_symbolic', 'train', '--out', str(out)] + TRAIN)
    assert result.returncode == 0, result.stderr
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
    status, err = export_main(['--checkpoint', str(old), '--out', str(old)], capsys)
    assert (status, err.split(' at ')[0]) == (
        2, 'error: --out: expected an export folder (or a new one), found a training folder')
    assert snapshot_files(old) == before


def test_training_refuses_an_export_folder(tmp_path):
    export_dir = tmp_path / 'exported'
    with Store(str(export_dir)).locked() as store:  # told by its manifest, as exports were
        store.commit(lambda folder: open(os.path.join(folder, 'm.onnx'), 'w').close(),
                     {'kind': 'export'})
    before = snapshot_files(export_dir)
    result = run(['-m', 'mp_symbolic', 'train', '--out', str(export_dir)] + TRAIN)
    assert result.returncode == 2
    assert result.stderr == ('error: --out: expected a training folder (or a new one), found '
                             'an export folder at %s; choose another folder\n' % export_dir)
    assert snapshot_files(export_dir) == before


def test_store_of_one_kind_refuses_the_other_and_nesting(tmp_path):
    with Store(str(tmp_path / 'a'), kind='training').locked():
        pass
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
    assert sorted(os.listdir(out)) == ['.kind', '.lock']


def test_params_that_cannot_be_written_raise_one_line():
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mp_symbolic.checkpoint import save_params  # pylint: disable=import-outside-toplevel
    with pytest.raises(OSError, match='/dev/full: cannot write the parameters') as err:
        save_params('/dev/full', {'w': mx.nd.ones((64, 64))})
    assert '\n' not in str(err.value)


# -- 4. a worker that fails alone ends the job, without ps-lite's barrier -----------------

def test_worker_0_failing_alone_ends_the_job_in_seconds(tmp_path):
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
        start = time.monotonic()
        job = run(['-m', 'mp_symbolic', 'launch', '--workers', '2', '--servers', '1', '--',
                   'train', '--out', str(out)] + TRAIN, timeout=90)
        elapsed = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    assert job.returncode == 1, job.stdout[-2000:] + job.stderr[-2000:]
    assert ('is in use by another process; expected one writer per folder' in job.stderr
            or 'is in use by another process (pid' in job.stderr)
    last = job.stderr.strip().splitlines()[-1]
    assert last.startswith('error: worker ') and 'exited with status 2; stopped the other' \
        in last, last
    assert elapsed < 60  # the processes start in about 10 s on two busy cores
