"""What python -m export and python -m export.predict make of hostile or
unusual input: samples of another dtype, .npy headers that lie or do not
parse, zip bombs, JSON nested 100,000 deep, batch sizes past the memory
budget, endless stdin, FIFOs, CSV numbers float() reads but a table should
not, paths too long to open, unfinished training runs, and inputs and
outputs of any rank (a convolutional network's images and maps; GluonCV's
ResNet-18 with random weights). Each refusal is one line on stderr, exit
status 2, and nothing written."""
import io
import json
import os
import signal
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from conftest import cli_status, make_config

import export
from export import MAX_CSV_BYTES, MAX_SAMPLE_ARRAYS, MAX_SAMPLE_BYTES, MEMORY_BUDGET
from export.__main__ import main as export_main
from export.errors import ModelFileError
from export.predict import main as predict_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')


def _one_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), err
    assert 'Traceback' not in err
    return lines[0]


def _export(argv, capsys):
    """``(status, stdout, the stderr line or '')`` of python -m export in this process."""
    capsys.readouterr()
    status = cli_status(export_main, argv)
    out, err = capsys.readouterr()
    return status, out, _one_line(err) if status else err


def _predict(argv, capsys):
    capsys.readouterr()
    status = cli_status(predict_main, argv)
    out, err = capsys.readouterr()
    return status, out, _one_line(err) if status else err


def _refused(argv, capsys, out_dir=None, command=_export):
    """The one line of a refusal with status 2; ``out_dir`` was not made."""
    status, _, line = command(argv, capsys)
    assert status == 2, line
    if out_dir is not None:
        assert not os.path.exists(out_dir)
    return line


@pytest.fixture(scope='module')
def regression(tmp_path_factory):
    """The regression trained 2 epochs on two devices (a finished run), and its export."""
    from export.exporter import export_checkpoint  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.loop import train  # pylint: disable=import-outside-toplevel
    run = str(tmp_path_factory.mktemp('run'))
    train(make_config(num_epochs=2, progress=False, devices='cpu:0,cpu:1', out=run,
                      widths=(2, 16, 1), num_examples=64, batch_size=16), log=lambda line: None)
    paths, _ = export_checkpoint(run, str(tmp_path_factory.mktemp('export')),
                                 log=lambda line: None)
    return {'run': run, 'paths': paths}


@pytest.fixture(scope='module')
def token_ids(tmp_path_factory):
    """A pair whose input records int32 (``mx.sym.var('data', dtype='int32')``):
    token ids into an Embedding, then a Dense layer, on two stages."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    with mx.AttrScope(ctx_group='stage0'):
        data = mx.sym.var('data', dtype='int32', shape=(0, 4))
        emb = mx.sym.Embedding(data, input_dim=10, output_dim=3, name='emb')
    with mx.AttrScope(ctx_group='stage1'):
        net = mx.sym.FullyConnected(mx.sym.flatten(emb, name='flat'), num_hidden=2, name='fc')
    rng = np.random.default_rng(0)
    prefix = str(tmp_path_factory.mktemp('ids') / 'ids')
    mx.model.save_checkpoint(prefix, 0, net, {
        'emb_weight': mx.nd.array(rng.normal(size=(10, 3))),
        'fc_weight': mx.nd.array(rng.normal(size=(2, 12))),
        'fc_bias': mx.nd.array(rng.normal(size=2))}, {})
    return prefix


@pytest.fixture(scope='module')
def conv(tmp_path_factory):
    """A two-stage convolutional network, (N, 3, 8, 8) images in, (N, 2, 8, 8) maps
    out, saved as a Pipeline module's checkpoint pair and exported."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mxnet.gluon import nn  # pylint: disable=import-outside-toplevel
    from mp_symbolic import Pipeline  # pylint: disable=import-outside-toplevel
    from export.exporter import export_checkpoint  # pylint: disable=import-outside-toplevel
    mx.random.seed(0)
    pipe = Pipeline([nn.Conv2D(4, 3, padding=1, in_channels=3), nn.Activation('relu'),
                     nn.Conv2D(2, 1, in_channels=4)], 'cpu:0,cpu:1', balance=[2, 1])
    mod = pipe.module(loss='l2')
    mod.bind(data_shapes=[('data', (2, 3, 8, 8))], label_shapes=[('softmax_label', (2, 2, 8, 8))],
             for_training=False)
    mod.init_params(mx.init.Xavier())
    prefix = str(tmp_path_factory.mktemp('conv') / 'conv')
    mod.save_checkpoint(prefix, 1)
    paths, report = export_checkpoint(prefix, str(tmp_path_factory.mktemp('conv-export')),
                                      epoch=1, log=lambda line: None)
    assert report['ok']
    return paths


# -- 1. a sample of another dtype --------------------------------------------------------

@pytest.mark.parametrize('dtype', ['float64', 'int64'])
def test_a_sample_of_float64_or_int64_is_cast_to_the_checkpoints_float32(regression, tmp_path,
                                                                         capsys, dtype):
    import onnx  # pylint: disable=import-outside-toplevel
    sample = str(tmp_path / 's.npz')
    np.savez(sample, data=np.arange(10).reshape(5, 2).astype(dtype) - 4)
    status, out, err = _export(['--checkpoint', regression['run'], '--sample', sample,
                                '--out', str(tmp_path / 'e')], capsys)
    assert status == 0, err
    assert "--sample: data cast from %s to float32, the dtype of the checkpoint's input" % dtype \
        in out.splitlines()
    assert 'verification: PASSED' in out
    model = onnx.load(str(tmp_path / 'e' / 'current' / 'regression.onnx'))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    with open(str(tmp_path / 'e' / 'current' / 'regression-symbol.json')) as f:
        data = next(n for n in json.load(f)['nodes'] if n['name'] == 'data')
    assert '__dtype__' not in data.get('attrs', {})  # float32: nothing to record


def test_token_ids_of_float64_or_int64_are_cast_to_a_recorded_int32_input(token_ids, tmp_path,
                                                                          capsys):
    import onnx  # pylint: disable=import-outside-toplevel
    for dtype in ('float64', 'int64'):
        sample = str(tmp_path / ('%s.npz' % dtype))
        np.savez(sample, data=np.array([[1, 2, 3, 4], [5, 6, 7, 9]], dtype))
        out_dir = tmp_path / ('e-' + dtype)
        status, out, err = _export(['--checkpoint', token_ids, '--epoch', '0', '--sample',
                                    sample, '--out', str(out_dir)], capsys)
        assert status == 0, err
        assert '--sample: data cast from %s to int32' % dtype in out
        model = onnx.load(str(out_dir / 'current' / 'ids.onnx'))
        assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT32


@pytest.mark.parametrize('which, values, message', [
    ('regression', np.array([[2 ** 25, 1]], np.int64),
     '--sample: data: expected whole numbers of at most 16777216 in magnitude (held exactly) '
     'for a float32 input, found 33554432 at index (0, 0) (of int64)'),
    ('regression', np.array([[1.0, 1e300]]),
     '--sample: data: expected values within its range (|x| <= 3.403e+38) for a float32 input, '
     'found 1e+300 at index (0, 1) (of float64)'),
    ('ids', np.array([[1, 2.5, 3, 4]]),
     '--sample: data: expected whole numbers for an int32 input, found 2.5 at index (0, 1) '
     '(of float64)'),
    ('ids', np.array([[1, 2, 3, 2 ** 40]], np.int64),
     '--sample: data: expected values in [-2147483648, 2147483647] for an int32 input, found '
     '1099511627776 at index (0, 3) (of int64)'),
], ids=['int-past-float32', 'float64-past-float32', 'fraction-for-int32', 'past-int32'])
def test_a_sample_that_a_cast_would_change_is_refused(regression, token_ids, tmp_path, capsys,
                                                      which, values, message):
    sample = str(tmp_path / 's.npz')
    np.savez(sample, data=values)
    argv = (['--checkpoint', regression['run']] if which == 'regression'
            else ['--checkpoint', token_ids, '--epoch', '0'])
    line = _refused(argv + ['--sample', sample, '--out', str(tmp_path / 'e')], capsys,
                    str(tmp_path / 'e'))
    assert line == 'error: ' + message


# -- 2. .npy headers that lie or do not parse --------------------------------------------

def _npy(header, data=b''):
    """A version 1.0 .npy file of ``header`` (text, padded as numpy pads it) and ``data``."""
    header += ' ' * ((64 - (10 + len(header) + 1) % 64) % 64) + '\n'
    return b'\x93NUMPY\x01\x00' + struct.pack('<H', len(header)) + header.encode() + data


NPY_FORGERIES = {
    # 8 TB claimed in a file of a few hundred bytes: numpy would allocate it first
    'claims 10**12 rows': (_npy("{'descr': '<f4', 'fortran_order': False, "
                                "'shape': (1000000000000, 2), }", bytes(64)),
                           "expected the 8000000000000 bytes its header claims (shape "
                           "(1000000000000, 2), float32), found 64"),
    'truncated': (_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (5, 2), }")[:30],
                  'expected a .npy header of 118 bytes, found 20'),
    # numpy: "Cannot parse header" quoting it all (a ValueError)
    'unterminated string': (_npy("{'descr': '<f4, 'fortran_order': False, 'shape': (5, 2), }",
                                 bytes(40)),
                            "expected a .npy header (a dict of descr, fortran_order, shape), "
                            "found '{'descr': '<f4, 'fortran_order': False, 'shape': (5, 2), }'"),
    # numpy: tokenize.TokenError, a traceback
    'unclosed bracket': (_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (5, 2 }",
                              bytes(40)),
                         "expected a .npy header (a dict of descr, fortran_order, shape), "
                         "found '{'descr': '<f4', 'fortran_order': False, 'shape': (5, 2 }'"),
}


@pytest.mark.parametrize('forgery', list(NPY_FORGERIES))
def test_a_npy_that_lies_or_does_not_parse_is_one_line_in_predict_and_export(
        regression, tmp_path, capsys, forgery):
    data, message = NPY_FORGERIES[forgery]
    path = str(tmp_path / 'x.npy')
    with open(path, 'wb') as f:
        f.write(data)
    line = _refused(['--model', regression['paths']['onnx'], '--input', path,
                     '--output', str(tmp_path / 'y.npy')], capsys, str(tmp_path / 'y.npy'),
                    command=_predict)
    assert line == 'error: %s: %s' % (path, message)
    sample = str(tmp_path / 's.npz')
    with zipfile.ZipFile(sample, 'w') as npz:
        npz.writestr('data.npy', data)
    line = _refused(['--checkpoint', regression['run'], '--sample', sample,
                     '--out', str(tmp_path / 'e')], capsys, str(tmp_path / 'e'))
    assert line == "error: --sample: %s member 'data.npy': %s" % (sample, message)


# -- 3. zip bombs and too many members ---------------------------------------------------

def _declaring(path, size):
    """Rewrites the central directory of the zip at ``path`` so that its one
    member declares ``size`` bytes decompressed (what a zip bomb declares)."""
    data = bytearray(open(path, 'rb').read())
    entry = data.index(b'PK\x01\x02')
    data[entry + 24:entry + 28] = struct.pack('<I', size)  # uncompressed size
    with open(path, 'wb') as f:
        f.write(bytes(data))


def test_a_sample_declaring_gigabytes_is_refused_from_its_zip_headers(regression, tmp_path,
                                                                      capsys):
    sample = str(tmp_path / 'bomb.npz')
    np.savez_compressed(sample, data=np.zeros((4, 2), np.float32))
    _declaring(sample, 0xFFFFFFF0)
    assert os.path.getsize(sample) < 1000 and 0xFFFFFFF0 > MAX_SAMPLE_BYTES
    line = _refused(['--checkpoint', regression['run'], '--sample', sample,
                     '--out', str(tmp_path / 'e')], capsys, str(tmp_path / 'e'))
    assert line == ('error: --sample: expected arrays of at most 1024 MiB in all in %s, found '
                    'members declaring 4294967280 bytes decompressed' % sample)


def test_a_sample_of_too_many_arrays_is_one_short_line(regression, tmp_path, capsys):
    sample = str(tmp_path / 'many.npz')
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((1, 2), np.float32))
    with zipfile.ZipFile(sample, 'w') as npz:
        for i in range(MAX_SAMPLE_ARRAYS + 1):
            npz.writestr('data%d.npy' % i, buffer.getvalue())
    line = _refused(['--checkpoint', regression['run'], '--sample', sample,
                     '--out', str(tmp_path / 'e')], capsys, str(tmp_path / 'e'))
    assert line.startswith('error: --sample: expected at most 1000 arrays (one per input) in %s, '
                           "found 1001: 'data0.npy, data1.npy, data2.npy, " % sample)
    assert len(line) < 300 and 'data1000' not in line


def test_a_sample_of_other_names_is_named_in_an_excerpt(regression, tmp_path, capsys):
    sample = str(tmp_path / 'other.npz')
    np.savez(sample, **{'x%03d' % i: np.zeros((1, 2), np.float32) for i in range(300)})
    line = _refused(['--checkpoint', regression['run'], '--sample', sample,
                     '--out', str(tmp_path / 'e')], capsys, str(tmp_path / 'e'))
    assert line.startswith('error: --sample: expected one array per input (data), found '
                           'x000, x001, ')
    assert line.endswith('...') and 'x299' not in line
    assert len(line) < 300


@pytest.mark.parametrize('model', ['onnx', 'symbol'])
def test_predict_takes_a_one_input_model_from_a_npz_named_as_its_input(regression, tmp_path,
                                                                       capsys, model):
    X = np.array([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]], np.float32)
    np.save(str(tmp_path / 'x.npy'), X)
    np.savez(str(tmp_path / 'x.npz'), data=X)
    outs = []
    for name in ('x.npy', 'x.npz'):
        status, out, _ = _predict(['--model', regression['paths'][model], '--input',
                                   str(tmp_path / name)], capsys)
        assert status == 0
        outs.append(out)
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 3


def test_predict_refuses_a_npz_declaring_gigabytes_from_its_zip_headers(regression, tmp_path,
                                                                        capsys):
    path = str(tmp_path / 'bomb.npz')
    np.savez_compressed(path, data=np.zeros((4, 2), np.float32))
    _declaring(path, 0xFFFFFFF0)
    line = _refused(['--model', regression['paths']['onnx'], '--input', path,
                     '--output', str(tmp_path / 'y.npy')], capsys, str(tmp_path / 'y.npy'),
                    command=_predict)
    assert line == ('error: expected arrays of at most 1024 MiB in all in %s, found members '
                    'declaring 4294967280 bytes decompressed' % path)


# -- 4. JSON nested 100,000 deep as the symbol -------------------------------------------

def test_a_symbol_of_json_nested_100000_deep_is_one_line_everywhere(regression, tmp_path,
                                                                    capsys):
    import shutil  # pylint: disable=import-outside-toplevel
    prefix = str(tmp_path / 'deep')
    with open(prefix + '-symbol.json', 'w') as f:
        f.write('[' * 100000 + ']' * 100000)
    shutil.copy(regression['paths']['params'], prefix + '-0000.params')
    message = ('%s-symbol.json is not an MXNet symbol file: expected a symbol JSON, found JSON '
               'nested too deeply to read' % prefix)
    line = _refused(['--checkpoint', prefix, '--epoch', '0', '--out', str(tmp_path / 'e')],
                    capsys, str(tmp_path / 'e'))
    assert line.startswith('error: ' + message)
    np.save(str(tmp_path / 'x.npy'), np.ones((3, 2), np.float32))
    line = _refused(['--model', prefix + '-symbol.json', '--input', str(tmp_path / 'x.npy')],
                    capsys, command=_predict)
    assert line.startswith('error: ' + message)
    with pytest.raises(ModelFileError, match='nested too deeply to read'):
        export.load_model(prefix + '-symbol.json')


# -- 5. verification batches past the memory budget --------------------------------------

def test_verify_batches_past_the_memory_budget_are_refused_naming_the_largest(
        regression, tmp_path, capsys):
    line = _refused(['--checkpoint', regression['run'], '--out', str(tmp_path / 'e'),
                     '--verify-batches', '1,10000000000'], capsys, str(tmp_path / 'e'))
    assert line.startswith('error: --verify-batches: expected batch sizes of at most ')
    largest = int(line.split('at most ')[1].split()[0])
    assert 1000 < largest < 10 ** 10
    assert line.endswith('fit the %d MiB memory budget), found 10000000000'
                         % (MEMORY_BUDGET >> 20))


# -- 6. endless stdin, large CSV, FIFOs --------------------------------------------------

def test_endless_stdin_is_refused_past_the_csv_bound(regression):
    """``yes 1,2 | python -m export.predict ...``: refused once 64 MiB are read."""
    proc = subprocess.run('yes 1,2 | %s -m export.predict --model %s --input -'
                          % (sys.executable, regression['paths']['onnx']), shell=True, cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ''
    assert _one_line(proc.stderr) == ('error: expected CSV of at most 64 MiB in <stdin>, found '
                                      'more (a larger input goes in a .npy file)')


def test_a_csv_file_over_the_bound_is_refused_unread(regression, tmp_path, capsys):
    path = tmp_path / 'x.csv'
    with open(str(path), 'wb') as f:
        f.truncate(MAX_CSV_BYTES + 1)  # sparse: no 64 MiB written
    line = _refused(['--model', regression['paths']['onnx'], '--input', str(path)], capsys,
                    command=_predict)
    assert line == ('error: expected CSV of at most 64 MiB in %s, found more (a larger input '
                    'goes in a .npy file)' % path)


class _Deadline(Exception):
    pass


def _alarm(signum, frame):
    raise _Deadline()


@pytest.mark.parametrize('name', ['s.npz', 'x.npy', 'x.csv'])
def test_a_fifo_as_sample_or_input_is_refused_at_once(regression, tmp_path, capsys, name):
    fifo = str(tmp_path / name)
    os.mkfifo(fifo)
    argv = (['--checkpoint', regression['run'], '--sample', fifo, '--out', str(tmp_path / 'e')]
            if name.endswith('.npz') else ['--model', regression['paths']['onnx'], '--input',
                                           fifo])
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)  # opening a FIFO for reading waits for a writer: fail, do not hang
    try:
        line = _refused(argv, capsys, command=_export if name.endswith('.npz') else _predict)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    what = 'a .npz file' if name.endswith('.npz') else 'an input file'
    assert line.endswith('expected %s at %s, found a FIFO' % (what, fifo)), line
    assert not os.path.exists(str(tmp_path / 'e'))


# -- 7. CSV numbers ----------------------------------------------------------------------

@pytest.mark.parametrize('field', ['1_0', '\u0661', '\uff11', '1e1_0', '0x10', '1.5\u00a0'],
                         ids=['underscore', 'arabic-indic', 'fullwidth', 'exponent-underscore',
                              'hex', 'no-break-space'])
def test_csv_numbers_other_than_ascii_notation_are_refused_naming_line_and_column(
        regression, tmp_path, capsys, field):
    assert field == '0x10' or float(field) is not None  # float() reads all but hex
    path = tmp_path / 'x.csv'
    path.write_text('# a comment_with \u0661\n1,2\n3,%s\n' % field, encoding='utf-8')
    line = _refused(['--model', regression['paths']['onnx'], '--input', str(path)], capsys,
                    command=_predict)
    assert line.startswith('error: expected numbers, found ')
    assert line.endswith(' in line 3, column 2 of %s (ASCII decimal or scientific notation, '
                         'such as -1.5e3)' % path), line


def test_csv_numbers_in_ascii_notation_read_as_numpy_reads_them(regression, tmp_path, capsys):
    fields = [' 1e3 ', '-.5', '+2.', '1E-3', '7', '-0.25e+1']
    path = tmp_path / 'x.csv'
    path.write_text(''.join('%s,%s\n' % (a, b) for a, b in zip(fields, fields[::-1])))
    status, _, err = _predict(['--model', regression['paths']['onnx'], '--input', str(path),
                               '--output', str(tmp_path / 'y.npy')], capsys)
    assert status == 0, err
    X = np.array([[float(a), float(b)] for a, b in zip(fields, fields[::-1])], np.float32)
    np.save(str(tmp_path / 'x.npy'), X)
    assert _predict(['--model', regression['paths']['onnx'], '--input', str(tmp_path / 'x.npy'),
                     '--output', str(tmp_path / 'z.npy')], capsys)[0] == 0
    np.testing.assert_array_equal(np.load(str(tmp_path / 'y.npy')),
                                  np.load(str(tmp_path / 'z.npy')))


# -- 8. paths too long to open, checked before any work ----------------------------------

def test_an_out_path_of_5000_characters_is_refused_before_the_checkpoint_is_read(tmp_path,
                                                                                capsys):
    out = str(tmp_path / ('x' * 5000))
    # the checkpoint does not exist: an --out checked after it would not be the message
    line = _refused(['--checkpoint', str(tmp_path / 'none'), '--out', out], capsys)
    assert line.startswith('error: --out: expected a path this system can open (names of at '
                           'most 255 bytes, 4096 in all), found ')
    assert line.endswith('characters): File name too long') and len(line) < 300


@pytest.mark.parametrize('flag', ['--checkpoint', '--sample'])
def test_a_checkpoint_or_sample_path_of_5000_characters_is_an_excerpt(tmp_path, capsys, flag):
    argv = {'--checkpoint': str(tmp_path / 'none'), '--out': str(tmp_path / 'e')}
    argv[flag] = str(tmp_path / ('x' * 5000 + '.npz'))
    line = _refused([word for item in argv.items() for word in item], capsys,
                    str(tmp_path / 'e'))
    assert line.startswith('error: %s: expected a path this system can open' % flag)
    assert len(line) < 300


def test_an_out_under_a_file_is_refused_before_the_checkpoint_is_read(tmp_path, capsys):
    (tmp_path / 'f').write_text('a file')
    line = _refused(['--checkpoint', str(tmp_path / 'none'), '--out',
                     str(tmp_path / 'f' / 'e')], capsys)
    assert line == 'error: --out: expected a folder, found a file at %s' % (tmp_path / 'f')


@pytest.mark.parametrize('flag', ['--model', '--input', '--output'])
def test_a_predict_path_of_5000_characters_is_an_excerpt(regression, tmp_path, capsys, flag):
    np.save(str(tmp_path / 'x.npy'), np.ones((3, 2), np.float32))
    argv = {'--model': regression['paths']['onnx'], '--input': str(tmp_path / 'x.npy')}
    argv[flag] = str(tmp_path / ('x' * 5000 + '.npy'))
    line = _refused([word for item in argv.items() for word in item], capsys, command=_predict)
    assert line.startswith('error: %s: expected a path this system can open' % flag), line
    assert len(line) < 300


# -- 9. an unfinished run ----------------------------------------------------------------

class _Stop(Exception):
    pass


@pytest.fixture(scope='module')
def unfinished(tmp_path_factory):
    """Two runs the store marks ``complete: false``: one stopped after epoch 1 of 3
    (its checkpoint is that epoch's), one that did not improve (``--lr 1e-30``)."""
    from mp_symbolic.training.loop import (  # pylint: disable=import-outside-toplevel
        TrainingDidNotLearn, train)
    small = dict(progress=False, devices='cpu:0,cpu:1', widths=(2, 8, 1), num_examples=64,
                 batch_size=16)
    stopped = str(tmp_path_factory.mktemp('stopped'))

    def stop_at_epoch_2(line):
        if line.startswith('epoch 2/3'):
            raise _Stop()

    with pytest.raises(_Stop):
        train(make_config(num_epochs=3, out=stopped, **small), log=stop_at_epoch_2)
    flat = str(tmp_path_factory.mktemp('flat'))
    with pytest.raises(TrainingDidNotLearn):
        train(make_config(num_epochs=1, lr=1e-30, out=flat, **small), log=lambda line: None)
    return {'stopped': stopped, 'flat': flat}


def test_the_export_of_an_unfinished_run_says_so_and_exports(unfinished, regression, tmp_path,
                                                             capsys):
    status, out, err = _export(['--checkpoint', unfinished['stopped'], '--out',
                                str(tmp_path / 'a')], capsys)
    assert status == 0, err
    assert ('note: the checkpoint is of an unfinished run (epoch 1 of 3); exporting it as it is'
            in out.splitlines())
    assert os.path.isfile(str(tmp_path / 'a' / 'current' / 'regression.onnx'))
    status, out, err = _export(['--checkpoint', unfinished['flat'], '--out',
                                str(tmp_path / 'b')], capsys)
    assert status == 0, err
    notes = [line for line in out.splitlines() if line.startswith('note: ')]
    assert len(notes) == 1 and notes[0].startswith(
        'note: the checkpoint is of an unfinished run (epoch 1 of 1, marked not improved: MSE ')
    assert notes[0].endswith(' after); exporting it as it is')
    # a finished run has no note
    status, out, err = _export(['--checkpoint', regression['run'], '--out',
                                str(tmp_path / 'c')], capsys)
    assert status == 0 and 'unfinished' not in out


# -- 10. inputs and outputs of any rank --------------------------------------------------

def test_images_of_the_models_own_rank_predict_maps_in_both_runtimes(conv, tmp_path, capsys):
    from export.runtimes import load_predictor  # pylint: disable=import-outside-toplevel
    X = np.random.default_rng(3).normal(size=(5, 3, 8, 8)).astype(np.float32)
    np.save(str(tmp_path / 'images.npy'), X)
    np.save(str(tmp_path / 'flat.npy'), X.reshape(5, -1))  # flat rows, as before
    found = {}
    for model in ('onnx', 'symbol'):
        for name in ('images', 'flat'):
            out = str(tmp_path / ('%s-%s.npy' % (model, name)))
            argv = ['--model', conv[model], '--input', str(tmp_path / (name + '.npy')),
                    '--output', out] + (['--devices', 'cpu:0,cpu:1'] if model == 'symbol' else [])
            status, _, err = _predict(argv, capsys)
            assert status == 0, err
            found[model, name] = np.load(out)
        found[model, 'python'] = load_predictor(conv[model], None if model == 'onnx'
                                                else 'cpu:0,cpu:1').predict(X)
    reference = found['symbol', 'images']
    assert reference.shape == (5, 2, 8, 8)
    for key, Y in found.items():
        np.testing.assert_allclose(Y, reference, rtol=0, atol=1e-5, err_msg=str(key))


@pytest.mark.parametrize('model', ['onnx', 'symbol'])
@pytest.mark.parametrize('output', [None, 'y.csv'])
def test_maps_to_csv_are_refused_in_one_line_pointing_to_npy(conv, tmp_path, capsys, model,
                                                             output):
    np.save(str(tmp_path / 'x.npy'), np.ones((2, 3, 8, 8), np.float32))
    argv = ['--model', conv[model], '--input', str(tmp_path / 'x.npy')]
    if output:
        argv += ['--output', str(tmp_path / output)]
    status, out, line = _predict(argv, capsys)
    assert status == 2 and out == ''
    assert line == ('error: expected predictions of shape (samples,) or (samples, outputs) for '
                    'CSV %s (one sample per line), found 4 dimensions: write them with --output '
                    'FILE.npy, which keeps their shape'
                    % ('on stdout' if output is None else 'in %s' % (tmp_path / output)))
    assert sorted(os.listdir(str(tmp_path))) == ['x.npy']


def test_images_of_another_shape_are_refused_naming_both_forms(conv, tmp_path, capsys):
    np.save(str(tmp_path / 'x.npy'), np.ones((2, 3, 8, 9), np.float32))
    line = _refused(['--model', conv['onnx'], '--input', str(tmp_path / 'x.npy'), '--output',
                     str(tmp_path / 'y.npy')], capsys, str(tmp_path / 'y.npy'), command=_predict)
    assert line == ('error: expected an array of shape (samples, 192) or (samples,) + (3, 8, 8) '
                    'in %s, found shape (2, 3, 8, 9) in its header' % (tmp_path / 'x.npy'))


def test_a_gluoncv_resnet18_body_exports_and_predicts_nd_maps(tmp_path):
    """GluonCV's ResNet-18 v1b (random weights) to its last stage, on two
    devices: (N, 3, 32, 32) images in, (N, 512, 1, 1) features out."""
    mx = pytest.importorskip('mxnet')
    model_zoo = pytest.importorskip('gluoncv.model_zoo')
    from mxnet.gluon import nn  # pylint: disable=import-outside-toplevel
    import mp_symbolic  # pylint: disable=import-outside-toplevel
    from export.exporter import export_checkpoint  # pylint: disable=import-outside-toplevel
    from export.runtimes import load_predictor  # pylint: disable=import-outside-toplevel
    mx.random.seed(0)
    net = model_zoo.get_model('resnet18_v1b', pretrained=False)
    body = nn.HybridSequential()
    for name in ('conv1', 'bn1', 'relu', 'maxpool', 'layer1', 'layer2', 'layer3', 'layer4'):
        body.add(getattr(net, name))
    body.initialize(mx.init.Xavier())
    mod = mp_symbolic.Pipeline(body, 'cpu:0,cpu:1', sample=(1, 3, 32, 32)).module(loss='l2')
    mod.bind(data_shapes=[('data', (2, 3, 32, 32))],
             label_shapes=[('softmax_label', (2, 512, 1, 1))], for_training=False)
    mod.init_params(mx.init.Xavier())
    mp_symbolic.save_checkpoint(mod, str(tmp_path / 'r18'), epoch=0)
    paths, report = export_checkpoint(str(tmp_path / 'r18' / 'current' / 'model'),
                                      str(tmp_path / 'export'), epoch=0, verify_batches=[1, 3],
                                      log=lambda line: None)
    assert report['ok']
    X = np.random.default_rng(0).normal(size=(4, 3, 32, 32)).astype(np.float32)
    onnx_out = load_predictor(paths['onnx']).predict(X)
    mxnet_out = load_predictor(paths['symbol'], 'cpu:0,cpu:1').predict(X)
    assert onnx_out.shape == mxnet_out.shape == (4, 512, 1, 1)
    np.testing.assert_allclose(onnx_out, mxnet_out, rtol=0,
                               atol=1e-5 * float(np.abs(mxnet_out).max()))
    with open(paths['symbol']) as f:
        assert len({n['attrs']['__ctx_group__'] for n in json.load(f)['nodes']}) == 2



@pytest.mark.slow
def test_a_network_whose_weights_onednn_reorders_in_place_exports_with_its_values(tmp_path):
    """GluonCV's SimplePose (ResNet-18 v1b, random weights) on two devices:
    MXNet's oneDNN backend reorders weights it binds (a convolution's, a
    deconvolution's) into its own layout in place at a forward pass, where
    MXNet copies no host memory into them. The export verifies (its
    float32 sensitivity writes the checkpoint's arrays one ulp off and
    back) and writes the checkpoint's values."""
    mx = pytest.importorskip('mxnet')
    model_zoo = pytest.importorskip('gluoncv.model_zoo')
    import mp_symbolic  # pylint: disable=import-outside-toplevel
    from export.exporter import export_checkpoint  # pylint: disable=import-outside-toplevel
    mx.random.seed(0)
    net = model_zoo.get_model('simple_pose_resnet18_v1b', pretrained=False, pretrained_base=False)
    net.initialize(mx.init.Xavier())
    mod = mp_symbolic.Pipeline(net, 'cpu:0,cpu:1', sample=(1, 3, 32, 32)).module(loss='l2')
    mod.bind(data_shapes=[('data', (2, 3, 32, 32))],
             label_shapes=[('softmax_label', (2, 17, 8, 8))], for_training=False)
    mod.init_params(mx.init.Xavier())
    mp_symbolic.save_checkpoint(mod, str(tmp_path / 'pose'), epoch=0)
    prefix = str(tmp_path / 'pose' / 'current' / 'model')
    paths, report = export_checkpoint(prefix, str(tmp_path / 'export'), epoch=0,
                                      verify_batches=[1, 3], log=lambda line: None)
    assert report['ok']
    saved = mx.nd.load('%s-0000.params' % prefix)
    exported = mx.nd.load(paths['params'])
    assert sorted(saved) == sorted(exported)
    for name, value in saved.items():
        np.testing.assert_array_equal(exported[name].asnumpy(), value.asnumpy(), err_msg=name)
