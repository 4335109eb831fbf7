"""``python -m bench.bn_chunks``: the digits CNN (BatchNorm included) with
``--chunks 4`` against ``--chunks 1``, as the command line trains them.

Each variant is ``python -m mp_symbolic train --task digits`` in a process of
its own (oneDNN is switched on or off once per process), run in alternating
rounds so that a busy machine slows every variant alike; the figure is the
training loop's own wall time (what the ``training: X s wall`` line prints,
after ``waitall()``, no checkpoints, no start-up; read unrounded from the
run's ``summary.json``). Per round, each variant's time
is divided by ``--chunks 1``'s; the median of those ratios is reported. The
last variant is what every ``--chunks`` run did before: oneDNN off
(``MXNET_MKLDNN_ENABLED=0``). Also counts the ``Storage type fallback``
blocks each variant wrote to stderr.

``--steps-only`` times forward and backward of the bound graphs instead, in
this process (oneDNN as the environment says), on the three-device plan and
on one device, to tell the micro-batching's own cost from the split's.
``--ops`` says where that cost goes: one training step of the digits graph on
one device, recorded by MXNet's profiler with bulking off (each op its own
engine operation), in a child process per variant; the time per step of each
op type with chunks 1 and 4.
``--sweep`` binds the digits graph at every balance over 2 and 3 devices with
1, 2 and 4 chunks, with MXNet's memory planner as it is and with
:mod:`mp_symbolic.core.base.compat`'s workaround, and counts the cuts that fail or
whose gradients differ from the same graph on one device.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import traceback

from mp_symbolic.tools.checkpoint import SUMMARY_NAME
from mp_symbolic.tools.text import columns

__all__ = ['VARIANTS', 'run_variant', 'measure', 'step_times', 'without_segment_boundaries',
           'profile_step', 'op_times', 'sweep', 'main']

# name -> (--chunks, extra environment)
VARIANTS = {
    'chunks=1': (1, {}),
    'chunks=4': (4, {}),
    'chunks=4, oneDNN off': (4, {'MXNET_MKLDNN_ENABLED': '0'}),
}
BASE = 'chunks=1'
_WALL = re.compile(r'^training: ([0-9.]+) s wall', re.M)


def run_variant(chunks, env, num_epochs, out_dir):
    """One training run; ``(seconds of the training loop, fallback blocks on stderr)``.

    Raises:
        RuntimeError: the run failed or printed no ``training:`` line.
    """
    cmd = [sys.executable, '-m', 'mp_symbolic', 'train', '--task', 'digits',
           '--chunks', str(chunks), '--epochs', str(num_epochs), '--no-memory',
           '--no-progress', '--out', out_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, **env))
    if proc.returncode != 0 or not _WALL.search(proc.stdout):
        lines = proc.stderr.strip().splitlines() or ['(no stderr)']
        raise RuntimeError('%s: expected exit status 0 and a training line, found %d: %s'
                           % (' '.join(cmd[2:]), proc.returncode, lines[-1]))
    # the line rounds to 10 ms; the checkpoint's summary keeps the measured seconds
    with open(os.path.join(out_dir, 'current', SUMMARY_NAME)) as f:
        seconds = json.load(f)['wall_time_s']
    return seconds, proc.stderr.count('Storage type fallback detected')


def measure(rounds, num_epochs, log=print):
    """``{variant: {'seconds': [...], 'ratios': [...], 'fallbacks': [...]}}``."""
    results = {name: {'seconds': [], 'ratios': [], 'fallbacks': []} for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix='bn-chunks-') as tmp:
        for r in range(rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            seconds = {}
            for name in order:
                chunks, env = VARIANTS[name]
                seconds[name], fallbacks = run_variant(
                    chunks, env, num_epochs, os.path.join(tmp, 'r%d-%d' % (r, chunks)))
                results[name]['seconds'].append(seconds[name])
                results[name]['fallbacks'].append(fallbacks)
            for name in VARIANTS:
                results[name]['ratios'].append(seconds[name] / seconds[BASE])
            log('round %d/%d: %s' % (r + 1, rounds, ', '.join(
                '%s %.3f s' % (n, seconds[n]) for n in VARIANTS)))
    return results


def step_times(batch_size, one_device, rounds, num_steps=40):
    """Median seconds of one forward + backward of the digits graph with
    chunks 1 and 4, and the median of their per-round ratios:
    ``(t1, t4, ratio)``. Bound as the library binds them; alternating."""
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    import numpy as np
    from mp_symbolic import Pipeline
    from mp_symbolic.core.base import timing
    from mp_symbolic.core.base.compat import split_bind
    from mp_symbolic.training.tasks import digits
    exes = {}
    for chunks in (1, 4):
        pipe = Pipeline(digits.build_blocks(), 'cpu:0,cpu:1,cpu:2', chunks=chunks)
        group2ctx = pipe.plan.group2ctx
        if one_device:
            group2ctx = {g: mx.cpu(0) for g in group2ctx}
        with split_bind(group2ctx):
            exes[chunks] = pipe.training_symbol('softmax').simple_bind(
                mx.cpu(0), group2ctx=group2ctx, data=(batch_size, 1, 8, 8),
                softmax_label=(batch_size,))
        rng = np.random.default_rng(0)
        for arr in exes[chunks].arg_arrays:
            arr[:] = rng.uniform(-0.1, 0.1, arr.shape)

    def seconds(exe, steps):
        def run():
            for _ in range(steps):
                exe.forward(is_train=True)
                exe.backward()
        return timing.seconds(run) / steps

    for exe in exes.values():
        seconds(exe, num_steps // 2)  # warm-up: oneDNN primitives, memory
    times = {1: [], 4: []}
    for r in range(rounds):
        for chunks in ((1, 4) if r % 2 == 0 else (4, 1)):
            times[chunks].append(seconds(exes[chunks], num_steps))
    ratios = [t4 / t1 for t1, t4 in zip(times[1], times[4])]
    return (statistics.median(times[1]), statistics.median(times[4]),
            statistics.median(ratios))


def _steps_only(rounds):
    rows = [['batch', 'graph', 'chunks=1', 'chunks=4', 'ratio (median)']]
    for batch_size in (64, 256):
        for one_device in (True, False):
            t1, t4, ratio = step_times(batch_size, one_device, rounds)
            rows.append([str(batch_size), 'one device' if one_device else 'three devices',
                         '%.2f ms' % (t1 * 1e3), '%.2f ms' % (t4 * 1e3), '%.2fx' % ratio])
    print('forward + backward of the digits graph, %d alternating rounds of 40 steps:' % rounds)
    for line in columns(rows):
        print('  ' + line)
    return 0


def without_segment_boundaries(symbol):
    """``symbol`` with every micro-batch boundary copy
    (:func:`mp_symbolic.core.base.compat.segment_boundaries`) bypassed, and how
    many there were."""
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    from mp_symbolic.core.base.compat import SEGMENT_BOUNDARY_OP
    graph = json.loads(symbol.tojson())
    alias = {i: n['inputs'][0] for i, n in enumerate(graph['nodes'])
             if n['op'] == SEGMENT_BOUNDARY_OP}
    for node in graph['nodes']:
        node['inputs'] = [alias.get(e[0], e) for e in node['inputs']]
    return mx.sym.load_json(json.dumps(graph)), len(alias)


def profile_step(chunks, devices, path, batch_size=64, boundaries=True):
    """One training step of the digits graph, recorded to the profiler trace
    ``path`` after two warm-up steps; the gradients go to ``path + '.npy'``.
    Run it in a process of its own (MXNet's profiler serves one trace per
    process): the child process of :func:`op_times`.

    Args:
        boundaries: False: the micro-batch boundary copies bypassed
            (:func:`without_segment_boundaries`).
    """
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    import numpy as np
    from mp_symbolic import Pipeline
    from mp_symbolic.core.base.compat import split_bind
    from mp_symbolic.training.tasks import digits
    pipe = Pipeline(digits.build_blocks(), devices, chunks=chunks)
    group2ctx = pipe.plan.group2ctx
    symbol = pipe.training_symbol('softmax')
    if not boundaries:
        symbol, _ = without_segment_boundaries(symbol)
    with split_bind(group2ctx):
        exe = symbol.simple_bind(pipe.plan.first_device, group2ctx=group2ctx,
                                 data=(batch_size, 1, 8, 8), softmax_label=(batch_size,),
                                 grad_req={n: 'null' if n in ('data', 'softmax_label')
                                           else 'write' for n in symbol.list_arguments()})
    rng = np.random.default_rng(0)
    for name in sorted(exe.arg_dict):
        exe.arg_dict[name][:] = rng.uniform(-0.3, 0.3, exe.arg_dict[name].shape)
    exe.arg_dict['softmax_label'][:] = rng.integers(0, 10, batch_size)
    for step in range(3):  # the last step is recorded
        if step == 2:
            mx.profiler.set_config(profile_symbolic=True, filename=path, continuous_dump=False)
            mx.profiler.set_state('run')
        exe.forward(is_train=True)
        exe.backward()
        mx.nd.waitall()
    mx.profiler.set_state('stop')
    from mp_symbolic.tools.trace import dump as dump_trace  # pylint: disable=import-outside-toplevel
    dump_trace(path)
    np.save(path + '.npy', np.concatenate([exe.grad_dict[n].asnumpy().ravel()
                                           for n in sorted(exe.grad_dict)
                                           if exe.grad_dict[n] is not None]))
    return 0


def _profile_forked(devices, runs):
    """:func:`profile_step` of each ``(chunks, path)`` or ``(chunks, path,
    boundaries)`` in ``runs``, each in a process forked from this one once
    MXNet is imported (before any array or profiler exists): a fresh
    profiler each, one MXNet start for all.

    Returns:
        0, or 1 once a run fails (its traceback on stderr).
    """
    import mxnet  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    from mp_symbolic import Pipeline  # noqa: F401  pylint: disable=C0415,W0611
    from mp_symbolic.training.tasks import digits  # noqa: F401  pylint: disable=C0415,W0611
    for chunks, path, *boundaries in runs:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # no Python shutdown, no MXNet teardown in the fork
            status = 1
            try:
                status = profile_step(chunks, devices, path, boundaries=all(boundaries))
            except BaseException:  # pylint: disable=broad-except
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(status)  # pylint: disable=protected-access
        if os.waitpid(pid, 0)[1] != 0:
            return 1
    return 0


def op_times(devices='cpu:0', rounds=3):
    """``{chunks: {op type: (calls, microseconds)}}`` for one training step of
    the digits graph on ``devices`` with bulking off, chunks 1 and 4; the
    median over ``rounds`` of each op type's time, each step profiled in a
    process of its own (forks of one child: :func:`_profile_forked`).

    Raises:
        RuntimeError: a child process failed.
    """
    from mp_symbolic.tools.trace import load_trace, op_intervals  # pylint: disable=import-outside-toplevel
    env = dict(os.environ, MXNET_EXEC_BULK_EXEC_TRAIN='0')
    samples = {1: [], 4: []}
    with tempfile.TemporaryDirectory(prefix='bn-ops-') as tmp:
        runs = [(chunks, os.path.join(tmp, '%d-%d.json' % (r, chunks)))
                for r in range(rounds) for chunks in ((1, 4) if r % 2 == 0 else (4, 1))]
        # one child, each step profiled in a fork of it (a fresh profiler each)
        cmd = [sys.executable, '-m', 'bench.bn_chunks', '--profile-steps', devices] + \
            ['%d:%s' % run for run in runs]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600 * len(runs),
                              env=env)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or ['(no stderr)']
            raise RuntimeError('%s: expected exit status 0, found %d: %s'
                               % (' '.join(cmd[2:4]), proc.returncode, lines[-1]))
        for chunks, path in runs:
            per_op = {}
            for intervals in op_intervals(load_trace(path)).values():
                for start, end, name in intervals:
                    calls, micros = per_op.get(name, (0, 0.0))
                    per_op[name] = (calls + 1, micros + end - start)
            samples[chunks].append(per_op)
    result = {}
    for chunks, runs in samples.items():
        names = set().union(*runs)
        result[chunks] = {n: (max(run.get(n, (0, 0))[0] for run in runs),
                              statistics.median(run.get(n, (0, 0.0))[1] for run in runs))
                          for n in names}
    return result


def _ops(rounds):
    times = op_times(rounds=rounds)
    names = sorted(set(times[1]) | set(times[4]),
                   key=lambda n: -(times[4].get(n, (0, 0))[1] - times[1].get(n, (0, 0))[1]))
    rows = [['op', 'chunks=1', 'chunks=4', 'difference']]
    totals = {c: sum(t for _, t in times[c].values()) for c in (1, 4)}
    for name in names:
        (c1, t1), (c4, t4) = times[1].get(name, (0, 0.0)), times[4].get(name, (0, 0.0))
        if max(t1, t4) < 5:
            continue
        rows.append([name, '%d x, %.0f us' % (c1, t1), '%d x, %.0f us' % (c4, t4),
                     '%+.0f us' % (t4 - t1)])
    rows.append(['all ops', '%.0f us' % totals[1], '%.0f us' % totals[4],
                 '%+.0f us (%.2fx)' % (totals[4] - totals[1], totals[4] / totals[1])])
    print('one training step of the digits graph (batch 64) on cpu(0), each op alone '
          '(MXNET_EXEC_BULK_EXEC_TRAIN=0), median of %d child processes; ops of 5 us or '
          'more:' % rounds)
    for line in columns(rows):
        print('  ' + line)
    return 0


def _two_steps(pipe, group2ctx, scope, batch_size=64):
    """Gradients and output after two training steps on one fixed batch."""
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    import numpy as np
    with scope:
        exe = pipe.training_symbol('softmax').simple_bind(
            mx.cpu(0), group2ctx=group2ctx, data=(batch_size, 1, 8, 8),
            softmax_label=(batch_size,))
    rng = np.random.default_rng(0)
    for name in sorted(exe.arg_dict):
        exe.arg_dict[name][:] = rng.uniform(-0.3, 0.3, exe.arg_dict[name].shape)
    exe.arg_dict['softmax_label'][:] = rng.integers(0, 10, batch_size)
    for name, arr in exe.aux_dict.items():
        arr[:] = 1 if name.endswith('var') else 0
    for _ in range(2):
        exe.forward(is_train=True)
        exe.backward()
    out = {n: g.asnumpy() for n, g in exe.grad_dict.items() if g is not None}
    out['output'] = exe.outputs[0].asnumpy()
    return out


def sweep(log=print):
    """Rows ``[devices, chunks, planner, failed, differ, cuts]`` over every balance."""
    # pylint: disable=import-outside-toplevel
    import itertools
    import mxnet as mx
    import numpy as np
    from mp_symbolic import Pipeline
    from mp_symbolic.core.base import compat
    from mp_symbolic.core.base.compat import split_bind
    from mp_symbolic.core.base.scoped import environ
    from mp_symbolic.training.tasks import digits
    num_blocks = len(digits.build_blocks())
    rows = []
    for num_devices in (2, 3):
        cuts = list(itertools.combinations(range(1, num_blocks), num_devices - 1))
        for chunks in (1, 2, 4):
            counts = {'as MXNet plans it': [0, 0], 'compat workaround': [0, 0]}
            for cut in cuts:
                balance = [b - a for a, b in zip((0,) + cut, cut + (num_blocks,))]
                pipe = Pipeline(digits.build_blocks(),
                                ','.join('cpu:%d' % i for i in range(num_devices)),
                                balance=balance, chunks=chunks)
                group2ctx = pipe.plan.group2ctx
                want = _two_steps(pipe, {g: mx.cpu(0) for g in group2ctx}, split_bind(None))
                for planner, scope in (('as MXNet plans it', environ(**compat.SUBGRAPH_BACKEND)),
                                       ('compat workaround', split_bind(group2ctx))):
                    try:
                        got = _two_steps(pipe, group2ctx, scope)
                    except mx.base.MXNetError:
                        counts[planner][0] += 1
                        continue
                    if any(not np.allclose(got[n], want[n], rtol=1e-4, atol=1e-4) for n in want):
                        counts[planner][1] += 1
            for planner, (failed, differ) in counts.items():
                rows.append([str(num_devices), str(chunks), planner, str(failed), str(differ),
                             str(len(cuts))])
                log('  '.join(rows[-1]))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.bn_chunks', description=__doc__
                                     .split('\n\n')[0])
    parser.add_argument('--rounds', type=int, default=5,
                        help='alternating rounds; the median is reported (default: %(default)s)')
    parser.add_argument('--epochs', type=int, default=10,
                        help='epochs per run (default: %(default)s, as make train-digits)')
    parser.add_argument('--sweep', action='store_true',
                        help='count the balances MXNet fails on, without and with the '
                             'workaround')
    parser.add_argument('--steps-only', action='store_true',
                        help='time forward + backward of the bound graphs in this process '
                             'instead of training runs')
    parser.add_argument('--ops', action='store_true',
                        help='time each op type of one step on one device, chunks 1 and 4 '
                             '(MXNet\'s profiler, bulking off)')
    parser.add_argument('--profile-step', nargs=3, metavar=('CHUNKS', 'DEVICES', 'PATH'),
                        help=argparse.SUPPRESS)  # one profiled step in this process
    parser.add_argument('--profile-steps', nargs='+', metavar='DEVICES CHUNKS:PATH',
                        help=argparse.SUPPRESS)  # the child process of --ops
    args = parser.parse_args(argv)
    if args.profile_step:
        chunks, devices, path = args.profile_step
        return profile_step(int(chunks), devices, path)
    if args.profile_steps:
        devices, runs = args.profile_steps[0], args.profile_steps[1:]
        return _profile_forked(devices, [(int(c), p) for c, p in
                                         (run.split(':', 1) for run in runs)])
    if args.rounds < 1 or args.epochs < 1:
        parser.error('expected --rounds and --epochs of at least 1, found %d and %d'
                     % (args.rounds, args.epochs))
    if args.steps_only:
        return _steps_only(args.rounds)
    if args.ops:
        return _ops(args.rounds)
    if args.sweep:
        from mp_symbolic.core.base.compat import onednn_active  # pylint: disable=import-outside-toplevel
        rows = sweep(log=lambda line: None)
        print('digits, every balance, two steps of batch 64, oneDNN %s:'
              % ('on' if onednn_active() else 'off'))
        for line in columns([['devices', 'chunks', 'memory plan', 'failed', 'differ',
                              'cuts']] + rows):
            print('  ' + line)
        return 0
    results = measure(args.rounds, args.epochs)
    rows = [['variant', 'epoch (median)', 'vs chunks=1 (median ratio)', 'fallback blocks']]
    for name, res in results.items():
        rows.append([name, '%.3f s' % (statistics.median(res['seconds']) / args.epochs),
                     '%.2fx' % statistics.median(res['ratios']),
                     '%d' % max(res['fallbacks'])])
    print('digits, %d epochs per run, %d rounds:' % (args.epochs, args.rounds))
    for line in columns(rows):
        print('  ' + line)
    return 0


if __name__ == '__main__':
    sys.exit(main())
