"""The ``'log_softmax'`` head on the networks users have, against the
``'softmax'`` head (MXNet's ``SoftmaxOutput``): GluonCV's
``cifar_resnet20_v1`` (BatchNorm, classes ``(N, 10)``) and GluonNLP's
``standard_lstm_lm_200`` (classes on the last axis of ``(T, N, V)``), each
cut into 2 stages over ``cpu(0)``, ``cpu(1)`` with 2 micro-batches under
GPipe and 1F1B. Random initial values; nothing is downloaded.

Each step both heads start from the same values (the ``'softmax'``
Module takes the ``'log_softmax'`` Module's parameters and running
statistics before the step), so each step's predictions and the
parameters after it compare the heads alone: the two compute the same
softmax and the same gradient, ``softmax - one_hot(label)``, by different
kernels, so they agree to float32 rounding. Runs trained apart drift
further than that on the ResNet, whichever head: from the second step a
ReLU input within rounding of zero may fall on the other side, which moves
``conv0_weight``'s gradient by a whole position's share; a 1-ulp change of
one weight under the ``'softmax'`` head alone drifts as far (1.8e-5 on
``conv0_weight`` after two steps at lr 0.01).

The export of each trained ResNet predicts the same probabilities, and the
memory estimate of the ResNet on ``'log_softmax'`` is within 5% of the
measured table.
"""
import json

import mxnet as mx
import numpy as np
import onnxruntime as ort
import pytest

import mp_symbolic
from mp_symbolic import Pipeline
from mp_symbolic.core.planning.estimate import batched_binds
from mp_symbolic.training import loop

from bench import estimate as bench

from export.__main__ import main as export_main
from export.runtimes import MXNetPredictor

TWO = 'cpu:0,cpu:1'
LOSSES = ('softmax', 'log_softmax')
LR = 0.1
STEPS = 3
# Float32 rounding, measured over the steps of both networks and schedules:
# the probabilities differ by at most 6e-8 (float32's epsilon is 1.2e-7),
# the summed gradients by 1.7e-6 of their largest entry, the parameters by
# 1.2e-7 (one ulp of a BatchNorm gamma near 1; the language model's 2.2e-8).
# 1e-6 leaves a margin of 8 and fails a gradient 1% off (conv0_weight's
# step is up to lr / batch x 2.7 = 0.03).
TOL = 1e-6

CNN_SHAPE = (8, 3, 32, 32)  # (batch, channels, height, width), 10 classes
VOCAB, T, N, LAYERS, HIDDEN = 50, 5, 4, 2, 200  # tokens (T, N), states (L, N, HIDDEN)


def _resnet():
    model_zoo = pytest.importorskip('gluoncv.model_zoo')
    return model_zoo.get_model('cifar_resnet20_v1', classes=10, pretrained=False,
                               prefix='r20_')


def _cnn_batch(step):
    rng = np.random.default_rng(step)
    return mx.io.DataBatch([mx.nd.array(rng.normal(size=CNN_SHAPE).astype(np.float32))],
                           [mx.nd.array(rng.integers(0, 10, CNN_SHAPE[0]).astype(np.float32))])


def _cnn(schedule):
    """``(pipe, data and label shapes, output, batch(step))`` of the ResNet."""
    pipe = Pipeline(_resnet(), TWO, sample=CNN_SHAPE, chunks=2, schedule=schedule)
    return (pipe, [('data', CNN_SHAPE)], [('softmax_label', CNN_SHAPE[:1])], None,
            _cnn_batch)


def _language_model():
    gluonnlp = pytest.importorskip('gluonnlp')
    vocab = gluonnlp.Vocab(gluonnlp.data.count_tokens([str(i) for i in range(VOCAB - 4)]))
    net, _ = gluonnlp.model.get_model('standard_lstm_lm_200', dataset_name=None, vocab=vocab,
                                      pretrained=False, dropout=0, prefix='lm_')
    return net


def _lm_batch(step):
    """Tokens, begin states ``[h, c]``; next tokens ``(T, N)``."""
    rng = np.random.default_rng(step)
    x, y = (mx.nd.array(rng.integers(0, VOCAB, size=(T, N))) for _ in range(2))
    states = [mx.nd.array(0.1 * rng.normal(size=(LAYERS, N, HIDDEN))) for _ in range(2)]
    return mx.io.DataBatch([x] + states, [y])


def _lm(schedule):
    """The language model, the batch on axis 1, the head on output 0 (its
    ``(T, N, V)`` scores; the states go out beside it)."""
    sample = _lm_batch(0).data
    pipe = Pipeline(_language_model(), TWO, sample=(sample[0], sample[1:]), batch_axis=1,
                    chunks=2, schedule=schedule)
    return (pipe, list(zip(pipe.input_names, [a.shape for a in sample])),
            [('softmax_label', (T, N))], 0, _lm_batch)


def _modules(make, schedule):
    """A Module of each head on the same network and initial values (seed
    0), bound, with plain SGD; the batch of each step."""
    mods = {}
    for loss in LOSSES:
        pipe, data_shapes, label_shapes, output, batch = make(schedule)
        arg_params, aux_params = loop.initial_values(pipe, seed=0)
        mod = pipe.module(loss=loss, output=output)
        mod.bind(data_shapes=data_shapes, label_shapes=label_shapes)
        mod.init_params(arg_params={k: mx.nd.array(v) for k, v in arg_params.items()},
                        aux_params={k: mx.nd.array(v) for k, v in aux_params.items()},
                        allow_missing=False)
        mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': LR})
        mods[loss] = mod
    return mods, batch


def _numpy(params):
    return {k: v.asnumpy() for k, v in params.items()}


def _steps_of_both_heads(make, schedule, steps=STEPS):
    """Trains the ``'log_softmax'`` Module ``steps`` SGD steps; before each,
    the ``'softmax'`` Module takes its parameters and running statistics and
    takes the same step. Asserts at each step that the outputs and then the
    parameters and statistics agree within :data:`TOL`.

    Returns:
        ``(modules, the last step's probabilities)``.
    """
    mods, batch = _modules(make, schedule)
    ours, theirs = mods['log_softmax'], mods['softmax']
    runtime = 'StageRuntime' if schedule == '1f1b' else 'FusedRuntime'
    assert {type(mod.runtimes[0]).__name__ for mod in mods.values()} == {runtime}
    for step in range(steps):
        before = ours.get_params()
        theirs.set_params(*before)
        outputs = []
        for mod in (ours, theirs):
            mod.forward_backward(batch(step))
            outputs.append([o.asnumpy() for o in mod.get_outputs()])  # before the update
            mod.update()
        assert [o.shape for o in outputs[0]] == [o.shape for o in outputs[1]]
        for got, expected in zip(*outputs):
            np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)
        np.testing.assert_allclose(outputs[0][0].sum(axis=-1), 1, rtol=1e-5)  # probabilities
        for got, expected in zip(ours.get_params(), theirs.get_params()):
            got, expected = _numpy(got), _numpy(expected)
            assert sorted(got) == sorted(expected)
            for name, value in expected.items():
                np.testing.assert_allclose(got[name], value, rtol=0, atol=TOL, err_msg=name)
    start, after = _numpy(before[0]), _numpy(ours.get_params()[0])
    assert all(not np.array_equal(value, start[name]) for name, value in after.items())
    return mods, outputs[0][0]


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_resnet_with_batchnorm_steps_on_log_softmax_as_on_softmax(schedule):
    mods, probabilities = _steps_of_both_heads(_cnn, schedule)
    assert probabilities.shape == (CNN_SHAPE[0], 10)
    stats = _numpy(mods['log_softmax'].get_params()[1])
    assert any('running_mean' in name and np.abs(value).max() > 0
               for name, value in stats.items())  # the running statistics moved too


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_language_model_steps_on_log_softmax_over_its_last_axis_as_on_softmax(schedule):
    _, probabilities = _steps_of_both_heads(_lm, schedule)
    assert probabilities.shape == (T, N, VOCAB)


def _exported(mod, folder, name):
    """``mod`` saved by :func:`mp_symbolic.save_checkpoint` and exported by
    ``python -m export``'s main: ``(inference symbol file, ONNX file)``."""
    mp_symbolic.save_checkpoint(mod, str(folder / 'run'), epoch=STEPS, name=name)
    assert export_main(['--checkpoint', str(folder / 'run'), '--out', str(folder / 'out'),
                        '--verify-batches', '1,8']) == 0
    current = folder / 'out' / 'current'
    return str(current / (name + '-symbol.json')), str(current / (name + '.onnx'))


def test_a_resnet_trained_on_log_softmax_exports_the_predictions_of_softmax(tmp_path):
    """Both heads' exports end in ``softmax`` over the classes: the same
    probabilities in MXNet (symbol/params, split over the stages) and in
    onnxruntime, each the trained Module's own."""
    mods, _ = _steps_of_both_heads(_cnn, 'gpipe')
    X = np.random.default_rng(10).normal(size=CNN_SHAPE).astype(np.float32)
    predictions = {}
    for loss, mod in mods.items():
        symbol, onnx_file = _exported(mod, tmp_path / loss, 'r20')
        with open(symbol) as f:
            ops = {node['op'] for node in json.load(f)['nodes']}
        assert 'softmax' in ops and not ops & {'SoftmaxOutput', 'log_softmax', 'pick',
                                               'MakeLoss', 'slice_like', 'BlockGrad'}
        session = ort.InferenceSession(onnx_file, providers=['CPUExecutionProvider'])
        onnx_out = session.run(None, {'data': X})[0]
        split = MXNetPredictor.from_files(symbol, devices=TWO).predict(X)
        mod.forward(mx.io.DataBatch([mx.nd.array(X)]), is_train=False)
        own = mod.get_outputs()[0].asnumpy()
        assert onnx_out.shape == own.shape == (CNN_SHAPE[0], 10)
        np.testing.assert_allclose(onnx_out.sum(axis=1), 1, rtol=1e-5)  # not the scores
        np.testing.assert_allclose(split, own, rtol=0, atol=1e-5)
        np.testing.assert_allclose(onnx_out, own, rtol=0, atol=1e-5)
        predictions[loss] = onnx_out
    np.testing.assert_allclose(predictions['log_softmax'], predictions['softmax'], rtol=0,
                               atol=1e-5)


@pytest.mark.slow  # two measured tables, each in a process of its own
def test_the_memory_estimate_of_a_resnet_on_log_softmax_is_within_5_percent_of_the_measured():
    """bench.estimate's ResNet cells with ``loss='log_softmax'``: the one
    graph and the stage runtime, each estimated in this process and measured
    by one step in a process of its own (tests/test_estimate.py's measure)."""
    # pylint: disable=protected-access
    cells = [bench._cell('cifar_resnet20_v1', loss='log_softmax', **plan)
             for plan in ({}, {'schedule': '1f1b', 'chunks': 2})]
    assert [bench.build(cell)[1] for cell in cells] == ['log_softmax'] * 2
    with batched_binds():
        estimated = [bench.estimate(cell) for cell in cells]
    for cell, guess, measured in zip(cells, estimated, bench.measure(cells)):
        devices, _ = bench.errors(measured, guess)
        assert sorted(devices) == ['cpu(0)', 'cpu(1)'], bench.label(cell)
        for device, (total, estimate, error) in devices.items():
            assert abs(error) <= 0.05, (bench.label(cell), device, total, estimate)
        guess = bench.as_profiled(guess, measured)
        for device, row in measured.items():
            for category in ('params', 'grads', 'optimizer', 'aux', 'module_copy'):
                assert guess[device][category] == row[category], \
                    (bench.label(cell), device, category)
