"""Tensor-parallel layers: each equals its Gluon counterpart on 1, 2 and 3
shards, with its parameters on the stage's devices in 1/N parts; sharded
networks take, give and checkpoint the unsplit layer's parameters; every
split of a small MLP (stages x shards x chunks x replicas) computes what one
device computes."""
import json

import mxnet as mx
from mxnet import autograd, gluon
import numpy as np
import pytest

import mp_symbolic
from mp_symbolic import (ColumnParallelDense, DeviceSpecError, Pipeline, RowParallelDense,
                         VocabParallelEmbedding)
from mp_symbolic.core.base.compat import fresh_variables, split_bind
from mp_symbolic.core.placement.devices import parse_devices
from mp_symbolic.tools.checkpoint import read_checkpoint, save_checkpoint
from mp_symbolic.tools.memory import device_memory
from conftest import chain

TOL = 1e-5
VOCAB, DIM, UNITS = 12, 6, 12


def _layer(kind, shards):
    """(tensor-parallel layer, its Gluon counterpart, a batch) with the same names."""
    if kind == 'embedding':
        X = mx.nd.array(np.random.RandomState(0).randint(0, VOCAB, (4, 3)))
        return (VocabParallelEmbedding(VOCAB, DIM, shards, prefix='emb_'),
                gluon.nn.Embedding(VOCAB, DIM, prefix='emb_'), X)
    X = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (4, DIM)))
    cls = ColumnParallelDense if kind == 'column' else RowParallelDense
    return (cls(UNITS, DIM, shards, activation='tanh', prefix='fc_'),
            gluon.nn.Dense(UNITS, in_units=DIM, activation='tanh', prefix='fc_'), X)


def _gluon_reference(ref, X, head):
    ref.initialize(mx.init.Uniform(0.5))
    with autograd.record():
        y = ref(X)
    y.backward(head)
    params = {n: p.data().copy() for n, p in ref.collect_params().items()}
    grads = {n: p.grad().asnumpy() for n, p in ref.collect_params().items()}
    return params, y.asnumpy(), grads


def _close(a, b):
    return np.allclose(a, b, atol=TOL, rtol=TOL)


@pytest.mark.parametrize('shards', [1, 2, 3])
@pytest.mark.parametrize('kind', ['column', 'row', 'embedding'])
def test_layer_matches_gluon_forward_and_gradients_with_shards_on_stage_devices(kind, shards):
    layer, ref, X = _layer(kind, shards)
    out_shape = (4, 3, DIM) if kind == 'embedding' else (4, UNITS)
    head = mx.nd.array(np.random.RandomState(1).uniform(-1, 1, out_shape))
    params, y_ref, g_ref = _gluon_reference(ref, X, head)
    devices = tuple(mx.cpu(1 + i) for i in range(shards))
    pipe = Pipeline([layer], [devices])

    # the symbolic graph, bound with group2ctx
    plan = pipe.plan
    sym = pipe.symbol()
    values = pipe.split_params(params)
    grad_req = {n: 'null' if n == 'data' else 'write' for n in sym.list_arguments()}
    with split_bind(plan.group2ctx):
        exe = sym.simple_bind(ctx=plan.first_device, group2ctx=plan.group2ctx,
                              grad_req=grad_req, data=X.shape)
    for name, value in values.items():
        exe.arg_dict[name][:] = value
    exe.arg_dict['data'][:] = X
    y = exe.forward(is_train=True)[0]
    exe.backward(head.as_in_context(y.context))
    assert _close(y.asnumpy(), y_ref)
    grads = pipe.gather_params({n: g for n, g in exe.grad_dict.items() if n != 'data'})
    assert sorted(grads) == sorted(g_ref)
    for name, grad in grads.items():
        assert _close(grad.asnumpy(), g_ref[name]), name

    # 1/N of each split parameter, and its gradient, on each device of the stage
    for full in pipe.sharded.values():
        assert len(full.shards) == shards
        for i, shard in enumerate(full.shards):
            assert exe.arg_dict[shard.name].context == devices[i]
            assert exe.grad_dict[shard.name].context == devices[i]
            assert exe.arg_dict[shard.name].shape[full.axis] == full.shape[full.axis] // shards

    # the imperative twin, on NDArrays
    pipe.set_params(params)
    for full in pipe.sharded.values():
        assert [p.list_ctx() for p in full.shards] == [[d] for d in devices]
    with autograd.record():
        y = pipe(X.as_in_context(devices[0]))
    y.backward(head.as_in_context(y.context))
    assert _close(y.asnumpy(), y_ref)
    grads = pipe.gather_params({n: p.grad(p.list_ctx()[0])
                                for n, p in pipe.collect_params().items()})
    for name, grad in grads.items():
        assert _close(grad.asnumpy(), g_ref[name]), name


def _mlp(shards, prefix='mlp'):
    """Column (hidden, relu) then Row, then a plain Dense head."""
    return [ColumnParallelDense(8, 5, shards, activation='relu', prefix=prefix + 'col_'),
            RowParallelDense(6, 8, shards, activation='tanh', prefix=prefix + 'row_'),
            gluon.nn.Dense(3, in_units=6, prefix=prefix + 'out_')]


def _batch(batch_size=8):
    rng = np.random.RandomState(2)
    return (mx.nd.array(rng.uniform(-1, 1, (batch_size, 5))),
            mx.nd.array(rng.randint(0, 3, (batch_size,))))


def _module(pipe, X, y, optimizer='sgd', loss='softmax', **init):
    mod = pipe.module(loss=loss)
    mod.bind([('data', X.shape)], [('softmax_label', y.shape)])
    mod.init_params(mx.init.Uniform(0.5), **init)
    mod.init_optimizer(kvstore='local' if pipe.replicas > 1 else None, optimizer=optimizer,
                       optimizer_params={'learning_rate': 0.1})
    return mod


def _per_position(pred, label):
    """A softmax loss at every position of a sequence."""
    return mx.sym.SoftmaxOutput(pred, label, preserve_shape=True)


def _step(mod, X, y):
    mod.forward_backward(mx.io.DataBatch([X], [y]))
    mod.update()
    return mod.get_outputs()[0].asnumpy()


def _params_close(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert _close(a[name].asnumpy(), b[name].asnumpy()), name


def test_module_on_sharded_stage_takes_one_device_parameters_by_name():
    X, y = _batch()
    one = _module(Pipeline(_mlp(1), 'cpu:0'), X, y)
    arg, aux = one.get_params()
    split = _module(Pipeline(_mlp(2), 'cpu:1+cpu:2,cpu:3', balance=[1, 2]), X, y,
                    arg_params=arg, aux_params=aux)
    _params_close(split.get_params()[0], arg)
    assert _close(_step(split, X, y), _step(one, X, y))
    _params_close(split.get_params()[0], one.get_params()[0])
    executor = split.executors[0]
    assert executor.arg_dict['mlpcol_shard1_weight'].context == mx.cpu(2)
    assert executor.arg_dict['mlpcol_shard0_weight'].shape == (4, 5)


def test_checkpoint_saved_on_two_shards_resumes_on_one_and_three(tmp_path):
    X, y = _batch()
    two = _module(Pipeline(_mlp(2), 'cpu:1+cpu:2,cpu:3', balance=[1, 2]), X, y,
                  optimizer='adam')
    _step(two, X, y)
    save_checkpoint(two, str(tmp_path), epoch=1)
    checkpoint = read_checkpoint(str(tmp_path))
    _, saved, _ = checkpoint.load()
    assert saved['mlpcol_weight'].shape == (8, 5)   # the unsplit layer's names and shapes
    assert not any('shard' in name for name in checkpoint.load()[0].list_arguments())
    expected = _step(two, X, y)
    after = two.get_params()[0]
    for shards, devices in [(1, 'cpu:1,cpu:3'), (3, 'cpu:1+cpu:2+cpu:4,cpu:3')]:
        mod = _module(Pipeline(_mlp(shards), devices, balance=[1, 2]), X, y, optimizer='adam')
        mod.restore(checkpoint)
        _params_close(mod.get_params()[0], saved)
        assert _close(_step(mod, X, y), expected)   # optimizer state followed too
        _params_close(mod.get_params()[0], after)


# stages x shards x chunks x replicas on the same batch as one device
SPLITS = [
    ('cpu:1+cpu:2', 2, [3], 1, 1),
    ('cpu:1+cpu:2+cpu:3', 3, [3], 1, 1),
    ('cpu:1+cpu:2,cpu:3', 2, [1, 2], 2, 1),
    ('cpu:1,cpu:2+cpu:3', 2, [1, 2], 1, 1),
    ('cpu:1+cpu:2,cpu:3,cpu:4+cpu:5,cpu:6', 2, [1, 2], 2, 2),
    ('cpu:1+cpu:2,cpu:3+cpu:4', 2, [3], 1, 2),
]


@pytest.mark.parametrize('devices,shards,balance,chunks,replicas', SPLITS)
def test_split_mlp_step_matches_one_device(devices, shards, balance, chunks, replicas):
    X, y = _batch()
    one = _module(Pipeline(_mlp(1), 'cpu:0'), X, y)
    arg, aux = one.get_params()
    pipe = Pipeline(_mlp(shards), devices, balance=balance, chunks=chunks, replicas=replicas)
    split = _module(pipe, X, y, arg_params=arg, aux_params=aux)
    assert _close(_step(split, X, y), _step(one, X, y))
    _params_close(split.get_params()[0], one.get_params()[0])


@pytest.mark.parametrize('devices,shards,balance,chunks,replicas', SPLITS)
def test_split_mlp_twin_step_with_the_trainer_matches_one_device(devices, shards, balance,
                                                                 chunks, replicas):
    """The imperative twin: each replica's shards run on that replica's
    devices with its own copies, so every copy gets its gradient and the
    Trainer's step equals one device's."""
    X, y = _batch()
    pipes = [Pipeline(_mlp(1), 'cpu:0'),
             Pipeline(_mlp(shards), devices, balance=balance, chunks=chunks, replicas=replicas)]
    pipes[0].initialize(mx.init.Uniform(0.5))
    pipes[1].initialize()
    pipes[1].set_params(pipes[0].get_params()[0])
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    outputs = []
    for pipe in pipes:
        trainer = mp_symbolic.Trainer(pipe.collect_params(), 'sgd', {'learning_rate': 0.1})
        with autograd.record():
            out = pipe(X.as_in_context(pipe.plan.first_device))
            value = loss(out, y.as_in_context(out.context))
        value.backward()
        trainer.step(X.shape[0])  # refuses a copy whose gradient backward did not write
        outputs.append(out.asnumpy())
    assert _close(outputs[1], outputs[0])
    _params_close(pipes[1].get_params()[0], pipes[0].get_params()[0])


def test_row_after_column_reads_its_shards_without_gather_or_slice():
    pipe = Pipeline(_mlp(2), 'cpu:1+cpu:2,cpu:3', balance=[1, 2])
    ops = [n['op'] for n in json.loads(pipe.symbol().tojson())['nodes']]
    assert 'slice_axis' not in ops and 'Concat' not in ops
    assert ops.count('add_n') == 1


def test_memory_table_shows_each_device_holding_one_nth_of_the_layer():
    units, in_units = 64, 32
    layer_bytes = (units * in_units + units) * 4
    for shards in (1, 2, 4):
        devices = tuple(mx.cpu(1 + i) for i in range(shards))
        pipe = Pipeline([ColumnParallelDense(units, in_units, shards, prefix='big_')], [devices])
        mod = pipe.module(loss='l2')
        mod.bind([('data', (4, in_units))], [('softmax_label', (4, units))])
        mod.init_params()
        table = device_memory(mod)
        for device in devices:
            assert table[str(device)]['params'] == layer_bytes // shards
            assert table[str(device)]['grads'] == layer_bytes // shards


def test_stage_of_other_device_count_than_shards_raises():
    with pytest.raises(DeviceSpecError, match='expected a stage of 1 or 2 devices for a layer '
                                              'of 2 shards, found 3 devices'):
        Pipeline(_mlp(2), 'cpu:1+cpu:2+cpu:3')


def test_plus_joins_devices_of_one_stage_and_single_device_plans_keep_group_names():
    assert parse_devices('cpu:0+cpu:1,cpu:2') == [(mx.cpu(0), mx.cpu(1)), mx.cpu(2)]
    pipe = Pipeline(_mlp(2), 'cpu:1+cpu:2,cpu:3', balance=[1, 2])
    assert pipe.plan.group2ctx == {'stage0': mx.cpu(1), 'stage0_shard1': mx.cpu(2),
                                   'stage1': mx.cpu(3)}
    assert pipe.describe()[0].startswith('stage0 -> cpu(1)+cpu(2): ')
    plain = Pipeline(_mlp(2), 'cpu:1,cpu:3', balance=[1, 2])
    assert plain.plan.group2ctx == {'stage0': mx.cpu(1), 'stage1': mx.cpu(3)}
    with pytest.raises(DeviceSpecError, match='each device once'):
        parse_devices('cpu:0+cpu:0')


def test_public_names():
    assert mp_symbolic.ColumnParallelDense is ColumnParallelDense
    with pytest.raises(ValueError, match='shards: expected a positive integer, found 0'):
        RowParallelDense(4, 4, 0)


def _pair_softmax(F, x):
    """Softmax within each pair of features (a stand-in for per-head attention)."""
    return F.reshape(F.softmax(F.reshape(x, (0, 0, -4, -1, 2)), axis=-1), (0, 0, -3))


def _attention_like(shards):
    return [ColumnParallelDense(12, 6, shards, flatten=False, prefix='qkv_'),
            mp_symbolic.PerShard(_pair_softmax, 12, shards),
            RowParallelDense(5, 12, shards, flatten=False, prefix='proj_')]


def _l2_module(pipe, X, y, **init):
    """``pipe``'s Module with an L2 head, bound to ``X``/``y``, initialised, SGD."""
    mod = pipe.module(loss='l2')
    mod.bind([('data', X.shape)], [('softmax_label', y.shape)])
    mod.init_params(mx.init.Uniform(0.5), **init)
    mod.init_optimizer(kvstore=None, optimizer_params={'learning_rate': 0.1})
    return mod


@pytest.mark.parametrize('devices,shards', [('cpu:1+cpu:2', 2), ('cpu:1+cpu:2+cpu:3', 3)])
def test_per_shard_function_between_column_and_row_matches_one_device(devices, shards):
    rng = np.random.RandomState(3)
    X = mx.nd.array(rng.uniform(-1, 1, (4, 3, 6)))
    y = mx.nd.array(rng.uniform(-1, 1, (4, 3, 5)))

    def module(pipe, **init):
        return _l2_module(pipe, X, y, **init)

    one = module(Pipeline(_attention_like(1), 'cpu:0'))
    pipe = Pipeline(_attention_like(shards), devices)
    split = module(pipe, arg_params=one.get_params()[0])
    ops = [n['op'] for n in json.loads(pipe.symbol().tojson())['nodes']]
    assert 'slice_axis' not in ops and 'Concat' not in ops
    assert _close(_step(split, X, y), _step(one, X, y))
    _params_close(split.get_params()[0], one.get_params()[0])


def test_imperative_twin_of_split_attention_like_block_matches_one_device():
    X = mx.nd.array(np.random.RandomState(4).uniform(-1, 1, (4, 3, 6)))
    one = Pipeline(_attention_like(1), 'cpu:0')
    one.initialize(mx.init.Uniform(0.5))
    split = Pipeline(_attention_like(2), 'cpu:1+cpu:2')
    split.set_params(*one.get_params())
    assert split.collect_params()['qkv_shard1_weight'].list_ctx() == [mx.cpu(2)]
    assert _close(split(X.as_in_context(mx.cpu(1))).asnumpy(), one(X).asnumpy())


def _tied_lm(shards):
    """Embedding, a column layer, and the output tied to the embedding's shards."""
    emb = VocabParallelEmbedding(10, 6, shards, prefix='tok_')
    return [emb, ColumnParallelDense(6, 6, shards, flatten=False, activation='tanh',
                                     prefix='mid_'),
            ColumnParallelDense(10, 6, shards, use_bias=False, flatten=False,
                                prefix=emb.prefix, params=emb.params)]


def test_output_tied_to_vocab_parallel_embedding_across_stages_matches_one_device():
    rng = np.random.RandomState(5)
    X, y = mx.nd.array(rng.randint(0, 10, (4, 3))), mx.nd.array(rng.randint(0, 10, (4, 3)))

    def module(pipe, **init):
        return _module(pipe, X, y, optimizer='adam', loss=_per_position, **init)

    one = module(Pipeline(_tied_lm(1), 'cpu:0'))
    assert sorted(one.get_params()[0]) == ['mid_bias', 'mid_weight', 'tok_weight']
    pipe = Pipeline(_tied_lm(2), 'cpu:1+cpu:2,cpu:3+cpu:4', balance=[2, 1])
    split = module(pipe, arg_params=one.get_params()[0])
    executor = split.executors[0]
    assert executor.arg_dict['tok_shard1_weight'].context == mx.cpu(2)  # its owner's device
    assert split.export_symbol.list_arguments().count('tok_weight') == 1
    assert _close(_step(split, X, y), _step(one, X, y))
    _params_close(split.get_params()[0], one.get_params()[0])


def _groups_of_tied_output(symbol, weight='tok_shard'):
    """``ctx_group`` of each op of the output layer: the products with the
    embedding's weights named ``weight...`` (directly, or through their tied
    identities)."""
    nodes = json.loads(symbol.tojson())['nodes']
    return sorted(n['attrs']['__ctx_group__'] for n in nodes if n['op'] == 'FullyConnected'
                  and any(nodes[i]['name'].startswith(weight) for i, _, _ in n['inputs']))


def test_whole_network_output_tied_to_vocab_parallel_embedding_runs_on_its_own_stage():
    rng = np.random.RandomState(5)
    X, y = mx.nd.array(rng.randint(0, 10, (4, 3))), mx.nd.array(rng.randint(0, 10, (4, 3)))

    def module(pipe, **init):
        return _module(pipe, X, y, optimizer='adam', loss=_per_position, **init)

    one = module(Pipeline(chain(_tied_lm(1), prefix='lm_'), 'cpu:0'))
    pipe = Pipeline(chain(_tied_lm(2), prefix='lm_'), 'cpu:1+cpu:2,cpu:3+cpu:4', sample=X)
    assert pipe.cut.stage_of_op[-1] == 1  # the cut leaves the output layer on the last stage
    assert _groups_of_tied_output(pipe.symbol()) == ['stage1', 'stage1_shard1']
    assert pipe.tied['tok_shard1_weight'] == (0, [0, 1])
    split = module(pipe, arg_params=one.get_params()[0])
    assert _groups_of_tied_output(split.export_symbol, 'tok_weight') == ['stage1']  # checkpoints'
    executor = split.executors[0]
    assert executor.arg_dict['tok_shard1_weight'].context == mx.cpu(2)  # its owner's device
    assert _close(_step(split, X, y), _step(one, X, y))
    _params_close(split.get_params()[0], one.get_params()[0])
    twin = Pipeline(chain(_tied_lm(2), prefix='lm_'), 'cpu:1+cpu:2,cpu:3+cpu:4', sample=X)
    twin.set_params(*one.get_params())
    assert _close(twin(X.as_in_context(mx.cpu(1))).softmax().asnumpy(), one.predict(
        mx.io.NDArrayIter(X, batch_size=len(X))).asnumpy())

@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_layers_of_one_shard_over_stages_with_micro_batches_checkpoint_their_graph(
        schedule, tmp_path):
    """A tensor-parallel layer of one shard is built unsplit-equal in both
    traces, but only the checkpoint's trace marks it: its checkpoint graph
    (micro-batches make one apart from the bound graph) keeps each layer on
    its stage, the output tied to the embedding on the last."""
    rng = np.random.RandomState(5)
    X, y = mx.nd.array(rng.randint(0, 10, (4, 3))), mx.nd.array(rng.randint(0, 10, (4, 3)))
    pipe = Pipeline(_tied_lm(1), 'cpu:1,cpu:2', balance=[2, 1], chunks=2, schedule=schedule)
    mod = _module(pipe, X, y, loss=_per_position)
    assert _groups_of_tied_output(mod.export_symbol, 'tok_weight') == ['stage1']
    _step(mod, X, y)
    save_checkpoint(mod, str(tmp_path), epoch=1)
    symbol, saved, _ = read_checkpoint(str(tmp_path)).load()
    assert saved['tok_weight'].shape == (10, 6)
    assert _groups_of_tied_output(symbol, 'tok_weight') == ['stage1']



class _Residual(gluon.HybridBlock):
    """Column -> Row with a skip connection, then a head: one whole network."""

    def __init__(self, shards, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.col = ColumnParallelDense(8, 5, shards, activation='relu', prefix='col_')
            self.row = RowParallelDense(5, 8, shards, prefix='row_')
            self.out = gluon.nn.Dense(3, in_units=5, prefix='out_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.out(x + self.row(self.col(x)))


def test_whole_network_cut_keeps_each_layer_shards_on_one_stage_and_matches_one_device():
    X, y = _batch()
    one = _module(Pipeline(_Residual(1, prefix='res_'), 'cpu:0'), X, y)
    pipe = Pipeline(_Residual(2, prefix='res_'), 'cpu:1+cpu:2,cpu:3')
    split = _module(pipe, X, y, arg_params=one.get_params()[0])
    executor = split.executors[0]
    assert [executor.arg_dict['res_col_shard%d_weight' % i].context for i in (0, 1)] == \
        [mx.cpu(1), mx.cpu(2)]
    assert _close(_step(split, X, y), _step(one, X, y))
    _params_close(split.get_params()[0], one.get_params()[0])
    twin = Pipeline(_Residual(2, prefix='res_'), 'cpu:1+cpu:2,cpu:3')
    twin.set_params(*one.get_params())
    assert _close(mx.nd.softmax(twin(X.as_in_context(mx.cpu(1)))).asnumpy(), one.predict(
        mx.io.NDArrayIter(X, batch_size=len(X))).asnumpy())


def test_whole_network_checkpoint_holds_unsplit_layers_and_resumes_on_three_shards(tmp_path):
    X, y = _batch()
    two = _module(Pipeline(_Residual(2, prefix='res_'), 'cpu:1+cpu:2,cpu:3'), X, y,
                  optimizer='adam')
    _step(two, X, y)
    save_checkpoint(two, str(tmp_path), epoch=1)
    checkpoint = read_checkpoint(str(tmp_path))
    symbol, saved, _ = checkpoint.load()
    assert not any('shard' in name for name in symbol.list_arguments())
    groups = {n['attrs']['__ctx_group__'] for n in json.loads(symbol.tojson())['nodes']}
    assert groups == {'stage0', 'stage1'}
    expected, after = _step(two, X, y), two.get_params()[0]
    three = _module(Pipeline(_Residual(3, prefix='res_'), 'cpu:1+cpu:2+cpu:4,cpu:3'), X, y,
                    optimizer='adam')
    three.restore(checkpoint)
    _params_close(three.get_params()[0], saved)
    assert _close(_step(three, X, y), expected)
    _params_close(three.get_params()[0], after)


def test_unsplit_value_of_another_shape_raises_naming_both_shapes():
    pipe = Pipeline(_mlp(2), 'cpu:1+cpu:2,cpu:3', balance=[1, 2])
    with pytest.raises(ValueError, match=r'mlpcol_weight: expected shape \(8, 5\) \(the unsplit '
                                         r'layer\), found \(3, 3\)'):
        pipe.set_params({'mlpcol_weight': np.zeros((3, 3))})


def _mix(F, q, k, v):
    """A per-pair function of three inputs (a stand-in for attention on whole heads)."""
    return _pair_softmax(F, q * k) * v


class _ThreeColumns(gluon.HybridBlock):
    """Three column layers read by one PerShard, then a row layer."""

    def __init__(self, shards, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.q, self.k, self.v = (ColumnParallelDense(8, 6, shards, flatten=False,
                                                          prefix=p + '_') for p in 'qkv')
            self.mix = mp_symbolic.PerShard(_mix, 8, shards)
            self.proj = RowParallelDense(5, 8, shards, flatten=False, prefix='proj_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.proj(self.mix(self.q(x), self.k(x), self.v(x)))


def test_per_shard_function_of_several_column_outputs_reads_each_shard_and_matches_one_device():
    rng = np.random.RandomState(6)
    X = mx.nd.array(rng.uniform(-1, 1, (4, 3, 6)))
    y = mx.nd.array(rng.uniform(-1, 1, (4, 3, 5)))

    def module(pipe, **init):
        return _l2_module(pipe, X, y, **init)

    one = module(Pipeline([_ThreeColumns(1, prefix='att_')], 'cpu:0'))
    pipe = Pipeline([_ThreeColumns(2, prefix='att_')], 'cpu:1+cpu:2')
    split = module(pipe, arg_params=one.get_params()[0])
    ops = [n['op'] for n in json.loads(pipe.symbol().tojson())['nodes']]
    assert 'slice_axis' not in ops and 'Concat' not in ops
    assert _close(_step(split, X, y), _step(one, X, y))
    _params_close(split.get_params()[0], one.get_params()[0])
    twin = Pipeline([_ThreeColumns(2, prefix='att_')], 'cpu:1+cpu:2')
    twin.set_params(*one.get_params())
    assert _close(twin(X.as_in_context(mx.cpu(1))).asnumpy(),
                  one.predict(mx.io.NDArrayIter(X, batch_size=len(X))).asnumpy())


def _doc_layer():
    """The ``ShardedBlock`` example of docs/tensor-parallel.md, run as written."""
    import os
    import re
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs',
                        'tensor-parallel.md')
    with open(path) as f:
        blocks = re.findall(r'^```python\n(.*?)^```', f.read(), re.M | re.S)
    code, = [b for b in blocks if 'class ColumnParallelBilinear' in b]
    namespace = {}
    exec(compile(code, path, 'exec'), namespace)  # pylint: disable=exec-used
    return namespace


def test_a_layer_written_on_sharded_block_equals_one_device_with_shards_on_their_devices():
    doc = _doc_layer()
    pipe, layer_class = doc['pipe'], doc['ColumnParallelBilinear']
    rng = np.random.RandomState(3)
    X = mx.nd.array(rng.uniform(-1, 1, (4, 8)))
    y = mx.nd.array(rng.randint(0, 3, 4))
    one_net = gluon.nn.HybridSequential(prefix=doc['net'].prefix)
    with one_net.name_scope():  # the same names: the layer's one shard is the whole layer
        one_net.add(gluon.nn.Dense(8, in_units=8), layer_class(5, 4, 1), gluon.nn.Dense(3))
    one = _module(Pipeline(one_net, 'cpu:0', sample=X), X, y)
    params = {n: v.copy() for n, v in one.get_params()[0].items()}
    split = _module(pipe, X, y, arg_params=params)
    # the unsplit layer is what the math says: y_k = x W_k z
    W = params[[n for n in params if n.endswith('weight') and params[n].ndim == 3][0]].asnumpy()
    assert W.shape == (5, 4, 4)
    for mod in (one, split):
        _step(mod, X, y)
    outputs = [m.get_outputs()[0].asnumpy() for m in (one, split)]
    assert _close(outputs[1], outputs[0])
    one_grads = dict(zip(one._exec_group.param_names,  # pylint: disable=protected-access
                         one._exec_group.grad_arrays))  # pylint: disable=protected-access
    split_grads = pipe.gather_params({n: g for n, g in split.executors[0].grad_dict.items()
                                      if n in pipe.collect_params()})
    assert sorted(split_grads) == sorted(one_grads)
    for name, grad in split_grads.items():
        assert _close(grad.asnumpy(), one_grads[name][0].asnumpy()), name
    # shard i's weight and gradient on the stage's device i, of its part's size
    weight, = pipe.sharded.values()
    assert [s.shape[0] for s in weight.shards] == [3, 2]
    exe = split.executors[0]
    assert [exe.arg_dict[s.name].context for s in weight.shards] == [mx.cpu(1), mx.cpu(2)]
    assert [exe.grad_dict[s.name].context for s in weight.shards] == [mx.cpu(1), mx.cpu(2)]
    # the checkpointed (unsplit) graph computes the same layer on one device
    h = X.asnumpy() @ params[pipe.blocks[0].weight.name].asnumpy().T + \
        params[pipe.blocks[0].bias.name].asnumpy()
    x, z = h[:, :4], h[:, 4:]
    bilinear = np.einsum('ni,kij,nj->nk', x, W, z)
    internals = split.export_symbol.get_internals()
    name, = [n for n in internals.list_outputs() if n.endswith('fwd_output') and 'dense' not in n]
    exe = internals[name].simple_bind(mx.cpu(0), data=X.shape, grad_req='null')
    for arg in exe.arg_dict:
        exe.arg_dict[arg][:] = X if arg == 'data' else params[arg]
    assert _close(exe.forward()[0].asnumpy(), bilinear)


def test_sharded_block_refuses_sizes_that_do_not_split_the_axis():
    class Bad(mp_symbolic.ShardedBlock):
        def __init__(self):
            super().__init__(2)
            with self.name_scope():
                self.add_param('weight', (5, 4), 0, [3, 3])
    with pytest.raises(ValueError, match=r'^weight: expected sizes of the 2 shards summing to '
                                         r'axis 0 of \(5, 4\) \(5\), found \[3, 3\]$'):
        Bad()


def test_a_trace_marks_the_layers_of_the_network_it_traces_and_no_other():
    """The trace is held by the traced network's layers for its length: a
    layer of another network called meanwhile builds its split graph
    unmarked, as outside any trace, and after it nothing is marked."""
    from mp_symbolic.core.parallel import tensor_parallel  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.graph.names import SHARD_ATTR  # pylint: disable=import-outside-toplevel

    def marks(symbol):
        return sorted({n.get('attrs', {}).get(SHARD_ATTR) for n in
                       json.loads(symbol.tojson())['nodes']} - {None})

    traced = ColumnParallelDense(UNITS, DIM, 2, prefix='traced_')
    other = ColumnParallelDense(UNITS, DIM, 2, prefix='other_')
    x = mx.sym.var('data')
    with fresh_variables([traced, other]), tensor_parallel.mark_shards(traced):
        inside, beside = traced(x), other(x)
    with fresh_variables(traced):
        after = traced(x)
    assert marks(inside) == ['0/2/traced#0', '1/2/traced#0']  # shard/shards/layer#call
    assert marks(beside) == [] and marks(after) == []


class _GatedColumns(mp_symbolic.ShardedBlock):
    """``(x A^T) * (z B^T)`` of two inputs, the units of ``A`` and ``B`` split
    over the shards: a layer of several inputs, joined through comm."""

    def __init__(self, units, shards, **kwargs):
        super().__init__(shards, **kwargs)
        self.units, self.sizes = units, [units // shards + (i < units % shards)
                                         for i in range(shards)]
        with self.name_scope():
            self.add_param('a_weight', (units, 6), 0, self.sizes, init=mx.init.Xavier())
            self.add_param('b_weight', (units, 4), 0, self.sizes, init=mx.init.Xavier())

    @staticmethod
    def _gated(F, x, z, a_weight, b_weight, units, name):
        return F.FullyConnected(x, a_weight, no_bias=True, num_hidden=units, name=name + 'a') * \
            F.FullyConnected(z, b_weight, no_bias=True, num_hidden=units, name=name + 'b')

    def shard_forward(self, F, i, x, z, a_weight, b_weight):  # pylint: disable=arguments-differ
        return self._gated(F, x, z, a_weight, b_weight, self.sizes[i], 'shard%d_' % i)

    def combine(self, F, parts, x, z):  # pylint: disable=arguments-differ
        from mp_symbolic.core.transport.comm import gather_from_shards
        return gather_from_shards(F, parts)

    def unsplit_forward(self, F, x, z, a_weight, b_weight):  # pylint: disable=arguments-differ
        return self._gated(F, x, z, a_weight, b_weight, self.units, '')


class _TwoInputNet(gluon.HybridBlock):
    def __init__(self, shards, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.left = gluon.nn.Dense(6, in_units=8, prefix='left_')
            self.right = gluon.nn.Dense(4, in_units=8, prefix='right_')
            self.gated = _GatedColumns(5, shards, prefix='gated_')
            self.out = gluon.nn.Dense(3, in_units=5, prefix='out_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.out(self.gated(self.left(x), self.right(x)))


def test_a_sharded_block_of_two_inputs_equals_its_unsplit_layer_in_graph_and_twin():
    rng = np.random.RandomState(5)
    X = mx.nd.array(rng.uniform(-1, 1, (4, 8)))
    y = mx.nd.array(rng.randint(0, 3, 4))
    one = _module(Pipeline(_TwoInputNet(1, prefix='net_'), 'cpu:0', sample=X), X, y)
    params = {n: v.copy() for n, v in one.get_params()[0].items()}
    pipe = Pipeline(_TwoInputNet(2, prefix='net_'), 'cpu:1+cpu:2', sample=X)
    split = _module(pipe, X, y, arg_params=params)
    assert _close(_step(split, X, y), _step(one, X, y))
    _params_close(split.get_params()[0], one.get_params()[0])
    weight = pipe.sharded['net_gated_a_weight']
    assert [s.shape[0] for s in weight.shards] == [3, 2]
    twin = Pipeline(_TwoInputNet(2, prefix='net_'), 'cpu:1+cpu:2', sample=X)
    twin.set_params(*one.get_params())
    assert _close(mx.nd.softmax(twin(X.as_in_context(mx.cpu(1)))).asnumpy(),
                  one.predict(mx.io.NDArrayIter(X, batch_size=len(X))).asnumpy())
