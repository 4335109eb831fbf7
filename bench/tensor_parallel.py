"""``python -m bench.tensor_parallel``: one layer split over 1, 2 and 4 devices.

A transformer's MLP block (Megatron-LM's pair: a
:class:`~mp_symbolic.ColumnParallelDense` ``num_hiddens -> 4 num_hiddens``
with ReLU, then a :class:`~mp_symbolic.RowParallelDense` back to
``num_hiddens``, L2 loss), trained by an ``mx.mod.Module`` on one stage of N
devices (``cpu:0+cpu:1+...``), for N = 1, 2, 4, all in one process; beside
it the same block written with two plain ``gluon.nn.Dense`` layers and
sharded by ``Pipeline(..., tensor_parallel='auto')`` ("auto, N devices"):

* memory per device after one step, from MXNet's own arrays and storage
  profiler in a fresh process (:func:`mp_symbolic.tools.memory.measure_memory`):
  the largest device's parameter bytes and total bytes as ratios to one device;
* samples/s (median of repeats, ``mx.nd.waitall()`` before each clock read)
  as a ratio to the unsplit layer on one device, and the same N shards all on
  ``cpu(0)`` (what splitting costs without any second device).

On this machine the "devices" are ``cpu(i)`` stand-ins that share its cores:
the memory figures are what a GPU would hold (the same arrays, placed the
same way), while the step-time ratios measure the cost of the split
(copies, the concat/sum, smaller matrix products) with no added compute; see
docs/tensor-parallel.md.
"""
import argparse
import json
import os

import mxnet as mx
from mxnet import gluon
import numpy as np

from mp_symbolic import ColumnParallelDense, Pipeline, RowParallelDense
from mp_symbolic.tools.files import write_text
from mp_symbolic.tools.memory import format_bytes, measure_memory
from mp_symbolic.tools.text import columns

from .measure import machine_info, throughput

__all__ = ['run', 'main']

OUT_DIR = os.path.join('artifacts', 'bench')


def _blocks(num_hiddens, shards):
    return [ColumnParallelDense(4 * num_hiddens, num_hiddens, shards, activation='relu',
                                prefix='mlp_fc1_'),
            RowParallelDense(num_hiddens, 4 * num_hiddens, shards, prefix='mlp_fc2_')]


def _plain_blocks(num_hiddens):
    """The same block in Gluon's own layers, for ``tensor_parallel='auto'``."""
    return [gluon.nn.Dense(4 * num_hiddens, in_units=num_hiddens, activation='relu',
                           prefix='mlp_fc1_'),
            gluon.nn.Dense(num_hiddens, in_units=4 * num_hiddens, prefix='mlp_fc2_')]


def _pipeline(num_hiddens, shards, devices, auto=False):
    if auto:
        return Pipeline(_plain_blocks(num_hiddens), devices, tensor_parallel='auto')
    return Pipeline(_blocks(num_hiddens, shards), devices)


class _Steps:
    """A bound Module stepping on one fixed batch (``run(n)`` for throughput)."""

    def __init__(self, pipe, batch_size, num_hiddens):
        rng = np.random.RandomState(0)
        self.mod = pipe.module(loss='l2')
        self.mod.bind([('data', (batch_size, num_hiddens))],
                      [('softmax_label', (batch_size, num_hiddens))])
        self.mod.init_params(mx.init.Xavier())
        self.mod.init_optimizer(kvstore=None, optimizer='sgd',
                                optimizer_params={'learning_rate': 0.01})
        device = pipe.plan.first_device
        self.batch = mx.io.DataBatch(
            [mx.nd.array(rng.uniform(-1, 1, (batch_size, num_hiddens)), ctx=device)],
            [mx.nd.array(rng.uniform(-1, 1, (batch_size, num_hiddens)), ctx=device)])

    def run(self, num_steps):
        for _ in range(num_steps):
            self.mod.forward_backward(self.batch)
            self.mod.update()


def plans_of(shard_counts, auto=False):
    """``{name: (shards, devices)}``: N shards on N devices, and on cpu(0) alone
    (with ``auto``, ``{name: (shards, devices, auto)}`` and the plain layers
    sharded automatically on N devices too)."""
    plans = {'1 device': (1, 'cpu:0')}
    for n in shard_counts:
        if n > 1:
            plans['%d shards, %d devices' % (n, n)] = (n, '+'.join('cpu:%d' % i
                                                                  for i in range(n)))
            plans['%d shards, 1 device' % n] = (n, 'cpu:0')
    if not auto:
        return plans
    plans = {name: plan + (False,) for name, plan in plans.items()}
    for n in shard_counts:
        if n > 1:
            plans['auto, %d devices' % n] = (n, '+'.join('cpu:%d' % i for i in range(n)), True)
    return plans


def run(shard_counts=(1, 2, 4), num_hiddens=512, batch_size=64, steps=20, repeats=5, warmup=5,
        out_dir=OUT_DIR, log=print):
    """Measures, logs the tables, writes ``tensor_parallel.json``; returns the report."""
    plans = plans_of(shard_counts, auto=True)
    layer_bytes = 4 * (2 * 4 * num_hiddens * num_hiddens + 5 * num_hiddens)
    log('MLP block %d -> %d -> %d (%s of parameters), batch %d, SGD'
        % (num_hiddens, 4 * num_hiddens, num_hiddens, format_bytes(layer_bytes), batch_size))

    memory = {}
    for name, (shards, devices, auto) in plans.items():
        pipe = _pipeline(num_hiddens, shards, devices, auto)
        symbol = pipe.training_symbol('l2')
        memory[name] = measure_memory(
            symbol, [('data', (batch_size, num_hiddens))],
            [('softmax_label', (batch_size, num_hiddens))], pipe.plan.group2ctx,
            context=str(pipe.plan.first_device))['devices']
    log_memory(memory, log)

    variants = {name: _Steps(_pipeline(num_hiddens, shards, devices, auto), batch_size,
                             num_hiddens)
                for name, (shards, devices, auto) in plans.items()}
    rates = throughput(variants, batch_size, steps, repeats, warmup)
    return write_report(os.path.join(out_dir, 'tensor_parallel.json'), rates, steps, repeats,
                        dict(num_hiddens=num_hiddens, batch_size=batch_size,
                             layer_bytes=layer_bytes, memory=memory), log)


def log_memory(memory, log=print, optimizer=False):
    """Logs memory per device of each plan beside ``'1 device'``'s, and adds
    ``on_device`` (all but the Module's host copy of the parameters, which is
    host memory on a GPU machine) to each row of ``memory``.

    Args:
        memory: ``{plan: {device: {category: bytes}}}`` (``measure_memory``'s).
        optimizer: Show the optimizer-state column too.
    """
    base = memory['1 device']['cpu(0)']
    base_on_device = base['total'] - base['module_copy']
    rows = [['plan', 'device', 'params', 'grads'] + (['optimizer'] if optimizer else []) +
            ['on device', 'params / 1 device', 'on device / 1 device']]
    for name, devices in memory.items():
        for device, row in devices.items():
            row['on_device'] = row['total'] - row['module_copy']
            rows.append([name, device, format_bytes(row['params']), format_bytes(row['grads'])] +
                        ([format_bytes(row['optimizer'])] if optimizer else []) +
                        [format_bytes(row['on_device']),
                         '%.2f' % (row['params'] / base['params']),
                         '%.2f' % (row['on_device'] / base_on_device)])
    log('memory per device after one step (on device: MXNet\'s storage profiler total, '
        'without the Module\'s host copy of the parameters; the batch sits on cpu(0)):')
    for line in columns(rows):
        log('  ' + line)


def write_report(path, rates, steps, repeats, facts, log=print):
    """Logs the step-time table (each plan's ratio to ``'1 device'``) and
    writes the report, ``facts`` included, as JSON to ``path``; returns it."""
    one = rates['1 device'][0]
    rows = [['plan', 'samples/s', 'step time / 1 device']]
    for name, (rate, _) in rates.items():
        rows.append([name, '%.0f' % rate, '%.2f' % (one / rate)])
    log('step time (median of %d repeats of %d steps):' % (repeats, steps))
    for line in columns(rows):
        log('  ' + line)
    report = dict(facts, machine=machine_info(), steps=steps, repeats=repeats,
                  samples_per_sec={n: {'median': r, 'repeats': rs}
                                   for n, (r, rs) in rates.items()},
                  step_time_ratio={n: one / r for n, (r, _) in rates.items()})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_text(path, json.dumps(report, indent=1))
    log('wrote %s' % path)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog='python -m bench.tensor_parallel',
        description='Tensor-parallel MLP block: memory per device and step time at 1, 2 and '
                    '4 shards, as ratios to one device, hand-written and sharded automatically.')
    parser.add_argument('--num-hiddens', type=int, default=512)
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--quick', action='store_true',
                        help='a small, fast run (num_hiddens 64, fewer steps)')
    args = parser.parse_args(argv)
    if args.num_hiddens < 1 or args.batch_size < 1:
        parser.error('--num-hiddens and --batch-size: expected positive integers, found %d, %d'
                     % (args.num_hiddens, args.batch_size))
    if args.quick:
        return run(num_hiddens=64, batch_size=16, steps=5, repeats=2, warmup=2)
    return run(num_hiddens=args.num_hiddens, batch_size=args.batch_size)


if __name__ == '__main__':
    main()
