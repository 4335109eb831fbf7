"""One node process of the real networks' node test: ``python
tests/node_networks_worker.py --out F --nodes N --table T``.

For each network named in the table (a JSON list of
:data:`bench.node_networks.PLANS` names), trains it as
``python -m bench.node_networks`` does (``mx.random.seed(0)``, then
``fit(initializer=mx.init.Xavier())`` with Adam under 1F1B, its small
sizes) and writes what this process holds to ``F<k>_<rank>.npz``.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import node_networks  # pylint: disable=wrong-import-position


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--out', required=True)
    parser.add_argument('--nodes', type=int, default=None)
    parser.add_argument('--table', required=True)
    args = parser.parse_args()
    for k, name in enumerate(json.loads(args.table)):
        np.savez('%s%d_%s.npz' % (args.out, k, os.environ.get('RANK', '0')),
                 **node_networks.fitted(name, args.nodes, quick=True))


if __name__ == '__main__':
    main()
