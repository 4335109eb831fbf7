"""``python -m mp_symbolic``: see :mod:`mp_symbolic.training.cli`."""
import os
import sys

from .tools.interrupts import end_process, exit_on_signals, ignore_signals, until_reader_gone
from .tools.startup import mxnet_without_sklearn

exit_on_signals()  # before MXNet loads: Ctrl-C or SIGTERM while starting is one line
mxnet_without_sklearn()  # MXNet loads as where scikit-learn is absent (tools/startup.py)
if sys.argv[1:2] != ['blas']:  # which reports the choice, and so makes none
    # OpenBLAS reads its kernel when MXNet loads: this process's and those it starts
    from .tools.blas import at_start
    at_start()
if not {'-h', '--help'} & set(sys.argv[1:]):  # a bad choice of op: one line, before any work
    from .core.base.checks import fused_adam_switch, fused_attention_switch, \
        fused_norm_switch, small_batch_dot_switch
    from .tools.cliargs import USAGE_ERROR, print_error
    try:
        fused_norm_switch()
        fused_adam_switch()
        small_batch_dot_switch()
        fused_attention_switch()
    except ValueError as err:
        print_error(err)
        sys.exit(USAGE_ERROR)
# pylint: disable=wrong-import-position
from .training.cli import main  # noqa: E402


def _run():
    status = until_reader_gone(main)
    # Done and written: a signal while MXNet shuts down would end the process silently.
    # (A worker may still wait in ps-lite's exit barrier: the launcher's SIGTERM must end it.)
    if os.environ.get('DMLC_ROLE') != 'worker':
        ignore_signals()
    return status


if os.environ.get('DMLC_ROLE') == 'worker':
    # A dist_sync worker that leaves Python normally after an error waits in
    # ps-lite's exit barrier forever: end it at once (see launch.abort_on_error).
    from .tools.launch import abort_on_error
    with abort_on_error():
        sys.exit(_run())
end_process(_run())
