"""A Gluon pipeline trained by several processes with ``dist_sync``.

Each worker holds the whole Pipeline (its stages on its own devices, with
``--replicas`` copies of it), reads its own shard of every batch, and one
:class:`mp_symbolic.Trainer` with ``kvstore='dist_sync'`` sums the gradients
of all copies in all workers before each worker updates its parameters on
their devices. Every worker ends with the same parameters; each prints their
sha256 digest. Run it under the launcher (one scheduler, one server, two
workers, all on this machine)::

    python -m mp_symbolic launch --workers 2 --servers 1 -- examples/gluon_dist_sync.py

Without the launcher, ``--kvstore device`` runs it as one process.
"""
import argparse
import hashlib

import mxnet as mx
from mxnet import autograd, gluon
import numpy as np

from mp_symbolic import Pipeline, Trainer
from mp_symbolic.tools.launch import abort_on_error
from mp_symbolic.training.tasks import regression


def params_digest(pipe):
    """sha256 of every parameter's float32 bytes, by name."""
    digest = hashlib.sha256()
    for name, value in sorted(pipe.get_params()[0].items()):
        digest.update(name.encode())
        digest.update(value.asnumpy().astype(np.float32).tobytes())
    return digest.hexdigest()


def train(devices='cpu:0,cpu:1', replicas=1, chunks=1, steps=60, batch_size=32, lr=0.02,
          kvstore='dist_sync', seed=0):
    """Trains the regression pipeline; returns ``(pipe, losses, kvstore)``,
    ``losses`` this worker's mean loss at each step.

    ``batch_size`` is the global batch: each of the W workers takes
    ``batch_size / W`` of it.
    """
    kv = mx.kv.create(kvstore)
    if batch_size % kv.num_workers:
        raise ValueError('batch_size: expected a multiple of the %d workers, found %d'
                         % (kv.num_workers, batch_size))
    pipe = Pipeline(regression.build_blocks(), devices, replicas=replicas, chunks=chunks)
    mx.random.seed(seed)  # the same start everywhere (the kvstore also sends worker 0's)
    pipe.initialize()
    trainer = Trainer(pipe.collect_params(), 'sgd', {'learning_rate': lr, 'momentum': 0.9},
                      kvstore=kv)
    X, y = regression.make_dataset(steps * batch_size, seed)
    share = batch_size // kv.num_workers
    loss_fn = gluon.loss.L2Loss()
    losses = []
    for step in range(steps):
        start = step * batch_size + kv.rank * share  # this worker's shard of the batch
        X_batch = mx.nd.array(X[start:start + share], ctx=pipe.plan.first_device)
        y_batch = mx.nd.array(y[start:start + share], ctx=pipe.plan.last_device)
        with autograd.record():
            loss = loss_fn(pipe(X_batch), y_batch)
        loss.backward()
        trainer.step(batch_size)  # the gradients of every worker's shard, summed
        losses.append(loss.mean())
    return pipe, [loss.asscalar() for loss in losses], kv


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--devices', default='cpu:0,cpu:1',
                        help='each worker\'s devices, replica by replica (default: %(default)s)')
    parser.add_argument('--replicas', type=int, default=1, help='copies in each worker')
    parser.add_argument('--chunks', type=int, default=1, help='micro-batches per batch')
    parser.add_argument('--steps', type=int, default=60, help='optimizer steps')
    parser.add_argument('--batch-size', type=int, default=32, help='global batch size')
    parser.add_argument('--kvstore', default='dist_sync',
                        help='dist_sync under the launcher; device or local in one process')
    parser.add_argument('--save', default=None, metavar='FILE',
                        help='rank 0 writes the parameters there (mx.nd.save)')
    args = parser.parse_args(argv)
    pipe, losses, kv = train(args.devices, args.replicas, args.chunks, args.steps,
                             args.batch_size, kvstore=args.kvstore)
    print('rank %d of %d: loss on its shard %.4f at step 1, %.4f at step %d'
          % (kv.rank, kv.num_workers, losses[0], losses[-1], len(losses)))
    print('parameters sha256: %s' % params_digest(pipe))
    if args.save and kv.rank == 0:
        mx.nd.save(args.save, pipe.get_params()[0])


if __name__ == '__main__':
    with abort_on_error():  # a failed worker exits at once instead of hanging in ps-lite
        main()
