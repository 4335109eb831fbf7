"""Every way ``python -m export.predict`` and ``python -m export`` can be
misused or fail ends in one ``error:`` line, a non-zero status and no file
written: unusable model files, unreadable stdin, a full stdout, undecodable
names, non-finite predictions, bad flags, Ctrl-C. What involves the process
itself (stdin, stdout, encodings, signals, exit status) runs in a
subprocess; the rest calls ``main()`` in-process."""
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

import mxnet as mx
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
import pytest

from mp_symbolic.training.cli import add_train_flags, main as cli_main
from mp_symbolic.tools.cliargs import OneLineArgumentParser, print_error
from mp_symbolic.training.tasks.regression import forward_numpy
from mp_symbolic.training.loop import train

from export.__main__ import main as export_main
from export.errors import EXCERPT_LIMIT, excerpt
from export.exporter import export_checkpoint
from export.predict import main as predict_main

from conftest import cli_status, make_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = 'root:x:0:0:the first line of some file that is not a model at all, quoted nowhere'


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp('symbolic')
    result = train(make_config(num_epochs=2, progress=False, devices='cpu:0,cpu:1,cpu:2',
                               out=str(out)), log=lambda line: None)
    return {'dir': str(out), 'params': result.params}


@pytest.fixture(scope='module')
def exported(trained, tmp_path_factory):
    paths, _ = export_checkpoint(trained['dir'], str(tmp_path_factory.mktemp('export')),
                                 log=lambda line: None)
    return paths


def _edit_onnx(src, dst, edit):
    model = onnx.load(src)
    edit(model)
    onnx.save(model, dst)
    return dst


def _int_input(model):
    model.graph.input[0].name = 'data_int'
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.INT64
    model.graph.node.insert(0, helper.make_node('Cast', ['data_int'], ['data'],
                                                to=TensorProto.FLOAT))


def _fixed_batch(size):
    def edit(model):
        for value in (model.graph.input[0], model.graph.output[0]):
            value.type.tensor_type.shape.dim[0].dim_value = size
    return edit


def _reshaped_output(shape, declared):
    """A last Reshape to ``shape``; the graph declares its output ``declared``."""
    def edit(model):
        model.graph.initializer.append(numpy_helper.from_array(np.array(shape, np.int64),
                                                               'last_shape'))
        model.graph.node.append(helper.make_node('Reshape', [model.graph.output[0].name,
                                                             'last_shape'], ['last']))
        del model.graph.output[:]
        model.graph.output.append(helper.make_tensor_value_info('last', TensorProto.FLOAT,
                                                                declared))
    return edit


def _nan_bias(model):
    for i, init in enumerate(model.graph.initializer):
        if init.name == 'layer1_bias':
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(
                np.full(tuple(init.dims), np.nan, np.float32), init.name))


def _flip_bit(src, dst, offset):
    data = bytearray(open(src, 'rb').read())
    data[offset] ^= 0x01
    with open(dst, 'wb') as f:
        f.write(bytes(data))
    return dst


@pytest.fixture(scope='module')
def models(exported, tmp_path_factory):
    """Damaged or unusual copies of the exported model, by name."""
    d = tmp_path_factory.mktemp('models')
    onnx_path = exported['onnx']
    found = {'onnx': onnx_path, 'symbol': exported['symbol']}
    for name, edit in [('int-input', _int_input), ('batch-1', _fixed_batch(1)),
                       ('batch-3', _fixed_batch(3)),
                       ('1d-output', _reshaped_output([-1], ['batch'])),
                       ('0d-output', _reshaped_output([], [])),
                       ('runtime-failure', _reshaped_output([3, 1], ['batch', 1])),
                       ('nan-onnx', _nan_bias)]:
        found[name] = _edit_onnx(onnx_path, str(d / (name + '.onnx')), edit)
    data = open(onnx_path, 'rb').read()
    found['flipped-header'] = _flip_bit(onnx_path, str(d / 'flipped-header.onnx'), 0)
    found['flipped-attribute'] = _flip_bit(onnx_path, str(d / 'flipped-attribute.onnx'),
                                           data.index(b'transB'))
    # The MXNet pair with a NaN parameter.
    pair = d / 'nan-pair'
    pair.mkdir()
    shutil.copy(exported['symbol'], str(pair / 'm-symbol.json'))
    arrays = mx.nd.load(exported['params'])
    arrays['arg:layer1_bias'] = mx.nd.full(arrays['arg:layer1_bias'].shape, np.nan)
    mx.nd.save(str(pair / 'm-0000.params'), arrays)
    found['nan-pair'] = str(pair / 'm-symbol.json')
    # Symbol files that are not symbol files, each with a good params file.
    for name, content in [('binary', bytes(range(256)) * 4),
                          ('truncated', open(exported['symbol'], 'rb').read()[:50]),
                          ('array', b'[1, 2, 3]\n'), ('other-json', b'{"files": {}}\n'),
                          ('text', (SECRET + '\nmore text\n').encode())]:
        (d / (name + '-symbol.json')).write_bytes(content)
        shutil.copy(exported['params'], str(d / (name + '-0000.params')))
        found[name] = str(d / (name + '-symbol.json'))
    return found


def _one_error_line(text):
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert lines[0].startswith('error: '), text
    assert 'Traceback' not in text
    return lines[0]


def _predict(capfd, argv):
    capfd.readouterr()
    code = predict_main(argv)
    return code, capfd.readouterr()


def _features(n, seed=0):
    return np.random.default_rng(seed).normal(0, 2, (n, 2)).astype(np.float32)


# -- 1. model files -------------------------------------------------------

@pytest.mark.parametrize('model, message', [
    ('int-input', 'expected a float32 input (tensor(float)), found data_int'),
    ('0d-output', "expected its first output to be of shape (batch, ...), found last[]"),
    ('runtime-failure', 'failed in onnxruntime on a batch of 4 samples'),
    ('batch-3', 'expected a multiple of 3 samples, found 4'),
    ('flipped-header', 'is not a loadable ONNX model: INVALID_PROTOBUF'),
    ('flipped-attribute', 'is not a loadable ONNX model: INVALID_GRAPH'),
    ('binary', 'is not an MXNet symbol file: expected UTF-8 JSON text (a symbol JSON), found '
               'binary data (byte 0x80 at offset 128)'),
    ('truncated', 'is not an MXNet symbol file: expected a symbol JSON, found invalid JSON '
                  '(Unterminated string starting at: line'),
    ('array', 'expected a JSON object with lists nodes, arg_nodes, heads, found a JSON array'),
    ('other-json', "found an object with keys 'files'"),
    ('text', "expected a symbol JSON, found text starting 'root:x:0:0:the fi...'"),
])
def test_unusable_model_file_is_one_line_naming_it(models, tmp_path, capfd, model, message):
    np.save(str(tmp_path / 'x.npy'), _features(4))
    target = tmp_path / 'y.csv'
    code, out = _predict(capfd, ['--model', models[model], '--input', str(tmp_path / 'x.npy'),
                                 '--output', str(target)])
    line = _one_error_line(out.err)
    assert code == 2
    assert message in line and models[model] in line
    assert 'codec' not in line and SECRET[:30] not in line
    assert sorted(os.listdir(tmp_path)) == ['x.npy']


def test_a_model_of_one_output_per_sample_predicts_one_csv_column(models, trained, tmp_path,
                                                                  capfd):
    X = _features(4, 2)
    np.save(str(tmp_path / 'x.npy'), X)
    code, out = _predict(capfd, ['--model', models['1d-output'], '--input',
                                 str(tmp_path / 'x.npy')])
    assert code == 0, out.err
    found = np.array([float(line) for line in out.out.splitlines()])
    np.testing.assert_allclose(found, forward_numpy(trained['params'], X)[:, 0], rtol=0,
                               atol=1e-5)


def test_fixed_batch_model_runs_in_batches_of_its_size(models, trained, tmp_path, capfd):
    X = _features(5, 1)
    np.save(str(tmp_path / 'x.npy'), X)
    for model in ('batch-1', 'onnx'):
        code, _ = _predict(capfd, ['--model', models[model], '--input', str(tmp_path / 'x.npy'),
                                   '--output', str(tmp_path / (model + '.npy'))])
        assert code == 0
        np.testing.assert_allclose(np.load(str(tmp_path / (model + '.npy'))),
                                   forward_numpy(trained['params'], X), rtol=0, atol=1e-5)


def test_undecodable_model_name_runs_in_onnxruntime_and_is_refused_for_mxnet(
        exported, trained, tmp_path, capfd):
    """onnxruntime is handed the file's bytes; MXNet opens files by UTF-8 name."""
    name = os.fsdecode(b'm\xff')
    shutil.copy(exported['onnx'], str(tmp_path / (name + '.onnx')))
    shutil.copy(exported['symbol'], str(tmp_path / (name + '-symbol.json')))
    shutil.copy(exported['params'], str(tmp_path / (name + '-0000.params')))
    X = _features(3, 4)
    np.save(str(tmp_path / 'x.npy'), X)
    argv = ['--input', str(tmp_path / 'x.npy'), '--output', str(tmp_path / 'y.npy')]
    code, _ = _predict(capfd, ['--model', str(tmp_path / (name + '.onnx'))] + argv)
    assert code == 0
    np.testing.assert_allclose(np.load(str(tmp_path / 'y.npy')),
                               forward_numpy(trained['params'], X), rtol=0, atol=1e-5)
    os.remove(str(tmp_path / 'y.npy'))
    code, out = _predict(capfd, ['--model', str(tmp_path / (name + '-symbol.json'))] + argv)
    assert code == 2
    assert _one_error_line(out.err) == ('error: expected a file name MXNet can open (UTF-8), '
                                        'found %s/m\\udcff-symbol.json' % tmp_path)
    assert not (tmp_path / 'y.npy').exists()


# -- 3. non-finite predictions --------------------------------------------

@pytest.mark.parametrize('model, rows, message', [
    ('nan-pair', '1,2\n3,4\n', "found 2 of 2 outputs not finite (NaN or inf); the first for "
                               "input sample 1 of {input}: '1.0,2.0'"),
    ('nan-onnx', '1,2\n', 'found 1 of 1 outputs not finite'),
    ('onnx', '0.5,1\n1,3.4e38\n', "found 1 of 2 outputs not finite (NaN or inf); the first for "
                                  "input sample 2 of {input}: '1.0,3.4e+38'"),
    ('symbol', '1,3.4e38\n', 'found 1 of 1 outputs not finite'),
])
def test_non_finite_predictions_are_an_error(models, tmp_path, capfd, model, rows, message):
    source = tmp_path / 'x.csv'
    source.write_text(rows)
    for target in (tmp_path / 'y.csv', None):
        argv = ['--model', models[model], '--input', str(source)]
        code, out = _predict(capfd, argv + (['--output', str(target)] if target else []))
        assert code == 1
        assert message.format(input=source) in _one_error_line(out.err)
        assert out.out == ''
        assert sorted(os.listdir(tmp_path)) == ['x.csv']


# -- 4. output names ------------------------------------------------------

def test_txt_output_is_refused_not_silently_csv(models, tmp_path, capfd):
    np.save(str(tmp_path / 'x.npy'), _features(2))
    code, out = _predict(capfd, ['--model', models['onnx'], '--input', str(tmp_path / 'x.npy'),
                                 '--output', str(tmp_path / 'y.txt')])
    assert code == 2
    assert ('--output: expected an output file ending in .csv or .npy, found %s'
            % (tmp_path / 'y.txt')) in _one_error_line(out.err)
    assert sorted(os.listdir(tmp_path)) == ['x.npy']


def test_undecodable_output_name_is_written(models, trained, tmp_path, capfd):
    """A name that is not UTF-8 arrives as surrogate escapes in sys.argv."""
    X = _features(3, 2)
    np.save(str(tmp_path / 'x.npy'), X)
    name = os.fsdecode(b'y\xff.csv')
    code, _ = _predict(capfd, ['--model', models['onnx'], '--input', str(tmp_path / 'x.npy'),
                               '--output', str(tmp_path / name)])
    assert code == 0
    assert os.fsencode(tmp_path / name) in [os.fsencode(p) for p in tmp_path.iterdir()]
    np.testing.assert_allclose(np.loadtxt(str(tmp_path / name), delimiter=',', ndmin=2),
                               forward_numpy(trained['params'], X), rtol=0, atol=1e-5)


# -- 5. flag errors -------------------------------------------------------

@pytest.mark.parametrize('main, argv, message', [
    (predict_main, ['--model', 'm.onnx', '--input', 'x.csv', '--bogus'],
     'error: python -m export.predict: unrecognized arguments: --bogus (see --help)'),
    (predict_main, ['--model', 'm.onnx', '--input'],
     'error: python -m export.predict: argument --input: expected one argument (see --help)'),
    (predict_main, [], 'error: python -m export.predict: the following arguments are required: '
                       '--model, --input (see --help)'),
    (export_main, ['--name'],
     'error: python -m export: argument --name: expected one argument (see --help)'),
    (export_main, ['--name', '-x'],
     'error: python -m export: argument --name: expected one argument (see --help)'),
])
def test_flag_error_is_one_line_exit_2(capfd, main, argv, message):
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert _one_error_line(capfd.readouterr().err) == message


@pytest.mark.parametrize('argv, message', [
    (['train', '--epochs', 'x'],
     "error: prog train: argument --epochs: invalid int value: 'x' (see --help)"),
    (['train', '--optimizer'], 'error: prog train: argument --optimizer: expected one argument '
                               '(see --help)'),
    (['fly'], "error: prog: argument COMMAND: invalid choice: 'fly' (choose from 'train') "
              "(see --help)"),
    ([], 'error: prog: the following arguments are required: COMMAND (see --help)'),
    (['train', '--bogus'], 'error: prog train: unrecognized arguments: --bogus (see --help)'),
])
def test_subcommand_flag_error_is_one_line_exit_2(capfd, argv, message):
    parser = OneLineArgumentParser(prog='prog')
    commands = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
    add_train_flags(commands.add_parser('train'))
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    assert exit_.value.code == 2
    assert _one_error_line(capfd.readouterr().err) == message


@pytest.mark.parametrize('argv', [
    ['train'], ['compare'], ['launch'], ['pair', '--checkpoint', 'a', '--out', 'b'],
    ['sample', '--model', 'm'], ['plan'], ['plan', '--task', 'regression'], ['blas']])
def test_unknown_flag_is_refused_naming_its_subcommand(capsys, argv):
    assert cli_status(cli_main, argv + ['--bogus']) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        'error: python -m mp_symbolic %s: unrecognized arguments: --bogus (see --help)'
        % argv[0])


def test_error_line_survives_a_stream_that_cannot_encode_it(tmp_path):
    with open(str(tmp_path / 'err.txt'), 'w', encoding='ascii', errors='strict') as f:
        print_error('cannot write %s\nfolded' % os.fsdecode(b'\xff\xc3\xa9.csv'), file=f)
    assert (tmp_path / 'err.txt').read_text() == 'error: cannot write \\udcff\\xe9.csv folded\n'


# -- 6. export --name -----------------------------------------------------

@pytest.mark.parametrize('name', ['a\nb', '*', '-x', 'a/b', 'a\\b', '', '.hidden', 'a b',
                                  'caf\xe9', 'x' * 101])
def test_export_name_must_be_a_plain_file_prefix(trained, tmp_path, capfd, name):
    out = tmp_path / 'out'
    capfd.readouterr()
    assert export_main(['--checkpoint', trained['dir'], '--out', str(out), '--name=' + name]) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert line.startswith('error: --name: expected a file name prefix such as regression')
    assert not out.exists()


def test_export_name_of_letters_digits_dot_dash_underscore_is_accepted(tmp_path, capfd):
    missing = tmp_path / 'no-run'
    assert export_main(['--checkpoint', str(missing), '--out', str(tmp_path / 'out'),
                        '--name', 'Model-v1.2_b']) == 2
    assert 'expected a training folder or a checkpoint prefix at' in \
        _one_error_line(capfd.readouterr().err)


# -- 8. no file content beyond a short excerpt ----------------------------

def _quotes(line):
    parts = line.split("'")
    return parts[1::2]


@pytest.mark.parametrize('name, content, message', [
    ('long-field.csv', '1,%s\n' % SECRET.replace(',', ';'),
     "expected numbers, found 'root:x:0:0:the first line of some file that is not a mode...' "
     'in line 1, column 2'),
    ('text.npy', SECRET + '\n', "is not a .npy array: expected it to start with "
                                "b'\\x93NUMPY', found text starting 'root:x:0:0:the fi...'"),
    ('latin1.csv', b'1,2\n3,caf\xe9\n', 'expected CSV text (UTF-8) in {path}, found a byte '
                                         'that is not UTF-8 (0xe9 at offset 9)'),
    ('binary.csv', bytes(range(256)), 'expected CSV text (UTF-8) in {path}, found binary data '
                                      '(byte 0x80 at offset 128)'),
])
def test_input_error_quotes_at_most_a_short_excerpt(models, tmp_path, capfd, name, content,
                                                    message):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    code, out = _predict(capfd, ['--model', models['onnx'], '--input', str(path)])
    line = _one_error_line(out.err)
    assert code == 2 and out.out == ''
    assert message.format(path=path) in line
    assert SECRET[:EXCERPT_LIMIT] not in line
    assert all(len(quote) <= EXCERPT_LIMIT for quote in _quotes(line))


def test_excerpt_is_short_printable_and_quoted():
    assert excerpt('a\tb\n\x00c\udcff') == "'a b \\x00c\\udcff'"
    assert excerpt(b'\xff' * 100) == "'%s...'" % ('\ufffd' * (EXCERPT_LIMIT - 3))
    assert len(excerpt(SECRET)) == EXCERPT_LIMIT + 2


# -- 2, 7. the process: stdin, stdout, encodings, Ctrl-C ------------------

def _run(argv, env=None, **kwargs):
    env = dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0', **(env or {}))
    return subprocess.run([sys.executable, '-m', 'export.predict'] + argv, cwd=ROOT, env=env,
                          stdout=kwargs.pop('stdout', subprocess.PIPE), stderr=subprocess.PIPE,
                          timeout=120, **kwargs)


@pytest.mark.parametrize('redirect, message', [
    ('<&-', 'error: --input -: expected CSV on stdin, found stdin closed'),
    ('0>/dev/null', 'error: --input -: expected CSV on stdin, found stdin not readable: '
                    'Bad file descriptor'),
])
def test_unreadable_stdin_is_one_line(models, tmp_path, redirect, message):
    target = tmp_path / 'y.csv'
    result = subprocess.run(
        ['sh', '-c', 'exec "$0" "$@" %s' % redirect, sys.executable, '-m', 'export.predict',
         '--model', models['onnx'], '--input', '-', '--output', str(target)],
        cwd=ROOT, env=dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0'), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, timeout=120)
    assert result.returncode == 2
    assert _one_error_line(result.stderr.decode()) == message
    assert not target.exists()


@pytest.mark.parametrize('stdout, message', [
    ('/dev/full', 'error: stdout: could not write the predictions: No space left on device'),
    ('closed pipe', 'error: stdout: could not write the predictions: Broken pipe'),
])
def test_stdout_that_cannot_be_written_is_one_line_exit_1(models, stdout, message):
    argv = ['--model', models['onnx'], '--input', '-']
    if stdout == '/dev/full':
        with open('/dev/full', 'w') as full:
            result = _run(argv, input=b'1,2\n', stdout=full)
        err, code = result.stderr, result.returncode
    else:
        proc = subprocess.Popen([sys.executable, '-m', 'export.predict'] + argv, cwd=ROOT,
                                env=dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0'),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        proc.stdout.close()  # the reader is gone before anything is written
        _, err = proc.communicate(b'1,2\n', timeout=120)
        code = proc.returncode
    assert code == 1
    assert _one_error_line(err.decode()) == message


def test_unicode_and_undecodable_names_print_on_an_ascii_terminal(models, tmp_path):
    target = os.fsencode(tmp_path) + b'/caf\xc3\xa9/y\xff.txt'
    result = _run([b'--model', models['onnx'], b'--input', b'-', b'--output', target],
                  env={'PYTHONIOENCODING': 'ascii:strict', 'LC_ALL': 'C'}, input=b'1,2\n')
    assert result.returncode == 2
    line = _one_error_line(result.stderr.decode('ascii'))
    assert line.endswith('found %s/caf\\xe9/y\\udcff.txt' % tmp_path)
    assert os.listdir(tmp_path) == []


_READ_SYSCALL = {'x86_64': '0', 'aarch64': '63'}.get(platform.machine())


def _blocked_reading_stdin(pid):
    """Whether the process's main thread is in read(0, ...), from /proc."""
    with open('/proc/%d/syscall' % pid) as f:
        fields = f.read().split()
    return fields[:2] == [_READ_SYSCALL, '0x0']


@pytest.mark.skipif(_READ_SYSCALL is None or not os.path.exists('/proc/self/syscall'),
                    reason='needs /proc/<pid>/syscall to see the process wait on stdin')
def test_ctrl_c_exits_130_with_one_line_and_writes_nothing(models, tmp_path):
    target = tmp_path / 'y.csv'
    proc = subprocess.Popen([sys.executable, '-m', 'export.predict', '--model', models['onnx'],
                             '--input', '-', '--output', str(target)], cwd=ROOT,
                            env=dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0'),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(b'1,2\n')  # part of the input: the rest never comes
        proc.stdin.flush()
        deadline = time.monotonic() + 120
        while not _blocked_reading_stdin(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert _one_error_line(err.decode()) == 'error: interrupted'
    assert out == b'' and os.listdir(tmp_path) == []
