"""Which Gluon layers export to ONNX: each in a small two-stage Pipeline on
``cpu:0,cpu:1``, saved with ``save_checkpoint``, exported by
:func:`export.exporter.export_checkpoint` (``python -m export --checkpoint
PREFIX --epoch 1``, in-process) and run in onnxruntime.

A layer that exports must pass the export's own verification (ONNX checker at
the declared opset, onnxruntime and the re-bound MXNet pair equal to the
checkpoint bound on one device within 1e-5 at batch sizes 1, 7 and 1000); a
layer that cannot must be refused in one line naming the op and its block.
The table is docs/export.md's.
"""
import mxnet as mx
from mxnet.gluon import nn, rnn
from mxnet.onnx.mx2onnx._export_onnx import MXNetGraph
from mxnet.onnx.mx2onnx._op_translations import _op_translations_opset12 as mx12
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from export.errors import ExportError
from export.exporter import export_checkpoint
from mp_symbolic.core.pipeline import Pipeline

DEVICES = 'cpu:0,cpu:1'
TOL = 1e-5
EXPORTS = 'exports'


class Residual(nn.HybridBlock):
    """``x + dense(x)``: a graph with a skip connection."""

    def __init__(self, num_hiddens, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = nn.Dense(num_hiddens, in_units=num_hiddens)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return F.relu(x + self.dense(x))


class Concat(nn.HybridBlock):
    """``concat(dense_a(x), dense_b(x))``: two branches joined."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.a = nn.Dense(3, in_units=4)
            self.b = nn.Dense(5, in_units=4)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return F.concat(self.a(x), self.b(x), dim=1)


def _reduce(how):
    """A block reducing over axis 1 (time or features) with ``F.<how>``."""
    return nn.HybridLambda(lambda F, x: getattr(F, how)(x, axis=1), prefix='%s_' % how)


def _last_step():
    return nn.HybridLambda(lambda F, x: F.slice_axis(x, axis=1, begin=-1, end=None),
                           prefix='last_')


def _ids(vocab):
    """Float inputs -> valid token ids (|x| clipped), as both runtimes truncate them."""
    return nn.HybridLambda(lambda F, x: F.clip(F.abs(x) * 2, 0, vocab - 1), prefix='ids_')


# name: (blocks factory, per-sample input shape, blocks in stage 0, EXPORTS or the refusal)
CASES = {
    # core
    'Dense': (lambda: [nn.Dense(6, in_units=4), nn.Dense(3, in_units=6)], (4,), 1, EXPORTS),
    'Dropout': (lambda: [nn.Dense(6, in_units=4), nn.Dropout(0.5)], (4,), 1, EXPORTS),
    'Flatten': (lambda: [nn.Conv2D(2, 3, in_channels=1), nn.Flatten()], (1, 5, 5), 1, EXPORTS),
    'Embedding': (lambda: [_ids(10), nn.Embedding(10, 3), nn.Flatten()], (4,), 1, EXPORTS),
    'HybridLambda': (lambda: [nn.Dense(6, in_units=4),
                              nn.HybridLambda(lambda F, x: F.tanh(x) * 2, prefix='lambda_')],
                     (4,), 1, EXPORTS),
    # convolution and pooling
    'Conv1D': (lambda: [nn.Conv1D(3, 3, padding=1, strides=2, in_channels=2), nn.Flatten()],
               (2, 9), 1, EXPORTS),
    'Conv1D dilated': (lambda: [nn.Conv1D(3, 2, dilation=2, in_channels=2), nn.Flatten()],
                       (2, 9), 1, EXPORTS),
    'Conv2D': (lambda: [nn.Conv2D(3, 3, padding=1, in_channels=2), nn.Flatten()],
               (2, 6, 6), 1, EXPORTS),
    'Conv2DTranspose': (lambda: [nn.Conv2DTranspose(2, 3, strides=2, in_channels=2),
                                 nn.Flatten()], (2, 4, 4), 1, EXPORTS),
    'Conv1DTranspose': (lambda: [nn.Conv1DTranspose(2, 3, strides=2, in_channels=2),
                                 nn.Flatten()], (2, 5), 1, EXPORTS),
    'MaxPool1D': (lambda: [nn.Conv1D(2, 1, in_channels=2), nn.MaxPool1D(2), nn.Flatten()],
                  (2, 8), 2, EXPORTS),
    'AvgPool1D': (lambda: [nn.Conv1D(2, 1, in_channels=2), nn.AvgPool1D(3, 2, 1),
                           nn.Flatten()], (2, 8), 2, EXPORTS),
    'GlobalAvgPool1D': (lambda: [nn.Conv1D(2, 1, in_channels=2), nn.GlobalAvgPool1D(),
                                 nn.Flatten()], (2, 8), 2, EXPORTS),
    'GlobalMaxPool1D': (lambda: [nn.Conv1D(2, 1, in_channels=2), nn.GlobalMaxPool1D(),
                                 nn.Flatten()], (2, 8), 2, EXPORTS),
    'MaxPool2D': (lambda: [nn.Conv2D(2, 1, in_channels=2), nn.MaxPool2D(2), nn.Flatten()],
                  (2, 6, 6), 1, EXPORTS),
    'AvgPool2D': (lambda: [nn.Conv2D(2, 1, in_channels=2), nn.AvgPool2D(3, 2, 1),
                           nn.Flatten()], (2, 6, 6), 1, EXPORTS),
    'GlobalAvgPool2D': (lambda: [nn.Conv2D(2, 1, in_channels=2), nn.GlobalAvgPool2D(),
                                 nn.Flatten()], (2, 6, 6), 1, EXPORTS),
    'GlobalMaxPool2D': (lambda: [nn.Conv2D(2, 1, in_channels=2), nn.GlobalMaxPool2D(),
                                 nn.Flatten()], (2, 6, 6), 1, EXPORTS),
    # normalisation
    'BatchNorm': (lambda: [nn.Conv2D(3, 3, in_channels=2), nn.BatchNorm(in_channels=3),
                           nn.Flatten()], (2, 5, 5), 1, EXPORTS),
    'BatchNorm(scale=False)': (lambda: [nn.Conv2D(3, 1, in_channels=2),
                                        nn.BatchNorm(scale=False, in_channels=3), nn.Flatten()],
                               (2, 4, 4), 1, EXPORTS),
    'LayerNorm': (lambda: [nn.Dense(6, in_units=4), nn.LayerNorm(in_channels=6)],
                  (4,), 1, EXPORTS),
    'InstanceNorm': (lambda: [nn.Conv2D(3, 1, in_channels=2), nn.InstanceNorm(in_channels=3),
                              nn.Flatten()], (2, 4, 4), 1, EXPORTS),
    'GroupNorm': (lambda: [nn.Conv2D(4, 1, in_channels=2), nn.GroupNorm(2), nn.Flatten()],
                  (2, 4, 4), 1, EXPORTS),
    'GroupNorm on (N, C, W)': (lambda: [nn.Conv1D(6, 1, in_channels=2), nn.GroupNorm(3),
                                        nn.Flatten()], (2, 5), 1, EXPORTS),
    'BatchNormReLU': (lambda: [nn.Conv2D(3, 1, in_channels=2), nn.BatchNormReLU(in_channels=3),
                               nn.Flatten()], (2, 4, 4), 1,
                      'cannot export op _contrib_BatchNormWithReLU of block batchnormrelu0 '
                      "(stage1): MXNet's ONNX converter has no translation for it"),
    # recurrent, reduced over time
    'LSTM + mean': (lambda: [rnn.LSTM(5, layout='NTC', input_size=4), _reduce('mean')],
                    (3, 4), 1, EXPORTS),
    'GRU + mean': (lambda: [rnn.GRU(5, layout='NTC', input_size=4), _reduce('mean')],
                   (3, 4), 1, EXPORTS),
    'GRU bidirectional + mean': (
        lambda: [rnn.GRU(5, layout='NTC', input_size=4, bidirectional=True), _reduce('mean')],
        (3, 4), 1, "cannot export op RNN of block gru0 (stage0): MXNet's ONNX converter "
                   'refused it (Currently RNN onnx export only supports bidirectional is False)'),
    'RNN + last step': (lambda: [rnn.RNN(5, layout='NTC', input_size=4), _last_step(),
                                 nn.Flatten()], (3, 4), 1, EXPORTS),
    'LSTM 2 layers + last step': (lambda: [rnn.LSTM(5, num_layers=2, layout='NTC',
                                                    input_size=5), _last_step(), nn.Flatten()],
                                  (3, 5), 1, EXPORTS),
    'LSTM 2 layers, input size != hidden': (
        lambda: [rnn.LSTM(5, num_layers=2, layout='NTC', input_size=4), _last_step(),
                 nn.Flatten()], (3, 4), 1,
        "cannot export op RNN of block lstm0 (stage0): MXNet's ONNX converter handles "
        'num_layers=2 only with an input size equal to the hidden size, found input size 4, '
        'hidden size 5'),
    # activations
    'relu': (lambda: [nn.Dense(6, in_units=4), nn.Activation('relu')], (4,), 1, EXPORTS),
    'sigmoid': (lambda: [nn.Dense(6, in_units=4), nn.Activation('sigmoid')], (4,), 1, EXPORTS),
    'tanh': (lambda: [nn.Dense(6, in_units=4), nn.Activation('tanh')], (4,), 1, EXPORTS),
    'softrelu': (lambda: [nn.Dense(6, in_units=4), nn.Activation('softrelu')],
                 (4,), 1, EXPORTS),
    'softsign': (lambda: [nn.Dense(6, in_units=4), nn.Activation('softsign')],
                 (4,), 1, EXPORTS),
    'LeakyReLU': (lambda: [nn.Dense(6, in_units=4), nn.LeakyReLU(0.1)], (4,), 1, EXPORTS),
    'PReLU': (lambda: [nn.Dense(6, in_units=4), nn.PReLU()], (4,), 1, EXPORTS),
    'ELU': (lambda: [nn.Dense(6, in_units=4), nn.ELU()], (4,), 1, EXPORTS),
    'SELU': (lambda: [nn.Dense(6, in_units=4), nn.SELU()], (4,), 1, EXPORTS),
    'GELU': (lambda: [nn.Dense(6, in_units=4), nn.GELU()], (4,), 1, EXPORTS),
    'Swish': (lambda: [nn.Dense(6, in_units=4), nn.Swish()], (4,), 1, EXPORTS),
    # reductions
    'F.mean': (lambda: [nn.Dense(6, in_units=4, flatten=False), _reduce('mean')],
               (3, 4), 1, EXPORTS),
    'F.sum': (lambda: [nn.Dense(6, in_units=4, flatten=False), _reduce('sum')],
              (3, 4), 1, EXPORTS),
    'F.max': (lambda: [nn.Dense(6, in_units=4, flatten=False), _reduce('max')],
              (3, 4), 1, EXPORTS),
    # graphs that are not a chain
    'residual': (lambda: [nn.Dense(4, in_units=4), Residual(4)], (4,), 1, EXPORTS),
    'concat': (lambda: [Concat(), nn.Dense(2, in_units=8)], (4,), 1, EXPORTS),
}


def _checkpoint(blocks, shape, stage0, prefix, seed=0):
    """The blocks in a two-stage Pipeline, every parameter and auxiliary state
    random (running variances positive), saved as ``prefix``-0001."""
    pipe = Pipeline(blocks, DEVICES, balance=[stage0, len(blocks) - stage0],
                    sample=(2,) + shape)  # shapes of layers given no input size
    mod = pipe.module(loss='l2')
    out_shape = pipe.symbol().infer_shape(data=(2,) + shape)[1][0]
    mod.bind(data_shapes=[('data', (2,) + shape)],
             label_shapes=[('softmax_label', out_shape)], for_training=False)
    mod.init_params(mx.init.Zero())
    rng = np.random.default_rng(seed)
    arg_params, aux_params = mod.get_params()
    arg_params = {k: mx.nd.array(rng.normal(0, 0.5, v.shape)) for k, v in arg_params.items()}
    aux_params = {k: mx.nd.array(rng.uniform(0.5, 1.5, v.shape) if k.endswith('_var')
                                 else rng.normal(0, 0.5, v.shape))
                  for k, v in aux_params.items()}
    mod.set_params(arg_params, aux_params)
    mod.save_checkpoint(prefix, 1)
    return pipe


@pytest.mark.parametrize('name', list(CASES))
def test_layer_exports_with_parity_or_is_refused_in_one_line(name, tmp_path):
    make_blocks, shape, stage0, expected = CASES[name]
    prefix = str(tmp_path / 'model')
    with mx.name.NameManager():  # block names counted from 0 in each case (lstm0, ...)
        blocks = make_blocks()
    pipe = _checkpoint(blocks, shape, stage0, prefix)
    assert len(pipe.stages[0]) == stage0 and len(pipe.stages[1]) >= 1
    out = str(tmp_path / 'export')
    if expected != EXPORTS:
        with pytest.raises(ExportError) as refused:
            export_checkpoint(prefix, out, epoch=1, log=lambda line: None)
        assert str(refused.value) == expected
        assert '\n' not in str(refused.value)
        return
    paths, report = export_checkpoint(prefix, out, epoch=1, log=lambda line: None)
    failed = [row for row in report['checks'] + report['parity'] if not row['ok']]
    assert report['ok'], failed
    assert {row['batch_size'] for row in report['parity']} == {1, 7, 1000}
    # onnxruntime against the split MXNet pair on inputs of its own, once more
    X = np.random.default_rng(1).normal(0, 1, (5,) + shape).astype(np.float32)
    session = ort.InferenceSession(paths['onnx'], providers=['CPUExecutionProvider'])
    onnx_out = session.run(None, {'data': X})[0]
    sym, arg_params, aux_params = mx.model.load_checkpoint(prefix, 1)
    prediction = sym.get_children()[0]  # the l2 head's input
    exe = prediction.simple_bind(ctx=mx.cpu(0), grad_req='null', data=X.shape)
    exe.copy_params_from(arg_params, aux_params, allow_extra_params=True)
    expected_out = exe.forward(is_train=False, data=X)[0].asnumpy()
    np.testing.assert_allclose(onnx_out, expected_out.reshape(onnx_out.shape),
                               rtol=TOL, atol=TOL)


def test_converter_graph_check_runs_at_the_declared_opset_and_is_restored(tmp_path, monkeypatch):
    """A node valid only at a newer opset (ReduceMean with its axes as an input,
    opset 18) is refused at the declared opset 13, in one line; MXNet's
    converter and onnx's checker are the library's own again afterwards."""
    def reduce_mean_opset18(node, **kwargs):
        name, inputs, _ = mx12.get_inputs(node, kwargs)
        mx12.create_tensor([1], name + '_axes', kwargs['initializer'])
        return [onnx.helper.make_node('ReduceMean', [inputs[0], name + '_axes'], [name],
                                      name=name)]

    monkeypatch.setitem(MXNetGraph.registry_[13], 'mean', reduce_mean_opset18)
    make_blocks, shape, stage0, _ = CASES['F.mean']
    prefix = str(tmp_path / 'model')
    with mx.name.NameManager():
        blocks = make_blocks()
    _checkpoint(blocks, shape, stage0, prefix)
    check_graph, convert_layer = onnx.checker.check_graph, MXNetGraph.__dict__['convert_layer']
    with pytest.raises(ExportError) as refused:
        export_checkpoint(prefix, str(tmp_path / 'export'), epoch=1, log=lambda line: None)
    assert str(refused.value).startswith('MXNet converted this graph to ONNX that is not valid '
                                         'at opset 13: ')
    assert 'ReduceMean' in str(refused.value) and '\n' not in str(refused.value)
    assert onnx.checker.check_graph is check_graph
    assert MXNetGraph.__dict__['convert_layer'] is convert_layer
