"""Prediction inputs and outputs: ``.npy`` arrays and CSV tables.

Inputs are ``(samples, features)``: a 2-D ``.npy`` array, or CSV (UTF-8
text, ``.csv``) with one sample per line and no header (blank lines and lines
starting with ``#`` are skipped), from a file or, for ``-``, from stdin.
Values must be finite as float32. Outputs are ``(samples, outputs)`` in the
same two formats, and must be finite too (:func:`check_predictions`).
"""
import csv
import io
import os
import sys

import numpy as np

from mp_symbolic.tools.files import atomic_path, write_text

from .errors import (InputError, OutputError, PredictionError, describe_start,
                     describe_undecodable, excerpt, library_message)

__all__ = ['STDIN', 'read_features', 'output_format', 'format_csv', 'write_predictions',
           'check_predictions', 'SUFFIXES']

STDIN = '-'
SUFFIXES = ('.csv', '.npy')  # of inputs and outputs alike
_NPY_MAGIC = b'\x93NUMPY'
_MAX_NPY_HEADER = 1 << 20  # numpy's own headers are a few hundred bytes


def features(shape):
    """Numbers per sample: the product of its shape."""
    return int(np.prod(shape))


def _suffix(path):
    return os.path.splitext(path)[1].lower()


def _check_rows(X, width, where, line_of_row):
    if len(X) == 0:
        raise InputError('expected at least one sample of %d features, found none in %s'
                         % (width, where))
    bad = np.argwhere(~np.isfinite(X))
    if len(bad):
        row, col = bad[0]
        raise InputError('expected finite numbers (as float32), found %s at %s, column %d of %s'
                         % (X[row, col], line_of_row(row), col + 1, where))
    return X


def _read_csv(text, width, where):
    rows, lines = [], []
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
        row = []
        for col, field in enumerate(fields, 1):
            try:
                row.append(float(field))
            except ValueError:
                raise InputError('expected numbers, found %s in line %d, column %d of %s'
                                 % (excerpt(field), lineno, col, where)) from None
        rows.append(row)
        lines.append(lineno)
    with np.errstate(over='ignore'):  # too large for float32: inf, reported below
        X = np.array(rows, dtype=np.float32).reshape(len(rows), width)
    return _check_rows(X, width, where, lambda row: 'line %d' % lines[row])


def _check_npy_header(f, path, width):
    """Reads a ``.npy`` header from ``f`` and checks it against the file's size.

    Numpy allocates what the header claims before it reads a byte: a header
    claiming 10**12 rows would be a MemoryError, or worse, a machine that
    swaps. The shape must be 2-D with ``width`` columns and no negative size,
    and the data it claims must be in the file.
    """
    head = f.read(64)  # the magic and the header's length; more, to describe a stranger
    if not head.startswith(_NPY_MAGIC):
        raise InputError('%s is not a .npy array: expected it to start with %r, found %s'
                         % (path, _NPY_MAGIC, describe_start(head)))
    version = tuple(head[6:8])
    if version == (1, 0):
        header_bytes = int.from_bytes(head[8:10], 'little')
    elif version == (2, 0):
        header_bytes = int.from_bytes(head[8:12], 'little')
    else:  # 3.0 only differs for structured dtypes, which are not features
        raise InputError('%s: expected a .npy array of format 1.0 or 2.0, found %d.%d'
                         % (path, version[0], version[1]))
    if header_bytes > _MAX_NPY_HEADER:
        raise InputError('%s: expected a .npy header of at most %d bytes, found one of %d'
                         % (path, _MAX_NPY_HEADER, header_bytes))
    f.seek(0)
    np.lib.format.read_magic(f)
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                   else np.lib.format.read_array_header_2_0)
    shape, _, dtype = read_header(f)
    if dtype.kind not in 'iuf':  # object arrays are pickles: their size says nothing
        raise InputError('expected a numeric array in %s, found dtype %s in its header'
                         % (path, dtype))
    if len(shape) != 2 or shape[1] != width or shape[0] < 0:
        raise InputError('expected an array of shape (samples, %d) in %s, found shape %s in '
                         'its header' % (width, path, shape))
    claimed = shape[0] * shape[1] * dtype.itemsize
    present = os.fstat(f.fileno()).st_size - f.tell()
    if claimed > present:
        raise InputError('%s: expected the %d bytes its header claims (shape %s, %s), found %d'
                         % (path, claimed, shape, dtype, present))


def _read_npy(path, width):
    try:
        with open(path, 'rb') as f:
            _check_npy_header(f, path, width)
        X = np.load(path, allow_pickle=False)
    except (OSError, EOFError) as err:
        raise InputError('%s is not a readable .npy array: %s'
                         % (path, library_message(err))) from None
    except ValueError as err:
        if isinstance(err, InputError):
            raise
        raise InputError('%s is not a readable .npy array: %s'
                         % (path, library_message(err))) from None
    if not isinstance(X, np.ndarray) or not (np.issubdtype(X.dtype, np.integer)
                                             or np.issubdtype(X.dtype, np.floating)):
        raise InputError('expected a numeric array in %s, found dtype %s'
                         % (path, getattr(X, 'dtype', type(X).__name__)))
    if X.ndim != 2 or X.shape[1] != width:
        raise InputError('expected an array of shape (samples, %d) in %s, found shape %s'
                         % (width, path, X.shape))
    with np.errstate(over='ignore'):
        X = X.astype(np.float32)
    return _check_rows(X, width, path, lambda row: 'row %d' % (row + 1))


def _decode(data, where):
    try:
        return data.decode('utf-8-sig')
    except UnicodeDecodeError as err:
        raise InputError('expected CSV text (UTF-8) in %s, found %s'
                         % (where, describe_undecodable(data, err))) from None


def _read_stdin():
    if sys.stdin is None:  # started with stdin closed (<&-)
        raise InputError('--input -: expected CSV on stdin, found stdin closed')
    try:
        if hasattr(sys.stdin, 'buffer'):
            return _decode(sys.stdin.buffer.read(), '<stdin>')
        return sys.stdin.read()
    except OSError as err:
        raise InputError('--input -: expected CSV on stdin, found stdin not readable: %s'
                         % (err.strerror or err)) from None


def read_features(path, width):
    """Reads ``(samples, width)`` float32 features.

    Args:
        path: A ``.npy`` file, a ``.csv`` file, or ``-`` for CSV on stdin.
        width: Features per sample the model expects.

    Raises:
        InputError: the file is missing or unreadable, of another kind, or
            not a non-empty table of ``width`` finite numbers per sample (the
            message says what was expected and what was found, and where;
            it quotes at most a short excerpt of the file).
    """
    if path == STDIN:
        return _read_csv(_read_stdin(), width, '<stdin>')
    if _suffix(path) not in SUFFIXES:
        raise InputError('expected an input file ending in .npy or .csv (or - for CSV on '
                         'stdin), found %s' % path)
    if not os.path.isfile(path):
        raise InputError('expected an input file at %s, found none' % path)
    if _suffix(path) == '.npy':
        return _read_npy(path, width)
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except OSError as err:
        raise InputError('%s is not a readable file: %s' % (path, err.strerror or err)) from None
    return _read_csv(_decode(data, path), width, path)


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


def format_csv(Y):
    """``(samples, outputs)`` -> CSV text, one sample per line, float32 precision."""
    return ''.join(','.join('%.9g' % v for v in row) + '\n' for row in np.asarray(Y))


def write_predictions(path, Y):
    """Writes predictions atomically, as ``.npy`` or CSV by ``path``'s extension.

    Raises:
        OutputError: see :func:`output_format`.
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
        Y: ``(samples, outputs)`` predictions.
        X: The ``(samples, features)`` inputs they were computed from.
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
        raise PredictionError(
            'expected finite predictions, found %d of %d outputs not finite (NaN or inf); the '
            'first for input sample %d of %s: %s' % (
                bad.sum(), bad.size, row + 1, where,
                excerpt(','.join(str(v) for v in np.asarray(X, dtype=np.float32)[row]))))
