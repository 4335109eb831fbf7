"""Inference throughput of the exported model: onnxruntime vs MXNet, one process.

    python bench/export_throughput.py [--model-dir artifacts/export/current] [--repeats 7]
    make bench-export        # exports first, then runs this

Runs ``<name>.onnx`` in onnxruntime and the ``<name>-symbol.json`` pair in
MXNet (bound with ``group2ctx``: one device per stage, and all stages on
``cpu:0``) at each batch size. Each timing is a whole ``predict`` call, numpy
in and numpy out; every runtime is warmed up first, ``mx.nd.waitall()`` runs
before each clock read, and the figure is the median over ``--repeats``
repeats of enough calls to last about ``--repeat-seconds``.
"""
import argparse
import os
import statistics
import sys

import mxnet as mx
import numpy as np
import onnxruntime as ort

from export.errors import one_line
from mp_symbolic.core.base import timing
from export.runtimes import MXNetPredictor, OnnxPredictor


def _time_calls(predict, X, calls):
    def run():
        for _ in range(calls):
            predict(X)
    return timing.seconds(run)


def measure(predict, X, repeats, repeat_seconds):
    """Median seconds per call of ``predict(X)``."""
    for _ in range(3):  # warm-up: binding, allocation, first-call setup
        predict(X)
    once = _time_calls(predict, X, 5) / 5
    calls = max(1, int(repeat_seconds / max(once, 1e-7)))
    return statistics.median(_time_calls(predict, X, calls) / calls for _ in range(repeats))


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0 or value == float('inf'):
            raise argparse.ArgumentTypeError('expected a positive number, found %r' % text)
        return value
    return parse


def _batch_sizes(text):
    try:
        sizes = [int(b) for b in text.split(',')]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            'expected comma-separated positive integers such as 1,4096, found %r' % text)
    return sizes


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python bench/export_throughput.py',
                                     description=__doc__.split('\n')[0])
    parser.add_argument('--model-dir', default=os.path.join('artifacts', 'export', 'current'),
                        help='folder of the exported files (default: %(default)s)')
    parser.add_argument('--name', default='regression',
                        help='file name prefix of the exported files (default: %(default)s)')
    parser.add_argument('--batch-sizes', type=_batch_sizes, default=[1, 4096],
                        help='batch sizes to time (default: 1,4096)')
    parser.add_argument('--repeats', type=_positive(int), default=7,
                        help='timed repeats per figure; the median is reported (default: 7)')
    parser.add_argument('--repeat-seconds', type=_positive(float), default=0.2,
                        help='about how long each repeat runs (default: 0.2)')
    args = parser.parse_args(argv)
    prefix = os.path.join(args.model_dir, args.name)
    try:
        onnx_runtime = OnnxPredictor(prefix + '.onnx')
        split = MXNetPredictor.from_files(prefix + '-symbol.json')
        one = MXNetPredictor.from_files(prefix + '-symbol.json', devices='cpu:0')
    except ValueError as err:  # missing or unusable files: say which, in one line
        print('error: %s (run make export first)' % one_line(err), file=sys.stderr)
        return 2
    # one device per stage of the exported model: its model-parallel split
    runtimes = [('onnxruntime %s' % ort.__version__, onnx_runtime),
                ('mxnet %s, %d devices' % (mx.__version__, len(split.stages)), split),
                ('mxnet %s, 1 device' % mx.__version__, one)]
    print('| runtime | batch | calls/s | samples/s | us per call | vs onnxruntime |')
    print('|---|---:|---:|---:|---:|---:|')
    for batch_size in args.batch_sizes:
        X = np.random.default_rng(0).normal(0, 1, (batch_size, 2)).astype(np.float32)
        seconds = [(label, measure(runtime.predict, X, args.repeats, args.repeat_seconds))
                   for label, runtime in runtimes]
        for label, per_call in seconds:
            # throughput ratio: above 1 is faster than onnxruntime
            print('| %s | %d | %.0f | %.3g | %.1f | %.2fx |'
                  % (label, batch_size, 1 / per_call, batch_size / per_call, per_call * 1e6,
                     seconds[0][1] / per_call))
        sys.stdout.flush()
    return 0


if __name__ == '__main__':
    sys.exit(main())
