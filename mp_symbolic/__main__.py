"""``python -m mp_symbolic``: see :mod:`mp_symbolic.cli`."""
import os
import sys

from .interrupts import exit_on_signals

exit_on_signals()  # before MXNet loads: Ctrl-C or SIGTERM while starting is one line
# pylint: disable=wrong-import-position
from .cli import main  # noqa: E402


def _run():
    status = main()
    if os.environ.get('DMLC_ROLE') != 'worker':  # a worker may wait in ps-lite's exit barrier
        exit_on_signals('interrupted while exiting')
    return status


if os.environ.get('DMLC_ROLE') == 'worker':
    # A dist_sync worker that leaves Python normally after an error waits in
    # ps-lite's exit barrier forever: end it at once (see launch.abort_on_error).
    from .launch import abort_on_error
    with abort_on_error():
        sys.exit(_run())
sys.exit(_run())
