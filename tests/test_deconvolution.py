"""Networks with a transposed convolution (``Conv2DTranspose``, MXNet's
``Deconvolution``; GluonCV's CenterNet upsamples with three), split over two
devices: one training step equals one device's, and the one graph of
several micro-batches, whose copies of the op share its weight, is refused
at bind in one line (MXNet 1.9.1's oneDNN backward writes such a weight's
gradient through a null pointer: compat.unallocated_weight_gradients)."""
import mxnet as mx
from mxnet import gluon
import numpy as np
import pytest

import mp_symbolic
from mp_symbolic import Pipeline
from mp_symbolic.core.base import compat
from mp_symbolic.core.graph import passes
from mp_symbolic.core.graph.ir import PlacedGraph

from export.__main__ import main as export_main

TWO_DEVICES = 'cpu:0,cpu:1'
ONEDNN = pytest.mark.skipif(not compat.onednn_active(),
                            reason='oneDNN is off in this process or this build')


def _upsampler():
    """Conv, BatchNorm, relu, a transposed convolution doubling the side,
    BatchNorm, relu, a 1x1 conv: CenterNet's upsampling head in small."""
    mx.random.seed(0)
    net = gluon.nn.HybridSequential(prefix='up_')
    with net.name_scope():
        net.add(gluon.nn.Conv2D(16, 3, padding=1, in_channels=3),
                gluon.nn.BatchNorm(in_channels=16), gluon.nn.Activation('relu'),
                gluon.nn.Conv2DTranspose(16, 4, strides=2, padding=1, in_channels=16,
                                         use_bias=False),
                gluon.nn.BatchNorm(in_channels=16), gluon.nn.Activation('relu'),
                gluon.nn.Conv2D(2, 1, in_channels=16))
    net.initialize(mx.init.Xavier())
    return net


def _values(net):
    return {name: param.data().copy() for name, param in net.collect_params().items()}


def _module(net, devices, x, label_shape, chunks=1, schedule='gpipe', output=None,
            for_training=True, **kwargs):
    pipe = Pipeline(net, devices, sample=x, chunks=chunks, schedule=schedule)
    mod = pipe.module(loss='l2', output=output, **kwargs)
    mod.bind(data_shapes=[('data', x.shape)],
             label_shapes=[(mod.label_names[0], label_shape)], for_training=for_training)
    return mod


def _one_step(net, values, devices, x, label, **kwargs):
    """The outputs of one training step of ``net`` from ``values``, and what
    SGD at rate 1 took from each parameter (its gradient, rescaled by the
    batch), as NumPy arrays."""
    mod = _module(net, devices, x, label.shape, **kwargs)
    aux = set(net.collect_params('.*running_.*').keys())
    mod.init_params(arg_params={n: v for n, v in values.items() if n not in aux},
                    aux_params={n: v for n, v in values.items() if n in aux})
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 1.0})
    mod.forward_backward(mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(label)]))
    mod.update()
    outputs = [o.asnumpy() for o in mod.get_outputs()]
    after, _ = mod.get_params()
    steps = {n: values[n].asnumpy() - after[n].asnumpy() for n in after}
    return outputs, steps


def _assert_same_step(ours, theirs, rtol=1e-5, atol=1e-6, still=0):
    """Same outputs, same step of every parameter; all but ``still`` of
    them moved."""
    for got, want in zip(ours[0], theirs[0]):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    assert sorted(ours[1]) == sorted(theirs[1])
    for name, step in theirs[1].items():
        np.testing.assert_allclose(ours[1][name], step, rtol=rtol, atol=atol, err_msg=name)
    assert sum(not np.any(step) for step in ours[1].values()) == still


def _batch():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(4, 3, 8, 8)).astype(np.float32),
            rng.normal(size=(4, 2, 16, 16)).astype(np.float32))


def test_a_transposed_convolution_split_over_two_devices_trains_one_step_as_one_device():
    net = _upsampler()
    values = _values(net)
    x, label = _batch()
    one_device = _one_step(net, values, 'cpu:0', x, label)
    _assert_same_step(_one_step(net, values, TWO_DEVICES, x, label), one_device)
    # micro-batches on the stage runtime: each stage graph reads the weight once
    chunked = _one_step(net, values, 'cpu:0', x, label, chunks=2)
    _assert_same_step(_one_step(net, values, TWO_DEVICES, x, label, chunks=2,
                                schedule='1f1b'), chunked)


@ONEDNN
def test_a_split_graph_training_a_deconvolution_whose_weight_micro_batches_share_is_refused():
    """The one graph of two micro-batches holds two copies of the
    transposed convolution reading one weight: its training bind is refused
    in one line before anything runs, naming the op and the cause. Bound for
    inference, or with the weight fixed, it runs."""
    net = _upsampler()
    values = _values(net)
    x, label = _batch()
    with pytest.raises(ValueError) as err:
        _module(net, TWO_DEVICES, x, label.shape, chunks=2)
    message = str(err.value)
    assert '\n' not in message
    assert message.startswith('up_conv1_fwd (Deconvolution): expected its weight read by it '
                              'alone to train a graph split over CPU devices with oneDNN, '
                              'found up_conv1_weight read by 2 ops (2 such ops in the graph)')
    assert 'through a null pointer' in message and "schedule='1f1b'" in message
    mod = _module(net, TWO_DEVICES, x, label.shape, chunks=2, for_training=False)
    aux = set(net.collect_params('.*running_.*').keys())
    mod.init_params(arg_params={n: v for n, v in values.items() if n not in aux},
                    aux_params={n: v for n, v in values.items() if n in aux})
    mod.forward(mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(label)]), is_train=False)
    np.testing.assert_allclose(mod.get_outputs()[0].asnumpy(), net(mx.nd.array(x)).asnumpy(),
                               rtol=1e-5, atol=1e-6)
    _, steps = _one_step(net, values, TWO_DEVICES, x, label, chunks=2,
                         fixed_param_names=['up_conv1_weight'])
    assert not np.any(steps['up_conv1_weight']) and np.any(steps['up_conv0_weight'])


def test_a_transposed_convolution_network_split_over_two_devices_exports_and_verifies(tmp_path):
    """Export's verification binds the checkpoint's own arrays for
    inference, where oneDNN's Deconvolution reorders its weight array into
    a layout of its own, and then writes each parameter one ulp off and
    back in place (compat.write_into): it used to fail there, with
    MXNet's ``!IsMKLDNNData()`` check."""
    net = _upsampler()
    values = _values(net)
    x, label = _batch()
    mod = _module(net, TWO_DEVICES, x, label.shape, for_training=False)
    aux = set(net.collect_params('.*running_.*').keys())
    mod.init_params(arg_params={n: v for n, v in values.items() if n not in aux},
                    aux_params={n: v for n, v in values.items() if n in aux})
    mp_symbolic.save_checkpoint(mod, str(tmp_path / 'up'), epoch=0, name='up')
    np.savez(str(tmp_path / 'sample.npz'), data=x)
    assert export_main(['--checkpoint', str(tmp_path / 'up'), '--out', str(tmp_path / 'out'),
                        '--sample', str(tmp_path / 'sample.npz'), '--verify-batches', '1,4']) == 0


def test_unallocated_weight_gradients_are_the_deconvolutions_whose_weight_other_ops_read():
    net = _upsampler()
    x, _ = _batch()
    one = Pipeline(net, TWO_DEVICES, sample=x).training_symbol('l2')
    two = Pipeline(net, TWO_DEVICES, sample=x, chunks=2).training_symbol('l2')
    assert compat.unallocated_weight_gradients(one) == []
    assert sorted(compat.unallocated_weight_gradients(two)) == [  # the graph runs chunk 1 first
        ('up_conv1_fwd', 'up_conv1_weight', 2), ('up_conv1_fwd_chunk1', 'up_conv1_weight', 2)]
    assert compat.unallocated_weight_gradients(two, fixed=('up_conv1_weight',)) == []
    # a weight read on another device, through the identity op in its own group
    data, weight = mx.sym.var('data'), mx.sym.var('w', attr={'__ctx_group__': 'stage0'})
    with mx.AttrScope(ctx_group='stage1'):
        up = mx.sym.Deconvolution(data, weight=weight, kernel=(2, 2), num_filter=4,
                                  no_bias=True, name='up')
    tied = passes.tie_parameters(PlacedGraph.from_symbol(up)).to_symbol()
    assert compat.unallocated_weight_gradients(up) == []
    assert compat.unallocated_weight_gradients(tied) == [('up', 'w_tied', 0)]


def test_centernet_splits_and_trains_one_step_as_one_device_and_its_micro_batches_are_refused():
    """GluonCV's CenterNet (ResNet-18, three transposed convolutions),
    random weights, traced as it predicts (boxes, scores, ids), the loss on
    its scores: split over two devices, one step equals one device's; the
    one graph of two micro-batches is refused at bind, where the first
    backward pass used to kill the process."""
    model_zoo = pytest.importorskip('gluoncv.model_zoo')
    mx.random.seed(0)
    net = model_zoo.get_model('center_net_resnet18_v1b_voc', pretrained=False,
                              pretrained_base=False)
    net.initialize(mx.init.Xavier(), force_reinit=True)
    x = np.random.default_rng(0).normal(size=(2, 3, 128, 128)).astype(np.float32)
    label = np.zeros([o.shape for o in net(mx.nd.array(x))][1], np.float32)
    values = _values(net)
    one_device = _one_step(net, values, 'cpu:0', x, label, output=1)
    # the box sizes' and offsets' heads (two convolutions each) do not reach the scores
    _assert_same_step(_one_step(net, values, TWO_DEVICES, x, label, output=1), one_device,
                      rtol=1e-4, atol=1e-5, still=8)
    if compat.onednn_active():
        with pytest.raises(ValueError, match=r'^deconvresnet\d+_conv1_fwd \(Deconvolution\): '
                                             r'.* read by 2 ops \(6 such ops in the graph\)'):
            _module(net, TWO_DEVICES, x, label.shape, chunks=2, output=1)
