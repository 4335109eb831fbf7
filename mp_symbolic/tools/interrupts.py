"""Ctrl-C and SIGTERM as one line, from a command's first instant.

Python turns SIGINT into ``KeyboardInterrupt`` wherever it lands. In the
seconds a command spends importing MXNet or onnx, before its own ``except
KeyboardInterrupt`` is in place, that is a traceback through the import
machinery; and SIGTERM ends a process with no word at all. The entry points
(``python -m mp_symbolic``, ``python -m export``, ``python -m
export.predict``) call :func:`exit_on_signals` first, before the heavy
imports: a signal then prints one line and ends the process at once, which
is safe because nothing has been written yet. Where the command's own
handling starts, :func:`interrupt_on_signals` makes both signals raise
``KeyboardInterrupt`` again, which the command reports in one line. Once the
command has returned, :func:`ignore_signals` lets the process exit: Python
restores the default actions while it shuts down, and a signal in MXNet's
teardown would otherwise end the process with no word, or print an ignored
``KeyboardInterrupt`` from a destructor.

Only the standard library is imported here.
"""
import atexit
import os
import signal
import sys
import threading

__all__ = ['exit_on_signals', 'interrupt_on_signals', 'ignore_signals', 'exit_status',
           'Terminated', 'until_reader_gone', 'READER_GONE', 'end_process']

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Signals ignored when the process started (a background job of a script ignores
# SIGINT): they stay ignored, as Python itself leaves them.
_IGNORED = {s for s in SIGNALS if signal.getsignal(s) == signal.SIG_IGN}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where SIGINT would raise ``KeyboardInterrupt``."""


def _write_line(text):
    try:
        os.write(2, ('error: %s\n' % text).encode('utf-8', 'backslashreplace'))
    except OSError:
        pass  # stderr is gone: the exit status still tells


def exit_on_signals(what='interrupted before any work; nothing was written'):
    """From now on SIGINT and SIGTERM print ``error: <what> (<signal>)`` and end
    the process with status 128 + the signal number, without unwinding."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, _frame):
        _write_line('%s (%s)' % (what, signal.Signals(signum).name))
        os._exit(128 + signum)  # pylint: disable=protected-access

    for signum in SIGNALS:
        if signum not in _IGNORED:
            signal.signal(signum, handler)


def _terminate(signum, _frame):
    raise Terminated('SIGTERM')


_PENDING = []  # the interrupt a destructor swallowed, to raise again (see _redeliver_interrupts)
REDELIVER_AFTER = 0.01  # seconds


def _raise_pending(_signum, _frame):
    raise _PENDING.pop() if _PENDING else KeyboardInterrupt()


def _redeliver_interrupts(hook):
    """A ``sys.unraisablehook`` for a ``KeyboardInterrupt`` raised where
    Python cannot raise it, in a destructor (MXNet's ``NDArray.__del__``):
    instead of printing it as ignored, raises it again 10 ms later (SIGALRM),
    most likely in ordinary code (else once more)."""
    def unraisable(info):
        if info.exc_type is not None and issubclass(info.exc_type, KeyboardInterrupt):
            _PENDING[:] = [Terminated('SIGTERM') if issubclass(info.exc_type, Terminated)
                           else KeyboardInterrupt()]
            signal.signal(signal.SIGALRM, _raise_pending)
            signal.setitimer(signal.ITIMER_REAL, REDELIVER_AFTER)
            return
        hook(info)
    unraisable.redelivers = True
    return unraisable


def interrupt_on_signals():
    """From now on SIGINT raises ``KeyboardInterrupt`` and SIGTERM raises
    :class:`Terminated` (one), for the command's own handler to report. One
    that lands in a destructor is sent again, instead of printed as ignored.

    In a ``dist_sync`` worker (``DMLC_ROLE=worker``) SIGTERM keeps its default
    action: the launcher stops a job with it, and a worker blocked inside
    ps-lite would only run a Python handler once the launcher gives up and
    sends SIGKILL. Called from another thread than the main one, it does
    nothing (only the main thread may set handlers).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if not getattr(sys.unraisablehook, 'redelivers', False):
        sys.unraisablehook = _redeliver_interrupts(sys.unraisablehook)
    if signal.SIGINT not in _IGNORED:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.SIGTERM not in _IGNORED:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if os.environ.get('DMLC_ROLE') == 'worker'
                      else _terminate)


def ignore_signals():
    """From now on SIGINT and SIGTERM are ignored: for a process whose work is
    done and written, while it exits."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.setitimer(signal.ITIMER_REAL, 0)  # no interrupt to raise again, either
    for signum in SIGNALS + (signal.SIGALRM,):
        signal.signal(signum, signal.SIG_IGN)


def exit_status(interrupt):
    """128 + the signal number behind a ``KeyboardInterrupt``: 143 for
    :class:`Terminated`, 130 otherwise."""
    return 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)



READER_GONE = 128 + signal.SIGPIPE  # the status of a shell tool ended by its reader


def until_reader_gone(run):
    """``run()``'s status; when the reader of standard output has gone (``| head``),
    :data:`READER_GONE` with no traceback, and no second error while Python
    flushes the closed stream at exit."""
    try:
        status = run()
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return READER_GONE


def end_process(status):
    """Ends the process with ``status`` once its work is done: its other
    non-daemon threads joined, the exit handlers run (MXNet's engine
    shutdown, leaving the node group), the streams flushed; without the
    collection of every object that Python's own finalisation makes after
    that, which takes seconds once torch and MXNet are loaded and writes
    nothing. Not for a ``dist_sync`` worker, whose kvstore leaves ps-lite
    when Python finalises."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed, or its reader gone: the status still tells
    os._exit(status)  # pylint: disable=protected-access
