"""``python -m bench.graphcut``: how the whole-network cut balances and what
crosses its boundaries, for a few model-zoo networks.

For each network and device count: its ops, the ops per stage of the cut
:class:`mp_symbolic.Pipeline` chooses (parameter-count balance), the
activation bytes per sample crossing each boundary, the same for the tightest
cut (the smallest largest stage, bytes ignored), the largest stage of each,
and how long the cut took.
"""

import mxnet as mx
from mxnet.gluon.model_zoo import vision
import numpy as np

from mp_symbolic import Pipeline
from mp_symbolic.core.graph import graphcut
from mp_symbolic.core.base import timing
from mp_symbolic.core.placement.balance import solve

CASES = (('resnet18_v1', 4), ('resnet18_v1', 2), ('mobilenetv2_1.0', 4), ('resnet152_v1', 4))
SAMPLE = (1, 3, 32, 32)


def measure(name, num_devices):
    """One row: ``{name, devices, ops, sizes, bytes, largest, tight_sizes, tight_bytes,
    tight_largest, seconds}``."""
    net = vision.get_model(name, classes=10)
    made = []
    seconds = timing.seconds(lambda: made.append(
        Pipeline(net, [mx.cpu(i) for i in range(num_devices)], sample=SAMPLE)))
    pipe = made[0]
    cut = pipe.cut
    prefix = np.concatenate([[0.0], np.cumsum(cut.costs)])

    def largest(sizes):
        bounds = np.cumsum((0,) + tuple(sizes))
        return int(max(prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])))

    tight = solve(cut.costs, num_devices, slack=0.0)
    stage_of = [s for s, n in enumerate(tight) for _ in range(n)]
    nbytes = {k: v for k, v in graphcut.entry_bytes(graphcut.load(cut.graph),
                                                    {'data': SAMPLE}).items()
              if k[0] in set(cut.op_names) | {'data'}}
    return {'name': name, 'devices': num_devices, 'ops': len(cut.op_names),
            'sizes': pipe.balance, 'bytes': cut.boundary_bytes, 'largest': largest(pipe.balance),
            'tight_sizes': tight, 'tight_bytes': graphcut.crossing_bytes(cut.graph, stage_of,
                                                                         nbytes),
            'tight_largest': largest(tight), 'seconds': seconds}


def main():
    for name, k in CASES:
        row = measure(name, k)
        print('%(name)s on %(devices)d: %(ops)d ops; chosen %(sizes)s, bytes %(bytes)s, largest '
              'stage %(largest)d; tightest %(tight_sizes)s, bytes %(tight_bytes)s, largest '
              'stage %(tight_largest)d; cut in %(seconds).2f s' % row)


if __name__ == '__main__':
    main()
