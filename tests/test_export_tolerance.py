"""The export's tolerance knows float32: an output whose softmax saturates
(GluonCV's ResNet-18 with random weights, its classifier scaled so that the
logits reach 1000, split over ``cpu:0,cpu:1``) passes verification by
default where the rule of a fraction of the scale refused it, and real
defects of that export still fail: one classifier weight off by 1e-3 of
itself in the ``.params``, two convolutions' weights swapped in the
``.onnx``. ``--tolerance T`` keeps the rule of a fraction of the scale; a
well-conditioned output gets no float32 allowance. The rule and the
sensitivity are export/verify.py's (its module docstring).
"""
import json
import os

from gluoncv.model_zoo import get_model
import mxnet as mx
import numpy as np
import onnx
from onnx import numpy_helper
import pytest

import mp_symbolic
from mp_symbolic.core.base.compat import split_bind
from mp_symbolic.core.engine.device_module import DeviceModule

from export.__main__ import main as export_main
from export.exporter import export_checkpoint
from export.runtimes import MXNetPredictor, OnnxPredictor
from export.verify import (SENSITIVITY_FACTOR, SENSITIVITY_LIMIT, TOLERANCE, OneDeviceReference,
                           allowed_difference, perturbed_params, verify_export, within_tolerance)

SHAPE = (3, 32, 32)
LOGITS = 1000.0  # the largest |logit| on a batch of noise: the softmax saturates
DEVICES = 'cpu:0,cpu:1'


def _noise(n, seed):
    return np.random.default_rng(seed).normal(0, 1, (n,) + SHAPE).astype(np.float32)


def _logits(symbol, arg_params, aux_params, X):
    """The input of the softmax head on ``X``, on one device."""
    logits = symbol.get_children()[0]
    exe = logits.simple_bind(mx.cpu(0), grad_req='null', data=X.shape)
    exe.copy_params_from(arg_params, aux_params, allow_extra_params=True)
    return exe.forward(is_train=False, data=X)[0].asnumpy()


def _classifier(symbol):
    """``(weight name, the symbol of its input)`` of the last FullyConnected."""
    nodes = json.loads(symbol.tojson())['nodes']
    fc = [n for n in nodes if n['op'] == 'FullyConnected'][-1]
    data, weight = (nodes[i]['name'] for i, _, _ in fc['inputs'][:2])
    return weight, symbol.get_internals()[data + '_output']


@pytest.fixture(scope='module')
def saturated(tmp_path_factory):
    """The ResNet-18 checkpoint (epoch 0) and its export by default: batch
    sizes 1, 7 and 1000, as the activations allow."""
    folder = tmp_path_factory.mktemp('saturated')
    mx.random.seed(7)
    net = get_model('resnet18_v1', pretrained=False, classes=10)
    net.initialize(mx.init.Xavier())
    mod = mp_symbolic.Pipeline(net, DEVICES, sample=(1,) + SHAPE).module(loss='softmax')
    mod.bind(data_shapes=[('data', (2,) + SHAPE)], label_shapes=[('softmax_label', (2,))],
             for_training=False)
    # the network whose softmax these tests read: Xavier drawn as MXNet's own
    # Module draws it (one stream, in its sorted order), not by name
    DeviceModule.init_params(mod, mx.init.Xavier())
    arg_params, aux_params = mod.get_params()
    weight, _ = _classifier(mod.symbol)
    k = LOGITS / np.abs(_logits(mod.symbol, arg_params, aux_params, _noise(64, 0))).max()
    arg_params[weight] *= k
    arg_params[weight.replace('_weight', '_bias')] *= k
    mod.set_params(arg_params, aux_params)
    mp_symbolic.save_checkpoint(mod, str(folder / 'ck'), epoch=0)
    prefix = str(folder / 'ck' / 'current' / 'model')
    paths, report = export_checkpoint(prefix, str(folder / 'out'), epoch=0, log=lambda _: None)
    symbol, arg_params, aux_params = mx.model.load_checkpoint(prefix, 0)
    return {'prefix': prefix, 'paths': paths, 'report': report,
            'reference': OneDeviceReference(symbol, arg_params, aux_params, SHAPE)}


@pytest.mark.slow
def test_a_saturated_softmax_exports_by_default_where_a_fraction_of_the_scale_refused(
        saturated):
    report = saturated['report']
    reference = saturated['reference']
    z = _logits(reference.symbol, reference.arg_params, reference.aux_params, _noise(64, 0))
    assert np.abs(z).max() == pytest.approx(LOGITS, rel=1e-3)
    assert report['ok'] and report['batch_sizes'] == [1, 7, 1000]
    assert report['sensitivity_factor'] == SENSITIVITY_FACTOR and 'sensitivity' in \
        report['tolerance_rule']
    # rows that the rule max |difference| <= 1e-4 x scale alone refused, now passed
    refused = [row for row in report['parity'] if row['max_abs_diff'] > TOLERANCE * row['scale']]
    assert refused and all(row['ok'] for row in refused)
    for row in report['parity']:
        assert row['allowed'] == allowed_difference(row['scale'], TOLERANCE, row['sensitivity'])
        assert row['max_abs_diff'] <= row['allowed'] <= SENSITIVITY_LIMIT * TOLERANCE * \
            row['scale']
    # the same on arrays, on a batch of its own, by within_tolerance with and without
    X = _noise(200, 2)
    expected = reference(X)
    sensitivity = reference.sensitivity([X], expected)[0]
    old = []
    for runtime in (OnnxPredictor(saturated['paths']['onnx'], table=False),
                    MXNetPredictor.from_files(saturated['paths']['symbol'], devices=DEVICES)):
        got = runtime.run(X)[0]
        old.append(within_tolerance(got, expected[0], TOLERANCE)[0])
        assert within_tolerance(got, expected[0], TOLERANCE, sensitivity)[0]
    assert not all(old)
    assert sensitivity > TOLERANCE / SENSITIVITY_FACTOR  # the scale is 1: the softmax's


def _failed_runtimes(report):
    return sorted({row['runtime'].split()[0] for row in report['parity'] if not row['ok']})


@pytest.mark.slow
def test_one_classifier_weight_off_by_1e_3_of_itself_fails_by_default(saturated, tmp_path):
    """The weight that moves the leading logit of the sample nearest a tie of
    two classes the most: a saturated softmax shows no weight on the others,
    whatever the rule."""
    reference = saturated['reference']
    X = _noise(200, 2)
    probabilities = reference(X)[0]                    # (200, classes)
    row = int(np.argmax(np.sort(probabilities, axis=1)[:, -2]))
    assert np.sort(probabilities[row])[-2] > 1e-3      # a tie within a few logits of 1000
    c = int(np.argmax(probabilities[row]))
    weight, features = _classifier(reference.symbol)
    exe = features.simple_bind(mx.cpu(0), grad_req='null', data=X.shape)
    exe.copy_params_from(reference.arg_params, reference.aux_params, allow_extra_params=True)
    h = exe.forward(is_train=False, data=X)[0].asnumpy().reshape(len(X), -1)[row]
    params = mx.nd.load(saturated['paths']['params'])
    W = params['arg:' + weight].asnumpy()              # (classes, features)
    j = int(np.argmax(np.abs(W[c] * h)))
    W[c, j] *= np.float32(1 + 1e-3)
    params['arg:' + weight] = mx.nd.array(W)
    edited = str(tmp_path / 'model-0000.params')
    mx.nd.save(edited, params)
    report = verify_export(saturated['paths']['onnx'], saturated['paths']['symbol'], edited,
                           reference, batch_sizes=[len(X)], sample={'data': X})
    assert not report['ok']
    assert _failed_runtimes(report) == ['mxnet']  # the .onnx holds the weight as it was
    for row in report['parity']:
        if not row['ok']:
            assert row['max_abs_diff'] > row['allowed'] > TOLERANCE * row['scale']


def test_two_convolutions_weights_swapped_fail_by_default(saturated, tmp_path):
    model = onnx.load(saturated['paths']['onnx'])
    inits = {init.name: init for init in model.graph.initializer}
    a, b = (inits[n] for n in sorted(inits) if n.endswith(('stage1_conv0_weight',
                                                           'stage1_conv1_weight')))
    assert list(a.dims) == list(b.dims) == [64, 64, 3, 3]
    A, B = numpy_helper.to_array(a), numpy_helper.to_array(b)
    a.CopyFrom(numpy_helper.from_array(B, a.name))
    b.CopyFrom(numpy_helper.from_array(A, b.name))
    swapped = str(tmp_path / 'model.onnx')
    onnx.save(model, swapped)
    symbol, arg_params, aux_params = mx.model.load_checkpoint(saturated['prefix'], 0)
    reference = OneDeviceReference(symbol, arg_params, aux_params, SHAPE)  # verify releases it
    report = verify_export(swapped, saturated['paths']['symbol'], saturated['paths']['params'],
                           reference, batch_sizes=[200])
    assert not report['ok'] and _failed_runtimes(report) == ['onnxruntime']
    assert max(row['max_abs_diff'] for row in report['parity']) > 0.5  # classes change


def test_an_explicit_tolerance_is_a_fraction_of_the_scale_alone(saturated, tmp_path, capfd):
    out = tmp_path / 'out'
    assert export_main(['--checkpoint', saturated['prefix'], '--epoch', '0', '--out', str(out),
                        '--tolerance', '1e-4', '--verify-batches', '200']) == 1
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: verification failed, nothing '
                                                   'written: parity'), lines
    assert 'allowed 1.00e-04' in lines[0]
    assert not (out / 'current').exists()


def _small_cnn():
    """Convolution, BatchNorm, three Dense layers and a softmax head over two stages."""
    with mx.AttrScope(ctx_group='stage0'):
        h = mx.sym.Convolution(mx.sym.var('data'), num_filter=8, kernel=(3, 3), pad=(1, 1),
                               name='conv0')
        h = mx.sym.relu(mx.sym.BatchNorm(h, name='bn0'))
        h = mx.sym.relu(mx.sym.FullyConnected(mx.sym.flatten(h), num_hidden=32, name='dense0'))
    with mx.AttrScope(ctx_group='stage1'):
        h = mx.sym.relu(mx.sym.FullyConnected(h, num_hidden=32, name='dense1'))
        h = mx.sym.FullyConnected(h, num_hidden=10, name='dense2')
        return mx.sym.SoftmaxOutput(h, name='softmax')


def _save_small_cnn(prefix):
    group2ctx = {'stage0': mx.cpu(0), 'stage1': mx.cpu(1)}
    mx.random.seed(0)
    mod = mx.mod.Module(_small_cnn(), context=mx.cpu(0), group2ctxs=group2ctx)
    with split_bind(group2ctx):  # MXNet's oneDNN fusion across the two devices crashes
        mod.bind(data_shapes=[('data', (2, 3, 8, 8))],
                 label_shapes=[('softmax_label', (2,))], for_training=False)
    mod.init_params(mx.init.Xavier())
    mod.save_checkpoint(prefix, 1)
    return prefix


def test_the_sensitivity_is_the_largest_change_of_the_checkpoint_one_ulp_off(tmp_path):
    symbol, arg_params, aux_params = mx.model.load_checkpoint(
        _save_small_cnn(str(tmp_path / 'cnn')), 1)
    reference = OneDeviceReference(symbol, arg_params, aux_params, (3, 8, 8))
    X = np.random.default_rng(0).normal(0, 1, (50, 3, 8, 8)).astype(np.float32)
    expected = reference(X)
    changes = []
    for k in range(2):  # each parameter set in a fresh executor, as MXNet's own code binds
        exe = symbol.simple_bind(mx.cpu(0), grad_req='null', data=X.shape)
        exe.copy_params_from(perturbed_params(arg_params, (5, k, 0)),
                             perturbed_params(aux_params, (5, k, 1)))
        changes.append(np.max(np.abs(exe.forward(is_train=False, data=X)[0].asnumpy()
                                     - expected[0])))
    assert reference.sensitivity([X], expected, seed=5) == [max(changes)]
    assert 0 < max(changes) < 1e-5  # a few ulps of outputs below 1


def test_a_well_conditioned_output_gets_no_float32_allowance(tmp_path):
    _save_small_cnn(str(tmp_path / 'cnn'))
    _, report = export_checkpoint(str(tmp_path / 'cnn'), str(tmp_path / 'out'), epoch=1,
                                  input_shape=(3, 8, 8), log=lambda _: None)
    assert report['ok'] and report['batch_sizes'] == [1, 7, 1000]
    for row in report['parity']:
        assert row['allowed'] == TOLERANCE * row['scale']
        assert row['sensitivity'] < TOLERANCE * row['scale'] / SENSITIVITY_FACTOR
    assert max(row['sensitivity'] for row in report['parity']) > 0  # measured, not assumed
    with open(os.path.join(str(tmp_path / 'out'), 'current', 'cnn-verification.json')) as f:
        assert json.load(f)['parity'][0]['sensitivity'] is not None


def test_allowed_difference_takes_the_larger_up_to_the_limit():
    assert allowed_difference(1.0, 1e-4) == pytest.approx(1e-4)
    assert allowed_difference(1.0, 1e-4, 1e-6) == pytest.approx(1e-4)      # the scale's
    assert allowed_difference(1.0, 1e-4, 3e-5) == pytest.approx(3e-4)      # 10 x sensitivity
    assert allowed_difference(2.0, 1e-4, 1.0) == pytest.approx(2e-2)       # the limit
    assert allowed_difference(1.0, 1e-4, float('nan')) == pytest.approx(1e-4)
    assert allowed_difference(1.0, 1e-4, float('inf')) == pytest.approx(1e-4)
    assert allowed_difference(0.0, 1e-4, 1e-3) == 0                        # zeros: exactly
    assert allowed_difference(1.0, -1.0, 1e-3) < 0                         # nothing passes
    want = np.ones((3, 4), np.float32)
    assert not within_tolerance(want + 2e-4, want, 1e-4)[0]
    assert within_tolerance(want + 2e-4, want, 1e-4, sensitivity=3e-5)[0]
    assert not within_tolerance(want + 2e-2, want, 1e-4, sensitivity=1.0)[0]


def test_perturbed_params_move_every_nonzero_finite_value_one_ulp():
    big = np.finfo(np.float32).max
    values = np.array([0, -0.0, np.inf, -np.inf, np.nan, big, -big, 1e-45, 1.0, -3.5, 2.0],
                      np.float32)
    rng = np.random.default_rng(0)
    params = {'x': mx.nd.array(values), 'w': mx.nd.array(rng.normal(0, 1, (64, 64))),
              'd': mx.nd.array([1.0, -3.0], dtype=np.float64),
              'h': mx.nd.array([1.0, 2.0], dtype=np.float16),
              'i': mx.nd.array([1, 2], dtype=np.int32)}
    moved = perturbed_params(params, 3)
    again = perturbed_params(params, 3)
    other = perturbed_params(params, 4)
    for name, value in params.items():
        was, now = value.asnumpy(), moved[name].asnumpy()
        assert now.dtype == was.dtype
        np.testing.assert_array_equal(now, again[name].asnumpy())  # by its seed
        if name == 'i':
            np.testing.assert_array_equal(now, was)
            continue
        with np.errstate(over='ignore'):  # the largest finite value, one ulp up
            one_ulp = ((now == np.nextafter(was, np.array(np.inf, was.dtype)))
                       | (now == np.nextafter(was, np.array(-np.inf, was.dtype))))
        kept = (was == 0) | ~np.isfinite(was)
        largest = np.abs(was) == np.finfo(was.dtype).max  # kept where moved up
        assert np.all(one_ulp[~kept & ~largest]) and np.all(one_ulp[largest]
                                                            | (now[largest] == was[largest]))
        assert np.all(now[kept & ~np.isnan(was)] == was[kept & ~np.isnan(was)])
    x = moved['x'].asnumpy()
    assert np.isnan(x[4]) and np.isfinite(x[5:7]).all()
    assert np.signbit(x[1]) and not np.signbit(x[0])  # -0.0 and 0.0 as they were
    w, w_moved = params['w'].asnumpy(), moved['w'].asnumpy()
    assert 0.45 < np.mean(np.abs(w_moved) > np.abs(w)) < 0.55  # up or down at random
    assert not np.array_equal(w_moved, other['w'].asnumpy())


def test_the_sensitivity_puts_the_checkpoints_arrays_back_bit_for_bit(saturated):
    """The perturbed runs write into the checkpoint's own arrays (no second
    copy of the parameters) and put every bit back, edge values included."""
    from export.verify import _moved, _one_ulp_off, _put_back  # pylint: disable=import-outside-toplevel
    tiny = np.finfo(np.float32).tiny
    edges = np.array([0.0, -0.0, 1e-45, -1e-45, tiny, np.finfo(np.float32).max,
                      -np.finfo(np.float32).max, np.inf, -np.inf, np.nan, 1.0, -2.5],
                     dtype=np.float32)
    for seed in range(8):
        array = mx.nd.array(edges, dtype=np.float32)
        off = _one_ulp_off(edges, np.random.default_rng(seed))
        record = _moved(array, edges, off)
        array[:] = off
        _put_back(*record)
        assert array.asnumpy().tobytes() == edges.tobytes(), seed
    symbol, arg_params, aux_params = mx.model.load_checkpoint(saturated['prefix'], 0)
    reference = OneDeviceReference(symbol, arg_params, aux_params, SHAPE)
    before = {n: a.asnumpy().tobytes() for n, a in reference.arg_params.items()}
    X = _noise(8, 5)
    expected = reference(X)
    assert reference.sensitivity([X], expected)[0] > 0
    assert {n: a.asnumpy().tobytes() for n, a in reference.arg_params.items()} == before
    np.testing.assert_array_equal(reference(X)[0], expected[0])
