"""``python -m bench.pipeline``: micro-batch pipelining of a wide MLP, from the trace.

A K-stage MLP (one ``FullyConnected`` + ``relu`` of width ``num_hiddens`` per
stage, stage ``s`` on ``cpu(s)``) splits each batch into M micro-batches
(:func:`bench.chunked.build_chunked_symbol`); MXNet's dependency engine then runs stage s
on chunk m while stage s + 1 works on chunk m - 1, since each ``cpu(i)`` has
its own engine worker. For K = 2, 3 and M = 1, 2, 4, 8, all in one process:

* samples/s (median of repeats, ``mx.nd.waitall()`` before each clock read)
  as a ratio to M = 1 and to the same K-layer model bound on ``cpu(0)``;
* from MXNet's profiler trace, on separate steps after the timed ones: each
  device's busy time, the time at least two devices are busy, and the
  measured bubble ``1 - sum(busy) / (K * span)`` beside GPipe's
  ``(K - 1) / (M + K - 1)`` (:mod:`mp_symbolic.tools.trace`);
* memory per device of the split plan and of one device
  (:mod:`mp_symbolic.tools.memory`), and the effect of MXNet's mirroring
  (re-materialisation: ``MXNET_BACKWARD_DO_MIRROR=1``, or
  ``__force_mirroring__`` on a stage's ops) on memory and step time;
* the schedules side by side on the language model (``Pipeline(...,
  schedule='gpipe' | '1f1b' | 'interleaved')``, :func:`bench.schedules.compare`):
  bubble from the trace beside the schedule's ideal, step time over GPipe's,
  activation memory per device, and the language model's tokens/s and model
  FLOPs utilisation against a matrix product timed beside its steps.

Every executor is bound with ``MXNET_EXEC_BULK_EXEC_TRAIN=0`` (read at each
bind): MXNet otherwise runs consecutive ops as one bulked segment, which the
trace shows as ``'[op,op,...]'`` and which hides the chunk of each op.
(``MXNET_SUBGRAPH_BACKEND=NONE``, also read at each bind, changes nothing
here: oneDNN fuses no training op of this model.) The timeline picture
infers chunks with :func:`mp_symbolic.tools.trace.label_chunks`.

On this CPU stand-in the K devices share the machine's cores, so wall-clock
speedups are bounded by free cores; the overlap in the trace is the figure
that carries over to GPUs.
"""
import argparse
import json
import os
import sys
import time

import mxnet as mx

from mp_symbolic.tools.files import write_text
from mp_symbolic.tools.memory import format_bytes, format_memory, measure_memories, measure_memory
from mp_symbolic.tools.text import columns
from mp_symbolic.tools.trace import dump as dump_trace
from mp_symbolic.tools.trace import (TraceError, clip, gpipe_bubble, load_trace, op_intervals,
                               step_stats, step_windows)
from mp_symbolic.core.base.compat import profiler_cpu_limit, unprofilable
from mp_symbolic.core.base.scoped import environ

from .chunked import LR, StepLoop, bind, build_chunked_symbol, stage_devices
from .measure import machine_info, throughput
from .schedules import compare
from .timeline import plot_timeline

__all__ = ['check_stages', 'run', 'main']

OUT_DIR = os.path.join('artifacts', 'bench')
ORDERED = '-ordered'  # variant name suffix: build_chunked_symbol(order_forward=True)
# the schedules' table under --quick: a language model small enough for a smoke run
QUICK_LM = dict(vocab_size=32, block_size=32, num_layers=2, num_heads=2, num_hiddens=32)


def check_stages(stages):
    """Raises ValueError for stage counts MXNet's profiler cannot record here.

    The profiler has a row per core plus two (``cpu pinned/``, ``cpu shared/``,
    read back as the next two CPUs, see :mod:`mp_symbolic.tools.trace`) and aborts
    the process on ``cpu(i)`` past them.
    """
    limit = profiler_cpu_limit()
    if any(k < 1 or unprofilable([mx.cpu(i) for i in range(k)]) for k in stages):
        raise ValueError('--stages: expected stage counts from 1 to %d on this %d-core machine '
                         "(MXNet's profiler aborts past cpu(%d)), found %s"
                         % (limit, limit - 2, limit - 1, ','.join(map(str, stages))))


def _name(k, m):
    """Variant and marker name; M0 is the K-layer model bound on cpu(0) alone."""
    return 'K%d-M%d' % (k, m)


def run(stages, chunks, num_hiddens, batch_size, steps, repeats, warmup, profiled_steps,
        out_dir=OUT_DIR, log=print, quick=False):
    """Measures everything, logs the tables, writes ``pipeline.json`` and the timeline.

    Args:
        quick: The schedules' table (:func:`_schedules`) on a small language
            model, micro-batch 8.

    Returns:
        The JSON report as a dict.
    """
    info = machine_info()
    log('machine: %d cores, %s; MXNet %s; load average at start %s'
        % (info['cores'], info['cpu'], info['mxnet'], info['load']))
    log('model: %d-wide MLP, one FullyConnected+relu per stage, batch %d, SGD lr %g'
        % (num_hiddens, batch_size, LR))
    variants, symbols = {}, {}
    for k in stages:
        symbols[_name(k, 0)] = build_chunked_symbol(k, 1, num_hiddens)
        variants[_name(k, 0)] = StepLoop(bind(symbols[_name(k, 0)], batch_size, num_hiddens))
        for m in chunks:
            symbols[_name(k, m)] = build_chunked_symbol(k, m, num_hiddens)
            variants[_name(k, m)] = StepLoop(bind(symbols[_name(k, m)], batch_size,
                                                  num_hiddens, stage_devices(k)))
        for m in (m for m in chunks if m > 1):
            variants[_name(k, m) + ORDERED] = StepLoop(bind(
                build_chunked_symbol(k, m, num_hiddens, order_forward=True), batch_size,
                num_hiddens, stage_devices(k)))
    rates = throughput(variants, batch_size, steps, repeats, warmup)
    trace_path = os.path.join(out_dir, 'pipeline-profile.json')
    steps_stats = _profile(variants, profiled_steps, trace_path)
    report = {'machine': info, 'model': {'num_hiddens': num_hiddens, 'batch_size': batch_size,
                                         'lr': LR},
              'timing': {'steps': steps, 'repeats': repeats, 'warmup': warmup},
              'profiled_steps': profiled_steps, 'configs': [], 'ordered': []}
    for k in stages:
        one = rates[_name(k, 0)][0]
        base = rates[_name(k, chunks[0])][0]
        one_busy = steps_stats[_name(k, 0)]['busy_us']['cpu/0']
        report['configs'].append({'stages': k, 'chunks': 1, 'plan': 'one device',
                                  'devices': ['cpu/0'], 'samples_per_s': one,
                                  'runs': rates[_name(k, 0)][1], **steps_stats[_name(k, 0)]})
        for m in chunks:
            r, stats = rates[_name(k, m)][0], steps_stats[_name(k, m)]
            report['configs'].append({
                'stages': k, 'chunks': m, 'plan': 'split',
                'devices': ['cpu/%d' % s for s in range(k)],
                'samples_per_s': r, 'runs': rates[_name(k, m)][1], 'vs_first_chunks': r / base,
                'vs_one_device': r / one, 'gpipe_bubble': gpipe_bubble(k, m),
                # > 1: ops ran slower side by side (shared cores) or there are more of them
                'busy_vs_one_device': sum(stats['busy_us'].values()) / one_busy, **stats})
            if m > 1:
                name = _name(k, m) + ORDERED
                report['ordered'].append({
                    'stages': k, 'chunks': m, 'devices': ['cpu/%d' % s for s in range(k)],
                    'samples_per_s': rates[name][0], 'runs': rates[name][1],
                    'vs_default_order': rates[name][0] / r, 'default_bubble': stats['bubble'],
                    'gpipe_bubble': gpipe_bubble(k, m), **steps_stats[name]})
    _log_pipeline(report, chunks[0], log)
    _log_ordered(report, log)
    setups = _mirror_setups(stages[0], chunks[-1], num_hiddens)
    # the memory of _mirror's graphs that need no environment of their own is measured
    # beside the table's, in its child (its run without mirroring is the table's graph)
    report['memory'], measured = _memory(symbols, stages, chunks, batch_size, num_hiddens, log,
                                         [symbol for symbol, env in setups.values() if not env])
    report['mirror'] = _mirror(setups, stages[0], chunks[-1], num_hiddens, batch_size, steps,
                               repeats, warmup, log, measured)
    log('')
    report['schedules'] = _schedules(stages, chunks, quick, log)
    log('')
    log('note: the CPU stand-in devices share this machine\'s %d cores, so wall-clock speedups '
        'are bounded by free cores; the overlap in the trace is the figure that carries over '
        'to GPUs.' % info['cores'])
    os.makedirs(out_dir, exist_ok=True)
    write_text(os.path.join(out_dir, 'pipeline.json'),
               json.dumps(report, indent=1, default=float) + '\n')
    picture = os.path.join(out_dir, 'pipeline-timeline.png')
    panels = [(max(stages), m) for m in chunks]
    # and the forced order at the second-largest M (M=4 by default)
    panels += [(max(stages), m, ORDERED) for m in chunks if m > 1][-2:-1]
    plot_timeline(load_trace(trace_path), panels, picture)
    log('wrote %s, %s, %s' % (os.path.join(out_dir, 'pipeline.json'), picture, trace_path))
    return report


def _profile(variants, profiled_steps, path):
    """Profiles ``profiled_steps`` steps of each variant, each between two markers.

    Returns ``{variant: stats of the step with the median span}``.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    mx.nd.waitall()
    mx.profiler.set_config(profile_symbolic=True, profile_imperative=True, profile_api=False,
                           profile_memory=False, aggregate_stats=False, filename=path,
                           continuous_dump=False)
    domain = mx.profiler.Domain('bench')
    mx.profiler.set_state('run')
    for name, variant in variants.items():
        marker = mx.profiler.Marker(domain, name)
        for _ in range(profiled_steps):
            mx.nd.waitall()
            marker.mark('process')
            variant.run(1)
        mx.nd.waitall()
        marker.mark('process')
    mx.profiler.set_state('stop')
    dump_trace(path)
    trace = load_trace(path)
    ops = op_intervals(trace)
    out = {}
    for name in variants:
        k = int(name[1:].split('-')[0])
        devices = ['cpu/0'] if name.endswith('-M0') else ['cpu/%d' % s for s in range(k)]
        per_step = [step_stats(clip(ops, w), devices) for w in step_windows(trace, name)]
        per_step.sort(key=lambda s: s['span_us'])
        out[name] = per_step[(len(per_step) - 1) // 2]
    return out


def _log_pipeline(report, first_m, log):
    log('')
    log('pipeline: samples/s median of %d runs of %d steps (spread: (max-min)/median); '
        'busy/overlap/span in ms from the profiler trace (step with the median span of %d '
        'profiled steps)'
        % (report['timing']['repeats'], report['timing']['steps'], report['profiled_steps']))
    head = ['K', 'M', 'samples/s', 'spread', 'vs M=%d' % first_m, 'vs 1-dev',
            'busy per device (ms)', 'sum/1-dev', '>=2 busy', 'span', 'bubble', 'GPipe']
    body = []
    for c in report['configs']:
        busy = ' '.join('%.1f' % (c['busy_us'][d] / 1e3) for d in c['devices'])
        if c['plan'] == 'one device':
            body.append([c['stages'], '1-dev', '%.0f' % c['samples_per_s'], _spread(c), '',
                         '1.00x', busy, '', '', '%.1f' % (c['span_us'] / 1e3),
                         '%.2f' % c['bubble'], ''])
            continue
        body.append([c['stages'], c['chunks'], '%.0f' % c['samples_per_s'], _spread(c),
                     '%.2fx' % c['vs_first_chunks'], '%.2fx' % c['vs_one_device'], busy,
                     '%.2f' % c['busy_vs_one_device'], '%.1f' % (c['overlap_us'] / 1e3),
                     '%.1f' % (c['span_us'] / 1e3), '%.2f' % c['bubble'],
                     '%.2f' % c['gpipe_bubble']])
    for line in columns([head] + body):
        log('  ' + line)


def _log_ordered(report, log):
    log('')
    log('forward order forced (build_chunked_symbol(order_forward=True)): chunk m starts on '
        'stage0 after chunk m-1 left it')
    head = ['K', 'M', 'samples/s', 'spread', 'vs default', '>=2 busy', 'span', 'bubble',
            'default', 'GPipe']
    body = [[c['stages'], c['chunks'], '%.0f' % c['samples_per_s'], _spread(c),
             '%.2fx' % c['vs_default_order'], '%.1f' % (c['overlap_us'] / 1e3),
             '%.1f' % (c['span_us'] / 1e3), '%.2f' % c['bubble'], '%.2f' % c['default_bubble'],
             '%.2f' % c['gpipe_bubble']] for c in report['ordered']]
    for line in columns([head] + body):
        log('  ' + line)


def _spread(config):
    runs = config['runs']
    return '%.0f%%' % (100 * (max(runs) - min(runs)) / config['samples_per_s'])


def _memory(symbols, stages, chunks, batch_size, num_hiddens, log, also=()):
    """Memory per device, split plan vs one device, for each K at the first
    and the largest M; ``also``: graphs of ``stages[0]`` stages measured on
    their split plan in the same child.

    Returns:
        ``(table, {symbol JSON: split plan's result})``, the latter for every
        split plan measured.
    """
    out = {}
    log('')
    log('memory per device after one step (Module, SGD momentum 0.9; other = activations, '
        'per-chunk weight gradients before their sum, workspace: the storage profiler\'s '
        'total in a fresh process less the arrays)')
    shapes = dict(data_shapes=[('data', (batch_size, num_hiddens))],
                  label_shapes=[('softmax_label', (batch_size,))],
                  optimizer_params={'momentum': 0.9})
    names = [(k, _name(k, m)) for k in stages for m in sorted({chunks[0], chunks[-1]})]
    requests = [dict(shapes, symbol=symbols[name], group2ctx=group2ctx)
                for k, name in names for group2ctx in (stage_devices(k), None)]
    requests += [dict(shapes, symbol=symbol, group2ctx=stage_devices(stages[0]))
                 for symbol in also]
    results = measure_memories(requests)  # one child, a fresh fork for each
    measured = {r['symbol'].tojson(): result for r, result in zip(requests, results)
                if r['group2ctx'] is not None}
    results = iter(results)
    for k, name in names:
        result = out[name] = {'split': next(results), 'one_device': next(results)}
        for plan, title in (('split', '%s on %d devices' % (name, k)),
                            ('one_device', '%s on cpu(0)' % name)):
            for line in format_memory(result[plan]['devices'], title):
                log('  ' + line)
    return out, measured


def _mirror_setups(k, m, num_hiddens):
    """``{setup: (training symbol, environment variables)}`` of :func:`_mirror`."""
    setups = {}
    for label, mirror_stages, env in (
            ('none', (), {}), ('MXNET_BACKWARD_DO_MIRROR=1', (), {'MXNET_BACKWARD_DO_MIRROR': '1'}),
            ('__force_mirroring__ on all stages', tuple(range(k)), {})):
        with environ(**env):  # built as it will be bound (compat.segment_boundaries)
            setups[label] = build_chunked_symbol(k, m, num_hiddens, mirror_stages), env
    return setups


def _mirror(setups, k, m, num_hiddens, batch_size, steps, repeats, warmup, log, measured=None):
    """Memory and samples/s with MXNet's mirroring, against none.

    ``measured``: ``{symbol JSON: measure_memory's result}`` of split plans
    already measured (by :func:`_memory`); a setup whose graph is there and
    that sets no environment variable takes that result instead of starting
    a fresh process for it (each costs MXNet's start, a few seconds).
    """
    shapes = ([('data', (batch_size, num_hiddens))], [('softmax_label', (batch_size,))])
    variants, out = {}, {}
    for label, (symbol, env) in setups.items():
        variants[label] = StepLoop(bind(symbol, batch_size, num_hiddens, stage_devices(k), env))
        # Nodes the backward pass recomputes, as the bound graph lists them.
        mirrored = {line.split('Name=')[1] for line in variants[label].exe.debug_str().splitlines()
                    if line.startswith('Op:') and line.endswith('_mirror')}
        known = None if env else (measured or {}).get(symbol.tojson())
        out[label] = {'recomputed_ops': len(mirrored),
                      'memory': known or measure_memory(symbol, *shapes, stage_devices(k),
                                                        optimizer_params={'momentum': 0.9},
                                                        env=env)}
    rates = throughput(variants, batch_size, steps, repeats, warmup)
    log('')
    log('re-materialisation (%s): activations+workspace per device and samples/s'
        % _name(k, m))
    devices = list(out['none']['memory']['devices'])
    body = []
    for label in setups:
        out[label]['samples_per_s'] = rates[label][0]
        other = out[label]['memory']['devices']
        body.append([label, out[label]['recomputed_ops']]
                    + [format_bytes(other[d]['other']) for d in devices]
                    + ['%.0f' % rates[label][0],
                       '%.2fx' % (rates[label][0] / rates['none'][0])])
    head = ['mirroring', 'recomputed ops'] + ['other on %s' % d for d in devices]
    for line in columns([head + ['samples/s', 'vs none']] + body):
        log('  ' + line)
    return out


def _schedules(stages, chunks, quick, log):
    """gpipe, 1f1b and interleaved (2 stages per device) side by side on the
    language model (:func:`bench.schedules.compare`) at the stage counts and
    the micro-batch counts above 1, and at M = 2K so that interleaved runs
    for each K (it needs M a multiple of K); ``quick``: at the smallest count
    above 1 only (2 if none), on a small model."""
    above = [m for m in chunks if m > 1]
    if quick:
        return compare(stages, [min(above or [2])], micro_batch=8, lm=QUICK_LM, steps=1,
                       log=log)
    counts = sorted(set(above) | {2 * k for k in stages})
    return compare(stages, counts, log=log)


def build_parser():
    parser = argparse.ArgumentParser(
        prog='python -m bench.pipeline',
        description='Micro-batch pipelining: samples/s, overlap and bubble from the trace, '
                    'memory per device, re-materialisation.')
    parser.add_argument('--stages', default='2,3', help='stage counts (default: %(default)s)')
    parser.add_argument('--chunks', default='1,2,4,8',
                        help='micro-batch counts, the first is the reference (default: '
                             '%(default)s)')
    parser.add_argument('--hidden', type=int, default=2048, help='width (default: %(default)s)')
    parser.add_argument('--batch-size', type=int, default=512,
                        help='samples per step, divisible by every chunk count '
                             '(default: %(default)s)')
    parser.add_argument('--steps', type=int, default=5,
                        help='steps per timed run (default: %(default)s)')
    parser.add_argument('--repeats', type=int, default=3,
                        help='timed runs; the median is reported (default: %(default)s)')
    parser.add_argument('--out', default=OUT_DIR, help='output folder (default: %(default)s)')
    parser.add_argument('--quick', action='store_true',
                        help='width 128, batch 64, 2 steps x 1 run: a smoke run')
    return parser


def _ints(flag, text):
    try:
        values = [int(v) for v in text.split(',')]
    except ValueError:
        raise ValueError('%s: expected comma-separated integers, found %r' % (flag, text)) \
            from None
    if not values or any(v < 1 for v in values):
        raise ValueError('%s: expected positive integers, found %r' % (flag, text))
    return values


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.hidden, args.batch_size, args.steps, args.repeats = 128, 64, 2, 1
    try:
        stages, chunks = _ints('--stages', args.stages), _ints('--chunks', args.chunks)
        check_stages(stages)
        if any(args.batch_size % m for m in chunks):
            raise ValueError('--batch-size: expected a multiple of every chunk count %s, found %d'
                             % (chunks, args.batch_size))
        if min(args.hidden, args.steps, args.repeats) < 1:
            raise ValueError('--hidden, --steps, --repeats: expected positive integers, found '
                             '%d, %d, %d' % (args.hidden, args.steps, args.repeats))
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise ValueError('--out: expected a folder, found a file: %s' % args.out)
    except ValueError as e:
        print('error: %s' % e, file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        run(stages, chunks, args.hidden, args.batch_size, args.steps, args.repeats,
            warmup=1 if args.quick else 2, profiled_steps=5, out_dir=args.out, quick=args.quick)
    except TraceError as e:
        print('error: %s' % e, file=sys.stderr)
        return 1
    print('done in %.0f s' % (time.perf_counter() - start))
    return 0


if __name__ == '__main__':
    sys.exit(main())
