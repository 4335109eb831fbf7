"""The imperative twin of a whole network runs every operator MXNet runs
imperatively: GluonCV's SE-ResNet and ResNeSt (``_contrib_AdaptiveAvgPooling2D``),
GluonNLP's TransformerEncoder (``_contrib_arange_like``) and StandardRNN (a
``begin_state`` ``_zeros`` whose batch is 0 until shape inference fills it),
split whole over several devices: ``pipe(x)`` and one SGD step with
``mp_symbolic.Trainer`` equal the network on one device with ``gluon.Trainer``,
within the equivalence tolerance (``AGREE_RTOL``, ``AGREE_ATOL``)."""
import json

import mxnet as mx
from mxnet import autograd, gluon
import numpy as np
import pytest

from mp_symbolic import Pipeline, Trainer
from mp_symbolic.core.graph.graphcut import CutError, run_graph
from mp_symbolic.training.metrics import AGREE_ATOL, AGREE_RTOL

LR = 0.1


class FirstOutput(gluon.HybridBlock):
    """A block's first output: GluonNLP's encoders and language models
    return ``(output, states...)``."""

    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.block = block

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.block(x)[0]


def se_resnet():
    import gluoncv  # pylint: disable=import-outside-toplevel
    return gluoncv.model_zoo.get_model('se_resnet18_v1', classes=10, pretrained=False), \
        np.random.default_rng(0).uniform(size=(2, 3, 32, 32))


def resnest():
    import gluoncv  # pylint: disable=import-outside-toplevel
    return gluoncv.model_zoo.get_model('resnest14', classes=10, pretrained=False), \
        np.random.default_rng(0).uniform(size=(2, 3, 32, 32))


def transformer():
    from gluonnlp.model.transformer import TransformerEncoder  # pylint: disable=import-outside-toplevel
    return FirstOutput(TransformerEncoder(num_layers=2, units=8, hidden_size=16, num_heads=2,
                                          max_length=8)), \
        np.random.default_rng(0).normal(size=(2, 5, 8))


def standard_rnn():
    import gluonnlp  # pylint: disable=import-outside-toplevel
    return FirstOutput(gluonnlp.model.StandardRNN('lstm', vocab_size=20, embed_size=8,
                                                  hidden_size=8, num_layers=2,
                                                  tie_weights=True, dropout=0)), \
        np.random.default_rng(0).integers(0, 20, size=(5, 2))  # (length, batch) tokens


NETWORKS = {
    'se_resnet18_v1': (se_resnet, 'cpu:0,cpu:1,cpu:2'),
    'resnest14': (resnest, 'cpu:0,cpu:1'),
    'transformer_encoder': (transformer, 'cpu:0,cpu:1,cpu:2,cpu:3'),
    'standard_rnn': (standard_rnn, 'cpu:0,cpu:1,cpu:2'),
}


def _values(net):
    return {n: p.data(p.list_ctx()[0]).asnumpy() for n, p in net.collect_params().items()}


def _step(net, x, target, trainer):
    with autograd.record():
        out = net(x)
        loss = gluon.loss.L2Loss()(out, target.as_in_context(out.context))
    loss.backward()
    value = out.asnumpy()  # read before the update, as the test below explains
    trainer.step(x.shape[0])
    return value


@pytest.mark.parametrize('name', sorted(NETWORKS))
def test_the_twin_of_a_whole_network_equals_one_device_in_prediction_and_one_sgd_step(name):
    make, devices = NETWORKS[name]
    mx.random.seed(0)
    net, X = make()
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    x = mx.nd.array(X, ctx=mx.cpu(0))
    # read at once: with oneDNN, an output left unread while the step below and
    # set_data run came out different in about one run of five (plain Gluon, one device)
    predicted = net(x).asnumpy()
    target = mx.nd.array(np.random.default_rng(1).normal(size=predicted.shape))
    initial = _values(net)
    out = _step(net, x, target, gluon.Trainer(net.collect_params(), 'sgd',
                                              {'learning_rate': LR}))
    stepped = _values(net)

    for n, p in net.collect_params().items():
        p.set_data(mx.nd.array(initial[n], dtype=p.dtype))
    pipe = Pipeline(net, devices, sample=X.shape)
    pipe.initialize()
    assert len({p.list_ctx()[0] for p in pipe.collect_params().values()}) > 1  # split
    np.testing.assert_allclose(pipe(x).asnumpy(), predicted, rtol=AGREE_RTOL, atol=AGREE_ATOL)
    np.testing.assert_allclose(
        _step(pipe, x, target, Trainer(pipe.collect_params(), 'sgd', {'learning_rate': LR})),
        out, rtol=AGREE_RTOL, atol=AGREE_ATOL)
    moved = _values(pipe)
    for n, value in stepped.items():  # weights and BatchNorm statistics
        np.testing.assert_allclose(moved[n], value, rtol=AGREE_RTOL, atol=AGREE_ATOL,
                                   err_msg=n)
    assert any(not np.array_equal(stepped[n], initial[n]) for n in stepped)


def _graph(op, attrs, inputs=()):
    nodes = [{'op': 'null', 'name': n, 'inputs': []} for n in inputs]
    nodes.append({'op': op, 'name': 'x0', 'attrs': dict(attrs, __ctx_group__='stage0'),
                  'inputs': [[i, 0, 0] for i in range(len(inputs))]})
    return {'nodes': nodes, 'heads': [[len(nodes) - 1, 0, 0]]}


def test_a_source_op_makes_its_array_on_its_stage_device():
    out = run_graph(_graph('_zeros', {'shape': '(2, 3)'}), {}, {'stage0': mx.cpu(2)})
    assert out.context == mx.cpu(2) and out.shape == (2, 3)


@pytest.mark.parametrize('graph, inputs, message', [
    (_graph('_no_such_op', {}), {}, r"^expected an operator MXNet runs imperatively, found "
                                     r"'_no_such_op'$"),
    (_graph('_contrib_BilinearResize2D', {'height': '-3', 'width': '2'}, ['data']),
     {'data': mx.nd.ones((1, 1, 2, 2))},
     r'^x0 \(_contrib_BilinearResize2D\): expected an operator MXNet runs imperatively on '
     r'these inputs, found: '),
])
def test_an_op_that_cannot_run_is_refused_in_one_line(graph, inputs, message):
    with pytest.raises(CutError, match=message) as err:
        run_graph(graph, inputs, {'stage0': mx.cpu(0)})
    assert '\n' not in str(err.value)


@pytest.mark.parametrize('op, attrs, shape', [
    ('_contrib_AdaptiveAvgPooling2D', {'output_size': '(2, 3)'}, (1, 2, 5, 7)),
    ('_contrib_BilinearResize2D', {'height': '6', 'width': '4'}, (1, 2, 3, 3)),
    ('_contrib_box_nms', {'overlap_thresh': '0.5', 'coord_start': '2', 'score_index': '1',
                          'id_index': '0'}, (1, 8, 6)),
    ('_contrib_arange_like', {'axis': '1'}, (2, 5, 3)),
])
def test_a_contrib_op_runs_as_the_symbol_runs_it(op, attrs, shape):
    graph = _graph(op, attrs, ['data'])
    data = mx.nd.array(np.random.default_rng(0).uniform(size=shape))
    expected = mx.sym.load_json(json.dumps(dict(graph, arg_nodes=[0]))).eval(
        ctx=mx.cpu(0), data=data)[0]
    out = run_graph(graph, {'data': data}, {'stage0': mx.cpu(1)})
    assert out.context == mx.cpu(1)
    np.testing.assert_array_equal(out.asnumpy(), expected.asnumpy())


def test_a_zeros_with_a_zero_batch_takes_its_shape_from_the_real_input():
    data = mx.sym.var('data')
    state = mx.sym.zeros(shape=(0, 3))  # as begin_state(batch_size=0) makes it
    graph = json.loads((mx.sym.elemwise_add(data, state) + 1).tojson())
    for node in graph['nodes']:
        if node['op'] != 'null':
            node.setdefault('attrs', {})['__ctx_group__'] = 'stage0'
    out = run_graph(graph, {'data': mx.nd.ones((5, 3))}, {'stage0': mx.cpu(1)})
    np.testing.assert_array_equal(out.asnumpy(), np.full((5, 3), 2.0))
