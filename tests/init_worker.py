"""One node process of the initial-value tests: ``python tests/init_worker.py
--out F --table T [--nodes N]``.

For each configuration of the table (a JSON list of :func:`initial` or
:func:`fitted` keyword arguments, with ``run``: ``'initial'`` or
``'fitted'``), writes the parameters this process holds (by their unsplit
names) to ``F<k>_<rank>.npz``. ``--nodes 1`` (or no rendezvous): one process.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_symbolic.tools.startup import mxnet_without_sklearn  # noqa: E402
mxnet_without_sklearn()  # as the commands load MXNet (a test importing this: no change)
# pylint: disable=wrong-import-position
import mxnet as mx  # noqa: E402
import numpy as np

from mp_symbolic import Pipeline  # pylint: disable=wrong-import-position
from mp_symbolic.training.tasks import gpt, lm, regression  # pylint: disable=wrong-import-position
from mp_symbolic.tools.interrupts import end_process  # pylint: disable=wrong-import-position

TINY = gpt.GPTConfig(vocab_size=23, block_size=12, num_layers=2, num_heads=2, num_hiddens=8)
BATCH = 8


def _held(mod):
    arg, aux = mod.get_params()
    return {k: v.asnumpy() for k, v in dict(arg, **aux).items()}


def initial(devices, nodes=None, chunks=1, replicas=1, schedule='1f1b', shards=1,
            virtual=None, twin=False):
    """The tiny language model's parameters after ``mx.random.seed(0)`` and
    ``init_params(initializer=mx.init.Xavier())`` (``twin``: after
    ``pipe.initialize(mx.init.Xavier())``), no step: name -> numpy array,
    those this process holds."""
    mx.random.seed(0)
    net = gpt.build_blocks(TINY, lm.sharded_layers(shards))
    pipe = Pipeline(net, devices, sample=(BATCH, TINY.block_size), chunks=chunks,
                    replicas=replicas, schedule=schedule, nodes=nodes, virtual=virtual)
    if twin:
        pipe.initialize(mx.init.Xavier())
        arg, aux = pipe.get_params()
        return {k: v.asnumpy() for k, v in dict(arg, **aux).items()}
    mod = pipe.module(loss='softmax')
    shape = (BATCH, TINY.block_size)
    mod.bind(data_shapes=[('data', shape)], label_shapes=[('softmax_label', shape)])
    mod.init_params(initializer=mx.init.Xavier())
    return _held(mod)


def fitted(devices, nodes=None, chunks=2, schedule='1f1b', epochs=2):
    """The Python route of docs/nodes.md: the regression network's three
    blocks, ``mx.random.seed(0)``, then ``fit(initializer=mx.init.Xavier())``
    with Adam; the parameters this process holds after."""
    mx.random.seed(0)
    X, y = regression.make_dataset(num_examples=128, seed=1)
    net = regression.build_blocks()
    pipe = Pipeline(net, devices, sample=(16, 2), schedule=schedule, chunks=chunks, nodes=nodes)
    mod = pipe.module(loss='l2', label_name='label')
    train_iter = mx.io.NDArrayIter(X, y, batch_size=16, label_name='label')
    mod.fit(train_iter, num_epoch=epochs, optimizer='adam', initializer=mx.init.Xavier())
    return _held(mod)


def main():
    """Runs each configuration of ``--table`` in this process, writing
    ``OUT<k>_<rank>.npz`` for the ``k``-th."""
    parser = argparse.ArgumentParser()
    parser.add_argument('--out', required=True)
    parser.add_argument('--nodes', type=int, default=None)
    parser.add_argument('--table', required=True)
    args = parser.parse_args()
    for k, config in enumerate(json.loads(args.table)):
        config = dict(config)
        run = {'initial': initial, 'fitted': fitted}[config.pop('run')]
        held = run(nodes=args.nodes, **config)
        np.savez('%s%d_%s.npz' % (args.out, k, os.environ.get('RANK', '0')), **held)


if __name__ == '__main__':
    main()
    end_process(0)  # without seconds of Python's final collection
