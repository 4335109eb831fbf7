"""The store through the commands: a folder of someone else's files is never
taken over (nothing in it is deleted or written), and a run that is still
training can be read: exported, resumed, read_checkpoint'ed, while it commits."""
import os
import threading

import pytest

from mp_symbolic.tools.checkpoint import read_checkpoint
from mp_symbolic.tools.store import WrongFolder, check_store_folder
from conftest import file_tree

TRAIN = ['--epochs', '2', '--num-examples', '200', '--devices', 'cpu:0,cpu:1', '--no-progress',
         '--no-memory']


def train_main(argv, capsys):
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    status = main(['train'] + argv + TRAIN)
    return status, capsys.readouterr().err


def export_main(argv, capsys):
    from export.__main__ import main  # pylint: disable=import-outside-toplevel
    status = main(argv)
    return status, capsys.readouterr().err


def tree(folder):
    return file_tree(folder, folders=True)


def one_error_line(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), stderr
    return lines[0]


@pytest.fixture(scope='module')
def parent(tmp_path_factory):
    """P/run, a training folder, beside the user's own P/snap-backup/."""
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    folder = tmp_path_factory.mktemp('parent')
    assert main(['train', '--out', str(folder / 'run')] + TRAIN) == 0
    (folder / 'snap-backup').mkdir()
    (folder / 'snap-backup' / 'notes.txt').write_text('mine\n')
    return folder


def test_training_into_a_folder_of_the_users_snap_and_staging_entries_is_refused(tmp_path,
                                                                                 capsys):
    home = tmp_path / 'H'
    (home / 'snap-photos').mkdir(parents=True)
    (home / '.staging-work').mkdir()
    (home / 'snap-photos' / 'img.txt').write_text('x\n')
    before = tree(home)
    status, err = train_main(['--out', str(home)], capsys)
    assert status == 2
    line = one_error_line(err)
    assert 'expected an empty folder or a training folder, found a folder of 2 entries' in line
    assert tree(home) == before


def test_an_export_into_the_runs_parent_is_refused_and_the_run_stays_resumable(parent, capsys):
    before = tree(parent)
    status, err = export_main(['--checkpoint', str(parent / 'run'), '--out', str(parent)], capsys)
    assert status == 2
    line = one_error_line(err)
    assert 'expected an empty folder or an export folder, found a folder of 2 entries' in line
    assert tree(parent) == before
    assert read_checkpoint(str(parent / 'run')).epoch == 2


@pytest.mark.parametrize('kind, name', [('training', 'out'), ('export', '--out')])
def test_the_root_and_a_home_folder_are_refused_as_output_folders(tmp_path, kind, name):
    home = tmp_path / 'home'
    home.mkdir()
    (home / '.bashrc').write_text('# mine\n')
    for folder in ('/', str(home)):
        with pytest.raises(WrongFolder, match='expected an empty folder or'):
            check_store_folder(folder, kind, name)
    assert tree(home) == {'.bashrc': b'# mine\n'}


def test_training_and_export_with_out_at_the_root_are_refused_and_write_nothing(parent,
                                                                                 capsys):
    with pytest.raises(WrongFolder):  # first, so that a regression cannot write to /
        check_store_folder('/', 'training', 'out')
    before = sorted(os.listdir('/'))
    for status, err in (train_main(['--out', '/'], capsys),
                        export_main(['--checkpoint', str(parent / 'run'), '--out', '/'], capsys)):
        assert status == 2, err
        assert 'expected an empty folder or' in one_error_line(err)
    assert sorted(os.listdir('/')) == before


def test_training_into_a_run_whose_snapshot_was_moved_and_linked_back_keeps_the_moved_files(
        parent, tmp_path, capsys):
    """train --out OUT after OUT/snap-X was moved elsewhere and linked back:
    the moved snapshot keeps every file (MANIFEST.json too), the link stays."""
    import shutil  # pylint: disable=import-outside-toplevel
    out = tmp_path / 'run'
    shutil.copytree(str(parent / 'run'), str(out), symlinks=True)
    name = os.readlink(str(out / 'current'))
    moved = tmp_path / 'backup' / name
    moved.parent.mkdir()
    os.rename(str(out / name), str(moved))
    os.symlink(str(moved), str(out / name))
    before = tree(moved)
    assert 'MANIFEST.json' in before
    status, err = train_main(['--out', str(out)], capsys)
    assert status == 0, err
    assert tree(moved) == before
    assert os.readlink(str(out / name)) == str(moved)
    assert read_checkpoint(str(out)).epoch == 2


def test_a_training_says_in_one_line_which_older_snapshot_a_reader_holds(parent, tmp_path,
                                                                          capsys):
    import shutil  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    out = tmp_path / 'run'
    shutil.copytree(str(parent / 'run'), str(out), symlinks=True)
    with read_checkpoint(str(out)) as held:  # a reader of the run, while it trains again
        assert main(['train', '--out', str(out)] + TRAIN) == 0
        lines = capsys.readouterr().out.splitlines()
        note = '%s: 1 older snapshot kept beside the new one, held by readers (held by pid %d)' \
            % (out, os.getpid())
        assert sum(l.startswith(note) for l in lines) == 2  # at each of the two commits
        assert os.path.isdir(held.folder)
    assert main(['train', '--out', str(out)] + TRAIN) == 0  # released: the next commits remove it
    assert not os.path.exists(held.folder)
    assert 'older snapshot' not in capsys.readouterr().out


def test_a_dangling_link_as_out_is_called_a_link_before_any_work(parent, tmp_path, capsys):
    dangling = tmp_path / 'out'
    os.symlink(str(tmp_path / 'gone'), str(dangling))
    for main in (train_main, export_main):
        argv = ['--out', str(dangling)] + (['--checkpoint', str(parent / 'run')]
                                           if main is export_main else [])
        status, err = main(argv, capsys)
        assert status == 2
        assert one_error_line(err) == ('error: --out: expected a folder, found a symlink to '
                                       'nothing at %s (-> %s)' % (dangling, tmp_path / 'gone'))
    assert os.readlink(str(dangling)) == str(tmp_path / 'gone')
    assert not (tmp_path / 'gone').exists()


def test_a_fifo_as_the_lock_of_a_run_is_named_not_called_a_folder_of_unknown_kind(
        parent, tmp_path, capsys):
    import shutil  # pylint: disable=import-outside-toplevel
    out = tmp_path / 'run'
    shutil.copytree(str(parent / 'run'), str(out), symlinks=True)
    os.remove(str(out / '.lock'))
    os.mkfifo(str(out / '.lock'))
    before = sorted(os.listdir(str(out)))
    status, err = train_main(['--out', str(out)], capsys)
    assert status == 2
    assert one_error_line(err) == ("error: %s/.lock: expected the folder's lock file (a regular "
                                   'file with one link), found a FIFO' % out)
    assert sorted(os.listdir(str(out))) == before


def test_an_export_out_the_system_cannot_open_is_refused_before_the_work(parent, tmp_path,
                                                                         capsys):
    out = os.path.join(str(tmp_path), *(['d' * 200] * 25))  # 5,000 characters
    status, err = export_main(['--checkpoint', str(parent / 'run'), '--out', out], capsys)
    assert status == 2
    line = one_error_line(err)
    assert line.startswith('error: --out: expected a path this system can open (names of at '
                           'most 255 bytes, 4096 in all), found ') and '...' in line, line
    assert len(line) < 300 and line.endswith('characters): File name too long'), line
    assert capsys.readouterr().out == ''  # nothing exported, verified or written first
    assert os.listdir(str(tmp_path)) == []


# -- a live run ---------------------------------------------------------------------------

def test_exports_of_a_folder_whose_writer_commits_every_few_milliseconds_all_succeed(tmp_path,
                                                                                    parent):
    """A writer thread commits the run's checkpoint anew as fast as it can
    while it is exported, read_checkpoint'ed and resumed (--resume, into
    another folder): every read gets one whole snapshot, though each is
    replaced many times while it is read."""
    import shutil  # pylint: disable=import-outside-toplevel
    from export.exporter import export_checkpoint  # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.store import Store  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    live = str(tmp_path / 'live')
    shutil.copytree(str(parent / 'run'), live, symlinks=True)
    source = read_checkpoint(live)
    names, meta = sorted(source.snapshot.files), dict(source.meta)
    blobs = {}
    for name in names:
        with open(source.snapshot.path(name), 'rb') as f:
            blobs[name] = f.read()
    del source  # released: the writer may remove its snapshot
    done, commits, failed = threading.Event(), [0], []

    def write(folder):
        for name, data in blobs.items():
            with open(os.path.join(folder, name), 'wb') as f:
                f.write(data)

    def writer():
        try:
            with Store(live, kind='training').locked() as store:
                while not done.is_set():
                    store.commit(write, meta)
                    commits[0] += 1
        except Exception as err:  # pylint: disable=broad-except
            failed.append(repr(err))

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for i in range(3):
            before = commits[0]
            export_checkpoint(live, str(tmp_path / ('export%d' % i)), log=lambda line: None)
            read_checkpoint(live).load()
            assert commits[0] > before  # the snapshot was replaced while it was read
        before = commits[0]
        resumed = str(tmp_path / 'resumed')  # --resume from the live folder into another one
        assert main(['train', '--resume', live, '--out', resumed, '--epochs', '3',
                     '--no-progress', '--no-memory', '--devices', 'cpu:0,cpu:1']) == 0
        assert read_checkpoint(resumed).epoch == 3 and commits[0] > before
    finally:
        done.set()
        thread.join()
    assert failed == []
