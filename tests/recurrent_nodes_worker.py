"""One node process of the recurrent node test: ``python
tests/recurrent_nodes_worker.py --out F --nodes N``.

Trains GluonNLP's ``AWDRNN`` (tiny, seeded, no dropout) with its ``TNC``
states, ``batch_axis=1``, under 1F1B in two micro-batches over
``cpu:0,cpu:1`` for three SGD steps (``--nodes 1``: in one process, the
reference) and writes what this process holds to ``F_<rank>.npz``: its
parameters, and the last batch's outputs where it runs the last stage.
:func:`train` is the same run in the caller's process.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_symbolic.tools.startup import mxnet_without_sklearn  # noqa: E402
mxnet_without_sklearn()  # as the commands load MXNet (a test importing this: no change)
# pylint: disable=wrong-import-position
import mxnet as mx  # noqa: E402
import numpy as np

from mp_symbolic import Pipeline  # pylint: disable=wrong-import-position
from mp_symbolic.tools.interrupts import end_process  # pylint: disable=wrong-import-position

VOCAB, T, N, EMBED, HIDDEN, LAYERS = 30, 6, 4, 8, 12, 2


def network():
    """``AWDRNN`` of two LSTM layers, its initial values seeded."""
    import gluonnlp  # pylint: disable=import-outside-toplevel
    net = gluonnlp.model.AWDRNN('lstm', vocab_size=VOCAB, embed_size=EMBED, hidden_size=HIDDEN,
                                num_layers=LAYERS, tie_weights=True, dropout=0, weight_drop=0,
                                drop_h=0, drop_i=0, drop_e=0, prefix='awd_')
    mx.random.seed(0)
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    return net, {n: p.data().copy() for n, p in net.collect_params().items()}


def batch(step):
    """Tokens ``(T, N)``, states ``[[h, c], [h, c]]`` of ``(1, N, C)``, next tokens."""
    rng = np.random.default_rng(step)
    x, y = (mx.nd.array(rng.integers(0, VOCAB, size=(T, N))) for _ in range(2))
    states = [[mx.nd.array(0.1 * rng.normal(size=(1, N, size))) for _ in range(2)]
              for size in (HIDDEN, EMBED)]
    return x, states, y


def train(nodes=None, steps=3):
    """``(parameters this process holds by name, last outputs or None)``."""
    net, values = network()
    x, states, y = batch(0)
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=(x, states), batch_axis=1, chunks=2,
                    schedule='1f1b', nodes=nodes)
    mod = pipe.module(loss='softmax', output=0)
    leaves = [x] + [s for layer in states for s in layer]
    mod.bind(list(zip(pipe.input_names, [a.shape for a in leaves])), [('softmax_label', y.shape)])
    mod.init_params(arg_params=values, aux_params={})
    mod.init_optimizer(kvstore=None, optimizer='sgd', optimizer_params={'learning_rate': 0.1})
    for step in range(steps):
        x, states, y = batch(step)
        mod.forward_backward(mx.io.DataBatch([x] + [s for layer in states for s in layer], [y]))
        mod.update()
    arg, aux = mod.get_params()
    held = {'param:' + k: v.asnumpy() for k, v in dict(arg, **aux).items()}
    outputs = mod.get_outputs()
    return held, [o.asnumpy() for o in outputs] if outputs else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--out', required=True)
    parser.add_argument('--nodes', type=int, default=1)
    args = parser.parse_args()
    held, outputs = train(nodes=args.nodes)
    for k, value in enumerate(outputs or ()):
        held['output:%d' % k] = value
    np.savez('%s_%s.npz' % (args.out, os.environ.get('RANK', '0')), **held)


if __name__ == '__main__':
    main()
    end_process(0)  # without seconds of Python's final collection
