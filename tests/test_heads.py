"""Each loss head is one record (mp_symbolic/core/heads.py): the training
graph, the imperative twin, the task and the export all read it."""
import json

import mxnet as mx
import numpy as np
import pytest

from export.inference import LOSS_HEADS, inference_graph
from mp_symbolic import Pipeline, Task
from mp_symbolic.core.heads import HEADS, LOSSES, gluon_loss, make_head, predict_form


@pytest.mark.parametrize('loss', LOSSES)
def test_every_site_reads_the_loss_heads_one_record(loss):
    head = HEADS[loss]
    node = json.loads(make_head(loss, mx.sym.var('p'), mx.sym.var('y')).tojson())['nodes'][-1]
    assert (node['op'], node['name']) == (head.op, head.node)
    assert isinstance(gluon_loss(loss), type(head.gluon_loss()))
    assert head.op in LOSS_HEADS
    X = np.zeros((4, 3), np.float32)
    y = np.zeros((4,) if head.classes else (4, 3), np.float32)
    task = Task(name='t', blocks=[mx.gluon.nn.Dense(3)], loss=loss, train=(X, y), batch_size=2)
    assert task.loss_label == head.label
    raw = mx.nd.array([[0.5, -1.0, 2.0]])
    assert np.array_equal(predict_form(loss, raw).asnumpy(),
                          (head.predict or (lambda o: o))(raw).asnumpy())
    label = mx.nd.array([2] if head.classes else [[1, 0, 1]])
    assert task.batch_loss(predict_form(loss, raw), label).asscalar() == \
        head.batch_loss(predict_form(loss, raw), label).asscalar()


@pytest.mark.parametrize('loss', LOSSES)
def test_the_export_replaces_each_head_by_its_inference_form(loss):
    """The exported graph computes what the head's record says its forward
    pass computes: the prediction as it is, its softmax or its sigmoid."""
    pipe = Pipeline([mx.gluon.nn.Dense(3, in_units=2, prefix='d_')], 'cpu:0')
    pipe.initialize(mx.init.Uniform(1.0))
    X = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (4, 2)))
    raw = pipe(X)
    forms = {'identity': raw, 'softmax': mx.nd.softmax(raw, axis=-1), 'sigmoid': mx.nd.sigmoid(raw)}
    graph = inference_graph(pipe.training_symbol(loss))
    arg_params, aux_params = pipe.get_params()
    exe = graph.bind(mx.cpu(0), dict(arg_params, data=X), aux_states=aux_params)
    np.testing.assert_allclose(exe.forward()[0].asnumpy(), forms[HEADS[loss].inference].asnumpy(),
                               rtol=1e-6)
