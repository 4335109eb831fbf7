"""Prediction inputs and outputs: ``.npy`` arrays and CSV tables.

Inputs are a batch of samples: a ``.npy`` array ``(samples, features)`` or
``(samples,) + one sample's shape`` in the model's own rank (``(N, 3, H, W)``
images for a convolutional network), or CSV (UTF-8 text, ``.csv``) with one
sample per line, its features flattened, and no header (blank lines and
lines starting with ``#`` are skipped), from a file or, for ``-``, from
stdin. A CSV number is ASCII decimal or scientific notation (``-1.5``,
``2e-3``; ``nan`` and ``inf`` are read, then refused as not finite), and CSV
text holds at most :data:`~export.MAX_CSV_BYTES`. Values must be finite as
float32. Outputs are ``(samples, ...)`` of any rank: ``.npy`` keeps the
shape, CSV takes one or two dimensions (one sample per line), and they must
be finite too (:func:`check_predictions`).

A file is opened only if it is a regular file (:func:`open_regular`): a FIFO
would wait for a writer. A ``.npy`` header is read and checked against the
bytes there before anything is allocated (:func:`read_npy`).
"""
from array import array
import ast
import csv
import io
import os
import re
import stat
import sys
import zipfile
import zlib

import numpy as np

from mp_symbolic.tools.files import atomic_path, what_is, write_text

from . import MAX_CSV_BYTES, MAX_SAMPLE_ARRAYS, MAX_SAMPLE_BYTES
from .errors import (InputError, OutputError, PredictionError, describe_start,
                     describe_undecodable, excerpt, library_message)

__all__ = ['STDIN', 'read_features', 'read_npz', 'read_inputs', 'output_format', 'format_csv', 'write_predictions',
           'check_predictions', 'check_csv_rank', 'open_regular', 'read_npy', 'SUFFIXES']

STDIN = '-'
SUFFIXES = ('.csv', '.npy')  # of inputs and outputs alike
_NPY_MAGIC = b'\x93NUMPY'
_MAX_NPY_HEADER = 1 << 20  # numpy's own headers are a few hundred bytes
_NPY_KEYS = ('descr', 'fortran_order', 'shape')
# A CSV number: ASCII digits in decimal or scientific notation, or nan/inf as
# float() spells them. float() alone also reads '1_0' (as 10) and other
# scripts' digits ('\u0661' as 1).
_NUMBER_RE = re.compile(r'[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?|inf|infinity|nan)',
                        re.ASCII | re.IGNORECASE)
_ASCII_SPACE = ' \t\r\n\f\v'
_NUMBER_HINT = 'ASCII decimal or scientific notation, such as -1.5e3'


def features(shape):
    """Numbers per sample: the product of its shape."""
    return int(np.prod(shape))


def _suffix(path):
    return os.path.splitext(path)[1].lower()


def open_regular(path, expected):
    """The regular file at ``path``, opened for reading as a binary file.

    It is opened without waiting (``O_NONBLOCK``) and refused unless it is a
    regular file, so a FIFO, which would block until some process writes to
    it, a folder or a device is refused at once.

    Args:
        expected: What the file should be, for the message (``'an input
            file'``).

    Raises:
        InputError: nothing there, not a regular file, or not readable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InputError('expected %s at %s, found none' % (expected, path)) from None
    except OSError as err:
        raise InputError('%s is not a readable file: %s' % (path, err.strerror or err)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError('expected %s at %s, found %s'
                         % (expected, path, what_is(os.path.realpath(path))))
    return os.fdopen(fd, 'rb')


def _position(index, row_name=None):
    """``row 3, column 2`` of a 0-based index (``row 3`` for a 1-D batch,
    ``row 3, position (0, 1, 2)`` for more axes); ``row_name(0-based row)``
    names the row otherwise (``line 7`` of a CSV file)."""
    row = row_name(index[0]) if row_name is not None else 'row %d' % (index[0] + 1)
    if len(index) == 1:
        return row
    if len(index) == 2:
        return '%s, column %d' % (row, index[1] + 1)
    return '%s, position %s' % (row, tuple(int(i) for i in index[1:]))


def _check_rows(X, width, where, row_name=None):
    if len(X) == 0:
        raise InputError('expected at least one sample of %d features, found none in %s'
                         % (width, where))
    bad = np.argwhere(~np.isfinite(X))
    if len(bad):
        index = tuple(bad[0])
        raise InputError('expected finite numbers (as float32), found %s at %s of %s'
                         % (X[index], _position(index, row_name), where))
    return X


def _bad_field(fields, lineno, where):
    """The first field of a line that is not a CSV number, as an InputError."""
    for col, field in enumerate(fields, 1):
        number = field.strip(_ASCII_SPACE)
        if not _NUMBER_RE.fullmatch(number):
            return InputError('expected numbers, found %s in line %d, column %d of %s (%s)'
                              % (excerpt(field), lineno, col, where, _NUMBER_HINT))
    return None


def _read_csv(text, width, where):
    values, lines = array('d'), array('q')  # 8 bytes a number, not a Python float each
    # In ASCII text without '_', float() reads exactly the CSV numbers; else
    # each field is matched first (float() reads '1_0' and other scripts' digits).
    strict = not text.isascii() or '_' in text
    reader = csv.reader(io.StringIO(text))
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            break
        except csv.Error as err:  # e.g. a field over csv's 128 KiB limit
            raise InputError('expected CSV, found %s in line %d of %s'
                             % (err, reader.line_num, where)) from None
        lineno = reader.line_num
        if not fields or not ''.join(fields).strip() or fields[0].lstrip().startswith('#'):
            continue
        if len(fields) != width:
            raise InputError('expected %d features per line, found %d in line %d of %s'
                             % (width, len(fields), lineno, where))
        bad = _bad_field(fields, lineno, where) if strict else None
        if bad is None:
            try:
                values.extend(map(float, fields))
            except ValueError:
                bad = _bad_field(fields, lineno, where)
        if bad is not None:
            raise bad
        lines.append(lineno)
    with np.errstate(over='ignore'):  # too large for float32: inf, reported below
        X = np.frombuffer(values, dtype=np.float64).astype(np.float32).reshape(len(lines), width)
    return _check_rows(X, width, where, lambda row: 'line %d' % lines[row])


def _read_exactly(f, count, where, what):
    data = f.read(count)
    if len(data) < count:
        raise InputError('%s: expected %s of %d bytes, found %d' % (where, what, count, len(data)))
    return data


def _parse_npy_header(text, where):
    """``(shape, fortran_order, dtype)`` of a ``.npy`` header's text, read as
    numpy writes it: a dict literal of ``descr``, ``fortran_order`` and
    ``shape`` (numpy's own reader raises ``tokenize.TokenError``,
    ``SyntaxError`` or a ``ValueError`` quoting the whole header instead)."""
    try:
        header = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        header = None
    if not isinstance(header, dict) or sorted(header) != sorted(_NPY_KEYS):
        raise InputError('%s: expected a .npy header (a dict of %s), found %s'
                         % (where, ', '.join(_NPY_KEYS), excerpt(text)))
    shape, fortran = header['shape'], header['fortran_order']
    if not (isinstance(shape, tuple) and all(type(d) is int for d in shape)) \
            or not isinstance(fortran, bool):
        raise InputError('%s: expected a .npy header with a shape of integers, found %s'
                         % (where, excerpt(text)))
    try:
        dtype = np.lib.format.descr_to_dtype(header['descr'])
    except (ValueError, TypeError, KeyError, IndexError):
        raise InputError('%s: expected a .npy header with a numpy dtype, found %s'
                         % (where, excerpt(repr(header['descr'])))) from None
    return shape, fortran, dtype


def read_npy(f, where, size, check_shape=None):
    """The array of a ``.npy`` stream, its header checked before anything is allocated.

    numpy allocates what a header claims before it reads a byte: a header
    claiming 10**12 rows would be a MemoryError, or worse, a machine that
    swaps. Here the header is parsed first (a garbled or truncated one is
    one line), the dtype must be numeric (an ``object`` array is a pickle),
    ``check_shape`` may refuse the shape, and the bytes the header claims
    must be among the ``size`` bytes of the stream.

    Args:
        f: A binary stream at the array's first byte (a file, or a member
            of a ``.npz``).
        where: The file (or ``FILE member NAME``), for messages.
        size: The stream's bytes (a file's size, a zip member's
            ``file_size``).
        check_shape: Called with the header's shape; raises to refuse it.

    Returns:
        The array (numeric, of the header's dtype and shape).

    Raises:
        InputError: not a ``.npy`` array of format 1.0 or 2.0, a header
            that does not parse, a dtype that is not numeric, a shape
            ``check_shape`` refuses, or fewer bytes than claimed.
    """
    head = f.read(12)  # the magic, the version and the header's length
    if not head.startswith(_NPY_MAGIC):
        raise InputError('%s is not a .npy array: expected it to start with %r, found %s'
                         % (where, _NPY_MAGIC, describe_start(head + f.read(52))))
    version = tuple(head[6:8])
    if version not in ((1, 0), (2, 0)):  # 3.0 only differs for structured dtypes
        raise InputError('%s: expected a .npy array of format 1.0 or 2.0, found %s'
                         % (where, '%d.%d' % version if len(version) == 2
                            else 'a file of %d bytes' % len(head)))
    start = 10 if version == (1, 0) else 12
    if len(head) < start:
        raise InputError('%s: expected a .npy header, found a file of %d bytes'
                         % (where, len(head)))
    header_bytes = int.from_bytes(head[8:start], 'little')
    if header_bytes > _MAX_NPY_HEADER:
        raise InputError('%s: expected a .npy header of at most %d bytes, found one of %d'
                         % (where, _MAX_NPY_HEADER, header_bytes))
    text = head[start:] + f.read(start + header_bytes - len(head))
    if len(text) < header_bytes:
        raise InputError('%s: expected a .npy header of %d bytes, found %d'
                         % (where, header_bytes, len(text)))
    text = text.decode('latin1')
    shape, fortran, dtype = _parse_npy_header(text, where)
    if dtype.kind not in 'iuf':  # object arrays are pickles: their size says nothing
        raise InputError('expected a numeric array in %s, found dtype %s in its header'
                         % (where, dtype))
    if check_shape is not None:
        check_shape(shape)
    if any(d < 0 for d in shape):
        raise InputError('expected an array of a shape of sizes >= 0 in %s, found shape %s in '
                         'its header' % (where, shape))
    claimed = int(np.prod(shape, dtype=object)) * dtype.itemsize  # Python ints: no overflow
    present = size - start - header_bytes
    if claimed > present:
        raise InputError('%s: expected the %d bytes its header claims (shape %s, %s), found %d'
                         % (where, claimed, shape, dtype, max(present, 0)))
    data = _read_exactly(f, claimed, where, 'the array its header claims')
    return np.frombuffer(data, dtype=dtype).reshape(shape, order='F' if fortran else 'C')


def _read_npy(path, width, shape=None):
    """A ``.npy`` batch: ``(samples, width)``, or ``(samples,) + shape``."""
    shape = None if shape is None else tuple(shape)

    def check_shape(found):
        ok = (len(found) == 2 and found[1] == width) or (shape is not None
                                                         and tuple(found[1:]) == shape)
        if not ok or not found or found[0] < 0:
            raise InputError('expected an array of shape (samples, %d)%s in %s, found shape %s '
                             'in its header' % (width, _or_shape(shape), path, found))

    with open_regular(path, 'an input file') as f:
        try:
            X = read_npy(f, path, os.fstat(f.fileno()).st_size, check_shape)
        except OSError as err:
            raise InputError('%s is not a readable .npy array: %s'
                             % (path, library_message(err))) from None
    with np.errstate(over='ignore'):
        X = X.astype(np.float32)
    return _check_rows(X, width, path)


def read_npz(path):
    """A ``.npz`` file (``numpy.savez``) -> ``{array name: array}``, in the
    file's order.

    What the file may hold is checked from its zip headers before any member
    is read: at most :data:`~export.MAX_SAMPLE_ARRAYS` members, all ``.npy``,
    declaring at most :data:`~export.MAX_SAMPLE_BYTES` decompressed in all
    (a zip bomb of a few KB declaring gigabytes is refused unread); then each
    member's ``.npy`` header, against its declared size, before its array
    is allocated (:func:`read_npy`). A FIFO is refused unopened; nothing is
    unpickled.

    Raises:
        InputError: not a readable ``.npz`` of numeric arrays within those
            bounds.
    """
    try:
        with open_regular(path, 'a .npz file') as f, zipfile.ZipFile(f) as npz:
            members = npz.infolist()
            names = [m.filename for m in members]
            if len(members) > MAX_SAMPLE_ARRAYS:
                raise InputError('expected at most %d arrays (one per input) in %s, found %d: '
                                 '%s' % (MAX_SAMPLE_ARRAYS, path, len(members),
                                         excerpt(', '.join(names))))
            odd = [n for n in names if not n.endswith('.npy')]
            if odd or len(set(names)) != len(names):
                raise InputError('expected one .npy member per input in %s (as numpy.savez '
                                 'writes them), found %s'
                                 % (path, 'members %s' % excerpt(', '.join(odd)) if odd else
                                    'a name given twice'))
            declared = sum(m.file_size for m in members)
            if declared > MAX_SAMPLE_BYTES:
                raise InputError('expected arrays of at most %d MiB in all in %s, found '
                                 'members declaring %d bytes decompressed'
                                 % (MAX_SAMPLE_BYTES >> 20, path, declared))
            arrays = {}
            for member in members:
                where = '%s member %s' % (path, excerpt(member.filename))
                with npz.open(member) as stream:
                    arrays[member.filename[:-len('.npy')]] = read_npy(stream, where,
                                                                      member.file_size)
            return arrays
    except (OSError, EOFError, RuntimeError, NotImplementedError, zipfile.BadZipFile,
            zlib.error) as err:  # RuntimeError: an encrypted member; NotImplementedError: a method
        raise InputError('expected a readable .npz file at %s, found %s'
                         % (path, library_message(err))) from None


def read_inputs(path, names):
    """A ``.npz`` of one batch per input of a model, named as its inputs
    (``data0``, ``data1``, ...) -> the arrays in ``names``' order.

    Raises:
        InputError: see :func:`read_npz`; an input without its array, an
            array named as no input, an empty batch or one of numbers that
            are not finite (as float32).
    """
    arrays = read_npz(path)
    missing = [n for n in names if n not in arrays]
    extra = [n for n in arrays if n not in names]
    if missing or extra:
        raise InputError('expected one array per input of the model in %s, named %s, found %s '
                         '(%s)' % (path, ', '.join(names),
                                   'arrays %s' % excerpt(', '.join(arrays)) if arrays else 'none',
                                   '; '.join(part for part in (
                                       missing and '%s missing' % ', '.join(missing),
                                       extra and '%s not an input' % excerpt(', '.join(extra)))
                                       if part)))
    checked = []
    for name in names:
        X = arrays[name]
        where = '%s member %s' % (path, name)
        if X.ndim < 1:
            raise InputError('expected a batch, (samples, ...), in %s, found a scalar' % where)
        with np.errstate(over='ignore'):
            _check_rows(X.astype(np.float32), features(X.shape[1:]), where)
        checked.append(X)
    return checked


def _or_shape(shape):
    """`` or (samples,) + (3, 8, 8)`` for a sample of more than one axis, else ''."""
    return '' if shape is None or len(shape) <= 1 else ' or (samples,) + %s' % (shape,)


def _decode(data, where):
    try:
        return data.decode('utf-8-sig')
    except UnicodeDecodeError as err:
        raise InputError('expected CSV text (UTF-8) in %s, found %s'
                         % (where, describe_undecodable(data, err))) from None


def _too_much_csv(where):
    return InputError('expected CSV of at most %d MiB in %s, found more (a larger input goes in '
                      'a .npy file)' % (MAX_CSV_BYTES >> 20, where))


def _read_stdin():
    if sys.stdin is None:  # started with stdin closed (<&-)
        raise InputError('--input -: expected CSV on stdin, found stdin closed')
    try:
        if hasattr(sys.stdin, 'buffer'):
            data = sys.stdin.buffer.read(MAX_CSV_BYTES + 1)
        else:
            data = sys.stdin.read(MAX_CSV_BYTES + 1).encode('utf-8', 'surrogateescape')
    except OSError as err:
        raise InputError('--input -: expected CSV on stdin, found stdin not readable: %s'
                         % (err.strerror or err)) from None
    if len(data) > MAX_CSV_BYTES:  # an endless stream (yes 1,2 | ...) ends here
        raise _too_much_csv('<stdin>')
    return _decode(data, '<stdin>')


def read_features(path, width, shape=None):
    """Reads a batch of float32 features.

    Args:
        path: A ``.npy`` file, a ``.csv`` file, or ``-`` for CSV on stdin.
        width: Features per sample the model expects.
        shape: One sample's shape; a ``.npy`` may then be ``(samples,) +
            shape`` too (``(N, 3, 64, 64)`` images), and CSV rows are
            reshaped to it. ``None``: ``(samples, width)`` only.

    Returns:
        ``(samples, width)``, or ``(samples,) + shape`` if ``shape`` is given.

    Raises:
        InputError: the file is missing, not a regular file (a FIFO) or
            unreadable, of another kind, more CSV than
            :data:`~export.MAX_CSV_BYTES`, or not a non-empty batch of
            finite numbers of that shape (the message says what was
            expected and what was found, and where; it quotes at most a
            short excerpt of the file).
    """
    if path == STDIN:
        X = _read_csv(_read_stdin(), width, '<stdin>')
    elif _suffix(path) not in SUFFIXES:
        raise InputError('expected an input file ending in .npy or .csv (or - for CSV on '
                         'stdin, or .npz of one batch per input by name), found %s' % path)
    elif _suffix(path) == '.npy':
        X = _read_npy(path, width, shape)
    else:
        with open_regular(path, 'an input file') as f:
            if os.fstat(f.fileno()).st_size > MAX_CSV_BYTES:
                raise _too_much_csv(path)
            try:
                data = f.read(MAX_CSV_BYTES + 1)
            except OSError as err:
                raise InputError('%s is not a readable file: %s'
                                 % (path, err.strerror or err)) from None
        if len(data) > MAX_CSV_BYTES:
            raise _too_much_csv(path)
        X = _read_csv(_decode(data, path), width, path)
    if shape is not None and X.shape[1:] != tuple(shape):
        X = X.reshape((len(X),) + tuple(shape))
    return X


def output_format(path):
    """``'npy'`` or ``'csv'`` for an output path, by its extension.

    Raises:
        OutputError: any other extension (``.txt`` included: the text written
            is CSV, and the name should say so).
    """
    if _suffix(path) in SUFFIXES:
        return _suffix(path)[1:]
    raise OutputError('--output: expected an output file ending in .csv or .npy, found %s'
                      % path)


def check_csv_rank(ndim, where='CSV'):
    """Raises unless predictions of ``ndim`` dimensions (the batch's
    included) can be CSV: one sample per line, so one or two.

    Raises:
        OutputError: more dimensions; the message points to ``.npy``.
    """
    if ndim > 2:
        raise OutputError('expected predictions of shape (samples,) or (samples, outputs) for '
                          '%s (one sample per line), found %d dimensions: write them with '
                          '--output FILE.npy, which keeps their shape' % (where, ndim))


def format_csv(Y):
    """``(samples, outputs)`` or ``(samples,)`` -> CSV text, one sample per
    line, float32 precision.

    Raises:
        OutputError: ``Y`` has more than two dimensions (:func:`check_csv_rank`).
    """
    Y = np.asarray(Y)
    check_csv_rank(Y.ndim)
    if Y.ndim < 2:
        Y = Y.reshape(len(Y), 1)
    return ''.join(','.join('%.9g' % v for v in row) + '\n' for row in Y)


def write_predictions(path, Y):
    """Writes predictions atomically, as ``.npy`` (any shape) or CSV (one or
    two dimensions) by ``path``'s extension.

    Raises:
        OutputError: see :func:`output_format` and :func:`check_csv_rank`.
    """
    if output_format(path) == 'npy':
        with atomic_path(path) as tmp:
            with open(tmp, 'wb') as f:
                np.save(f, np.asarray(Y))
    else:
        write_text(path, format_csv(Y))


def check_predictions(Y, X, where):
    """Raises unless every prediction is a finite number.

    Args:
        Y: ``(samples, ...)`` predictions.
        X: The ``(samples, ...)`` inputs they were computed from.
        where: Where ``X`` came from, for the message.

    Raises:
        PredictionError: NaN or inf among the predictions (a parameter that
            is not finite, or an input so large that the network overflows
            float32); the message gives their count and the first input
            sample that produced one.
    """
    bad = ~np.isfinite(np.asarray(Y, dtype=np.float64))
    if bad.any():
        row = int(np.argwhere(bad)[0][0])
        sample = np.asarray(X, dtype=np.float32)[row].ravel()[:32]  # enough for the excerpt
        raise PredictionError(
            'expected finite predictions, found %d of %d outputs not finite (NaN or inf); the '
            'first for input sample %d of %s: %s' % (
                bad.sum(), bad.size, row + 1, where,
                excerpt(','.join(str(v) for v in sample))))
