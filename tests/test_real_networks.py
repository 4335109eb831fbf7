"""The networks MXNet users have, split over cpu(i) devices: GluonNLP BERT
with its three inputs and three outputs, GluonCV segmentation and detection
networks with several outputs of any shape. Random initial values (nothing
is downloaded).

Each network given whole to ``Pipeline``: the inference module outputs what
the network outputs on one device, the imperative twin's SGD step with
``mp_symbolic.Trainer`` equals ``gluon.Trainer`` on one device, and the
checkpoint exports with parity. The large GluonCV networks run with
``MP_ZOO_SWEEP=1`` (minutes each).
"""
import os

import mxnet as mx
from mxnet import gluon
import numpy as np
import onnxruntime as ort
import pytest

import mp_symbolic
from mp_symbolic import Pipeline

from export.__main__ import main as export_main
from conftest import bert_batch, bert_trainer_steps, small_bert

FOUR_DEVICES = 'cpu:0,cpu:1,cpu:2,cpu:3'
SWEEP = pytest.mark.skipif(not os.environ.get('MP_ZOO_SWEEP'),
                           reason='GluonCV detection and segmentation take minutes; '
                                  'set MP_ZOO_SWEEP=1')


_bert = small_bert
_bert_batch = bert_batch


def _values(net):
    return {name: param.data().copy() for name, param in net.collect_params().items()}


def _inference_module(pipe, xs, net):
    mod = pipe.module(loss=None)
    mod.bind(data_shapes=list(zip(pipe.input_names, [x.shape for x in xs])), for_training=False)
    arg_names = set(mod.symbol.list_arguments())
    values = _values(net)
    mod.init_params(arg_params={n: v for n, v in values.items() if n in arg_names},
                    aux_params={n: v for n, v in values.items() if n not in arg_names})
    mod.forward(mx.io.DataBatch([mx.nd.array(x) for x in xs]), is_train=False)
    return mod


def test_bert_takes_its_three_inputs_split_over_four_devices_and_outputs_all_three():
    net = _bert()
    xs = _bert_batch()
    one_device = [o.asnumpy() for o in net(*[mx.nd.array(x) for x in xs])]
    pipe = Pipeline(net, FOUR_DEVICES, sample=tuple(xs))
    assert pipe.input_names == ('data0', 'data1', 'data2') and len(pipe.balance) == 4
    mod = _inference_module(pipe, xs, net)
    outputs = [o.asnumpy() for o in mod.get_outputs()]
    assert [o.shape for o in outputs] == [(4, 8, 16), (4, 16), (4, 2)]
    for ours, theirs in zip(outputs, one_device):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    devices = {a.context for a in mod.executors[0].arg_dict.values()}  # the parameters
    assert devices == {mx.cpu(i) for i in range(4)}


def test_bert_twin_step_with_the_trainer_equals_gluon_trainer_on_one_device():
    xs = _bert_batch()
    pipe, out, ref_out, reference, start = bert_trainer_steps(
        lambda net: Pipeline(net, FOUR_DEVICES, sample=tuple(xs)))
    for ours, theirs in zip(out, ref_out):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    ref_values = _values(reference)
    moved = 0
    for name, param in pipe.collect_params().items():
        value = param.data(param.list_ctx()[0]).asnumpy()
        np.testing.assert_allclose(value, ref_values[name].asnumpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=name)
        moved += not np.array_equal(value, start[name].asnumpy())
    assert moved > 10
    assert {c for p in pipe.collect_params().values() for c in p.list_ctx()} == \
        {mx.cpu(i) for i in range(4)}


def test_bert_trains_with_the_loss_on_one_output_and_keeps_the_others(tmp_path):
    net = _bert()
    xs = _bert_batch()
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=tuple(xs))
    mod = pipe.module(loss='softmax', output=2)
    assert mod.output_names[0] == 'softmax_output' and len(mod.output_names) == 3
    data = mx.io.NDArrayIter(dict(zip(pipe.input_names, xs)), np.array([0, 1, 1, 0]),
                             batch_size=4)
    before = {n: v.asnumpy() for n, v in _values(net).items()}
    mod.fit(data, num_epoch=1, optimizer='sgd', optimizer_params={'learning_rate': 0.5},
            arg_params=_values(net), aux_params={}, allow_missing=False, eval_metric='acc')
    after, _ = mod.get_params()
    assert not np.array_equal(after['bert_cls_weight'].asnumpy(),
                              before['bert_cls_weight'])
    score = dict(mod.score(data, 'acc'))
    assert 0 <= score['accuracy'] <= 1
    with pytest.raises(ValueError, match=r'output: expected the index of the output the loss '
                                         r'reads \(the network has 3 outputs\), found None'):
        pipe.module(loss='softmax')
    # exported, the outputs are the network's again, in its order: the head's prediction
    # (softmax of the scores) goes back to place 2
    mp_symbolic.save_checkpoint(mod, str(tmp_path / 'bert'), epoch=1, name='bert')
    np.savez(str(tmp_path / 'sample.npz'), **dict(zip(pipe.input_names, xs)))
    assert export_main(['--checkpoint', str(tmp_path / 'bert'), '--out', str(tmp_path / 'out'),
                        '--sample', str(tmp_path / 'sample.npz'), '--verify-batches', '4']) == 0
    trained = _bert({n: v for n, v in after.items()})
    expected = [o.asnumpy() for o in trained(*[mx.nd.array(x) for x in xs])]
    expected[2] = mx.nd.softmax(mx.nd.array(expected[2])).asnumpy()
    session = ort.InferenceSession(str(tmp_path / 'out' / 'current' / 'bert.onnx'),
                                   providers=['CPUExecutionProvider'])
    got = session.run(None, dict(zip(pipe.input_names, xs)))
    assert [g.shape for g in got] == [e.shape for e in expected]
    for ours, theirs in zip(got, expected):
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


def test_bert_checkpoint_exports_with_its_sample_and_matches_in_onnxruntime(tmp_path):
    net = _bert()
    xs = _bert_batch()
    one_device = [o.asnumpy() for o in net(*[mx.nd.array(x) for x in xs])]
    pipe = Pipeline(net, FOUR_DEVICES, sample=tuple(xs))
    mod = _inference_module(pipe, xs, net)
    mp_symbolic.save_checkpoint(mod, str(tmp_path / 'bert'), epoch=0, name='bert')
    np.savez(str(tmp_path / 'sample.npz'), **dict(zip(pipe.input_names, xs)))
    assert export_main(['--checkpoint', str(tmp_path / 'bert'), '--out', str(tmp_path / 'out'),
                        '--sample', str(tmp_path / 'sample.npz'), '--verify-batches', '1,4']) == 0
    session = ort.InferenceSession(str(tmp_path / 'out' / 'current' / 'bert.onnx'),
                                   providers=['CPUExecutionProvider'])
    assert [i.name for i in session.get_inputs()] == ['data0', 'data1', 'data2']
    got = session.run(None, dict(zip(pipe.input_names, xs)))
    for ours, theirs in zip(got, one_device):
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


def test_a_block_list_whose_first_block_takes_two_inputs():
    class Pair(gluon.HybridBlock):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            with self.name_scope():
                self.left, self.right = gluon.nn.Dense(8, in_units=3), gluon.nn.Dense(8, in_units=5)

        def hybrid_forward(self, F, a, b):  # pylint: disable=arguments-differ
            return F.relu(self.left(a) + self.right(b))

    blocks = [Pair(prefix='pair_'), gluon.nn.Dense(4, in_units=8, prefix='out_')]
    for block in blocks:
        block.initialize(mx.init.Xavier())
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=(6, 5)).astype(np.float32)
    expected = blocks[1](blocks[0](mx.nd.array(a), mx.nd.array(b))).asnumpy()
    pipe = Pipeline(blocks, 'cpu:1,cpu:2', sample=(a, b), chunks=2)
    pipe.initialize()  # moves the values onto their stages' devices
    assert pipe.input_names == ('data0', 'data1')
    np.testing.assert_allclose(pipe(mx.nd.array(a), mx.nd.array(b)).asnumpy(), expected,
                               rtol=1e-5, atol=1e-6)
    symbol = pipe.symbol()
    assert symbol.list_arguments()[:1] == ['data0'] and 'data1' in symbol.list_arguments()
    with pytest.raises(TypeError, match=r'inputs: expected 2 \(data0, data1\), found 1'):
        pipe(mx.nd.array(a))


def _gluoncv(name, **kwargs):
    model_zoo = pytest.importorskip('gluoncv.model_zoo')
    mx.random.seed(0)
    net = model_zoo.get_model(name, pretrained=False, **kwargs)
    net.initialize(mx.init.Xavier(), force_reinit=True)
    return net


@SWEEP
def test_fcn_segmentation_map_splits_matches_one_device_and_exports(tmp_path):
    net = _gluoncv('fcn_resnet50_voc', pretrained_base=False, crop_size=64, base_size=64)
    x = np.random.default_rng(0).normal(size=(1, 3, 64, 64)).astype(np.float32)
    one_device = net(mx.nd.array(x))
    one_device = [o.asnumpy() for o in (one_device if isinstance(one_device, (list, tuple))
                                        else [one_device])]
    pipe = Pipeline(net, FOUR_DEVICES, sample=x)
    mod = _inference_module(pipe, [x], net)
    outputs = [o.asnumpy() for o in mod.get_outputs()]
    assert outputs[0].shape == (1, 21, 64, 64)
    for ours, theirs in zip(outputs, one_device):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    mp_symbolic.save_checkpoint(mod, str(tmp_path / 'fcn'), epoch=0, name='fcn')
    assert export_main(['--checkpoint', str(tmp_path / 'fcn'), '--out', str(tmp_path / 'out'),
                        '--verify-batches', '1,2']) == 0


@SWEEP
def test_yolo_three_outputs_split_match_one_device_and_export_ends_before_box_nms(
        tmp_path, capsys):
    net = _gluoncv('yolo3_mobilenet1.0_voc', pretrained_base=False)
    x = np.random.default_rng(0).normal(size=(1, 3, 128, 128)).astype(np.float32)
    one_device = [o.asnumpy() for o in net(mx.nd.array(x))]
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=x)
    mod = _inference_module(pipe, [x], net)
    outputs = [o.asnumpy() for o in mod.get_outputs()]
    assert len(outputs) == 3
    for ours, theirs in zip(outputs, one_device):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    mp_symbolic.save_checkpoint(mod, str(tmp_path / 'yolo'), epoch=0, name='yolo')
    assert export_main(['--checkpoint', str(tmp_path / 'yolo'), '--out', str(tmp_path / 'out'),
                        '--verify-batches', '1,2']) == 0
    assert 'note: _contrib_box_nms left out' in capsys.readouterr().out


def test_bert_balances_by_time_with_its_lengths_cast_to_integers():
    """``balance='time'`` times each op of GluonNLP's BERT alone, at the
    dtypes the graph gives its inputs: the attention's ``softmax`` takes the
    ``valid_length`` cast to an integer, and refused the float32 it was once
    bound with ("This operation only support integer types")."""
    net = _bert()
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=[mx.nd.array(a) for a in bert_batch()],
                    balance='time')
    assert len(pipe.balance) == 2 and min(pipe.balance) > 0
