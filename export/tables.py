"""Prediction inputs and outputs: ``.npy`` arrays and CSV tables.

Inputs are ``(samples, features)``: a 2-D ``.npy`` array, or CSV with one
sample per line and no header (blank lines and lines starting with ``#`` are
skipped), from a file or, for ``-``, from stdin. Values must be finite as
float32. Outputs are ``(samples, outputs)`` in the same two formats.
"""
import csv
import io
import os
import sys

import numpy as np

from mp_symbolic.checkpoint import atomic_path, write_text

from .errors import InputError, OutputError, one_line

__all__ = ['STDIN', 'read_features', 'output_format', 'format_csv', 'write_predictions']

STDIN = '-'
_CSV_SUFFIXES = ('.csv', '.txt')


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
    for lineno, fields in enumerate(csv.reader(io.StringIO(text)), 1):
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
                raise InputError('expected numbers, found %r in line %d, column %d of %s'
                                 % (field, lineno, col, where)) from None
        rows.append(row)
        lines.append(lineno)
    with np.errstate(over='ignore'):  # too large for float32: inf, reported below
        X = np.array(rows, dtype=np.float32).reshape(len(rows), width)
    return _check_rows(X, width, where, lambda row: 'line %d' % lines[row])


def _read_npy(path, width):
    try:
        X = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise InputError('%s is not a readable .npy array: %s'
                         % (path, one_line(err))) from None
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


def read_features(path, width):
    """Reads ``(samples, width)`` float32 features.

    Args:
        path: A ``.npy`` file, a ``.csv`` (or ``.txt``) file, or ``-`` for
            CSV on stdin.
        width: Features per sample the model expects.

    Raises:
        InputError: the file is missing or unreadable, of another kind, or
            not a non-empty table of ``width`` finite numbers per sample (the
            message says what was expected and what was found, and where).
    """
    if path == STDIN:
        return _read_csv(sys.stdin.read(), width, '<stdin>')
    if _suffix(path) not in ('.npy',) + _CSV_SUFFIXES:
        raise InputError('expected an input file ending in .npy or .csv (or - for CSV on '
                         'stdin), found %s' % path)
    if not os.path.isfile(path):
        raise InputError('expected an input file at %s, found none' % path)
    if _suffix(path) == '.npy':
        return _read_npy(path, width)
    try:
        with open(path, newline='') as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError('%s is not a readable CSV text file: %s' % (path, err)) from None
    return _read_csv(text, width, path)


def output_format(path):
    """``'npy'`` or ``'csv'`` for an output path, by its extension.

    Raises:
        OutputError: any other extension.
    """
    if _suffix(path) == '.npy':
        return 'npy'
    if _suffix(path) in _CSV_SUFFIXES:
        return 'csv'
    raise OutputError('expected an output file ending in .csv or .npy, found %s' % path)


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
