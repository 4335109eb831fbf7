"""Process state changed for the length of a ``with`` block, then restored:
the environment MXNet reads at each bind or kvstore creation, and file
descriptor 2, where MXNet's C++ parts log past ``sys.stderr``. Standard
library only."""
from contextlib import contextmanager
import os
import sys
import tempfile

__all__ = []


#: ``{name: value MXNet reads as unset}`` of the variables set around MXNet
#: calls while MXNet's engine threads may be running operators that call
#: ``getenv`` (LayerNorm reads ``MXNET_SAFE_ACCUMULATION`` at every call).
#: Adding or removing an entry reallocates or shifts the C library's
#: environment array under such a read; replacing a value does not. Each gets
#: its entry once (:func:`hold_entries`), and :func:`environ` restores it to
#: this value rather than removing it.
HELD = {}


def hold_entries(**neutral):
    """Gives each variable of ``neutral`` an entry where it has none, with
    the value given (one MXNet reads as unset), and has :func:`environ`
    restore it to that value rather than remove it."""
    HELD.update(neutral)
    for key, value in neutral.items():
        os.environ.setdefault(key, value)


@contextmanager
def environ(**values):
    """Sets the environment variables ``values`` inside the block; restores
    each afterwards, removing those it added unless :data:`HELD`."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None and key in HELD:
                os.environ[key] = HELD[key]
            elif value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def captured_stderr():
    """Collects what is written to file descriptor 2 inside the block.

    Yields a list that holds the non-empty lines once the block has ended.
    """
    lines = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(line for line in sink.read().decode('utf-8', 'replace').splitlines()
                         if line.strip())


@contextmanager
def discarded_stderr():
    """Drops what is written to file descriptor 2 inside the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    sink = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(sink, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(sink)
