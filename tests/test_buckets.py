"""Variable-length batches: a ``DataBatch`` with ``bucket_key`` and
``provide_data`` / ``provide_label``, as MXNet's ``BucketingModule`` reads
it, on every route of a Pipeline's Module.

``fit`` over batches of GluonNLP's ``FixedBucketSampler`` (an LSTM language
model, batches padded to their bucket's length) ends with the parameters
of one device's ``BucketingModule`` within 1e-6, under 1F1B with 2
micro-batches, with 2 replicas, interleaved, and on GPipe's one graph
(``python -m bench.buckets`` runs 200 batches; these run fewer). Each
bucket's executors are bound once, on its first batch, and read and write
the default bucket's parameters and gradients; ``buckets=`` declares the
keys and refuses another in one line.

Over two node processes (``tests/buckets_worker.py``), the same run ends
as one device's too; nodes whose batches carry other bucket keys end at
the first step where they differ, each in one line naming the step and
both keys.
"""
import json
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from bench import buckets as bench
from conftest import ROOT, node_env, reserved_port, run_node_workers

EQUAL = 1e-6  # the bound: one device's BucketingModule, within 1e-6


def _batch(key, rng, labels=True):
    data = mx.nd.array(rng.integers(0, bench.VOCAB, (bench.BATCH, key)))
    label = mx.nd.array(rng.integers(0, bench.VOCAB, (bench.BATCH, key)))
    return mx.io.DataBatch([data], [label] if labels else None, bucket_key=key,
                           provide_data=[mx.io.DataDesc('data', data.shape)],
                           provide_label=[mx.io.DataDesc('softmax_label', label.shape)]
                           if labels else None)


def _bound(schedule, **kwargs):
    devices = 'cpu:0,cpu:1'
    mod = bench.pipeline_module(dict(devices=devices, schedule=schedule, chunks=2), **kwargs)
    shape = (bench.BATCH, bench.LENGTHS[1])
    mod.bind([('data', shape)], [('softmax_label', shape)])
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': bench.LEARNING_RATE})
    return mod


@pytest.mark.parametrize('names', [('1f1b chunks 2', '1f1b chunks 2 replicas 2'),
                                   ('gpipe chunks 2', 'interleaved chunks 2')])
def test_fit_over_fixed_bucket_sampler_batches_ends_as_one_device_bucketing_module(names):
    rows, data = bench.compare(names, batches=40)
    keys = set(data.keys)
    assert len(keys) == bench.NUM_BUCKETS  # every bucket met
    for name, worst, change, bound, _ in rows:
        assert change > 0.1, name  # it trained
        assert worst <= EQUAL, (name, worst)
        assert bound == len(keys), name  # one form per key


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_each_bucket_binds_once_on_its_first_batch_and_writes_the_default_parameters(schedule):
    mod = _bound(schedule)
    rng = np.random.default_rng(0)
    forms = {}
    for key in (11, 25, 11, 40, 25):
        mod.forward_backward(_batch(key, rng))
        mod.update()
        assert mod.get_outputs()[0].shape == (bench.BATCH, key, bench.VOCAB)
        form = mod._buckets.bound[key]  # pylint: disable=protected-access
        assert forms.setdefault(key, form) is form  # bound on its first batch only
    assert list(mod._buckets.bound) == [11, 25, 40]  # pylint: disable=protected-access
    # the bound shapes (40) run on the runtimes kept by batch size
    default = mod._buckets.bound[40]  # pylint: disable=protected-access
    assert list(default.values()) == [None]
    # one set of parameters: a value written into the Module's reaches every bucket
    arg, aux = mod.get_params()
    weight = [n for n in arg if n.startswith('dense') and n.endswith('_weight')][0]
    bias = arg[weight[:-len('weight')] + 'bias'].asnumpy()
    arg[weight] = mx.nd.zeros_like(arg[weight])
    mod.set_params(arg, aux)
    expected = np.exp(bias - bias.max()) / np.exp(bias - bias.max()).sum()
    for key in (11, 25):
        mod.forward(_batch(key, rng), is_train=False)
        assert np.allclose(mod.get_outputs()[0].asnumpy(), expected, atol=1e-6), key


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_bucket_not_declared_is_refused_in_one_line_and_binds_nothing(schedule):
    mod = _bound(schedule, buckets=[11, 40])
    rng = np.random.default_rng(0)
    mod.forward_backward(_batch(11, rng))
    with pytest.raises(ValueError) as raised:
        mod.forward_backward(_batch(25, rng))
    assert str(raised.value) == ('bucket_key: expected one of the declared buckets (11, 40), '
                                 'found 25')
    assert list(mod._buckets.bound) == [11]  # pylint: disable=protected-access


def test_buckets_that_are_not_keys_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r'^buckets: expected at least one bucket key'):
        bench.pipeline_module(dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2),
                              buckets=[])
    with pytest.raises(ValueError, match=r'^buckets: expected an iterable of bucket keys'):
        bench.pipeline_module(dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2),
                              buckets=[[11]])


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_bucket_batch_without_labels_predicts_as_with_them(schedule):
    mod = _bound(schedule)
    rng = np.random.default_rng(1)
    for key in (18, 32):
        batch = _batch(key, rng)
        mod.forward(batch, is_train=False)
        with_labels = mod.get_outputs()[0].asnumpy()
        mod.forward(mx.io.DataBatch(batch.data, None, bucket_key=key,
                                    provide_data=batch.provide_data), is_train=False)
        assert mod.get_outputs()[0].shape == (bench.BATCH, key, bench.VOCAB)
        assert np.array_equal(mod.get_outputs()[0].asnumpy(), with_labels)


WORKER = os.path.join(ROOT, 'tests', 'buckets_worker.py')


def _reference(batches, config):
    """One device's ``BucketingModule`` over the run's batches: its
    parameters in the graph's argument order."""
    mod = bench.pipeline_module(config)
    initial = bench.initial_values(mod.export_symbol)
    data = bench.BucketIter(bench.sentences(max(4 * batches, 64)), batches, 0)
    return bench.reference(mod.export_symbol, data, initial), initial


@pytest.mark.slow
def test_two_nodes_fit_bucketed_batches_as_one_device_bucketing_module(tmp_path):
    config = dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2)
    batches = 20
    out = str(tmp_path / 'node')
    with reserved_port() as port:
        run_node_workers(WORKER, out, 2, port, [dict(config, batches=batches)], timeout=300)
    held = {}
    for rank in range(2):
        with np.load('%s0_%d.npz' % (out, rank)) as data:
            mine = {n: v for n, v in data.items() if n != 'bound'}
            assert int(data['bound']) == bench.NUM_BUCKETS  # each node bound every key once
        assert not set(mine) & set(held)  # each node holds its own stages'
        held.update(mine)
    ref, initial = _reference(batches, config)
    assert sorted(held) == sorted('p%d' % i for i in range(len(initial)))
    worst = max(float(np.abs(held['p%d' % i] - r).max()) for i, r in enumerate(ref))
    change = max(float(np.abs(held['p%d' % i] - v).max()) for i, (_, v) in enumerate(initial))
    assert change > 0.1 and worst <= EQUAL, (worst, change)


@pytest.mark.slow
def test_nodes_reading_other_bucket_keys_end_at_that_step_in_one_line_naming_both(tmp_path):
    batches = 12
    keys = [bench.BucketIter(bench.sentences(64), batches, seed).keys for seed in (0, 1)]
    step = next(i for i, (a, b) in enumerate(zip(*keys)) if a != b)
    table = [dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2, batches=batches,
                  seeds=[0, 1])]
    with reserved_port() as port:
        procs = [subprocess.Popen([sys.executable, WORKER, '--out', str(tmp_path / 'node'),
                                   '--nodes', '2', '--table', json.dumps(table)],
                                  env=node_env(rank, 2, port), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(2)]
        try:
            ended = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                p.kill()
    for rank, (p, (_, err)) in enumerate(zip(procs, ended)):
        other = 1 - rank
        assert p.returncode == 2, err[-3000:]
        assert err.strip().splitlines() == [
            'error: nodes: expected every node to run the same bucket keys, found node %d\'s '
            'bucket_key %d where node %d\'s is %d at step %d (does every node read the same '
            'batches?)' % (other, keys[other][step], rank, keys[rank][step], step)], err[-3000:]
        assert not os.path.exists('/proc/%d' % p.pid) or \
            open('/proc/%d/stat' % p.pid).read().split(') ')[-1].startswith('Z')
    assert not list(tmp_path.glob('node*.npz'))  # neither node went on to write its result


@pytest.mark.parametrize('key', [None, 40])
def test_batches_of_the_bound_shapes_run_on_the_stage_runtimes_bound_at_bind(key):
    mod = _bound('1f1b')
    bound = mod._runtimes  # pylint: disable=protected-access
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = _batch(40, rng)
        batch.bucket_key = key
        mod.forward_backward(batch)
        mod.update()
        assert mod._runtimes is bound  # pylint: disable=protected-access


@pytest.mark.parametrize('key', [None, 25, (4, 7), np.int64(11)])
def test_a_bucket_key_crosses_nodes_as_integers_and_reads_back_as_given(key):
    from mp_symbolic.core.transport import nodes  # pylint: disable=import-outside-toplevel
    message = nodes._key_message(3, key)  # pylint: disable=protected-access
    assert len(message) == nodes.KEY_SLOTS and message[0] == 3
    assert nodes._key_of(message) == key  # pylint: disable=protected-access


def test_a_bucket_key_of_another_kind_is_refused_over_nodes_in_one_line():
    from mp_symbolic.core.transport import nodes  # pylint: disable=import-outside-toplevel
    with pytest.raises(nodes.NodeError) as raised:
        nodes._key_message(0, 'long')  # pylint: disable=protected-access
    assert str(raised.value) == ("bucket_key: expected an integer, a tuple of at most 13 "
                                 "integers or None over node processes, found 'long'")


def test_a_checkpoint_of_buckets_exports_with_the_sequence_dynamic(tmp_path):
    """Buckets bound at several lengths of the tokens' axis: the checkpoint
    records it as ``T`` of the layout ``'NT'``, and ``python -m export``
    makes it the ONNX model's dynamic ``seq``, which runs another length
    as the Module does."""
    import onnx  # pylint: disable=import-outside-toplevel
    import mp_symbolic  # pylint: disable=import-outside-toplevel
    from export.__main__ import main as export_main  # pylint: disable=import-outside-toplevel
    from export.runtimes import OnnxPredictor  # pylint: disable=import-outside-toplevel
    mod = _bound('1f1b')
    rng = np.random.default_rng(2)
    for key in (11, 25):
        mod.forward_backward(_batch(key, rng))
        mod.update()
    mp_symbolic.save_checkpoint(mod, str(tmp_path / 'lm'), epoch=1, name='lm')
    symbol = mx.sym.load(str(tmp_path / 'lm' / 'current' / 'lm-symbol.json'))
    assert symbol.attr_dict()['data'].get('__layout__') == 'NT'
    sample = _batch(18, rng).data[0].asnumpy()
    np.savez(str(tmp_path / 'sample.npz'), data=sample)
    assert export_main(['--checkpoint', str(tmp_path / 'lm' / 'current' / 'lm'), '--epoch', '1',
                        '--sample', str(tmp_path / 'sample.npz'),
                        '--out', str(tmp_path / 'out')]) == 0
    model = onnx.load(str(tmp_path / 'out' / 'current' / 'lm.onnx'))
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ['batch', 'seq']
    batch = _batch(7, rng, labels=False)
    mod.forward(batch, is_train=False)
    expected = mod.get_outputs()[0].asnumpy()
    session = OnnxPredictor(str(tmp_path / 'out' / 'current' / 'lm.onnx'), table=False).session
    got = session.run(None, {'data': batch.data[0].asnumpy()})[0]
    assert got.shape == expected.shape == (bench.BATCH, 7, bench.VOCAB)
    assert np.abs(got - expected).max() <= 1e-5


def test_shorter_buckets_reuse_the_memory_of_the_bound_longest_on_the_stage_runtime():
    """Storage MXNet's profiler counts (each in a fresh process): two more
    buckets, shorter than the one bound at the longest length, take less
    than that one did, their executors sharing its memory pools slot by
    slot."""
    def storage(count):
        out = subprocess.run([sys.executable, '-m', 'bench.buckets', '--memory-child',
                              str(count)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0'))
        assert out.returncode == 0, out.stderr[-3000:]
        return sum(json.loads(out.stdout.strip().splitlines()[-1])['storage'].values())
    one, three = storage(1), storage(3)
    assert three - one < one, (one, three)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_the_twin_follows_each_length_as_gluon_does_and_gives_the_modules_outputs(schedule):
    """The imperative twin takes each batch at its own length (Gluon's
    blocks rebind per shape); on the same values it gives what the Module
    gives each bucket."""
    from mp_symbolic import Pipeline  # pylint: disable=import-outside-toplevel
    pipe = Pipeline(bench.blocks(), 'cpu:0,cpu:1', sample=(bench.BATCH, bench.LENGTHS[1]),
                    chunks=2, schedule=schedule)
    pipe.initialize(mx.init.Xavier())
    mod = pipe.module(loss='softmax')
    shape = (bench.BATCH, bench.LENGTHS[1])
    mod.bind([('data', shape)], [('softmax_label', shape)], for_training=False)
    mod.init_params(arg_params=pipe.get_params()[0], aux_params={})
    rng = np.random.default_rng(3)
    for key in (11, 25, 11):
        batch = _batch(key, rng)
        twin = mx.nd.softmax(pipe(batch.data[0])).asnumpy()
        mod.forward(batch, is_train=False)
        assert twin.shape == (bench.BATCH, key, bench.VOCAB)
        assert np.abs(mod.get_outputs()[0].asnumpy() - twin).max() <= 1e-6, key


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_buckets_batch_of_fewer_sentences_runs_at_its_own_size(schedule):
    """A bucket's last batch may hold fewer sentences (a multiple of the
    micro-batches): it runs at its size, as one device runs it."""
    mod = _bound(schedule)
    rng = np.random.default_rng(4)
    full = _batch(25, rng)
    half = mx.io.DataBatch([full.data[0][:4]], [full.label[0][:4]], bucket_key=25,
                           provide_data=[mx.io.DataDesc('data', (4, 25))],
                           provide_label=[mx.io.DataDesc('softmax_label', (4, 25))])
    mod.forward(full, is_train=False)
    whole = mod.get_outputs()[0].asnumpy()
    mod.forward(half, is_train=False)
    assert mod.get_outputs()[0].shape == (4, 25, bench.VOCAB)
    assert np.abs(mod.get_outputs()[0].asnumpy() - whole[:4]).max() <= 1e-6
    mod.forward_backward(half)
    mod.update()


def test_a_peer_gone_before_the_bucket_key_is_sent_ends_in_one_line_naming_it(monkeypatch):
    """gloo refuses to post a send to a peer whose connection closed (the
    peer killed, its torchrun agent gone): that is a node failure in one
    line naming the node, as a failed wait is, not a traceback."""
    from mp_symbolic.core.transport import nodes  # pylint: disable=import-outside-toplevel
    dist = nodes.torch('distributed')

    def closed(*args, **kwargs):
        raise RuntimeError('[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection '
                           'closed by peer [127.0.0.1]:57019. This is typically caused by a '
                           'remote worker crashing.')

    monkeypatch.setattr(dist, 'isend', closed)
    me = nodes.Nodes(count=2, rank=0, timeout=5.0, address='127.0.0.1:1')
    with pytest.raises(nodes.NodeFailure) as failure:
        nodes.agree_key(me, 3, 11, node_of_stage=(0, 1))
    line = str(failure.value)
    assert len(line.splitlines()) == 1
    assert line.startswith('nodes: node 1 (stage 1) '), line
    assert 'agree on the bucket key of a batch' in line, line
