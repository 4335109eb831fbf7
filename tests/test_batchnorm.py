"""BatchNorm's running statistics under every schedule: each micro-batch
updates them in turn, in micro-batch order, under GPipe's one graph as
under 1F1B and the interleaved schedule, bit for bit."""
import mxnet as mx
import numpy as np
import pytest

from mp_symbolic import Pipeline
from mp_symbolic.training import loop
from mp_symbolic.training.tasks import digits

BATCH = 8


def _digits():
    return digits.build_blocks(), (BATCH, 1, 8, 8), 10


def _mobilenet():
    model_zoo = pytest.importorskip('gluoncv.model_zoo')
    return model_zoo.get_model('mobilenetv2_0.25', pretrained=False, classes=10,
                                prefix='mobilenet_'), \
        (8, 3, 32, 32), 10


def _batch(sample, step, classes):
    rng = np.random.default_rng(step)
    return mx.io.DataBatch([mx.nd.array(rng.normal(size=sample).astype(np.float32))],
                           [mx.nd.array(rng.integers(0, classes, sample[0]).astype(np.float32))])


def _module(make, devices, chunks, schedule, sample=None, replicas=1):
    net, full, classes = make()
    sample = sample or full
    pipe = Pipeline(net, devices, sample=sample, chunks=chunks, schedule=schedule,
                    virtual=1 if schedule == 'interleaved' else None, replicas=replicas)
    arg_params, aux_params = loop.initial_values(pipe, seed=0)
    mod = pipe.module(loss='softmax')
    mod.bind(data_shapes=[('data', sample)], label_shapes=[('softmax_label', (sample[0],))])
    mod.init_params(arg_params={k: mx.nd.array(v) for k, v in arg_params.items()},
                    aux_params={k: mx.nd.array(v) for k, v in aux_params.items()},
                    allow_missing=False)
    return mod, full, classes


def _train(make, devices, chunks, schedule, replicas=1, steps=3):
    """The last step's outputs, then every parameter and every running
    statistic after ``steps`` SGD steps (momentum 0.9)."""
    mod, sample, classes = _module(make, devices, chunks, schedule, replicas=replicas)
    mod.init_optimizer(kvstore='local' if replicas > 1 else None, optimizer='sgd',
                       optimizer_params={'learning_rate': 0.01, 'momentum': 0.9})
    for step in range(steps):
        mod.forward_backward(_batch(sample, step, classes))
        mod.update()
    arg_params, aux_params = mod.get_params()
    return mod.get_outputs()[0].asnumpy(), {k: v.asnumpy() for k, v in arg_params.items()}, \
        {k: v.asnumpy() for k, v in aux_params.items()}


def _assert_bitwise(ours, theirs):
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert np.array_equal(ours[name], value), \
            '%s differs by %g' % (name, np.abs(ours[name] - value).max())


@pytest.mark.parametrize('make, devices, replicas', [
    (_digits, 'cpu:0,cpu:1', 1), (_mobilenet, 'cpu:0,cpu:1', 1),
    (_digits, 'cpu:0,cpu:1,cpu:2,cpu:3', 2)], ids=['digits', 'mobilenetv2_0.25', 'replicas'])
def test_running_statistics_are_the_same_bit_for_bit_under_gpipe_1f1b_and_interleaved(
        make, devices, replicas):
    out, params, stats = _train(make, devices, 2, 'gpipe', replicas)
    assert any(not np.array_equal(v, 0) and not np.array_equal(v, 1) for v in stats.values())
    for schedule in ('1f1b', 'interleaved'):
        ours = _train(make, devices, 2, schedule, replicas)
        assert np.array_equal(ours[0], out), schedule
        _assert_bitwise(ours[1], params)
        _assert_bitwise(ours[2], stats)


@pytest.mark.parametrize('make, tol', [(_digits, 0), (_mobilenet, 1e-6)],
                         ids=['digits', 'mobilenetv2_0.25'])
@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_the_running_statistics_are_each_micro_batch_in_turn_as_on_one_device(make, tol,
                                                                              schedule):
    """One step of two micro-batches updates the statistics as one device
    does running the two halves of the batch one after the other: bit for
    bit on the digits CNN; MobileNetV2's convolutions on one device and
    split round differently in the last bits (its statistics are all
    within ``tol``)."""
    mod, sample, classes = _module(make, 'cpu:0,cpu:1', 2, schedule)
    batch = _batch(sample, 0, classes)
    mod.forward_backward(batch)
    stats = {k: v.asnumpy() for k, v in mod.get_params()[1].items()}
    half = (sample[0] // 2,) + sample[1:]
    one, _, _ = _module(make, 'cpu:0', 1, 'gpipe', sample=half)
    for m in range(2):
        rows = slice(m * half[0], (m + 1) * half[0])
        one.forward_backward(mx.io.DataBatch([batch.data[0][rows]], [batch.label[0][rows]]))
    expected = {k: v.asnumpy() for k, v in one.get_params()[1].items()}
    if not tol:
        _assert_bitwise(stats, expected)
    assert sorted(stats) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(stats[name], value, rtol=tol, atol=tol, err_msg=name)
