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
(:attr:`~mp_symbolic.core.engine.module.PipelineModule.export_symbol`).

Printed: one row per configuration, the largest ``|difference|`` of any
parameter from the reference's, the largest change of a parameter from
its initial value (that the run trained), the buckets bound and the
seconds (the configuration's run; the reference's first run is in the
first row's).

``--nodes``: the same run over 2 node processes under 1F1B, and a job
whose node 1 draws its batches with another seed (each node's line, exit
status and time). ``--memory``: the storage per device with 1 to 5
buckets bound, on the Pipeline's Module and on one device's
``BucketingModule``, each in a fresh process. ``--speed``: tokens per
second against every batch padded to the longest, side by side, and one
step's seconds per key.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import mxnet as mx
import numpy as np

from mp_symbolic import Pipeline
from mp_symbolic.core.base.timing import repeat
from mp_symbolic.tools.text import columns

VOCAB, EMBED, HIDDEN = 32, 16, 16
BATCH = 8  # sentences per batch
LENGTHS = (4, 40)  # the shortest and longest sentence, in tokens
NUM_BUCKETS = 5
LEARNING_RATE = 0.1
SPEED_WIDTH = 256  # the embedding and LSTM width of the tokens-per-second runs
SPEED_RATE = 0.01  # their learning rate (SGD)

# name -> Pipeline arguments
CONFIGS = {
    '1f1b chunks 2': dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2),
    '1f1b chunks 2 replicas 2': dict(devices='cpu:0,cpu:1,cpu:2,cpu:3', schedule='1f1b',
                                     chunks=2, replicas=2),
    'gpipe chunks 2': dict(devices='cpu:0,cpu:1', schedule='gpipe', chunks=2),
    'interleaved chunks 2': dict(devices='cpu:0,cpu:1', schedule='interleaved', chunks=2,
                                 virtual=2),
}


def blocks(layers=3, width=None):
    """The LSTM language model as blocks: embedding, LSTM (batch first),
    dense over the vocabulary at each step (``layers`` 4: two LSTMs, for
    four stages); ``width``: the embedding and LSTM width (default
    :data:`EMBED`, :data:`HIDDEN`)."""
    embed, hidden = (EMBED, HIDDEN) if width is None else (width, width)
    net = [mx.gluon.nn.Embedding(VOCAB, embed), mx.gluon.rnn.LSTM(hidden, layout='NTC')]
    if layers == 4:
        net.append(mx.gluon.rnn.LSTM(hidden, layout='NTC', input_size=hidden))
    return net + [mx.gluon.nn.Dense(VOCAB, flatten=False, in_units=hidden)]


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


def pipeline_module(config, layers=3, width=None, **kwargs):
    """The Pipeline's Module of ``config`` (:data:`CONFIGS`) over the LSTM
    model (:func:`blocks`)."""
    pipe = Pipeline(blocks(layers, width), sample=(BATCH, LENGTHS[1]), **config)
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
        bound = len(mod._buckets.bound)  # pylint: disable=protected-access
        rows.append((name, worst, change, bound, seconds))
    return rows, data


def node_run(nodes, batches, seeds=(0,), **config):
    """One node process's run of :func:`compare`'s ``fit`` over
    ``Pipeline(..., nodes=nodes)``: ``{p<i>: array}``, the parameters this
    node holds after it, by their place in the graph's argument order
    (:func:`initial_values`), and ``bound``, the buckets it bound.
    ``seeds``: the sampler's seed of each node
    (the last one's for the nodes past them)."""
    mod = pipeline_module(dict(config, nodes=nodes))
    initial = initial_values(mod.export_symbol)
    rank = int(os.environ.get('RANK', '0'))
    data = BucketIter(sentences(max(4 * batches, 64)), batches, seeds[min(rank, len(seeds) - 1)])
    mod.fit(data, num_epoch=1, optimizer='sgd',
            optimizer_params={'learning_rate': LEARNING_RATE},
            arg_params={n: mx.nd.array(v) for n, v in initial}, aux_params={},
            eval_metric=mx.metric.CustomMetric(cross_entropy, 'cross-entropy'))
    arg_params, _ = mod.get_params()
    held = {'p%d' % i: arg_params[n].asnumpy() for i, (n, _) in enumerate(initial)
            if n in arg_params}
    held['bound'] = np.array(len(mod._buckets.bound))  # pylint: disable=protected-access
    return held


def worker_main(argv=None):
    """A node process: ``--out F --nodes N --table JSON`` (a list of
    :func:`node_run`'s keyword arguments); writes ``F<k>_<rank>.npz`` for
    the ``k``-th. A refusal of the nodes (``NodeError``, ``NodeFailure``)
    ends it as the command line ends it: one line on stderr, exit status 2
    (1 for a failure)."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.transport.nodes import NodeError, NodeFailure
    from mp_symbolic.tools.interrupts import end_process
    parser = argparse.ArgumentParser()
    parser.add_argument('--out', required=True)
    parser.add_argument('--nodes', type=int, default=1)
    parser.add_argument('--table', required=True)
    args = parser.parse_args(argv)
    for k, config in enumerate(json.loads(args.table)):
        try:
            held = node_run(args.nodes, **config)
        except (NodeError, NodeFailure) as err:
            sys.stderr.write('error: %s\n' % err)
            sys.stderr.flush()
            end_process(2 if isinstance(err, NodeError) else 1)
        np.savez('%s%d_%s.npz' % (args.out, k, os.environ.get('RANK', '0')), **held)
    end_process(0)  # without seconds of Python's final collection


def run_nodes(config, out, count=2, timeout=900):
    """``count`` node processes of :func:`worker_main` over ``[config]`` on
    127.0.0.1; returns ``[(exit status, seconds from the start to its exit,
    (seconds, its error line) or None)]`` per node."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    start = time.perf_counter()
    procs = [subprocess.Popen(
        [sys.executable, '-m', 'bench.buckets', '--worker', '--out', out, '--nodes', str(count),
         '--table', json.dumps([config])], cwd=root, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=root, MXNET_SUBGRAPH_VERBOSE='0',
                 MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank),
                 WORLD_SIZE=str(count))) for rank in range(count)]
    lines = [None] * count

    def read(rank):
        for line in procs[rank].stderr:
            if line.startswith('error: ') and lines[rank] is None:
                lines[rank] = (time.perf_counter() - start, line.strip())
    readers = [threading.Thread(target=read, args=(r,)) for r in range(count)]
    for reader in readers:
        reader.start()
    ended = []
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
            ended.append(time.perf_counter() - start)
    finally:
        for proc in procs:
            proc.kill()
        for reader in readers:
            reader.join()
    return [(p.returncode, e, l) for p, e, l in zip(procs, ended, lines)]


def nodes_rows(batches, folder):
    """Two node processes under 1F1B with 2 micro-batches against one
    device's ``BucketingModule`` (the largest ``|difference|``, the largest
    change, the buckets each node bound, the seconds of the job), and a job whose node 1 draws its
    batches with another seed: each node's line, exit status and seconds,
    and whether a process is left."""
    config = dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2)
    out = os.path.join(folder, 'node')
    start = time.perf_counter()
    statuses = run_nodes(dict(config, batches=batches), out)
    seconds = time.perf_counter() - start
    if any(s for s, _, _ in statuses):
        sys.exit('error: the nodes ended with %s' % ', '.join(
            '%d (%s)' % (s, l[1] if l else 'no line') for s, _, l in statuses))
    held, bound = {}, []
    for rank in range(2):
        with np.load('%s0_%d.npz' % (out, rank)) as data:
            held.update({n: v for n, v in data.items() if n != 'bound'})
            bound.append(int(data['bound']))
    mod = pipeline_module(config)
    initial = initial_values(mod.export_symbol)
    ref = reference(mod.export_symbol, BucketIter(sentences(max(4 * batches, 64)), batches),
                    initial)
    worst = max(float(np.abs(held['p%d' % i] - r).max()) for i, r in enumerate(ref))
    change = max(float(np.abs(held['p%d' % i] - v).max()) for i, (_, v) in enumerate(initial))
    mismatch = run_nodes(dict(config, batches=batches, seeds=[0, 1]), out + '-mismatch')
    return (worst, change, bound, seconds), mismatch


def padded_batches(data):
    """``data``'s batches, each padded to the longest key (the default
    bucket), without a ``bucket_key``: what training without buckets runs."""
    longest = data.default_bucket_key
    batches = []
    data.reset()
    for batch in list(data):
        rows, key = batch.data[0].shape
        data_padded = mx.nd.zeros((rows, longest))
        label_padded = mx.nd.zeros((rows, longest))
        data_padded[:, :key] = batch.data[0]
        label_padded[:, :key] = batch.label[0]
        batches.append(mx.io.DataBatch([data_padded], [label_padded]))
    data.reset()
    return batches


def speed(batches, repeats=3, name='1f1b chunks 2', width=SPEED_WIDTH):
    """Tokens per second of ``name``'s configuration over ``batches``
    batches: each batch at its bucket's length, and every batch padded to
    the longest, side by side (the model at ``width``, each a Module of
    its own, every pass from the same values, SGD at :data:`SPEED_RATE`,
    a pass over the batches of each in turn, after one untimed
    pass of each: :func:`mp_symbolic.core.base.timing.repeat`).

    Returns:
        ``({'buckets' | 'padded': [seconds of each pass]}, tokens of the
        sentences (padding left out), tokens each run computes)``.
    """
    data = BucketIter(sentences(max(4 * batches, 64)), batches)
    runs, computed = {}, {}
    for kind, batch_list in (('buckets', list(data)), ('padded', padded_batches(data))):
        mod = pipeline_module(CONFIGS[name], width=width)
        shape = (BATCH, data.default_bucket_key)
        mod.bind([('data', shape)], [('softmax_label', shape)])
        initial = {n: mx.nd.array(v) for n, v in initial_values(mod.export_symbol)}
        mod.init_params(arg_params=initial)
        mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': SPEED_RATE})

        def run(mod=mod, batch_list=batch_list, initial=initial):
            mod.set_params(initial, {})  # every pass from the same values
            for batch in batch_list:
                mod.forward_backward(batch)
                mod.update()
        runs[kind] = run
        computed[kind] = sum(b.data[0].size for b in batch_list)
    return repeat(runs, repeats), data.real_tokens, computed


def step_seconds(width=SPEED_WIDTH, steps=5, repeats=3):
    """Seconds of one training step of each key's first batch, on the
    Pipeline's Module of ``1f1b chunks 2`` and on one device's
    ``BucketingModule`` (the model at ``width``; ``steps`` steps of each
    key in turn, median of ``repeats``): ``{route: {key: seconds}}``."""
    import statistics  # pylint: disable=import-outside-toplevel
    data = BucketIter(sentences(64), 40)
    first = {}
    for batch in data:
        first.setdefault(int(batch.bucket_key), batch)
    split = pipeline_module(CONFIGS['1f1b chunks 2'], width=width)
    symbol, initial = split.export_symbol, initial_values(split.export_symbol)
    one = mx.mod.BucketingModule(lambda key: (symbol, ('data',), ('softmax_label',)),
                                 default_bucket_key=data.default_bucket_key, context=mx.cpu(0))
    result = {}
    for route, mod in (('2 stages, 1f1b chunks 2', split), ('one device', one)):
        shape = (BATCH, data.default_bucket_key)
        mod.bind([('data', shape)], [('softmax_label', shape)])
        mod.init_params(arg_params={n: mx.nd.array(v) for n, v in initial})
        mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 0.01})

        def run(batch, mod=mod):
            def steps_of():
                for _ in range(steps):
                    mod.forward_backward(batch)
                    mod.update()
            return steps_of
        times = repeat({k: run(first[k]) for k in sorted(first)}, repeats)
        result[route] = {k: statistics.median(t) / steps for k, t in times.items()}
    return result


def memory_child(count, route='split', width=SPEED_WIDTH):
    """In a fresh process (``--memory-child COUNT [ROUTE]``): the storage
    MXNet's profiler counts per device (``{device: bytes}``, printed as
    JSON) once the Module of ``1f1b chunks 2`` (``route`` ``'split'``; the
    model at ``width``), or one device's ``BucketingModule`` (``'one'``),
    bound at the longest key, ran one training batch of each of the
    ``count`` longest keys, longest first (``count`` 1: one form, bound at
    the longest length, as padding every batch to it binds). Every child
    makes the same batches, the five keys' first, before its Module."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.memory import counted_storage, start_storage_profile
    trace_path = start_storage_profile('mp-bench-buckets-')
    data = BucketIter(sentences(64), 40)
    first = {}
    for batch in data:
        first.setdefault(batch.bucket_key, batch)
    chosen = [first[k] for k in sorted(first, reverse=True)[:count]]
    mod = pipeline_module(CONFIGS['1f1b chunks 2'], width=width)
    symbol = mod.export_symbol
    if route == 'one':
        mod = mx.mod.BucketingModule(lambda key: (symbol, ('data',), ('softmax_label',)),
                                     default_bucket_key=data.default_bucket_key,
                                     context=mx.cpu(0))
    shape = (BATCH, data.default_bucket_key)
    mod.bind([('data', shape)], [('softmax_label', shape)])
    mod.init_params(arg_params={n: mx.nd.array(v) for n, v in initial_values(symbol)})
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': LEARNING_RATE})
    for batch in chosen:
        mod.forward_backward(batch)
        mod.update()
    storage = counted_storage(trace_path)
    print(json.dumps({'keys': [int(b.bucket_key) for b in chosen], 'storage': storage}))


def memory_rows(route='split', counts=(1, 2, 3, 4, 5)):
    """:func:`memory_child` of ``route`` at each count, each in a process
    of its own: ``[(keys run, {device: bytes})]``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for count in counts:
        out = subprocess.run([sys.executable, '-m', 'bench.buckets', '--memory-child',
                              str(count), route], cwd=root, capture_output=True, text=True,
                             check=True,
                             env=dict(os.environ, PYTHONPATH=root, MXNET_SUBGRAPH_VERBOSE='0'),
                             timeout=600)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((result['keys'], result['storage']))
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ['--worker']:
        worker_main(argv[1:])
        return
    if argv[:1] == ['--memory-child']:
        memory_child(int(argv[1]), *argv[2:3])
        return
    parser = argparse.ArgumentParser(prog='python -m bench.buckets', description=__doc__.split(
        '\n\n', maxsplit=1)[0])
    parser.add_argument('--batches', type=int, default=200)
    parser.add_argument('--only', default=','.join(CONFIGS),
                        help='configurations, comma-separated (%s)' % ', '.join(CONFIGS))
    parser.add_argument('--nodes', action='store_true',
                        help='also 1F1B over 2 node processes, and 2 nodes of other batches')
    parser.add_argument('--memory', action='store_true',
                        help='storage per device with 1 to 5 buckets bound (1f1b chunks 2), '
                             'the first one bound at the longest length')
    parser.add_argument('--speed', action='store_true',
                        help='tokens per second against every batch padded to the longest '
                             '(1f1b chunks 2), side by side')
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
    table = [('configuration', 'max |difference|', 'largest change', 'buckets bound',
              'seconds')] + [(n, '%.1e' % d, '%.2f' % c, str(b), '%.1f' % s)
                             for n, d, c, b, s in rows]
    mismatch = None
    if args.nodes:
        import tempfile  # pylint: disable=import-outside-toplevel
        with tempfile.TemporaryDirectory() as folder:
            (worst, change, bound, seconds), mismatch = nodes_rows(args.batches, folder)
        table.append(('1f1b chunks 2 over 2 nodes', '%.1e' % worst, '%.2f' % change,
                      ' and '.join(map(str, bound)), '%.1f' % seconds))
    for line in columns(table):
        print(line)
    if args.memory:
        from mp_symbolic.tools.memory import format_bytes  # pylint: disable=import-outside-toplevel
        print('storage per device (MXNet\'s profiler), width %d, batches of %d, after one '
              'training batch of each key run, the first bound at the longest:'
              % (SPEED_WIDTH, BATCH))
        for route, title in (('split', '2 stages, 1f1b chunks 2 (cpu/0, cpu/1)'),
                             ('one', 'one device\'s BucketingModule (cpu/0)')):
            mem = memory_rows(route)
            devices = sorted({d for _, storage in mem for d in storage})
            base = sum(mem[0][1].values())
            print('  ' + title)
            for line in columns([('buckets bound (keys)',) + tuple(devices) +
                                 ('all', 'beside one bound at the longest')] +
                                [('%d (%s)' % (len(keys), ', '.join(map(str, keys))),) +
                                 tuple(format_bytes(storage.get(d, 0)) for d in devices) +
                                 (format_bytes(sum(storage.values())),
                                  '%.2fx' % (sum(storage.values()) / base))
                                 for keys, storage in mem]):
                print('    ' + line)
    if args.speed:
        import statistics  # pylint: disable=import-outside-toplevel
        times, real, computed = speed(args.batches)
        print('tokens per second, 1f1b chunks 2, width %d, SGD lr %g, %d batches (%d tokens of '
              'sentences), a pass of each in turn from the same values, median of %d:'
              % (SPEED_WIDTH, SPEED_RATE, args.batches, real, len(times['buckets'])))
        rate = {}
        for kind in ('buckets', 'padded'):
            median = statistics.median(times[kind])
            rate[kind] = real / median
            print('  %-8s %6.2f s (passes %s)  %8.0f tokens/s of sentences  %8.0f tokens/s '
                  'computed (%d, padding included)'
                  % (kind, median, ', '.join('%.2f' % t for t in times[kind]), rate[kind],
                     computed[kind] / median, computed[kind]))
        print('  buckets / padded: %.2fx the tokens per second' % (rate['buckets'] /
                                                                   rate['padded']))
        per_key = step_seconds()
        keys = sorted(next(iter(per_key.values())))
        print('seconds of one training step per bucket key (the key\'s first batch, median):')
        for line in columns([('route',) + tuple(map(str, keys))] +
                            [(route,) + tuple('%.3f' % t[k] for k in keys)
                             for route, t in per_key.items()]):
            print('  ' + line)
    if mismatch:
        print('2 nodes, node 1 drawing its batches with another seed:')
        for rank, (status, ended, line) in enumerate(mismatch):
            print('  node %d: exit status %d at %.2f s; %s' % (
                rank, status, ended, 'at %.2f s: %s' % line if line else 'no error line'))
        first = min((l[0] for _, _, l in mismatch if l), default=None)
        if first is not None:
            print('  from the first node\'s line to the last exit: %.2f s'
                  % (max(e for _, e, _ in mismatch) - first))


if __name__ == '__main__':
    main()
