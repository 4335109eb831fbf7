"""Digests of what a training run leaves, per configuration, to compare two
versions of the library bit for bit (python -m bench.equality --out FILE,
then --against FILE on the other version).

Each Module configuration (network, devices, micro-batches, replicas,
schedule) trains three Adam steps through ``pipe.module('softmax')`` from the blocks'
seeded initial values and records the sha256 of: the last step's outputs,
every replica's gradients, the parameters and auxiliary states, the
optimizer states by name, the checkpoint's params file, and the imperative
twin's output on the trained parameters. Each stepper configuration (the
command line's ``--api executor`` and ``module`` steppers) trains six SGD
steps of a bundled task and records its losses, parameters, auxiliary
states, gradients, optimizer states and predictions. What raises is recorded as its
one-line message in place of the digest.
"""
import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

import mxnet as mx
import numpy as np

from mp_symbolic import Pipeline
from mp_symbolic.training import loop
from mp_symbolic.training.tasks import digits, gpt, lm

TINY = gpt.GPTConfig(vocab_size=23, block_size=12, num_layers=2, num_heads=2, num_hiddens=8)
BATCH = 8


def _lm(whole=False, shards=1):
    build = gpt.build_network if whole else gpt.build_blocks
    return build(TINY, lm.sharded_layers(shards)), (BATCH, TINY.block_size)


def _digits():
    return digits.build_blocks(), (BATCH, 1, 8, 8)


class _Skip(mx.gluon.HybridBlock):
    """Stage 0's output read by stages 1 and 2."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.fc0 = mx.gluon.nn.Dense(8, in_units=4, activation='relu', prefix='fc0_')
            self.fc1 = mx.gluon.nn.Dense(8, in_units=8, activation='relu', prefix='fc1_')
            self.fc2 = mx.gluon.nn.Dense(10, in_units=8, prefix='fc2_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        h = self.fc0(x)
        return self.fc2(self.fc1(h) + h)


def _skip():
    return _Skip(prefix='skip_'), (BATCH, 1, 4), [2, 2, 2]


NETWORKS = {'lm': _lm, 'lm_whole': lambda: _lm(whole=True), 'lm_tp': lambda: _lm(shards=2),
            'lm_whole_tp': lambda: _lm(whole=True, shards=2), 'digits': _digits,
            'skip': _skip}

# (network, devices, micro-batches, replicas): test_stages' table
BASE = [('lm', 'cpu:0,cpu:1', m, 1) for m in (1, 2, 4)] + \
    [('lm', 'cpu:0,cpu:1,cpu:2', m, 1) for m in (1, 2, 4)] + [
        ('lm_whole', 'cpu:0,cpu:1,cpu:2', 4, 1),
        ('lm_tp', 'cpu:0+cpu:1,cpu:2', 2, 1),
        ('lm_tp', 'cpu:0+cpu:1,cpu:2+cpu:3', 1, 1),
        ('lm_tp', 'cpu:0+cpu:1,cpu:2+cpu:3', 4, 1),
        ('lm_whole_tp', 'cpu:0+cpu:1,cpu:2+cpu:3', 2, 1),
        ('lm_tp', 'cpu:0+cpu:1,cpu:2+cpu:3,cpu:4+cpu:5,cpu:6+cpu:7', 2, 2),
        ('lm', 'cpu:0,cpu:1,cpu:2,cpu:3', 2, 2),
        ('digits', 'cpu:0,cpu:1,cpu:2', 4, 1),
        ('digits', 'cpu:0,cpu:1', 2, 2),
        ('skip', 'cpu:0,cpu:1,cpu:2', 2, 1),
    ]
CONFIGS = [c + (s, None) for c in BASE for s in ('gpipe', '1f1b')] + [
    ('lm', 'cpu:0,cpu:1', 4, 1, 'interleaved', 2),
    ('lm_tp', 'cpu:0+cpu:1,cpu:2+cpu:3', 2, 1, 'interleaved', 1),
    ('digits', 'cpu:0,cpu:1', 4, 1, 'interleaved', 2),
]


def _batch(sample, step):
    rng = np.random.default_rng(step)
    if len(sample) == 2:
        X = rng.integers(0, TINY.vocab_size, sample)
        y = rng.integers(0, TINY.vocab_size, sample)
    else:
        X, y = rng.normal(size=sample), rng.integers(0, 10, sample[0])
    return mx.io.DataBatch([mx.nd.array(X.astype(np.float32))],
                           [mx.nd.array(y.astype(np.float32))])


def _digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _flat(value):
    """Every array in ``value`` (nested dicts, lists, NDArrays), in a fixed order."""
    if isinstance(value, dict):
        return [x for k in sorted(value, key=str) for x in [np.array(str(k))] + _flat(value[k])]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    if isinstance(value, mx.nd.NDArray):
        return [value.asnumpy()]
    if callable(value):
        return _flat(value())
    return [np.array(repr(value))]


def _guarded(fn):
    try:
        return fn()
    except Exception as e:  # pylint: disable=broad-except
        return 'raised %s: %s' % (type(e).__name__, str(e).splitlines()[0][:200])


def run(name, devices, chunks, replicas, schedule, virtual, steps=3):
    """The digests of one configuration: ``{part: sha256 prefix}``."""
    net, sample, *balance = NETWORKS[name]()
    pipe = Pipeline(net, devices, balance=(balance or [None])[0], sample=sample, chunks=chunks,
                    replicas=replicas, schedule=schedule, virtual=virtual)
    arg_params, aux_params = loop.initial_values(pipe, seed=0)
    mod = pipe.module(loss='softmax')
    batch = _batch(sample, 0)
    mod.bind(data_shapes=[('data', sample)],
             label_shapes=[('softmax_label', batch.label[0].shape)])
    mod.init_params(arg_params={k: mx.nd.array(v) for k, v in arg_params.items()},
                    aux_params={k: mx.nd.array(v) for k, v in aux_params.items()},
                    allow_missing=False)
    mod.init_optimizer(kvstore='local' if replicas > 1 else None, optimizer='adam',
                       optimizer_params={'learning_rate': 0.01})
    for step in range(steps):
        mod.forward_backward(_batch(sample, step))
        mod.update()
    out = {'outputs': _digest([o.asnumpy() for o in mod.get_outputs()])}
    group = mod._exec_group  # pylint: disable=protected-access
    out['grads'] = _digest([np.array(n) for n in group.param_names] + [
        g.asnumpy() for arrays in group.grad_arrays for g in arrays if g is not None])
    arg, aux = mod.get_params()
    out['params'] = _digest(_flat(arg) + _flat(aux))
    out['optimizer'] = _guarded(lambda: _digest(_flat(mod.optimizer_states())))
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, 'c')

        def saved():
            mod.save_checkpoint(prefix, 1)
            with open(prefix + '-0001.params', 'rb') as f:
                return hashlib.sha256(f.read()).hexdigest()[:16]
        out['checkpoint'] = _guarded(saved)

    def twin():
        pipe.set_params(arg, aux)
        x = _batch(sample, steps).data[0]
        y = pipe(x.as_in_context(pipe.plan.first_device))
        return _digest(_flat(y))
    out['twin'] = _guarded(twin)
    return out


# the command line's steppers (task, devices, chunks, schedule, api), six steps each
STEPPERS = [('regression', 'cpu:0,cpu:1', m, 'gpipe', api) for m in (1, 2)
            for api in ('executor', 'module')] + [
    ('regression', 'cpu:0,cpu:1,cpu:2', 2, '1f1b', 'module'),
    ('digits', 'cpu:0,cpu:1', 2, 'gpipe', 'executor'),
    ('digits', 'cpu:0,cpu:1,cpu:2', 4, 'gpipe', 'executor'),
    ('regression', 'cpu:0,cpu:1', 4, 'gpipe', 'executor'),
    ('digits', 'cpu:0,cpu:1', 2, '1f1b', 'module'),
]


def run_stepper(task_name, devices, chunks, schedule, api, steps=6):
    """The digests of one stepper's run: losses, parameters, auxiliary
    states, gradients, optimizer states and predictions."""
    from mp_symbolic.training.config import TrainConfig  # pylint: disable=import-outside-toplevel
    fields = dict(task=task_name, devices=devices, chunks=chunks, schedule=schedule, api=api,
                  progress=False, batch_size=40, momentum=0.9, lr=0.01, optimizer='sgd')
    if task_name == 'regression':
        fields['task_args'] = dict(widths=(2, 4, 4, 4, 1), num_examples=400)
    task, cfg = loop.load(TrainConfig(**fields))
    pipe, _ = loop.build_pipeline(cfg, task)
    X, y = task.train
    stepper = loop.make_stepper(cfg, pipe, task, loop.initial_values(pipe, cfg.seed),
                                y.shape[1:])
    losses = [stepper.step(*batch).asnumpy()
              for _, batch in zip(range(steps), stepper.batches(X, y, 0))]
    return {'losses': _digest(losses), 'params': _digest(_flat(dict(stepper.params()))),
            'aux': _digest(_flat(dict(stepper.aux()))),
            'grads': _digest(_flat(dict(stepper.grads()))),
            'optimizer': _guarded(lambda: _digest(_flat(stepper.optimizer_states()))),
            'predict': _digest([stepper.predict(X[:80])])}


def key(config):
    if len(config) == 5:
        return 'stepper %s %s chunks=%d %s api=%s' % config
    return '%s %s chunks=%d replicas=%d %s virtual=%s' % config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', help='write the digests (JSON) here')
    parser.add_argument('--against', help='compare with the digests of this file')
    parser.add_argument('--only', default='', help='configurations whose key contains this')
    args = parser.parse_args(argv)
    found, start = {}, time.perf_counter()
    for config in CONFIGS + STEPPERS:
        if args.only not in key(config):
            continue
        found[key(config)] = _guarded(lambda c=config: (run_stepper if len(c) == 5 else run)(*c))
        print(key(config), json.dumps(found[key(config)]), flush=True)
    print('%d configurations in %.0f s' % (len(found), time.perf_counter() - start))
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(found, f, indent=1, sort_keys=True)
    if args.against:
        with open(args.against) as f:
            before = json.load(f)
        differ = [(k, part) for k, v in found.items() for part in
                  (v if isinstance(v, dict) else {'run': v})
                  if (before.get(k) or {}).get(part) != v.get(part)]
        for k, part in differ:
            print('differs: %s: %s' % (k, part))
        print('%d of %d configurations bitwise equal to %s' % (
            len(found) - len({k for k, _ in differ}), len(found), args.against))
        return 1 if differ else 0
    return 0


if __name__ == '__main__':
    sys.exit(main())
