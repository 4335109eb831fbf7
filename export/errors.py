"""The exceptions of the export package, and how they are reported. All are
``ValueError``s: each one is a user-facing problem with a file or an input,
reported in one line (:func:`one_line`).

A message may show what a file holds only through :func:`excerpt` or
:func:`describe_start`: a short, printable quote, so that pointing a command
at an arbitrary file never copies that file's first line to the terminal.
"""

__all__ = ['one_line', 'excerpt', 'describe_start', 'describe_undecodable', 'library_message',
           'ExportError', 'VerificationError', 'ModelFileError', 'InputError', 'OutputError',
           'PredictionError', 'EXCERPT_LIMIT']

EXCERPT_LIMIT = 60  # characters of a file's content an error message may quote


class ExportError(ValueError):
    """A checkpoint or environment that the exporter cannot turn into files."""


class VerificationError(ExportError):
    """An export whose files failed a verification check; nothing was written."""


class ModelFileError(ValueError):
    """An exported model file that is missing, corrupt, or of an unknown kind."""


class InputError(ValueError):
    """Prediction inputs that are not a finite numeric (samples, features) table."""


class OutputError(ValueError):
    """A predictions output path of a kind that cannot be written."""


class PredictionError(ValueError):
    """Predictions that are not finite numbers; nothing was written."""


def one_line(err):
    """An error's message with its line breaks and runs of spaces folded."""
    return ' '.join(str(err).split())


def _printable(text):
    """``text`` with whitespace folded and other unprintable characters escaped."""
    return ''.join(c if c.isprintable() else ascii(c)[1:-1] for c in ' '.join(text.split()))


def excerpt(text, limit=EXCERPT_LIMIT):
    """A quotable excerpt of text read from a file: whitespace folded,
    unprintable characters escaped (``\\x00``, ``\\udcff``), at most
    ``limit`` characters (``...`` marks a cut), in quotes."""
    if isinstance(text, bytes):
        text = text.decode('utf-8', 'replace')
    text = _printable(text)
    if len(text) > limit:
        text = text[:limit - 3] + '...'
    return "'%s'" % text


def _looks_binary(data):
    sample = data[:512].decode('utf-8', 'replace')
    odd = sum(1 for c in sample if c == '\ufffd' or not (c.isprintable() or c in '\t\r\n'))
    return '\0' in sample or odd > len(sample) // 10


def describe_start(head):
    """What the first bytes of a file look like, for a "found ..." clause:
    ``an empty file``, ``binary data`` or ``text starting '...'`` (a
    20-character excerpt)."""
    if not head:
        return 'an empty file'
    if _looks_binary(head):
        return 'binary data'
    return 'text starting %s' % excerpt(head.decode('utf-8', 'replace'), 20)


def describe_undecodable(data, err):
    """A "found ..." clause for ``data`` that failed to decode as UTF-8 with
    ``err``: ``binary data (byte 0x9a at offset 77)`` or ``a byte that is not
    UTF-8 (0xe9 at offset 5)``."""
    if _looks_binary(data):
        return 'binary data (byte 0x%02x at offset %d)' % (data[err.start], err.start)
    return 'a byte that is not UTF-8 (0x%02x at offset %d)' % (data[err.start], err.start)


def library_message(err, limit=200):
    """The informative part of a third-party library's exception, in one
    printable line of at most about ``limit`` characters (MXNet's and
    onnxruntime's messages start with a C++ traceback or a status prefix; a
    long one keeps its start and its end, where the shapes usually are)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    line = lines[-1] if lines[0].startswith(('Traceback', 'Stack trace')) else ' '.join(lines)
    if line.startswith('MXNetError: '):
        line = line[len('MXNetError: '):]
    line = _printable(line)
    if len(line) > limit:
        line = '%s ... %s' % (line[:limit // 3], line[-(limit - limit // 3 - 5):])
    return line
