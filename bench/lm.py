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
  ``cpu(0)`` (what splitting costs without any second device);
* tokens/s and the model FLOPs utilisation: the model's training FLOPs per
  token (:func:`model_flops_per_token`) times tokens/s, over the FLOP/s of a
  1024^3 float32 matrix product timed in the same rounds (:class:`Gemm`).

``--against GPT_PY`` instead times the one-device step of this GPT beside
another ``gpt.py``'s in alternated rounds (:func:`against`), and with
``--profile N`` prints MXNet's profiler's top N ops of both
(:func:`top_ops`). ``--losses A,B`` times the one-device step of this GPT
with each of those loss heads in alternated rounds, in CPU and wall time
(:func:`losses`).

Random token ids stand in for the corpus (the step's cost does not depend on
which characters they are). On this machine the "devices" are ``cpu(i)``
stand-ins that share its cores: the memory figures are what a GPU would hold,
the step-time ratios the cost of the split; see docs/lm.md.
"""
import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import tempfile
import time

import mxnet as mx
import numpy as np

from mp_symbolic import Pipeline
from mp_symbolic.core.graph.heads import HEADS
from mp_symbolic.tools.memory import format_bytes, measure_memory
from mp_symbolic.training.tasks import gpt, lm

from mp_symbolic.tools.text import columns

from .measure import throughput
from .tensor_parallel import log_memory, plans_of, write_report

__all__ = ['run', 'main']

OUT_DIR = os.path.join('artifacts', 'bench')
VOCAB_SIZE = 166   # the corpus' distinct characters (docs/lm.md)
OPTIMIZER = ('adam', {'learning_rate': 1e-3})
GEMM = 'matrix product'   # timed with the plans, reported apart


def model_flops_per_token(cfg):
    """Training FLOPs per token of the GPT of ``cfg``: its matrix products
    (2 FLOPs a multiply-add) forward, times 3 (the backward pass takes two
    products per forward one). Per block: query, key, value and output
    projections ``4 x 2 C^2``, the MLP ``2 x 2 x 4 C^2``, the attention's two
    products ``2 x 2 T C`` (every key of the context, as the masked scores are
    computed); the tied output ``2 C V``. Embeddings, norms and softmax are
    left out, as Megatron-LM's and PaLM's MFU leave them out."""
    C, T = cfg.num_hiddens, cfg.block_size
    forward = cfg.num_layers * (24 * C * C + 4 * T * C) + 2 * C * cfg.vocab_size
    return 3 * forward


class Gemm:
    """``run(n)``: ``n`` products of ``size x size`` float32 matrices as a
    ``FullyConnected`` (oneDNN's matrix product, the one the model's dense
    layers run) on ``device``; timed beside the model's steps, round-robin
    (:func:`bench.measure.throughput`), so that both see the same load."""

    def __init__(self, size=1024, device=None):
        rng = np.random.RandomState(1)
        self.size = size
        self.x, self.w = (mx.nd.array(rng.uniform(-1, 1, (size, size)), ctx=device or mx.cpu(0))
                          for _ in range(2))

    def run(self, num_steps):
        for _ in range(num_steps):
            mx.nd.FullyConnected(self.x, self.w, no_bias=True, num_hidden=self.size)

    def flops(self, rate, batch_size):
        """FLOP/s from ``throughput``'s samples/s (``batch_size`` per run step)."""
        return rate / batch_size * 2.0 * self.size ** 3


def utilisation(rates, cfg, gemm):
    """``{plan: {'tokens_per_sec', 'mfu'}}`` from ``{plan: (samples/s, _)}``
    and the matrix product's FLOP/s ``gemm``."""
    flops = model_flops_per_token(cfg)
    return {name: {'tokens_per_sec': rate * cfg.block_size,
                   'mfu': rate * cfg.block_size * flops / gemm}
            for name, (rate, _) in rates.items()}


def _log_utilisation(util, flops, gemm, log):
    log('model FLOPs utilisation (%d training FLOPs per token, against a 1024^3 float32 '
        'matrix product at %.1f GFLOP/s, median of the same rounds):' % (flops, gemm / 1e9))
    rows = [['plan', 'tokens/s', 'model GFLOP/s', 'MFU']]
    for name, row in util.items():
        rows.append([name, '%.0f' % row['tokens_per_sec'],
                     '%.2f' % (row['tokens_per_sec'] * flops / 1e9), '%.2f' % row['mfu']])
    for line in columns(rows):
        log('  ' + line)


def _pipe(cfg, shards, devices):
    return Pipeline(gpt.build_blocks(cfg, lm.sharded_layers(shards)), devices,
                    sample=(1, cfg.block_size))


class _Steps:
    """A bound Module stepping on one fixed batch (``run(n)`` for throughput)."""

    def __init__(self, pipe, cfg, batch_size, loss=lm.LOSS):
        rng = np.random.RandomState(0)
        shape = (batch_size, cfg.block_size)
        self.mod = pipe.module(loss=loss)
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
            pipe.training_symbol(lm.LOSS), [('data', shape)], [('softmax_label', shape)],
            pipe.plan.group2ctx, context=str(pipe.plan.first_device), optimizer=OPTIMIZER[0],
            optimizer_params=OPTIMIZER[1])['devices']
    log_memory(memory, log, optimizer=True)

    variants = {name: _Steps(_pipe(cfg, shards, devices), cfg, batch_size)
                for name, (shards, devices) in plans.items()}
    product = Gemm()
    variants[GEMM] = product
    rates = throughput(variants, batch_size, steps, repeats, warmup)
    gemm = product.flops(rates.pop(GEMM)[0], batch_size)
    util = utilisation(rates, cfg, gemm)
    report = write_report(os.path.join(out_dir, 'lm.json'), rates, steps, repeats,
                          dict(num_layers=num_layers, num_heads=num_heads,
                               num_hiddens=num_hiddens, block_size=block_size,
                               vocab_size=VOCAB_SIZE, batch_size=batch_size,
                               model_bytes=model_bytes, memory=memory,
                               flops_per_token=model_flops_per_token(cfg),
                               gemm_flops_per_sec=gemm, utilisation=util), log)
    _log_utilisation(util, model_flops_per_token(cfg), gemm, log)
    return report


@contextlib.contextmanager
def _unbulked():
    """MXNet binds one engine operation per op (``MXNET_EXEC_BULK_EXEC_TRAIN=0``)
    inside, so that its profiler times each op by name, not segments of them."""
    before = os.environ.get('MXNET_EXEC_BULK_EXEC_TRAIN')
    os.environ['MXNET_EXEC_BULK_EXEC_TRAIN'] = '0'
    try:
        yield
    finally:
        if before is None:
            del os.environ['MXNET_EXEC_BULK_EXEC_TRAIN']
        else:
            os.environ['MXNET_EXEC_BULK_EXEC_TRAIN'] = before


def top_ops(variants, num_steps=10, rounds=3, warmup=3):
    """MXNet's profiler over ``rounds`` x ``num_steps`` training steps of each
    of ``variants`` (``{name: _Steps}``, bound unbulked for a time per op),
    the variants taking turns in each round so that the machine's load
    touches all alike: ``{name: [(op, ms a step, share of the op time, calls
    a step)]}``, largest first. Each op's time includes MXNet's dispatch of
    it, which bulked segments share."""
    for steps in variants.values():
        steps.run(warmup)
    mx.nd.waitall()
    totals = {name: {} for name in variants}
    # the aggregate table only; the trace file is in a folder of its own (set_config
    # unlinks the file it names), removed at the end
    folder = tempfile.mkdtemp(prefix='mp-bench-lm-')
    mx.profiler.set_config(profile_symbolic=True, profile_imperative=True, aggregate_stats=True,
                           filename=os.path.join(folder, 'trace.json'), continuous_dump=False)
    for _ in range(rounds):
        for name, steps in variants.items():
            mx.profiler.set_state('run')
            steps.run(num_steps)
            mx.nd.waitall()
            mx.profiler.set_state('stop')
            ops = json.loads(mx.profiler.dumps(reset=True, format='json'))
            for op, row in ops['Time']['operator'].items():
                ms, count = totals[name].get(op, (0.0, 0))
                totals[name][op] = (ms + row['Total'], count + row['Count'])
    shutil.rmtree(folder, ignore_errors=True)  # and what MXNet writes at the end goes nowhere
    result = {}
    for name, ops in totals.items():
        total, timed = sum(ms for ms, _ in ops.values()), rounds * num_steps
        result[name] = sorted(((op, ms / timed, ms / total, count / timed)
                               for op, (ms, count) in ops.items()), key=lambda row: -row[1])
    return result


def _log_top_ops(tops, count, log):
    names = list(tops)
    log("MXNet's profiler, one op per engine operation (MXNET_EXEC_BULK_EXEC_TRAIN=0), "
        'alternated rounds, the top %d ops of each graph:' % count)
    rows = [['']]
    for name in names:
        rows[0] += [name + ' op', 'ms/step', 'share', 'calls']
    for i in range(count):
        rows.append([str(i + 1)])
        for name in names:
            if i < len(tops[name]):
                op, ms, share, calls = tops[name][i]
                rows[-1] += [op, '%.2f' % ms, '%.1f%%' % (100 * share), '%g' % calls]
            else:
                rows[-1] += ['', '', '', '']
    rows.append(['all'])
    for name in names:
        rows[-1] += ['', '%.2f' % sum(row[1] for row in tops[name]), '100%',
                     '%g' % sum(row[3] for row in tops[name])]
    for line in columns(rows):
        log('  ' + line)


def _gpt_module(path):
    spec = importlib.util.spec_from_file_location('other_gpt', path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    return other


def against(path, num_hiddens=64, batch_size=16, steps=10, repeats=15, warmup=5, profile=0,
            log=print):
    """The one-device training step of this GPT beside the GPT of another
    ``gpt.py`` (``path``, e.g. an earlier commit's checkout), alternated in one
    process (:func:`bench.measure.throughput`'s rounds) on the same batch;
    logs and returns ``{'this', 'other', 'speedup'}`` (median samples/s, and
    this one's over the other's), with ``'top_ops'``: ``{'this', 'other'}``
    of :func:`top_ops` where ``profile`` (the number of ops to log) is
    positive.

    Raises:
        FileNotFoundError: ``path`` is not a file.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError('--against: expected a gpt.py file, found %r' % path)
    modules = (('this', gpt), ('other', _gpt_module(path)))

    def steps_of(module):
        cfg = module.GPTConfig(vocab_size=VOCAB_SIZE, block_size=64, num_layers=2, num_heads=4,
                               num_hiddens=num_hiddens)
        return _Steps(Pipeline(module.build_blocks(cfg), 'cpu:0', sample=(1, 64)),
                      cfg, batch_size)

    variants = {name: steps_of(module) for name, module in modules}
    rates = throughput(variants, batch_size, steps, repeats, warmup)
    result = {name: rate for name, (rate, _) in rates.items()}
    result['speedup'] = result['this'] / result['other']
    log('one-device training step, width %d, batch %d (median of %d alternated repeats of %d '
        'steps): this gpt.py %.1f samples/s, %s %.1f samples/s: %.2f times faster'
        % (num_hiddens, batch_size, repeats, steps, result['this'], path, result['other'],
           result['speedup']))
    if profile > 0:
        with _unbulked():
            unbulked = {name: steps_of(module) for name, module in modules}
        result['top_ops'] = top_ops(unbulked, steps)
        _log_top_ops(result['top_ops'], profile, log)
    return result


def losses(names, num_hiddens=64, batch_size=16, steps=10, repeats=15, warmup=5, log=print):
    """The one-device training step of this GPT with each loss head of
    ``names`` (``heads.HEADS``' names), alternated in one process on the same
    batch, the first head's turn first in even rounds and last in odd ones;
    logs and returns ``{name: {'cpu_ms', 'wall_ms', 'cpu_ratio'}}``: the
    median CPU and wall time a step over the rounds, and the median of each
    round's CPU time over the first head's."""
    cfg = gpt.GPTConfig(vocab_size=VOCAB_SIZE, block_size=64, num_layers=2, num_heads=4,
                        num_hiddens=num_hiddens)
    variants = {name: _Steps(Pipeline(gpt.build_blocks(cfg), 'cpu:0', sample=(1, 64)), cfg,
                             batch_size, loss=name) for name in names}
    cpu, wall = {name: [] for name in names}, {name: [] for name in names}
    for variant in variants.values():
        variant.run(warmup)
    mx.nd.waitall()
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start, clock = time.process_time(), time.perf_counter()
            variants[name].run(steps)
            mx.nd.waitall()
            cpu[name].append(1e3 * (time.process_time() - start) / steps)
            wall[name].append(1e3 * (time.perf_counter() - clock) / steps)
    first = names[0]
    result = {name: {'cpu_ms': statistics.median(cpu[name]),
                     'wall_ms': statistics.median(wall[name]),
                     'cpu_ratio': statistics.median(
                         [a / b for a, b in zip(cpu[name], cpu[first])])} for name in names}
    log('one-device training step, width %d, batch %d, each loss head (median of %d '
        'alternated rounds of %d steps; CPU time of every thread of the process):'
        % (num_hiddens, batch_size, repeats, steps))
    rows = [['loss', 'CPU ms a step', 'wall ms a step', 'CPU / %s\'s' % first]]
    for name in names:
        rows.append([name, '%.2f' % result[name]['cpu_ms'], '%.2f' % result[name]['wall_ms'],
                     '%.3f' % result[name]['cpu_ratio']])
    for line in columns(rows):
        log('  ' + line)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog='python -m bench.lm',
        description='The language model split over 1, 2 and 4 tensor-parallel shards: memory '
                    'per device and step time, as ratios to one device.')
    parser.add_argument('--num-hiddens', type=int,
                        help='model width (default 256; 64 with --against)')
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--quick', action='store_true',
                        help='a small, fast run (num_hiddens 64, fewer steps)')
    parser.add_argument('--against', metavar='GPT_PY',
                        help="only the one-device step (the task's width 64 unless "
                             "--num-hiddens), alternated with the GPT of another gpt.py")
    parser.add_argument('--losses', metavar='LOSS,LOSS',
                        help="only the one-device step (the task's width 64 unless "
                             "--num-hiddens) with each of these loss heads, alternated")
    parser.add_argument('--profile', type=int, default=0, metavar='N',
                        help="with --against: MXNet's profiler's top N ops of both graphs")
    args = parser.parse_args(argv)
    if args.num_hiddens is None:
        args.num_hiddens = 64 if args.against or args.losses else 256
    if args.profile < 0 or (args.profile and not args.against):
        parser.error('--profile: expected a number of ops at least 1, with --against, found %d%s'
                     % (args.profile, '' if args.against else ' without --against'))
    if args.num_hiddens < 4 or args.num_hiddens % 4 or args.batch_size < 1:
        parser.error('--num-hiddens, --batch-size: expected a positive multiple of 4 (the '
                     'heads) and a positive integer, found %d, %d'
                     % (args.num_hiddens, args.batch_size))
    if args.losses:
        names = args.losses.split(',')
        classes = [name for name, head in HEADS.items() if head.classes]
        if len(names) < 2 or not set(names) <= set(classes):
            parser.error('--losses: expected two or more of %s, comma-separated, found %r'
                         % (', '.join(classes), args.losses))
        return losses(names, num_hiddens=args.num_hiddens, batch_size=args.batch_size)
    if args.against:
        if not os.path.isfile(args.against):
            parser.error('--against: expected a gpt.py file, found %r' % args.against)
        return against(args.against, num_hiddens=args.num_hiddens, batch_size=args.batch_size,
                       profile=args.profile)
    if args.quick:
        return run(num_hiddens=64, batch_size=8, steps=3, repeats=2, warmup=1)
    return run(num_hiddens=args.num_hiddens, batch_size=args.batch_size)


if __name__ == '__main__':
    main()
