"""``python -m bench.bn_chunks``: the digits CNN (BatchNorm included) with
``--chunks 4`` against ``--chunks 1``, as the command line trains them.

Each variant is ``python -m mp_symbolic train --task digits`` in a process of
its own (oneDNN is switched on or off once per process), run in alternating
rounds so that a busy machine slows every variant alike; the figure is the
training loop's own wall time (the ``training: X s wall`` line: after
``waitall()``, no checkpoints, no start-up). Per round, each variant's time
is divided by ``--chunks 1``'s; the median of those ratios is reported. The
last variant is what every ``--chunks`` run did before: oneDNN off
(``MXNET_MKLDNN_ENABLED=0``). Also counts the ``Storage type fallback``
blocks each variant wrote to stderr.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from mp_symbolic.text import columns

__all__ = ['VARIANTS', 'run_variant', 'measure', 'main']

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
    match = _WALL.search(proc.stdout)
    if proc.returncode != 0 or not match:
        lines = proc.stderr.strip().splitlines() or ['(no stderr)']
        raise RuntimeError('%s: expected exit status 0 and a training line, found %d: %s'
                           % (' '.join(cmd[2:]), proc.returncode, lines[-1]))
    return float(match.group(1)), proc.stderr.count('Storage type fallback detected')


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
                '%s %.2f s' % (n, seconds[n]) for n in VARIANTS)))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.bn_chunks', description=__doc__
                                     .split('\n\n')[0])
    parser.add_argument('--rounds', type=int, default=5,
                        help='alternating rounds; the median is reported (default: %(default)s)')
    parser.add_argument('--epochs', type=int, default=10,
                        help='epochs per run (default: %(default)s, as make train-digits)')
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.epochs < 1:
        parser.error('expected --rounds and --epochs of at least 1, found %d and %d'
                     % (args.rounds, args.epochs))
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
