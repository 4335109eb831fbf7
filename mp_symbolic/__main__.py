"""``python -m mp_symbolic``: see :mod:`mp_symbolic.training.cli`."""
import atexit
import os
import sys
import threading

from .tools.interrupts import exit_on_signals, ignore_signals, until_reader_gone

exit_on_signals()  # before MXNet loads: Ctrl-C or SIGTERM while starting is one line
if sys.argv[1:2] != ['blas']:  # which reports the choice, and so makes none
    # OpenBLAS reads its kernel when MXNet loads: this process's and those it starts
    from .tools.blas import at_start
    at_start()
# pylint: disable=wrong-import-position
from .training.cli import main  # noqa: E402


def _run():
    status = until_reader_gone(main)
    # Done and written: a signal while MXNet shuts down would end the process silently.
    # (A worker may still wait in ps-lite's exit barrier: the launcher's SIGTERM must end it.)
    if os.environ.get('DMLC_ROLE') != 'worker':
        ignore_signals()
    return status


def _exit(status):
    """Ends the process once its work is done: its threads joined, the exit
    handlers run (MXNet's engine shutdown, leaving the node group), the
    streams flushed; without the collection of every object that Python's
    own finalisation makes after that, which takes seconds once torch and
    MXNet are loaded and writes nothing."""
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


if os.environ.get('DMLC_ROLE') == 'worker':
    # A dist_sync worker that leaves Python normally after an error waits in
    # ps-lite's exit barrier forever: end it at once (see launch.abort_on_error).
    from .tools.launch import abort_on_error
    with abort_on_error():
        sys.exit(_run())
_exit(_run())
