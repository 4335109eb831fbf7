"""Export to symbol/params and ONNX, and prediction from both in MXNet and
onnxruntime: round trips, placement, parity, metadata, and refusals."""
import io
import json
import os
import shutil

import mxnet as mx
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mp_symbolic.training.tasks.regression import forward_numpy
from mp_symbolic.training.loop import train

from export import onnx_export
from export.__main__ import main as export_main
from export.errors import ExportError
from export.exporter import export_checkpoint
from mp_symbolic.tools.files import sha256_file
from export.predict import main as predict_main
from export.runtimes import MXNetPredictor, OnnxPredictor

from conftest import make_config

TOL = 1e-5
STAGES = ('stage0', 'stage1', 'stage2')


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A short model-parallel training run on cpu(0), cpu(1), cpu(2)."""
    out = tmp_path_factory.mktemp('symbolic')
    result = train(make_config(num_epochs=2, progress=False, devices='cpu:0,cpu:1,cpu:2',
                               out=str(out)), log=lambda line: None)
    return {'dir': str(out), 'params': result.params, 'files': result.files,
            'params_file': result.files['params']}


@pytest.fixture(scope='module')
def exported(trained, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('export'))
    lines = []
    paths, report = export_checkpoint(trained['dir'], out, log=lines.append)
    return {'dir': out, 'paths': paths, 'report': report, 'lines': lines}


def _features(n, seed):
    return np.random.default_rng(seed).normal(0, 2, (n, 2)).astype(np.float32)


def _one_error_line(text):
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert lines[0].startswith('error: ')
    return lines[0]


# -- export ---------------------------------------------------------------

def test_export_commits_files_and_a_passing_report(exported):
    current = os.path.join(exported['dir'], 'current')
    assert sorted(os.listdir(current)) == sorted(
        [os.path.basename(p) for p in exported['paths'].values()] + ['MANIFEST.json'])
    assert sorted(n for n in os.listdir(exported['dir']) if not n.startswith('snap-')) == [
        '.kind', '.lock', 'current']  # no temporaries left
    with open(exported['paths']['report']) as f:
        report = json.load(f)
    assert report['ok'] is True
    assert {row['batch_size'] for row in report['parity']} == {1, 7, 1000}
    assert all(row['max_abs_diff'] <= TOL for row in report['parity'])
    assert all(check['ok'] for check in report['checks'])
    assert any(line.startswith('verification: PASSED') for line in exported['lines'])


def test_symbol_has_no_loss_head_and_keeps_ctx_group(exported):
    with open(exported['paths']['symbol']) as f:
        nodes = json.load(f)['nodes']
    ops = [n['op'] for n in nodes]
    assert 'LinearRegressionOutput' not in ops and ops.count('FullyConnected') == 3
    assert 'label' not in [n['name'] for n in nodes]
    groups = {n['name']: n['attrs']['__ctx_group__'] for n in nodes}
    assert groups['data'] == 'stage0'
    for layer, stage in enumerate(STAGES):
        for suffix in ('weight', 'bias', 'fwd'):
            assert groups['layer%d_%s' % (layer, suffix)] == stage


@pytest.mark.parametrize('devices, expected', [
    ('cpu:0', {s: mx.cpu(0) for s in STAGES}),
    ('cpu:0,cpu:1,cpu:2', {s: mx.cpu(i) for i, s in enumerate(STAGES)}),
])
def test_pair_rebinds_model_parallel(exported, trained, devices, expected):
    predictor = MXNetPredictor.from_files(exported['paths']['symbol'], devices=devices)
    assert predictor.group2ctx == expected
    for n in (3, 50):
        X = _features(n, n)
        np.testing.assert_allclose(predictor.predict(X), forward_numpy(trained['params'], X),
                                   rtol=0, atol=TOL)
    placement = predictor.placement()
    assert set(placement) == {'data'} | {'layer%d_%s' % (i, k) for i in range(3)
                                         for k in ('weight', 'bias')}
    for name, ctx in placement.items():
        stage = 'stage0' if name == 'data' else 'stage%s' % name[len('layer')]
        assert ctx == expected[stage], name


def test_pair_loads_in_plain_mxnet(exported, trained):
    prefix = exported['paths']['symbol'][:-len('-symbol.json')]
    sym, arg_params, aux_params = mx.model.load_checkpoint(prefix, 0)
    group2ctx = {'stage0': mx.cpu(0), 'stage1': mx.cpu(1), 'stage2': mx.cpu(2)}
    exe = sym.simple_bind(ctx=mx.cpu(0), group2ctx=group2ctx, grad_req='null', data=(5, 2))
    exe.copy_params_from(arg_params, aux_params)
    X = _features(5, 11)
    out = exe.forward(is_train=False, data=X)[0].asnumpy()
    np.testing.assert_allclose(out, forward_numpy(trained['params'], X), rtol=0, atol=TOL)
    assert exe.arg_dict['layer2_weight'].context == mx.cpu(2)


# -- ONNX -----------------------------------------------------------------

def test_onnx_parity_at_new_batch_sizes(exported, trained):
    session = ort.InferenceSession(exported['paths']['onnx'], providers=['CPUExecutionProvider'])
    for n in (3, 50):
        X = _features(n, 100 + n)
        (out,) = session.run(None, {'data': X})
        assert out.shape == (n, 1)
        np.testing.assert_allclose(out, forward_numpy(trained['params'], X), rtol=0, atol=TOL)


def test_onnx_metadata_and_opset(exported, trained):
    model = onnx.load(exported['paths']['onnx'])
    props = {p.key: p.value for p in model.metadata_props}
    for key in ('producer', 'producer_version', 'mxnet_version', 'input_names', 'input_shapes',
                'output_names', 'output_shapes', 'stages', 'source_params_sha256'):
        assert props.get(key), key
    assert props['mxnet_version'] == mx.__version__
    assert props['source_params_sha256'] == sha256_file(trained['params_file'])
    assert json.loads(props['input_shapes']) == {'data': ['batch', 2]}
    stages = json.loads(props['stages'])
    assert {s: stages[s]['layers'] for s in stages} == {'stage0': ['layer0'],
                                                        'stage1': ['layer1'],
                                                        'stage2': ['layer2']}
    assert [(o.domain, o.version) for o in model.opset_import] == [('', 13)]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == 'batch'


def test_onnx_weights_are_initializers_not_inputs(exported):
    model = onnx.load(exported['paths']['onnx'])
    assert [i.name for i in model.graph.input] == ['data']
    initializers = {i.name for i in model.graph.initializer}
    assert {'layer0_weight', 'layer2_bias'} <= initializers


def test_onnxruntime_loads_without_warnings(exported, tmp_path, capfd):
    capfd.readouterr()
    ort.InferenceSession(exported['paths']['onnx'], providers=['CPUExecutionProvider'])
    assert capfd.readouterr().err == ''
    # The same capture does see the warning for weights left in the graph inputs.
    model = onnx.load(exported['paths']['onnx'])
    weight = next(i for i in model.graph.initializer if i.name == 'layer0_weight')
    model.graph.input.append(onnx.helper.make_tensor_value_info(
        weight.name, weight.data_type, list(weight.dims)))
    onnx.save(model, str(tmp_path / 'weights-as-inputs.onnx'))
    ort.InferenceSession(str(tmp_path / 'weights-as-inputs.onnx'),
                         providers=['CPUExecutionProvider'])
    assert 'layer0_weight appears in graph inputs' in capfd.readouterr().err


def test_exporter_refuses_onnx_that_breaks_it(monkeypatch):
    monkeypatch.setattr(onnx, '__version__', '1.18.0')
    with pytest.raises(ExportError, match='onnx<1.18'):
        onnx_export.check_onnx_version()


# -- refusals of bad checkpoints ------------------------------------------

def _damage(params_file, how):
    if how == 'corrupt':
        with open(params_file, 'wb') as f:
            f.write(b'not an ndarray file')
        return
    if how == 'missing file':
        os.remove(params_file)
        return
    arrays = mx.nd.load(params_file)
    if how == 'missing array':
        del arrays['arg:layer1_bias']
    elif how == 'extra array':
        arrays['arg:layer3_weight'] = mx.nd.zeros((1, 1))
    elif how == 'wrong shape':
        arrays['arg:layer2_weight'] = mx.nd.zeros((3, 2))
    mx.nd.save(params_file, arrays)


def _plain_pair(trained, folder):
    """The trained checkpoint as a plain MXNet pair (prefix, epoch) in ``folder``."""
    folder.mkdir()
    for key in ('symbol', 'params'):
        shutil.copy(trained['files'][key], str(folder))
    return str(folder / 'regression'), 2


@pytest.mark.parametrize('how, message', [
    ('missing array', 'missing layer1_bias'),
    ('extra array', 'unexpected layer3_weight'),
    ('wrong shape', 'layer2_weight has shape (3, 2)'),
    ('corrupt', 'is not an MXNet params file'),
    ('missing file', 'expected a checkpoint file'),
])
def test_export_refuses_bad_checkpoint(trained, tmp_path, capfd, how, message):
    prefix, epoch = _plain_pair(trained, tmp_path / 'checkpoint')
    _damage('%s-%04d.params' % (prefix, epoch), how)
    out = tmp_path / 'out'
    capfd.readouterr()
    assert export_main(['--checkpoint', prefix, '--epoch', str(epoch), '--out', str(out)]) == 2
    assert message in _one_error_line(capfd.readouterr().err)
    assert not (out / 'current').exists()


def test_export_refuses_a_tampered_training_folder(trained, tmp_path, capfd):
    """A committed training folder is verified file by file before export."""
    checkpoint = tmp_path / 'run'
    shutil.copytree(trained['dir'], str(checkpoint), symlinks=True)
    params = checkpoint / 'current' / os.path.basename(trained['params_file'])
    params.write_bytes(params.read_bytes()[:-1] + b'\x00')
    assert export_main(['--checkpoint', str(checkpoint), '--out', str(tmp_path / 'out')]) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert os.path.basename(trained['params_file']) in line and 'sha256' in line


def test_export_of_a_missing_training_run_says_how_to_make_one(tmp_path, capfd):
    """Export never trains."""
    missing = tmp_path / 'no-such-run'
    assert export_main(['--checkpoint', str(missing), '--out', str(tmp_path / 'out')]) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert 'expected a training folder or a checkpoint prefix at' in line
    assert 'make train-symbolic' in line
    assert not missing.exists() and not (tmp_path / 'out').exists()


def test_export_refuses_its_own_checkpoint_folder_as_out(trained, capfd):
    assert export_main(['--checkpoint', trained['dir'], '--out', trained['dir']]) == 2
    assert "expected a folder other than the checkpoint's own" in \
        _one_error_line(capfd.readouterr().err)


def test_failed_verification_writes_nothing(trained, tmp_path, capfd, monkeypatch):
    from export import verify  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(verify, 'TOLERANCE', -1.0)  # nothing is within a negative tolerance
    out = tmp_path / 'out'
    assert export_main(['--checkpoint', trained['dir'], '--out', str(out)]) == 1
    err = capfd.readouterr().err
    assert 'verification failed, nothing written: parity' in _one_error_line(err)
    assert not (out / 'current').exists()
    assert [n for n in os.listdir(out) if n != '.lock'] == []


def test_export_refuses_misshaped_arrays_without_shape_attributes(trained, tmp_path, capfd):
    """With no __shape__ attributes to compare against, MXNet's own shape
    inference over the arrays still catches a layer that does not fit."""
    prefix, epoch = _plain_pair(trained, tmp_path / 'checkpoint')
    sym_file = tmp_path / 'checkpoint' / 'regression-symbol.json'
    graph = json.loads(sym_file.read_text())
    for node in graph['nodes']:
        node.get('attrs', {}).pop('__shape__', None)
    sym_file.write_text(json.dumps(graph))
    _damage('%s-%04d.params' % (prefix, epoch), 'wrong shape')
    assert export_main(['--checkpoint', prefix, '--epoch', str(epoch), '--out',
                        str(tmp_path / 'out'), '--input-shape', '2']) == 2
    # the given input shape lets MXNet infer every parameter's shape and name the one
    line = _one_error_line(capfd.readouterr().err)
    assert 'does not match its symbol: layer2_weight has shape (3, 2), the symbol expects ' \
           '(1, 2)' in line


@pytest.mark.parametrize('name', ['', 'a/b', '.hidden'])
def test_export_refuses_a_name_that_is_not_a_file_prefix(trained, tmp_path, capfd, name):
    out = tmp_path / 'out'
    assert export_main(['--checkpoint', trained['dir'], '--out', str(out), '--name', name]) == 2
    assert '--name: expected a file name prefix' in _one_error_line(capfd.readouterr().err)
    assert not out.exists()


# -- predict CLI ----------------------------------------------------------

@pytest.mark.parametrize('model, devices', [('onnx', None), ('symbol', 'cpu:0'),
                                            ('symbol', 'cpu:0,cpu:1,cpu:2')])
@pytest.mark.parametrize('fmt', ['csv', 'npy'])
def test_predict_writes_training_time_numbers(exported, trained, tmp_path, model, devices, fmt):
    X = _features(4, 7)
    np.save(str(tmp_path / 'x.npy'), X)
    target = str(tmp_path / ('y.' + fmt))
    argv = ['--model', exported['paths'][model], '--input', str(tmp_path / 'x.npy'),
            '--output', target] + (['--devices', devices] if devices else [])
    assert predict_main(argv) == 0
    Y = np.load(target) if fmt == 'npy' else np.loadtxt(target, delimiter=',', ndmin=2)
    np.testing.assert_allclose(Y, forward_numpy(trained['params'], X), rtol=0, atol=TOL)


def test_predict_reads_stdin_csv_and_prints(exported, trained, monkeypatch, capfd):
    X = np.array([[1.0, 2.0], [-0.5, 0.25]], dtype=np.float32)
    monkeypatch.setattr('sys.stdin', io.StringIO('1,2\n# comment\n-0.5, 0.25\n'))
    capfd.readouterr()
    assert predict_main(['--model', exported['paths']['onnx'], '--input', '-']) == 0
    printed = np.loadtxt(io.StringIO(capfd.readouterr().out), delimiter=',', ndmin=2)
    np.testing.assert_allclose(printed, forward_numpy(trained['params'], X), rtol=0, atol=TOL)


BAD_INPUTS = [
    ('three.csv', '1,2,3\n', 'expected 2 features per line, found 3'),
    ('three.npy', np.zeros((4, 3)), 'expected an array of shape (samples, 2)'),
    ('flat.npy', np.zeros(2), 'found shape (2,)'),
    ('nan.csv', '1,2\n3,nan\n', 'expected finite numbers'),
    ('inf.npy', np.array([[1.0, np.inf]]), 'expected finite numbers'),
    ('text.csv', '1,2\nx,y\n', "expected numbers, found 'x' in line 2, column 1"),
    ('text.npy', np.array([['a', 'b']]), 'expected a numeric array'),
    ('empty.csv', '', 'expected at least one sample'),
    ('empty.npy', np.zeros((0, 2)), 'expected at least one sample'),
    ('absent.csv', None, 'expected an input file at'),
    ('table.xlsx', 'x', 'expected an input file ending in .npy or .csv'),
]


@pytest.mark.parametrize('model', ['onnx', 'symbol'])
@pytest.mark.parametrize('name, content, message', BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_predict_rejects_bad_input(exported, tmp_path, capfd, model, name, content, message):
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        np.save(str(path), content)
    target = tmp_path / 'y.csv'
    capfd.readouterr()
    code = predict_main(['--model', exported['paths'][model], '--input', str(path),
                         '--output', str(target)])
    assert code == 2
    assert message in _one_error_line(capfd.readouterr().err)
    assert not target.exists()


def _corrupt_copy(exported, tmp_path, which):
    """A copy of the pair or the ONNX file with one file damaged or gone."""
    for key in ('symbol', 'params', 'onnx'):
        shutil.copy(exported['paths'][key], str(tmp_path))
    local = {k: str(tmp_path / os.path.basename(p)) for k, p in exported['paths'].items()}
    if which == 'onnx garbage':
        with open(local['onnx'], 'wb') as f:
            f.write(b'\x08garbage')
        return local['onnx']
    if which == 'params garbage':
        with open(local['params'], 'wb') as f:
            f.write(b'garbage')
    elif which == 'params missing':
        os.remove(local['params'])
    elif which == 'symbol garbage':
        with open(local['symbol'], 'w') as f:
            f.write('{"nodes": [')
    return local['symbol']


@pytest.mark.parametrize('which, message', [
    ('onnx garbage', 'is not a loadable ONNX model'),
    ('params garbage', 'is not an MXNet params file'),
    ('params missing', 'expected a params file'),
    ('symbol garbage', 'is not an MXNet symbol file'),
])
def test_predict_rejects_corrupt_model(exported, tmp_path, capfd, which, message):
    model = _corrupt_copy(exported, tmp_path, which)
    np.save(str(tmp_path / 'x.npy'), _features(2, 0))
    target = tmp_path / 'y.npy'
    capfd.readouterr()
    assert predict_main(['--model', model, '--input', str(tmp_path / 'x.npy'),
                         '--output', str(target)]) == 2
    assert message in _one_error_line(capfd.readouterr().err)
    assert not target.exists()


@pytest.mark.parametrize('argv, message', [
    (['--model', '{dir}/absent.onnx'], 'expected an ONNX model file at'),
    (['--model', '{dir}/absent-symbol.json'], 'expected an MXNet symbol file at'),
    (['--model', '{dir}/model.pt'], 'expected a model file ending in .onnx or -symbol.json'),
    (['--model', '{onnx}', '--devices', 'cpu:0'], 'expected --devices only with an MXNet pair'),
    (['--model', '{symbol}', '--devices', 'cpu:0,cpu:1,cpu:2,cpu:3'], 'too many devices'),
    (['--model', '{onnx}', '--output', '{dir}/y.json'], 'expected an output file ending in'),
    (['--model', '{onnx}', '--output', '{dir}/folder.csv'], '--output: expected a file path, '
                                                           'found a folder'),
    (['--model', '{onnx}', '--output', '{dir}/x.npy/y.csv'], '--output: expected a folder, '
                                                            'found a file'),
])
def test_predict_rejects_bad_arguments(exported, tmp_path, capfd, argv, message):
    np.save(str(tmp_path / 'x.npy'), _features(2, 0))
    (tmp_path / 'folder.csv').mkdir()
    fill = {'dir': str(tmp_path), 'onnx': exported['paths']['onnx'],
            'symbol': exported['paths']['symbol']}
    argv = [a.format(**fill) for a in argv] + ['--input', str(tmp_path / 'x.npy')]
    capfd.readouterr()
    assert predict_main(argv) == 2
    assert message in _one_error_line(capfd.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['folder.csv', 'x.npy']


def test_onnx_predictor_and_mxnet_predictor_agree(exported):
    X = _features(1000, 3)
    onnx_out = OnnxPredictor(exported['paths']['onnx']).predict(X)
    mxnet_out = MXNetPredictor.from_files(exported['paths']['symbol']).predict(X)
    np.testing.assert_allclose(onnx_out, mxnet_out, rtol=0, atol=TOL)


# -- the digits CNN -----------------------------------------------------------

@pytest.fixture(scope='module')
def cnn_export(tmp_path_factory):
    """The digits CNN (convolution, BatchNorm, pooling, dense) trained briefly
    on three devices and exported."""
    from mp_symbolic.training.tasks import digits  # pylint: disable=import-outside-toplevel
    run = str(tmp_path_factory.mktemp('digits'))
    train(make_config(task='digits', num_epochs=2, progress=False, devices='cpu:0,cpu:1,cpu:2',
                      out=run), log=lambda line: None)
    out = str(tmp_path_factory.mktemp('digits-export'))
    paths, report = export_checkpoint(run, out, log=lambda line: None)
    X = digits.load_digits()[0][:37]
    return paths, report, X


def test_cnn_export_matches_in_onnxruntime_and_mxnet(cnn_export):
    paths, report, X = cnn_export
    assert report['ok'] and report['source']['input_shape'] == [1, 8, 8]
    session = ort.InferenceSession(paths['onnx'], providers=['CPUExecutionProvider'])
    onnx_out = session.run(None, {'data': X})[0]
    split = MXNetPredictor.from_files(paths['symbol'], devices='cpu:0,cpu:1,cpu:2')
    one = MXNetPredictor.from_files(paths['symbol'], devices='cpu:0')
    assert onnx_out.shape == (37, 10)
    np.testing.assert_allclose(onnx_out.sum(axis=1), 1, rtol=1e-5)  # softmax, not logits
    np.testing.assert_allclose(split.predict(X.reshape(37, 64)), onnx_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(one.predict(X), onnx_out, rtol=1e-4, atol=1e-5)
    placement = split.placement()
    assert placement['conv0_weight'] == mx.cpu(0) and placement['dense1_weight'] == mx.cpu(2)
    ops = [n['op'] for n in json.load(open(paths['symbol']))['nodes']]
    assert 'SoftmaxOutput' not in ops and 'softmax' in ops and 'BatchNorm' in ops


def test_cnn_onnx_metadata_lists_each_stages_layers(cnn_export):
    paths, _, _ = cnn_export
    props = {p.key: p.value for p in onnx.load(paths['onnx']).metadata_props}
    layers = [json.loads(props['stages'])['stage%d' % s]['layers'] for s in range(3)]
    assert all(layers)
    assert [name for stage in layers for name in stage] == [
        'conv0', 'bn0', 'relu0', 'pool0', 'conv1', 'bn1', 'relu1', 'pool1', 'flatten0',
        'dense0', 'dense1', 'softmax']  # the head's inference form ends the last stage


@pytest.mark.parametrize('dtype', ['float64', 'float16'])
def test_export_refuses_params_of_another_dtype(trained, tmp_path, capfd, dtype):
    prefix, epoch = _plain_pair(trained, tmp_path / 'checkpoint')
    path = '%s-%04d.params' % (prefix, epoch)
    mx.nd.save(path, {k: v.astype(dtype) for k, v in mx.nd.load(path).items()})
    assert export_main(['--checkpoint', prefix, '--epoch', str(epoch), '--out',
                        str(tmp_path / 'out')]) == 2
    assert 'expected float32 arrays (the graph computes in float32), found layer' in \
        _one_error_line(capfd.readouterr().err)


def test_predict_refuses_a_committed_export_whose_files_changed(exported, tmp_path, capfd):
    copy = tmp_path / 'export'
    shutil.copytree(exported['dir'], str(copy), symlinks=True)
    params = copy / 'current' / os.path.basename(exported['paths']['params'])
    data = bytearray(params.read_bytes())
    data[-1] ^= 1
    params.write_bytes(bytes(data))
    np.save(str(tmp_path / 'x.npy'), _features(2, 0))
    assert predict_main(['--model', str(copy / 'current' / 'regression-symbol.json'),
                         '--input', str(tmp_path / 'x.npy')]) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert 'regression-0000.params: expected sha256' in line
