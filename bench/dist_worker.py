"""One worker of the distributed benchmark: ``python -m bench.dist_worker``.

Trains the project's regression network (on ``cpu(0)``, through
``mx.mod.Module``) on synthetic data with a fixed global batch split across
the job's workers: each worker takes ``global_batch / num_workers`` examples a
step from its own share of the data. With ``--kvstore dist_sync`` (under
``python -m mp_symbolic launch``) gradients go through ps-lite and the
optimizer runs on the servers; with ``--kvstore none`` it trains alone, with
no kvstore, as the reference.

It prints two lines that :mod:`bench.dist` reads::

    first step at <unix time, s>
    timed <steps> steps of <samples> samples in <seconds> s
"""
import argparse
import sys
import time

import mxnet as mx

from mp_symbolic.core.base import timing
from mp_symbolic.core.pipeline import Pipeline
from mp_symbolic.training.tasks.regression import build_blocks, make_dataset

LABEL_NAME = 'label'
from mp_symbolic.tools.launch import abort_on_error

DATA_NAME = 'data'


def build_parser():
    parser = argparse.ArgumentParser(prog='python -m bench.dist_worker')
    parser.add_argument('--kvstore', choices=('dist_sync', 'none'), default='dist_sync')
    parser.add_argument('--global-batch', type=int, default=1000,
                        help='examples per step over all workers')
    parser.add_argument('--steps', type=int, default=200, help='timed steps')
    parser.add_argument('--warmup', type=int, default=20, help='untimed steps first')
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    kv = mx.kv.create('dist_sync') if args.kvstore == 'dist_sync' else None
    rank, num_workers = (kv.rank, kv.num_workers) if kv else (0, 1)
    if args.global_batch % num_workers:
        raise ValueError('--global-batch: expected a multiple of the %d workers, found %d'
                         % (num_workers, args.global_batch))
    batch_size = args.global_batch // num_workers
    X, y = make_dataset(num_examples=20 * args.global_batch, seed=0)
    X, y = X[rank::num_workers], y[rank::num_workers]  # this worker's share: 20 batches
    batches = [mx.io.DataBatch([mx.nd.array(X[i:i + batch_size])],
                               [mx.nd.array(y[i:i + batch_size])])
               for i in range(0, len(X) - batch_size + 1, batch_size)]

    mod = mx.mod.Module(Pipeline(build_blocks(), 'cpu:0').training_symbol('l2', label_name=LABEL_NAME),
                        data_names=[DATA_NAME], label_names=[LABEL_NAME], context=mx.cpu(0))
    mod.bind(data_shapes=[(DATA_NAME, (batch_size, 2))],
             label_shapes=[(LABEL_NAME, (batch_size, 1))])
    mod.init_params(mx.init.Xavier(magnitude=2.24))
    mod.init_optimizer(kvstore=kv, optimizer='sgd',
                       optimizer_params={'learning_rate': 0.02,
                                         'rescale_grad': 1.0 / args.global_batch})

    def step(i):
        mod.forward_backward(batches[i % len(batches)])
        mod.update()

    step(0)
    mx.nd.waitall()
    print('first step at %.6f' % time.time(), flush=True)
    for i in range(1, args.warmup):
        step(i)
    seconds = timing.seconds(lambda: [step(i) for i in range(args.steps)])
    print('timed %d steps of %d samples in %.6f s'
          % (args.steps, batch_size, seconds), flush=True)


if __name__ == '__main__':
    with abort_on_error():  # else a failed worker hangs in ps-lite's exit barrier
        sys.exit(main())
