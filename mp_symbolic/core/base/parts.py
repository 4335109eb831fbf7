"""Files of named arrays written and read one array at a time, unpickled: the
uncompressed ``.npz`` part each node commits to a checkpoint, and MXNet's
``.params``. Only numpy and the standard library, so that export and tools
read parts without MXNet."""
import hashlib
import os
import struct
import zipfile

import numpy as np

__all__ = []

SUFFIX = '.npy'
_LIST_MAGIC = 0x112          # kMXAPINDArrayListMagic: an NDArray list file
_ARRAY_MAGIC = 0xF993FAC9    # NDARRAY_V2_MAGIC: one dense NDArray, its storage type next
_CPU = 1                     # Context::kCPU
# MXNet's type flags (mshadow's TypeFlag)
_FLAGS = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2,
          np.dtype(np.uint8): 3, np.dtype(np.int32): 4, np.dtype(np.int8): 5,
          np.dtype(np.int64): 6, np.dtype(np.bool_): 7}
_DTYPES = {flag: dtype for dtype, flag in _FLAGS.items()}
MAX_NDIM = 32
MAX_NAME_BYTES = 1 << 16
CHUNK = 1 << 24              # bytes read at a time by the digests


class PartError(ValueError):
    """A part file that is unreadable or not what its writer wrote; one line."""


def write_npz(path, members, replace=False, digests=None):
    """Writes an ``.npz`` file of ``members`` one array at a time (the bytes
    ``np.savez`` writes), and fsyncs it.

    Args:
        path: The file to create (it must not exist, unless ``replace``).
        members: ``(name, value)`` pairs in order; ``value`` an array or a
            function of no arguments returning one, called in turn.
        replace: Truncate ``path`` if it exists.
        digests: A dict to fill with each member's sha256 (hex) of its
            ``.npy`` bytes, as :func:`npz_digests` reads them; or ``None``.

    Returns:
        ``{name: (shape, dtype)}`` of what was written, in order.

    Raises:
        OSError: the file cannot be written.
    """
    written = {}
    with _created(path, replace) as f:
        with zipfile.ZipFile(f, 'w', zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, value in members:
                array = np.asarray(value() if callable(value) else value)
                with zf.open(name + SUFFIX, 'w', force_zip64=True) as member:
                    out = member if digests is None else _Hashing(member)
                    np.lib.format.write_array(out, array, allow_pickle=False)
                if digests is not None:
                    digests[name] = out.hexdigest()
                written[name] = (tuple(array.shape), array.dtype)
                del array
    return written


class _Hashing:
    """A file object's ``write``, hashing what passes (sha256)."""

    def __init__(self, out):
        self._out, self._hash = out, hashlib.sha256()

    def write(self, data):
        self._hash.update(data)
        return self._out.write(data)

    def hexdigest(self):
        return self._hash.hexdigest()


class _created:  # pylint: disable=invalid-name,too-few-public-methods
    """``with _created(path, replace) as f``: ``path`` opened for binary writing
    (created, or truncated if ``replace``), fsynced if the block ends without
    an error."""

    def __init__(self, path, replace):
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if replace else os.O_EXCL)
        self._file = open(os.open(path, flags, 0o644), 'wb')

    def __enter__(self):
        return self._file

    def __exit__(self, kind, *exc):
        with self._file as f:
            if kind is None:
                f.flush()
                os.fsync(f.fileno())


def _npy_members(path):
    """``(name, member)`` of each ``.npy`` member of the ``.npz`` file ``path``,
    each open while it is handled; raises PartError for a file that is not a
    zip of ``.npy`` members, or a member unreadable."""
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.filename.endswith(SUFFIX):
                    raise PartError('%s: expected .npy members, found %r'
                                    % (path, info.filename[:80]))
                with zf.open(info) as member:
                    yield info.filename[:-len(SUFFIX)], member
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        if isinstance(err, PartError):
            raise
        raise _not_a_part(path, err) from None


def _not_a_part(path, err):
    return PartError('%s: expected a checkpoint part (.npz), found %s: %s'
                     % (path, type(err).__name__, ' '.join(str(err).split())[:200]))


def npz_digests(path):
    """``{name: sha256 (hex)}`` of an ``.npz`` file's members' ``.npy`` bytes;
    raises PartError for a file that is not a zip of ``.npy`` members."""
    found = {}
    for name, member in _npy_members(path):
        digest = hashlib.sha256()
        try:
            for chunk in iter(lambda m=member: m.read(CHUNK), b''):
                digest.update(chunk)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise _not_a_part(path, err) from None
        found[name] = digest.hexdigest()
    return found


def npz_index(path):
    """``{name: (shape, dtype)}`` of an ``.npz`` file's members, from their
    ``.npy`` headers only; raises PartError for a file that is not a zip of
    ``.npy`` members of numbers."""
    found = {}
    for name, member in _npy_members(path):
        try:
            version = np.lib.format.read_magic(member)
            shape, _, dtype = np.lib.format._read_array_header(  # pylint: disable=protected-access
                member, version, max_header_size=10000)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise _not_a_part(path, err) from None
        if dtype.hasobject:
            raise PartError('%s: expected arrays of numbers, found %s%s of objects'
                            % (path, name, SUFFIX))
        found[name] = (tuple(shape), dtype)
    return found


class NpzReader:
    """One ``.npz`` file open for reading, one member at a time, unpickled;
    :meth:`read` raises PartError for a member missing or unreadable."""

    def __init__(self, path):
        self.path = path
        try:
            self._data = np.load(path, allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile) as err:
            raise PartError('%s: expected a checkpoint part (.npz), found %s'
                            % (path, ' '.join(str(err).split())[:200])) from None

    def read(self, name):
        """The member ``name`` as a numpy array."""
        try:
            return self._data[name]
        except (KeyError, OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise PartError('%s: expected the array %r readable, found %s: %s'
                            % (self.path, name, type(err).__name__,
                               ' '.join(str(err).split())[:200])) from None

    def close(self):
        self._data.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_mxnet_params(path, items, replace=False, digests=None):
    """Writes the bytes ``mx.nd.save(path, dict(items))`` writes, one array at a
    time, and fsyncs the file.

    Args:
        path: The file to create (it must not exist, unless ``replace``).
        items: ``(name, value)`` pairs; ``value`` an array of one of MXNet's
            dense types or a function of no arguments returning one.
        replace: Truncate ``path`` if it exists.
        digests: A dict to fill with each array's sha256 (hex) of its data
            bytes, as :meth:`MxnetParams.digest` reads them; or ``None``.

    Returns:
        ``{name: (shape, dtype)}`` of what was written.

    Raises:
        OSError: the file cannot be written.
        ValueError: an array of a type MXNet does not save.
    """
    items = list(items)
    written = {}
    with _created(path, replace) as f:
        f.write(struct.pack('<QQQ', _LIST_MAGIC, 0, len(items)))
        for name, value in items:
            array = np.asarray(value() if callable(value) else value)
            if array.dtype not in _FLAGS:
                raise ValueError('%s: expected arrays of a type MXNet saves, found %s of %s'
                                 % (path, name, array.dtype))
            f.write(struct.pack('<IiI', _ARRAY_MAGIC, 0, array.ndim))
            f.write(struct.pack('<%dq' % array.ndim, *array.shape))
            f.write(struct.pack('<iii', _CPU, 0, _FLAGS[array.dtype]))
            data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder('<')).data
            f.write(data)
            if digests is not None:
                digests[name] = hashlib.sha256(data).hexdigest()
            written[name] = (tuple(array.shape), array.dtype)
            del array, data  # the view holds the array
        f.write(struct.pack('<Q', len(items)))
        for name, _ in items:
            data = name.encode('utf-8')
            f.write(struct.pack('<Q', len(data)) + data)
    return written


def mxnet_params_index(path):
    """``{name: (shape, dtype)}`` of an MXNet ``.params`` file of dense arrays,
    read from its headers; raises PartError naming a file that is not one."""
    return {name: (shape, dtype) for name, (shape, dtype, _) in _mxnet_layout(path).items()}


class MxnetParams:
    """An MXNet ``.params`` file of dense arrays, read one array at a time;
    raises PartError for a file that is not one, or (:meth:`read`) no array
    of that name."""

    def __init__(self, path):
        self.path = path
        self._layout = _mxnet_layout(path)

    def names(self):
        """The names of its arrays, in the file's order."""
        return list(self._layout)

    def read(self, name):
        """The array ``name`` as a numpy array, read from its offset."""
        if name not in self._layout:
            raise PartError('%s: expected an array named %r, found none' % (self.path, name))
        shape, dtype, offset = self._layout[name]
        count = int(np.prod(shape, dtype=np.int64))
        with open(self.path, 'rb') as f:
            f.seek(offset)
            array = np.fromfile(f, dtype=dtype.newbyteorder('<'), count=count)
        if array.size != count:
            raise PartError('%s: expected %d values of %s, found %d'
                            % (self.path, count, name, array.size))
        return array.astype(dtype, copy=False).reshape(shape)

    def digest(self, name):
        """The sha256 (hex) of the array ``name``'s data bytes."""
        if name not in self._layout:
            raise PartError('%s: expected an array named %r, found none' % (self.path, name))
        shape, dtype, offset = self._layout[name]
        left = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        digest = hashlib.sha256()
        with open(self.path, 'rb') as f:
            f.seek(offset)
            while left:
                chunk = f.read(min(left, CHUNK))
                if not chunk:
                    raise PartError('%s: expected the data of %s, found it truncated'
                                    % (self.path, name))
                digest.update(chunk)
                left -= len(chunk)
        return digest.hexdigest()


def _mxnet_layout(path):
    """``{name: (shape, dtype, offset of its data)}`` of an MXNet ``.params`` file."""
    def take(f, fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise PartError('%s: expected an MXNet params file, found it truncated' % path)
        return struct.unpack(fmt, data)

    size = os.path.getsize(path)
    with open(path, 'rb') as f:
        magic, _, count = take(f, '<QQQ')
        if magic != _LIST_MAGIC:
            raise PartError('%s: expected an MXNet params file, found another kind' % path)
        arrays = []
        for _ in range(min(count, size)):
            magic, stype, ndim = take(f, '<IiI')
            if magic != _ARRAY_MAGIC or stype != 0 or ndim > MAX_NDIM:
                raise PartError('%s: expected dense arrays (MXNet\'s format 2), found another '
                                'kind' % path)
            shape = take(f, '<%dq' % ndim)
            _, _, flag = take(f, '<iii')
            if flag not in _DTYPES or any(d < 0 for d in shape):
                raise PartError('%s: expected arrays of MXNet\'s types, found type %d'
                                % (path, flag))
            arrays.append((tuple(shape), _DTYPES[flag], f.tell()))
            f.seek(int(np.prod(shape, dtype=np.int64)) * _DTYPES[flag].itemsize, os.SEEK_CUR)
            if f.tell() > size:
                raise PartError('%s: expected an MXNet params file, found it truncated' % path)
        (names,) = take(f, '<Q')
        if names != count:
            raise PartError('%s: expected a name for each of its %d arrays, found %d'
                            % (path, count, names))
        found = {}
        for entry in arrays:
            (length,) = take(f, '<Q')
            if length > MAX_NAME_BYTES:
                raise PartError('%s: expected array names, found one of %d bytes'
                                % (path, length))
            found[f.read(length).decode('utf-8', 'replace')] = entry
    return found
