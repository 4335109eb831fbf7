"""Schedules on the stage runtime: ``Pipeline(..., schedule='1f1b')`` trains
as the one GPipe graph does (stages x micro-batches, tied weights, a whole
network's cut, tensor-parallel shards, replicas, BatchNorm), through MXNet's
own fit, score, predict and save_checkpoint, and refuses in one line what it
cannot run."""
import itertools
import threading
import time

import mxnet as mx
from mxnet import gluon
import numpy as np
import pytest

import mp_symbolic
from mp_symbolic import Pipeline
from mp_symbolic.core.engine.module import PipelineModule
from mp_symbolic.core.graph.passes import cut
from mp_symbolic.core.engine.runtime import ArrayGroup
from mp_symbolic.core.engine.staged_module import StagedModule
from mp_symbolic.training import loop
from mp_symbolic.training.tasks import digits, gpt, lm

from conftest import assert_host_copy_changes_no_value_or_byte, bert_batch, bn_mlp, small_bert

TINY = gpt.GPTConfig(vocab_size=23, block_size=12, num_layers=2, num_heads=2, num_hiddens=8)
BATCH = 8
TOL = 1e-5


def _lm(whole=False, shards=1):
    build = gpt.build_network if whole else gpt.build_blocks
    return build(TINY, lm.sharded_layers(shards)), (BATCH, TINY.block_size)


def _digits():
    return digits.build_blocks(), (BATCH, 1, 8, 8)


class _Skip(gluon.HybridBlock):
    """Stage 0's output read by stages 1 and 2 (a skip over stage 1)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.fc0 = gluon.nn.Dense(8, in_units=4, activation='relu', prefix='fc0_')
            self.fc1 = gluon.nn.Dense(8, in_units=8, activation='relu', prefix='fc1_')
            self.fc2 = gluon.nn.Dense(10, in_units=8, prefix='fc2_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        h = self.fc0(x)
        return self.fc2(self.fc1(h) + h)


def _skip():
    return _Skip(prefix='skip_'), (BATCH, 1, 4), [2, 2, 2]  # ops per stage


def _batch(sample, step, classes):
    rng = np.random.default_rng(step)
    if len(sample) == 2:  # token ids and their next-token labels
        X = rng.integers(0, TINY.vocab_size, sample)
        y = rng.integers(0, TINY.vocab_size, sample)
    else:
        X, y = rng.normal(size=sample), rng.integers(0, classes, sample[0])
    return mx.io.DataBatch([mx.nd.array(X.astype(np.float32))],
                           [mx.nd.array(y.astype(np.float32))])


def _runtime_kind(pipe, make):
    """The class name of the runtime ``pipe``'s Module runs a batch of ``make``'s on."""
    _, sample, *_ = make()
    mod = pipe.module(loss='softmax')
    mod.bind([('data', sample)], [('softmax_label', _batch(sample, 0, 10).label[0].shape)])
    return type(mod.runtimes[0]).__name__


def _train(make, devices, chunks, schedule, replicas=1, steps=3, virtual=None):
    """The last step's output and the parameters after ``steps`` SGD steps
    (momentum 0.9) from the blocks' seeded initial values."""
    net, sample, *balance = make()
    pipe = Pipeline(net, devices, balance=(balance or [None])[0], sample=sample, chunks=chunks,
                    replicas=replicas, schedule=schedule, virtual=virtual)
    arg_params, aux_params = loop.initial_values(pipe, seed=0)
    mod = pipe.module(loss='softmax')
    batch = _batch(sample, 0, 10)
    mod.bind(data_shapes=[('data', sample)], label_shapes=[('softmax_label',
                                                            batch.label[0].shape)])
    mod.init_params(arg_params={k: mx.nd.array(v) for k, v in arg_params.items()},
                    aux_params={k: mx.nd.array(v) for k, v in aux_params.items()},
                    allow_missing=False)
    mod.init_optimizer(kvstore='local' if replicas > 1 else None, optimizer='sgd',
                       optimizer_params={'learning_rate': 0.5, 'momentum': 0.9})
    for step in range(steps):
        mod.forward_backward(_batch(sample, step, 10))
        mod.update()
    out = mod.get_outputs()[0].asnumpy()
    arg_params, aux_params = mod.get_params()
    return pipe, out, {k: v.asnumpy() for k, v in dict(arg_params, **aux_params).items()}


# (network, devices, micro-batches, replicas): the language model over 2 and 3
# stages (its token embedding tied to its output layer across stages), its
# whole graph cut, tensor-parallel shards in a stage, replicas, BatchNorm, an
# activation read by two later stages (their gradients summed).
TABLE = [(_lm, 'cpu:0,cpu:1', m, 1) for m in (1, 2, 4)] + \
    [(_lm, 'cpu:0,cpu:1,cpu:2', m, 1) for m in (1, 2, 4)] + [
        (lambda: _lm(whole=True), 'cpu:0,cpu:1,cpu:2', 4, 1),
        (lambda: _lm(shards=2), 'cpu:0+cpu:1,cpu:2', 2, 1),
        # shards in a stage that receives: its shards read the received activation
        (lambda: _lm(shards=2), 'cpu:0+cpu:1,cpu:2+cpu:3', 1, 1),
        (lambda: _lm(shards=2), 'cpu:0+cpu:1,cpu:2+cpu:3', 4, 1),
        (lambda: _lm(whole=True, shards=2), 'cpu:0+cpu:1,cpu:2+cpu:3', 2, 1),
        (lambda: _lm(shards=2), 'cpu:0+cpu:1,cpu:2+cpu:3,cpu:4+cpu:5,cpu:6+cpu:7', 2, 2),
        (_lm, 'cpu:0,cpu:1,cpu:2,cpu:3', 2, 2),
        (_digits, 'cpu:0,cpu:1,cpu:2', 4, 1),
        (_skip, 'cpu:0,cpu:1,cpu:2', 2, 1),
    ]


@pytest.mark.parametrize('make, devices, chunks, replicas', TABLE)
def test_1f1b_equals_the_gpipe_graph_after_three_steps(make, devices, chunks, replicas):
    _, expected_out, expected = _train(make, devices, chunks, 'gpipe', replicas)
    pipe, out, params = _train(make, devices, chunks, '1f1b', replicas)
    assert _runtime_kind(pipe, make) == 'StageRuntime'
    np.testing.assert_allclose(out, expected_out, rtol=TOL, atol=TOL)
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():  # BatchNorm's running statistics too
        np.testing.assert_allclose(params[name], value, rtol=TOL, atol=TOL, err_msg=name)


def test_interleaved_with_shards_in_every_stage_equals_the_gpipe_graph():
    _, expected_out, expected = _train(lambda: _lm(shards=2), 'cpu:0+cpu:1,cpu:2+cpu:3', 2,
                                       'gpipe')
    _, out, params = _train(lambda: _lm(shards=2), 'cpu:0+cpu:1,cpu:2+cpu:3', 2, 'interleaved',
                            virtual=1)
    np.testing.assert_allclose(out, expected_out, rtol=TOL, atol=TOL)
    for name, value in expected.items():
        np.testing.assert_allclose(params[name], value, rtol=TOL, atol=TOL, err_msg=name)


def test_the_stage_graphs_pass_the_tied_embedding_from_its_owner_to_the_output_stage():
    net, sample = _lm()
    pipe = Pipeline(net, 'cpu:0,cpu:1,cpu:2', sample=sample)
    symbol = pipe.training_symbol('softmax')
    stages = cut(pipe.training_graph('softmax'), 3)
    assert stages[0].inputs == ('data',) and stages[2].inputs == ('softmax_label',)
    assert [t for _, t, _ in stages[1].receives] == [0]
    # the last stage reads the previous stage's activations and the tied weight's identity
    assert sorted(t for _, t, _ in stages[2].receives) == [0, 1]
    assert any(name.startswith('embed_token_weight_tied') for name, _, _ in stages[2].receives)
    assert not stages[0].heads and stages[2].heads == ((0, 0),) and not stages[2].sends
    params = set(symbol.list_arguments()) - {'data', 'softmax_label'}
    owned = [set(g.symbol.list_arguments()) & params for g in stages]
    assert set.union(*owned) == params and sum(map(len, owned)) == len(params)


def _bert_steps(schedule, steps=3):
    """The outputs of the last step and the parameters after ``steps`` SGD
    steps of a loss on GluonNLP's BERT's classifier, over two devices in two
    micro-batches, from :func:`small_bert`'s values (a new batch each step,
    its valid lengths from 1 to the sequence's)."""
    start = {n: p.data() for n, p in small_bert().collect_params().items()}
    pipe = Pipeline(small_bert(start), 'cpu:0,cpu:1', sample=tuple(bert_batch()), chunks=2,
                    schedule=schedule)
    mod = pipe.module(loss='softmax', output=2)
    xs = bert_batch()
    mod.bind(data_shapes=[(n, x.shape) for n, x in zip(pipe.input_names, xs)],
             label_shapes=[('softmax_label', (len(xs[0]),))])
    mod.init_params(arg_params=start, aux_params={}, allow_missing=False)
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 0.5})
    rng = np.random.default_rng(1)
    for _ in range(steps):
        tokens, types = rng.integers(0, 50, xs[0].shape), rng.integers(0, 2, xs[1].shape)
        lengths = rng.integers(1, xs[0].shape[1] + 1, len(xs[0]))
        label = rng.integers(0, 2, len(xs[0]))
        mod.forward_backward(mx.io.DataBatch(
            [mx.nd.array(a.astype(np.float32)) for a in (tokens, types, lengths)],
            [mx.nd.array(label.astype(np.float32))]))
        mod.update()
    arg_params, _ = mod.get_params()
    return ([o.asnumpy() for o in mod.get_outputs()],
            {n: v.asnumpy() for n, v in arg_params.items()})


def test_bert_under_1f1b_equals_the_gpipe_graph_after_three_steps():
    """GluonNLP's BERT: the second stage's attention reads the lengths the
    first stage computes (softmax with ``use_length``), a received tensor
    whose gradient the stage runtime asks for (compat.lengths_outside_gradient)."""
    expected_out, expected = _bert_steps('gpipe')
    out, params = _bert_steps('1f1b')
    for ours, theirs in zip(out, expected_out):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_fit_score_predict_and_save_checkpoint_work_under_1f1b(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 4)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.float32)
    nn = gluon.nn
    blocks = [nn.Dense(16, in_units=4, activation='relu'), nn.Dense(16, in_units=16,
                                                                    activation='relu'),
              nn.Dense(2, in_units=16)]
    pipe = Pipeline(blocks, 'cpu:0,cpu:1,cpu:2', chunks=4, schedule='1f1b')
    mod = pipe.module(loss='softmax')
    mx.random.seed(0)
    train = mx.io.NDArrayIter(X, y, batch_size=16)
    mod.fit(train, num_epoch=8, optimizer='sgd', initializer=mx.init.Xavier(),
            optimizer_params={'learning_rate': 0.2, 'momentum': 0.9})
    accuracy = dict(mod.score(mx.io.NDArrayIter(X, y, batch_size=16), 'acc'))['accuracy']
    assert accuracy > 0.9
    probabilities = mod.predict(mx.io.NDArrayIter(X, batch_size=16)).asnumpy()
    assert probabilities.shape == (64, 2)
    assert np.mean(probabilities.argmax(axis=1) == y) == pytest.approx(accuracy)
    # the same weights in the one-graph module predict the same
    arg_params, aux_params = mod.get_params()
    other = Pipeline(blocks, 'cpu:0,cpu:1,cpu:2', chunks=4).module(loss='softmax')
    other.bind([('data', (16, 4))], [('softmax_label', (16,))], for_training=False)
    other.init_params(arg_params=arg_params, aux_params=aux_params)
    np.testing.assert_allclose(other.predict(mx.io.NDArrayIter(X, batch_size=16)).asnumpy(),
                               probabilities, rtol=1e-5, atol=1e-6)
    mp_symbolic.save_checkpoint(mod, str(tmp_path / 'run'), epoch=8)
    _, saved, _ = mp_symbolic.read_checkpoint(str(tmp_path / 'run')).load()
    assert sorted(saved) == sorted(arg_params)
    for name, value in saved.items():
        np.testing.assert_array_equal(value.asnumpy(), arg_params[name].asnumpy())


@pytest.mark.parametrize('schedule, virtual', [('1f1b', None), ('interleaved', 2)])
def test_the_stage_runtime_keeps_no_host_copy_unless_asked_and_checkpoints_the_same_bytes(
        tmp_path, schedule, virtual):
    """As the one-graph Module (tests/test_pipeline.py): no host copy of the
    parameters unless ``host_copy=True``, and the same values and bytes from
    fit's epoch callback, get_params and every checkpoint either way."""
    pipe = Pipeline(bn_mlp(), 'cpu:0,cpu:1', chunks=2, schedule=schedule, virtual=virtual)
    assert_host_copy_changes_no_value_or_byte(pipe, tmp_path)


def test_an_unknown_schedule_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^schedule: expected one of 'gpipe', '1f1b', "
                                         r"'interleaved' or a function \(num_stages, "
                                         r"microbatches\) -> one list of actions per device, "
                                         r"found 'zero-bubble'$"):
        Pipeline(_lm()[0], 'cpu:0,cpu:1', schedule='zero-bubble')


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_what_neither_runtime_can_do_is_refused_in_one_line(schedule):
    net, sample = _lm()
    pipe = Pipeline(net, 'cpu:0,cpu:1', chunks=2, sample=sample, schedule=schedule)
    mod = pipe.module(loss='softmax')
    with pytest.raises(ValueError, match=r'^batch size: expected a multiple of chunks x '
                                         r'replicas \(2 x 1 = 2\), found 7$'):
        mod.bind([('data', (7, TINY.block_size))], [('softmax_label', (7, TINY.block_size))])
    mod.bind([('data', sample)], [('softmax_label', sample)])
    mod.init_params(mx.init.Xavier())
    with pytest.raises(RuntimeError, match=r'^backward: expected forward\(is_train=True\) '
                                           r'first'):
        mod.backward()
    with pytest.raises(ValueError, match=r'^batch size: expected a multiple of chunks x '
                                         r'replicas \(2 x 1 = 2\), found 3$'):
        mod.forward(_batch((3, TINY.block_size), 0, 10), is_train=True)
    mod.forward(_batch(sample, 0, 10), is_train=True)
    with pytest.raises(ValueError, match=r"^out_grads: expected None under schedule='%s' "
                                         r"\(the loss head is in the graph\), found them given$"
                       % schedule):
        mod.backward(out_grads=[mx.nd.ones((BATCH, TINY.block_size, TINY.vocab_size))])


def _module_on(schedule, make, devices, chunks, replicas=1, **bind):
    """The Module of ``make``'s network under ``schedule``, bound with
    ``bind``'s arguments, at the blocks' seeded initial values, with SGD."""
    net, sample, *balance = make()
    pipe = Pipeline(net, devices, balance=(balance or [None])[0], sample=sample, chunks=chunks,
                    replicas=replicas, schedule=schedule)
    arg_params, aux_params = loop.initial_values(pipe, seed=0)
    mod = pipe.module(loss='softmax')
    label = _batch(sample, 0, 10).label[0].shape
    mod.bind([('data', sample)], [('softmax_label', label)], **bind)
    mod.init_params(arg_params={k: mx.nd.array(v) for k, v in arg_params.items()},
                    aux_params={k: mx.nd.array(v) for k, v in aux_params.items()})
    mod.init_optimizer(kvstore='local' if replicas > 1 else None, optimizer='sgd',
                       optimizer_params={'learning_rate': 0.1})
    return mod, sample


def _grads(mod):
    group = mod._exec_group  # pylint: disable=protected-access
    return {n: [g.asnumpy() for g in arrays] for n, arrays in
            zip(group.param_names, group.grad_arrays) if arrays[0] is not None}


@pytest.mark.parametrize('make, devices, chunks, replicas', [
    (_digits, 'cpu:0,cpu:1,cpu:2', 4, 1), (_digits, 'cpu:0,cpu:1', 2, 2),
    (_skip, 'cpu:0,cpu:1,cpu:2', 2, 1)])
def test_input_gradients_under_1f1b_are_the_gpipe_graphs(make, devices, chunks, replicas):
    found = {}
    for schedule in ('gpipe', '1f1b'):
        mod, sample = _module_on(schedule, make, devices, chunks, replicas,
                                 inputs_need_grad=True)
        mod.forward_backward(_batch(sample, 1, 10))
        merged = mod.get_input_grads()
        parts = mod.get_input_grads(merge_multi_context=False)
        assert [a.shape for a in merged] == [sample]
        assert [len(p) for p in parts] == [replicas]
        found[schedule] = merged[0].asnumpy()
    assert np.abs(found['gpipe']).max() > 0
    np.testing.assert_allclose(found['1f1b'], found['gpipe'], rtol=TOL, atol=1e-7)


def test_the_input_gradients_of_an_input_batched_on_axis_1_join_on_axis_1_under_1f1b():
    found = {}
    for schedule in ('gpipe', '1f1b'):
        net = gluon.nn.Dense(4, flatten=False, in_units=3, prefix='tnc_')
        pipe = Pipeline(net, 'cpu:0', sample=(5, 8, 3), chunks=2, schedule=schedule,
                        batch_axis=1)
        mod = pipe.module('softmax')
        mod.bind([('data', (5, 8, 3))], [('softmax_label', (5, 8))], inputs_need_grad=True)
        mx.random.seed(0)
        mod.init_params(mx.init.Xavier())
        rng = np.random.default_rng(0)
        mod.forward_backward(mx.io.DataBatch(
            [mx.nd.array(rng.normal(size=(5, 8, 3)))], [mx.nd.array(rng.integers(0, 4, (5, 8)))]))
        found[schedule] = mod.get_input_grads()[0].asnumpy()
    assert found['1f1b'].shape == (5, 8, 3)
    np.testing.assert_allclose(found['1f1b'], found['gpipe'], rtol=TOL, atol=1e-7)


def test_grad_req_add_sums_the_batches_gradients_under_1f1b_as_in_the_gpipe_graph():
    found = {}
    for schedule in ('gpipe', '1f1b'):
        mod, sample = _module_on(schedule, _digits, 'cpu:0,cpu:1,cpu:2', 2, grad_req='add')
        mod.forward_backward(_batch(sample, 1, 10))
        once = _grads(mod)
        mod.forward_backward(_batch(sample, 2, 10))
        found[schedule] = once, _grads(mod)
    for name, value in found['gpipe'][1].items():
        assert not np.allclose(value, found['gpipe'][0][name])  # the second batch added
        np.testing.assert_allclose(found['1f1b'][1][name][0], value[0], rtol=TOL, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_grad_req_null_leaves_no_gradient_and_no_update_on_either_runtime(schedule):
    mod, sample = _module_on(schedule, _digits, 'cpu:0,cpu:1,cpu:2', 2, grad_req='null')
    before = {k: v.asnumpy() for k, v in mod.get_params()[0].items()}
    mod.forward_backward(_batch(sample, 1, 10))
    mod.update()
    assert _grads(mod) == {}
    after = mod.get_params()[0]
    for name, value in before.items():
        np.testing.assert_array_equal(after[name].asnumpy(), value)
    assert mod.get_outputs()[0].shape == (BATCH, 10)


def test_input_gradients_asked_for_without_inputs_need_grad_are_refused_in_one_line():
    mod, sample = _module_on('1f1b', _digits, 'cpu:0,cpu:1,cpu:2', 2)
    mod.forward_backward(_batch(sample, 1, 10))
    with pytest.raises(ValueError, match=r'^get_input_grads: expected bind\(\.\.\., '
                                         r'inputs_need_grad=True\), found it bound without$'):
        mod.get_input_grads()


@pytest.mark.slow
def test_1f1b_activation_memory_per_device_is_flat_in_the_number_of_microbatches():
    from bench.schedules import measure, spec  # pylint: disable=import-outside-toplevel
    small = dict(vocab_size=32, block_size=32, num_layers=2, num_heads=2, num_hiddens=32)
    # the first step measured after the warm-up still counts some of MXNet's
    # once-per-process allocations: it is not compared
    _, few, many, gpipe = measure([spec('1f1b', 2, 2, 8, small), spec('1f1b', 2, 2, 8, small),
                                   spec('1f1b', 2, 8, 8, small), spec('gpipe', 2, 8, 8, small)],
                                  warmup=True)
    assert sorted(few) == sorted(many) == sorted(gpipe) == ['cpu(0)', 'cpu(1)']
    for device in few:
        assert 0 < many[device] <= 1.25 * few[device], (device, few, many)
        assert gpipe[device] >= 2 * many[device], (device, many, gpipe)


@pytest.mark.parametrize('schedule, virtual', [('1f1b', None), ('interleaved', None),
                                               ('interleaved', 2)])
def test_the_training_loops_module_stepper_under_1f1b_gives_gpipes_losses_and_parameters(
        small_data, schedule, virtual):
    """``--schedule 1f1b`` (and ``interleaved``, ``--virtual`` given or not)
    through the command line's stepper: the losses it reports (read from the
    stage runtime's outputs) and the parameters after six steps are GPipe's,
    with replicas too."""
    from conftest import load_config  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.loop import build_pipeline, make_stepper  # pylint: disable=C0415
    X, y = small_data[0], small_data[1]
    runs = {}
    for name, given in (('gpipe', None), (schedule, virtual)):
        # four blocks: two stages on each of a replica's two devices under interleaved
        task, cfg = load_config(task='regression', devices='cpu:0,cpu:1,cpu:2,cpu:3',
                                chunks=2, replicas=2, schedule=name, virtual=given,
                                progress=False, num_examples=len(X), widths=(2, 4, 4, 4, 1),
                                batch_size=40, momentum=0.9, lr=0.01)
        pipe, _ = build_pipeline(cfg, task)
        assert pipe.plan.num_stages == (4 if name == 'interleaved' else 2)
        stepper = make_stepper(cfg, pipe, task, loop.initial_values(pipe, cfg.seed), y.shape[1:])
        losses = [stepper.step(*batch).asscalar()
                  for _, batch in zip(range(6), stepper.batches(X, y, 0))]
        runs[name] = losses, stepper.params(), stepper.predict(X[:40])
    (losses, params, predicted), (ref_losses, ref_params, ref_predicted) = \
        runs[schedule], runs['gpipe']
    assert ref_losses[-1] < ref_losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=1e-6)
    np.testing.assert_allclose(predicted, ref_predicted, rtol=TOL, atol=1e-6)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=TOL, atol=1e-6, err_msg=name)


@pytest.mark.parametrize('schedule, virtual', [('1f1b', None), ('interleaved', None)])
def test_the_executor_api_runs_every_schedule_and_gives_gpipes_losses_and_parameters(
        small_data, schedule, virtual):
    """``--api executor`` drives the runtime its schedule runs on (GPipe's
    one graph, or the stage runtime): the losses, parameters and
    predictions after six steps are GPipe's."""
    from conftest import load_config  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.loop import build_pipeline, make_stepper  # pylint: disable=C0415
    X, y = small_data[0], small_data[1]
    runs = {}
    for name, given in (('gpipe', None), (schedule, virtual)):
        task, cfg = load_config(task='regression', devices='cpu:0,cpu:1', api='executor',
                                chunks=2, schedule=name, virtual=given, progress=False,
                                num_examples=len(X), widths=(2, 4, 4, 4, 1), batch_size=40,
                                momentum=0.9, lr=0.01)
        pipe, _ = build_pipeline(cfg, task)
        stepper = make_stepper(cfg, pipe, task, loop.initial_values(pipe, cfg.seed), y.shape[1:])
        losses = [stepper.step(*batch).asscalar()
                  for _, batch in zip(range(6), stepper.batches(X, y, 0))]
        runs[name] = losses, stepper.params(), stepper.predict(X[:40]), stepper.grads()
    (losses, params, predicted, grads), (ref_losses, ref_params, ref_predicted, ref_grads) = \
        runs[schedule], runs['gpipe']
    assert ref_losses[-1] < ref_losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=1e-6)
    np.testing.assert_allclose(predicted, ref_predicted, rtol=TOL, atol=1e-6)
    assert sorted(params) == sorted(ref_params) and sorted(grads) == sorted(ref_grads)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=TOL, atol=1e-6, err_msg=name)


@pytest.mark.parametrize('fields, message', [
    (dict(schedule='zb'), r"^schedule: expected gpipe or 1f1b or interleaved, found 'zb'$"),
    (dict(schedule='1f1b', virtual=2),
     r"^virtual: expected None with schedule='1f1b' \(virtual stages are the 'interleaved' "
     r"schedule's\), found 2$"),
    (dict(schedule='interleaved', virtual=0), r"^virtual: expected a positive integer, found 0$"),
    (dict(schedule='1f1b', variant='imperative'),
     r"^schedule: expected 'gpipe' \(the default\) with variant 'imperative'"),
])
def test_a_schedule_the_run_cannot_use_is_refused_in_one_line(fields, message):
    from mp_symbolic.training.config import TrainConfig  # pylint: disable=import-outside-toplevel
    with pytest.raises(ValueError, match=message):
        TrainConfig(task='regression', batch_size=8, num_epochs=1, optimizer='sgd', lr=0.1,
                    momentum=0.0, **fields)


def test_the_run_refuses_virtual_stages_with_the_schedule_records_own_message():
    """The task file's ``virtual`` and ``Pipeline(virtual=...)`` are one check
    (``schedule.check_spec``): one message each."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.schedule import check_spec
    from mp_symbolic.training.config import TrainConfig
    for schedule, virtual in (('1f1b', 2), ('gpipe', 1), ('interleaved', 0),
                              ('interleaved', True), ('interleaved', 1.5)):
        with pytest.raises(ValueError) as record:
            check_spec(schedule, virtual)
        with pytest.raises(ValueError) as run:
            TrainConfig(task='regression', batch_size=8, num_epochs=1, schedule=schedule,
                        virtual=virtual)
        assert str(run.value) == str(record.value), (schedule, virtual)


@pytest.mark.slow
def test_virtual_stages_the_run_cannot_use_are_refused_on_the_command_line_in_one_line(capsys):
    """``--virtual`` without ``--schedule interleaved``, end to end (exit
    status 2, one line, no traceback); a count of 0 and ``--chunks`` not a
    multiple of the devices through ``main`` in this process."""
    from tests.test_bounds import TRAIN, one_line_error, one_line_error_in_process, run  # pylint: disable=C0415
    blocks = ['--widths', '2,4,4,4,1', '--batch-size', '12']
    assert one_line_error(run(['-m', 'mp_symbolic', 'train', '--schedule', '1f1b', '--virtual',
                               '2'] + TRAIN + blocks)) == \
        "error: --virtual: expected None with schedule='1f1b' (virtual stages are the " \
        "'interleaved' schedule's), found 2"
    assert one_line_error_in_process(['train', '--schedule', 'interleaved', '--virtual', '0']
                                     + TRAIN + blocks, capsys) == \
        'error: --virtual: expected a positive integer, found 0'
    assert one_line_error_in_process(['train', '--schedule', 'interleaved', '--chunks', '3']
                                     + TRAIN + blocks, capsys) == \
        'error: --chunks: expected a multiple of the 2 devices for the interleaved schedule, ' \
        'found 3'


def test_the_runs_memory_table_under_1f1b_is_its_stages_arrays_per_device(small_data):
    """``--memory`` under ``--schedule 1f1b`` in one process: the table of
    the stages' arrays on their devices (``memory_table`` of the Module),
    parameters on both devices."""
    from conftest import load_config  # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.memory import memory_table  # pylint: disable=import-outside-toplevel
    X, y = small_data[0], small_data[1]
    task, cfg = load_config(task='regression', devices='cpu:0,cpu:1', chunks=2, schedule='1f1b',
                            progress=False, num_examples=len(X), widths=(2, 4, 4, 4, 1),
                            batch_size=40, memory=True)
    pipe, _ = loop.build_pipeline(cfg, task)
    stepper = loop.make_stepper(cfg, pipe, task, loop.initial_values(pipe, cfg.seed), y.shape[1:])
    stepper.step(*next(iter(stepper.batches(X, y, 0))))
    lines = []
    measured = loop.plan_memory(cfg, pipe, task, y.shape[1:], log=lines.append, stepper=stepper)
    assert lines[0] == ('memory per device of the stages, their arrays (optimizer state once '
                        'made; activations: python -m bench.schedules):')
    assert measured == {'stages': memory_table(stepper.module).as_dict()}
    assert sorted(measured['stages']) == ['cpu(0)', 'cpu(1)']
    assert all(row['params'] > 0 for row in measured['stages'].values())


@pytest.mark.parametrize('schedule, kind', [('gpipe', 'FusedRuntime'), ('1f1b', 'StageRuntime')])
def test_every_schedules_module_binds_no_executor_but_its_runtimes_and_they_hold_its_arrays(
        monkeypatch, schedule, kind):
    """``bind`` binds the runtimes' executors alone (the stages', or GPipe's
    fused graph's; no executor group, no executor that never runs): every
    parameter, gradient and auxiliary array the Module reads
    (``get_params``, the optimizer) is the one a runtime's executor binds."""
    made = []
    simple_bind = mx.sym.Symbol.simple_bind
    monkeypatch.setattr(mx.sym.Symbol, 'simple_bind',
                        lambda self, *a, **k: made.append(1) or simple_bind(self, *a, **k))
    mod, _ = _module_on(schedule, _digits, 'cpu:0,cpu:1', 2, 2)
    assert not made
    assert [type(r).__name__ for r in mod.runtimes] == [kind, kind]
    group = mod._exec_group  # pylint: disable=protected-access
    assert isinstance(group, ArrayGroup)
    for r, runtime in enumerate(mod._runtimes):  # pylint: disable=protected-access
        bound = {id(a) for exe in runtime.executors
                 for a in list(exe.arg_dict.values()) + list(exe.aux_dict.values()) +
                 [g for g in exe.grad_dict.values() if g is not None]}
        held = [arrays[r] for arrays in group.param_arrays + group.grad_arrays +
                group.aux_arrays if arrays[r] is not None]
        assert held and all(id(a) in bound for a in held)


def test_a_stage_module_bound_with_a_shared_module_holds_its_arrays_and_refuses_another_kind():
    """``bind(shared_module=...)`` (MXNet's buckets): the parameters,
    gradients and auxiliary states are the shared StagedModule's arrays;
    a Module of another kind is refused in one line."""
    first, sample = _module_on('1f1b', _digits, 'cpu:0,cpu:1', 2, 1)
    mod = StagedModule(first.pipeline, loss='softmax')
    mod.bind([('data', sample)], [('softmax_label', (BATCH,))], shared_module=first)
    for mine, theirs in (
            (mod._exec_group.param_arrays, first._exec_group.param_arrays),  # pylint: disable=protected-access
            (mod._exec_group.grad_arrays, first._exec_group.grad_arrays),  # pylint: disable=protected-access
            (mod._exec_group.aux_arrays, first._exec_group.aux_arrays)):  # pylint: disable=protected-access
        assert mine
        for a, b in zip(mine, theirs):
            b[0][:] = 7
            assert (a[0].asnumpy() == 7).all()
    other = mx.mod.Module(mx.sym.Variable('data'))
    with pytest.raises(ValueError, match='^shared_module: expected a bound and initialised '
                                         'PipelineModule, found Module$'):
        StagedModule(first.pipeline, loss='softmax').bind(
            [('data', sample)], [('softmax_label', (BATCH,))], shared_module=other)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_monitor_installed_on_the_module_sees_its_runtimes_executors_run(schedule):
    mod, sample = _module_on(schedule, _digits, 'cpu:0,cpu:1', 2, 1)
    monitor = mx.monitor.Monitor(1, pattern='.*')
    mod.install_monitor(monitor)
    monitor.tic()
    mod.forward_backward(_batch(sample, 1, 10))
    seen = {name for _, name, _ in monitor.toc()}
    assert any(name.endswith('_output') for name in seen)


def test_the_stage_modules_memory_table_counts_the_inputs_its_stage_executors_bind():
    """Under 1F1B at K = 2, M = 2 stage 0 holds two micro-batches in flight
    (two executors, each with its input array), stage 1 one with the labels:
    the table's ``inputs`` are those arrays, on their stages' devices."""
    from mp_symbolic.tools.memory import memory_table  # pylint: disable=import-outside-toplevel
    mod, sample = _module_on('1f1b', _digits, 'cpu:0,cpu:1', 2, 1)
    table = memory_table(mod).as_dict()
    micro = BATCH // 2
    data = micro * int(np.prod(sample[1:])) * 4
    assert table['cpu(0)']['inputs'] == 2 * data
    assert table['cpu(1)']['inputs'] == micro * 4


def test_the_runs_memory_table_is_not_the_one_graphs_under_1f1b():
    from conftest import make_config  # pylint: disable=import-outside-toplevel
    lines = []
    assert loop.plan_memory(make_config(task='regression', schedule='1f1b'), None, None, None,
                            log=lines.append) is None
    assert lines == ["memory per device: not measured (the table binds the one GPipe graph; "
                     "under --schedule 1f1b, python -m bench.schedules measures each stage's)"]


def test_the_stage_runtime_reports_each_action_as_issued_and_waiting_in_it_changes_nothing():
    """``StageRuntime.run(..., each=...)`` (how ``bench.schedules`` times the
    stages one action at a time): called once per action, in the runtime's
    issue order; a ``waitall`` in it leaves the gradients as they were."""
    from mp_symbolic.core.schedule import issue_order  # pylint: disable=import-outside-toplevel
    net, sample = _lm()
    pipe = Pipeline(net, 'cpu:0,cpu:1,cpu:2', sample=sample, chunks=4, schedule='1f1b')
    mod = pipe.module(loss='softmax')
    batch = _batch(sample, 0, 10)
    mod.bind(data_shapes=[('data', sample)], label_shapes=[('softmax_label', sample)])
    mod.init_params(initializer=mx.init.Xavier())
    runtime = mod._runtimes[0]  # pylint: disable=protected-access
    inputs = {'data': batch.data[0], 'softmax_label': batch.label[0]}
    runtime.run(inputs, train=True)
    free = [g.asnumpy() for g in runtime.grads]
    seen = []
    runtime.run(inputs, train=True, each=lambda action: (mx.nd.waitall(), seen.append(action)))
    assert seen == issue_order(pipe.run_schedule()) and len(seen) == 2 * 3 * 4
    for grad, value in zip(runtime.grads, free):
        np.testing.assert_array_equal(grad.asnumpy(), value)


def _one_at_a_time(num_stages, microbatches):
    """Each micro-batch forward and backward through every stage before the
    next starts: one micro-batch in flight anywhere (a schedule of the
    user's, as a function)."""
    return [[mp_symbolic.Action(s, i, kind) for i in range(microbatches) for kind in 'FB']
            for s in range(num_stages)]


def _trains_as_the_gpipe_graph_keeping(spec, kept):
    """Trains ``spec`` over three devices as the GPipe graph does; the
    micro-batches each stage's runtime keeps are ``kept``. The Pipeline."""
    _, expected_out, expected = _train(_lm, 'cpu:0,cpu:1,cpu:2', 4, 'gpipe')
    pipe, out, params = _train(_lm, 'cpu:0,cpu:1,cpu:2', 4, spec)
    mod = pipe.module(loss='softmax')
    mod.bind([('data', (BATCH, TINY.block_size))], [('softmax_label', (BATCH, TINY.block_size))])
    assert [len(slots) for slots in mod._runtimes[0].slots] == kept  # pylint: disable=W0212
    np.testing.assert_allclose(out, expected_out, rtol=TOL, atol=TOL)
    for name, value in expected.items():
        np.testing.assert_allclose(params[name], value, rtol=TOL, atol=TOL, err_msg=name)
    return pipe


def test_a_schedule_given_as_a_function_trains_as_the_gpipe_graph_and_keeps_what_it_says():
    pipe = _trains_as_the_gpipe_graph_keeping(_one_at_a_time, [1, 1, 1])
    assert pipe.run_schedule().name == '_one_at_a_time'


def test_a_schedule_function_is_called_once_however_often_the_schedule_is_read():
    """The Pipeline makes a function's schedule once: reading it again, and
    binding and stepping a Module on it, call the function no more, and
    every read is that one record."""
    calls = []

    def counted(num_stages, microbatches):
        calls.append((num_stages, microbatches))
        return _one_at_a_time(num_stages, microbatches)

    net, sample = _digits()
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=sample, chunks=2, schedule=counted)
    first = pipe.run_schedule()
    assert pipe.run_schedule() is first and pipe.virtual == 1 and pipe.devices_per_replica == 2
    mod = pipe.module(loss='softmax')
    batch = _batch(sample, 0, 10)
    mod.bind(data_shapes=[('data', sample)], label_shapes=[('softmax_label', (BATCH,))])
    mod.init_params(initializer=mx.init.Xavier())
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 0.1})
    mod.forward_backward(batch)
    mod.update()
    assert calls == [(2, 2)]


def test_gpipe_given_as_its_function_runs_on_the_stage_runtime_and_trains_as_its_one_graph():
    """What docs/pipelining.md says: ``schedule=schedule.gpipe`` (the
    function, not the name) runs GPipe on the stage runtime in one process,
    every micro-batch in flight on every stage, and trains as the one graph."""
    from mp_symbolic.core import schedule  # pylint: disable=import-outside-toplevel
    _, expected_out, expected = _train(_lm, 'cpu:0,cpu:1,cpu:2', 4, 'gpipe')
    pipe, out, params = _train(_lm, 'cpu:0,cpu:1,cpu:2', 4, schedule.gpipe)
    mod = pipe.module(loss='softmax')
    mod.bind([('data', (BATCH, TINY.block_size))], [('softmax_label', (BATCH, TINY.block_size))])
    assert type(mod.runtimes[0]).__name__ == 'StageRuntime'
    assert [len(slots) for slots in mod._runtimes[0].slots] == [4, 4, 4]  # pylint: disable=W0212
    np.testing.assert_allclose(out, expected_out, rtol=TOL, atol=TOL)
    for name, value in expected.items():
        np.testing.assert_allclose(params[name], value, rtol=TOL, atol=TOL, err_msg=name)


def test_a_schedule_added_as_one_record_in_named_runs_and_trains_as_the_gpipe_graph(
        monkeypatch):
    """A schedule added as a ``Schedule`` subclass and its ``NAMED`` entry,
    nothing else (1F1B's lists under another name), is taken by name and
    runs on the stage runtime, as its record says, giving the GPipe
    graph's outputs and parameters."""
    from mp_symbolic.core import schedule  # pylint: disable=import-outside-toplevel

    class Zigzag(schedule.Schedule):
        virtual_default = None

        @classmethod
        def build(cls, num_stages, microbatches, virtual):  # pylint: disable=unused-argument
            made = schedule.one_f_one_b(num_stages, microbatches)
            return cls('zigzag', made.devices, num_stages, microbatches, made.device_of_stage)

    monkeypatch.setitem(schedule.NAMED, 'zigzag', Zigzag)
    _, expected_out, expected = _train(_lm, 'cpu:0,cpu:1,cpu:2', 4, 'gpipe')
    pipe, out, params = _train(_lm, 'cpu:0,cpu:1,cpu:2', 4, 'zigzag')
    assert type(pipe.run_schedule()) is Zigzag  # pylint: disable=unidiomatic-typecheck
    mod = pipe.module(loss='softmax')
    mod.bind([('data', (BATCH, TINY.block_size))], [('softmax_label', (BATCH, TINY.block_size))])
    assert type(mod.runtimes[0]).__name__ == 'StageRuntime'
    np.testing.assert_allclose(out, expected_out, rtol=TOL, atol=TOL)
    for name, value in expected.items():
        np.testing.assert_allclose(params[name], value, rtol=TOL, atol=TOL, err_msg=name)


def test_the_stage_runtime_binds_per_stage_what_the_schedule_record_says_it_keeps_in_flight(
        monkeypatch):
    """The stage runtime asks the schedule's record (``Schedule.in_flight``)
    how many micro-batches each stage keeps: a record that keeps every
    micro-batch of 1F1B's order alive gets that many executors a stage, and
    trains as the GPipe graph."""
    from mp_symbolic.core import schedule  # pylint: disable=import-outside-toplevel

    class Roomy(schedule.OneFOneB):
        @classmethod
        def build(cls, num_stages, microbatches, virtual):  # pylint: disable=unused-argument
            made = schedule.one_f_one_b(num_stages, microbatches)
            return cls('roomy', made.devices, num_stages, microbatches, made.device_of_stage)

        def in_flight(self):
            return {s: self.microbatches for s in range(self.num_stages)}

    monkeypatch.setitem(schedule.NAMED, 'roomy', Roomy)
    _trains_as_the_gpipe_graph_keeping('roomy', [4, 4, 4])


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'interleaved', _one_at_a_time])
def test_pipe_module_is_one_class_for_every_schedule(schedule):
    """``pipe.module()`` is a PipelineModule whatever the schedule (GPipe's
    fused graph or the stage runtime), and StagedModule is that class."""
    pipe = Pipeline(_digits()[0], 'cpu:0,cpu:1', sample=(BATCH, 1, 8, 8), chunks=2,
                    schedule=schedule)
    assert type(pipe.module()) is PipelineModule  # pylint: disable=unidiomatic-typecheck
    assert StagedModule is PipelineModule


def _swapped(num_stages, microbatches):
    lists = _one_at_a_time(num_stages, microbatches)
    return [lists[1], lists[0]] + lists[2:]


def _backward_first(num_stages, microbatches):
    return [[mp_symbolic.Action(s, i, kind) for i in range(microbatches) for kind in 'BF']
            for s in range(num_stages)]


@pytest.mark.parametrize('schedule, message', [
    (lambda k, m: _one_at_a_time(k, m)[:-1],
     r'^schedule: expected <lambda> to return one list of actions per device \(2\), found 1 '
     r'lists$'),
    (lambda k, m: [a[1:] for a in _one_at_a_time(k, m)],
     r'^schedule: expected every stage forward and backward on every micro-batch, found 0F0, '
     r'1F0 missing$'),
    (_swapped, r'^schedule: expected 1F0 on device 1 \(its stage\'s\), found it on device 0$'),
    (_backward_first, r'^schedule: expected an order the devices can run, found every device '
                      r'waiting \(device 0 at 0B0, device 1 at 1B0\)$'),
    (lambda k, m: [[(0, 0, 'X')], []], r"^schedule: expected actions \(stage < 2, micro-batch < 1, F "
                                   r"or B\), found \(0, 0, 'X'\) on device 0$"),
    (lambda k, m: [[0]], r'^schedule: expected <lambda> to return one list of \(stage, '
                         r'microbatch, kind\) actions per device, found \[\[0\]\]$'),
    (lambda k, m: 1 / 0, r'^schedule: expected <lambda>\(2, 1\) to return one list of actions '
                         r'per device, found it raising ZeroDivisionError: division by zero$'),
])
def test_a_schedule_function_that_cannot_run_is_refused_in_one_line(schedule, message):
    with pytest.raises(mp_symbolic.ScheduleError, match=message):
        Pipeline(_lm()[0], 'cpu:0,cpu:1', schedule=schedule)


def _raising_after_one(error):
    """A schedule whose outer generator raises ``error`` after one list."""
    def raising(num_stages, microbatches):
        yield _one_at_a_time(num_stages, microbatches)[0]
        raise error
    return raising


def _inner_raising(num_stages, microbatches):
    """A schedule whose second device's list is a generator that raises."""
    def second():
        yield mp_symbolic.Action(1, 0, 'F')
        raise KeyError('stage')
    return [_one_at_a_time(num_stages, microbatches)[0], second()]


@pytest.mark.parametrize('schedule, message', [
    (_raising_after_one(RuntimeError('no more')), r'RuntimeError: no more'),
    (_raising_after_one(KeyError('x')), r"KeyError: 'x'"),
    (_raising_after_one(ZeroDivisionError('division by zero')),
     r'ZeroDivisionError: division by zero'),
    (_inner_raising, r"KeyError: 'stage'"),
])
def test_a_schedule_whose_lists_raise_while_read_is_refused_in_one_line(schedule, message):
    with pytest.raises(mp_symbolic.ScheduleError,
                       match=r'^schedule: expected the lists \w+\(2, 1\) returns to be read, '
                             r'found reading them raising ' + message + '$'):
        Pipeline(_lm()[0], 'cpu:0,cpu:1', schedule=schedule)


def test_a_schedule_function_raising_a_message_of_several_lines_is_refused_in_one_line():
    def several_lines(num_stages, microbatches):
        raise ValueError('no schedule:\n  stages %d\n  micro-batches %d'
                         % (num_stages, microbatches))
    with pytest.raises(mp_symbolic.ScheduleError) as err:
        Pipeline(_lm()[0], 'cpu:0,cpu:1', schedule=several_lines)
    assert str(err.value) == ('schedule: expected several_lines(2, 1) to return one list of '
                              'actions per device, found it raising ValueError: no schedule: '
                              'stages 2 micro-batches 1')


def _endless_lists(num_stages, microbatches):
    return itertools.repeat([])


def _endless_actions(num_stages, microbatches):
    return [itertools.cycle(_one_at_a_time(num_stages, microbatches)[0]), []]


def _endless_action(num_stages, microbatches):
    return [[itertools.count()], []]


@pytest.mark.parametrize('schedule, message', [
    (_endless_lists, r'^schedule: expected _endless_lists to return one list of actions per '
                     r'device \(2\), found more than 2 lists$'),
    (_endless_actions, r'^schedule: expected at most 2 x stages x micro-batches = 2 x 2 x 2 = 8 '
                       r'actions on a device from _endless_actions\(2, 2\) \(a longer list '
                       r'repeats one\), found more on device 0$'),
    (_endless_action, r'^schedule: expected _endless_action to return one list of \(stage, '
                      r'microbatch, kind\) actions per device, found \[\[count\(4\)\], \[\]\]$'),
])
def test_an_endless_schedule_is_refused_at_its_bound(schedule, message):
    with pytest.raises(mp_symbolic.ScheduleError, match=message):
        Pipeline(_lm()[0], 'cpu:0,cpu:1', chunks=2, schedule=schedule)


@pytest.mark.parametrize('in_thread', [False, True])
def test_a_schedule_function_that_does_not_return_in_time_is_refused_from_any_thread(
        monkeypatch, in_thread):
    """A function that waits (here on an event, released at the end) is
    refused after ``schedule.TIME_LIMIT`` seconds, whether the Pipeline is
    built in the main thread or in another (where no signal reaches)."""
    from mp_symbolic.core import schedule  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(schedule, 'TIME_LIMIT', 0.5)
    release = threading.Event()

    def waiting(num_stages, microbatches):
        release.wait(60)
        return _one_at_a_time(num_stages, microbatches)

    raised = []

    def build():
        try:
            Pipeline(_lm()[0], 'cpu:0,cpu:1', schedule=waiting)
        except mp_symbolic.ScheduleError as err:
            raised.append(str(err))

    start = time.monotonic()
    try:
        if in_thread:
            thread = threading.Thread(target=build)
            thread.start()
            thread.join(30)
        else:
            build()
    finally:
        release.set()
    assert raised == ['schedule: expected waiting(2, 1) to return its lists of actions within '
                      '0.5 s (schedule.TIME_LIMIT), found it still running then']
    assert time.monotonic() - start < 30


@pytest.mark.parametrize('schedule', ['1f1b', 'interleaved'])
def test_fit_with_eval_data_score_and_predict_take_other_batch_sizes_under_the_stage_runtime(
        schedule):
    """``fit(eval_data=...)``, ``score`` and ``predict`` at batch sizes other
    than the bound one give what the GPipe graph gives; a prediction at a
    batch size the micro-batches do not divide gives the same values."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 4)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.float32)
    nn = gluon.nn
    results = {}
    for name in ('gpipe', schedule):
        mx.random.seed(0)
        blocks = [nn.Dense(16, in_units=4, activation='relu', prefix='a_'),
                  nn.Dense(16, in_units=16, activation='relu', prefix='b_'),
                  nn.Dense(16, in_units=16, activation='relu', prefix='c_'),
                  nn.Dense(2, in_units=16, prefix='d_')]  # 4 stages under interleaved
        pipe = Pipeline(blocks, 'cpu:0,cpu:1', chunks=2, schedule=name)
        mod = pipe.module(loss='softmax')
        mod.fit(mx.io.NDArrayIter(X, y, batch_size=20), num_epoch=3,
                eval_data=mx.io.NDArrayIter(X, y, batch_size=10), eval_metric='acc',
                optimizer='sgd', initializer=mx.init.Xavier(rnd_type='gaussian'),
                optimizer_params={'learning_rate': 0.2})
        score = dict(mod.score(mx.io.NDArrayIter(X, y, batch_size=12), 'acc'))['accuracy']
        results[name] = score, mod.predict(mx.io.NDArrayIter(X, batch_size=20)).asnumpy()
    assert results[schedule][0] == results['gpipe'][0] and results['gpipe'][0] > 0.8
    np.testing.assert_allclose(results[schedule][1], results['gpipe'][1], rtol=1e-5, atol=1e-6)
    for size in (6, 5):  # 5: not of 2 micro-batches
        np.testing.assert_allclose(mod.predict(mx.io.NDArrayIter(X, batch_size=size)).asnumpy(),
                                   results['gpipe'][1], rtol=1e-5, atol=1e-6)


def test_runtime_bind_splits_a_batch_on_axis_1_into_micro_batches_on_the_stage_runtime():
    """``runtime.bind`` of a Pipeline of ``batch_axis=1`` (``(T, N, C)``
    inputs, ``(T, N)`` labels): the stage runtime's micro-batches split
    and join on axis 1, and its outputs and gradients are the fused graph's."""
    from mp_symbolic.core.engine import runtime  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(5, 8, 3)), rng.integers(0, 4, (5, 8))
    found = {}
    for schedule in ('gpipe', '1f1b'):
        blocks = [gluon.nn.Dense(6, flatten=False, in_units=3, prefix='tnc0_'),
                  gluon.nn.Dense(4, flatten=False, in_units=6, prefix='tnc1_')]
        pipe = Pipeline(blocks, 'cpu:0,cpu:1', sample=(5, 8, 3), chunks=2, schedule=schedule,
                        batch_axis=1)
        bound = runtime.bind(pipe, 'softmax', 'softmax_label',
                             {'data': (5, 8, 3), 'softmax_label': (5, 8)})
        arg_dict, grad_dict, _ = bound.parameters
        for name in sorted(n for n, g in grad_dict.items() if g is not None):
            arg_dict[name][:] = np.random.default_rng(len(name)).normal(
                size=arg_dict[name].shape)
        bound.run({'data': mx.nd.array(X), 'softmax_label': mx.nd.array(y)}, train=True)
        found[schedule] = (bound.outputs[0].asnumpy(),
                           {n: g.asnumpy() for n, g in grad_dict.items() if g is not None})
    (out, grads), (ref_out, ref_grads) = found['1f1b'], found['gpipe']
    assert out.shape == (5, 8, 4)
    np.testing.assert_allclose(out, ref_out, rtol=TOL, atol=1e-7)
    assert sorted(grads) == sorted(ref_grads)
    for name, value in ref_grads.items():
        np.testing.assert_allclose(grads[name], value, rtol=TOL, atol=1e-6, err_msg=name)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_runtime_bind_builds_only_the_graph_it_binds_and_a_module_its_checkpoint_graph_on_read(
        monkeypatch, schedule):
    """``runtime.bind`` (the executor API) builds the graph it binds and not
    the checkpoint's (one micro-batch, shards unsplit); a Module builds that
    one when its ``export_graph`` is first read, once, the graph
    ``training_graph(..., chunks=1, unsplit=True)`` gives."""
    from mp_symbolic.core.engine import runtime  # pylint: disable=import-outside-toplevel
    built = []
    build = Pipeline.training_graph

    def counted(self, *args, **kwargs):
        built.append(bool(kwargs.get('unsplit')))
        return build(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, 'training_graph', counted)
    net, sample = _digits()
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=sample, chunks=4, schedule=schedule)
    runtime.bind(pipe, 'softmax', 'softmax_label', {'data': sample, 'softmax_label': (BATCH,)})
    assert built == [False]
    mod = pipe.module(loss='softmax')
    assert True not in built
    symbol = mod.export_symbol
    assert built.count(True) == 1 and mod.export_graph is mod.export_graph
    assert built.count(True) == 1
    expected = build(pipe, 'softmax', chunks=1, unsplit=True).to_symbol()
    assert symbol.tojson() == expected.tojson()


def test_runtime_bind_gives_the_fused_graph_or_the_stage_runtime_behind_one_interface():
    """``runtime.bind`` under ``gpipe`` (the fused one graph) and ``1f1b``
    (the stage runtime): both are a ``Runtime``, bind the same parameters on
    the same devices, and give the same outputs and gradients for a batch."""
    from mp_symbolic.core.engine import runtime  # pylint: disable=import-outside-toplevel
    found = {}
    for schedule in ('gpipe', '1f1b'):
        net, sample = _digits()
        pipe = Pipeline(net, 'cpu:0,cpu:1,cpu:2', sample=sample, chunks=4, schedule=schedule)
        arg_params, aux_params = loop.initial_values(pipe, seed=0)
        bound = runtime.bind(pipe, 'softmax', 'softmax_label',
                             {'data': sample, 'softmax_label': (BATCH,)})
        assert isinstance(bound, runtime.Runtime)
        assert type(bound).__name__ == ('FusedRuntime' if schedule == 'gpipe' else 'StageRuntime')
        arg_dict, grad_dict, aux_dict = bound.parameters
        for name, value in arg_params.items():
            arg_dict[name][:] = value
        for name, value in aux_params.items():
            aux_dict[name][:] = value
        batch = _batch(sample, 1, 10)
        bound.run({'data': batch.data[0], 'softmax_label': batch.label[0]}, train=True)
        found[schedule] = (bound.outputs[0].asnumpy(),
                           {n: (g.context, g.asnumpy()) for n, g in grad_dict.items()
                            if g is not None},
                           {n: a.context for n, a in arg_dict.items() if n in arg_params})
    (out, grads, devices), (ref_out, ref_grads, ref_devices) = found['1f1b'], found['gpipe']
    assert devices == ref_devices
    np.testing.assert_allclose(out, ref_out, rtol=TOL, atol=1e-7)
    assert sorted(grads) == sorted(ref_grads)
    for name, (device, value) in ref_grads.items():
        assert grads[name][0] == device
        np.testing.assert_allclose(grads[name][1], value, rtol=TOL, atol=1e-6, err_msg=name)


def test_zero_sets_every_gradient_to_0_with_one_op_a_device_and_a_sparse_one_apart(monkeypatch):
    from mp_symbolic.core.engine import stages  # pylint: disable=import-outside-toplevel
    dense = [mx.nd.ones((3, 2), mx.cpu(0)), mx.nd.ones((5,), mx.cpu(1)),
             mx.nd.ones((2, 2), mx.cpu(0), dtype='float16'), mx.nd.ones((4,), mx.cpu(1))]
    sparse = mx.nd.ones((4, 2)).tostype('row_sparse')
    calls = []
    real = mx.nd.reset_arrays

    def spy(*arrays, **kwargs):
        calls.append(sorted({a.context.device_id for a in arrays}))
        return real(*arrays, **kwargs)

    monkeypatch.setattr(mx.nd, 'reset_arrays', spy)
    stages.zero(dense + [sparse])
    for array in dense + [sparse]:
        assert not array.asnumpy().any()
    assert sorted(calls) == [[0], [1]], calls
