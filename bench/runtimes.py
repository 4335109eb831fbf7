"""``python -m bench.runtimes``: GPipe as the one graph beside GPipe on the
stage runtime, Module build time and step time, in one process.

For each configuration (the language model at 2 and 3 stages, the digits
CNN at 3 stages), each round builds both Modules in turn (``Pipeline``,
``module``, ``bind``, ``init_params``, ``init_optimizer``: the build time)
and then times their training steps (``forward_backward`` and ``update``)
round-robin, one step of each in turn (:func:`mp_symbolic.core.base.timing.repeat`),
so a change in the machine's load touches both alike. The one graph is
``pipe.module()`` under ``schedule='gpipe'``; the stage runtime is
``pipe.module()`` under ``schedule=mp_symbolic.core.schedule.gpipe``, the
same schedule given as its function (its actions, fill and drain).
Printed: the median build seconds and step milliseconds of each, per round,
and their ratio.
"""
import argparse
import statistics
import sys
import time

import mxnet as mx
import numpy as np

from mp_symbolic import Pipeline
from mp_symbolic.core.schedule import gpipe
from mp_symbolic.core.base.timing import repeat
from mp_symbolic.tools.text import columns
from mp_symbolic.training.tasks import digits, gpt

LM = dict(vocab_size=96, block_size=64, num_layers=4, num_heads=4, num_hiddens=64)

# name -> (blocks, devices, input shape per sample, chunks, micro-batch)
CONFIGS = {
    'lm K=2 M=4': (lambda: gpt.build_blocks(gpt.GPTConfig(**LM)), 2, (LM['block_size'],), 4, 16),
    'lm K=3 M=8': (lambda: gpt.build_blocks(gpt.GPTConfig(**LM)), 3, (LM['block_size'],), 8, 8),
    'digits K=3 M=4': (digits.build_blocks, 3, (1, 8, 8), 4, 16),
}
RUNTIMES = ('one graph', 'stages')


def build(name, runtime):
    """``name``'s Module on ``runtime``, bound, initialised, with Adam, and a batch."""
    make, stages, sample, chunks, micro = CONFIGS[name]
    shape = (chunks * micro,) + sample
    pipe = Pipeline(make(), ','.join('cpu:%d' % s for s in range(stages)), sample=shape,
                    chunks=chunks, schedule=gpipe if runtime == 'stages' else 'gpipe')
    mod = pipe.module(loss='softmax')
    label = shape if len(sample) == 1 else shape[:1]
    mod.bind([('data', shape)], [('softmax_label', label)])
    mod.init_params(initializer=mx.init.Xavier())
    mod.init_optimizer(kvstore=None, optimizer='adam', optimizer_params={'learning_rate': 1e-3})
    rng = np.random.default_rng(0)
    if len(sample) == 1:
        X = rng.integers(0, LM['vocab_size'], shape).astype(np.float32)
        y = rng.integers(0, LM['vocab_size'], label).astype(np.float32)
    else:
        X = rng.normal(size=shape).astype(np.float32)
        y = rng.integers(0, 10, label).astype(np.float32)
    return mod, mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)])


def _step(mod, batch):
    def step():
        mod.forward_backward(batch)
        mod.update()
    return step


def measure(name, rounds, steps):
    """``{runtime: ([build seconds per round], [step seconds])}``."""
    found = {r: ([], []) for r in RUNTIMES}
    for _ in range(rounds):
        built = {}
        for runtime in RUNTIMES:
            mx.nd.waitall()
            start = time.perf_counter()
            built[runtime] = build(name, runtime)
            mx.nd.waitall()
            found[runtime][0].append(time.perf_counter() - start)
        times = repeat({r: _step(*built[r]) for r in RUNTIMES}, steps, warmup=2)
        for runtime in RUNTIMES:
            found[runtime][1].extend(times[runtime])
        del built
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--steps', type=int, default=10, help='timed steps of each per round')
    parser.add_argument('--only', default='', help='configurations whose name contains this')
    args = parser.parse_args(argv)
    rows = [('configuration', 'build s: one graph', 'stages', 'step ms: one graph', 'stages',
             'stages / one graph: build, step')]
    for name in CONFIGS:
        if args.only not in name:
            continue
        found = measure(name, args.rounds, args.steps)
        (gb, gs), (sb, ss) = found['one graph'], found['stages']
        rows.append((name, '%.2f' % statistics.median(gb), '%.2f' % statistics.median(sb),
                     '%.1f' % (1e3 * statistics.median(gs)),
                     '%.1f' % (1e3 * statistics.median(ss)),
                     '%.2f, %.2f' % (statistics.median(sb) / statistics.median(gb),
                                     statistics.median(ss) / statistics.median(gs))))
        print('  '.join(rows[-1]), flush=True)
    print('medians of %d rounds (build) and %d x %d steps, alternated:' % (
        args.rounds, args.rounds, args.steps))
    for line in columns(rows):
        print(line)
    return 0


if __name__ == '__main__':
    sys.exit(main())
