"""``python -m bench.buckets``: batches of variable length, as GluonNLP
batches sentences (``gluonnlp.data.FixedBucketSampler``), trained by
``fit`` on a Pipeline's Module and on MXNet's own ``BucketingModule`` on
one device; the parameters after the run compared.

The corpus is random sentences of random lengths (tokens of a small
vocabulary); the sampler groups them into buckets by length, each batch
padded to its bucket's key (its longest length) and carrying it as its
``bucket_key``, with ``provide_data`` and ``provide_label`` at its shapes,
as MXNet's bucketing iterators give them. The network is an LSTM language
model (embedding, LSTM, a dense layer over the vocabulary at each step)
as a list of three blocks, batch first, its loss a softmax over the
vocabulary at every step. Every configuration starts from the same
values, drawn once, and trains with SGD over the same batches in the
same order; the reference is ``mx.mod.BucketingModule`` on ``cpu(0)``
whose ``sym_gen`` gives the Module's graph without micro-batches
(:attr:`~mp_symbolic.core.module.PipelineModule.export_symbol`).

Printed: one row per configuration, the largest ``|difference|`` of any
parameter from the reference's, the largest change of a parameter from
its initial value (that the run trained), the buckets bound and the
seconds (the configuration's run; the reference's first run is in the
first row's).
"""
import argparse
import sys
import time

import mxnet as mx
import numpy as np

from mp_symbolic import Pipeline
from mp_symbolic.tools.text import columns

VOCAB, EMBED, HIDDEN = 32, 16, 16
BATCH = 8  # sentences per batch
LENGTHS = (4, 40)  # the shortest and longest sentence, in tokens
NUM_BUCKETS = 5
LEARNING_RATE = 0.1

# name -> Pipeline arguments
CONFIGS = {
    '1f1b chunks 2': dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2),
    '1f1b chunks 2 replicas 2': dict(devices='cpu:0,cpu:1,cpu:2,cpu:3', schedule='1f1b',
                                     chunks=2, replicas=2),
    'gpipe chunks 2': dict(devices='cpu:0,cpu:1', schedule='gpipe', chunks=2),
    'interleaved chunks 2': dict(devices='cpu:0,cpu:1', schedule='interleaved', chunks=2,
                                 virtual=2),
}


def blocks(layers=3):
    """The LSTM language model as blocks: embedding, LSTM (batch first),
    dense over the vocabulary at each step (``layers`` 4: two LSTMs, for
    four stages)."""
    net = [mx.gluon.nn.Embedding(VOCAB, EMBED), mx.gluon.rnn.LSTM(HIDDEN, layout='NTC')]
    if layers == 4:
        net.append(mx.gluon.rnn.LSTM(HIDDEN, layout='NTC', input_size=HIDDEN))
    return net + [mx.gluon.nn.Dense(VOCAB, flatten=False, in_units=HIDDEN)]


class BucketIter(mx.io.DataIter):
    """Batches of ``FixedBucketSampler``: each padded to its bucket's key,
    the labels the next tokens, ``bucket_key`` the key, ``provide_data``
    and ``provide_label`` its shapes; the default bucket the longest.

    Args:
        sentences: Token arrays (int), one per sentence.
        batches: How many batches (the sampler's, in its order, its full
            batches only, repeated as needed).
        seed: The sampler's shuffle (numpy's global state, as GluonNLP draws).
    """

    def __init__(self, sentences, batches, seed=0):
        # pylint: disable=import-outside-toplevel
        from gluonnlp.data import FixedBucketSampler
        super().__init__(BATCH)
        np.random.seed(seed)
        sampler = FixedBucketSampler([len(s) - 1 for s in sentences], BATCH,
                                     num_buckets=NUM_BUCKETS, shuffle=True)
        keys = sampler._bucket_keys  # pylint: disable=protected-access
        order = []
        while len(order) < batches:
            for indices in sampler:
                if len(indices) == BATCH:
                    order.append(indices)
        self._batches = []
        for indices in order[:batches]:
            longest = max(len(sentences[i]) - 1 for i in indices)
            key = min(k for k in keys if k >= longest)
            data = np.zeros((BATCH, key), np.float32)
            label = np.zeros((BATCH, key), np.float32)
            for row, i in enumerate(indices):
                tokens = sentences[i]
                data[row, :len(tokens) - 1] = tokens[:-1]
                label[row, :len(tokens) - 1] = tokens[1:]
            self._batches.append((key, data, label))
        self.default_bucket_key = max(keys)
        self.real_tokens = sum(len(sentences[i]) - 1 for b in order[:batches] for i in b)
        self._at = 0

    @property
    def keys(self):
        """The bucket key of each batch, in order."""
        return [key for key, _, _ in self._batches]

    @property
    def provide_data(self):
        return [mx.io.DataDesc('data', (BATCH, self.default_bucket_key))]

    @property
    def provide_label(self):
        return [mx.io.DataDesc('softmax_label', (BATCH, self.default_bucket_key))]

    def reset(self):
        self._at = 0

    def next(self):
        if self._at == len(self._batches):
            raise StopIteration
        key, data, label = self._batches[self._at]
        self._at += 1
        return mx.io.DataBatch([mx.nd.array(data)], [mx.nd.array(label)], bucket_key=key,
                               provide_data=[mx.io.DataDesc('data', data.shape)],
                               provide_label=[mx.io.DataDesc('softmax_label', label.shape)])


def sentences(count, seed=0):
    """``count`` random sentences, each of a length drawn within :data:`LENGTHS`."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, int(rng.integers(LENGTHS[0], LENGTHS[1] + 1)))
            for _ in range(count)]


def initial_values(symbol, seed=0):
    """``[(parameter, numpy array)]``: every parameter of ``symbol`` in its
    graph's order (the architecture's, whatever Gluon's names), each drawn
    from a normal of deviation 0.1 in that order: the one start of every run."""
    shapes, _, _ = symbol.infer_shape(data=(BATCH, LENGTHS[1]))
    rng = np.random.default_rng(seed)
    return [(n, (rng.normal(size=s) * 0.1).astype(np.float32))
            for n, s in zip(symbol.list_arguments(), shapes)
            if n not in ('data', 'softmax_label')]


def cross_entropy(label, pred):
    """The mean negative log-probability of the labels (``(N, T)``) under
    ``pred`` (``(N, T, V)``)."""
    picked = np.take_along_axis(pred, label.astype(np.int64)[..., None], axis=-1)
    return float(-np.log(np.maximum(picked, 1e-12)).mean())


def fit(mod, data, initial):
    """``mod.fit`` over one pass of ``data`` with SGD from ``initial``."""
    data.reset()
    mod.fit(data, num_epoch=1, optimizer='sgd',
            optimizer_params={'learning_rate': LEARNING_RATE},
            arg_params={n: mx.nd.array(v) for n, v in initial}, aux_params={},
            eval_metric=mx.metric.CustomMetric(cross_entropy, 'cross-entropy'))
    arg_params, _ = mod.get_params()
    return [arg_params[n].asnumpy() for n, _ in initial]


def pipeline_module(config, layers=3, **kwargs):
    """The Pipeline's Module of ``config`` (:data:`CONFIGS`) over the LSTM model."""
    pipe = Pipeline(blocks(layers), sample=(BATCH, LENGTHS[1]), **config)
    return pipe.module(loss='softmax', **kwargs)


def reference(symbol, data, initial):
    """The parameters one device's ``BucketingModule`` ends with."""
    def sym_gen(key):  # pylint: disable=unused-argument
        return symbol, ('data',), ('softmax_label',)
    mod = mx.mod.BucketingModule(sym_gen, default_bucket_key=data.default_bucket_key,
                                 context=mx.cpu(0))
    return fit(mod, data, initial)


def compare(names, batches, seed=0):
    """``([(name, largest |difference| from the reference, largest change
    of a parameter from its initial value, buckets bound, seconds)], the
    iterator)`` for each configuration of ``names`` over ``batches``
    batches."""
    data = BucketIter(sentences(max(4 * batches, 64), seed), batches, seed)
    rows, refs = [], {}
    for name in names:
        config = dict(CONFIGS[name])
        layers = 4 if 'interleaved' in name else 3
        start = time.perf_counter()
        mod = pipeline_module(config, layers=layers)
        initial = initial_values(mod.export_symbol, seed)
        if layers not in refs:
            refs[layers] = reference(mod.export_symbol, data, initial)
        params = fit(mod, data, initial)
        seconds = time.perf_counter() - start
        worst = max(float(np.abs(p - r).max()) for p, r in zip(params, refs[layers]))
        change = max(float(np.abs(p - v).max()) for p, (_, v) in zip(params, initial))
        rows.append((name, worst, change, len(mod._buckets.bound), seconds))  # pylint: disable=protected-access
    return rows, data


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.buckets', description=__doc__.split(
        '\n\n', maxsplit=1)[0])
    parser.add_argument('--batches', type=int, default=200)
    parser.add_argument('--only', default=','.join(CONFIGS),
                        help='configurations, comma-separated (%s)' % ', '.join(CONFIGS))
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(',') if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit('error: --only: expected names among %s, found %s'
                 % (', '.join(CONFIGS), ', '.join(unknown)))
    rows, data = compare(names, args.batches)
    print('%d batches of %d sentences from FixedBucketSampler (%d buckets, lengths %d to %d), '
          'SGD lr %g; largest |difference| of any parameter from one device\'s '
          'BucketingModule' % (args.batches, BATCH, NUM_BUCKETS, LENGTHS[0], LENGTHS[1],
                               LEARNING_RATE))
    print('bucket keys seen: %s' % ', '.join('%d x%d' % (k, data.keys.count(k))
                                             for k in sorted(set(data.keys))))
    for line in columns([('configuration', 'max |difference|', 'largest change', 'buckets bound',
                          'seconds')] +
                        [(n, '%.1e' % d, '%.2f' % c, str(b), '%.1f' % s)
                         for n, d, c, b, s in rows]):
        print(line)


if __name__ == '__main__':
    main()
