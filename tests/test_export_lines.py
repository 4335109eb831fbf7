"""The export side in one line: python -m export and python -m export.predict
interrupted while they load MXNet, models and inputs that MXNet or numpy
would answer with a traceback, a file-size limit, an output that is the
input. Each case is one line on stderr and a non-zero exit. Last, the ONNX
prediction in a process where MXNet cannot be imported."""
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')


def _loading_mxnet(pid):
    """Whether MXNet's library is mapped into the process: its import has begun."""
    try:
        with open('/proc/%d/maps' % pid) as f:
            return 'libmxnet' in f.read()
    except OSError:
        return False


@pytest.mark.parametrize('module', ['export', 'export.predict'])
@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_mxnet_loads_is_one_line(tmp_path, module, signum):
    """The signal lands as soon as MXNet's library is mapped, in the seconds
    its import takes, before any of the command's own code ran."""
    argv = (['--checkpoint', str(tmp_path / 'none'), '--out', str(tmp_path / 'e')]
            if module == 'export' else ['--model', str(tmp_path / 'm-symbol.json'), '--input', '-'])
    proc = subprocess.Popen([sys.executable, '-m', module] + argv, cwd=ROOT, env=ENV,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _loading_mxnet(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    assert stderr.startswith('error: ') and stderr.count('\n') == 1, stderr
    assert not os.path.exists(str(tmp_path / 'e'))


# -- models, inputs and outputs ---------------------------------------------------------

@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    """The regression trained 2 epochs on three devices, and its export."""
    from conftest import make_config  # pylint: disable=import-outside-toplevel
    from export.exporter import export_checkpoint  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.loop import train  # pylint: disable=import-outside-toplevel
    run = str(tmp_path_factory.mktemp('run'))
    train(make_config(num_epochs=2, progress=False, devices='cpu:0,cpu:1,cpu:2', out=run,
                      widths=(2, 64, 64, 1)), log=lambda line: None)
    paths, _ = export_checkpoint(run, str(tmp_path_factory.mktemp('export')),
                                 log=lambda line: None)
    return {'run': run, 'paths': paths}


def _predict(argv, capsys):
    from export.predict import main  # pylint: disable=import-outside-toplevel
    status = main(argv)
    return status, capsys.readouterr().err


def _one_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), err
    return lines[0]


def _deep_copy_of(sym_path, params_path, folder, depth):
    """The exported graph with ``depth`` relu ops chained between data and the first layer."""
    import json  # pylint: disable=import-outside-toplevel
    import shutil  # pylint: disable=import-outside-toplevel
    with open(sym_path) as f:
        graph = json.load(f)
    nodes = graph['nodes']
    data = next(i for i, n in enumerate(nodes) if n['name'] == 'data')
    group = {'__ctx_group__': nodes[data]['attrs']['__ctx_group__']}
    shift = depth  # the chain goes right after data: later nodes move down by depth
    moved = lambda i: i if i <= data else i + shift  # noqa: E731
    out = nodes[:data + 1] + [{'op': 'relu', 'name': 'deep%d' % k, 'attrs': dict(group),
                               'inputs': [[data + k, 0, 0]]} for k in range(depth)]
    for node in nodes[data + 1:]:
        node['inputs'] = [[data + depth if a == data else moved(a), b, c]
                          for a, b, c in node['inputs']]
        out.append(node)
    graph['nodes'] = out
    graph['arg_nodes'] = [moved(i) for i in graph['arg_nodes']]
    graph['heads'] = [[moved(a), b, c] for a, b, c in graph['heads']]
    graph.pop('node_row_ptr', None)
    sym = os.path.join(folder, 'deep-symbol.json')
    with open(sym, 'w') as f:
        json.dump(graph, f)
    shutil.copy(params_path, os.path.join(folder, 'deep-0000.params'))
    return sym


@pytest.mark.slow
def test_a_symbol_100000_ops_deep_is_one_line_in_predict_and_load_model(exported, tmp_path,
                                                                          capsys):
    import numpy as np  # pylint: disable=import-outside-toplevel
    import export  # pylint: disable=import-outside-toplevel
    from export.errors import ModelFileError  # pylint: disable=import-outside-toplevel
    sym = _deep_copy_of(exported['paths']['symbol'], exported['paths']['params'],
                        str(tmp_path), 100000)
    np.save(str(tmp_path / 'x.npy'), np.ones((3, 2), np.float32))
    status, err = _predict(['--model', sym, '--input', str(tmp_path / 'x.npy')], capsys)
    assert status == 2
    assert 'expected a graph at most 4000 ops deep' in _one_line(err) and sym in err
    with pytest.raises(ModelFileError, match='expected a graph at most 4000 ops deep'):
        export.load_model(sym)


def test_batchnorm_statistics_in_another_stage_than_their_op_is_one_line(tmp_path, capsys):
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import export  # pylint: disable=import-outside-toplevel
    from export.errors import ModelFileError  # pylint: disable=import-outside-toplevel
    with mx.AttrScope(ctx_group='stage0'):
        data = mx.sym.var('data', shape=(0, 4))
        hidden = mx.sym.FullyConnected(data, num_hidden=4, name='dense0')
    with mx.AttrScope(ctx_group='stage1'):
        mean = mx.sym.var('bn0_moving_mean')  # on another stage than its BatchNorm
    with mx.AttrScope(ctx_group='stage0'):
        normed = mx.sym.BatchNorm(hidden, moving_mean=mean, name='bn0')
    with mx.AttrScope(ctx_group='stage1'):
        net = mx.sym.FullyConnected(normed, num_hidden=2, name='dense1')
    prefix = str(tmp_path / 'bn')
    net.save(prefix + '-symbol.json')
    rng = np.random.default_rng(0)
    shapes, _, aux_shapes = net.infer_shape(data=(1, 4))
    arrays = {'arg:' + n: mx.nd.array(rng.normal(size=s)) for n, s in
              zip(net.list_arguments(), shapes) if n != 'data'}
    arrays.update({'aux:' + n: mx.nd.ones(s) for n, s in
                   zip(net.list_auxiliary_states(), aux_shapes)})
    mx.nd.save(prefix + '-0000.params', arrays)
    np.save(str(tmp_path / 'x.npy'), np.ones((3, 4), np.float32))
    status, err = _predict(['--model', prefix + '-symbol.json', '--input',
                            str(tmp_path / 'x.npy')], capsys)
    assert status == 2
    assert ("expected the state 'bn0_moving_mean' of BatchNorm 'bn0' on its op's device group "
            "stage0, found it in stage1") in _one_line(err)
    with pytest.raises(ModelFileError, match='bn0_moving_mean'):
        export.load_model(prefix + '-symbol.json')


def test_a_npy_of_dtype_object_is_refused_by_its_dtype(exported, tmp_path, capsys):
    import numpy as np  # pylint: disable=import-outside-toplevel
    path = str(tmp_path / 'obj.npy')
    np.save(path, np.array([[1, 2], [3, 'a']], dtype=object), allow_pickle=True)
    status, err = _predict(['--model', exported['paths']['onnx'], '--input', path], capsys)
    assert status == 2
    assert _one_line(err) == ('error: expected a numeric array in %s, found dtype object in '
                              'its header' % path)


@pytest.mark.parametrize('via_link', [False, True])
def test_predictions_over_their_own_input_are_refused(exported, tmp_path, capsys, via_link):
    data = '1,2\n3,4\n'
    (tmp_path / 'x.csv').write_text(data)
    output = str(tmp_path / 'x.csv')
    if via_link:
        os.symlink('x.csv', str(tmp_path / 'y.csv'))
        output = str(tmp_path / 'y.csv')
    status, err = _predict(['--model', exported['paths']['onnx'], '--input',
                            str(tmp_path / 'x.csv'), '--output', output], capsys)
    assert status == 2
    assert 'error: --output: expected a file other than the input, found ' in _one_line(err)
    assert (tmp_path / 'x.csv').read_text() == data


def test_an_export_over_a_file_size_limit_names_the_file(exported, tmp_path, capsys):
    """Under `ulimit -f` the ONNX file, larger than the params, fails: its
    writer (onnx.save) reports [Errno 27] without a file name."""
    import resource  # pylint: disable=import-outside-toplevel
    from export.__main__ import main  # pylint: disable=import-outside-toplevel
    sizes = {k: os.path.getsize(p) for k, p in exported['paths'].items()}
    assert sizes['symbol'] < sizes['params'] < sizes['onnx']
    limit = (sizes['params'] + sizes['onnx']) // 2
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        status = main(['--checkpoint', exported['run'], '--out', str(tmp_path / 'e')])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err
    assert status == 1
    line = _one_line(err)
    assert line.endswith('.onnx: cannot write the ONNX model (File too large; a full disk or a '
                         'file size limit?)'), line
    assert 'current' not in os.listdir(str(tmp_path / 'e'))


@pytest.mark.parametrize('name, kind', [('m.onnx', 'FIFO'), ('m-symbol.json', 'FIFO'),
                                        ('m.onnx', 'folder'), ('m-symbol.json', 'folder')])
def test_a_model_that_is_no_regular_file_is_one_line_saying_what_it_is(tmp_path, capsys, name,
                                                                       kind):
    import numpy as np  # pylint: disable=import-outside-toplevel
    import export  # pylint: disable=import-outside-toplevel
    from export.errors import ModelFileError  # pylint: disable=import-outside-toplevel
    model = str(tmp_path / name)
    (os.mkfifo if kind == 'FIFO' else os.mkdir)(model)
    np.save(str(tmp_path / 'x.npy'), np.ones((3, 2), np.float32))
    status, err = _predict(['--model', model, '--input', str(tmp_path / 'x.npy')], capsys)
    assert status == 2
    assert _one_line(err).endswith('file at %s, found a %s' % (model, kind))
    if name.endswith('-symbol.json') and kind == 'FIFO':  # a folder is an export folder to it
        with pytest.raises(ModelFileError, match='found a %s' % kind):
            export.load_model(model)



# -- without MXNet ----------------------------------------------------------------------

# MXNet and the model zoos made unimportable (a None in sys.modules makes their
# import raise ImportError), then the command on the ONNX file, then the same
# file through export.runtimes from Python (its predictions to PYTHON_OUT);
# prints which of the heavy libraries were imported.
_WITHOUT_MXNET = """
import os, sys
for name in ('mxnet', 'gluoncv', 'gluonnlp'):
    sys.modules[name] = None
import numpy as np
from export.predict import main
status = main(sys.argv[1:])
from export.runtimes import MXNetPredictor, OnnxPredictor, load_predictor
flags = dict(zip(sys.argv[1::2], sys.argv[2::2]))
X = np.load(flags['--input'])
np.save(os.environ['PYTHON_OUT'], load_predictor(flags['--model']).predict(X))
heavy = ('mxnet', 'gluoncv', 'gluonnlp', 'cv2', 'sklearn', 'pandas', 'scipy')
print(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in heavy))
sys.exit(status)
"""


def test_an_onnx_prediction_needs_no_mxnet_and_matches_the_module(exported, tmp_path):
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    X = np.random.default_rng(5).normal(size=(7, 2)).astype(np.float32)
    np.save(str(tmp_path / 'x.npy'), X)
    command, python = str(tmp_path / 'y.npy'), str(tmp_path / 'y-python.npy')
    proc = subprocess.run([sys.executable, '-c', _WITHOUT_MXNET, '--model',
                           exported['paths']['onnx'], '--input', str(tmp_path / 'x.npy'),
                           '--output', command], cwd=ROOT, env=dict(ENV, PYTHON_OUT=python),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == '', proc.stderr
    assert proc.stdout == '[]\n'  # none of MXNet, the zoos, cv2, sklearn, pandas, scipy
    # the trained Module, on the devices it trained on
    symbol, arg_params, aux_params = mx.model.load_checkpoint(
        os.path.join(exported['run'], 'current', 'regression'), 2)
    mod = mx.mod.Module(symbol, data_names=['data'], label_names=['label'], context=mx.cpu(0),
                        group2ctxs={'stage%d' % i: mx.cpu(i) for i in range(3)})
    mod.bind(data_shapes=[('data', X.shape)], label_shapes=[('label', (len(X), 1))],
             for_training=False)
    mod.set_params(arg_params, aux_params)
    expected = mod.predict(mx.io.NDArrayIter(X, batch_size=len(X))).asnumpy()
    for path in (command, python):
        np.testing.assert_allclose(np.load(path), expected, rtol=0, atol=1e-5)
