"""The Pipeline: tagging of any Gluon blocks, the plan, the Module it hands
out (MXNet's own fit/score/predict/save_checkpoint), and its refusals."""
import json

import mxnet as mx
from mxnet import gluon
import numpy as np
import pytest

from mp_symbolic import Pipeline
from mp_symbolic.core.base import compat
from mp_symbolic.core.base.compat import split_bind
from mp_symbolic.core.placement.devices import DeviceSpecError, stage_name
from mp_symbolic.training.tasks import digits, regression

from conftest import (THREE_DEVICES, assert_host_copy_changes_no_value_or_byte,
                      assert_host_params_are_the_devices, bn_mlp)

nn = gluon.nn


def _groups(symbol):
    return {n['name']: n.get('attrs', {}).get('__ctx_group__')
            for n in json.loads(symbol.tojson())['nodes']}


def _mlp(widths=(2, 8, 8, 8, 1)):
    return [nn.Dense(widths[i + 1], in_units=widths[i], activation='relu' if i < 3 else None,
                     prefix='fc%d_' % i) for i in range(len(widths) - 1)]


@pytest.mark.parametrize('blocks, devices, loss', [
    (regression.build_blocks, THREE_DEVICES, 'l2'),
    (regression.build_blocks, 'cpu:0,cpu:1', 'l2'),
    (digits.build_blocks, THREE_DEVICES, 'softmax'),
    (digits.build_blocks, 'cpu:1,cpu:0', 'softmax'),
])
def test_every_op_variable_and_auxiliary_state_carries_its_stage(blocks, devices, loss):
    pipe = Pipeline(blocks(), devices)
    groups = _groups(pipe.training_symbol(loss))
    assert all(g is not None for g in groups.values()), groups
    for block, stage in zip(pipe.blocks, pipe.plan.stage_of_layer):
        for param in block.collect_params().values():
            assert groups[param.name] == stage_name(stage), param.name
    assert groups['data'] == 'stage0'
    last = stage_name(pipe.plan.num_stages - 1)
    assert groups['softmax_label'] == last
    symbol = pipe.training_symbol(loss)
    assert len(symbol.list_auxiliary_states()) == (4 if blocks is digits.build_blocks else 0)


def test_rebuilding_with_another_plan_does_not_keep_the_first_plans_groups():
    """Gluon caches each parameter's variable: a second Pipeline over the same
    blocks must tag them with its own stages."""
    blocks = _mlp()
    first = _groups(Pipeline(blocks, 'cpu:0,cpu:1', balance=[1, 3]).symbol())
    second = _groups(Pipeline(blocks, 'cpu:0,cpu:1', balance=[3, 1]).symbol())
    assert first['fc1_weight'] == 'stage1' and second['fc1_weight'] == 'stage0'
    assert first['fc3_weight'] == second['fc3_weight'] == 'stage1'


def test_plan_is_printed_with_block_names_and_parameter_counts():
    lines = Pipeline(_mlp(), 'cpu:0,cpu:1').describe()
    assert lines[0].startswith('stage0 -> cpu(0): fc0')
    assert 'parameters)' in lines[0] and lines[1].startswith('stage1 -> cpu(1): ')


def test_micro_batched_graph_has_unique_op_names_and_shared_weights():
    pipe = Pipeline(_mlp(), 'cpu:0,cpu:1', chunks=4)
    symbol = pipe.training_symbol('l2')
    nodes = json.loads(symbol.tojson())['nodes']
    ops = [n['name'] for n in nodes if n['op'] != 'null']
    assert len(ops) == len(set(ops))
    assert sum(n['op'] == 'FullyConnected' for n in nodes) == 4 * 4
    assert symbol.list_arguments().count('fc0_weight') == 1
    assert 'chunk' in ops and 'join' in ops
    # each chunk's output but the last through a copy on the last stage, so
    # that MXNet bulks each stage's ops per chunk (compat.segment_boundaries)
    boundaries = [n for n in nodes if n['op'] == compat.SEGMENT_BOUNDARY_OP]
    assert [n['name'] for n in boundaries] == ['chunk_boundary0', 'chunk_boundary1',
                                               'chunk_boundary2']
    assert {n['attrs']['__ctx_group__'] for n in boundaries} == {'stage1'}


def test_deferred_shapes_are_inferred_from_a_sample():
    blocks = [nn.Conv2D(4, 3), nn.Flatten(), nn.Dense(3)]
    with pytest.raises(ValueError, match='expected every parameter shape to be known'):
        Pipeline(blocks, 'cpu:0,cpu:1')
    pipe = Pipeline(blocks, 'cpu:0,cpu:1', sample=np.zeros((2, 1, 6, 6)))
    assert blocks[2].weight.shape == (3, 64)
    assert sum(pipe.balance) == 3


@pytest.mark.parametrize('kwargs, error, message', [
    ({'blocks': [], 'devices': 'cpu:0'}, ValueError, 'expected at least one HybridBlock'),
    ({'blocks': [nn.Dense(2, in_units=2), gluon.nn.Sequential()], 'devices': 'cpu:0'},
     TypeError, 'found Sequential at position 1'),
    ({'devices': None}, DeviceSpecError, 'found None'),
    ({'devices': 'cpu:0,cpu:1,cpu:2,cpu:3,cpu:4'}, DeviceSpecError, 'devices per replica: 5'),
    ({'devices': 'cpu:0,cpu:1', 'balance': [2, 3]}, ValueError, 'summing to the 4 blocks'),
    ({'devices': 'cpu:0,cpu:1', 'balance': [4, 0]}, ValueError, 'at least one block per stage'),
    ({'devices': 'cpu:0,cpu:1', 'balance': [4]}, ValueError, 'one entry per device'),
    ({'devices': 'cpu:0,cpu:1', 'balance': 'params'}, ValueError, "found 'params'"),
    ({'devices': 'cpu:0,cpu:1', 'balance': 'time'}, ValueError, 'expected sample='),
    ({'devices': 'cpu:0,cpu:1', 'chunks': 0}, ValueError, 'chunks: expected a positive'),
    ({'devices': 'cpu:0,cpu:1,cpu:2', 'replicas': 2}, DeviceSpecError, 'multiple of the '
                                                                        'replicas'),
    ({'devices': [mx.cpu(0), 'cpu:1']}, DeviceSpecError, 'expected devices as mx.Context'),
])
def test_bad_arguments_are_refused_with_what_was_expected(kwargs, error, message):
    kwargs = dict(kwargs)
    kwargs.setdefault('blocks', _mlp())
    with pytest.raises(error, match=message.replace('(', r'\(').replace(')', r'\)')):
        Pipeline(**kwargs)


class _Whole(gluon.HybridBlock):
    """Two dense layers of unknown input size, given as one network."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.a = nn.Dense(8)
            self.b = nn.Dense(2)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.b(self.a(x))


def _deferred():
    return [nn.Dense(8), nn.Dense(2)]


def _refusal(build, sample):
    with pytest.raises(ValueError) as err:
        Pipeline(build(), 'cpu:0,cpu:1', sample=sample)
    assert '\n' not in str(err.value) and type(err.value) is ValueError
    return str(err.value)


@pytest.mark.parametrize('build', [_deferred, _Whole], ids=['block-list', 'whole-network'])
@pytest.mark.parametrize('sample', [(0, 2), (-1, 2), np.zeros((0, 2)), (4, 0)])
def test_a_sample_without_rows_or_with_a_size_below_one_is_refused_in_one_line(build, sample):
    shape = tuple(getattr(sample, 'shape', sample))
    assert _refusal(build, sample) == ('sample: expected sizes of at least 1 in every axis (a '
                                       'batch of at least one row), found shape %s' % (shape,))


@pytest.mark.parametrize('build', [_deferred, _Whole], ids=['block-list', 'whole-network'])
@pytest.mark.parametrize('shape', [(10 ** 6, 10 ** 6), (10 ** 12, 1), (2 ** 31, 1)])
def test_a_sample_of_more_elements_than_mxnet_takes_is_refused_in_one_line(build, shape):
    assert _refusal(build, shape) == (
        'sample: expected at most 2147483647 elements per input (the most MXNet takes in one '
        'tensor in this build), found shape %s, %d elements' % (shape, np.prod(shape,
                                                                                  dtype=object)))


@pytest.mark.parametrize('shape, message', [
    ((0, 2), 'some stay unknown (a size of 0 is unknown to MXNet)'),
    ((2 ** 31, 2), '[_infer_shape_impl] Size of tensor you are trying to allocate is larger '
                   'than 2^31 elements. Please build with flag USE_INT64_TENSOR_SIZE=1'),
])
def test_infer_shape_from_a_shape_mxnet_cannot_take_is_refused_in_one_line(shape, message):
    pipe = Pipeline(_mlp(), 'cpu:0,cpu:1')
    with pytest.raises(ValueError) as err:
        pipe.infer_shape(shape)
    assert str(err.value) == ("sample: cannot infer the network's shapes from input shape "
                              "%s: %s" % (shape, message))


def _holding_itself():
    sample = [(4, 2)]
    sample.append(sample)
    return sample


def _nested(depth):
    sample = (4, 2)
    for _ in range(depth):
        sample = [sample]
    return sample


@pytest.mark.parametrize('sample, message', [
    (_holding_itself(), 'sample: expected batches in lists and tuples, found a list that holds '
                        'itself'),
    (_nested(3000), 'sample: expected lists and tuples nested at most 32 deep, found them '
                    'deeper'),
], ids=['holding-itself', 'nested-3000-deep'])
def test_a_sample_that_holds_itself_or_nests_thousands_deep_is_refused_in_one_line(sample,
                                                                                   message):
    assert _refusal(_deferred, sample) == message
    assert _refusal(_Whole, sample) == message


def test_inputs_that_hold_themselves_or_nest_thousands_deep_are_refused_in_one_line():
    pipe = Pipeline(_mlp(), 'cpu:0,cpu:1')
    pipe.initialize()
    for inputs, message in [(_holding_itself(), 'a list that holds itself'),
                            (_nested(3000), 'nested at most 32 deep, found them deeper')]:
        with pytest.raises(ValueError, match=r'^inputs: expected .*' + message + '$'):
            pipe(mx.nd.ones((4, 2)), inputs)


@pytest.mark.parametrize('build', [_mlp, lambda: _Whole(prefix='whole_')],
                         ids=['block-list', 'whole-network'])
def test_the_twin_before_initialize_is_refused_in_one_line_naming_initialize(build):
    pipe = Pipeline(build(), 'cpu:0,cpu:1', sample=(4, 2))
    with pytest.raises(RuntimeError) as err:
        pipe(mx.nd.ones((4, 2)))
    message = str(err.value)
    assert '\n' not in message
    count = len(pipe.collect_params().keys())
    assert message.startswith('parameters: expected them initialized before the twin runs (call '
                              'pipe.initialize(), or pipe.set_params(arg_params, aux_params) '
                              'with saved values), found %d of %d not initialized (%s, '
                              % (count, count, list(pipe.blocks[0].collect_params().keys())[0]))
    pipe.initialize()
    assert pipe(mx.nd.ones((4, 2))).shape[0] == 4


class _Twice(gluon.HybridBlock):
    """Two children given one prefix= outside the parent's name_scope()."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = gluon.nn.Dense(16, in_units=4, prefix='fc_')
        self.b = gluon.nn.Dense(4, in_units=16, prefix='fc_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.b(self.a(x))


@pytest.mark.parametrize('blocks, where', [
    (lambda: [gluon.nn.Dense(16, prefix='fc_'), gluon.nn.Dense(4, prefix='fc_')],
     'blocks[0] (Dense) and in blocks[1] (Dense)'),
    (lambda: _Twice(prefix='net_'), '_Twice.a (Dense) and in _Twice.b (Dense)'),
], ids=['block-list', 'whole-network'])
def test_two_parameters_of_one_name_are_refused_naming_the_parameter_and_both_blocks(
        blocks, where):
    """Gluon merged them (a list: ``Expected shape (4, 16) is incompatible
    with given shape (16, 0)`` at the first step) or asserted in its
    collect_params (a whole network)."""
    with pytest.raises(ValueError) as err:
        Pipeline(blocks(), 'cpu:0,cpu:1', sample=(8, 4))
    assert str(err.value).startswith(
        'blocks: expected each parameter name once, found fc_weight in %s: two parameters of '
        'one name' % where), str(err.value)
    assert '\n' not in str(err.value)


def test_a_parameter_shared_across_stages_lives_on_the_first_stage_that_reads_it():
    shared = nn.Dense(4, in_units=4, prefix='tied_')
    second = nn.Dense(4, in_units=4, params=shared.collect_params(), prefix='tied2_')
    pipe = Pipeline([shared, second], 'cpu:0,cpu:1')
    assert pipe.tied == {'tied_weight': (0, [0, 1]), 'tied_bias': (0, [0, 1])}
    with pytest.raises(ValueError, match='tied: expected a stage index below 2 for tied_bias'):
        Pipeline([shared, second], 'cpu:0,cpu:1', tied={'tied_bias': 2})


def test_mxnet_fit_with_ndarrayiter_trains_a_pipeline_module(tmp_path):
    """The framework's own loop: fit, score, predict, save_checkpoint, and
    MXNet's load_checkpoint on the result."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(512, 2)).astype(np.float32)
    y = (X[:, 0] * X[:, 1] > 0).astype(np.float32)  # XOR-like: needs the hidden layers
    pipe = Pipeline(_mlp((2, 16, 16, 16, 2)), 'cpu:0,cpu:1')
    mod = pipe.module(loss='softmax')
    train_iter = mx.io.NDArrayIter(X, y, batch_size=32, shuffle=False)
    mx.random.seed(0)
    mod.fit(train_iter, eval_data=train_iter, optimizer='sgd', num_epoch=25,
            optimizer_params={'learning_rate': 0.2, 'momentum': 0.9},
            initializer=mx.init.Xavier())
    (_, accuracy), = mod.score(train_iter, 'acc')
    assert accuracy > 0.9
    probabilities = mod.predict(train_iter).asnumpy()
    assert probabilities.shape == (512, 2)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1, rtol=1e-5)
    executor = mod.executors[0]
    assert executor.arg_dict['fc0_weight'].context == mx.cpu(0)
    assert executor.arg_dict['fc3_weight'].context == mx.cpu(1)
    mod.save_checkpoint(str(tmp_path / 'mlp'), 25)
    symbol, arg_params, _ = mx.model.load_checkpoint(str(tmp_path / 'mlp'), 25)
    assert symbol.attr_dict()['data']['__shape__'] == '(0, 2)'
    assert symbol.attr_dict()['fc3_weight']['__ctx_group__'] == 'stage1'
    assert set(arg_params) == {p.name for p in pipe.collect_params().values()}


@pytest.mark.parametrize('devices, replicas', [('cpu:0,cpu:1', 1),
                                               ('cpu:0,cpu:1,cpu:2,cpu:3', 2)])
def test_the_module_keeps_no_host_copy_unless_asked_and_checkpoints_the_same_bytes(
        tmp_path, devices, replicas):
    """MXNet's Module holds a host copy of every parameter on cpu(0); a
    Pipeline's holds none unless made with ``host_copy=True``, and fit (its
    epoch callback included), get_params and every checkpoint give the same
    values and bytes either way (with replicas, fit's kvstore starts from a
    copy made for it)."""
    pipe = Pipeline(bn_mlp(), devices, replicas=replicas)
    assert_host_copy_changes_no_value_or_byte(pipe, tmp_path)


def test_init_params_set_params_and_a_rebind_give_what_the_host_copy_gives():
    """Given values, an initializer for the rest (BatchNorm's statistics by
    their names), set_params, a rebind that fails and one at another batch
    size: the same values with and without the host copy (the failed rebind
    loses none), and none kept without."""
    pipe = Pipeline(digits.build_blocks(), 'cpu:0,cpu:1')
    rng = np.random.default_rng(0)
    values = {n: mx.nd.array(rng.normal(size=s)) for n, s in
              pipe.infer_shape((1, 1, 8, 8)).items() if 'weight' in n}
    seen = {}
    for host_copy in (False, True):
        mod = pipe.module(host_copy=host_copy)
        mod.bind(data_shapes=[('data', (8, 1, 8, 8))], label_shapes=[('softmax_label', (8,))])
        assert (mod.host_params == (None, None)) != host_copy  # none made to initialise from
        mx.random.seed(0)
        mod.init_params(mx.init.Uniform(0.5), arg_params=values, allow_missing=True)
        arg_params, aux_params = mod.get_params()
        initial = {n: a.asnumpy() for n, a in dict(arg_params, **aux_params).items()}
        mod.set_params({n: -a for n, a in arg_params.items()}, aux_params)
        with pytest.raises(RuntimeError, match='Shape inconsistent'):  # 3 channels, not 1
            mod.bind(data_shapes=[('data', (8, 3, 8, 8))],
                     label_shapes=[('softmax_label', (8,))], force_rebind=True)
        mod.bind(data_shapes=[('data', (4, 1, 8, 8))], label_shapes=[('softmax_label', (4,))],
                 force_rebind=True)
        assert (mod.host_params == (None, None)) != host_copy
        assert_host_params_are_the_devices(mod)
        seen[host_copy] = initial, {n: a.asnumpy() for n, a in mod.get_params()[0].items()}
    (initial, rebound), (initial_kept, rebound_kept) = seen[False], seen[True]
    assert sorted(initial) == sorted(initial_kept) and sorted(rebound) == sorted(rebound_kept)
    for name, value in initial.items():
        np.testing.assert_array_equal(value, initial_kept[name], name)
        if name in values:
            np.testing.assert_array_equal(value, values[name].asnumpy(), name)
    for name, value in rebound.items():
        np.testing.assert_array_equal(value, -initial[name], name)
        np.testing.assert_array_equal(value, rebound_kept[name], name)


def test_module_refuses_a_batch_the_chunks_do_not_divide():
    mod = Pipeline(_mlp(), 'cpu:0,cpu:1', chunks=3).module(loss='l2')
    with pytest.raises(ValueError, match=r'multiple of chunks x replicas \(3 x 1 = 3\), found 32'):
        mod.bind(data_shapes=[('data', (32, 2))], label_shapes=[('softmax_label', (32, 1))])


def test_module_refuses_replicas_without_a_kvstore():
    mod = Pipeline(_mlp(), 'cpu:0,cpu:1,cpu:2,cpu:3', replicas=2).module(loss='l2')
    mod.bind(data_shapes=[('data', (8, 2))], label_shapes=[('softmax_label', (8, 1))])
    mod.init_params()
    with pytest.raises(ValueError, match='found None .each replica would train on its own'):
        mod.init_optimizer(kvstore=None)


def _step(symbol, group2ctx, params, X, y):
    """Forward and backward of ``symbol`` bound as the library binds it;
    ``(output, {name: gradient})`` as numpy."""
    with split_bind(group2ctx):
        exe = symbol.simple_bind(mx.cpu(0), group2ctx=group2ctx, data=X.shape,
                                 softmax_label=y.shape)
    for name, value in params.items():
        (exe.arg_dict[name] if name in exe.arg_dict else exe.aux_dict[name])[:] = value
    exe.arg_dict['data'][:] = X
    exe.arg_dict['softmax_label'][:] = y
    exe.forward(is_train=True)
    exe.backward()
    return exe.outputs[0].asnumpy(), {n: g.asnumpy() for n, g in exe.grad_dict.items()
                                      if n not in ('data', 'softmax_label')}


def test_batchnorm_with_micro_batches_under_onednn_equals_one_chunk_per_micro_batch():
    """BatchNorm with chunks=2, oneDNN on, cut where MXNet's copy used to fail
    (bn1 ends stage 0): each micro-batch's output is the chunks=1 graph's on
    that micro-batch alone (statistics per micro-batch, as in GPipe), and the
    gradients are their sum."""
    if not compat.onednn_active():
        pytest.skip('oneDNN is off in this process or this build')
    pipe = Pipeline(digits.build_blocks(), 'cpu:0,cpu:1', balance=[6, 5], chunks=2)
    rng = np.random.default_rng(0)
    params = {name: rng.uniform(-0.3, 0.3, shape) for name, shape in
              pipe.infer_shape((1, 1, 8, 8)).items() if name != 'data'}
    X = rng.uniform(0, 1, (64, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 64).astype(np.float32)
    group2ctx = pipe.plan.group2ctx
    output, grads = _step(pipe.training_symbol('softmax'), group2ctx, params, X, y)
    one_chunk = pipe.training_symbol('softmax', chunks=1)
    halves = [_step(one_chunk, group2ctx, params, X[i:i + 32], y[i:i + 32]) for i in (0, 32)]
    np.testing.assert_allclose(output, np.concatenate([h[0] for h in halves]), rtol=1e-4,
                               atol=1e-6)
    assert set(grads) == {p.name for p in pipe.collect_params().values()} - {
        n for n in params if 'running' in n}
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, halves[0][1][name] + halves[1][1][name], rtol=1e-4,
                                   atol=1e-5, err_msg=name)
        assert np.abs(grad).max() > 0, name


def test_module_rebinds_a_batch_of_another_shape_as_it_binds():
    """Module.forward reshapes (binds anew) on a batch of another size; that
    bind gets the same workaround, or the cut after bn1 fails as in MXNet."""
    if not compat.onednn_active():
        pytest.skip('oneDNN is off in this process or this build')
    mod = Pipeline(digits.build_blocks(), 'cpu:0,cpu:1', balance=[6, 5], chunks=2).module()
    mod.bind(data_shapes=[('data', (64, 1, 8, 8))], label_shapes=[('softmax_label', (64,))])
    mod.init_params(initializer=mx.init.Uniform(0.3))
    mod.init_optimizer(kvstore=None, optimizer='sgd', optimizer_params={'learning_rate': 0.1})
    rng = np.random.default_rng(0)
    for batch_size in (64, 32, 32):
        mod.forward_backward(mx.io.DataBatch(
            [mx.nd.array(rng.uniform(0, 1, (batch_size, 1, 8, 8)))],
            [mx.nd.array(rng.integers(0, 10, batch_size))]))
        mod.update()
        assert mod.get_outputs()[0].shape == (batch_size, 10)
        assert np.isfinite(mod.get_outputs()[0].asnumpy()).all()


def test_module_bound_to_train_predicts_and_scores_batches_of_other_sizes():
    """After a training bind at 8: predict (no labels) at 4 and 5 (which
    the two chunks do not divide) and score at 6 give what the same
    parameters give on one device."""
    rng = np.random.default_rng(1)
    X = rng.uniform(0, 1, (12, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 12).astype(np.float32)
    mods = []
    for devices, chunks in (('cpu:0', 1), ('cpu:0,cpu:1', 2)):
        mod = Pipeline(digits.build_blocks(), devices, sample=(8, 1, 8, 8),
                       chunks=chunks).module(loss='softmax')
        mod.bind([('data', (8, 1, 8, 8))], [('softmax_label', (8,))])
        if mods:
            mod.set_params(*mods[0].get_params())
        else:
            mod.init_params(mx.init.Xavier())
        mods.append(mod)
    one, split = mods
    predicted = [m.predict(mx.io.NDArrayIter(X, batch_size=4)).asnumpy() for m in mods]
    assert predicted[1].shape == (12, 10)
    np.testing.assert_allclose(predicted[1], predicted[0], rtol=1e-5, atol=1e-6)
    scores = [dict(m.score(mx.io.NDArrayIter(X, y, batch_size=6), 'ce')) for m in mods]
    assert abs(scores[1]['cross-entropy'] - scores[0]['cross-entropy']) < 1e-5
    uneven = [m.predict(mx.io.NDArrayIter(X, batch_size=5, last_batch_handle='pad')).asnumpy()
              for m in (one, split)]
    assert uneven[1].shape == (12, 10)
    np.testing.assert_allclose(uneven[1], uneven[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_an_inference_batch_the_micro_batches_do_not_divide_runs_whole_on_each_replica(
        schedule):
    """Bound to train at 8 in 2 chunks over 2 replicas, a forward of 6 or
    2 examples (not of 2 x 2 parts) gives on GPipe's fused graph what it
    gives on the stage runtime and what the bound size gives for the same
    examples; one the replicas do not divide is refused in one line."""
    rng = np.random.default_rng(2)
    X = rng.uniform(0, 1, (8, 1, 8, 8)).astype(np.float32)
    found = {}
    for name in ('1f1b', schedule):
        mx.random.seed(3)
        mod = Pipeline(digits.build_blocks(), 'cpu:0,cpu:1,cpu:2,cpu:3', sample=(8, 1, 8, 8),
                       chunks=2, replicas=2, schedule=name).module(loss='softmax')
        mod.bind([('data', (8, 1, 8, 8))], [('softmax_label', (8,))])
        mod.init_params(mx.init.Xavier())
        outputs = []
        for size in (8, 6, 2):
            mod.forward(mx.io.DataBatch([mx.nd.array(X[:size])]), is_train=False)
            outputs.append(mod.get_outputs()[0].asnumpy())
        with pytest.raises(ValueError, match=r'^batch size: expected a multiple of the replicas '
                                             r'\(2\) to predict, found 5$'):
            mod.forward(mx.io.DataBatch([mx.nd.array(X[:5])]), is_train=False)
        found[name] = outputs
    whole, six, two = found[schedule]
    assert six.shape == (6, 10) and two.shape == (2, 10)
    np.testing.assert_allclose(six, whole[:6], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two, whole[:2], rtol=1e-5, atol=1e-6)
    for ours, staged in zip(found[schedule], found['1f1b']):
        np.testing.assert_allclose(ours, staged, rtol=1e-5, atol=1e-6)


def test_imperative_twin_places_and_moves_parameters():
    blocks = _mlp()
    for block in blocks:
        block.initialize(ctx=mx.cpu(0))
    before = blocks[3].weight.data().asnumpy()
    pipe = Pipeline(blocks, 'cpu:0,cpu:1', balance=[2, 2])
    pipe.initialize()
    assert blocks[0].weight.list_ctx() == [mx.cpu(0)]
    assert blocks[3].weight.list_ctx() == [mx.cpu(1)]
    np.testing.assert_array_equal(blocks[3].weight.data().asnumpy(), before)  # moved, kept
    out = pipe(mx.nd.ones((4, 2), ctx=mx.cpu(0)))
    assert out.context == mx.cpu(1) and out.shape == (4, 1)
    with pytest.raises(ValueError, match='ctx: expected None'):
        pipe.initialize(ctx=mx.cpu(0))


def test_set_params_and_get_params_round_trip():
    pipe = Pipeline(digits.build_blocks(), THREE_DEVICES)
    sym = pipe.symbol()
    values = {n: np.full(s, i, dtype=np.float32) for i, (n, s) in enumerate(zip(
        sym.list_arguments()[1:], sym.infer_shape(data=(1, 1, 8, 8))[0][1:]))}
    aux = {n: np.ones(s, dtype=np.float32) for n, s in zip(
        sym.list_auxiliary_states(), sym.infer_shape(data=(1, 1, 8, 8))[2])}
    pipe.set_params(values, aux)
    assert pipe.blocks[-1].weight.list_ctx() == [mx.cpu(2)]
    arg_params, aux_params = pipe.get_params()
    assert set(aux_params) == set(aux) and set(arg_params) == set(values)
    for name, value in values.items():
        np.testing.assert_array_equal(arg_params[name].asnumpy(), value)
    with pytest.raises(ValueError, match='expected shape'):
        pipe.set_params(dict(values, dense1_bias=np.zeros(3)), aux)


def test_calling_the_pipeline_on_a_symbol_gives_its_tagged_graph():
    """``pipe(symbol)``: a plain variable gives ``pipe.symbol()``; ops of the
    caller's on the input run in the first stage; the bound graph computes
    what the imperative twin does."""
    pipe = Pipeline(_mlp(), 'cpu:0,cpu:1')
    pipe.initialize(mx.init.Xavier())
    assert pipe(mx.sym.var('data')).tojson() == pipe.symbol().tojson()
    x = mx.sym.var('x')
    symbol = pipe(mx.sym.elemwise_add(x, x, name='double'))  # 2x, bit for bit
    groups = _groups(symbol)
    assert groups['x'] == groups['double'] == 'stage0'
    X = np.random.default_rng(0).uniform(-1, 1, (4, 2)).astype(np.float32)
    args = {n: p.data(pipe.plan.group2ctx[groups[n]]) for n, p in pipe.collect_params().items()}
    args['x'] = mx.nd.array(X, ctx=mx.cpu(0))
    with split_bind(pipe.plan.group2ctx):
        exe = symbol.bind(mx.cpu(0), args, group2ctx=pipe.plan.group2ctx)
    got = exe.forward()[0].asnumpy()
    want = pipe(mx.nd.array(X * 2, ctx=mx.cpu(0))).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with mx.AttrScope(ctx_group='gpu_side'):
        foreign = mx.sym.relu(mx.sym.var('x'))
    with pytest.raises(ValueError, match=r"of the Pipeline's \(stage0, stage1\), found 'x' in "
                                         r"'gpu_side'"):
        pipe(foreign)


def test_the_placement_is_one_frozen_value_that_graph_and_twin_take():
    """Planning makes one value; the graph builder and the twin read it, and
    no private member of the Pipeline."""
    import dataclasses  # pylint: disable=import-outside-toplevel
    import pathlib  # pylint: disable=import-outside-toplevel
    import re  # pylint: disable=import-outside-toplevel
    pipe = Pipeline(_mlp(), 'cpu:0,cpu:1')
    with pytest.raises(dataclasses.FrozenInstanceError):
        pipe.placement.owner = {}
    assert pipe.plan is pipe.placement.plan and pipe.stages == pipe.placement.stages
    core = pathlib.Path(__file__).resolve().parent.parent / 'mp_symbolic' / 'core'
    for name in ('graph/build.py', 'engine/twin.py'):
        code = (core / name).read_text()
        assert not re.search(r'\b(pipe|pipeline)\._', code), name
