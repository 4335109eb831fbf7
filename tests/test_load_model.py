"""``export.load_model``: the exported pair bound on a device plan or one
device, against onnxruntime on the same export, for the regression MLP and
the digits CNN (convolution, BatchNorm and ReLU across stage boundaries)."""
import os
import shutil

import mxnet as mx
import numpy as np
import onnxruntime as ort
import pytest

from mp_symbolic.training.config import TrainConfig
from mp_symbolic.core.placement.devices import DeviceSpecError
from mp_symbolic.tools.store import StoreError
from mp_symbolic.training.loop import train

import export
from export.errors import InputError, ModelFileError
from export.exporter import export_checkpoint

TOL = 1e-5
THREE = 'cpu:0,cpu:1,cpu:2'


def _export(task, tmp_path_factory):
    run = str(tmp_path_factory.mktemp(task))
    train(TrainConfig(task=task, num_epochs=1, progress=False, devices=THREE, out=run),
          log=lambda line: None)
    out = str(tmp_path_factory.mktemp(task + '-export'))
    paths, report = export_checkpoint(run, out, log=lambda line: None)
    assert report['ok']
    return out, paths


@pytest.fixture(scope='module')
def regression_export(tmp_path_factory):
    return ('regression',) + _export('regression', tmp_path_factory)


@pytest.fixture(scope='module')
def digits_export(tmp_path_factory):
    return ('digits',) + _export('digits', tmp_path_factory)


@pytest.fixture(params=['regression', 'digits'])
def exported(request):
    """``(task, export folder, paths)`` of a one-epoch run on three devices."""
    return request.getfixturevalue(request.param + '_export')


def _onnx(paths, X):
    session = ort.InferenceSession(paths['onnx'], providers=['CPUExecutionProvider'])
    return session.run(None, {'data': X})[0]


def _batch(model, n, seed):
    return np.random.default_rng(seed).normal(0, 1, (n,) + model.sample_shape).astype(np.float32)


@pytest.mark.parametrize('devices', [THREE, 'cpu:0,cpu:1', 'cpu:0', [mx.cpu(1)], None])
def test_loaded_model_matches_onnxruntime_on_any_plan(exported, devices):
    _, out, paths = exported
    model = export.load_model(out, devices=devices)
    for n in (1, 7, 37):
        X = _batch(model, n, n)
        expected = _onnx(paths, X)
        np.testing.assert_allclose(model.predict(X), expected, rtol=TOL, atol=TOL)
        np.testing.assert_allclose(model.predict(mx.nd.array(X)), expected, rtol=TOL, atol=TOL)


def test_loaded_model_places_each_stage_on_its_device(exported):
    _, out, _ = exported
    model = export.load_model(out, devices=THREE)
    assert model.group2ctx == {'stage%d' % s: mx.cpu(s) for s in range(3)}
    model.predict(_batch(model, 2, 0))
    internals = model.symbol.get_internals()
    placement = model.placement()
    assert len({ctx for ctx in placement.values()}) == 3
    for name, ctx in placement.items():
        assert ctx == model.group2ctx[internals[name].attr('ctx_group')], name


@pytest.mark.parametrize('how', ['folder', 'current', 'prefix', 'symbol file', 'epoch'])
def test_load_model_finds_the_pair_from_each_kind_of_path(exported, how):
    task, out, paths = exported
    prefix = paths['symbol'][:-len('-symbol.json')]
    path, epoch = {'folder': (out, None), 'current': (out + '/current', None),
                   'prefix': (prefix, None), 'symbol file': (paths['symbol'], None),
                   'epoch': (prefix, 0)}[how]
    model = export.load_model(path, devices='cpu:0', epoch=epoch)
    assert model.path.endswith('%s-symbol.json' % task)
    assert model.params_path.endswith('%s-0000.params' % task)


def test_symbol_block_matches_onnxruntime(exported):
    _, out, paths = exported
    model = export.load_model(out, devices='cpu:0')
    net = model.symbol_block()
    X = _batch(model, 9, 3)
    np.testing.assert_allclose(net(mx.nd.array(X)).asnumpy(), _onnx(paths, X),
                               rtol=TOL, atol=TOL)
    assert {p.data().context for p in net.collect_params().values()} == {mx.cpu(0)}


def test_split_bind_without_the_onednn_workaround_fails_on_the_digits_cnn(digits_export,
                                                                          monkeypatch):
    """Why the loader binds inside split_bind: a plain split bind (oneDNN's
    subgraph backend on, as by default) fails on the CNN."""
    _, out, paths = digits_export
    monkeypatch.delenv('MXNET_SUBGRAPH_BACKEND', raising=False)
    sym, arg_params, aux_params = mx.model.load_checkpoint(
        paths['symbol'][:-len('-symbol.json')], 0)
    group2ctx = {'stage%d' % s: mx.cpu(s) for s in range(3)}
    X = np.zeros((4, 1, 8, 8), np.float32)
    with pytest.raises(mx.base.MXNetError, match='MKLDNN memory desc'):
        exe = sym.simple_bind(ctx=mx.cpu(0), group2ctx=group2ctx, grad_req='null',
                              data=X.shape)
        exe.copy_params_from(arg_params, aux_params)
        exe.forward(is_train=False, data=X)[0].asnumpy()
    model = export.load_model(out, devices=THREE)
    np.testing.assert_allclose(model.predict(X), _onnx(paths, X), rtol=TOL, atol=TOL)


@pytest.mark.parametrize('path, message', [
    ('nowhere', 'expected an export folder, a <name>-symbol.json file or the prefix of one, '
                'found nothing of the kind at'),
    ('empty-folder', 'expected one <name>-symbol.json in the export folder'),
])
def test_load_model_refuses_a_path_without_a_pair(tmp_path, path, message):
    (tmp_path / 'empty-folder').mkdir()
    with pytest.raises(ModelFileError, match=message):
        export.load_model(str(tmp_path / path))


def test_load_model_refuses_bad_epoch_devices_and_input(exported):
    _, out, paths = exported
    prefix = paths['symbol'][:-len('-symbol.json')]
    with pytest.raises(ModelFileError, match='-0003.params for epoch 3, found none'):
        export.load_model(prefix, epoch=3)
    with pytest.raises(DeviceSpecError):
        export.load_model(out, devices='cpu:0,cpu:1,cpu:2,cpu:3')
    model = export.load_model(out, devices='cpu:0')
    with pytest.raises(InputError, match='expected'):
        model.predict(np.zeros((3, 5), np.float32))
    with pytest.raises(InputError, match=r'^expected .* found shape \(%s' % model.sample_shape[0]):
        model.predict(np.zeros(model.sample_shape, np.float32))  # one sample, unbatched


def test_load_model_refuses_a_committed_export_whose_files_changed(regression_export, tmp_path):
    _, out, paths = regression_export
    copy = tmp_path / 'export'
    shutil.copytree(out, str(copy), symlinks=True)
    params = copy / 'current' / os.path.basename(paths['params'])
    data = bytearray(params.read_bytes())
    data[-1] ^= 1
    params.write_bytes(bytes(data))
    with pytest.raises(StoreError, match='regression-0000.params: expected sha256'):
        export.load_model(str(copy))
