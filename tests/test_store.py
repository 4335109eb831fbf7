"""The store's promises under real faults: a process killed after each
file-system call of a save, a full disk at each write, a second writer, a
tampered folder. After each, the folder must hold one whole snapshot, the old
or the new one, and the next writer must be able to go on."""
import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from mp_symbolic.tools.files import atomic_write_bytes
from mp_symbolic.tools.store import MANIFEST, FolderInUse, Store, StoreError

from tests.killpoints import killed_points

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A = {'params': 'A-params ' * 50, 'symbol.json': '{"A": 1}', 'summary.json': '{"epoch": 1}'}
B = {'params': 'B-params ' * 60, 'symbol.json': '{"B": 2}', 'summary.json': '{"epoch": 2}',
     'log.txt': 'B only'}
C = {'params': 'C', 'summary.json': '{"epoch": 3}'}


def writer(files):
    """A write() for Store.commit that writes through os.open/os.write/os.close,
    the calls the fault injections below count and break."""
    def write(folder):
        for name, text in files.items():
            fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                data = text.encode()
                while data:
                    data = data[os.write(fd, data):]
            finally:
                os.close(fd)
    return write


def commit(folder, files, name):
    with Store(folder).locked() as store:
        return store.commit(writer(files), {'name': name})


def contents(snapshot):
    out = {}
    for name in snapshot.files:
        with open(snapshot.path(name)) as f:
            out[name] = f.read()
    return out


def assert_only_one_snapshot(folder):
    names = sorted(os.listdir(folder))
    assert len(names) == 3 and names[:2] == ['.lock', 'current'] \
        and names[2].startswith('snap-'), names


def child_env():
    return dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')


def test_commit_then_current_returns_verified_files_and_replaces_the_old_snapshot(tmp_path):
    out = str(tmp_path / 'out')
    store = Store(out)
    assert store.current() is None and not store.has_snapshot()

    first = commit(out, A, 'A')
    got = Store(out).current()
    assert got.folder == first.folder and contents(got) == A and got.meta == {'name': 'A'}
    with open(os.path.join(got.folder, MANIFEST)) as f:
        manifest = json.load(f)
    for name, text in A.items():
        assert manifest['files'][name] == got.files[name] == {
            'sha256': hashlib.sha256(text.encode()).hexdigest(), 'bytes': len(text)}
    assert manifest['format'] == 'mp_symbolic.store/1' and manifest['meta'] == {'name': 'A'}
    assert store.has_snapshot()

    second = commit(out, B, 'B')
    assert contents(Store(out).current()) == B
    assert not os.path.exists(first.folder)
    assert os.readlink(os.path.join(out, 'current')) == os.path.basename(second.folder)
    assert_only_one_snapshot(out)
    with pytest.raises(StoreError, match='expected a file named .nope. in the manifest'):
        second.path('nope')


# A child that, for k = 1, 2, ..., commits A into a fresh folder, then forks a
# process that starts committing B and SIGKILLs itself right after its k-th
# file-system call, until a k where the save ends first.
KILL_CHILD = r"""
import json, os, sys
from mp_symbolic.tools.store import Store
from tests.killpoints import arm, kill_each, one
base, A, B = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])

def writer(files):  # as in the test module: os.open/os.write/os.close, all counted
    def write(folder):
        for name, text in files.items():
            fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, text.encode())
            os.close(fd)
    return write

def attempt(k, folder):
    with Store(folder).locked() as store:
        store.commit(writer(A), {'name': 'A'})
    def save():
        arm(k, makedirs=True)
        with Store(folder).locked() as store:
            store.commit(writer(B), {'name': 'B'})
    return one(save)

kill_each(base, attempt)
"""


def test_a_kill_after_any_file_system_call_of_a_save_leaves_the_old_or_the_new_snapshot(
        tmp_path):
    base = str(tmp_path)
    killed = killed_points(KILL_CHILD, [base, json.dumps(A), json.dumps(B)], timeout=120)
    # A save is ~30 counted calls (mkdir, writes, fsyncs, renames, the old snapshot's removal).
    assert len(killed) >= 20, killed
    seen = {'A': 0, 'B': 0}
    leftovers = 0
    for k in killed:
        folder = os.path.join(base, 'k%03d' % k)
        snapshot = Store(folder).current()  # readers need no lock and no cleanup
        name = snapshot.meta['name']
        assert contents(snapshot) == {'A': A, 'B': B}[name], 'k=%d: a mix of A and B' % k
        seen[name] += 1
        leftovers += len(os.listdir(folder)) > 3
        commit(folder, C, 'C')
        assert contents(Store(folder).current()) == C, 'k=%d' % k
        assert_only_one_snapshot(folder)
    # Kills landed on both sides of the switch, and some left debris to clean.
    assert seen['A'] > 0 and seen['B'] > 0 and leftovers > 0, (seen, leftovers)


# Two node processes, forked for k = 1, 2, ...: node 0 holds the store and
# commits B across both (each writes, fsyncs and hashes its part, node 0
# writes its own file beside them and seals, reading no other part); node R
# SIGKILLs itself right after its k-th file-system call, until a k where the
# commit ends first. The nodes talk through tests.killpoints.Pipes.
ACROSS_CHILD = r"""
import json, os, sys
from mp_symbolic.tools.store import Store, commit_across
from tests.killpoints import arm, kill_each, two
base, A, B, R = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])

def part(files, rank):
    def write(folder):
        names = [name for name in files if name.endswith('.part%d' % rank)]
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, files[name].encode())
            os.close(fd)
        return names
    return write

def finish(folder):  # node 0's own file beside the parts
    fd = os.open(os.path.join(folder, 'rest'), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, B['rest'].encode())
    os.close(fd)

def attempt(k, folder):
    with Store(folder).locked() as store:
        store.commit(lambda f: open(os.path.join(f, 'params'), 'w').write(A['params']),
                     {'name': 'A'})
    def node(rank, group):
        if rank == R:
            arm(k, makedirs=True)
        if rank == 0:
            with Store(folder).locked() as store:
                commit_across(store, group, part(B, 0), finish, {'name': 'B'})
        else:
            commit_across(None, group, part(B, 1), finish)
    return two(node)

kill_each(base, attempt, victim=R)
"""


@pytest.mark.parametrize('killed_node', [0, 1])
def test_a_node_killed_after_any_file_operation_of_a_commit_across_nodes_leaves_a_whole_snapshot(
        tmp_path, killed_node):
    A_ = {'params': 'A' * 300}
    B_ = {'params.part0': 'B0' * 100, 'params.part1': 'B1' * 120, 'rest': 'B'}
    killed = killed_points(ACROSS_CHILD, [tmp_path, json.dumps(A_), json.dumps(B_), killed_node],
                           timeout=300)
    # node 0 commits (~30 counted calls); node 1 writes its part (open, write, close) and
    # fsyncs it
    assert len(killed) >= (20 if killed_node == 0 else 2), killed
    seen = {'A': 0, 'B': 0}
    for k in killed:
        folder = str(tmp_path / ('k%03d' % k))
        snapshot = Store(folder).current()
        name = snapshot.meta['name']
        assert contents(snapshot) == ({'params': A_['params']} if name == 'A' else B_), \
            'k=%d: a mix of A and B' % k
        seen[name] += 1
        commit(folder, C, 'C')  # the next writer cleans what the kill left
        assert_only_one_snapshot(folder)
    # a kill of node 1 always comes before the switch: the old snapshot stays
    assert seen['A'] > 0 and (seen['B'] > 0 or killed_node == 1), seen


@pytest.mark.parametrize('call', ['write', 'fsync'])
def test_a_full_disk_at_any_write_keeps_the_previous_snapshot(tmp_path, monkeypatch, call):
    out = str(tmp_path / 'out')
    commit(out, A, 'A')
    real = getattr(os, call)
    failures = 0
    for n in range(1, 1000):
        count = [0]

        def full_disk(*args, _n=n, _count=count):
            _count[0] += 1
            if _count[0] == _n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(*args)

        monkeypatch.setattr(os, call, full_disk)
        try:
            commit(out, B, 'B')
        except OSError as e:
            monkeypatch.setattr(os, call, real)
            assert e.errno == errno.ENOSPC
            failures += 1
            assert contents(Store(out).current()) == A, 'ENOSPC at %s call %d' % (call, n)
            assert_only_one_snapshot(out)
            continue
        monkeypatch.setattr(os, call, real)
        break
    assert contents(Store(out).current()) == B
    # write: 4 files + the manifest; fsync: 4 files, the manifest, staging and out (twice).
    assert failures >= 5, failures


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs, or a skip where this process may not mount one."""
    mnt = str(tmp_path / 'mnt')
    os.mkdir(mnt)
    if os.geteuid() != 0 or not shutil.which('mount'):
        pytest.skip('mounting a small tmpfs needs root and mount(8)')
    proc = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=256k', 'tmpfs', mnt],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip('cannot mount a tmpfs here: %s' % (proc.stderr.strip().splitlines()
                                                        or ['mount failed'])[0])
    try:
        yield mnt
    finally:
        subprocess.run(['umount', mnt], check=True)


def test_a_really_full_disk_keeps_the_previous_snapshot(small_tmpfs):
    out = os.path.join(small_tmpfs, 'out')
    big = {'params': 'a' * 100_000, 'summary.json': '{}'}
    commit(out, big, 'A')
    with pytest.raises(OSError) as e:
        commit(out, {'params': 'b' * 200_000, 'summary.json': '{}'}, 'B')
    assert e.value.errno == errno.ENOSPC
    assert contents(Store(out).current()) == big
    assert_only_one_snapshot(out)
    # The failed save gave its space back: a save that fits beside A succeeds.
    smaller = {'params': 'c' * 90_000, 'summary.json': '{}'}
    commit(out, smaller, 'C')
    assert contents(Store(out).current()) == smaller


HOLDER = r'''
import sys, time
from mp_symbolic.tools.store import Store
with Store(sys.argv[1]).locked():
    print('locked', flush=True)
    time.sleep(120)
'''


def test_a_second_writer_is_refused_at_once_and_a_killed_writer_never_blocks(tmp_path):
    out = str(tmp_path / 'out')
    holder = subprocess.Popen([sys.executable, '-c', HOLDER, out], env=child_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == 'locked\n'
        outcome = []

        def try_lock():
            try:
                with Store(out).locked():
                    outcome.append('locked')
            except FolderInUse as e:
                outcome.append(e)

        thread = threading.Thread(target=try_lock, daemon=True)
        thread.start()
        thread.join(timeout=2)  # a bound on waiting for the lock, not a timing figure
        assert not thread.is_alive(), 'locked() waited for the other writer instead of refusing'
        (error,) = outcome
        assert str(error) == ('%s is in use by another process (pid %d); expected one writer '
                              'per folder' % (os.path.abspath(out), holder.pid))
    finally:
        holder.kill()  # SIGKILL: the holder never releases the lock itself
        holder.wait()
    with Store(out).locked() as store:
        store.commit(writer(C))
    assert contents(Store(out).current()) == C


def _replace_link(out, target):
    tmp = os.path.join(out, 'tmp-link')
    os.symlink(target, tmp)
    os.replace(tmp, os.path.join(out, 'current'))


def _edit_manifest(snap, edit):
    path = os.path.join(snap.folder, MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(path, 'w') as f:
        json.dump(manifest, f)


def _write(path, data):
    with open(path, 'wb') as f:
        f.write(data)


def _flip_a_bit(path):
    with open(path, 'rb') as f:
        data = bytearray(f.read())
    data[3] ^= 0x01
    _write(path, bytes(data))


# Each case damages a committed folder and returns what the message must hold:
# the path it names, the expected value and the found value.
TAMPERING = {
    'link to an absolute path': lambda out, snap: (
        _replace_link(out, snap.folder),
        ('current', 'snap-<token>', repr(snap.folder)))[1],
    'link out of the folder': lambda out, snap: (
        os.mkdir(os.path.join(os.path.dirname(out), 'other')),
        _replace_link(out, '../other'),
        ('current', 'snap-<token>', "'../other'"))[2],
    'link to a missing folder': lambda out, snap: (
        _replace_link(out, 'snap-gone'),
        ('current', 'snap-gone', 'nothing'))[1],
    'current not a link': lambda out, snap: (
        os.remove(os.path.join(out, 'current')),
        _write(os.path.join(out, 'current'), b'snap-x'),
        ('current', 'a symlink', 'a file'))[2],
    'manifest missing': lambda out, snap: (
        os.remove(os.path.join(snap.folder, MANIFEST)),
        (MANIFEST, 'the snapshot manifest', 'nothing'))[1],
    'manifest not JSON': lambda out, snap: (
        _write(os.path.join(snap.folder, MANIFEST), b'{"format": '),
        (MANIFEST, 'JSON', 'Expecting value'))[1],
    'manifest of another format': lambda out, snap: (
        _edit_manifest(snap, lambda m: m.update(format='other/9')),
        (MANIFEST, "'mp_symbolic.store/1'", "'other/9'"))[1],
    'manifest naming ../x': lambda out, snap: (
        _edit_manifest(snap, lambda m: m['files'].update({'../x': m['files']['params']})),
        (MANIFEST, 'plain file names', "'../x'"))[1],
    'manifest naming an absolute path': lambda out, snap: (
        _edit_manifest(snap, lambda m: m['files'].update({'/etc/hostname': m['files']['params']})),
        (MANIFEST, 'plain file names', "'/etc/hostname'"))[1],
    'a named file missing': lambda out, snap: (
        os.remove(snap.path('symbol.json')),
        ('symbol.json', 'a file of %d bytes' % len(A['symbol.json']), 'nothing'))[1],
    'a bit flipped': lambda out, snap: (
        _flip_a_bit(snap.path('params')),
        ('params', 'sha256 ' + snap.files['params']['sha256'], ''))[1],
    'a file grown by one byte': lambda out, snap: (
        _write(snap.path('summary.json'), A['summary.json'].encode() + b' '),
        ('summary.json', '%d bytes' % len(A['summary.json']),
         '%d bytes' % (len(A['summary.json']) + 1)))[1],
}


@pytest.mark.parametrize('case', sorted(TAMPERING))
def test_a_tampered_folder_raises_one_line_naming_the_file_and_the_values(tmp_path, case):
    out = str(tmp_path / 'out')
    snap = commit(out, A, 'A')
    named, expected, found = TAMPERING[case](out, snap)
    with pytest.raises(StoreError) as e:
        Store(out).current()
    message = str(e.value)
    assert '\n' not in message
    head, _, tail = message.partition(': expected ')
    expected_part, _, found_part = tail.partition(', found ')
    assert head.startswith(out) and head.endswith(named), message
    assert expected in expected_part and found in found_part, message
    if case == 'a bit flipped':
        assert re.fullmatch('[0-9a-f]{64}', found_part) and found_part not in expected_part, \
            message


def test_leftovers_the_records_name_are_removed_by_the_next_writer(tmp_path):
    out = str(tmp_path / 'out')
    snap = commit(out, A, 'A')
    with Store(out).locked() as store:  # what a writer killed mid-save leaves, recorded first
        for token in ('0123456789abcdef', 'fedcba9876543210'):
            store._record(token)  # pylint: disable=protected-access
        os.mkdir(os.path.join(out, '.staging-0123456789abcdef'))
        _write(os.path.join(out, '.staging-0123456789abcdef', 'params'), b'half')
        os.symlink('snap-fedcba9876543210', os.path.join(out, '.current-fedcba9876543210'))
        os.mkdir(os.path.join(out, 'snap-fedcba9876543210'))
        _write(os.path.join(out, 'snap-fedcba9876543210', 'params'), b'never committed')
    assert contents(Store(out).current()) == A  # readers ignore leftovers
    with Store(out).locked():
        assert_only_one_snapshot(out)
    assert Store(out).current().folder == snap.folder and contents(Store(out).current()) == A


def test_snap_and_staging_entries_of_someone_else_survive_commits(tmp_path):
    """Cleaning removes only what the store's records name: a user's folder
    called snap-*, .staging-* or .current-* inside a store is never deleted."""
    out = str(tmp_path / 'out')
    commit(out, A, 'A')
    theirs = {'snap-photos': b'img', '.staging-work': b'draft', 'snap-0123456789abcdef': b'x',
              '.current-mine': None}
    for name, data in theirs.items():
        if data is None:
            os.symlink('snap-photos', os.path.join(out, name))
        else:
            os.mkdir(os.path.join(out, name))
            _write(os.path.join(out, name, 'f.txt'), data)
    for files, name in ((B, 'B'), (C, 'C'), (A, 'A')):
        commit(out, files, name)
    assert contents(Store(out).current()) == A
    for name, data in theirs.items():
        if data is None:
            assert os.readlink(os.path.join(out, name)) == 'snap-photos'
        else:
            with open(os.path.join(out, name, 'f.txt'), 'rb') as f:
                assert f.read() == data, name
    ours = [n for n in os.listdir(out) if n not in theirs]
    assert sorted(ours)[:2] == ['.lock', 'current'] and len(ours) == 3, ours


def _tree_bytes(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), 'rb') as f:
            out[name] = f.read()
    return out


def test_a_snapshot_moved_elsewhere_and_linked_back_is_never_deleted_through_the_link(tmp_path):
    """A user moves OUT/snap-X away and links it back: the next commits
    neither delete through the link (its MANIFEST.json included) nor remove
    the link, and the store forgets it (the link is not the store's)."""
    out = str(tmp_path / 'out')
    moved = commit(out, A, 'A')
    name = os.path.basename(moved.folder)
    kept = str(tmp_path / 'elsewhere' / name)
    os.mkdir(os.path.dirname(kept))
    os.rename(moved.folder, kept)
    os.symlink(kept, os.path.join(out, name))
    before = _tree_bytes(kept)
    assert MANIFEST in before
    for files, label in ((B, 'B'), (C, 'C')):
        commit(out, files, label)
    assert _tree_bytes(kept) == before
    assert os.readlink(os.path.join(out, name)) == kept
    with open(os.path.join(out, '.lock'), 'rb') as f:
        assert name[len('snap-'):].encode() not in f.read()  # forgotten: never looked at again
    assert contents(Store(out).current()) == C


def test_links_and_folders_at_recorded_names_are_left_alone(tmp_path):
    """At every name a record gives (.staging-T, snap-T, .current-T), what
    is not the kind of entry the store makes there is left: a link to the
    user's folder (nothing at its target is deleted) or a folder where the
    store makes a link."""
    out = str(tmp_path / 'out')
    commit(out, A, 'A')
    mine = tmp_path / 'mine'
    mine.mkdir()
    (mine / MANIFEST).write_text('{}')
    (mine / 'f.txt').write_text('mine')
    token = '0123456789abcdef'
    with Store(out).locked() as store:
        store._record(token)  # pylint: disable=protected-access
    for prefix in ('.staging-', 'snap-'):
        os.symlink(str(mine), os.path.join(out, prefix + token))
    os.mkdir(os.path.join(out, '.current-' + token))
    _write(os.path.join(out, '.current-' + token, 'g.txt'), b'mine too')
    commit(out, B, 'B')
    with Store(out).locked():
        pass
    assert _tree_bytes(str(mine)) == {MANIFEST: b'{}', 'f.txt': b'mine'}
    for prefix in ('.staging-', 'snap-'):
        assert os.readlink(os.path.join(out, prefix + token)) == str(mine)
    assert _tree_bytes(os.path.join(out, '.current-' + token)) == {'g.txt': b'mine too'}
    assert contents(Store(out).current()) == B


def test_a_store_written_before_records_is_accepted_and_its_old_snapshot_replaced(tmp_path):
    """A folder of the writer without records (.kind, .lock with only a pid,
    current -> snap-*) is taken as a store; its snapshot goes once replaced,
    and the leftovers it cannot tell as its own stay."""
    out = str(tmp_path / 'out')
    old = commit(out, A, 'A')
    with open(os.path.join(out, '.lock'), 'r+b') as f:  # as the writer without records left it
        f.truncate(20)
    os.mkdir(os.path.join(out, '.staging-0000000000000000'))  # its leftover: not provably its own
    new = commit(out, B, 'B')
    assert contents(Store(out).current()) == B
    assert not os.path.exists(old.folder) and os.path.isdir(new.folder)
    assert os.path.isdir(os.path.join(out, '.staging-0000000000000000'))


def test_leftovers_are_kept_when_current_is_damaged(tmp_path):
    out = str(tmp_path / 'out')
    snap = commit(out, A, 'A')
    _replace_link(out, 'snap-gone')
    with Store(out).locked():
        pass
    assert os.path.isdir(snap.folder)  # the only good snapshot is not an orphan to delete


def test_a_failing_write_or_bad_files_leave_the_previous_snapshot(tmp_path):
    out = str(tmp_path / 'out')
    commit(out, A, 'A')

    def crashing(folder):
        writer(B)(folder)
        raise RuntimeError('crashed after writing')

    def with_subfolder(folder):
        os.mkdir(os.path.join(folder, 'sub'))

    with Store(out).locked() as store:
        with pytest.raises(RuntimeError, match='crashed after writing'):
            store.commit(crashing)
        with pytest.raises(StoreError, match='expected write.. to leave plain files only, '
                                             'found a folder'):
            store.commit(with_subfolder)
        with pytest.raises(StoreError, match='expected write.. to leave MANIFEST.json'):
            store.commit(writer({MANIFEST: '{}'}))
        with pytest.raises(StoreError, match='meta: expected a JSON-able dict'):
            store.commit(writer(B), meta={'x': object()})
    assert contents(Store(out).current()) == A
    assert_only_one_snapshot(out)


def test_commit_outside_locked_nested_locked_and_a_file_as_folder_raise(tmp_path):
    store = Store(str(tmp_path / 'out'))
    with pytest.raises(StoreError, match='expected commit.. inside Store.locked'):
        store.commit(writer(A))
    with store.locked():
        with pytest.raises(StoreError, match='expected one locked.. at a time per Store'):
            with store.locked():
                pass
        store.commit(writer(A))
    _write(str(tmp_path / 'file'), b'')
    with pytest.raises(StoreError, match='expected a folder, found a file'):
        with Store(str(tmp_path / 'file')).locked():
            pass


def test_atomic_write_bytes_replaces_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = str(tmp_path / 'x.json')
    atomic_write_bytes(path, b'old')
    real = os.write
    monkeypatch.setattr(os, 'write', lambda *a: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, 'No space left on device')))
    with pytest.raises(OSError):
        atomic_write_bytes(path, b'new')
    monkeypatch.setattr(os, 'write', real)
    with open(path, 'rb') as f:
        assert f.read() == b'old'
    assert os.listdir(str(tmp_path)) == ['x.json']
    atomic_write_bytes(path, b'new')
    with open(path, 'rb') as f:
        assert f.read() == b'new'


def test_a_reader_holds_its_snapshot_whole_while_a_writer_commits(tmp_path, monkeypatch):
    import mp_symbolic.tools.store as store_module
    out = str(tmp_path / 'out')
    commit(out, A, 'A')
    real = store_module.sha256_file
    raced = []

    def hash_while_a_writer_commits(path):
        if not raced:  # mid-read, another writer replaces A by B and would delete A's files
            raced.append(commit(out, B, 'B'))
        return real(path)

    monkeypatch.setattr(store_module, 'sha256_file', hash_while_a_writer_commits)
    with Store(out).current(hold=True) as snapshot:
        assert raced and contents(Store(out).current()) == B
        commit(out, C, 'C')  # still held: A stays, whole, beside the newer snapshots
        assert snapshot.meta == {'name': 'A'} and contents(snapshot) == A
    commit(out, B, 'B')  # released: the next commit removes A and C
    assert not os.path.exists(snapshot.folder)
    assert_only_one_snapshot(out)


def test_a_reader_holding_every_snapshot_keeps_at_most_max_held_and_each_commit_says_so(
        tmp_path):
    """A reader that holds each snapshot it sees: every commit says in one
    line which older ones stay; with MAX_HELD held, a commit is refused
    before it writes anything (it deletes none of them), and once the reader
    lets go the next commit removes them all."""
    from mp_symbolic.tools.store import MAX_HELD  # pylint: disable=import-outside-toplevel
    out = str(tmp_path / 'out')
    commit(out, A, 'A')
    holds, notes = [], []
    for n in range(MAX_HELD):
        holds.append(Store(out).current(hold=True))
        snapshot = commit(out, {'n': str(n)}, str(n))
        assert len(snapshot.held) == n + 1
        notes.append(snapshot.held_note())
    assert notes[0] == ('%s: 1 older snapshot kept beside the new one, held by readers (held by '
                        'pid %d); a commit never deletes a snapshot a reader holds, and is '
                        'refused while %d are held' % (out, os.getpid(), MAX_HELD))
    assert notes[-1].startswith('%s: %d older snapshots kept' % (out, MAX_HELD))
    holds.append(Store(out).current(hold=True))
    before = sorted(os.listdir(out))
    with pytest.raises(StoreError) as e:
        commit(out, B, 'B')
    assert str(e.value) == (
        '%s: expected at most %d older snapshots held by readers, found %d (held by pid %d); a '
        'commit never deletes a snapshot a reader holds, so nothing was committed and current '
        'is kept' % (out, MAX_HELD, MAX_HELD, os.getpid()))
    assert sorted(os.listdir(out)) == before  # nothing written, nothing deleted
    assert len([n for n in before if n.startswith('snap-')]) == MAX_HELD + 1
    for hold in holds:
        assert contents(hold)  # every held snapshot is whole
        hold.close()
    assert commit(out, C, 'C').held == () and commit(out, C, 'C').held_note() is None
    assert_only_one_snapshot(out)


def test_readers_of_a_folder_committing_every_few_milliseconds_always_read_one_whole_snapshot(
        tmp_path):
    """A writer thread commits as fast as it can; readers in other threads
    hold current, read every file after a pause and find the snapshot the
    manifest describes, never a missing file, also when the writer switched
    away from it meanwhile."""
    out = str(tmp_path / 'out')
    commit(out, {'n': '0', 'params': '0' * 5000}, '0')
    done, commits, errors, overtaken = threading.Event(), [0], [], [0]

    def write():
        with Store(out).locked() as store:
            while commits[0] < 40:
                n = commits[0] + 1
                store.commit(writer({'n': str(n), 'params': str(n % 10) * 5000}), {'name': str(n)})
                commits[0] = n
        done.set()

    def read():
        try:
            while not done.is_set():
                with Store(out).current(hold=True) as snapshot:
                    n = snapshot.meta['name']
                    time.sleep(0.003)  # the writer commits meanwhile
                    assert contents(snapshot) == {'n': n, 'params': str(int(n) % 10) * 5000}, n
                    overtaken[0] += os.readlink(os.path.join(out, 'current')) != \
                        os.path.basename(snapshot.folder)
        except Exception as err:  # pylint: disable=broad-except
            errors.append(repr(err))

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and commits[0] == 40, (errors[:3], commits)
    assert overtaken[0] > 0  # some reads held a snapshot the writer had switched away from
    commit(out, A, 'A')
    assert_only_one_snapshot(out)  # every snapshot a reader held goes with a later commit


def test_a_fifo_or_a_folder_as_the_manifest_is_one_line_without_blocking(tmp_path):
    """Opening a FIFO for reading waits for a writer; the store must not."""
    for kind in ('fifo', 'folder'):
        out = str(tmp_path / kind)
        snap = commit(out, A, 'A')
        os.remove(os.path.join(snap.folder, MANIFEST))
        (os.mkfifo if kind == 'fifo' else os.mkdir)(os.path.join(snap.folder, MANIFEST))
        raised = []

        def read(folder=out):
            try:
                Store(folder).current()
            except StoreError as err:
                raised.append(str(err))

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), 'current() blocked on a %s manifest' % kind
        assert raised == ['%s: expected a manifest (a regular file), found a %s' % (
            os.path.join(snap.folder, MANIFEST), 'FIFO' if kind == 'fifo' else 'folder')]
