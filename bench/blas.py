"""``python -m bench.blas``: OpenBLAS at the CPU's own kernel against its own choice.

The kernel is the one the commands have MXNet's OpenBLAS run
(:mod:`mp_symbolic.tools.blas`: ``OPENBLAS_CORETYPE`` as the library loads,
checked), against ``MP_SYMBOLIC_BLAS=default``. OpenBLAS picks its kernel
when it loads, so each side runs in processes of its own, started in
alternated rounds (the kernel first in even rounds, last in odd ones), so
that a change in the machine's load touches both alike:

* ``dot`` and ``batch_dot`` on float32 matrices (the language model's
  attention shapes among them): seconds a call, in one process per side and
  round, and GFLOP/s;
* every bundled task, ``python -m mp_symbolic train --task T`` (regression,
  digits, zoo, lm) with ``--epochs`` as given (the language model on
  ``make train-lm``'s two devices, on :data:`LM_ARGS`'s shorter epoch): the
  samples/s and wall time
  its ``training:`` line prints, and whether its ``parameters sha256`` is the
  same on both sides (a kernel changes the float32 rounding of ``dot`` and
  ``batch_dot``, never of oneDNN's ``FullyConnected`` and convolutions).

It prints medians over the rounds and their ratios (kernel over OpenBLAS's own
choice: above 1 is faster), the thread settings and the load average before
and after.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from mp_symbolic.tools import blas
from mp_symbolic.tools.cliargs import OneLineArgumentParser, print_error
from mp_symbolic.tools.text import columns

__all__ = []

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ('regression', 'digits', 'zoo', 'lm')
TIMEOUT = 3600  # seconds one child may take
# make train-lm's devices; an epoch of 2**17 characters (128 steps), not 2**22
LM_ARGS = ('--devices', 'cpu:0,cpu:1', '--task-arg', 'train_chars=131072',
           '--task-arg', 'val_chars=8192')

# (op, batch or None, m, k, n, transpose_b, what it stands for)
CASES = (
    ('dot', None, 64, 64, 64, False, ''),
    ('dot', None, 256, 256, 256, False, ''),
    ('dot', None, 1024, 1024, 1024, False, 'the GEMM peak of bench.lm'),
    ('dot', None, 1024, 64, 256, False, 'a dense layer, width 64'),
    ('batch_dot', 64, 64, 16, 64, True, 'attention scores, width 64'),
    ('batch_dot', 64, 64, 64, 16, False, 'attention values, width 64'),
    ('batch_dot', 64, 64, 64, 64, True, 'attention scores, width 256'),
    ('batch_dot', 64, 64, 64, 64, False, 'attention values, width 256'),
)

# The child's program: argv[1] the cases (JSON), argv[2] seconds per case,
# argv[3] the kernel (loaded as the commands load it) or nothing.
_MICRO = r'''
import ctypes, json, sys, time
if len(sys.argv) > 3:
    from mp_symbolic.tools.blas import load
    load(sys.argv[3])
import numpy as np
import mxnet as mx
cases, budget = json.loads(sys.argv[1]), float(sys.argv[2])
f = mx.base._LIB.openblas_get_corename
f.restype = ctypes.c_char_p
rng = np.random.RandomState(0)
out = []
for op, batch, m, k, n, tb in cases:
    lead = () if batch is None else (batch,)
    a = mx.nd.array(rng.uniform(-1, 1, lead + (m, k)))
    b = mx.nd.array(rng.uniform(-1, 1, lead + ((n, k) if tb else (k, n))))
    call = getattr(mx.nd, op)
    for _ in range(3):
        call(a, b, transpose_b=tb).wait_to_read()
    calls, start = 0, time.perf_counter()
    while True:
        call(a, b, transpose_b=tb).wait_to_read()
        calls += 1
        elapsed = time.perf_counter() - start
        if calls >= 3 and elapsed >= budget:
            break
    out.append(elapsed / calls)
print(json.dumps({'core': f().decode(), 'seconds': out}))
'''

_TRAINING = re.compile(r'^training: ([\d.]+) s wall, ([\d.]+) samples/s', re.M)
_DIGEST = re.compile(r'^parameters sha256: ([0-9a-f]{64})$', re.M)


def _environments():
    """(with the kernel, OpenBLAS's own choice): the children's environments."""
    base = {k: v for k, v in os.environ.items() if k not in (blas.VARIABLE, blas.SWITCH)}
    base['PYTHONPATH'] = os.pathsep.join(
        [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p])
    base.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')
    return base, dict(base, **{blas.SWITCH: 'default'})


def _run(argv, env):
    result = subprocess.run(argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=TIMEOUT, check=False)
    if result.returncode:
        tail = (result.stderr.strip().splitlines() or ['no output'])[-1]
        raise RuntimeError('%s exited %d: %s' % (' '.join(argv[1:4]), result.returncode, tail))
    return result.stdout


def micro(env, budget, kernel=None):
    """``(kernel OpenBLAS runs, [seconds a call of each case])`` in a child."""
    cases = [list(case[:6]) for case in CASES]
    out = _run([sys.executable, '-c', _MICRO, json.dumps(cases), repr(budget)]
               + ([kernel] if kernel else []), env)
    found = json.loads(out.strip().splitlines()[-1])
    return found['core'], found['seconds']


def train(task, env, epochs, out):
    """``(samples/s, wall seconds, parameters sha256)`` of one training run."""
    argv = [sys.executable, '-m', 'mp_symbolic', 'train', '--task', task, '--no-progress',
            '--no-memory', '--out', out]
    if epochs:
        argv += ['--epochs', str(epochs)]
    if task == 'lm':
        argv += list(LM_ARGS)
    text = _run(argv, env)
    rate, digest = _TRAINING.search(text), _DIGEST.search(text)
    if rate is None:
        raise RuntimeError('train --task %s printed no training: line' % task)
    return float(rate.group(2)), float(rate.group(1)), digest.group(1) if digest else None


def _flops(case):
    _, batch, m, k, n, _, _ = case
    return 2.0 * (batch or 1) * m * k * n


def _label(case):
    op, batch, m, k, n, tb, what = case
    shape = '%s%dx%d @ %dx%d%s' % ('%d x ' % batch if batch else '', m, k, k, n,
                                   ' (B transposed)' if tb else '')
    return '%s %s%s' % (op, shape, ', ' + what if what else '')


def _ratio(fast, slow):
    return '%.2f' % (fast / slow) if slow else '-'


def main(argv=None):
    parser = OneLineArgumentParser(
        prog='python -m bench.blas',
        description='OpenBLAS at the CPU\'s kernel (OPENBLAS_CORETYPE, as python -m '
                    'mp_symbolic sets it) against OpenBLAS\'s own choice, in alternated rounds: '
                    'dot and batch_dot, and every bundled task\'s training.')
    parser.add_argument('--rounds', type=int, default=4, metavar='N',
                        help='alternated rounds (default: %(default)s)')
    parser.add_argument('--tasks', default=','.join(TASKS), metavar='LIST',
                        help='bundled tasks to train, comma-separated; empty for none '
                             '(default: %(default)s)')
    parser.add_argument('--epochs', type=int, default=1, metavar='N',
                        help='epochs of each training run; 0 for the task\'s own '
                             '(default: %(default)s)')
    parser.add_argument('--seconds', type=float, default=0.5, metavar='S',
                        help='seconds of calls per micro-benchmark case (default: %(default)s)')
    parser.add_argument('--quick', action='store_true',
                        help='a smoke run: 1 round, regression only, short micro-benchmarks')
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(',') if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or args.rounds < 1 or args.epochs < 0 or not args.seconds > 0:
        print_error('python -m bench.blas: expected --tasks from %s, --rounds >= 1, --epochs >= 0 '
                    'and --seconds > 0, found %s' % (','.join(TASKS), ', '.join(
                        unknown) or '--rounds %d --epochs %d --seconds %g'
                    % (args.rounds, args.epochs, args.seconds)))
        return 2
    if args.quick:
        args.rounds, tasks, args.seconds = 1, ['regression'], 0.05
    import bench  # pylint: disable=import-outside-toplevel
    choice = getattr(bench, 'CHOICE', None) or blas.recommended()
    kernel = choice.coretype
    if kernel is None:
        print_error('python -m bench.blas: expected a kernel the commands choose, found none: %s'
                    % choice.reason)
        return 2
    env_kernel, env_default = _environments()
    print('OPENBLAS_CORETYPE=%s against OpenBLAS\'s own choice; %d alternated rounds; '
          'OMP_NUM_THREADS=%s, OPENBLAS_NUM_THREADS=%s; %d cores; load %s'
          % (kernel, args.rounds, os.environ.get('OMP_NUM_THREADS', 'unset'),
             os.environ.get('OPENBLAS_NUM_THREADS', 'unset'), os.cpu_count(),
             '%.2f %.2f %.2f' % os.getloadavg()), flush=True)
    sides = (('kernel', env_kernel), ('default', env_default))
    seconds = {'kernel': [], 'default': []}
    cores = {}
    runs = {(t, s): [] for t in tasks for s in ('kernel', 'default')}
    with tempfile.TemporaryDirectory(prefix='bench-blas-') as tmp:
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for side, env in order:
                cores[side], found = micro(env, args.seconds,
                                           kernel if side == 'kernel' else None)
                seconds[side].append(found)
            for task in tasks:
                for side, env in order:
                    runs[task, side].append(train(task, env, args.epochs,
                                                  os.path.join(tmp, '%s-%s-%d' % (task, side, r))))
            print('round %d/%d done, load %.2f' % (r + 1, args.rounds, os.getloadavg()[0]),
                  flush=True)
    print('OpenBLAS runs %s under OPENBLAS_CORETYPE=%s, %s on its own'
          % (cores['kernel'], kernel, cores['default']))
    rows = [['op', 'kernel ms', 'own ms', 'kernel GFLOP/s', 'own GFLOP/s', 'speed-up']]
    for i, case in enumerate(CASES):
        k = statistics.median(s[i] for s in seconds['kernel'])
        d = statistics.median(s[i] for s in seconds['default'])
        rows.append([_label(case), '%.3f' % (k * 1e3), '%.3f' % (d * 1e3),
                     '%.1f' % (_flops(case) / k / 1e9), '%.1f' % (_flops(case) / d / 1e9),
                     _ratio(d, k)])
    print('\n'.join(columns(rows)))
    if tasks:
        rows = [['task', 'kernel samples/s', 'own samples/s', 'speed-up', 'kernel wall s',
                 'own wall s', 'same parameters']]
        for task in tasks:
            k, d = runs[task, 'kernel'], runs[task, 'default']
            rk, rd = statistics.median(x[0] for x in k), statistics.median(x[0] for x in d)
            dk, dd = {x[2] for x in k}, {x[2] for x in d}
            same = ('yes' if dk == dd and len(dk) == 1 else 'no' if len(dk) == len(dd) == 1
                    else 'varies within a side')
            rows.append([task, '%.0f' % rk, '%.0f' % rd, _ratio(rk, rd),
                         '%.2f' % statistics.median(x[1] for x in k),
                         '%.2f' % statistics.median(x[1] for x in d),
                         same])
        print('\n'.join(columns(rows)))
    print('load after: %.2f %.2f %.2f' % os.getloadavg())
    return 0


if __name__ == '__main__':
    sys.exit(main())
