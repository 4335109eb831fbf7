"""One dist_sync worker's measured table beside its estimate, for
tests/test_estimate.py: ``python tests/dist_memory_worker.py CELL``.

Run under ``python -m mp_symbolic launch``, it builds ``CELL`` (a JSON cell
of :mod:`bench.estimate`) with MXNet's storage profiler on, trains one step
of its Module with the ``dist_sync`` kvstore, and prints one line::

    table RANK {"measured": {device: {category: bytes}}, "estimated": {...}}

the estimate made for this worker (``estimate_memory(..., workers=W,
rank=RANK)``).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_symbolic.tools.startup import mxnet_without_sklearn  # noqa: E402
mxnet_without_sklearn()
# pylint: disable=wrong-import-position
import mxnet as mx  # noqa: E402

from bench import estimate as bench  # noqa: E402
from mp_symbolic import estimate_memory  # noqa: E402
from mp_symbolic.tools.launch import abort_on_error, announce_rank, hold_kvstore  # noqa: E402
from mp_symbolic.tools.memory import (  # noqa: E402
    device_memory, profiled_step, start_storage_profile)


def main():
    cell = json.loads(sys.argv[1])
    path = start_storage_profile('mp-dist-memory-')
    kvstore = mx.kv.create('dist_sync')
    hold_kvstore(kvstore)
    announce_rank(kvstore)
    pipe, loss, output, data_shapes, label_shapes = bench.build(cell)
    optimizer, params = bench._optimizer(cell)  # pylint: disable=protected-access
    mod = pipe.module(loss=loss, output=output, label_name=label_shapes[0][0])
    mod.bind(data_shapes=data_shapes, label_shapes=label_shapes)
    mod.init_params(initializer=lambda desc, arr: arr.__setitem__(slice(None), 0.01))
    mod.init_optimizer(kvstore=kvstore, optimizer=optimizer,
                       optimizer_params=dict(params, learning_rate=0.01))
    storage = profiled_step(mod, data_shapes, label_shapes, path)
    # pylint: disable-next=protected-access
    measured = device_memory(mod, bench._blocks_free(storage, pipe))
    estimated = estimate_memory(pipe, data_shapes=data_shapes, label_shapes=label_shapes,
                                loss=loss, output=output, optimizer=optimizer,
                                optimizer_params=params, workers=kvstore.num_workers,
                                rank=kvstore.rank).as_dict()
    print('table %d %s' % (kvstore.rank, json.dumps({'measured': measured,
                                                     'estimated': estimated})), flush=True)


if __name__ == '__main__':
    with abort_on_error():
        main()
