"""Inference throughput of the exported model: onnxruntime vs MXNet, one process.

    python bench/export_throughput.py [--model-dir artifacts/export] [--repeats 7]
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
import time

import mxnet as mx
import numpy as np
import onnxruntime as ort

from export.runtimes import MXNetPredictor, OnnxPredictor


def _time_calls(predict, X, calls):
    mx.nd.waitall()
    start = time.perf_counter()
    for _ in range(calls):
        predict(X)
    mx.nd.waitall()
    return time.perf_counter() - start


def measure(predict, X, repeats, repeat_seconds):
    """Median seconds per call of ``predict(X)``."""
    for _ in range(3):  # warm-up: binding, allocation, first-call setup
        predict(X)
    once = _time_calls(predict, X, 5) / 5
    calls = max(1, int(repeat_seconds / max(once, 1e-7)))
    return statistics.median(_time_calls(predict, X, calls) / calls for _ in range(repeats))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model-dir', default=os.path.join('artifacts', 'export'))
    parser.add_argument('--name', default='regression')
    parser.add_argument('--batch-sizes', default='1,4096')
    parser.add_argument('--repeats', type=int, default=7)
    parser.add_argument('--repeat-seconds', type=float, default=0.2)
    args = parser.parse_args(argv)
    prefix = os.path.join(args.model_dir, args.name)
    runtimes = [('onnxruntime %s' % ort.__version__, OnnxPredictor(prefix + '.onnx')),
                ('mxnet %s, 3 devices' % mx.__version__,
                 MXNetPredictor.from_files(prefix + '-symbol.json', devices='cpu:0,cpu:1,cpu:2')),
                ('mxnet %s, 1 device' % mx.__version__,
                 MXNetPredictor.from_files(prefix + '-symbol.json', devices='cpu:0'))]
    print('| runtime | batch | calls/s | samples/s | us per call | vs onnxruntime |')
    print('|---|---:|---:|---:|---:|---:|')
    for batch_size in [int(b) for b in args.batch_sizes.split(',')]:
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
