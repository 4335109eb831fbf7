"""``python -m mp_symbolic``: see :mod:`mp_symbolic.cli`."""
import sys

from .cli import main

sys.exit(main())
