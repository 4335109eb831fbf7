"""``python -m mp_symbolic``: see :mod:`mp_symbolic.training.cli`."""
import os
import sys

from .training.cli import main

if os.environ.get('DMLC_ROLE') == 'worker':
    # A dist_sync worker that leaves Python normally after an error waits in
    # ps-lite's exit barrier forever: end it at once (see launch.abort_on_error).
    from .tools.launch import abort_on_error
    with abort_on_error():
        sys.exit(main())
sys.exit(main())
