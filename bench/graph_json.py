"""JSON reads and writes of the typed graph per Module build and per export
(python -m bench.graph_json).

Counts, while one Pipeline's Module is built and bound under each schedule,
and while its checkpoint is exported (``export.export_checkpoint``: the
inference pair, ONNX and their verification, which reads the files back):
``PlacedGraph.from_json`` (MXNet's JSON read into the typed graph),
``PlacedGraph.to_json`` (the typed graph written back as JSON),
``Symbol.tojson`` and ``mx.sym.load_json`` (every JSON MXNet makes or reads,
the typed graph's included).
"""
from collections import Counter
from contextlib import contextmanager

import mxnet as mx
from mxnet.gluon import nn
import numpy as np

from mp_symbolic import Pipeline
from mp_symbolic.core.graph import ir

__all__ = ['counting', 'build_counts', 'export_counts']


@contextmanager
def counting():
    """A Counter of the four calls above, counted while the block runs."""
    counts = Counter()
    originals = (ir.PlacedGraph.from_json, ir.PlacedGraph.to_json, mx.sym.Symbol.tojson,
                 mx.sym.load_json)
    from_json, to_json, tojson, load_json = originals

    def counted_from_json(cls, *args, **kwargs):
        counts['from_json'] += 1
        return from_json.__func__(cls, *args, **kwargs)

    def counted_to_json(self):
        counts['to_json'] += 1
        return to_json(self)

    def counted_tojson(self, *args, **kwargs):
        counts['Symbol.tojson'] += 1
        return tojson(self, *args, **kwargs)

    def counted_load_json(text):
        counts['load_json'] += 1
        return load_json(text)

    ir.PlacedGraph.from_json = classmethod(counted_from_json)
    ir.PlacedGraph.to_json = counted_to_json
    mx.sym.Symbol.tojson = counted_tojson
    mx.sym.load_json = counted_load_json
    try:
        yield counts
    finally:
        (ir.PlacedGraph.from_json, ir.PlacedGraph.to_json, mx.sym.Symbol.tojson,
         mx.sym.load_json) = originals
        ir.PlacedGraph.from_json = originals[0]


def _mlp():
    blocks = [nn.Dense(8, activation='relu', in_units=8) for _ in range(3)]
    for block in blocks:
        block.initialize()
    return blocks


class _Whole(nn.HybridBlock):  # pylint: disable=abstract-method
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.a = nn.Dense(8, activation='relu', in_units=8)
            self.b = nn.Dense(8, activation='relu', in_units=8)
            self.c = nn.Dense(4, in_units=8)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.c(self.b(self.a(x)))


def build_counts(schedule, whole=False, chunks=2):
    """``(counts of the build, counts of the bind)`` of one Module of a
    3-stage network (a block list, or one whole network cut by its graph)."""
    if whole:
        net = _Whole()
        net.initialize()
        pipe = Pipeline(net, 'cpu:0,cpu:1,cpu:2', sample=(4, 8), chunks=chunks,
                        schedule=schedule)
    else:
        pipe = Pipeline(_mlp(), 'cpu:0,cpu:1,cpu:2', chunks=chunks, schedule=schedule)
    with counting() as built:
        mod = pipe.module(loss='softmax')
    with counting() as bound:
        mod.bind([('data', (4, 8))], [('softmax_label', (4,))])
    return built, bound


def export_counts(folder):
    """The counts of exporting a 3-stage block list's checkpoint, written
    under ``folder``."""
    # pylint: disable=import-outside-toplevel
    import os
    from export.exporter import export_checkpoint
    from mp_symbolic.tools.checkpoint import save_checkpoint
    mod = Pipeline(_mlp(), 'cpu:0,cpu:1,cpu:2').module(loss='softmax')
    mod.bind([('data', (4, 8))], [('softmax_label', (4,))])
    mod.init_params(mx.init.Xavier())
    save_checkpoint(mod, os.path.join(folder, 'run'), 1)
    with counting() as exported:
        export_checkpoint(os.path.join(folder, 'run'), os.path.join(folder, 'out'),
                          log=lambda *_: None)
    return exported


def main():
    keys = ('from_json', 'to_json', 'Symbol.tojson', 'load_json')
    print('%-28s %s' % ('Module of 3 stages, 2 chunks', '  '.join('%13s' % k for k in keys)))
    for whole in (False, True):
        for schedule in ('gpipe', '1f1b'):
            built, bound = build_counts(schedule, whole)
            form = 'whole network' if whole else 'block list'
            for what, counts in (('build', built), ('bind', bound)):
                print('%-28s %s' % ('%s %s %s' % (form, schedule, what),
                                    '  '.join('%13d' % counts[k] for k in keys)))
    import tempfile  # pylint: disable=import-outside-toplevel
    with tempfile.TemporaryDirectory() as folder:
        counts = export_counts(folder)
    print('%-28s %s' % ('its checkpoint exported', '  '.join('%13d' % counts[k] for k in keys)))


if __name__ == '__main__':
    np.random.seed(0)
    main()
