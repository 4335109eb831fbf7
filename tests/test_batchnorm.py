"""BatchNorm's running statistics under every schedule: each micro-batch
updates them in turn, in micro-batch order, under GPipe's one graph as
under 1F1B and the interleaved schedule, bit for bit; with
``batchnorm='deferred'``, once per batch with the whole batch's."""
import os

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

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


def _module(make, devices, chunks, schedule, sample=None, replicas=1, batchnorm='micro-batch'):
    net, full, classes = make()
    sample = sample or full
    pipe = Pipeline(net, devices, sample=sample, chunks=chunks, schedule=schedule,
                    virtual=1 if schedule == 'interleaved' else None, replicas=replicas,
                    batchnorm=batchnorm)
    arg_params, aux_params = loop.initial_values(pipe, seed=0)
    mod = pipe.module(loss='softmax')
    mod.bind(data_shapes=[('data', sample)], label_shapes=[('softmax_label', (sample[0],))])
    mod.init_params(arg_params={k: mx.nd.array(v) for k, v in arg_params.items()},
                    aux_params={k: mx.nd.array(v) for k, v in aux_params.items()},
                    allow_missing=False)
    return mod, full, classes


def _train(make, devices, chunks, schedule, replicas=1, steps=3, batchnorm='micro-batch'):
    """The last step's outputs, then every parameter and every running
    statistic after ``steps`` SGD steps (momentum 0.9)."""
    mod, sample, classes = _module(make, devices, chunks, schedule, replicas=replicas,
                                   batchnorm=batchnorm)
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


# -- batchnorm='deferred' ------------------------------------------------------


def _whole_batch_statistics(make, arg_params, aux_params, batch, chunks):
    """Each BatchNorm's running statistics after one update with the whole
    batch's mean and biased variance of what it reads, computed on one
    device: the network run by Gluon on ``cpu(0)`` with the given values,
    micro-batch by micro-batch in training mode (each BatchNorm normalises
    a micro-batch by its own statistics, as a pipeline's forward does), the
    inputs of its BatchNorms kept and joined, their statistics taken in
    float64."""
    net, _, _ = make()
    seq = gluon.nn.HybridSequential(prefix='')
    for block in net if isinstance(net, list) else [net]:
        seq.add(block)
    seq.collect_params().load_dict(dict(arg_params, **aux_params), ctx=mx.cpu(0))
    read = {}

    def keep(block):
        if isinstance(block, gluon.nn.BatchNorm):
            block.register_forward_pre_hook(
                lambda b, inputs: read.setdefault(b, []).append(inputs[0].asnumpy()))
        for child in block._children.values():  # pylint: disable=protected-access
            keep(child)

    keep(seq)
    data = batch.data[0]
    rows = data.shape[0] // chunks
    with mx.autograd.train_mode():
        for m in range(chunks):
            seq(data[m * rows:(m + 1) * rows])
    expected = {}
    for block, parts in read.items():
        values = np.concatenate(parts).astype(np.float64)
        axes = tuple(a for a in range(values.ndim) if a != 1)
        momentum = block._kwargs['momentum']  # pylint: disable=protected-access
        for param, stat in ((block.running_mean, values.mean(axis=axes)),
                            (block.running_var, values.var(axis=axes))):
            expected[param.name] = aux_params[param.name].asnumpy() * momentum + \
                stat * (1 - momentum)
    return expected


def _assert_within(ours, theirs, tol):
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=0, atol=tol, err_msg=name)


@pytest.mark.parametrize('make, chunks, steps', [
    (_digits, 2, 3), (_digits, 4, 3), (_mobilenet, 2, 1), (_mobilenet, 4, 1)],
    ids=['digits-2', 'digits-4', 'mobilenetv2_0.25-2', 'mobilenetv2_0.25-4'])
@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_deferred_statistics_are_the_whole_batchs_of_what_each_batchnorm_reads(
        make, chunks, steps, schedule):
    """With ``batchnorm='deferred'``, each step updates every running
    statistic once with the whole batch's mean and biased variance, within
    1e-6 of one device's over the whole batch (SGD with momentum 0.9 moves
    the weights between steps; MobileNetV2's random weights make its
    statistics grow past 1e3 after one step, so it is checked at the first)."""
    mod, sample, classes = _module(make, 'cpu:0,cpu:1', chunks, schedule, batchnorm='deferred')
    mod.init_optimizer(optimizer='sgd',
                       optimizer_params={'learning_rate': 0.01, 'momentum': 0.9})
    for step in range(steps):
        batch = _batch(sample, step, classes)
        arg_params, aux_params = mod.get_params()
        expected = _whole_batch_statistics(make, arg_params, aux_params, batch, chunks)
        mod.forward_backward(batch)
        mod.update()
        ours = {k: v.asnumpy() for k, v in mod.get_params()[1].items()}
        _assert_within(ours, expected, 1e-6)
    assert len(mod.get_outputs()) == 1 and mod.get_outputs()[0].shape == (sample[0], classes)
    assert mod.output_shapes == [('softmax_output', (sample[0], classes))]


@pytest.mark.parametrize('chunks', [2, 4])
def test_deferred_statistics_of_a_batchnorm_reading_the_data_equal_one_devices_whole_batch(
        chunks):
    """The digits CNN's first BatchNorm (``bn0``, after the first
    convolution: no other BatchNorm before it) after one step equals a
    Module on one device given the whole batch, within 1e-6, under GPipe
    and 1F1B alike; the default rule does not (each micro-batch's update
    in turn)."""
    batch = _batch((BATCH, 1, 8, 8), 0, 10)
    one, _, _ = _module(_digits, 'cpu:0', 1, 'gpipe')
    one.forward_backward(batch)
    expected = {k: v.asnumpy() for k, v in one.get_params()[1].items() if k.startswith('bn0_')}
    for schedule in ('gpipe', '1f1b'):
        for batchnorm in ('deferred', 'micro-batch'):
            mod, _, _ = _module(_digits, 'cpu:0,cpu:1', chunks, schedule, batchnorm=batchnorm)
            mod.forward_backward(batch)
            ours = {k: v.asnumpy() for k, v in mod.get_params()[1].items()
                    if k.startswith('bn0_')}
            if batchnorm == 'deferred':
                _assert_within(ours, expected, 1e-6)
            else:
                assert max(np.abs(ours[k] - v).max() for k, v in expected.items()) > 1e-3


@pytest.mark.parametrize('make, devices, replicas', [
    (_digits, 'cpu:0,cpu:1', 1), (_mobilenet, 'cpu:0,cpu:1', 1),
    (_digits, 'cpu:0,cpu:1,cpu:2,cpu:3', 2)], ids=['digits', 'mobilenetv2_0.25', 'replicas'])
def test_deferred_statistics_are_the_same_bit_for_bit_under_gpipe_1f1b_and_interleaved(
        make, devices, replicas):
    """The deferred update is one rule for every schedule: outputs,
    parameters and running statistics after three steps equal GPipe's one
    graph's bit for bit, each replica updating its own from its own
    micro-batches; they are not the default rule's."""
    out, params, stats = _train(make, devices, 2, 'gpipe', replicas, batchnorm='deferred')
    default = _train(make, devices, 2, 'gpipe', replicas)[2]
    assert any(not np.array_equal(stats[k], default[k]) for k in stats)
    for schedule in ('1f1b', 'interleaved'):
        ours = _train(make, devices, 2, schedule, replicas, batchnorm='deferred')
        assert np.array_equal(ours[0], out), schedule
        _assert_bitwise(ours[1], params)
        _assert_bitwise(ours[2], stats)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_deferred_with_one_chunk_is_the_default_rule(schedule):
    """With one micro-batch there is nothing to defer: the statistics are
    MXNet's own update, bit for bit."""
    ours = _train(_digits, 'cpu:0,cpu:1', 1, schedule, batchnorm='deferred')
    theirs = _train(_digits, 'cpu:0,cpu:1', 1, schedule)
    _assert_bitwise(ours[1], theirs[1])
    _assert_bitwise(ours[2], theirs[2])


def test_an_unknown_batchnorm_rule_is_refused_in_one_line():
    net, sample, _ = _digits()
    with pytest.raises(ValueError) as err:
        Pipeline(net, 'cpu:0,cpu:1', sample=sample, chunks=2, batchnorm='sync')
    assert str(err.value) == "batchnorm: expected one of 'micro-batch', 'deferred', found 'sync'"


def test_the_twin_refuses_to_train_with_deferred_statistics_and_chunks():
    """The imperative twin updates the statistics per micro-batch: under
    autograd in training it refuses ``'deferred'`` in one line; to predict
    it runs."""
    net, sample, _ = _digits()
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=sample, chunks=2, batchnorm='deferred')
    pipe.initialize()
    x = mx.nd.ones(sample)
    assert pipe(x).shape == (BATCH, 10)
    with mx.autograd.record(), pytest.raises(ValueError) as err:
        pipe(x)
    assert str(err.value).startswith("batchnorm: expected 'micro-batch' for the imperative twin")
    assert '\n' not in str(err.value)


def _cli(capsys, *args, train=('--task', 'digits', '--devices', 'cpu:0,cpu:1', '--epochs', '1',
                                '--no-progress', '--no-memory')):
    """``python -m mp_symbolic train`` ``train`` + ``args`` through the
    command's ``main`` in this process (the same argv and folders; no MXNet
    start): ``(status, stdout, stderr)``."""
    from conftest import cli_status  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    capsys.readouterr()
    status = cli_status(main, ['train'] + list(train) + list(args))
    said = capsys.readouterr()
    return status, said.out, said.err


def _saved_statistics(folder):
    found = [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files
             if f.endswith('-0001.params')]
    assert len(found) == 1, found
    return {k[4:]: v.asnumpy() for k, v in mx.nd.load(found[0]).items()
            if k.startswith('aux:')}


def test_batchnorm_deferred_from_the_command_line_is_one_rule_for_gpipe_and_1f1b(tmp_path,
                                                                                  capsys):
    """``--batchnorm deferred`` trains an epoch of the digits CNN in two
    micro-batches: the checkpoints' running statistics under ``--schedule
    gpipe`` and ``1f1b`` are the same bit for bit, and not the default
    rule's; the run says so in its title line, and so does its resume. An
    unknown rule is refused in one line before anything runs."""
    stats = {}
    for schedule, batchnorm in (('gpipe', 'deferred'), ('1f1b', 'deferred'),
                                ('gpipe', 'micro-batch')):
        out = tmp_path / ('%s-%s' % (schedule, batchnorm))
        status, stdout, stderr = _cli(capsys, '--chunks', '2', '--schedule', schedule,
                                      '--batchnorm', batchnorm, '--out', str(out))
        assert status == 0, stderr[-2000:]
        assert ('BatchNorm statistics deferred' in stdout) == (batchnorm == 'deferred')
        stats[schedule, batchnorm] = _saved_statistics(out)
    _assert_bitwise(stats['1f1b', 'deferred'], stats['gpipe', 'deferred'])
    # a resume keeps the rule unless --batchnorm is given
    status, stdout, stderr = _cli(capsys, '--resume', str(tmp_path / 'gpipe-deferred'),
                                  '--epochs', '2', '--no-progress', '--no-memory', train=())
    assert status == 0, stderr[-2000:]
    assert 'BatchNorm statistics deferred' in stdout
    default = stats['gpipe', 'micro-batch']
    assert any(not np.array_equal(v, default[k]) for k, v in stats['gpipe', 'deferred'].items())
    status, _, stderr = _cli(capsys, '--chunks', '2', '--batchnorm', 'sync',
                             '--out', str(tmp_path / 'bad'))
    assert status == 2
    assert len(stderr.strip().splitlines()) == 1 and 'sync' in stderr, stderr
    assert not (tmp_path / 'bad').exists()


@pytest.mark.slow
def test_nodes_given_other_batchnorm_rules_both_exit_2_in_one_line(tmp_path, port):
    """The BatchNorm rule is part of the plan every node compares before
    any tensor crosses."""
    from test_nodes import _nodes_given  # pylint: disable=import-outside-toplevel
    ended = _nodes_given(tmp_path, port, [['--chunks', '2'],
                                          ['--chunks', '2', '--batchnorm', 'deferred']])
    for status, lines, _ in ended:
        assert status == 2 and len(lines) == 1, lines[-20:]
        assert "node 1's batchnorm 'deferred' where node 0's is 'micro-batch'" in lines[0]
    assert not (tmp_path / 'run' / 'current').exists()


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_the_executor_api_updates_deferred_statistics_as_the_module_does(digits_data, schedule):
    """``--api executor --batchnorm deferred`` with chunks: the runtime the
    executor API drives updates the running statistics once per batch with
    the whole batch's, as the Module does: the same losses, parameters and
    statistics after four steps."""
    from conftest import load_config  # pylint: disable=import-outside-toplevel
    X, y = digits_data[0], digits_data[1]
    runs = {}
    for api in ('module', 'executor'):
        task, cfg = load_config(task='digits', devices='cpu:0,cpu:1', api=api, chunks=2,
                                schedule=schedule, batchnorm='deferred', progress=False,
                                batch_size=32)
        pipe, _ = loop.build_pipeline(cfg, task)
        stepper = loop.make_stepper(cfg, pipe, task, loop.initial_values(pipe, cfg.seed),
                                    y.shape[1:])
        losses = [stepper.step(*batch).asscalar()
                  for _, batch in zip(range(4), stepper.batches(X, y, 0))]
        runs[api] = losses, dict(stepper.params()), dict(stepper.aux())
    (losses, params, aux), (ref_losses, ref_params, ref_aux) = runs['executor'], runs['module']
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-7)
    assert sorted(aux) == sorted(ref_aux) and aux
    for name, value in list(ref_params.items()) + list(ref_aux.items()):
        np.testing.assert_allclose({**params, **aux}[name], value, rtol=1e-6, atol=1e-7,
                                   err_msg=name)
