"""``python -m bench.lm``: the language model's transformer split over 1, 2 and 4 devices.

The GPT of ``--task lm`` (:mod:`mp_symbolic.training.tasks.gpt`, built by
:func:`~mp_symbolic.training.tasks.lm.sharded_layers`: query, key and value
column-parallel by heads, the attention on each shard's heads, the output
projection and the MLP's second layer row-parallel, the token embedding
vocabulary-parallel with the output tied to its shards) trained with Adam by
an ``mx.mod.Module`` on one stage of N devices (``cpu:0+cpu:1+...``), for
N = 1, 2, 4, all in one process:

* memory per device after one step, from MXNet's own arrays and storage
  profiler in a fresh process (:func:`mp_symbolic.tools.memory.measure_memory`),
  as ratios to one device;
* samples/s (median of repeats, ``mx.nd.waitall()`` before each clock read)
  as a ratio to the unsplit model on one device, and the same N shards all on
  ``cpu(0)`` (what splitting costs without any second device).

Random token ids stand in for the corpus (the step's cost does not depend on
which characters they are). On this machine the "devices" are ``cpu(i)``
stand-ins that share its cores: the memory figures are what a GPU would hold,
the step-time ratios the cost of the split; see docs/lm.md.
"""
import argparse
import os

import mxnet as mx
import numpy as np

from mp_symbolic import Pipeline
from mp_symbolic.tools.memory import format_bytes, measure_memory
from mp_symbolic.training.tasks import gpt, lm

from .measure import throughput
from .tensor_parallel import log_memory, plans_of, write_report

__all__ = ['run', 'main']

OUT_DIR = os.path.join('artifacts', 'bench')
VOCAB_SIZE = 166   # the corpus' distinct characters (docs/lm.md)
OPTIMIZER = ('adam', {'learning_rate': 1e-3})


def _pipe(cfg, shards, devices):
    return Pipeline(gpt.build_blocks(cfg, lm.sharded_layers(shards)), devices,
                    sample=(1, cfg.block_size))


class _Steps:
    """A bound Module stepping on one fixed batch (``run(n)`` for throughput)."""

    def __init__(self, pipe, cfg, batch_size):
        rng = np.random.RandomState(0)
        shape = (batch_size, cfg.block_size)
        self.mod = pipe.module(loss='softmax')
        self.mod.bind([('data', shape)], [('softmax_label', shape)])
        self.mod.init_params(mx.init.Normal(0.02))
        self.mod.init_optimizer(kvstore=None, optimizer=OPTIMIZER[0],
                                optimizer_params=OPTIMIZER[1])
        device = pipe.plan.first_device
        self.batch = mx.io.DataBatch(
            [mx.nd.array(rng.randint(0, cfg.vocab_size, shape), ctx=device)],
            [mx.nd.array(rng.randint(0, cfg.vocab_size, shape), ctx=device)])

    def run(self, num_steps):
        for _ in range(num_steps):
            self.mod.forward_backward(self.batch)
            self.mod.update()


def run(shard_counts=(1, 2, 4), num_layers=2, num_heads=4, num_hiddens=256, block_size=64,
        batch_size=16, steps=10, repeats=5, warmup=3, out_dir=OUT_DIR, log=print):
    """Measures, logs the tables, writes ``lm.json``; returns the report.

    Raises:
        ValueError: a shard count that does not divide ``num_heads``.
    """
    for n in shard_counts:
        if num_heads % n:
            raise ValueError('shard_counts: expected divisors of num_heads (%d), found %d'
                             % (num_heads, n))
    cfg = gpt.GPTConfig(vocab_size=VOCAB_SIZE, block_size=block_size, num_layers=num_layers,
                        num_heads=num_heads, num_hiddens=num_hiddens)
    plans = plans_of(shard_counts)
    one = _pipe(cfg, 1, 'cpu:0')
    model_bytes = 4 * sum(int(np.prod(p.shape)) for p in one.collect_params().values())
    log('GPT: %d blocks, width %d, %d heads, context %d, vocabulary %d (%s of parameters), '
        'batch %d, Adam' % (num_layers, num_hiddens, num_heads, block_size, VOCAB_SIZE,
                            format_bytes(model_bytes), batch_size))

    shape = (batch_size, block_size)
    memory = {}
    for name, (shards, devices) in plans.items():
        pipe = _pipe(cfg, shards, devices)
        memory[name] = measure_memory(
            pipe.training_symbol('softmax'), [('data', shape)], [('softmax_label', shape)],
            pipe.plan.group2ctx, context=str(pipe.plan.first_device), optimizer=OPTIMIZER[0],
            optimizer_params=OPTIMIZER[1])['devices']
    log_memory(memory, log, optimizer=True)

    variants = {name: _Steps(_pipe(cfg, shards, devices), cfg, batch_size)
                for name, (shards, devices) in plans.items()}
    rates = throughput(variants, batch_size, steps, repeats, warmup)
    return write_report(os.path.join(out_dir, 'lm.json'), rates, steps, repeats,
                        dict(num_layers=num_layers, num_heads=num_heads, num_hiddens=num_hiddens,
                             block_size=block_size, vocab_size=VOCAB_SIZE,
                             batch_size=batch_size, model_bytes=model_bytes, memory=memory), log)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog='python -m bench.lm',
        description='The language model split over 1, 2 and 4 tensor-parallel shards: memory '
                    'per device and step time, as ratios to one device.')
    parser.add_argument('--num-hiddens', type=int, default=256)
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--quick', action='store_true',
                        help='a small, fast run (num_hiddens 64, fewer steps)')
    args = parser.parse_args(argv)
    if args.num_hiddens < 4 or args.num_hiddens % 4 or args.batch_size < 1:
        parser.error('--num-hiddens, --batch-size: expected a positive multiple of 4 (the '
                     'heads) and a positive integer, found %d, %d'
                     % (args.num_hiddens, args.batch_size))
    if args.quick:
        return run(num_hiddens=64, batch_size=8, steps=3, repeats=2, warmup=1)
    return run(num_hiddens=args.num_hiddens, batch_size=args.batch_size)


if __name__ == '__main__':
    main()
