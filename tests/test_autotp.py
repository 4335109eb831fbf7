"""Tensor parallelism for networks written with Gluon's own layers
(``Pipeline(..., tensor_parallel='auto' | {pattern: kind})``): GluonNLP's
BERT and TransformerEncoder and a GPT of plain ``nn.Dense`` layers, sharded
automatically over two stages of two devices, equal one device in outputs
and after a training step (Module and the twin with Trainer), each sharded
weight's halves on their devices; a plan for a layout the automatic pass
leaves whole, and the plans that cannot hold refused in one line; a
checkpoint that resumes on one device and on four shards and exports to one
unsplit ONNX file. Small sizes, random values (nothing is downloaded).
"""

import mxnet as mx
from mxnet import autograd, gluon
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import mp_symbolic
from mp_symbolic import Pipeline, Trainer
from mp_symbolic.tools.checkpoint import read_checkpoint

from export.__main__ import main as export_main
from conftest import bert_batch, bert_trainer_steps, small_bert

TWO_BY_TWO = 'cpu:0+cpu:1,cpu:2+cpu:3'


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def _values(net):
    return {name: param.data().copy() for name, param in net.collect_params().items()}


# -- the networks ----------------------------------------------------------------

def _bert(values=None):
    """A two-layer BERT of 4 heads (fixed names)."""
    return small_bert(values, num_heads=4, scale=0.05)


_bert_batch = bert_batch


class _Encoder(gluon.HybridBlock):
    """GluonNLP's TransformerEncoder (separate query/key/value ``Dense``
    layers in a MultiHeadAttentionCell) and a classifier on its first step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        transformer = pytest.importorskip('gluonnlp.model.transformer')
        with self.name_scope():
            self.encoder = transformer.TransformerEncoder(
                num_layers=2, units=16, hidden_size=32, max_length=16, num_heads=4,
                scaled=True, dropout=0.0, prefix='enc_')
            self.head = gluon.nn.Dense(3, flatten=False, prefix='head_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        out, _ = self.encoder(x)
        return self.head(F.slice_axis(out, axis=1, begin=0, end=1).reshape((0, -1)))


def _encoder(values=None):
    mx.random.seed(1)
    net = _Encoder(prefix='tx_')
    net.initialize(mx.init.Normal(0.1))
    net(mx.nd.array(_encoder_batch()))
    for name, value in (values or {}).items():
        net.collect_params()[name].set_data(value)
    return net


def _encoder_batch():
    return np.random.default_rng(2).normal(size=(4, 6, 16)).astype(np.float32)


class _Attend:
    """Causal attention on whole heads of ``head_dim`` (minGPT's), any head count."""

    def __init__(self, head_dim):
        self.head_dim = head_dim

    def __call__(self, F, q, k, v):
        q, k, v = (F.transpose(F.reshape(t, shape=(0, 0, -1, self.head_dim)), axes=(0, 2, 1, 3))
                   for t in (q, k, v))
        steps = F.contrib.arange_like(q, axis=2)
        future = F.broadcast_greater(F.reshape(steps, shape=(1, -1)), F.reshape(steps, shape=(-1, 1)))
        scores = F.broadcast_add(F.batch_dot(q, k, transpose_b=True) * self.head_dim ** -0.5,
                                 future * -1e9)
        out = F.batch_dot(F.softmax(scores, axis=-1), v)
        return F.reshape(F.transpose(out, axes=(0, 2, 1, 3)), shape=(0, 0, -1))


class _GPTAttention(gluon.HybridBlock):
    def __init__(self, units, heads, **kwargs):
        super().__init__(**kwargs)
        self.attend = _Attend(units // heads)
        with self.name_scope():
            self.query, self.key, self.value, self.proj = (
                gluon.nn.Dense(units, in_units=units, flatten=False, prefix=p)
                for p in ('query_', 'key_', 'value_', 'proj_'))

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.proj(self.attend(F, self.query(x), self.key(x), self.value(x)))


class _GPTBlock(gluon.HybridBlock):
    def __init__(self, units, heads, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.ln1 = gluon.nn.LayerNorm(in_channels=units, prefix='ln1_')
            self.attention = _GPTAttention(units, heads, prefix='attention_')
            self.ln2 = gluon.nn.LayerNorm(in_channels=units, prefix='ln2_')
            self.fc = gluon.nn.Dense(4 * units, in_units=units, flatten=False, prefix='fc_')
            self.gelu = gluon.nn.GELU(prefix='gelu_')
            self.out = gluon.nn.Dense(units, in_units=4 * units, flatten=False, prefix='out_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        x = x + self.attention(self.ln1(x))
        return x + self.out(self.gelu(self.fc(self.ln2(x))))


class _GPT(gluon.HybridBlock):
    """The project's GPT (mp_symbolic/training/tasks/gpt.py) in plain Gluon
    layers: token and position embeddings, pre-LayerNorm blocks, logits."""

    def __init__(self, vocab=20, units=16, heads=4, layers=2, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.token = gluon.nn.Embedding(vocab, units, prefix='token_')
            self.position = gluon.nn.Embedding(16, units, prefix='position_')
            self.blocks = gluon.nn.HybridSequential(prefix='blocks_')
            with self.blocks.name_scope():
                for i in range(layers):
                    self.blocks.add(_GPTBlock(units, heads, prefix='block%d_' % i))
            self.ln = gluon.nn.LayerNorm(in_channels=units, prefix='ln_')
            self.logits = gluon.nn.Dense(vocab, flatten=False, prefix='logits_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        positions = F.contrib.arange_like(x, axis=1)
        h = F.broadcast_add(self.token(x), F.expand_dims(self.position(positions), axis=0))
        return self.logits(self.ln(self.blocks(h)))


def _gpt(values=None):
    mx.random.seed(2)
    net = _GPT(prefix='gpt_')
    net.initialize(mx.init.Normal(0.1))
    net(mx.nd.array(_gpt_batch()))
    for name, value in (values or {}).items():
        net.collect_params()[name].set_data(value)
    return net


def _gpt_batch():
    return np.random.default_rng(3).integers(0, 20, (4, 8)).astype(np.float32)


# -- helpers ---------------------------------------------------------------------

def _module(pipe, xs, values, loss=None, output=None, label_shape=None):
    mod = pipe.module(loss=loss, output=output)
    mod.bind(data_shapes=list(zip(pipe.data_names(), [x.shape for x in xs])),
             label_shapes=None if loss is None else [('softmax_label', label_shape)],
             for_training=loss is not None)
    # unsplit names, as one device has them (the networks have no auxiliary states)
    mod.init_params(arg_params=values, aux_params={}, allow_missing=False, allow_extra=True)
    if loss is not None:
        mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 0.5})
    return mod


def _forward(mod, xs, label=None):
    batch = mx.io.DataBatch([mx.nd.array(x) for x in xs],
                            None if label is None else [mx.nd.array(label)])
    if label is None:
        mod.forward(batch, is_train=False)
    else:
        mod.forward_backward(batch)
        mod.update()
    return [o.asnumpy() for o in mod.get_outputs()]


def _shard_devices(mod):
    """``{shard parameter: its device}`` in the bound executor."""
    args = mod.executors[0].arg_dict
    return {n: (a.context, a.shape) for n, a in args.items() if '_shard' in n}


# -- BERT ------------------------------------------------------------------------

def test_bert_sharded_automatically_lists_its_attention_and_mlp_layers():
    pipe = Pipeline(_bert(), TWO_BY_TWO, sample=tuple(_bert_batch()), tensor_parallel='auto')
    text = repr(pipe)
    for layer in (0, 1):
        cell = 'encoder_transformer%d_dotproductselfattentioncell0: attention by heads: 4 ' \
               'heads, 2 per shard' % layer
        assert cell in text
        assert 'encoder_transformer%d_proj: row-parallel, reads the attention\'s shards ' \
               '(no gather)' % layer in text
        ffn = 'encoder_transformer%d_positionwiseffn0_' % layer
        assert ffn + 'ffn_1: MLP in, column-parallel' in text
        assert ffn + 'ffn_2: MLP out, row-parallel, reads the shards (no gather)' in text
        assert ffn + 'gelu0: per shard' in text
    assert 'bert_pooler: whole on the stage\'s first device: not in an attention or MLP ' \
           'pattern' in text
    assert pipe.sharding.shards == 2


def test_the_sample_is_traced_for_shapes_once_per_pipeline(monkeypatch):
    from mp_symbolic.core.graph import build as graph
    calls = []
    infer = graph.infer_shapes
    monkeypatch.setattr(graph, 'infer_shapes', lambda *a, **k: calls.append(1) or infer(*a, **k))
    Pipeline(_bert(), TWO_BY_TWO, sample=tuple(_bert_batch()), tensor_parallel='auto')
    assert len(calls) == 1
    del calls[:]
    Pipeline(_bert(), TWO_BY_TWO, sample=tuple(_bert_batch()))
    assert len(calls) == 1


def test_bert_auto_equals_one_device_in_outputs_and_after_one_module_step():
    xs = _bert_batch()
    label = np.array([0, 1, 1, 0], dtype=np.float32)
    start = _values(_bert())
    one = _module(Pipeline(_bert(start), 'cpu:0', sample=tuple(xs)), xs, start, 'softmax', 2,
                  (4,))
    split_pipe = Pipeline(_bert(start), TWO_BY_TWO, sample=tuple(xs), tensor_parallel='auto')
    split = _module(split_pipe, xs, start, 'softmax', 2, (4,))
    for ours, theirs in zip(_forward(split, xs, label), _forward(one, xs, label)):
        _close(ours, theirs)
    after_one, after_split = one.get_params()[0], split.get_params()[0]
    assert sorted(after_split) == sorted(after_one)
    moved = 0
    for name, value in after_one.items():
        _close(after_split[name].asnumpy(), value.asnumpy(), 1e-4)
        moved += not np.array_equal(value.asnumpy(), start[name].asnumpy())
    assert moved > 20
    shards = _shard_devices(split)
    ffn = 'encoder_transformer%d_positionwiseffn0_ffn_1_shard%d_weight'
    cell = 'encoder_transformer%d_dotproductselfattentioncell0_shard%d_query_weight'
    for layer, devices in ((0, (0, 1)), (1, (2, 3))):
        for i, device in enumerate(devices):
            assert shards[ffn % (layer, i)] == (mx.cpu(device), (16, 16))
            assert shards[cell % (layer, i)] == (mx.cpu(device), (8, 16))


def test_bert_auto_twin_step_with_the_trainer_equals_gluon_trainer_on_one_device():
    xs = _bert_batch()
    pipe, out, ref_out, reference, _ = bert_trainer_steps(
        lambda net: Pipeline(net, TWO_BY_TWO, sample=tuple(xs), tensor_parallel='auto'), _bert)
    for ours, theirs in zip(out, ref_out):
        _close(ours, theirs)
    arg, _ = pipe.get_params()
    for name, value in _values(reference).items():
        _close(arg[name].asnumpy(), value.asnumpy(), 1e-4)
    param = pipe.collect_params()['encoder_transformer1_positionwiseffn0_ffn_2_shard1_weight']
    assert param.list_ctx() == [mx.cpu(3)] and param.shape == (16, 16)


# -- TransformerEncoder and GPT ---------------------------------------------------

@pytest.mark.parametrize('build, batch, attention, chunks', [
    (_encoder, _encoder_batch, 'tx_enc_transformer%d_multiheadattentioncell0', 1),
    (_gpt, _gpt_batch, 'gpt_blocks_block%d_attention', 2)])
def test_transformer_encoder_and_plain_gpt_auto_equal_one_device_after_one_step(
        build, batch, attention, chunks):
    X = batch()
    start = _values(build())
    one = _module(Pipeline(build(start), 'cpu:0', sample=X), [X], start, 'softmax', None,
                  X.shape[:1] if build is _encoder else X.shape)
    pipe = Pipeline(build(start), TWO_BY_TWO, sample=X, tensor_parallel='auto', chunks=chunks)
    text = repr(pipe)
    for layer in (0, 1):
        assert (attention % layer) + ': attention by heads: 4 heads, 2 per shard' in text
    split = _module(pipe, [X], start, 'softmax', None,
                    X.shape[:1] if build is _encoder else X.shape)
    label = np.random.default_rng(4).integers(0, 3, X.shape[:1] if build is _encoder
                                              else X.shape).astype(np.float32)
    for ours, theirs in zip(_forward(split, [X], label), _forward(one, [X], label)):
        _close(ours, theirs)
    after_one, after_split = one.get_params()[0], split.get_params()[0]
    for name, value in after_one.items():
        _close(after_split[name].asnumpy(), value.asnumpy(), 1e-4)
    devices = {c for c, _ in _shard_devices(split).values()}
    assert devices == {mx.cpu(i) for i in range(4)}


# -- a plan ------------------------------------------------------------------------

class _Tagger(gluon.HybridBlock):
    """Token tags: an embedding, a wide layer into a LayerNorm, a
    column/row pair, a head; the automatic pass shards only the pair."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embed = gluon.nn.Embedding(30, 12, prefix='embed_')
            self.wide = gluon.nn.Dense(16, flatten=False, prefix='wide_')
            self.norm = gluon.nn.LayerNorm(in_channels=16, prefix='norm_')
            self.fc = gluon.nn.Dense(8, flatten=False, activation='relu', prefix='fc_')
            self.out = gluon.nn.Dense(12, flatten=False, prefix='out_')
            self.head = gluon.nn.Dense(3, flatten=False, prefix='head_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.head(self.out(self.fc(self.norm(self.wide(self.embed(x))))))


def _tagger(values=None):
    mx.random.seed(3)
    net = _Tagger(prefix='tag_')
    net.initialize(mx.init.Normal(0.2))
    net(mx.nd.array(_tagger_batch()))
    for name, value in (values or {}).items():
        net.collect_params()[name].set_data(value)
    return net


def _tagger_batch():
    return np.random.default_rng(5).integers(0, 30, (4, 6)).astype(np.float32)


PLAN = {'tag_embed*': 'vocab', 'tag_wide': 'column', 'tag_fc_*': 'column', 'tag_out_weight': 'row',
        'tag_head': 'replicate'}


def test_plan_shards_a_layout_the_automatic_pass_leaves_whole_and_equals_one_device():
    X = _tagger_batch()
    auto = repr(Pipeline(_tagger(), 'cpu:0+cpu:1', sample=X, tensor_parallel='auto'))
    assert 'tag_embed: whole' in auto and 'tag_wide: whole' in auto
    start = _values(_tagger())
    one = _module(Pipeline(_tagger(start), 'cpu:0', sample=X), [X], start, 'softmax', None,
                  X.shape)
    pipe = Pipeline(_tagger(start), TWO_BY_TWO, sample=X, tensor_parallel=PLAN)
    text = repr(pipe)
    for line in ('tag_embed: vocabulary-parallel', 'tag_wide: column-parallel (plan)',
                 'tag_fc: column-parallel (plan)', 'tag_out: row-parallel (plan)',
                 "tag_head: whole on the stage's first device (replicate)"):
        assert line in text
    split = _module(pipe, [X], start, 'softmax', None, X.shape)
    label = np.random.default_rng(6).integers(0, 3, X.shape).astype(np.float32)
    for ours, theirs in zip(_forward(split, [X], label), _forward(one, [X], label)):
        _close(ours, theirs)
    for name, value in one.get_params()[0].items():
        _close(split.get_params()[0][name].asnumpy(), value.asnumpy(), 1e-4)
    assert {n: s for n, (_, s) in _shard_devices(split).items() if 'embed' in n} == \
        {'tag_embed_shard0_weight': (15, 12), 'tag_embed_shard1_weight': (15, 12)}


@pytest.mark.parametrize('devices, plan, message', [
    ('cpu:0+cpu:1+cpu:2', {'tag_wide': 'column'},
     r"tensor_parallel\['tag_wide'\]: expected units that divide into 3 shards, found tag_wide "
     r"of weight \(16, 12\) \(16 units\)"),
    (TWO_BY_TWO, {'tag_out': 'row'},
     r"tensor_parallel\['tag_out'\]: expected the input of row layer tag_out \(weight \(12, 8\), "
     r"2 shards\) to be a column layer's or a sharded attention's output, found tag_fc_relu_fwd "
     r"\(Activation\)"),
    (TWO_BY_TWO, {'tag_embed': 'row'},
     r"tensor_parallel\['tag_embed'\]: expected a Dense layer for row, found tag_embed "
     r"\(Embedding\)"),
    (TWO_BY_TWO, {'tag_*': 'columns'},
     r"tensor_parallel\['tag_\*'\]: expected 'column', 'row', 'vocab' or 'replicate', found "
     r"'columns'"),
    (TWO_BY_TWO, {'*ffn*': 'column'},
     r"tensor_parallel\['\*ffn\*'\]: expected a pattern that matches a layer's name or "
     r"parameter, found no match \(layers: tag_embed, tag_wide, tag_fc, tag_out, tag_head\)"),
    (TWO_BY_TWO, 'automatic',
     r"tensor_parallel: expected 'auto' or a dict \{pattern: 'column' \| 'row' \| 'vocab' \| "
     r"'replicate'\}, found 'automatic'"),
])
def test_plan_that_cannot_hold_is_refused_in_one_line_and_the_network_is_unchanged(
        devices, plan, message):
    net = _tagger()
    before = [(k, type(b).__name__) for k, b in net._children.items()]  # pylint: disable=protected-access
    with pytest.raises(ValueError, match='^' + message + '$') as err:
        Pipeline(net, devices, sample=_tagger_batch(), tensor_parallel=plan)
    assert '\n' not in str(err.value)
    assert [(k, type(b).__name__) for k, b in net._children.items()] == before  # pylint: disable=protected-access


def test_plan_of_heads_that_do_not_divide_is_refused_naming_the_heads_and_widths():
    with pytest.raises(ValueError, match=(
            r"^tensor_parallel\['\*transformer0_dotproductselfattentioncell0'\]: expected a Dense "
            r"layer or an attention block \(query, key and value, a head count\) for column, "
            r"found encoder_transformer0_dotproductselfattentioncell0 "
            r"\(DotProductSelfAttentionCell: not sharded: 4 heads \(query, key, value widths "
            r"16/16/16\) do not divide into 3 shards\)$")):
        Pipeline(_bert(), 'cpu:0+cpu:1+cpu:2', sample=tuple(_bert_batch()),
                 tensor_parallel={'*transformer0_dotproductselfattentioncell0': 'column'})


# -- checkpoints and export ---------------------------------------------------------

def test_auto_checkpoint_resumes_on_one_device_and_on_four_shards(tmp_path):
    xs = _bert_batch()
    label = np.array([0, 1, 1, 0], dtype=np.float32)
    start = _values(_bert())
    split = _module(Pipeline(_bert(start), TWO_BY_TWO, sample=tuple(xs), tensor_parallel='auto'),
                    xs, start, 'softmax', 2, (4,))
    _forward(split, xs, label)
    mp_symbolic.save_checkpoint(split, str(tmp_path), epoch=1, name='bert')
    checkpoint = read_checkpoint(str(tmp_path))
    symbol, saved, _ = checkpoint.load()
    assert not any('shard' in name for name in symbol.list_arguments())
    assert saved['encoder_transformer0_positionwiseffn0_ffn_1_weight'].shape == (32, 16)
    expected, after = _forward(split, xs, label), split.get_params()[0]
    for devices, tp in (('cpu:0', None), ('cpu:0+cpu:1+cpu:2+cpu:3', 'auto')):
        pipe = Pipeline(_bert(), devices, sample=tuple(xs), tensor_parallel=tp)
        resumed = _module(pipe, xs, _values(_bert()), 'softmax', 2, (4,))
        resumed.restore(checkpoint)
        for name, value in saved.items():
            _close(resumed.get_params()[0][name].asnumpy(), value.asnumpy(), 1e-6)
        for ours, theirs in zip(_forward(resumed, xs, label), expected):
            _close(ours, theirs)
        for name, value in after.items():
            _close(resumed.get_params()[0][name].asnumpy(), value.asnumpy(), 1e-4)
    assert 'attention by heads: 4 heads, 1 per shard' in repr(pipe)
    assert {c for c, _ in _shard_devices(resumed).values()} == {mx.cpu(i) for i in range(4)}


def test_auto_checkpoint_exports_to_one_unsplit_onnx_file_equal_to_one_device(tmp_path):
    xs = _bert_batch()
    net = _bert()
    one_device = [o.asnumpy() for o in net(*[mx.nd.array(x) for x in xs])]
    values = _values(net)
    pipe = Pipeline(net, TWO_BY_TWO, sample=tuple(xs), tensor_parallel='auto')
    mod = _module(pipe, xs, values)
    mp_symbolic.save_checkpoint(mod, str(tmp_path / 'bert'), epoch=0, name='bert')
    np.savez(str(tmp_path / 'sample.npz'), **dict(zip(pipe.input_names, xs)))
    assert export_main(['--checkpoint', str(tmp_path / 'bert'), '--out', str(tmp_path / 'out'),
                        '--sample', str(tmp_path / 'sample.npz'), '--verify-batches', '4']) == 0
    onnx_files = sorted(p.name for p in (tmp_path / 'out' / 'current').iterdir()
                        if p.suffix == '.onnx')
    assert onnx_files == ['bert.onnx']
    session = ort.InferenceSession(str(tmp_path / 'out' / 'current' / 'bert.onnx'),
                                   providers=['CPUExecutionProvider'])
    initializers = {i.name for i in onnx.load(
        str(tmp_path / 'out' / 'current' / 'bert.onnx')).graph.initializer}
    assert 'encoder_transformer0_positionwiseffn0_ffn_1_weight' in initializers
    assert not any('shard' in name for name in initializers)
    for ours, theirs in zip(session.run(None, dict(zip(pipe.input_names, xs))), one_device):
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


def test_training_checkpoint_of_a_network_with_a_one_axis_input_reads_back(tmp_path):
    # BERT's valid lengths (one number per sample) carry no recorded shape
    xs = _bert_batch()
    start = _values(_bert())
    mod = _module(Pipeline(_bert(start), 'cpu:0', sample=tuple(xs)), xs, start, 'softmax', 2, (4,))
    mp_symbolic.save_checkpoint(mod, str(tmp_path), epoch=0, name='bert')
    _, saved, _ = read_checkpoint(str(tmp_path)).load()
    _close(saved['bert_cls_weight'].asnumpy(), start['bert_cls_weight'].asnumpy())


def test_layer_tied_to_another_stays_whole_automatically_and_is_refused_by_a_plan():
    class Tied(gluon.HybridBlock):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            with self.name_scope():
                self.fc = gluon.nn.Dense(8, in_units=8, flatten=False, activation='relu',
                                         prefix='fc_')
                self.out = gluon.nn.Dense(8, in_units=8, flatten=False, prefix='out_',
                                          params=self.fc.collect_params())

        def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
            return self.out(self.fc(x))

    X = np.ones((2, 3, 8), dtype=np.float32)
    pipe = Pipeline(Tied(prefix='tied_'), 'cpu:0+cpu:1', sample=X, tensor_parallel='auto')
    assert 'tied_fc: whole: tied_fc_weight is also held by tied_out' in repr(pipe)
    with pytest.raises(ValueError, match=r"^tensor_parallel\['tied_out'\]: expected a layer whose "
                                         r"parameters are its own to shard, found tied_out sharing "
                                         r"tied_fc_weight with tied_fc$"):
        Pipeline(Tied(prefix='tied_'), 'cpu:0+cpu:1', sample=X,
                 tensor_parallel={'tied_out': 'row'})


@pytest.mark.parametrize('chunks, replicas', [(2, 1), (1, 2)])
def test_plain_gpt_auto_twin_with_chunks_or_replicas_equals_gluon_trainer_on_one_device(
        chunks, replicas):
    X = _gpt_batch()
    y = mx.nd.array(np.random.default_rng(7).integers(0, 20, X.shape))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def step(net, trainer, x, target):
        with autograd.record():
            out = net(x)
            loss = loss_fn(out, target)
        loss.backward()
        trainer.step(len(X))
        return out.asnumpy()

    start = _values(_gpt())
    reference = _gpt(start)
    expected = step(reference, gluon.Trainer(reference.collect_params(), 'sgd',
                                             {'learning_rate': 0.5}), mx.nd.array(X), y)
    pipe = Pipeline(_gpt(start), TWO_BY_TWO, sample=X, tensor_parallel='auto', chunks=chunks,
                    replicas=replicas)
    pipe.initialize()
    out = step(pipe, Trainer(pipe.collect_params(), 'sgd', {'learning_rate': 0.5}),
               mx.nd.array(X, ctx=mx.cpu(0)), y.as_in_context(pipe.plan.last_device))
    _close(out, expected)
    arg, _ = pipe.get_params()
    for name, value in _values(reference).items():
        _close(arg[name].asnumpy(), value.asnumpy(), 1e-4)


def test_hybridized_network_is_sharded_and_unknown_shapes_without_a_sample_are_refused():
    X = _tagger_batch()
    start = _values(_tagger())
    net = _tagger(start)
    net.hybridize()
    expected = net(mx.nd.array(X)).asnumpy()   # caches the graph of the unsplit layers
    pipe = Pipeline(net, 'cpu:0+cpu:1', sample=X, tensor_parallel='auto')
    pipe.initialize()
    assert 'tag_fc: MLP in, column-parallel' in repr(pipe)
    assert 'tag_fc_shard1_weight' in net.collect_params()
    _close(pipe(mx.nd.array(X, ctx=mx.cpu(0))).asnumpy(), expected)
    lazy = gluon.nn.HybridSequential(prefix='lazy_')
    with lazy.name_scope():
        lazy.add(gluon.nn.Dense(8, activation='relu'), gluon.nn.Dense(4))
    with pytest.raises(ValueError, match=r'^sample: expected a batch or its shape to shard a '
                                         r'network whose parameter shapes are not known yet '
                                         r'\(lazy_dense0_weight, .*\), found none$'):
        Pipeline(lazy, 'cpu:0+cpu:1', tensor_parallel='auto')


def test_auto_gpt_whose_attention_holds_its_output_projection_exports_equal_to_one_device(
        tmp_path):
    X = _gpt_batch()
    net = _gpt()
    one_device = net(mx.nd.array(X)).asnumpy()
    values = _values(net)
    pipe = Pipeline(net, TWO_BY_TWO, sample=X, tensor_parallel='auto')
    assert 'gpt_blocks_block0_attention: attention by heads: 4 heads, 2 per shard, ' \
           'query/key/value column-parallel, proj row-parallel, one sum' in repr(pipe)
    mp_symbolic.save_checkpoint(_module(pipe, [X], values), str(tmp_path / 'gpt'), epoch=0,
                                name='gpt')
    assert export_main(['--checkpoint', str(tmp_path / 'gpt'), '--out', str(tmp_path / 'out'),
                        '--verify-batches', '4']) == 0
    session = ort.InferenceSession(str(tmp_path / 'out' / 'current' / 'gpt.onnx'),
                                   providers=['CPUExecutionProvider'])
    got = session.run(None, {session.get_inputs()[0].name: X})[0]
    assert np.abs(got - one_device).max() <= 1e-4 * np.abs(one_device).max()


@pytest.mark.parametrize('build, xs, plan', [
    (_bert, lambda: tuple(_bert_batch()),
     {'*dotproductselfattentioncell0': 'column', 'encoder_transformer?_proj': 'row'}),
    (_gpt, _gpt_batch, {'*_attention': 'column', '*_attention_proj': 'row'})])
def test_plan_shards_attention_by_heads_and_equals_one_device(build, xs, plan):
    xs = xs()
    net = build()
    inputs = xs if isinstance(xs, tuple) else (xs,)
    one_device = net(*[mx.nd.array(x) for x in inputs])
    one_device = [o.asnumpy() for o in (one_device if isinstance(one_device, (list, tuple))
                                        else [one_device])]
    values = _values(net)
    pipe = Pipeline(net, TWO_BY_TWO, sample=xs, tensor_parallel=plan)
    assert repr(pipe).count('attention by heads (plan): 4 heads, 2 per shard') == 2
    outputs = _forward(_module(pipe, list(inputs), values), list(inputs))
    for ours, theirs in zip(outputs, one_device):
        _close(ours, theirs)


def test_stages_of_different_device_counts_are_refused_and_one_device_stages_shard_nothing():
    X = _tagger_batch()
    with pytest.raises(mp_symbolic.DeviceSpecError,
                       match=r'^tensor_parallel: expected stages of one device count to shard '
                             r'over, found stages of 2 and 3 devices$'):
        Pipeline(_tagger(), 'cpu:0+cpu:1,cpu:2+cpu:3+cpu:4', sample=X, tensor_parallel='auto')
    pipe = Pipeline(_tagger(), 'cpu:0,cpu:1', sample=X, tensor_parallel='auto')
    assert pipe.sharding.lines() == ['tensor parallel (auto, 1 shard):',
                                     '  all layers: whole: every stage has one device']
    assert not pipe.sharded
