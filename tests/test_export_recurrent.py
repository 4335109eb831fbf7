"""``python -m export`` on a recurrent network's checkpoint: GluonNLP's LSTM
language model (``standard_lstm_lm_200`` over 50 words, random weights)
trained with ``batch_axis=1`` under 1F1B, its tokens ``(T, N)`` and states
``(L, N, C)``. The checkpoint records each input's layout (``'TN'``,
``'TNC'``); ``--sample`` holds the inputs so laid out, the ONNX model takes
them so, with its batch and sequence axes dynamic, and verifies. Without a
sample, each missing shape is asked for by name and layout, in one line.
"""
import json

import mxnet as mx
import numpy as np
import onnx
import pytest

import mp_symbolic
from mp_symbolic import Pipeline

from export.__main__ import main as export_main
from export.runtimes import OnnxPredictor
from tests.test_recurrent import LAYERS, N, T, VOCAB, _lm_batch, _lm_values


def _dims(value):
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


@pytest.fixture(scope='module')
def lm_checkpoint(tmp_path_factory):
    """``(net, folder, checkpoint args, the TNC sample's leaves)``: one SGD
    step of the language model under 1F1B, saved by
    ``mp_symbolic.save_checkpoint``; ``net`` holds the saved values."""
    folder = tmp_path_factory.mktemp('lm')
    net, values = _lm_values()
    (x, states), y = _lm_batch(0)
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=(x, states), batch_axis=1, chunks=2,
                    schedule='1f1b')
    mod = pipe.module(loss='softmax', output=0)
    leaves = [x] + states
    mod.bind(list(zip(pipe.input_names, [a.shape for a in leaves])), [('softmax_label', y.shape)])
    mod.init_params(arg_params=values, aux_params={})
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 0.1})
    mod.forward_backward(mx.io.DataBatch(leaves, [y]))
    mod.update()
    mp_symbolic.save_checkpoint(mod, str(folder / 'lm'), epoch=1, name='lm')
    stepped = mod.get_params()[0]
    for name, param in net.collect_params().items():  # the network holds what was saved
        param.set_data(stepped[name])
    arrays = [a.asnumpy() for a in leaves]
    np.savez(str(folder / 'sample.npz'), **dict(zip(pipe.input_names, arrays)))
    args = ['--checkpoint', str(folder / 'lm' / 'current' / 'lm'), '--epoch', '1']
    return net, folder, args, arrays


@pytest.fixture(scope='module')
def lm_export(lm_checkpoint):
    net, folder, args, arrays = lm_checkpoint
    assert export_main(args + ['--sample', str(folder / 'sample.npz'), '--out',
                               str(folder / 'out'), '--verify-batches', '1,4']) == 0
    return net, folder / 'out' / 'current', arrays


def test_the_checkpoint_records_each_inputs_layout(lm_checkpoint):
    _, folder, _, _ = lm_checkpoint
    symbol = mx.sym.load(str(folder / 'lm' / 'current' / 'lm-symbol.json'))
    attrs = symbol.attr_dict()
    assert [attrs[n].get('__layout__') for n in ('data0', 'data1', 'data2')] == \
        ['TN', 'TNC', 'TNC']


def test_a_tnc_sample_exports_with_batch_and_sequence_dynamic_and_verifies(lm_export):
    """No ``--dynamic``: the tokens' ``T`` (of ``'TN'``) is the sequence;
    the states' first axis (their layers) stays fixed."""
    _, folder, _ = lm_export
    model = onnx.load(str(folder / 'lm.onnx'))
    assert [_dims(v) for v in model.graph.input] == [['seq', 'batch'], [LAYERS, 'batch', 200],
                                                     [LAYERS, 'batch', 200]]
    assert [_dims(v) for v in model.graph.output] == [['seq', 'batch', VOCAB],
                                                      [LAYERS, 'batch', 200],
                                                      [LAYERS, 'batch', 200]]
    report = json.loads((folder / 'lm-verification.json').read_text())
    assert report['ok'] and report['dynamic_inputs'] == {'data0': {'1': 'seq'}}
    assert {tuple(row['shapes']['data0']) for row in report['parity']} == {
        (b, t) for b in (1, 4) for t in (1, 3, T)}  # batch first: (N, T)
    assert all(row['ok'] for row in report['parity']) and len(report['parity']) == 2 * 3 * 3 * 3


@pytest.mark.parametrize('seq_len', [2, T])
def test_the_onnx_model_takes_tnc_inputs_as_the_network_at_other_lengths(lm_export, seq_len):
    net, folder, _ = lm_export
    rng = np.random.default_rng(1)
    x = rng.integers(0, VOCAB, size=(seq_len, 3)).astype(np.float32)
    states = [(0.1 * rng.normal(size=(LAYERS, 3, 200))).astype(np.float32) for _ in range(2)]
    out, (h, c) = net(mx.nd.array(x), [mx.nd.array(s) for s in states])
    session = OnnxPredictor(str(folder / 'lm.onnx'), table=False).session
    got = session.run(None, {'data0': x, 'data1': states[0], 'data2': states[1]})
    assert [g.shape for g in got] == [(seq_len, 3, VOCAB), (LAYERS, 3, 200), (LAYERS, 3, 200)]
    for ours, theirs in zip(got, (mx.nd.softmax(out), h, c)):
        theirs = theirs.asnumpy()
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


def test_without_a_sample_each_missing_shape_is_asked_for_by_name_and_layout(lm_checkpoint,
                                                                             capsys):
    _, folder, args, _ = lm_checkpoint
    assert export_main(args + ['--out', str(folder / 'none')]) != 0
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and 'Traceback' not in err
    assert err.endswith(
        'expected the per-sample shapes of data0 (layout TN), data1 (layout TNC), data2 '
        '(layout TNC) recorded, found none: give each with --input-shape NAME=SHAPE, its '
        'shape without the batch axis N of its layout (e.g. --input-shape data0=8), or '
        '--sample FILE.npz holding each input as its layout lays it out')


def test_a_sample_of_other_batch_sizes_names_each_along_its_layouts_n(lm_checkpoint, tmp_path,
                                                                     capsys):
    _, _, args, arrays = lm_checkpoint
    x, h, c = arrays
    np.savez(str(tmp_path / 'bad.npz'), data0=x.T, data1=h, data2=c)  # tokens batch first
    assert export_main(args + ['--sample', str(tmp_path / 'bad.npz'), '--out',
                               str(tmp_path / 'out')]) != 0
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    assert err.endswith('--sample: expected the same batch size for every input, found data0 '
                        '%d (N of TN), data1 %d (N of TNC), data2 %d (N of TNC)' % (T, N, N))


def test_load_model_takes_and_returns_the_arrays_batch_first(lm_export):
    """``export.load_model(...).predict`` holds every model to batch first:
    the TNC model's tokens go in ``(N, T)``, its states ``(N, L, C)``, and
    its outputs come back so, the network's moved."""
    from export import load_model  # pylint: disable=import-outside-toplevel
    net, folder, _ = lm_export
    rng = np.random.default_rng(2)
    x = rng.integers(0, VOCAB, size=(3, 3)).astype(np.float32)
    states = [(0.1 * rng.normal(size=(LAYERS, 3, 200))).astype(np.float32) for _ in range(2)]
    out, (h, c) = net(mx.nd.array(x), [mx.nd.array(s) for s in states])
    expected = [np.moveaxis(a.asnumpy(), 1, 0) for a in (mx.nd.softmax(out), h, c)]
    loaded = load_model(str(folder.parent), devices='cpu:0,cpu:1')
    got = loaded.predict(x.T, *[np.moveaxis(s, 1, 0) for s in states])
    assert [g.shape for g in got] == [(3, 3, VOCAB), (3, LAYERS, 200), (3, LAYERS, 200)]
    for ours, theirs in zip(got, expected):
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


def test_input_shapes_given_by_name_without_their_batch_axis_export_and_verify(lm_checkpoint):
    """What the refusal asks for: ``--input-shape NAME=SHAPE``, each input's
    shape without its layout's ``N`` (tokens ``T``, states ``L,C``)."""
    _, folder, args, _ = lm_checkpoint
    assert export_main(args + ['--input-shape', 'data0=%d' % T, '--input-shape', 'data1=2,200',
                               '--input-shape', 'data2=2,200', '--out', str(folder / 'shaped'),
                               '--verify-batches', '1,3']) == 0
    report = json.loads((folder / 'shaped' / 'current' / 'lm-verification.json').read_text())
    assert report['ok'] and report['source']['input_shape'] == {
        'data0': [T], 'data1': [LAYERS, 200], 'data2': [LAYERS, 200]}
    model = onnx.load(str(folder / 'shaped' / 'current' / 'lm.onnx'))
    assert [_dims(v) for v in model.graph.input] == [['seq', 'batch'], [LAYERS, 'batch', 200],
                                                     [LAYERS, 'batch', 200]]
