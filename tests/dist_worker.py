"""A small dist_sync worker for the launcher's tests: ``python tests/dist_worker.py``.

Run under ``python -m mp_symbolic launch``, it creates the ``dist_sync``
kvstore, trains the project's regression network (on ``cpu(0)``, through
``mx.mod.Module`` with the optimizer on the servers) on its rank's share of
the data, and prints its rank and the final parameters as one JSON line:

    rank 0 of 2
    step 1 ... step N
    params {"layer0_weight": [[...]], ...}

``--fail-rank R --fail-after K --fail-how kill|exit3|hang`` makes the worker
of kvstore rank R kill itself with SIGKILL, exit with status 3, or sleep for
ever (alive, making no progress) after K steps: a job that loses a worker
mid-run. (The kvstore rank is ps-lite's, assigned by
the scheduler; it need not be the launcher's index in ``[worker i]``.)
"""
import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_symbolic.tools.startup import mxnet_without_sklearn  # noqa: E402
mxnet_without_sklearn()  # as the commands load MXNet (a test importing this: no change)
# pylint: disable=wrong-import-position
import mxnet as mx  # noqa: E402

from mp_symbolic.core.pipeline import Pipeline
from mp_symbolic.training.tasks.regression import build_blocks, make_dataset

LABEL_NAME = 'label'
from mp_symbolic.tools.launch import abort_on_error

DATA_NAME = 'data'


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--batch-size', type=int, default=50, help='per worker')
    parser.add_argument('--fail-rank', type=int, default=None)
    parser.add_argument('--fail-after', type=int, default=1)
    parser.add_argument('--fail-how', choices=('kill', 'exit3', 'hang'), default='kill')
    args = parser.parse_args()

    kv = mx.kv.create('dist_sync')
    print('rank %d of %d' % (kv.rank, kv.num_workers), flush=True)
    X, y = make_dataset(num_examples=args.steps * args.batch_size * kv.num_workers, seed=0)
    X, y = X[kv.rank::kv.num_workers], y[kv.rank::kv.num_workers]  # this worker's share

    symbol = Pipeline(build_blocks(), 'cpu:0').training_symbol('l2', label_name=LABEL_NAME)
    mod = mx.mod.Module(symbol, data_names=[DATA_NAME],
                        label_names=[LABEL_NAME], context=mx.cpu(0))
    mod.bind(data_shapes=[(DATA_NAME, (args.batch_size, 2))],
             label_shapes=[(LABEL_NAME, (args.batch_size, 1))])
    mx.random.seed(kv.rank)  # different local draws: rank 0's values must win
    mod.init_params(mx.init.Xavier(magnitude=2.24))
    mod.init_optimizer(kvstore=kv, optimizer='sgd',
                       optimizer_params={'learning_rate': 0.05,
                                         'rescale_grad': 1.0 / (args.batch_size * kv.num_workers)})
    for step in range(args.steps):
        if kv.rank == args.fail_rank and step == args.fail_after:
            if args.fail_how == 'kill':
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fail_how == 'hang':
                signal.pause()  # until the launcher ends the job
            sys.exit(3)
        batch = slice(step * args.batch_size, (step + 1) * args.batch_size)
        mod.forward_backward(mx.io.DataBatch([mx.nd.array(X[batch])], [mx.nd.array(y[batch])]))
        mod.update()
        mx.nd.waitall()
        print('step %d' % (step + 1), flush=True)
    arg_params, _ = mod.get_params()
    print('params %s' % json.dumps({k: v.asnumpy().tolist() for k, v in sorted(arg_params.items())}),
          flush=True)


if __name__ == '__main__':
    with abort_on_error():  # else a failed worker hangs in ps-lite's exit barrier
        main()
