"""Each loss head is one record (mp_symbolic/core/graph/heads.py): the training
graph, the imperative twin, the task and the export all read it; 'softmax'
takes its classes on the axis the labels leave (a per-pixel classifier's
axis 1), on every route and from the command line; a callable head's printed
loss is the loss itself."""
import json

import mxnet as mx
import numpy as np
import pytest

from conftest import cli_status
from export.inference import inference_graph
from mp_symbolic import Pipeline, Task
from mp_symbolic.core.graph.heads import (HEADS, LOSSES, class_axis, gluon_loss, head_at,
                                    labels_of, make_head, predict_form, with_head)
from mp_symbolic.core.graph.ir import PlacedGraph
from mp_symbolic.core.graph.names import other_output_name


def _own_loss(prediction, label):
    parts = prediction if isinstance(prediction, list) else [prediction]
    return mx.sym.MakeLoss(mx.sym.sum(mx.sym.square(mx.sym.elemwise_sub(
        parts[-1], label, name='own_diff'), name='own_square'), name='own_sum'), name='own_loss')


@pytest.mark.parametrize('loss', list(LOSSES) + [HEADS['softmax'].on_axis(1), _own_loss],
                         ids=lambda l: l if isinstance(l, str) else getattr(l, '__name__', 'axis1'))
@pytest.mark.parametrize('outputs', [1, 3])
def test_the_loss_head_pass_gives_the_graph_of_mxnets_composition_node_for_node(loss, outputs):
    """heads.with_head on the typed graph: the nodes, their order, names and
    attributes MXNet's composition of the head's Symbol onto the
    prediction's gives (as the training graph was built from Symbols)."""
    x = mx.sym.var('data')
    hidden = mx.sym.relu(mx.sym.FullyConnected(x, num_hidden=4, name='fc'), name='act')
    leaves = [mx.sym.FullyConnected(hidden, num_hidden=4, name='out%d' % k)
              for k in range(outputs)]
    prediction = leaves[0] if outputs == 1 else mx.sym.Group(leaves)
    named = not callable(loss)
    output = 1 if named and outputs > 1 else None
    got = with_head(PlacedGraph.from_symbol(prediction, ['data']), loss, 'softmax_label',
                    output, 'stage1')
    with mx.AttrScope(ctx_group='stage1'):
        label = mx.sym.var('softmax_label')
        if not named or outputs == 1:
            expected = make_head(loss, leaves if outputs > 1 else prediction, label)
        else:
            expected = mx.sym.Group([make_head(loss, leaves[1], label)] + [
                mx.sym.BlockGrad(o, name=other_output_name(k))
                for k, o in enumerate(leaves) if k != 1])
    assert got.to_json() == PlacedGraph.from_symbol(expected, ['data', 'softmax_label']).to_json()
    assert got == PlacedGraph.from_symbol(expected, ['data', 'softmax_label'])


@pytest.mark.parametrize('loss', LOSSES)
def test_every_site_reads_the_loss_heads_one_record(loss):
    head = HEADS[loss]
    symbol = make_head(loss, mx.sym.var('p'), mx.sym.var('y'))
    node = json.loads(symbol.tojson())['nodes'][-1]
    assert (node['op'], node['name']) == (head.op, head.node)
    assert isinstance(gluon_loss(loss), type(head.gluon_loss()))
    graph = PlacedGraph.from_symbol(symbol)
    assert head_at(graph, graph.output_node(0)) is head   # what read_head and the export find
    assert labels_of(symbol) == {'y'}
    X = np.zeros((4, 3), np.float32)
    y = np.zeros((4,) if head.classes else (4, 3), np.float32)
    task = Task(name='t', blocks=[mx.gluon.nn.Dense(3)], loss=loss, train=(X, y), batch_size=2)
    assert task.loss_label == head.label
    raw = mx.nd.array([[0.5, -1.0, 2.0]])
    assert np.array_equal(predict_form(loss, raw).asnumpy(),
                          head.predict_form(raw).asnumpy())
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


# -- 'softmax' on the class axis its labels leave ----------------------------------------------

@pytest.mark.parametrize('output, label, axis', [
    ((8, 10), (8,), -1),
    ((8, 12, 50), (8, 12), -1),          # a language model: (N, T, V) with (N, T)
    ((8, 3, 16, 16), (8, 16, 16), 1),    # a per-pixel classifier: (N, C, H, W) with (N, H, W)
    ((8, 3, 20), (8, 20), 1),            # per-position classes on axis 1
    ((8, 4, 4, 4), (8, 4, 4), 1),        # both fit: 4 axes are MXNet's NCHW
    ((8, 5, 5), (8, 5), -1),             # both fit: 3 axes are a sequence's
    ((8, 3, 16, 16), (8, 3, 16, 16), None),
    ((8, 3, 16, 16), None, 1),           # no labels (a prediction): by the outputs' axes
])
def test_softmax_takes_its_classes_on_the_axis_the_labels_leave(output, label, axis):
    assert class_axis(output, label) == axis


SEGMENT = dict(batch=4, classes=3, size=6)


def _segmenter(prefix):
    """A per-pixel classifier: (N, 2, H, W) -> (N, 3, H, W), in two blocks."""
    return [mx.gluon.nn.Conv2D(4, 3, padding=1, in_channels=2, activation='tanh',
                               prefix=prefix + 'c0_'),
            mx.gluon.nn.Conv2D(SEGMENT['classes'], 1, in_channels=4, prefix=prefix + 'c1_')]


def _pixels():
    rng = np.random.default_rng(0)
    n, size = SEGMENT['batch'], SEGMENT['size']
    X = rng.normal(size=(n, 2, size, size)).astype(np.float32)
    y = rng.integers(0, SEGMENT['classes'], (n, size, size)).astype(np.float32)
    return X, y


@pytest.mark.parametrize('loss', ['softmax', 'log_softmax'])
def test_the_label_takes_the_predictions_type_and_shape_from_the_data_alone(loss):
    """As SoftmaxOutput types its label, so the estimate and the command line,
    which infer types from the data alone, see every array's type."""
    symbol = make_head(loss, mx.sym.var('p'), mx.sym.var('y'))
    arg_types, _, _ = symbol.infer_type(p='float32')
    assert dict(zip(symbol.list_arguments(), arg_types)) == {'p': np.float32, 'y': np.float32}
    arg_shapes, _, _ = symbol.infer_shape(p=(2, 3, 5))
    assert dict(zip(symbol.list_arguments(), arg_shapes)) == {'p': (2, 3, 5), 'y': (2, 3)}


def test_the_log_softmax_head_refuses_classes_on_axis_1_in_one_line():
    """'log_softmax' takes its classes on the last axis only (its MakeLoss
    sums each pixel's loss, where SoftmaxOutput's multi_output averages)."""
    X, y = _pixels()
    pipe = Pipeline(_segmenter('ls_'), 'cpu:0', sample=X.shape)
    mod = pipe.module(loss='log_softmax')
    with pytest.raises(ValueError) as err:
        mod.bind([('data', X.shape)], [('softmax_label', y.shape)])
    assert str(err.value) == (
        "loss: expected classes on the last axis for 'log_softmax' (labels of the outputs' "
        "shape without it), found labels that leave axis 1: use loss='softmax'")


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_per_pixel_softmax_takes_the_same_step_on_the_module_the_twin_and_one_device(
        schedule):
    """(N, C, H, W) outputs with (N, H, W) labels: the Module's head is
    MXNet's multi_output softmax (its classes on axis 1), its step equals the
    imperative twin's and one device's, and the export's inference form is
    the softmax over axis 1 that the Module and the twin predict."""
    X, y = _pixels()
    one = _segmenter('one_')
    for block in one:
        block.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    values = {n: p.data().asnumpy() for b in one for n, p in b.collect_params().items()}
    net = mx.gluon.nn.HybridSequential()
    for block in one:
        net.add(block)
    with mx.autograd.record():  # one device: Gluon's own per-pixel cross-entropy
        loss = mx.gluon.loss.SoftmaxCrossEntropyLoss(axis=1)(net(mx.nd.array(X)),
                                                            mx.nd.array(y))
    loss.backward()
    expected = {n: p.grad().asnumpy() / len(X) for b in one for n, p in
                b.collect_params().items()}
    raw = net(mx.nd.array(X))

    def ours(name):
        return name.replace('one_', 'pp_')

    pipe = Pipeline(_segmenter('pp_'), 'cpu:0,cpu:1', chunks=2, schedule=schedule)
    mod = pipe.module('softmax')
    mod.bind(data_shapes=[('data', X.shape)], label_shapes=[('softmax_label', y.shape)])
    mod.init_params(arg_params={ours(n): mx.nd.array(v) for n, v in values.items()})
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 0.0})
    mod.forward_backward(mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)]))
    grads = dict(zip(mod._exec_group.param_names,  # pylint: disable=protected-access
                     mod._exec_group.grad_arrays))  # pylint: disable=protected-access
    for name, value in expected.items():  # rescale_grad 1/batch, as Module applies it
        np.testing.assert_allclose(grads[ours(name)][0].asnumpy() / len(X), value, rtol=1e-4,
                                   atol=1e-6, err_msg=name)
    probs = mx.nd.softmax(raw, axis=1).asnumpy()
    np.testing.assert_allclose(mod.get_outputs()[0].asnumpy(), probs, rtol=1e-5, atol=1e-6)

    twin = Pipeline(_segmenter('tw_'), 'cpu:0,cpu:1')
    twin.set_params({n.replace('one_', 'tw_'): v for n, v in values.items()})
    fitted = HEADS['softmax'].on_axis(1)
    with mx.autograd.record():
        out = twin(mx.nd.array(X, ctx=mx.cpu(0)))
        loss = gluon_loss(fitted)(out, mx.nd.array(y, ctx=out.context))
    loss.backward()
    for name, value in expected.items():
        param = twin.collect_params()[name.replace('one_', 'tw_')]
        np.testing.assert_allclose(param.grad(param.list_ctx()[0]).asnumpy() / len(X), value,
                                   rtol=1e-4, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(predict_form(fitted, out).asnumpy(), probs, rtol=1e-5, atol=1e-6)

    graph = inference_graph(mod.export_symbol)
    arg_params, aux_params = mod.get_params()
    exe = graph.bind(mx.cpu(0), dict(arg_params, data=mx.nd.array(X)), aux_states=aux_params)
    np.testing.assert_allclose(exe.forward()[0].asnumpy(), probs, rtol=1e-5, atol=1e-6)


def _tnc_blocks(prefix):
    """(T, N, 3) -> (T, N, 4), the batch on axis 1, in two blocks."""
    return [mx.gluon.nn.Dense(6, flatten=False, in_units=3, activation='tanh',
                              prefix=prefix + 'a_'),
            mx.gluon.nn.Dense(4, flatten=False, in_units=6, prefix=prefix + 'b_')]


def _mae(prediction, label):
    return mx.sym.MAERegressionOutput(prediction, label, name='mae')


def _tnc_step(loss, devices, chunks, replicas, schedule, values, X, Y):
    """Input gradients, parameter gradients (summed over replicas) and
    parameters after one SGD step of ``loss`` on ``(X, Y)``, batch axis 1."""
    pipe = Pipeline(_tnc_blocks('tnc_'), devices, chunks=chunks, replicas=replicas,
                    schedule=schedule, batch_axis=1)
    mod = pipe.module(loss, label_name='label')
    mod.bind([('data', X.shape)], [('label', Y.shape)], inputs_need_grad=True)
    mod.init_params(arg_params={n: mx.nd.array(v) for n, v in values.items()})
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 0.5})
    mod.forward_backward(mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(Y)]))
    grads = {n: sum(g.asnumpy() for g in parts) for n, parts in
             zip(mod._exec_group.param_names,  # pylint: disable=protected-access
                 mod._exec_group.grad_arrays)}  # pylint: disable=protected-access
    inputs = mod.get_input_grads()[0].asnumpy()
    mod.update()
    params = {n: v.asnumpy() for n, v in mod.get_params()[0].items()}
    return inputs, grads, params


@pytest.mark.parametrize('loss', ['l2', 'logistic', _mae])
@pytest.mark.parametrize('devices, chunks, replicas, schedule', [
    ('cpu:0,cpu:1', 2, 1, 'gpipe'), ('cpu:0,cpu:1', 2, 1, '1f1b'),
    ('cpu:0,cpu:1,cpu:2,cpu:3', 1, 2, 'gpipe'), ('cpu:0,cpu:1,cpu:2,cpu:3', 2, 2, '1f1b')])
def test_a_regression_head_on_batch_axis_1_takes_one_devices_step_on_every_route(
        loss, devices, chunks, replicas, schedule):
    """MXNet's regression heads divide their gradient by the label's size
    over axis 0, which with the batch on axis 1 counts the batch: split into
    micro-batches or replicas, the inputs' and parameters' gradients and the
    step still equal one device's on the unsplit batch."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(5, 8, 3)).astype(np.float32)
    Y = rng.normal(size=(5, 8, 4)) if loss == 'l2' else rng.integers(0, 2, (5, 8, 4))
    Y = Y.astype(np.float32)
    blocks = _tnc_blocks('tnc_')
    for block in blocks:
        block.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    values = {n: p.data().asnumpy() for b in blocks for n, p in b.collect_params().items()}
    one = _tnc_step(loss, 'cpu:0', 1, 1, 'gpipe', values, X, Y)
    found = _tnc_step(loss, devices, chunks, replicas, schedule, values, X, Y)
    assert np.abs(one[0]).max() > 0
    np.testing.assert_allclose(found[0], one[0], rtol=1e-4, atol=1e-7)
    for name in values:
        np.testing.assert_allclose(found[1][name], one[1][name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)
        assert not np.allclose(one[2][name], values[name])  # the step moved it
        np.testing.assert_allclose(found[2][name], one[2][name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def _grad_scales(symbol):
    return [node['attrs'].get('grad_scale') for node in json.loads(symbol.tojson())['nodes']
            if node['op'] == 'LinearRegressionOutput']


def test_only_a_replicas_bound_head_on_batch_axis_1_carries_its_share_and_the_checkpoint_none():
    """The graph a replica binds divides the head's gradient by the replicas
    (with the batch on axis 1); the checkpoint's graph keeps the head one
    device trains, and with the batch on axis 0 the bound head is MXNet's."""
    scales = {}
    for axis in (0, 1):
        pipe = Pipeline(_tnc_blocks('ck%d_' % axis), 'cpu:0,cpu:1,cpu:2,cpu:3', replicas=2,
                        batch_axis=axis)
        mod = pipe.module('l2')
        scales[axis] = _grad_scales(mod.symbol), _grad_scales(mod.export_symbol)
    assert scales[1] == (['0.5'], [None])
    assert scales[0] == ([None], [None])


SEGMENT_TASK = '''
import mxnet as mx
import numpy as np
from mxnet import gluon
import mp_symbolic


def task(loss='softmax', metric=None, num_epochs=4):
    """A per-pixel classifier of 8x8 two-channel maps into 3 classes."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 2, 8, 8)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.float32) + (X[:, 1] > 0.5)    # (N, H, W) classes 0..2
    if loss == 'callable':   # the same head, written by its user
        loss = lambda p, label: mx.sym.SoftmaxOutput(p, label, multi_output=True,
                                                     name='softmax')
    blocks = [gluon.nn.Conv2D(8, 3, padding=1, activation='relu', prefix='seg_c0_'),
              gluon.nn.Conv2D(8, 3, padding=1, activation='relu', prefix='seg_c1_'),
              gluon.nn.Conv2D(3, 1, prefix='seg_c2_')]      # (N, 3, 8, 8)
    return mp_symbolic.Task(name='seg', blocks=blocks, loss=loss, train=(X, y), metric=metric,
                            batch_size=16, num_epochs=num_epochs, optimizer='adam', lr=0.05)
'''


@pytest.fixture(name='segment_task')
def _segment_task(tmp_path):
    path = tmp_path / 'seg_task.py'
    path.write_text(SEGMENT_TASK)
    return str(path)


def _train_cli(argv, capsys):
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    capsys.readouterr()
    status = cli_status(cli.main, argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_a_segmentation_task_trains_from_the_command_line_on_two_devices_and_exports(
        segment_task, tmp_path, capsys):
    out = str(tmp_path / 'out')
    status, printed, err = _train_cli(['train', '--task', segment_task, '--devices',
                                       'cpu:0,cpu:1', '--out', out, '--no-progress',
                                       '--no-memory'], capsys)
    assert status == 0, err
    summary = json.loads((tmp_path / 'out' / 'current' / 'summary.json').read_text())
    losses = summary['epoch_losses']
    assert losses[-1] < 0.8 * losses[0], losses
    assert summary['complete'] is True and summary['improved'] is True
    assert 'mean cross-entropy' in printed and 'training accuracy' in printed, printed
    checkpoint = json.loads(next((tmp_path / 'out' / 'current').glob('*-symbol.json'))
                            .read_text())
    head = [n for n in checkpoint['nodes'] if n['op'] == 'SoftmaxOutput']
    assert head and head[0]['attrs'].get('multi_output') == 'True', head
    from export.__main__ import main as export_main  # pylint: disable=import-outside-toplevel
    assert export_main(['--checkpoint', out, '--out', str(tmp_path / 'export'),
                        '--verify-batches', '1,3']) == 0
    folder = tmp_path / 'export' / 'current'
    symbol = mx.sym.load(str(folder / 'seg-symbol.json'))
    params = mx.nd.load(str(folder / 'seg-0000.params'))
    X = np.random.default_rng(1).normal(size=(2, 2, 8, 8)).astype(np.float32)
    exe = symbol.bind(mx.cpu(0), dict({k.split(':', 1)[1]: v for k, v in params.items()
                                       if k.startswith('arg:')}, data=mx.nd.array(X)))
    probs = exe.forward()[0].asnumpy()
    assert probs.shape == (2, 3, 8, 8)
    np.testing.assert_allclose(probs.sum(axis=1), 1, rtol=1e-5)  # the classes on axis 1


def test_the_twin_trains_the_segmentation_task_as_the_module_does(segment_task, tmp_path,
                                                                   capsys):
    status, printed, err = _train_cli(['compare', '--task', segment_task, '--task-arg',
                                       'num_epochs=2', '--devices', 'cpu:0,cpu:1', '--out',
                                       str(tmp_path / 'compare'), '--no-progress'], capsys)
    assert status == 0, err + printed
    assert 'agree: yes' in printed, printed


def test_a_callable_head_prints_its_loss_and_a_run_that_does_not_improve_keeps_its_last_epoch(
        segment_task, tmp_path, capsys):
    """A per-pixel SoftmaxOutput written as a callable prints its
    cross-entropy (it printed the mean probability, 1/3), its default metric
    reads the class axis, and at --lr 1e-30 the "did not improve" check reads
    that loss: exit 1, the last epoch kept, marked."""
    out = tmp_path / 'out'
    status, printed, err = _train_cli(
        ['train', '--task', segment_task, '--task-arg', 'loss=callable', '--task-arg',
         'num_epochs=2', '--lr', '1e-30', '--checkpoint-every', '5', '--devices',
         'cpu:0,cpu:1', '--out', str(out), '--no-progress', '--no-memory'], capsys)
    assert status == 1, err
    lines = [l for l in printed.splitlines() if l.startswith('epoch ')]
    assert len(lines) == 2 and all('mean cross-entropy' in l for l in lines), printed
    value = float(lines[-1].split()[-1])
    assert 0.9 < value < 2.0, lines  # about log(3), not 1/3
    assert 'training accuracy' in printed, printed
    assert err.count('\n') == 1 and err.startswith(
        'error: training did not improve the model (training loss: '), err
    assert 'its last epoch is kept in %s, marked incomplete' % (out / 'current') in err, err
    summary = json.loads((out / 'current' / 'summary.json').read_text())
    assert (summary['epoch'], summary['complete'], summary['improved']) == (2, False, False)
    assert summary['score_after'] >= summary['score_before'] > 0.9


SEQUENCE_TASK = '''
import numpy as np
from mxnet import gluon
import mp_symbolic


def task():
    """Each token of a sequence classified: (N, T) tokens -> (N, T, V) outputs."""
    X = np.random.default_rng(0).integers(0, 10, size=(64, 6)).astype(np.float32)
    blocks = [gluon.nn.Embedding(10, 8, prefix='seq_e_'),
              gluon.nn.Dense(10, flatten=False, prefix='seq_d_')]
    return mp_symbolic.Task(name='seq', blocks=blocks, loss='softmax', train=(X, X.copy()),
                            batch_size=16, num_epochs=3, lr=0.5)
'''


def test_the_default_metric_of_per_position_classes_reads_the_last_axis(tmp_path, capsys):
    path = tmp_path / 'seq_task.py'
    path.write_text(SEQUENCE_TASK)
    status, printed, err = _train_cli(['train', '--task', str(path), '--devices', 'cpu:0,cpu:1',
                                       '--out', str(tmp_path / 'out'), '--no-progress',
                                       '--no-memory'], capsys)
    assert status == 0, err
    summary = json.loads((tmp_path / 'out' / 'current' / 'summary.json').read_text())
    assert summary['training_accuracy'] > 0.5, printed


def _normalized_heads():
    """Callable heads whose gradient MXNet normalises: by the batch, or by
    the valid entries of the batch their op sees."""
    def counted(p, label):
        return mx.sym.sum(mx.sym.square(p), axis=1) * (label >= 0)
    return {
        'softmax batch': lambda p, label: mx.sym.SoftmaxOutput(
            p, label, normalization='batch', name='softmax'),
        'softmax valid': lambda p, label: mx.sym.SoftmaxOutput(
            p, label, normalization='valid', use_ignore=True, ignore_label=-1, name='softmax'),
        'makeloss batch': lambda p, label: mx.sym.MakeLoss(counted(p, label),
                                                           normalization='batch', name='mk'),
        'makeloss valid': lambda p, label: mx.sym.MakeLoss(counted(p, label),
                                                           normalization='valid', name='mk')}


def _normalized_step(head, devices, chunks, replicas, schedule, values, X, Y):
    """Parameters after one SGD step (``rescale_grad`` 1) of ``head``."""
    blocks = [mx.gluon.nn.Dense(6, in_units=3, activation='tanh', prefix='norm_a_'),
              mx.gluon.nn.Dense(4, in_units=6, prefix='norm_b_')]
    pipe = Pipeline(blocks, devices, chunks=chunks, replicas=replicas, schedule=schedule)
    mod = pipe.module(_normalized_heads()[head], label_name='label')
    mod.bind([('data', X.shape)], [('label', Y.shape)])
    mod.init_params(arg_params={n: mx.nd.array(v) for n, v in values.items()})
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 0.5,
                                                          'rescale_grad': 1.0})
    mod.forward_backward(mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(Y)]))
    mod.update()
    return {n: v.asnumpy() for n, v in mod.get_params()[0].items()}


@pytest.mark.parametrize('head', ['softmax batch', 'softmax valid', 'makeloss batch',
                                  'makeloss valid'])
def test_a_normalised_head_takes_one_devices_step_or_is_refused_where_it_cannot(head):
    """A head normalised by the batch it sees takes one device's step split
    into micro-batches or replicas (its gradient scaled by the parts); one
    normalised by the valid entries of its part takes it where it sees the
    whole batch (GPipe's one graph) and is refused in one line where no
    constant can (1F1B's micro-batches, replicas)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(8, 3)).astype(np.float32)
    Y = rng.integers(0, 4, 8).astype(np.float32)
    Y[:3] = -1  # ignored by the softmax, zero in MakeLoss: three of the first part's four
    values = {'norm_a_weight': rng.normal(size=(6, 3)), 'norm_a_bias': np.zeros(6),
              'norm_b_weight': rng.normal(size=(4, 6)), 'norm_b_bias': np.zeros(4)}
    values = {n: v.astype(np.float32) for n, v in values.items()}
    one = _normalized_step(head, 'cpu:0', 1, 1, 'gpipe', values, X, Y)
    assert max(np.abs(one[n] - values[n]).max() for n in values) > 1e-3  # the step moved
    for devices, chunks, replicas, schedule in [('cpu:0,cpu:1', 2, 1, 'gpipe'),
                                                ('cpu:0,cpu:1', 2, 1, '1f1b'),
                                                ('cpu:0,cpu:1,cpu:2,cpu:3', 1, 2, 'gpipe')]:
        split = chunks * replicas if schedule == '1f1b' or replicas > 1 else 1
        if head.endswith('valid') and split > 1:
            with pytest.raises(ValueError, match=r"^loss: .* has normalization='valid', which "
                                                 r"divides each part's gradient .* split into "
                                                 r"2 parts"):
                _normalized_step(head, devices, chunks, replicas, schedule, values, X, Y)
            continue
        found = _normalized_step(head, devices, chunks, replicas, schedule, values, X, Y)
        for name in values:
            np.testing.assert_allclose(found[name], one[name], rtol=1e-5, atol=1e-6,
                                       err_msg='%s %s' % (name, (schedule, chunks, replicas)))


def test_the_labels_of_a_graph_are_what_its_loss_heads_read_second_and_nothing_else():
    data = mx.sym.var('data')
    out = mx.sym.FullyConnected(data, num_hidden=3, name='fc')
    heads = mx.sym.Group([mx.sym.SoftmaxOutput(out, name='softmax'),
                          mx.sym.MAERegressionOutput(out, mx.sym.var('y'), name='mae'),
                          mx.sym.SVMOutput(out, mx.sym.var('z'), name='svm'),
                          mx.sym.MakeLoss(mx.sym.sum(out * mx.sym.var('w')), name='made')])
    assert labels_of(heads) == {'softmax_label', 'y', 'z'}
    assert labels_of(out) == set()
