"""``python -m bench``: training throughput and time-to-accuracy, as ratios.

Every variant runs in this one process on the same data and from the same
initial parameters: the symbolic graph model-parallel (Module and executor
API), the symbolic graph on one device, the imperative Gluon twin
model-parallel, the Gluon network hybridized on one device, and the seed
question's own loop (:mod:`bench.seed_loop`). Throughput is the median of
``--repeats`` timed runs after a warm-up, at batch sizes 100 and 1000;
time-to-accuracy is the training time until the full-data MSE reaches
``TARGET_MSE``, checked once per epoch.
"""
import argparse
import os
import sys

from mp_symbolic.training.config import TrainConfig
from mp_symbolic.training.tasks import regression
from mp_symbolic.tools.text import columns
from mp_symbolic.training.loop import build_pipeline, initial_values, load

from .measure import machine_info, throughput, time_to_accuracy
from .variants import BASELINE, FLOOR, REFERENCE, SEED, THREE, VARIANTS, make_variant

BATCH_SIZES = (100, 1000)
TARGET_MSE = 1e-5  # 10x the noise floor (noise std 0.001 -> MSE 1e-6)
NUM_EXAMPLES = 10000
WARMUP = 20
TTA_BATCH_SIZE = 100
TTA_MAX_EPOCHS = 100
TTA_MAX_SECONDS = 60.0
TTA_MAX_REPEATS = 3  # the seed loop needs ~16 epochs per run
# The floor steps one fixed batch: it is a step-cost yardstick, not a training run.
TTA_VARIANTS = tuple(v for v in VARIANTS if v != FLOOR)


def build_parser():
    parser = argparse.ArgumentParser(
        prog='python -m bench',
        description='Training throughput and time-to-accuracy of every variant, as ratios.')
    parser.add_argument('--repeats', type=int, default=5,
                        help='timed runs per figure; the median is reported '
                             '(default: %(default)s)')
    parser.add_argument('--steps', type=int, default=200,
                        help='training steps per timed run (default: %(default)s)')
    parser.add_argument('--quick', action='store_true',
                        help='3 repeats of 50 steps and a 10 s time-to-accuracy cap: a smoke run')
    return parser


def run(repeats, num_steps, tta_max_seconds, log=print):
    """Measures everything and logs the tables.

    Returns:
        ``{'throughput': {batch_size: {variant: samples/s}}, 'tta': {variant:
        (seconds, reached, epochs, mse)}}``.
    """
    info = machine_info()
    log('machine: %d cores, %s; MXNet %s, Python %s; load average at start %s'
        % (info['cores'], info['cpu'], info['mxnet'], info['python'], info['load']))
    log('devices: cpu(0), cpu(1), cpu(2) stand in for three GPUs')
    X, y = regression.make_dataset(NUM_EXAMPLES, seed=0)
    pipe, _ = build_pipeline(*reversed(load(TrainConfig(devices=THREE))))
    init = initial_values(pipe, seed=0)[0]

    rates = _throughput(X, y, init, repeats, num_steps, log)
    tta = _time_to_accuracy(X, y, init, repeats, tta_max_seconds, log)
    log('load average at end %.2f %.2f %.2f' % os.getloadavg())
    return {'throughput': rates, 'tta': tta}


def _throughput(X, y, init, repeats, num_steps, log):
    """Logs the throughput table; returns ``{batch_size: {variant: samples/s}}``."""
    rates, spread = {}, {}
    for batch_size in BATCH_SIZES:
        variants = {name: make_variant(name, X, y, batch_size, init) for name in VARIANTS}
        measured = throughput(variants, batch_size, num_steps, repeats, WARMUP)
        rates[batch_size] = {name: median for name, (median, _) in measured.items()}
        # (max - min) / median of the repeats: how much the machine's load moved the figure
        spread[batch_size] = {name: (max(r) - min(r)) / median
                              for name, (median, r) in measured.items()}
    log('')
    log('throughput: samples/s, median of %d runs of %d steps after %d warm-up steps '
        '(spread: (max-min)/median); ratio vs %s' % (repeats, num_steps, WARMUP, BASELINE))
    head = ['variant'] + sum((['bs=%d' % b, 'spread', 'ratio'] for b in BATCH_SIZES), [])
    body = [[name] + sum((['%.0f' % rates[b][name], '%.0f%%' % (100 * spread[b][name]),
                           '%.2fx' % (rates[b][name] / rates[b][BASELINE])]
                          for b in BATCH_SIZES), [])
            for name in VARIANTS]
    for line in columns([head] + body):
        log('  ' + line)
    for b in BATCH_SIZES:
        log('  bs=%d: %s is %.2fx %s and %.2fx imperative MP'
            % (b, REFERENCE, rates[b][REFERENCE] / rates[b][BASELINE], BASELINE,
               rates[b][REFERENCE] / rates[b]['imperative MP']))
    for b in BATCH_SIZES:
        log('  bs=%d: step time of %s / %s (staged batches): %.2fx'
            % (b, REFERENCE, FLOOR, rates[b][FLOOR] / rates[b][REFERENCE]))
    return rates


def _time_to_accuracy(X, y, init, repeats, cap, log):
    """Logs the time-to-accuracy table; returns ``{variant: (seconds, reached, epochs, mse)}``."""
    steps_per_epoch = NUM_EXAMPLES // TTA_BATCH_SIZE
    tta_repeats = min(repeats, TTA_MAX_REPEATS)
    runs = {name: [] for name in TTA_VARIANTS}
    for _ in range(tta_repeats):  # round-robin, from a fresh start each time
        for name in TTA_VARIANTS:
            variant = make_variant(name, X, y, TTA_BATCH_SIZE, init)
            runs[name].append(time_to_accuracy(variant, X, y, steps_per_epoch, TARGET_MSE,
                                               TTA_MAX_EPOCHS, cap))
    tta = {name: _median_run(r) for name, r in runs.items()}
    log('')
    log('time to full-data MSE <= %g: median of %d runs, bs=%d, MSE checked each epoch off the '
        'clock, cap %d epochs or %.0f s; project variants: SGD lr 0.02, seed loop: Adam lr 0.001'
        % (TARGET_MSE, tta_repeats, TTA_BATCH_SIZE, TTA_MAX_EPOCHS, cap))
    body = []
    for name in TTA_VARIANTS:
        seconds, reached, epochs, mse = tta[name]
        body.append([name, '%.2f' % seconds if reached else '>%.2f (cap)' % seconds, epochs,
                     '%.2e' % mse, _ratio(tta[name], tta[BASELINE]),
                     _ratio(tta[name], tta[SEED])])
    for line in columns([['variant', 'seconds', 'epochs', 'MSE', 'vs 1-device', 'vs seed']]
                        + body):
        log('  ' + line)
    return tta


def _median_run(runs):
    """The run with the median time; a run that hit a cap counts as slowest."""
    ordered = sorted(runs, key=lambda r: (not r[1], r[0]))
    return ordered[(len(ordered) - 1) // 2]


def _ratio(run, reference):
    """``run``'s time over ``reference``'s; a bound when a cap stopped either."""
    (seconds, reached), (ref_seconds, ref_reached) = run[:2], reference[:2]
    if reached and ref_reached:
        return '%.3fx' % (seconds / ref_seconds)
    if reached:  # the reference needs more than ref_seconds
        return '<%.3fx' % (seconds / ref_seconds)
    if ref_reached:
        return '>%.3fx' % (seconds / ref_seconds)
    return '-'


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 3, 50
    if args.repeats < 1 or args.steps < 1:
        print('error: --repeats and --steps: expected positive integers, found %d and %d'
              % (args.repeats, args.steps), file=sys.stderr)
        return 2
    run(args.repeats, args.steps, 10.0 if args.quick else TTA_MAX_SECONDS)
    return 0


if __name__ == '__main__':
    sys.exit(main())
