"""``python -m bench.dist``: a distributed-kvstore job of 1 and of 2 workers on
loopback, as a ratio, and the time from launch to the first training step.

Each job is started through ``python -m mp_symbolic launch --servers 1`` and
its workers train with the same global batch, split across them (see
:mod:`bench.dist_worker`); a job's samples/s is ``global batch x timed steps``
over the slowest worker's time. One worker without any kvstore, run directly,
is the reference for what ps-lite costs. Jobs repeat round-robin and the
median is printed.

On a machine with few cores the workers, the server and the scheduler share
them: the 2-worker/1-worker ratio then shows the launcher's and ps-lite's
overhead, not how training scales.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

from mp_symbolic.tools.text import columns

GLOBAL_BATCH = 1000
WORKER_COUNTS = (1, 2)
JOB_TIMEOUT = 300  # seconds; a job that takes longer is reported as failed


def worker_command(args):
    """The workers' COMMAND, after ``launch ... --``.

    To time ``python -m mp_symbolic train`` instead, return ``['train', ...]``
    here; it must print the two lines :mod:`bench.dist_worker` prints.
    """
    return [sys.executable, '-m', 'bench.dist_worker', '--global-batch', str(GLOBAL_BATCH),
            '--steps', str(args.steps), '--warmup', str(args.warmup)]


def build_parser():
    parser = argparse.ArgumentParser(
        prog='python -m bench.dist',
        description='Samples/s of a dist_sync job of 1 and 2 workers on loopback, and the '
                    'time from launch to the first training step.')
    parser.add_argument('--repeats', type=int, default=3,
                        help='jobs per worker count; the median is printed (default: %(default)s)')
    parser.add_argument('--steps', type=int, default=200,
                        help='timed steps per job (default: %(default)s)')
    parser.add_argument('--warmup', type=int, default=20,
                        help='untimed steps before them (default: %(default)s)')
    return parser


class JobFailed(RuntimeError):
    pass


def _parse(stdout, num_workers, launched_at):
    """``(samples/s, seconds from launch to the first step)`` of one job's output."""
    firsts = [float(t) for t in re.findall(r'^(?:\[worker \d+\] )?first step at (\S+)$',
                                           stdout, re.M)]
    timed = [(int(n), int(b), float(s)) for n, b, s in re.findall(
        r'^(?:\[worker \d+\] )?timed (\d+) steps of (\d+) samples in (\S+) s$', stdout, re.M)]
    if len(firsts) != num_workers or len(timed) != num_workers:
        raise JobFailed('expected the lines of %d worker(s), found %d and %d:\n%s'
                        % (num_workers, len(firsts), len(timed), stdout))
    samples = sum(steps * batch for steps, batch, _ in timed)
    return samples / max(seconds for _, _, seconds in timed), max(firsts) - launched_at


def run_job(argv, num_workers):
    """Runs ``argv``; returns ``(samples/s, seconds to first step, seconds in all)``."""
    env = dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0')
    launched_at = time.time()
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    wall = time.time() - launched_at
    if result.returncode != 0:
        raise JobFailed('%s exited %d:\n%s%s' % (' '.join(argv[:6]), result.returncode,
                                                 result.stdout, result.stderr))
    rate, first_step = _parse(result.stdout, num_workers, launched_at)
    return rate, first_step, wall


def run(args, log=print):
    """Runs every job ``args.repeats`` times and logs the table.

    Returns:
        ``{label: (median samples/s, median seconds to first step, median wall)}``.
    """
    command = worker_command(args)
    jobs = {'1 worker, no kvstore': (command + ['--kvstore', 'none'], 1)}
    for n in WORKER_COUNTS:
        jobs['%d worker%s, dist_sync' % (n, 's' if n > 1 else '')] = (
            [sys.executable, '-m', 'mp_symbolic', 'launch', '--workers', str(n),
             '--servers', '1', '--'] + command, n)
    log('machine: %d cores, load average at start %.2f %.2f %.2f'
        % ((os.cpu_count(),) + os.getloadavg()))
    log('global batch %d split across the workers, %d timed steps after %d warm-up; '
        'median of %d jobs each' % (GLOBAL_BATCH, args.steps, args.warmup, args.repeats))
    runs = {label: [] for label in jobs}
    for _ in range(args.repeats):  # round-robin: load changes touch every job alike
        for label, (argv, n) in jobs.items():
            runs[label].append(run_job(argv, n))
    medians = {label: tuple(statistics.median(r[i] for r in rs) for i in range(3))
               for label, rs in runs.items()}
    rows = [('job', 'samples/s', 'launch to first step', 'job wall time')]
    rows += [(label, '%.0f' % rate, '%.2f s' % first, '%.2f s' % wall)
             for label, (rate, first, wall) in medians.items()]
    for line in columns(rows):
        log('  ' + line)
    two, one = medians['2 workers, dist_sync'][0], medians['1 worker, dist_sync'][0]
    alone = medians['1 worker, no kvstore'][0]
    log('2 workers / 1 worker: %.2fx on %d cores (the processes share them: this is the '
        'launcher\'s and ps-lite\'s overhead, not scaling)' % (two / one, os.cpu_count()))
    log('1 worker through ps-lite / no kvstore: %.2fx' % (one / alone))
    log('load average at end %.2f %.2f %.2f' % os.getloadavg())
    return medians


def main(argv=None):
    args = build_parser().parse_args(argv)
    if min(args.repeats, args.steps, args.warmup) < 1:
        print('error: --repeats, --steps and --warmup: expected positive integers, found '
              '%d, %d and %d' % (args.repeats, args.steps, args.warmup), file=sys.stderr)
        return 2
    try:
        run(args)
    except (JobFailed, subprocess.TimeoutExpired) as err:
        print('error: a benchmark job failed: %s' % err, file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
