"""An ONNX model too large for one protobuf message is written in ONNX's
external-data format: its weights' values in ``<name>.onnx.data`` beside
``<name>.onnx``, committed with the rest of the export, verified (the
checker on the path, shape inference, onnxruntime), and read back by
onnxruntime, ``onnx.load``, ``load_model`` and ``python -m export.predict``.

A model over 2 GB takes minutes to export here, so the tests lower the
threshold (``external_data_threshold``) on three Dense layers whose weights
(more than 65,536 values each) go outside; docs/export.md gives the 2.4 GB
case measured by hand.
"""
import os
import shutil

import mxnet as mx
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import export
from export import converters
from export.exporter import export_checkpoint
from export.onnx_export import (EXTERNAL_DATA_ALIGNMENT, PROTOBUF_LIMIT, onnx_file_bytes,
                                save_onnx)
from export.predict import main as predict_main
from mp_symbolic.core.base.parts import write_mxnet_params

UNITS, LAYERS = 300, 3  # 90,000 values a weight: each goes outside


def _forward(params, X):
    for i in range(LAYERS):
        X = X @ params['dense%d_weight' % i].T + params['dense%d_bias' % i]
        if i < LAYERS - 1:
            X = np.maximum(X, 0)
    return X


def _pair(folder):
    """Dense layers over three stages, saved as an MXNet pair; the arrays."""
    with mx.AttrScope(ctx_group='stage0'):
        x = mx.sym.var('data')
    for i in range(LAYERS):
        with mx.AttrScope(ctx_group='stage%d' % i):
            x = mx.sym.FullyConnected(x, num_hidden=UNITS, name='dense%d' % i)
            if i < LAYERS - 1:
                x = mx.sym.relu(x)
    prefix = os.path.join(folder, 'dense')
    x.save(prefix + '-symbol.json')
    rng = np.random.default_rng(0)
    params = {}
    for i in range(LAYERS):
        params['dense%d_weight' % i] = (rng.standard_normal((UNITS, UNITS)) /
                                        np.sqrt(UNITS)).astype(np.float32)
        params['dense%d_bias' % i] = rng.standard_normal(UNITS).astype(np.float32)
    write_mxnet_params(prefix + '-0000.params', [('arg:' + k, v) for k, v in params.items()])
    return prefix, params


@pytest.fixture(scope='module')
def outside(tmp_path_factory):
    """The pair exported with every model forced into external data."""
    folder = str(tmp_path_factory.mktemp('dense'))
    prefix, params = _pair(folder)
    out = os.path.join(folder, 'export')
    lines = []
    paths, report = export_checkpoint(prefix, out, epoch=0, input_shape=(UNITS,),
                                      log=lines.append, verify_batches=[1, 7],
                                      external_data_threshold=0)
    return {'prefix': prefix, 'params': params, 'out': out, 'paths': paths,
            'report': report, 'lines': lines}


def test_weights_go_to_one_data_file_committed_beside_the_model(outside):
    current = os.path.join(outside['out'], 'current')
    assert sorted(os.listdir(current)) == sorted(
        ['MANIFEST.json', 'dense-symbol.json', 'dense-0000.params', 'dense.onnx',
         'dense.onnx.data', 'dense-verification.json'])
    assert outside['paths']['onnx_data'] == outside['paths']['onnx'] + '.data'
    assert os.path.dirname(outside['paths']['onnx']) == os.path.realpath(current)
    weights = sum(v.nbytes for k, v in outside['params'].items() if k.endswith('weight'))
    assert os.path.getsize(os.path.join(current, 'dense.onnx')) < weights // 10
    assert os.path.getsize(os.path.join(current, 'dense.onnx.data')) >= weights
    model = onnx.load(os.path.join(current, 'dense.onnx'), load_external_data=False)
    placed = {t.name: {e.key: e.value for e in t.external_data}
              for t in model.graph.initializer
              if t.data_location == onnx.TensorProto.EXTERNAL}
    assert sorted(placed) == ['dense%d_weight' % i for i in range(LAYERS)]
    assert all(p['location'] == 'dense.onnx.data' and
               int(p['offset']) % EXTERNAL_DATA_ALIGNMENT == 0 for p in placed.values())
    assert any('dense.onnx.data beside it (ONNX external data' in line
               for line in outside['lines'])


def test_external_data_model_passes_checker_shape_inference_and_parity(outside):
    report = outside['report']
    assert report['ok'] is True
    checks = {c['name']: c for c in report['checks']}
    assert checks['onnx checker (full_check)']['ok']
    assert checks['shape inference (strict)']['ok']
    assert checks['weights in external data']['ok']
    assert checks['weights in external data']['detail'].startswith(
        '3 initializers, ') and 'dense.onnx.data' in checks['weights in external data']['detail']
    runtimes = {row['runtime'].split()[0] for row in report['parity']}
    assert runtimes == {'onnxruntime', 'mxnet'} and all(r['ok'] for r in report['parity'])
    onnx.checker.check_model(outside['paths']['onnx'], full_check=True)


def test_onnx_load_reads_the_weights_back_exactly(outside):
    model = onnx.load(outside['paths']['onnx'])
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for name, value in outside['params'].items():
        np.testing.assert_array_equal(values[name], value)


def test_onnxruntime_load_model_and_predict_run_the_external_export(outside, tmp_path):
    X = np.random.default_rng(1).standard_normal((5, UNITS)).astype(np.float32)
    expected = _forward(outside['params'], X)
    session = ort.InferenceSession(outside['paths']['onnx'], providers=['CPUExecutionProvider'])
    onnx_out = session.run(None, {'data': X})[0]
    np.testing.assert_allclose(onnx_out, expected, rtol=0, atol=1e-4)
    model = export.load_model(outside['out'], devices='cpu:0,cpu:1,cpu:2')
    np.testing.assert_allclose(model.predict(X), onnx_out, rtol=0, atol=1e-5)
    np.save(str(tmp_path / 'x.npy'), X)
    assert predict_main(['--model', outside['paths']['onnx'], '--input', str(tmp_path / 'x.npy'),
                         '--output', str(tmp_path / 'y.npy')]) == 0
    np.testing.assert_array_equal(np.load(str(tmp_path / 'y.npy')), onnx_out)


def test_predict_refuses_an_external_export_whose_data_file_changed(outside, tmp_path, capfd):
    copy = tmp_path / 'export'
    shutil.copytree(outside['out'], str(copy), symlinks=True)
    data = copy / 'current' / 'dense.onnx.data'
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    np.save(str(tmp_path / 'x.npy'), np.zeros((2, UNITS), np.float32))
    assert predict_main(['--model', str(copy / 'current' / 'dense.onnx'),
                         '--input', str(tmp_path / 'x.npy')]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and 'dense.onnx.data: expected sha256' in lines[0], lines


def test_a_model_within_the_limit_stays_one_file(outside, tmp_path):
    paths, report = export_checkpoint(outside['prefix'], str(tmp_path / 'one'), epoch=0,
                                      input_shape=(UNITS,), log=lambda line: None,
                                      verify_batches=[1])
    assert report['ok'] and 'onnx_data' not in paths
    assert not os.path.exists(paths['onnx'] + '.data')
    assert 'weights in external data' not in {c['name'] for c in report['checks']}


def test_save_onnx_switches_to_external_data_past_the_threshold(tmp_path):
    # small integers: every sum of the product is exact in float32 (at most 700 x 250,
    # below 2^24), so onnxruntime's kernel on any CPU gives numpy's values in any order
    weight = (np.arange(70000) % 251).astype(np.float32).reshape(700, 100)
    small = np.array([1, -1], dtype=np.int64)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node('MatMul', ['x', 'w'], ['y']),
         onnx.helper.make_node('Reshape', ['y', 's'], ['z'])], 'g',
        [onnx.helper.make_tensor_value_info('x', onnx.TensorProto.FLOAT, [2, 700])],
        [onnx.helper.make_tensor_value_info('z', onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(weight, 'w'), onnx.numpy_helper.from_array(small, 's')])
    model = onnx.helper.make_model(graph)
    before = model.SerializeToString()
    size = onnx_file_bytes(model)
    assert size == len(before)
    one = str(tmp_path / 'one.onnx')
    assert save_onnx(model, one, external_data_threshold=size) is None
    assert os.path.getsize(one) == size and not os.path.exists(one + '.data')
    two = str(tmp_path / 'two.onnx')
    assert save_onnx(model, two, external_data_threshold=size - 1) == two + '.data'
    assert model.SerializeToString() == before  # the model given is not changed
    assert os.path.getsize(two) < 1000 and os.path.getsize(two + '.data') == weight.nbytes
    light = onnx.load(two, load_external_data=False)
    assert [t.data_location for t in light.graph.initializer] == [
        onnx.TensorProto.EXTERNAL, onnx.TensorProto.DEFAULT]  # the small one stays inside
    back = onnx.load(two)
    assert back.graph.initializer[0].data_location == onnx.TensorProto.DEFAULT
    back.graph.initializer[0].ClearField('data_location')  # onnx.load sets it; model had none
    assert back == model
    X = np.ones((2, 700), np.float32)
    got = ort.InferenceSession(two, providers=['CPUExecutionProvider']).run(None, {'x': X})[0]
    np.testing.assert_array_equal(got, (X @ weight).reshape(1, -1))
    assert PROTOBUF_LIMIT == 2 ** 31 - 1


@pytest.mark.parametrize('threshold', [PROTOBUF_LIMIT, 0], ids=['one file', 'external data'])
def test_save_onnx_reads_held_back_weights_into_the_same_files(tmp_path, threshold):
    """The export writes the weights' values from the checkpoint's arrays as
    the file is written (to_onnx(fill=False)): the files are those of the
    model with its values in."""
    weight = np.random.default_rng(0).standard_normal((300, 300)).astype(np.float32)
    bias = np.arange(300, dtype=np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node('Gemm', ['x', 'w', 'b'], ['y'], transB=1)], 'g',
        [onnx.helper.make_tensor_value_info('x', onnx.TensorProto.FLOAT, [2, 300])],
        [onnx.helper.make_tensor_value_info('y', onnx.TensorProto.FLOAT, [2, 300])],
        [onnx.numpy_helper.from_array(weight, 'w'), onnx.numpy_helper.from_array(bias, 'b')])
    full = onnx.helper.make_model(graph)
    held = onnx.ModelProto()
    held.CopyFrom(full)
    held.graph.initializer[0].ClearField('raw_data')
    weights = converters.Weights({'arg:w': mx.nd.array(weight)})
    weights.deferred.add('w')
    assert onnx_file_bytes(held, weights) == onnx_file_bytes(full) == full.ByteSize()
    a, b = str(tmp_path / 'a.onnx'), str(tmp_path / 'b.onnx')
    save_onnx(full, a, threshold)
    save_onnx(held, b, threshold, weights)
    with open(a, 'rb') as fa, open(b, 'rb') as fb:
        assert fa.read() == fb.read().replace(b'b.onnx.data', b'a.onnx.data')
    if not threshold:
        with open(a + '.data', 'rb') as fa, open(b + '.data', 'rb') as fb:
            assert fa.read() == fb.read() == weight.tobytes()
    assert onnx.numpy_helper.to_array(onnx.load(b).graph.initializer[0]).tobytes() == \
        weight.tobytes()
