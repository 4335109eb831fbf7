"""``python -m bench.build_time SCHEDULE``: seconds the command line's
steppers take to build (``loop.make_stepper``: ``--api executor``, which
binds through ``runtime.bind``, and ``--api module``), task ``lm`` on
``cpu:0,cpu:1`` in 4 micro-batches, each on a Pipeline and initial values
made before the clock starts. Printed on one line: ``executor <s> module <s>``.
Run it in two trees, alternated, to compare them (docs/pipelining.md).
"""
import sys
import time

import mxnet as mx

from mp_symbolic.training.config import TrainConfig
from mp_symbolic.training.loop import build_pipeline, initial_values, load, make_stepper


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    schedule = argv[0] if argv else 'gpipe'
    out = []
    for api in ('executor', 'module'):
        cfg = TrainConfig(task='lm', devices='cpu:0,cpu:1', chunks=4, schedule=schedule,
                          api=api)
        task, cfg = load(cfg)
        pipe, _ = build_pipeline(cfg, task)
        init = initial_values(pipe, cfg.seed)
        mx.nd.waitall()
        start = time.perf_counter()
        make_stepper(cfg, pipe, task, init, task.label_shape)
        mx.nd.waitall()
        out.append('%s %.4f' % (api, time.perf_counter() - start))
    print(' '.join(out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
