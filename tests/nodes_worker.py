"""One node process of the node tests: ``python tests/nodes_worker.py --out F --table T``.

Builds the language model of ``tests/test_stages.py`` (tiny, seeded), or a
GluonCV network of random weights on small images (``network``), a
``Pipeline(..., nodes=N)`` over it (``--nodes 1``: one process, the
reference), trains three Adam steps through ``pipe.module()`` on fixed batches, for each
configuration of the table, and writes what this process holds to
``F<k>_<rank>.npz``: its
parameters and auxiliary states (by their unsplit names), its optimizer
states, and the last batch's outputs where it runs the loss head. :func:`train` is the same run
in the caller's process.
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

from gluoncv import model_zoo  # pylint: disable=wrong-import-position
import mp_symbolic  # pylint: disable=wrong-import-position
from mp_symbolic import Pipeline  # pylint: disable=wrong-import-position
from mp_symbolic.training import loop  # pylint: disable=wrong-import-position
from mp_symbolic.training.tasks import gpt, lm  # pylint: disable=wrong-import-position
from mp_symbolic.tools.interrupts import end_process  # pylint: disable=wrong-import-position

TINY = gpt.GPTConfig(vocab_size=23, block_size=12, num_layers=2, num_heads=2, num_hiddens=8)


def batch(step, size):
    rng = np.random.default_rng(step)
    X = rng.integers(0, TINY.vocab_size, (size, TINY.block_size)).astype(np.float32)
    y = rng.integers(0, TINY.vocab_size, (size, TINY.block_size)).astype(np.float32)
    return mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)])


IMAGE = (3, 32, 32)  # the GluonCV networks' input
CLASSES = 10


def image_batch(step, size):
    rng = np.random.default_rng(step)
    X = rng.normal(size=(size,) + IMAGE).astype(np.float32)
    y = rng.integers(0, CLASSES, size).astype(np.float32)
    return mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)])


def train(devices, nodes=1, chunks=1, replicas=1, schedule='1f1b', steps=3, shards=1,
          whole=False, batch_size=8, virtual=None, save=None, network=None, evaluate=False,
          stats=False, batchnorm='micro-batch'):
    """``(arrays this process holds by name, last outputs or None)``; with
    ``save``, the module is saved there (``mp_symbolic.save_checkpoint``,
    by every node) after its steps. ``network``: a GluonCV model zoo name
    (random weights, :data:`IMAGE` in, :data:`CLASSES` out), cut whole,
    in place of the language model. With ``evaluate`` (a ``network``),
    ``predict`` and ``score`` (accuracy, cross-entropy) of two batches after
    the steps are held too, as ``every:predict`` and ``every:score``: every
    node reads them. ``schedule='stage-gpipe'`` is GPipe's schedule run by
    the stage runtime (``mp_symbolic.core.schedule.gpipe``), not the one
    graph. With ``stats`` (over nodes), what the steps sent to other nodes
    is held as ``stats:<rank>:sent`` and ``stats:<rank>:sent_bytes``
    (summed over the replicas' transports). ``batchnorm``: the Pipeline's."""
    if network is not None:
        net = model_zoo.get_model(network, pretrained=False, classes=CLASSES)
        sample, label, make_batch = (batch_size,) + IMAGE, (batch_size,), image_batch
    else:
        build = gpt.build_network if whole else gpt.build_blocks
        net = build(TINY, lm.sharded_layers(shards))
        sample = label = (batch_size, TINY.block_size)
        make_batch = batch
    if schedule == 'stage-gpipe':
        schedule = mp_symbolic.core.schedule.gpipe
    pipe = Pipeline(net, devices, sample=sample, chunks=chunks,
                    replicas=replicas, schedule=schedule, nodes=nodes, virtual=virtual,
                    batchnorm=batchnorm)
    arg_params, aux_params = loop.initial_values(pipe, seed=0)
    mod = pipe.module(loss='softmax')
    mod.bind(data_shapes=[('data', sample)], label_shapes=[('softmax_label', label)])
    mod.init_params(arg_params={k: mx.nd.array(v) for k, v in arg_params.items()},
                    aux_params={k: mx.nd.array(v) for k, v in aux_params.items()})
    mod.init_optimizer(kvstore='local' if replicas > 1 else None, optimizer='adam',
                       optimizer_params={'learning_rate': 0.01})
    for step in range(steps):
        mod.forward_backward(make_batch(step, batch_size))
        mod.update()
    held_stats = {}
    if stats and nodes > 1:  # every transfer of the run is one of these steps'
        rank = os.environ.get('RANK', '0')
        transports = [r.transport for r in mod._runtimes]  # pylint: disable=protected-access
        for key in ('sent', 'sent_bytes'):
            held_stats['stats:%s:%s' % (rank, key)] = np.array(
                sum(t.stats[key] for t in transports))
    if save is not None:
        mp_symbolic.save_checkpoint(mod, save, epoch=steps, name='lm')
        if nodes > 1:  # restored on each node: the arrays it reads, by name
            _restore_recording(mod, save, '%s-read-node%s.json'
                               % (save, os.environ.get('RANK', '0')))
    outputs = mod.get_outputs()
    evaluated = {}
    if evaluate:
        batches = [image_batch(steps + k, batch_size) for k in range(2)]
        data = mx.io.NDArrayIter(mx.nd.concat(*[b.data[0] for b in batches], dim=0),
                                 mx.nd.concat(*[b.label[0] for b in batches], dim=0),
                                 batch_size=batch_size)
        evaluated['every:predict'] = mod.predict(data).asnumpy()
        evaluated['every:score'] = np.array([value for _, value in
                                             mod.score(data, ['acc', 'ce'])])
    arg, aux = mod.get_params()
    held = {'param:' + k: v.asnumpy() for k, v in dict(arg, **aux).items()}
    states = mod.optimizer_states()
    for name, entry in states['params'].items():
        held['count:' + name] = np.array(entry['count'])
        for k, index in enumerate(_arrays_of(entry['state'])):
            held['state:%s:%d' % (name, k)] = np.asarray(states['arrays'][index])
    held.update(evaluated)
    held.update(held_stats)
    return held, outputs[0].asnumpy() if outputs else None


def _restore_recording(mod, folder, out):
    """``mod.restore`` of the checkpoint in ``folder``, writing to ``out``
    (JSON) the names of the arrays read from its files."""
    from mp_symbolic.core.base import parts  # pylint: disable=import-outside-toplevel
    read, real = [], parts.NpzReader.read

    def recorded(self, name):
        read.append(name)
        return real(self, name)

    parts.NpzReader.read = recorded
    try:
        with mp_symbolic.read_checkpoint(folder) as checkpoint:
            mod.restore(checkpoint)
    finally:
        parts.NpzReader.read = real
    with open(out, 'w') as f:
        json.dump(read, f)


def _arrays_of(spec):
    """The array indices of an encoded optimizer state, in order."""
    if spec['t'] == 'nd':
        return [spec['a']]
    return [a for item in spec.get('items', ()) for a in _arrays_of(item)]


def main():
    """Trains each configuration of ``--table`` (a JSON list of
    :func:`train`'s keyword arguments) in turn, in this one node process
    (one process group for all), writing ``OUT<k>_<rank>.npz`` for the
    ``k``-th."""
    parser = argparse.ArgumentParser()
    parser.add_argument('--out', required=True)
    parser.add_argument('--nodes', type=int, default=1)
    parser.add_argument('--table', required=True)
    args = parser.parse_args()
    for k, config in enumerate(json.loads(args.table)):
        held, outputs = train(nodes=args.nodes, **config)
        if outputs is not None:
            held['outputs'] = outputs
        np.savez('%s%d_%s.npz' % (args.out, k, os.environ.get('RANK', '0')), **held)


if __name__ == '__main__':
    main()
    end_process(0)  # without seconds of Python's final collection
