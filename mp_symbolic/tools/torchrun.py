"""``python -m mp_symbolic.tools.torchrun ...``: PyTorch's ``torchrun``, for an
environment where torch lives apart from GluonCV (``.venv/torch-site``, see
:mod:`mp_symbolic.core.transport.nodes`), where the ``torchrun`` of torch's own
install cannot import torch. The arguments are torchrun's, unchanged::

    python -m mp_symbolic.tools.torchrun --nnodes 1 --nproc-per-node 2 \\
        --max-restarts 1 -m mp_symbolic train --nodes 2 ...

Where torch is installed as usual, ``torchrun`` itself does the same.
"""
import sys

from ..core.transport.nodes import NodeError, torch

__all__ = []


def main():
    try:
        run = torch('distributed.run')
    except NodeError as err:
        print('error: %s' % err, file=sys.stderr)
        return 2
    run.main()
    return 0


if __name__ == '__main__':
    sys.exit(main())
