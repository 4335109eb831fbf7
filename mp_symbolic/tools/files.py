"""Files written whole or not at all, and their digests: the one atomic write
(with fsync) and the one sha256 of the project. Standard library only.

Reference: the rename-into-place pattern of ``os.replace`` (POSIX rename(2)
is atomic within a file system) with the fsyncs that make it durable: the
file before the rename, its folder after.
"""
from contextlib import contextmanager
import errno
import hashlib
import json
import os
import stat
import tempfile

from ..core.base.checks import excerpt

__all__ = []

_CHUNK = 1 << 20


def _openable(path):
    """Whether ``path`` is short enough for the system to look up: names of at
    most 255 bytes, 4096 bytes in all (Linux's NAME_MAX and PATH_MAX), also
    below a folder that does not exist yet."""
    try:
        raw = os.fsencode(os.path.abspath(path))
    except (TypeError, UnicodeError, ValueError):
        return True  # not a name this check can measure: the system says what it is
    return len(raw) < 4096 and all(len(name) <= 255 for name in raw.split(b'/'))


def shown_path(path):
    """``path`` for a message: whole where the system could open a path so
    long (:func:`_openable`), else an excerpt of 80 characters (a 100 KB
    value is not echoed)."""
    return path if _openable(path) else excerpt(path)


def check_path(path, name):
    """Raises ValueError if the system would refuse ``path`` as too long (a
    name of more than 255 bytes, or more than 4096 in all: ``ENAMETOOLONG``),
    so that such a path is refused before any work, quoted as an excerpt.

    Args:
        name: What to call the path in the message (a field or flag name).
    """
    if not _openable(path):
        raise ValueError('%s: expected a path this system can open (names of at most 255 '
                         'bytes, 4096 in all), found %s (%d characters): %s'
                         % (name, excerpt(ascii(path)[1:-1]), len(path),
                            os.strerror(errno.ENAMETOOLONG)))


def check_writable_dir(path, name):
    """Raises ValueError unless ``path`` is, or can become, a writable folder.

    Args:
        name: What to call the path in the message (a field or flag name).
    """
    check_path(path, name)
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if os.path.islink(probe) and not os.path.exists(probe):
        raise ValueError('%s: expected a folder, found a symlink to nothing at %s (-> %s)'
                         % (name, probe, os.readlink(probe)))
    if not os.path.isdir(probe):
        raise ValueError('%s: expected a folder, found %s at %s' % (name, what_is(probe), probe))
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError('%s: expected a folder this user can write, found %s not writable'
                         % (name, probe))


def fsync_path(path):
    """fsyncs a file or a folder (a folder's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path):
    """Yields a temporary path next to ``path``; when the block succeeds the
    file there is fsynced, renamed onto ``path`` and the folder fsynced, so
    after a crash ``path`` holds the old file or the complete new one. On any
    failure (an exception or an interrupt) the temporary file is removed and
    ``path`` is unchanged.

    Raises:
        OSError: the folder cannot be made, or a write, fsync or rename fails.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix='.' + os.path.basename(path) + '.',
                               suffix='.tmp')
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; artifacts are meant to be shared
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_path(folder)


def atomic_write_bytes(path, data):
    """Replaces the file ``path`` with ``data``, durably and all at once (see
    :func:`atomic_path`).

    Raises:
        OSError: the write failed (e.g. ENOSPC); ``path`` is unchanged.
    """
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def write_text(path, text):
    """Writes ``text`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        with open(tmp, 'w') as f:
            f.write(text)


def write_json(path, obj):
    """Writes ``obj`` as indented, sorted JSON to ``path`` atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + '\n')


def what_is(path, nothing='nothing'):
    """What is at ``path``, for messages: ``nothing`` (when nothing is there),
    'a symlink', 'a file', 'a folder', 'a FIFO', 'a socket', 'a character
    device', ..."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return nothing
    for test, name in ((stat.S_ISLNK, 'a symlink'), (stat.S_ISREG, 'a file'),
                       (stat.S_ISDIR, 'a folder'), (stat.S_ISFIFO, 'a FIFO'),
                       (stat.S_ISSOCK, 'a socket'), (stat.S_ISCHR, 'a character device'),
                       (stat.S_ISBLK, 'a block device')):
        if test(mode):
            return name
    return 'a special file'


def sha256_file(path):
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(_CHUNK), b''):
            digest.update(chunk)
    return digest.hexdigest()
