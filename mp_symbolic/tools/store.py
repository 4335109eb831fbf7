"""A folder of outputs that is always one whole snapshot, written by one process at a time.

A training checkpoint or an export is several files that only make sense
together. Renamed into place one by one, they become a mix of old and new
files when the process is killed between two renames; two runs writing to the
same folder delete each other's files; a full disk in the middle of a save
must not cost the old files. This module keeps such a folder as::

    OUT/
      .lock                advisory lock (fcntl.flock); holds the writer's pid, for messages,
                           then the tokens T of the entries the store made (its records)
      .kind                what the folder holds: 'training' or 'export' (one line)
      current -> snap-T    relative symlink: the commit record, switched atomically
      snap-T/              the committed snapshot: the caller's files + MANIFEST.json
      .staging-T/          a save in progress (renamed to snap-T, or removed)

A save writes a new snapshot beside the current one, fsyncs it, records every
file's size and sha256 in ``MANIFEST.json`` (written last), renames it into
place and then replaces ``current`` with one ``rename(2)``, as Git updates a
ref (write a lock file, rename it onto the ref). Whenever the
writer dies, ``current`` names either the old or the new snapshot, and both
are complete; what the dead writer left beside it is removed by the next
writer. Readers verify every file against the manifest and use only the files
it names, holding the snapshot against removal while they read (a shared
``flock`` on its ``MANIFEST.json``, which a writer's cleanup respects).

A store never deletes what it did not write. A writer records a save's token
in ``.lock`` (written and fsynced) before it creates ``.staging-T``, so every
entry it may leave behind is named by its records; cleaning removes only
those, and ``snap-*`` or ``.staging-*`` entries of anyone else stay. A folder
is taken as a store's only when it is absent, empty, or already a store (its
``.lock`` plus a ``.kind``, a committed ``current`` or records); any other
folder (``/``, a home folder, one holding a run) is refused before anything
is written.

A folder says what it holds (``.kind``, written with a writer's first
commit): a training run refuses an export folder and an export refuses
a training folder, since each would replace the other's snapshot. No store is
made inside another store or a snapshot, where the enclosing store's next
writer would delete it. The lock file is opened without following a symlink
and never truncated, so a link planted at ``OUT/.lock`` cannot make a writer
truncate or create another file.

Only the standard library is used, so the export side and tools can read
training outputs without MXNet.
"""
import contextlib
import fcntl
import json
import os
import re
import shutil
import stat
import time
import uuid

from . import files
from .files import atomic_write_bytes, fsync_path, sha256_file

__all__ = []

MANIFEST = 'MANIFEST.json'
FORMAT = 'mp_symbolic.store/1'  # the manifest's 'format'; bump when its fields change
LOCK = '.lock'
KIND = '.kind'
KINDS = ('training', 'export')  # what a store folder may hold
MAX_MANIFEST_BYTES = 64 << 20  # a manifest names a few files; more is not one of ours
CURRENT = 'current'
SNAP_PREFIX = 'snap-'
STAGING_PREFIX = '.staging-'
LINK_PREFIX = '.current-'
# The records in .lock: after the pid's 20 bytes, one 17-byte slot per token,
# b'<16 hex digits>\n' or blanked with b'-'; read at most this many bytes.
PID_BYTES = 20
SLOT = 17
MAX_RECORD_BYTES = SLOT << 16
# Snapshots beside `current` that readers may hold: each is a whole checkpoint or export
# on disk, so a reader holding every one it sees would fill the disk. A commit that
# would leave more is refused (it deletes none of them); readers hold one at a time.
MAX_HELD = 8
MAX_LOCKS_BYTES = 4 << 20  # /proc/locks: a line per lock on the machine
_TOKEN_RE = re.compile(rb'[0-9a-f]{16}\n')
_BLANK = b'-' * (SLOT - 1) + b'\n'


class StoreError(ValueError):
    """A store folder that is not as expected; the message is one line saying
    what was expected and what was found."""


class FolderInUse(StoreError):
    """Another live process holds the folder's writer lock."""


class WrongFolder(StoreError):
    """A folder that holds another kind of output, or lies inside a store."""


def _write_new_file(path, data):
    """Creates ``path`` (which must not exist), writes ``data`` and fsyncs it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_folder(path):
    """Removes a folder tree the store made (a staging or snapshot folder); a
    missing path, or one that is not a folder of its own (a symlink to one,
    a file), is left alone: a link is never followed for a deletion."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return
    except OSError:
        return
    shutil.rmtree(path, ignore_errors=True)  # refuses a link swapped in meanwhile


def _remove_link(path):
    """Removes a temporary symlink the store made (``.current-T``); anything
    else at ``path`` is left alone."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


def _is_folder(path):
    """Whether ``path`` is a folder itself, not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _kind(path):
    """What is at ``path``, for messages: 'a file', 'a folder', 'a symlink', ..."""
    return files.what_is(path)


def _is_plain_name(name):
    return (isinstance(name, str) and name not in ('', '.', '..')
            and '/' not in name and '\0' not in name)


def _hash_and_fsync(path):
    """Returns (sha256 hex, size) of the file at ``path`` after fsyncing it."""
    fsync_path(path)
    return files.sha256_file(path), os.path.getsize(path)  # the writer's own, not the reader's


def read_bounded(path, limit, what='file'):
    """The bytes of the regular file at ``path``, refusing one over ``limit`` bytes.

    A forged file of many gigabytes is refused after ``limit + 1`` bytes
    instead of filling memory; one that is not a regular file (a FIFO, which
    would block until some process writes to it, ``/dev/zero``, a folder) is
    refused without reading.

    Raises:
        StoreError: The file holds more than ``limit`` bytes, or is not a
            regular file.
        OSError: It cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO: no wait to open
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise StoreError('%s: expected a %s (a regular file), found %s'
                         % (path, what, _kind(path)))
    with open(fd, 'rb') as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise StoreError('%s: expected a %s of at most %d bytes, found more'
                         % (path, what, limit))
    return data


def _parse_records(data):
    """``[(slot, token)]`` of the valid slots in the bytes after the pid."""
    return [(i, data[i * SLOT:i * SLOT + SLOT - 1].decode('ascii'))
            for i in range(len(data) // SLOT)
            if _TOKEN_RE.fullmatch(data[i * SLOT:(i + 1) * SLOT])]


def _read_records(folder):
    """The tokens a store's ``.lock`` records, ``[]`` for none (or no lock file)."""
    try:
        fd = os.open(os.path.join(folder, LOCK),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        return _parse_records(os.pread(fd, MAX_RECORD_BYTES, PID_BYTES))
    finally:
        os.close(fd)


def _remove_snapshot(path):
    """Removes a snapshot folder unless a reader holds it (a shared ``flock``
    on its manifest); returns whether a reader holds it (it stays).

    The manifest is unlinked first, under an exclusive ``flock``: a reader
    that opened it meanwhile finds it unlinked once it gets its shared lock,
    and goes back to ``current``. The folder is opened without following a
    symlink and the manifest is unlinked through that descriptor: a
    ``snap-T`` that is a link (a snapshot moved elsewhere and linked back) is
    not the store's, and nothing at its target is touched.
    """
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # gone, a symlink or not a folder: not ours to remove
    fd = None
    try:
        try:
            fd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         dir_fd=folder)
        except OSError:
            pass  # no manifest (a save that never sealed): no reader can hold it
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True  # a reader holds it: a later commit removes it
            except OSError:
                pass  # no flock on this file system: remove as before
            with contextlib.suppress(OSError):
                os.unlink(MANIFEST, dir_fd=folder)
        _remove_folder(path)
    finally:
        if fd is not None:
            os.close(fd)
        os.close(folder)
    return False


def _held_by(folders):
    """``' (held by pid 4242)'`` for the processes holding a shared ``flock``
    on the manifests of ``folders``, as ``/proc/locks`` names them; ``''``
    where it cannot tell."""
    wanted = set()
    for folder in folders:
        with contextlib.suppress(OSError):
            info = os.lstat(os.path.join(folder, MANIFEST))
            wanted.add((os.major(info.st_dev), os.minor(info.st_dev), info.st_ino))
    try:
        text = read_bounded('/proc/locks', MAX_LOCKS_BYTES, 'lock table').decode('ascii',
                                                                                 'replace')
    except (OSError, StoreError):
        return ''
    pids = set()
    for line in text.splitlines():
        words = line.replace('->', ' ').split()
        try:  # "1: FLOCK  ADVISORY  READ  4242 fd:01:1234567 0 EOF"
            major, minor, inode = words[5].split(':')
            key = (int(major, 16), int(minor, 16), int(inode))
        except (IndexError, ValueError):
            continue
        if words[1] == 'FLOCK' and key in wanted and words[4].isdigit():
            pids.add(int(words[4]))
    if not pids:
        return ''
    return ' (held by pid%s %s)' % ('s' if len(pids) > 1 else '',
                                    ', '.join(str(p) for p in sorted(pids)))


def _marker(folder):
    """The kind a folder's ``.kind`` file names, or '' (no such file, or one
    naming none of :data:`KINDS`)."""
    path = os.path.join(folder, KIND)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return ''  # none, a symlink, or something unreadable
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ''
        text = os.read(fd, 64).decode('ascii', 'replace').strip()
    finally:
        os.close(fd)
    return text if text in KINDS else ''


def folder_kind(folder):
    """What the folder holds: ``'training'`` or ``'export'``; ``'snapshot'``
    for a committed or staged snapshot folder; ``'store'`` for a store whose
    kind cannot be told; None for any other folder (or none).

    The ``.kind`` file says it; a folder written before there were kinds is
    told by its current manifest (an export records ``"kind": "export"``, a
    training checkpoint names its optimizer states or its parts).
    """
    marker = _marker(folder)
    if marker:
        return marker
    if os.path.basename(folder).startswith((SNAP_PREFIX, STAGING_PREFIX)) \
            and os.path.isfile(os.path.join(folder, MANIFEST)):
        return 'snapshot'
    try:
        target = os.readlink(os.path.join(folder, CURRENT))
    except OSError:
        return None
    if not (_is_plain_name(target) and target.startswith(SNAP_PREFIX)):
        return None
    try:
        meta = json.loads(read_bounded(os.path.join(folder, target, MANIFEST),
                                       MAX_MANIFEST_BYTES, 'manifest').decode('utf-8'))['meta']
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return 'store'
    if isinstance(meta, dict) and meta.get('kind') in KINDS:
        return meta['kind']
    if isinstance(meta, dict) and isinstance(meta.get('files'), dict) \
            and ('states' in meta['files'] or 'parts' in meta['files']):
        return 'training'
    return 'store'


_ARTICLE = {'training': 'a training folder', 'export': 'an export folder',
            'snapshot': 'a snapshot folder', 'store': 'an output folder of unknown kind'}


def check_store_folder(path, kind=None, name='folder'):
    """Raises unless ``path`` may become (or is) a store folder of ``kind``.

    Refused: an empty path; a folder inside another store or a snapshot
    (``OUT/current``, ``OUT/snap-*``, ``OUT/sub``), which that store's next
    writer could delete; and, with ``kind``, a folder holding the other kind
    (training output where an export goes, or the reverse) and any folder
    that is neither absent, empty nor a store (:func:`check_destination`).

    Args:
        path: The folder (need not exist).
        kind: One of :data:`KINDS`, or None to check nesting only (for a
            command that writes plain files, not a store).
        name: What to call the path in the message (a flag such as ``--out``).

    Raises:
        WrongFolder: The message names ``name``, what was expected and what
            was found.
    """
    if kind is not None and kind not in KINDS:
        raise ValueError('kind: expected one of %s, found %r' % (KINDS, kind))
    if not isinstance(path, str) or not path.strip():
        raise WrongFolder('%s: expected a folder path, found an empty string' % name)
    real = os.path.realpath(path)
    want = _ARTICLE[kind] if kind else 'a folder'
    parent = os.path.dirname(real)
    while True:
        found = folder_kind(parent)
        if found is not None:
            raise WrongFolder('%s: expected %s outside any training or export folder, found %s '
                              'inside %s (%s), whose next writer may delete it'
                              % (name, want, path, _ARTICLE[found], parent))
        if os.path.dirname(parent) == parent:
            break
        parent = os.path.dirname(parent)
    found = folder_kind(real)
    if found == 'snapshot' or (kind is not None and found in KINDS and found != kind):
        raise WrongFolder('%s: expected %s (or a new one), found %s at %s; choose another folder'
                          % (name, want, _ARTICLE[found], path))
    if kind is not None:
        check_destination(path, kind, name)


def _is_store(real):
    """Whether the folder at ``real`` was made by a store: its ``.lock`` is a
    regular file and it says its kind, names a committed snapshot, holds
    records, or holds nothing else."""
    try:
        info = os.lstat(os.path.join(real, LOCK))
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode):
        return False
    if _marker(real) or folder_kind(real) is not None or _read_records(real):
        return True
    return set(os.listdir(real)) <= {LOCK}


def check_destination(path, kind=None, name='folder'):
    """Raises unless a store may write in ``path``: it is absent, empty (a
    lone ``.lock`` counts as empty), or already a store (:func:`_is_store`).

    A store writes ``.lock``, ``.kind``, ``current`` and its ``snap-*`` /
    ``.staging-*`` entries beside whatever a folder holds, so a folder of
    someone else's files (``/``, a home folder, the parent of a run) is
    refused before anything is written there.

    Raises:
        WrongFolder: The message names ``name``, the folder and a few of its
            entries.
    """
    real = os.path.realpath(path)
    try:
        names = sorted(os.listdir(real))
    except OSError:
        return  # absent, a file, or unreadable: locked() says which
    if LOCK in names and _kind(os.path.join(real, LOCK)) not in ('a file', 'nothing'):
        raise StoreError(_bad_lock(os.path.join(path, LOCK)))  # not "a folder of unknown kind"
    if not names or names == [LOCK] or _is_store(real):
        return
    want = _ARTICLE[kind] if kind else 'a store folder'
    shown = ', '.join(ascii(n)[1:-1][:40] for n in names[:3]) + (', ...' if len(names) > 3
                                                                  else '')
    raise WrongFolder('%s: expected an empty folder or %s, found a folder of %d entries of '
                      'unknown kind at %s (%s); nothing was written there, choose another folder'
                      % (name, want, len(names), path, shown))


def _bad_lock(path, links=None):
    """The message for a ``.lock`` that is not a regular file of one link
    (``links``: its count, for a regular file with more)."""
    if links is None and os.path.islink(path):
        return ('%s: expected the folder\'s lock file, found a symlink; refusing to follow it '
                '(remove it if this is your folder)' % path)
    return ('%s: expected the folder\'s lock file (a regular file with one link), found %s'
            % (path, 'a file with %d links' % links if links is not None else _kind(path)))


class Snapshot:
    """A committed snapshot whose files were checked against its manifest.

    Attributes:
        folder: Absolute real path of the ``snap-<token>`` folder.
        manifest: The parsed ``MANIFEST.json``.
        meta: ``manifest['meta']``, the dict given to :meth:`Store.commit`.
        files: File name -> ``{'sha256': hex, 'bytes': size}``, from the manifest.
        held: For one :meth:`Store.commit` returned, the ``snap-*`` names of
            older snapshots kept beside it because readers hold them
            (:meth:`held_note` says so in one line); ``()`` otherwise.

    One returned by ``Store.current(hold=True)`` holds its folder against
    removal by a writer's cleanup (a shared ``flock`` on its manifest) until
    :meth:`close`, the end of a ``with`` block, or garbage collection.
    """

    def __init__(self, folder, manifest, hold_fd=None):
        self.folder = folder
        self.manifest = manifest
        self.meta = manifest['meta']
        self.files = manifest['files']
        self._hold_fd = hold_fd
        self.held = ()

    def held_note(self):
        """One line saying which older snapshots stay beside this one because
        readers hold them, or None when none does."""
        if not self.held:
            return None
        store = os.path.dirname(self.folder)
        return ('%s: %d older snapshot%s kept beside the new one, held by readers%s; a commit '
                'never deletes a snapshot a reader holds, and is refused while %d are held'
                % (store, len(self.held), '' if len(self.held) == 1 else 's',
                   _held_by(os.path.join(store, n) for n in self.held), MAX_HELD))

    def close(self):
        """Lets writers remove the snapshot folder (when it is no longer current)."""
        fd, self._hold_fd = self._hold_fd, None
        if fd is not None:
            os.close(fd)  # releases the shared flock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit `os` may be gone already
            self.close()

    def path(self, name):
        """Absolute path of a file the manifest names.

        Raises:
            StoreError: The manifest does not name ``name``.
        """
        if name not in self.files:
            raise StoreError('%s: expected a file named %r in the manifest, found only %s'
                             % (self.folder, name, sorted(self.files)))
        return os.path.join(self.folder, name)

    def __repr__(self):
        return 'Snapshot(%r, files=%s)' % (self.folder, sorted(self.files))


class Store:
    """One folder holding one committed snapshot; one writer at a time.

    Writers do ``with store.locked(): store.commit(write, meta)``; readers
    call :meth:`current` and need no lock.

    Args:
        folder: The output folder; created by :meth:`locked` if missing.
        kind: What the folder holds, one of :data:`KINDS`: :meth:`locked`
            refuses a folder of the other kind, and :meth:`commit` records
            this one in ``.kind`` before its first switch of ``current``.
            None (a store of no kind) checks nesting only.
    """

    def __init__(self, folder, kind=None):
        if kind is not None and kind not in KINDS:
            raise ValueError('kind: expected one of %s or None, found %r' % (KINDS, kind))
        self.folder = os.path.abspath(folder)
        self.kind = kind
        self._lock_fd = None
        self._held = []  # snap-* names a reader held at the last clean-up

    def _at(self, name):
        return os.path.join(self.folder, name)

    # -- writer side ---------------------------------------------------------

    @contextlib.contextmanager
    def locked(self):
        """Holds the folder's writer lock for the ``with`` block.

        Creates the folder if needed and takes the lock without waiting. The
        lock file is opened without following a symlink, must be a regular
        file with one link, and is never truncated. Once held, checks the
        folder (:func:`check_store_folder`, :func:`check_destination`) and
        removes what an interrupted save left, among the entries its records
        name only: ``.staging-T`` folders, ``.current-T`` temporary links and
        ``snap-T`` folders that ``current`` does not name and no reader
        holds. Entries of the same prefixes that the records do not name
        (another's, or left by a writer older than the records) are never
        touched. A lock left by a
        killed process never blocks: the kernel drops a ``flock`` with the
        last descriptor of its holder (a child forked inside the block holds
        it too, until it exits).

        Raises:
            FolderInUse: Another process holds the lock.
            WrongFolder: The folder holds the other kind, lies inside a
                store or a snapshot, or is neither empty nor a store.
            StoreError: ``folder`` exists and is not a folder, ``.lock`` is a
                symlink or not a regular file, or this Store already holds
                the lock.
        """
        if self._lock_fd is not None:
            raise StoreError('%s: expected one locked() at a time per Store, found it already held'
                             % self.folder)
        self._check_folder()  # before making it
        try:
            os.makedirs(self.folder, exist_ok=True)
        except FileExistsError:
            raise StoreError('%s: expected a folder, found a file' % self.folder) from None
        fd = self._open_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = (os.pread(fd, 32, 0).decode('ascii', 'replace').split() or ['unknown'])[0]
            os.close(fd)
            raise FolderInUse('%s is in use by another process (pid %s); expected one writer '
                              'per folder' % (self.folder, pid)) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            # Fixed width, so a shorter pid overwrites a longer one without truncating.
            os.pwrite(fd, b'%-19d\n' % os.getpid(), 0)
            self._check_folder()  # again, under the lock
            self._lock_fd = fd
            self._clean_leftovers()
            yield self
        finally:
            self._lock_fd = None
            os.close(fd)  # releases the flock

    def _check_folder(self):
        check_store_folder(self.folder, self.kind, self.folder)
        if self.kind is None:
            check_destination(self.folder, None, self.folder)

    def _open_lock(self):
        """Opens (or creates) ``.lock`` without following a symlink; returns the fd."""
        path = self._at(LOCK)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK, 0o644)
        except OSError as err:
            if os.path.islink(path):
                raise StoreError(_bad_lock(path)) from None
            raise StoreError('%s: expected a lock file this user can open, found %s (%s)'
                             % (path, _kind(path), err.strerror or err)) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise StoreError(_bad_lock(path, info.st_nlink if stat.S_ISREG(info.st_mode)
                                       else None))
        return fd

    def _records(self):
        return _parse_records(os.pread(self._lock_fd, MAX_RECORD_BYTES, PID_BYTES))

    def _record(self, token):
        """Records ``token`` in a free slot of ``.lock`` and fsyncs it, before
        any entry named by it is made.

        Raises:
            StoreError: Every slot is taken (records of 65,536 snapshots
                that readers still hold).
            OSError: The write or the fsync failed (ENOSPC).
        """
        used = {slot for slot, _ in self._records()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        if (slot + 1) * SLOT > MAX_RECORD_BYTES:
            raise StoreError('%s: expected fewer than %d snapshots held by readers, found all '
                             'slots taken' % (self._at(LOCK), MAX_RECORD_BYTES // SLOT))
        os.pwrite(self._lock_fd, token.encode('ascii') + b'\n', PID_BYTES + slot * SLOT)
        os.fsync(self._lock_fd)

    def _clean_leftovers(self):
        """Removes the entries the records name that ``current`` does not
        (a held snapshot stays, for a later commit), and forgets the tokens
        of which nothing is left. ``current``'s own snapshot, written before
        there were records, is recorded, so that the next commit removes it.
        Returns the names of the snapshots kept because a reader holds them."""
        try:
            target = os.readlink(self._at(CURRENT))
        except FileNotFoundError:
            target = None  # nothing committed: every recorded snap-* is a save that never switched
        except OSError:
            target = ''  # `current` is not a symlink: keep every snap-*, current() will say why
        # A damaged `current` keeps every snapshot: removing one could lose the only good one.
        damaged = target == '' or (target is not None and not (
            _is_plain_name(target) and target.startswith(SNAP_PREFIX)
            and os.path.isdir(self._at(target))))
        records = self._records()
        if target and not damaged and _TOKEN_RE.fullmatch(
                target[len(SNAP_PREFIX):].encode('ascii', 'replace') + b'\n') \
                and target[len(SNAP_PREFIX):] not in {t for _, t in records}:
            self._record(target[len(SNAP_PREFIX):])
        held = []
        for slot, token in records:
            _remove_folder(self._at(STAGING_PREFIX + token))
            for name in (LINK_PREFIX + token, LINK_PREFIX + token + '-back'):
                _remove_link(self._at(name))
            snap = SNAP_PREFIX + token
            if snap == target:
                continue
            if not damaged and _remove_snapshot(self._at(snap)):
                held.append(snap)
            if not any(_is_folder(self._at(prefix + token))
                       for prefix in (SNAP_PREFIX, STAGING_PREFIX)):
                # nothing of it is left (a link put in its place is not the store's):
                # free the slot (a lost write only means another look)
                os.pwrite(self._lock_fd, _BLANK, PID_BYTES + slot * SLOT)
        self._held = held
        return held

    def _check_held(self):
        """Raises before a commit writes anything when :data:`MAX_HELD`
        snapshots beside ``current`` are held by readers (looked at again
        first: a reader may have let go since the last commit)."""
        if len(self._held) < MAX_HELD or len(self._clean_leftovers()) < MAX_HELD:
            return
        raise StoreError('%s: expected at most %d older snapshots held by readers, found %d%s; '
                         'a commit never deletes a snapshot a reader holds, so nothing was '
                         'committed and current is kept'
                         % (self.folder, MAX_HELD, len(self._held),
                            _held_by(self._at(n) for n in self._held)))

    def commit(self, write, meta=None):
        """Writes a new snapshot and makes it current, or leaves the old one.

        Steps: ``write(staging)`` writes the files; each is fsynced and
        hashed; ``MANIFEST.json`` (format, every file's sha256 and size,
        ``meta``, UTC time) is written last and fsynced with the staging
        folder; the folder is renamed to ``snap-<token>``; ``current`` is
        switched to it with one ``os.replace``; then the previous snapshot is
        deleted, unless a reader holds it (a later commit deletes it). The
        token is recorded in ``.lock`` before the staging folder is made. The folder is fsynced after the rename and after the switch.

        Args:
            write: Called with the staging folder's path; writes the
                snapshot's files there, as plain files (no subfolders,
                symlinks or a file named ``MANIFEST.json``). It may return
                ``{file name: {'sha256': hex, 'bytes': size}}`` for files
                their writer (another node) already fsynced and hashed:
                those are checked for their size only, not read again.
            meta: A JSON-able dict stored in the manifest (e.g. epoch, config).

        Returns:
            The new current :class:`Snapshot`.

        Raises:
            StoreError: Not inside :meth:`locked`, ``meta`` not a JSON-able
                dict, or ``write`` left something other than plain files.
            OSError: A file-system call failed (ENOSPC included).
            Exception: Whatever ``write`` raised. On any exception the
                staging folder is removed and the previous snapshot stays
                current and intact; the exception is re-raised. (Should the
                failure come after the switch, e.g. the last fsync, and even
                switching back fail, the new snapshot stays current, whole.)
        """
        if self._lock_fd is None:
            raise StoreError('%s: expected commit() inside Store.locked(), found the lock not held'
                             % self.folder)
        meta = {} if meta is None else meta
        if not isinstance(meta, dict):
            raise StoreError('meta: expected a dict, found %s' % type(meta).__name__)
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise StoreError('meta: expected a JSON-able dict, found %s' % e) from None
        self._check_held()
        previous = self._read_link()
        token = uuid.uuid4().hex[:16]
        staging = self._at(STAGING_PREFIX + token)
        snap_name = SNAP_PREFIX + token
        snap = self._at(snap_name)
        link_tmp = self._at(LINK_PREFIX + token)
        self._record(token)  # before anything it names exists: a kill leaves nothing unrecorded
        try:
            os.mkdir(staging)
            hashed = write(staging)
            manifest = self._seal(staging, meta, hashed if isinstance(hashed, dict) else {})
            if self.kind is not None and _marker(self.folder) != self.kind:
                atomic_write_bytes(self._at(KIND), self.kind.encode() + b'\n')
            os.rename(staging, snap)
            fsync_path(self.folder)
            os.symlink(snap_name, link_tmp)
            os.replace(link_tmp, self._at(CURRENT))
            fsync_path(self.folder)
        except BaseException:
            _remove_folder(staging)
            _remove_link(link_tmp)
            if self._points_to(snap_name) and not self._switch_back(previous, snap_name):
                raise  # could not restore the old link: the new snapshot stays, whole
            _remove_folder(snap)
            raise
        # Committed already: the previous snapshot, and any a reader held until now, go;
        # one a reader still holds stays, for a later commit.
        with contextlib.suppress(OSError):
            self._clean_leftovers()
        snapshot = Snapshot(os.path.realpath(snap), manifest)
        snapshot.held = tuple(self._held)
        return snapshot

    def _switch_back(self, previous, snap_name):
        """Points ``current`` at ``previous`` again (or removes it if there
        was none) after a failure that followed the switch to ``snap_name``,
        such as an fsync error. Returns whether ``current`` left ``snap_name``."""
        link_tmp = self._at(LINK_PREFIX + snap_name[len(SNAP_PREFIX):] + '-back')
        try:
            if previous is None:
                os.unlink(self._at(CURRENT))
            else:
                os.symlink(previous, link_tmp)
                os.replace(link_tmp, self._at(CURRENT))
            fsync_path(self.folder)
        except OSError:
            _remove_link(link_tmp)
        return not self._points_to(snap_name)

    def _seal(self, staging, meta, hashed):
        """fsyncs and hashes the written files (but those ``hashed`` names,
        whose size is checked), then writes the manifest."""
        files = {}
        # a file another node wrote is looked up by its name too: a shared file
        # system may list the folder as it was a moment ago
        for name in sorted(set(os.listdir(staging)) | set(hashed)):
            if not _is_plain_name(name):
                raise StoreError('%s: expected plain file names, found %r' % (staging, name))
            path = os.path.join(staging, name)
            if name == MANIFEST:
                raise StoreError('%s: expected write() to leave %s to the store, found it written'
                                 % (path, MANIFEST))
            if os.path.islink(path) or not os.path.isfile(path):
                raise StoreError('%s: expected write() to leave plain files only, found %s'
                                 % (path, _kind(path)))
            if name in hashed:
                entry = hashed[name]
                if os.path.getsize(path) != entry.get('bytes'):
                    raise StoreError('%s: expected the %s bytes its writer wrote, found %d'
                                     % (path, entry.get('bytes'), os.path.getsize(path)))
                files[name] = {'sha256': entry['sha256'], 'bytes': entry['bytes']}
                continue
            sha256, size = _hash_and_fsync(path)
            files[name] = {'sha256': sha256, 'bytes': size}
        manifest = {'format': FORMAT, 'files': files, 'meta': meta,
                    'created_utc': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}
        _write_new_file(os.path.join(staging, MANIFEST),
                        (json.dumps(manifest, indent=2, sort_keys=True) + '\n').encode())
        fsync_path(staging)
        return manifest

    # -- reader side ---------------------------------------------------------

    def _read_link(self):
        try:
            return os.readlink(self._at(CURRENT))
        except FileNotFoundError:
            return None
        except OSError:
            raise StoreError('%s: expected a symlink to snap-<token>, found %s'
                             % (self._at(CURRENT), _kind(self._at(CURRENT)))) from None

    def _points_to(self, name):
        try:
            return os.readlink(self._at(CURRENT)) == name
        except OSError:
            return False

    def has_snapshot(self):
        """Whether a snapshot was ever committed here (``current`` exists);
        :meth:`current` verifies it."""
        return os.path.lexists(self._at(CURRENT))

    def current(self, hold=False):
        """The committed snapshot, verified, or None when nothing was committed.

        Checks that ``current`` is a relative link to a ``snap-*`` folder of
        this folder that exists; that its ``MANIFEST.json`` parses and has
        this format; and that every file it names is a plain name, exists,
        and has the recorded size and sha256. Files the manifest does not
        name are ignored. The snapshot is held against removal while it is
        verified (a shared ``flock`` on its manifest, which a writer's
        cleanup respects), so a writer committing meanwhile leaves it whole;
        one removed before the hold was taken is left for the snapshot
        ``current`` names then.

        Args:
            hold: Keep holding the snapshot after returning, until the
                :class:`Snapshot` is closed (for a caller that reads its
                files next, such as an export of a live run).

        Returns:
            A :class:`Snapshot`, or None if there is no ``current`` link.

        Raises:
            StoreError: Any check failed; the message names the link, folder
                or file and the expected vs found value.
        """
        for attempt in range(10):
            target = self._read_link()
            if target is None:
                return None
            fd = self._hold(target)
            if fd is False:
                continue  # removed after the switch: `current` names a newer one
            try:
                snapshot = self._verify(target)
            except StoreError:
                if fd is not None:
                    os.close(fd)
                if attempt == 9 or self._read_link() == target:
                    raise
                continue
            except BaseException:
                if fd is not None:
                    os.close(fd)
                raise
            if hold:
                snapshot._hold_fd = fd  # pylint: disable=protected-access
            elif fd is not None:
                os.close(fd)
            return snapshot
        return self._verify(self._read_link())  # one that kept changing: say what is there

    def _hold(self, target):
        """A descriptor of ``target``'s manifest under a shared ``flock``;
        None where it cannot be held (no manifest there, or no flock on this
        file system: :meth:`_verify` then tells); False if a writer removed
        it meanwhile."""
        if not (_is_plain_name(target) and target.startswith(SNAP_PREFIX)):
            return None
        try:
            fd = os.open(os.path.join(self._at(target), MANIFEST),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return False if self._read_link() != target else None
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a writer holds LOCK_EX only while it removes
        except OSError:
            return fd  # no flock here: read unheld, as before
        if os.fstat(fd).st_nlink == 0:  # unlinked by a writer before we got the lock
            os.close(fd)
            return False
        return fd

    def _verify(self, target):
        link = self._at(CURRENT)
        if not (_is_plain_name(target) and target.startswith(SNAP_PREFIX)):
            raise StoreError('%s: expected a link to a folder snap-<token> beside it, found %r'
                             % (link, target))
        folder = self._at(target)
        if os.path.islink(folder) or not os.path.isdir(folder):
            raise StoreError('%s: expected the snapshot folder %s, found %s'
                             % (link, folder, _kind(folder)))
        manifest = self._read_manifest(os.path.join(folder, MANIFEST))
        for name, entry in sorted(manifest['files'].items()):
            path = os.path.join(folder, name)
            if not _is_plain_name(name) or name == MANIFEST:
                raise StoreError('%s: expected plain file names in "files", found %r'
                                 % (os.path.join(folder, MANIFEST), name))
            if not (isinstance(entry, dict) and isinstance(entry.get('sha256'), str)
                    and type(entry.get('bytes')) is int):
                raise StoreError('%s: expected {"sha256": hex, "bytes": int} for %r, found %r'
                                 % (os.path.join(folder, MANIFEST), name, entry))
            try:  # a writer may delete this snapshot meanwhile: current() then retries
                if os.path.islink(path) or not os.path.isfile(path):
                    raise FileNotFoundError
                size = os.path.getsize(path)
                if size != entry['bytes']:
                    raise StoreError('%s: expected %d bytes, found %d bytes'
                                     % (path, entry['bytes'], size))
                sha256 = sha256_file(path)
            except FileNotFoundError:
                raise StoreError('%s: expected a file of %d bytes, found %s'
                                 % (path, entry['bytes'], _kind(path))) from None
            if sha256 != entry['sha256']:
                raise StoreError('%s: expected sha256 %s, found %s'
                                 % (path, entry['sha256'], sha256))
        return Snapshot(os.path.realpath(folder), manifest)

    @staticmethod
    def _read_manifest(path):
        try:
            manifest = json.loads(read_bounded(path, MAX_MANIFEST_BYTES, 'manifest')
                                  .decode('utf-8'))
        except FileNotFoundError:
            raise StoreError('%s: expected the snapshot manifest, found nothing' % path) from None
        except StoreError:
            raise
        except RecursionError:
            raise StoreError('%s: expected a manifest, found JSON nested too deeply to read'
                             % path) from None
        except (UnicodeDecodeError, ValueError) as e:
            raise StoreError('%s: expected JSON, found %s' % (path, e)) from None
        if not isinstance(manifest, dict) or manifest.get('format') != FORMAT:
            raise StoreError('%s: expected "format": %r, found %r' % (
                path, FORMAT, manifest.get('format') if isinstance(manifest, dict)
                else type(manifest).__name__))
        for key in ('files', 'meta'):
            if not isinstance(manifest.get(key), dict):
                raise StoreError('%s: expected "%s" to be an object, found %r'
                                 % (path, key, manifest.get(key)))
        return manifest


class PartError(StoreError):
    """A node could not write its part of a snapshot committed across nodes,
    or the committing node could not commit it."""


def commit_across(store, group, write_part, finish, meta=None):
    """One snapshot written by several processes (the nodes of one job)
    into a folder they share, committed only when every part is written:
    all or nothing, as :meth:`Store.commit`.

    Node 0 holds ``store`` locked and commits; the others write into its
    staging folder. Steps: node 0 makes the staging folder and sends its
    path; every node writes its part there (``write_part(staging)``),
    fsyncs and hashes it; node 0 gathers whether each did, with the sha256
    and size of each node's files, and only when all did, ``finish(staging)``
    writes node 0's own remaining files and the store seals (the other
    nodes' files are not read again) and switches ``current``; then node 0
    tells every node how the commit ended. No node reads another's part. A
    node killed at any step leaves ``current`` as it was (or, once switched,
    the new snapshot whole): the staging folder is removed by the store (on
    error) or by its next writer.

    Args:
        store: Node 0's :class:`Store`, inside :meth:`Store.locked`; ``None``
            on the other nodes.
        group: The nodes: ``rank``, ``broadcast(value, source)`` (node
            ``source``'s JSON-able value on every node) and ``gather(value)``
            (every node's value, in rank order, on every node); each raises
            when a node died or stopped answering.
        write_part: Called on every node with the staging folder: writes
            that node's plain files, named apart from every other node's,
            and returns their names.
        finish: Called on node 0 with the staging folder once every part is
            there: writes the snapshot's other files, plain files only.
        meta: As :meth:`Store.commit`'s.

    Returns:
        On node 0, the committed :class:`Snapshot`; on the others, the
        path of its folder.

    Raises:
        PartError: a node's ``write_part`` failed (every node raises it,
            naming the node and its error), or node 0's commit failed.
        Exception: what ``group`` raises when a node died; what ``finish``
            or the store raised (node 0).
    """
    if group.rank != 0:
        staging = group.broadcast(None, 0)
        if staging is not None and not isinstance(staging, str):
            raise PartError('node 0 sent %s where a staging folder was expected'
                            % type(staging).__name__)
        if staging is not None:
            group.gather(_attempt(write_part, staging))
        outcome = group.broadcast(None, 0)
        if not (isinstance(outcome, (list, tuple)) and len(outcome) == 2 and
                outcome[0] in ('ok', 'error') and isinstance(outcome[1], str)):
            raise PartError('node 0 sent %s where how the commit ended was expected'
                            % type(outcome).__name__)
        status, detail = outcome
        if status != 'ok':
            raise PartError(detail)
        return detail
    staged = []

    def write(staging):
        staged.append(staging)
        group.broadcast(staging, 0)
        outcomes = group.gather(_attempt(write_part, staging))
        failed = [(k, o.get('error') if isinstance(o, dict) else 'sent %s' % type(o).__name__)
                  for k, o in enumerate(outcomes)
                  if not isinstance(o, dict) or o.get('error')]
        if failed:
            raise PartError('node %d could not write its part of the checkpoint: %s'
                            % failed[0])
        finish(staging)
        return {name: entry for o in outcomes for name, entry in o['files'].items()}

    try:
        snapshot = store.commit(write, meta)
    except PartError as err:
        group.broadcast(['error', str(err)], 0)
        raise
    except Exception as err:  # pylint: disable=broad-except
        message = 'node 0 could not commit the checkpoint: %s: %s' % (
            type(err).__name__, ' '.join(str(err).split())[:300])
        try:
            if not staged:
                group.broadcast(None, 0)  # the others wait for a staging folder first
            group.broadcast(['error', message], 0)
        except Exception:  # pylint: disable=broad-except
            pass  # a node is gone: the error it raises there says so
        raise
    group.broadcast(['ok', snapshot.folder], 0)
    return snapshot


def abandon_across(group, message):
    """On node 0, when a commit across nodes cannot start (its folder in use,
    say): releases the other nodes waiting in :func:`commit_across`, which
    raise :class:`PartError` with ``message``."""
    try:
        group.broadcast(None, 0)
        group.broadcast(['error', message], 0)
    except Exception:  # pylint: disable=broad-except
        pass  # a node is gone: the error it raises there says so


def _attempt(write_part, staging):
    """``{'error': None, 'files': {name: {'sha256', 'bytes'}}}`` once
    ``write_part(staging)`` wrote this node's files (fsynced and hashed
    here), else ``{'error': its error in one line}``."""
    try:
        names = write_part(staging) or ()
        hashed = {}
        for name in names:
            sha256, size = _hash_and_fsync(os.path.join(staging, name))
            hashed[name] = {'sha256': sha256, 'bytes': size}
    except Exception as err:  # pylint: disable=broad-except
        return {'error': '%s: %s' % (type(err).__name__, ' '.join(str(err).split())[:300])}
    return {'error': None, 'files': hashed}


def check_committed_file(path):
    """Checks a file read through a store's ``current`` link against its commit.

    A path that resolves into the current ``snap-*`` folder of a store has
    every file of that snapshot verified (:meth:`Store.current`) and must be
    one the manifest names; any other path is left alone.

    Raises:
        StoreError: the snapshot does not match its manifest, or does not
            name the file.
    """
    folder = os.path.dirname(os.path.realpath(path))
    if not (os.path.basename(folder).startswith(SNAP_PREFIX)
            and os.path.isfile(os.path.join(folder, MANIFEST))):
        return
    snapshot = Store(os.path.dirname(folder)).current()
    if snapshot is not None and snapshot.folder == folder:
        snapshot.path(os.path.basename(path))
