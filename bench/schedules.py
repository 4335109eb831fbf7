"""``python -m bench.schedules``: activation memory per device of the language
model under each pipeline schedule, at a fixed micro-batch size.

For each schedule (``Pipeline(..., schedule=...)``: ``'gpipe'``, the one graph
of every micro-batch; ``'1f1b'`` and ``'interleaved'``, the stage runtime) and each number of
micro-batches M, the GPT of ``--task lm`` (``gpt.build_blocks``) split over K
stages on ``cpu(0..K-1)`` trains one step (SGD, momentum 0.9) on a batch of
M x ``--micro-batch`` sequences, with MXNet's storage
profiler on (:func:`mp_symbolic.tools.trace.storage_bytes`), each in a
fresh process (so each counts what MXNet allocates once per process, as
:func:`mp_symbolic.tools.memory.measure_memory` does). Each device's
activations are what it holds after the step less the arrays of the
Module's parameters, gradients, optimizer state, auxiliary states, inputs
and parameter copy (:func:`mp_symbolic.tools.memory.device_memory`'s
``other``) and of the batch's outputs: the executors' activations and
workspace; under ``'1f1b'`` also the stage executors' own input arrays.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import mxnet as mx

from mp_symbolic import Pipeline
from mp_symbolic.core.schedule import bubble, check_spec, gpipe, kind, make
from mp_symbolic.tools.memory import device_memory
from mp_symbolic.tools.trace import dump as dump_trace
from mp_symbolic.tools.trace import (TraceError, clip, load_trace, op_intervals, step_stats,
                                     step_windows, storage_bytes)
from mp_symbolic.tools.text import columns
from mp_symbolic.training.tasks import gpt

from .lm import Gemm, model_flops_per_token
from .measure import throughput

__all__ = ['measure', 'trace', 'spec', 'run', 'compare', 'main']

LM = dict(vocab_size=96, block_size=64, num_layers=4, num_heads=4, num_hiddens=64)


def _step(spec):
    """One training step of ``spec``'s Pipeline; returns the bytes per device
    of the arrays :func:`~mp_symbolic.tools.memory.device_memory` knows
    (the Module's), of the batch and of its outputs, and the Module (whose memory is held
    as long as it lives)."""
    mod, batch = _build(spec)
    mod.forward_backward(batch)
    mod.update()
    mx.nd.waitall()
    known = {d: sum(row.values()) for d, row in device_memory(mod).items()}
    # the batch, and its outputs (every schedule holds them whole)
    for arr in batch.data + batch.label + [a for o in mod.get_outputs(False) for a in o]:
        known[str(arr.context)] = known.get(str(arr.context), 0) + arr.size * 4
    return known, (mod, batch)


def _build(spec):
    """``spec``'s Module, bound, initialised, with SGD, and a batch for it."""
    cfg = gpt.GPTConfig(**spec['lm'])
    shape = (spec['chunks'] * spec['micro_batch'], cfg.block_size)
    schedule = spec['schedule']
    if spec.get('runtime') == 'stages' and schedule == 'gpipe':
        schedule = gpipe  # GPipe on the stage runtime, beside its one graph (the name's)
    pipe = Pipeline(gpt.build_blocks(cfg), ','.join('cpu:%d' % s for s in range(spec['stages'])),
                    sample=shape, chunks=spec['chunks'], schedule=schedule,
                    virtual=spec.get('virtual'), balance=spec.get('balance'))
    mod = pipe.module(loss='softmax')
    mod.bind([('data', shape)], [('softmax_label', shape)])
    mod.init_params(initializer=lambda desc, arr: arr.__setitem__(slice(None), 0.01))
    mod.init_optimizer(kvstore=None, optimizer='sgd',
                       optimizer_params={'learning_rate': 0.1, 'momentum': 0.9})
    return mod, mx.io.DataBatch([mx.nd.ones(shape)], [mx.nd.zeros(shape)])


def _stopped_trace(path):
    """Stops the profiler, reads the trace it dumps to ``path`` (in a
    temporary folder of its own) and removes both."""
    mx.nd.waitall()
    mx.profiler.set_state('stop')
    dump_trace(path)
    trace = load_trace(path)
    os.remove(path)
    os.rmdir(os.path.dirname(path))
    return trace


def _child(specs, warmup):
    """In a fresh process: one training step of each spec in turn under the
    storage profiler (with ``warmup``, after one step of the first that is
    not measured); each one's activations are what the devices gained during
    it less the arrays it knows (the process frees everything between)."""
    path = os.path.join(tempfile.mkdtemp(prefix='mp-schedules-'), 'memory.json')
    mx.profiler.set_config(profile_symbolic=False, profile_imperative=False, profile_api=False,
                           profile_memory=True, aggregate_stats=False, filename=path,
                           continuous_dump=False)
    mx.profiler.set_state('run')
    domain = mx.profiler.Domain('schedules')
    if warmup:  # MXNet keeps some per-device resources once a step has made them
        _step(specs[0])
    known = []
    for k, spec in enumerate(specs):
        gc.collect()
        mx.nd.waitall()
        mx.profiler.Marker(domain, 'start%d' % k).mark()
        arrays, alive = _step(spec)
        known.append(arrays)
        mx.profiler.Marker(domain, 'end%d' % k).mark()
        del alive
    gc.collect()
    trace = _stopped_trace(path)
    marks = {e['name']: e['ts'] for e in trace['traceEvents'] if e.get('ph') in ('n', 'i', 'I')}

    def held(ts):
        events = [e for e in trace['traceEvents'] if e.get('ph') != 'C' or e['ts'] <= ts]
        try:
            return storage_bytes(dict(trace, traceEvents=events))
        except TraceError:  # nothing allocated yet
            return {}

    results = []
    for k, spec in enumerate(specs):
        before, after = held(marks['start%d' % k]), held(marks['end%d' % k])
        devices = ['cpu(%d)' % s for s in range(spec['stages'])]
        results.append({d: after.get(_row(d), 0) - before.get(_row(d), 0) - known[k].get(d, 0)
                        for d in devices})
    return results


class _Steps:
    """``run(n)``: ``n`` training steps (``forward_backward`` and ``update``)
    of one spec's Module, for :func:`bench.measure.throughput`."""

    def __init__(self, spec):
        self.mod, self.batch = _build(spec)

    def run(self, num_steps):
        for _ in range(num_steps):
            self.mod.forward_backward(self.batch)
            self.mod.update()


def _rate_child(specs, steps, repeats):
    """In a fresh process, not profiled: the training steps of every spec
    and a 1024^3 matrix product (:class:`bench.lm.Gemm`) timed round-robin
    (:func:`bench.measure.throughput`, the median of ``repeats`` runs of
    ``steps``); per spec its tokens/s and model FLOPs utilisation (its
    training FLOPs per token, :func:`bench.lm.model_flops_per_token`, times
    tokens/s, over the product's FLOP/s)."""
    variants = {str(k): _Steps(spec) for k, spec in enumerate(specs)}
    product = variants['gemm'] = Gemm()
    rates = throughput(variants, 1, steps, repeats, warmup=1)
    gemm = product.flops(rates.pop('gemm')[0], 1)
    out = []
    for k, spec in enumerate(specs):
        tokens = rates[str(k)][0] * spec['chunks'] * spec['micro_batch'] * spec['lm']['block_size']
        flops = model_flops_per_token(gpt.GPTConfig(**spec['lm']))
        out.append({'tokens_per_sec': tokens, 'mfu': tokens * flops / gemm,
                    'gemm_flops_per_sec': gemm})
    return out


def _stage_times(spec, built=None, steps=3):
    """``{(stage, kind): us}``: the shortest time of each action of ``spec``'s
    stages issued one by one, each waited for before the next (so one device
    works at a time: no core shared, no copy overlapped), over ``steps``
    steps after the traced ones (the shortest: a loaded machine only adds to
    it, waking the threads late). GPipe's one graph has no stage executors:
    its stages are timed on the stage runtime of the same split (``'1f1b'``).
    """
    if built is None or kind(spec['schedule']).fused:
        built = _build(dict(spec, schedule='1f1b'))
    mod, batch = built
    names = list(mod._data_names) + list(mod._label_names)  # pylint: disable=protected-access
    inputs = dict(zip(names, list(batch.data) + list(batch.label)))
    runtime = mod._runtimes[0]  # pylint: disable=protected-access
    times = {}
    for _ in range(steps):
        mx.nd.waitall()
        clock = [time.perf_counter()]

        def each(action):
            mx.nd.waitall()
            now = time.perf_counter()
            times.setdefault((action.stage, action.kind), []).append((now - clock[0]) * 1e6)
            clock[0] = now
        runtime.run(inputs, train=True, each=each)
    return {key: min(t) for key, t in times.items()}


def _trace_child(specs, steps=3, timed=False):
    """In a fresh process: ``steps`` profiled steps of each spec (after one
    not profiled; the specs take turns, one step each), each step's
    ``forward_backward`` between two markers (``step_us``: its wall time);
    per spec, the step of the median span: each device's busy time, whether
    it started a dense layer's backward before its last dense layer's forward
    ended (:func:`_phase`), on the first stage's device the micro-batches
    it began before its first dense backward (its ``Embedding`` ops, a fixed
    number per micro-batch, that started then, rounded up: MXNet's engine
    may run the rest of a begun micro-batch's first ops after a backward
    that does not depend on them, as it did on a loaded machine), the bubble, and each device's idle time
    before its first op and after its last (``lead_us``, ``tail_us``: the
    rest of its idle time is between its ops). With ``timed``, also
    :func:`_stage_times` (``stage_us``, ``'<stage><kind>'``: us)."""
    built = []
    for spec in specs:
        mod, batch = _build(spec)
        mod.forward_backward(batch)
        mod.update()
        built.append((mod, batch))
    mx.nd.waitall()
    path = os.path.join(tempfile.mkdtemp(prefix='mp-schedules-'), 'trace.json')
    mx.profiler.set_config(profile_symbolic=True, profile_imperative=True, profile_api=False,
                           profile_memory=False, aggregate_stats=False, filename=path,
                           continuous_dump=False)
    domain = mx.profiler.Domain('schedules')
    mx.profiler.set_state('run')
    markers = [mx.profiler.Marker(domain, 'spec%d' % k) for k in range(len(built))]
    for _ in range(steps):  # the specs in turn, step by step: side by side in time
        for marker, (mod, batch) in zip(markers, built):
            mx.nd.waitall()
            marker.mark('process')
            mod.forward_backward(batch)
            mx.nd.waitall()
            marker.mark('process')
            mod.update()
    trace = _stopped_trace(path)
    ops = op_intervals(trace)
    results = []
    for k, spec in enumerate(specs):
        devices = ['cpu/%d' % s for s in range(spec['stages'])]
        windows = step_windows(trace, 'spec%d' % k)[::2]  # forward_backward, not update
        steps_seen = []
        for window in windows:
            step = clip(ops, window)
            stats = step_stats(step, devices)
            early, entered = {}, {}
            for d in devices:
                names = [(iv, _phase(iv[2])) for iv in step.get(d, [])]
                backward = [iv[0] for iv, phase in names if phase == 'B']
                forward = [iv[1] for iv, phase in names if phase == 'F']
                early[d] = bool(backward and forward and min(backward) < max(forward))
                first = min(backward, default=float('inf'))
                embeddings = [iv[0] for iv in step.get(d, []) if iv[2] == 'Embedding']
                if embeddings:  # the first stage's device: a fixed number per micro-batch
                    begun = sum(1 for t in embeddings if t < first) * spec['chunks']
                    entered[d] = -(-begun // len(embeddings))  # rounded up
            ops_of = {d: step.get(d, []) for d in devices}
            first = min(iv[0] for v in ops_of.values() for iv in v)
            last = max(iv[1] for v in ops_of.values() for iv in v)
            steps_seen.append(dict(stats, backward_before_last_forward=early,
                                   microbatches_before_first_backward=entered,
                                   step_us=window[1] - window[0],
                                   lead_us={d: v[0][0] - first if v else 0
                                            for d, v in ops_of.items()},
                                   tail_us={d: last - max(iv[1] for iv in v) if v else 0
                                            for d, v in ops_of.items()}))
        steps_seen.sort(key=lambda st: st['span_us'])
        results.append(steps_seen[(len(steps_seen) - 1) // 2])
    if timed:
        for result, spec, one in zip(results, specs, built):
            result['stage_us'] = {'%d%s' % key: us for key, us in _stage_times(spec, one).items()}
    return results


def alone_bubble(spec, stats):
    """The idle fraction of the step's span in the units the ideal assumes:
    ``1 - M x sum(stage_us) / (K x span)``, the work counted at its time
    alone (:func:`_stage_times`), not at the trace's busy time (which grows
    when devices share cores, and so shrinks the trace's bubble for the
    schedule that overlaps them most). On a machine where the devices do not
    slow each other it is the trace's bubble; beside :func:`timed_ideal` it
    is what the run loses to copies, the host, and devices sharing cores."""
    work = sum(stats['stage_us'].values()) * spec['chunks']
    return 1 - work / (spec['stages'] * stats['span_us'])


def timed_ideal(spec, stage_us):
    """The schedule's ideal bubble at the stage times ``stage_us``
    (``{'<stage><kind>': us}``, :func:`_stage_times`): what a perfect
    machine would leave idle with stages this uneven and copies free."""
    made = _schedule_of(spec)
    cost = {(int(key[:-1]), key[-1]): us for key, us in stage_us.items()}
    return bubble(made, cost)


def _schedule_of(spec):
    """The schedule of ``spec`` (``'stages'``: its devices, each holding its
    ``'virtual'`` stages, or as many as the schedule takes by default)."""
    v = check_spec(spec['schedule'], spec.get('virtual'))
    return make(spec['schedule'], spec['stages'] * v, spec['chunks'], v)


def _phase(op):
    """``'F'`` for ``FullyConnected``, ``'B'`` for its backward, else ``None``.

    Only these two: MXNet writes some gradients with forward ops (the
    attention's ``batch_dot`` and ``transpose`` appear in both passes), so an
    op's name does not tell its pass, but a dense layer's does.
    """
    return {'FullyConnected': 'F', '_backward_FullyConnected': 'B'}.get(op)


def _row(device):
    return device.replace('(', '/').rstrip(')')  # 'cpu(1)' -> 'cpu/1', as the counters name it


def trace(specs, timeout=900, steps=3, timed=False, threads=None):
    """``[stats]`` of one profiled step of each spec (the median span of
    ``steps``; with ``timed``, each stage's action times: see :func:`_trace_child`),
    all in one child process, with ``MXNET_EXEC_BULK_EXEC_TRAIN=0`` (each op
    its own row in the trace, not a bulked segment); ``threads``: each op's
    threads in it (``OMP_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS``, read
    when MXNet loads; ``None``: as the environment says, MXNet's default one
    per core, for each device).

    Raises:
        RuntimeError: the child failed (its last line of stderr).
    """
    env = {'MXNET_EXEC_BULK_EXEC_TRAIN': '0'}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    return _run_child({'specs': specs, 'mode': 'trace', 'steps': steps, 'timed': timed},
                      timeout, env)


def measure(specs, warmup=False, timeout=600):
    """``[{device: activation bytes}]`` after one step of each spec (``schedule``,
    ``stages``, ``chunks``, ``micro_batch``, ``lm``: ``GPTConfig`` fields),
    all measured in one child process, one after the other.

    Args:
        warmup: Run one step of the first spec, not measured, before them.
            MXNet keeps some per-device resources (its temporary workspace)
            once a step has made them, and counts them to the first step that
            needs them; after a warm-up, a later step counts only what it
            needs beyond them.

    Raises:
        RuntimeError: the child failed (its last line of stderr).
    """
    return _run_child({'specs': specs, 'warmup': warmup, 'mode': 'memory'}, timeout)


def _run_child(given, timeout, env=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0', **(env or {}))
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [root, env.get('PYTHONPATH')]))
    proc = subprocess.run([sys.executable, '-m', 'bench.schedules', '--child'],
                          input=json.dumps(given), capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=root)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ['(no stderr)']
        raise RuntimeError('%s measurement: expected exit status 0, found %d: %s'
                           % (given['mode'], proc.returncode, lines[-1]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def layered(lm, stages, layers_per_device):
    """``lm`` (default :data:`LM`) with ``layers_per_device x stages`` layers
    (``None``: as it is)."""
    lm = dict(lm or LM)
    if layers_per_device is not None:
        lm['num_layers'] = layers_per_device * stages
    return lm


def spec(schedule, stages, chunks, micro_batch, lm=None, virtual=None):
    """One configuration for :func:`measure`: ``stages`` devices ``cpu(0..)``
    (each holding ``virtual`` stages under ``'interleaved'``)."""
    one = {'schedule': schedule, 'stages': stages, 'chunks': chunks,
           'micro_batch': micro_batch, 'lm': dict(lm or LM)}
    if virtual is not None:
        one['virtual'] = virtual
    return one


def run(stages=(2, 3), chunks=(2, 4, 8), micro_batch=16, schedules=('gpipe', '1f1b'),
        log=print):
    """The table: one row per schedule, K and M; activation MiB per device."""
    specs = [spec(schedule, k, m, micro_batch) for k in stages for schedule in schedules
             for m in chunks]
    rows = []
    for one in specs:
        memory = measure([one])[0]  # a fresh process each: everything the step needs
        rows.append(dict(one, memory=memory))
        log('%-6s K=%d M=%d  %s' % (one['schedule'], one['stages'], one['chunks'], '  '.join(
            '%s %.1f MiB' % (d, b / 2 ** 20) for d, b in memory.items())))
    return rows


def compare(stages=(2, 3), chunks=(2, 4, 8), micro_batch=16, lm=None, virtual=2, steps=3,
            log=print, layers_per_device=None, threads=None, timed=False):
    """Every schedule side by side: for each K and M, ``'gpipe'``, ``'1f1b'``
    and ``'interleaved'`` (``virtual`` stages per device; only where M is a
    multiple of K) traced in one child process, steps taking turns
    (:func:`trace`), and their activation memory per device after a warm-up
    step in another (:func:`measure`), which then, its profiler stopped,
    times their steps (:func:`_rate_child`): one MXNet start fewer than a process each.

    Args:
        layers_per_device: The language model gets this many layers per
            device at each K (an even split: under ``'interleaved'`` with
            ``virtual=2`` and 2 per device, one layer per stage); ``None``:
            ``lm``'s.
        threads: Each op's threads in the traced child (:func:`trace`).
        timed: Also each stage's actions timed alone, the schedule's ideal
            at those times and the step's bubble counted at them (in each
            row as ``timed_ideal``, ``alone_bubble``: :func:`timed_ideal`,
            :func:`alone_bubble`).

    Returns:
        One dict per spec run: the spec, ``ideal`` (the schedule's bubble on
        one unit per action, :func:`~mp_symbolic.core.schedule.bubble`), the
        trace's stats, ``step_vs_gpipe`` (its median step over GPipe's at
        the same K and M), ``memory`` (``{device: bytes}``) and
        :func:`_rate_child`'s ``tokens_per_sec``, ``mfu`` and ``gemm_flops_per_sec``.
    """
    specs = []
    for k in stages:
        at_k = layered(lm, k, layers_per_device)
        for m in chunks:
            specs += [spec('gpipe', k, m, micro_batch, at_k),
                      dict(spec('gpipe', k, m, micro_batch, at_k), runtime='stages'),
                      spec('1f1b', k, m, micro_batch, at_k)]
            if m % k == 0:
                specs.append(spec('interleaved', k, m, micro_batch, at_k, virtual))
    traced = trace(specs, steps=steps, timed=timed, threads=threads)
    # memory then rate in one child: the storage profiler is stopped before the timed steps
    both = _run_child({'specs': specs, 'warmup': True, 'mode': 'memory',
                       'rate': {'steps': 2, 'repeats': steps}}, 900)
    memory, rates = both['memory'], both['rate']
    rows, gpipe_step = [], {}
    for one, stats, held, speed in zip(specs, traced, memory, rates):
        k, m = one['stages'], one['chunks']
        made = _schedule_of(one)
        if one['schedule'] == 'gpipe' and 'runtime' not in one:
            gpipe_step[(k, m)] = stats['step_us']
        row = dict(one, ideal=bubble(made), memory=held,
                   step_vs_gpipe=stats['step_us'] / gpipe_step[(k, m)], **speed, **stats)
        if timed:
            row['timed_ideal'] = timed_ideal(one, stats['stage_us'])
            row['alone_bubble'] = alone_bubble(one, stats)
        rows.append(row)
    layers = '%d layers' % specs[0]['lm']['num_layers'] if layers_per_device is None else \
        '%d layers per device' % layers_per_device
    log('schedules on the language model (width %d, %s, context %d), micro-batch %d, '
        'K devices (interleaved: %d stages on each): bubble and busy time of the median traced '
        'step of %d beside the schedule\'s ideal%s, step time over gpipe\'s (side by side, '
        'steps in turn), '
        'activation MiB per device after a warm-up step; tokens/s of the steps not profiled '
        'and the model FLOPs utilisation against a 1024^3 matrix product timed beside them '
        '(%.1f GFLOP/s)'
        % (specs[0]['lm']['num_hiddens'], layers, specs[0]['lm']['block_size'], micro_batch,
           virtual, steps, ' (and at the stages\' times, each action alone)' if timed else '',
           rates[0]['gemm_flops_per_sec'] / 1e9))
    lines = [['schedule', 'K', 'M', 'bubble', 'ideal'] +
             (['at stage times', 'bubble at stage times'] if timed else []) +
             ['busy ms per device', 'step ms', 'step/gpipe', 'activations MiB', 'tokens/s',
              'MFU']]
    for row in rows:
        lines.append([row['schedule'] + (' (stages)' if 'runtime' in row else ''),
                      str(row['stages']), str(row['chunks']),
                      '%.2f' % row['bubble'], '%.2f' % row['ideal']] +
                     (['%.2f' % row['timed_ideal'], '%.2f' % row['alone_bubble']]
                      if timed else []) +
                     [' '.join('%.0f' % (b / 1e3) for b in row['busy_us'].values()),
                      '%.0f' % (row['step_us'] / 1e3), '%.2f' % row['step_vs_gpipe'],
                      ' '.join('%.1f' % (b / 2 ** 20) for b in row['memory'].values()),
                      '%.0f' % row['tokens_per_sec'], '%.3f' % row['mfu']])
    skipped = sorted({(k, m) for k in stages for m in chunks if m % k})
    for line in columns(lines):
        log('  ' + line)
    if skipped:
        log('  interleaved needs M a multiple of K: not run at %s'
            % ', '.join('K=%d M=%d' % km for km in skipped))
    return rows


def _where_idle(one, stats):
    """One line: the ideal at the stages' measured times, the busy time over
    those times (above 1: the devices slowed each other), and each device's
    idle ms before its first op, between its ops and after its last, and the
    bubble counted at the stage times (:func:`alone_bubble`)."""
    serial = sum(us for us in stats['stage_us'].values()) * one['chunks']
    idle = []
    for d, busy in stats['busy_us'].items():
        lead, tail = stats['lead_us'][d], stats['tail_us'][d]
        idle.append('%.0f/%.0f/%.0f' % (lead / 1e3, (stats['span_us'] - busy - lead - tail) / 1e3,
                                        tail / 1e3))
    stage_ms = ' '.join('%s %.1f' % (key, us / 1e3) for key, us in sorted(
        stats['stage_us'].items(), key=lambda kv: (int(kv[0][:-1]), kv[0][-1] == 'B')))
    return ('ideal at the stage times %.2f  bubble at the stage times %.2f  busy over the stage '
            'times %.2f  idle ms before/between/after: %s  stage ms (alone): %s'
            % (timed_ideal(one, stats['stage_us']), alone_bubble(one, stats),
               sum(stats['busy_us'].values()) / serial,
               '  '.join(idle), stage_ms))


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.schedules', description=__doc__)
    parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--stages', default='2,3', help='stage counts K (default 2,3)')
    parser.add_argument('--chunks', default='2,4,8', help='micro-batch counts M (default 2,4,8)')
    parser.add_argument('--micro-batch', type=int, default=16,
                        help='sequences per micro-batch (default 16)')
    parser.add_argument('--trace', action='store_true',
                        help='the profiler trace instead: busy time, early backwards, bubble')
    parser.add_argument('--compare', action='store_true',
                        help='gpipe, 1f1b and interleaved side by side instead: bubble beside '
                             'the ideal, step time over gpipe\'s, activation memory')
    parser.add_argument('--layers-per-device', type=int, default=None, metavar='N',
                        help='--trace, --compare: the language model with N layers per device '
                             'at each K (an even split; default: its 4 layers at every K)')
    parser.add_argument('--threads', type=int, default=None, metavar='N',
                        help='--trace, --compare: each op\'s threads in the traced process '
                             '(OMP_NUM_THREADS, OPENBLAS_NUM_THREADS; default: as the '
                             'environment says, one per core for each device)')
    args = parser.parse_args(argv)
    stages = [int(k) for k in args.stages.split(',')]
    chunks = [int(m) for m in args.chunks.split(',')]
    if args.child:
        given = json.loads(sys.stdin.read())
        if given['mode'] == 'trace':
            print(json.dumps(_trace_child(given['specs'], given.get('steps', 3),
                                          given.get('timed', False))))
        else:
            held = _child(given['specs'], given['warmup'])
            if 'rate' in given:  # then, the profiler stopped, the steps timed (compare)
                held = {'memory': held, 'rate': _rate_child(given['specs'],
                                                            given['rate']['steps'],
                                                            given['rate']['repeats'])}
            print(json.dumps(held))
        return
    if args.compare:
        compare(stages, chunks, args.micro_batch, layers_per_device=args.layers_per_device,
                threads=args.threads, timed=True)
        return
    if args.trace:
        print('one profiled step (median span of 3) of the language model (width %d), '
              'micro-batch %d: busy ms per device, a backward before the last forward on '
              'every device, bubble beside the schedule\'s ideal (K-1)/(M+K-1)'
              % (LM['num_hiddens'], args.micro_batch))
        specs = [spec(schedule, k, m, args.micro_batch, layered(None, k, args.layers_per_device))
                 for k in stages for schedule in ('gpipe', '1f1b') for m in chunks]
        for one, stats in zip(specs, trace(specs, timed=True, threads=args.threads)):
            k, m = one['stages'], one['chunks']
            print('%-6s K=%d M=%d  busy %s  early backward on all: %s  bubble %.2f  '
                  'ideal %.2f  span %.1f ms%s'
                  % (one['schedule'], k, m, ' '.join('%.1f' % (b / 1e3) for b in
                                                      stats['busy_us'].values()),
                     'yes' if all(stats['backward_before_last_forward'].values()) else 'no',
                     stats['bubble'], (k - 1) / (m + k - 1), stats['span_us'] / 1e3,
                     '' if args.layers_per_device is None else
                     '  (%d layers)' % one['lm']['num_layers']))
            print('  %s' % _where_idle(one, stats))
        return
    print('activation memory per device after one step: the language model (width %d, %d '
          'layers, context %d), micro-batch %d' % (LM['num_hiddens'], LM['num_layers'],
                                                   LM['block_size'], args.micro_batch))
    run(stages, chunks, args.micro_batch)


if __name__ == '__main__':
    main()
