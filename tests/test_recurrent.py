"""A recurrent network with its states, given whole: GluonNLP's
``standard_lstm_lm_200`` (random weights, a vocabulary of 50) takes
``(inputs, begin_state)`` and returns ``(out, [h, c])``, laid out ``TNC``
(tokens ``(T, N)``, states ``(L, N, C)``: the batch on axis 1).

Split over ``cpu(0)``, ``cpu(1)`` with ``sample=(x, [h, c])`` and
``batch_axis=1``: the twin returns ``(out, [h, c])`` and the Module the
flattened leaves (``data0``, ``data1``, ``data2`` in, the head and both
states out), each equal to one device, and one SGD step equal to one
device's, with micro-batches and replicas split on the batch axis; the
layout may come from ``mx.io.DataDesc`` instead. A block list hands the
states on; ``AWDRNN``'s ``[[h, c], ...]`` per layer nests two deep. Inputs
nested otherwise, and layouts that cannot hold, are refused in one line
that echoes no value.

On the stage runtime (1F1B, interleaved, a schedule function; over two
node processes too) each input, label and output is split and joined on
its own batch axis: three SGD steps give GPipe's one graph.
"""
import mxnet as mx
from mxnet import autograd, gluon
import numpy as np
import pytest

from mp_symbolic import Pipeline, Trainer
from mp_symbolic.training.metrics import AGREE_ATOL, AGREE_RTOL

TWO = 'cpu:0,cpu:1'
VOCAB, T, N, LAYERS, HIDDEN = 50, 5, 4, 2, 200
LR = 0.1
EXACT = 1e-6  # split against one device: the same ops on the same values


def language_model(dropout=0):
    """GluonNLP's ``standard_lstm_lm_200`` (two LSTM layers of 200, tied
    embedding and output weights) over a vocabulary of 50, not pretrained."""
    import gluonnlp  # pylint: disable=import-outside-toplevel
    vocab = gluonnlp.Vocab(gluonnlp.data.count_tokens([str(i) for i in range(VOCAB - 4)]))
    assert len(vocab) == VOCAB  # with <unk>, <pad>, <bos>, <eos>
    net, _ = gluonnlp.model.get_model('standard_lstm_lm_200', dataset_name=None, vocab=vocab,
                                      pretrained=False, dropout=dropout, prefix='lm_')
    return net


def batch(seed=0):
    """Tokens and next tokens ``(T, N)``, begin states ``[h, c]`` of ``(L, N, C)``."""
    rng = np.random.default_rng(seed)
    x, y = (mx.nd.array(rng.integers(0, VOCAB, size=(T, N))) for _ in range(2))
    states = [mx.nd.array(0.1 * rng.normal(size=(LAYERS, N, HIDDEN))) for _ in range(2)]
    return x, y, states


def summed_cross_entropy(out, y):
    """What ``SoftmaxOutput`` back-propagates, summed over every position."""
    return -mx.nd.pick(mx.nd.log_softmax(out), y.as_in_context(out.context), axis=-1).sum()


@pytest.fixture(scope='module')
def one_device():
    """The network on cpu(0) by Gluon: its initial values, outputs, states,
    gradients and parameters after one SGD step of ``gluon.Trainer``."""
    mx.random.seed(0)
    net = language_model()
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    x, y, states = batch()
    initial = {n: p.data().copy() for n, p in net.collect_params().items()}
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': LR})
    with autograd.record():
        out, (h, c) = net(x, states)
        loss = summed_cross_entropy(out, y)
    loss.backward()
    result = {'out': out.asnumpy(), 'h': h.asnumpy(), 'c': c.asnumpy(),
              'grads': {n: p.grad().asnumpy() for n, p in net.collect_params().items()}}
    trainer.step(N)
    result['stepped'] = {n: p.data().asnumpy() for n, p in net.collect_params().items()}
    result['initial'] = initial
    return result


def fresh_model(values):
    """The network again (its parameter names the same), holding ``values``."""
    net = language_model()
    net.initialize(ctx=mx.cpu(0))
    for name, param in net.collect_params().items():
        param.set_data(values[name])
    return net


def assert_exact(ours, theirs):
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=EXACT)


def test_the_states_go_in_nested_and_the_graph_takes_their_leaves_in_order():
    net = language_model()
    x, _, states = batch()
    pipe = Pipeline(net, TWO, sample=(x, states), batch_axis=1)
    assert pipe.inputs == ('data0', ['data1', 'data2'])
    assert pipe.input_names == ('data0', 'data1', 'data2') and pipe.batch_axis == 1
    assert pipe.symbol().list_arguments()[:1] == ['data0']
    assert {'data1', 'data2'} <= set(pipe.symbol().list_arguments())
    assert pipe.module(loss=None).data_names == ['data0', 'data1', 'data2']
    assert len(pipe.symbol().list_outputs()) == 3  # out, h, c


@pytest.mark.parametrize('chunks, replicas', [(1, 1), (2, 2)])
def test_twin_returns_out_and_states_nested_and_steps_as_one_device(one_device, chunks, replicas):
    net = fresh_model(one_device['initial'])
    x, y, states = batch()
    devices = ','.join('cpu:%d' % i for i in range(2 * replicas))
    pipe = Pipeline(net, devices, sample=(x, states), batch_axis=1, chunks=chunks,
                    replicas=replicas)
    pipe.initialize()
    trainer = Trainer(pipe.collect_params(), 'sgd', {'learning_rate': LR})
    with autograd.record():
        result = pipe(x, states)
        out, (h, c) = result
        loss = summed_cross_entropy(out, y)
    loss.backward()
    assert isinstance(result, tuple) and isinstance(result[1], list) and len(result[1]) == 2
    assert out.context == mx.cpu(1) and out.shape == (T, N, VOCAB)
    for ours, name in ((out, 'out'), (h, 'h'), (c, 'c')):
        assert_exact(ours.asnumpy(), one_device[name])
    if replicas == 1:
        for name, param in pipe.collect_params().items():
            assert_exact(param.grad(param.list_ctx()[0]).asnumpy(), one_device['grads'][name])
    trainer.step(N)
    for name, param in pipe.collect_params().items():
        for ctx in param.list_ctx():
            assert_exact(param.data(ctx).asnumpy(), one_device['stepped'][name])


def test_twin_of_one_chunk_and_one_replica_takes_tnc_inputs_without_batch_axis(one_device):
    """At one chunk and one replica nothing is split, so the sizes on axis 0
    (tokens 5, layers 2) need not agree: every input goes whole, and the
    outputs are one device's."""
    net = fresh_model(one_device['initial'])
    x, _, states = batch()
    pipe = Pipeline(net, TWO, sample=(x, states))
    pipe.initialize()
    out, (h, c) = pipe(x, states)
    for ours, name in ((out, 'out'), (h, 'h'), (c, 'c')):
        assert_exact(ours.asnumpy(), one_device[name])


@pytest.mark.parametrize('chunks, replicas', [(2, 1), (1, 2)])
def test_tnc_inputs_split_on_axis_0_are_refused_naming_each_size_and_batch_axis(chunks,
                                                                                 replicas):
    x, _, states = batch()
    devices = ','.join('cpu:%d' % i for i in range(2 * replicas))
    pipe = Pipeline(language_model(), devices, sample=(x, states), chunks=chunks,
                    replicas=replicas)
    pipe.initialize()
    with pytest.raises(ValueError) as err:
        pipe(x, states)
    assert _one_line(err) == (
        'batch size: expected a multiple of chunks x replicas (%d x %d = 2), the same for '
        'every input along axis 0 (batch_axis), found data0 5, data1 2, data2 2 (give '
        "Pipeline(..., batch_axis=) the axis of the batch where it is not axis 0: 1 for "
        "GluonNLP's TNC inputs)" % (chunks, replicas))


def _bound(pipe, values, descs, label):
    mod = pipe.module(loss='softmax', output=0)
    mod.bind(descs, [label])
    mod.init_params(arg_params=values, aux_params={})
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': LR})
    return mod


def _step(mod, x, y, states):
    mod.forward_backward(mx.io.DataBatch([x] + states, [y]))
    outputs = [o.asnumpy() for o in mod.get_outputs()]  # read before the update
    group = mod._exec_group  # pylint: disable=protected-access
    grads = {n: sum(g.asnumpy() for g in arrays)  # summed over the replicas
             for n, arrays in zip(group.param_names, group.grad_arrays)}
    mod.update()
    return outputs, grads, mod.get_params()[0]


PAIRS = [('data0', (T, N)), ('data1', (LAYERS, N, HIDDEN)), ('data2', (LAYERS, N, HIDDEN))]


@pytest.mark.parametrize('chunks, replicas', [(1, 1), (2, 2)])
def test_module_outputs_states_and_sgd_step_equal_one_device(one_device, chunks, replicas):
    values = one_device['initial']
    x, y, states = batch()
    devices = ','.join('cpu:%d' % i for i in range(2 * replicas))
    split = Pipeline(fresh_model(values), devices, sample=(x, states), batch_axis=1,
                     chunks=chunks, replicas=replicas)
    alone = Pipeline(fresh_model(values), 'cpu:0', sample=(x, states), batch_axis=1)
    label = ('softmax_label', (T, N))
    ours = _step(_bound(split, values, PAIRS, label), x, y, states)
    theirs = _step(_bound(alone, values, PAIRS, label), x, y, states)
    assert [o.shape for o in ours[0]] == [(T, N, VOCAB), (LAYERS, N, HIDDEN), (LAYERS, N, HIDDEN)]
    for a, b in zip(ours[0], theirs[0]):  # the head's softmax, h, c
        assert_exact(a, b)
    assert sorted(ours[1]) == sorted(theirs[1]) == sorted(one_device['grads'])
    for name, grad in ours[1].items():
        assert_exact(grad, theirs[1][name])
        assert_exact(ours[2][name].asnumpy(), theirs[2][name].asnumpy())  # after the update
    # and the one device's Module is Gluon's: softmax of the output, the states, each gradient
    reference = [mx.nd.softmax(mx.nd.array(one_device['out'])).asnumpy(), one_device['h'],
                 one_device['c']]
    for a, b in zip(ours[0], reference):
        np.testing.assert_allclose(a, b, rtol=AGREE_RTOL, atol=AGREE_ATOL)
    for name, grad in ours[1].items():
        np.testing.assert_allclose(grad, one_device['grads'][name], rtol=AGREE_RTOL,
                                   atol=AGREE_ATOL)


def test_module_takes_the_layout_from_data_descs(one_device):
    """No ``batch_axis``: ``DataDesc(layout='TN')`` and ``'TNC'`` say where
    the batch is; two replicas split on it and the outputs join on it."""
    values = one_device['initial']
    x, y, states = batch()
    pipe = Pipeline(fresh_model(values), 'cpu:0,cpu:1,cpu:2,cpu:3', sample=(x, states),
                    replicas=2)
    descs = [mx.io.DataDesc(n, s, layout='TN' if len(s) == 2 else 'TNC') for n, s in PAIRS]
    mod = _bound(pipe, values, descs, mx.io.DataDesc('softmax_label', (T, N), layout='TN'))
    outputs, grads, _ = _step(mod, x, y, states)
    assert mod.output_shapes[1] == ('output1_output', (LAYERS, N, HIDDEN))
    np.testing.assert_allclose(outputs[1], one_device['h'], rtol=AGREE_RTOL, atol=AGREE_ATOL)
    np.testing.assert_allclose(outputs[2], one_device['c'], rtol=AGREE_RTOL, atol=AGREE_ATOL)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, one_device['grads'][name], rtol=AGREE_RTOL,
                                   atol=AGREE_ATOL)


def _one_line(err):
    message = str(err.value)
    assert '\n' not in message and '[[' not in message and '0.0' not in message, message
    return message


def test_inputs_nested_otherwise_are_refused_in_one_line_without_their_values():
    net = language_model()
    x, _, states = batch()
    pipe = Pipeline(net, TWO, sample=(x, states), batch_axis=1)
    pipe.initialize()
    with pytest.raises(TypeError) as err:
        pipe(x, states[:1])
    assert _one_line(err) == ('inputs: expected (data0, [data1, data2]), nested as sample= has '
                              'them, found (NDArray(5, 4), [NDArray(2, 4, 200)])')
    assert pipe(x, tuple(states))[0].shape == (T, N, VOCAB)  # a tuple of states is one too
    with pytest.raises(TypeError, match=r'found \(NDArray\(5, 4\), NDArray\(2, 4, 200\), '):
        pipe(x, *states)
    with pytest.raises(ValueError) as err:
        Pipeline(language_model(), TWO, sample=(x, [states[0], 'c']))
    assert _one_line(err).endswith('found (NDArray(5, 4), [NDArray(2, 4, 200), str])')
    with pytest.raises(ValueError) as err:  # the LSTM reads a cell state nothing gives
        Pipeline(language_model(), TWO, sample=(x, states[:1]), batch_axis=1)
    assert _one_line(err).startswith('sample: expected every input the network reads in it '
                                     '(data0, data1), found lm_lstm0_rnn0_state_cell read but '
                                     'not given')


@pytest.mark.parametrize('shapes, where', [
    (((T, 0), [(LAYERS, 0, HIDDEN), (LAYERS, 0, HIDDEN)]), '(5, 0) for data0'),
    (((T, N), [(LAYERS, 0, HIDDEN), (LAYERS, N, HIDDEN)]), '(2, 0, 200) for data1'),
])
def test_a_recurrent_sample_of_batch_zero_is_refused_in_one_line(shapes, where):
    with pytest.raises(ValueError) as err:
        Pipeline(language_model(), TWO, sample=shapes, batch_axis=1)
    assert _one_line(err) == ('sample: expected sizes of at least 1 in every axis (a batch of '
                              'at least one row), found shape ' + where)


def test_a_batch_axis_or_layout_that_cannot_hold_is_refused_in_one_line():
    x, _, states = batch()
    with pytest.raises(ValueError, match=r'^batch_axis: expected a non-negative integer .*'
                                         r'found -1$'):
        Pipeline(language_model(), TWO, sample=(x, states), batch_axis=-1)
    pipe = Pipeline(language_model(), TWO, sample=(x, states), batch_axis=1)
    pipe.initialize()
    with pytest.raises(ValueError) as err:
        pipe(x.reshape((-1,)), states)
    assert _one_line(err) == 'data0: expected an array with the batch on axis 1 (batch_axis), ' \
                             'found shape (20,)'
    mod = pipe.module(loss='softmax', output=0)
    with pytest.raises(ValueError) as err:
        mod.bind([mx.io.DataDesc(n, s, layout='NT' if len(s) == 2 else 'TNC')
                  for n, s in PAIRS], [('softmax_label', (T, N))])
    assert _one_line(err) == "data0: expected a layout with N at axis 1 (the Pipeline's " \
                             "batch_axis), found 'NT' (N at axis 0)"
    chunked = Pipeline(language_model(), TWO, sample=(x, states), chunks=2)
    with pytest.raises(ValueError) as err:
        chunked.module(loss='softmax', output=0).bind(
            [mx.io.DataDesc(n, s, layout='TN' if len(s) == 2 else 'TNC') for n, s in PAIRS],
            [('softmax_label', (T, N))])
    assert _one_line(err).startswith("data0: expected the batch on axis 0 with chunks=2 (the "
                                     "micro-batches split there; Pipeline(..., batch_axis=1)")
    staged = Pipeline(language_model(), TWO, sample=(x, states), batch_axis=1, chunks=2,
                      schedule='1f1b')
    with pytest.raises(ValueError) as err:  # the stage runtime takes layouts as the graph does
        staged.module(loss='softmax', output=0).bind(
            [mx.io.DataDesc(n, s, layout='NT' if len(s) == 2 else 'TNC') for n, s in PAIRS],
            [('softmax_label', (T, N))])
    assert _one_line(err) == "data0: expected a layout with N at axis 1 (the Pipeline's " \
                             "batch_axis), found 'NT' (N at axis 0)"


class Decoder(gluon.HybridBlock):
    """A dense layer on a language model's output, its states passed on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(8, flatten=False, in_units=VOCAB)

    def hybrid_forward(self, F, out, states):  # pylint: disable=arguments-differ
        return self.dense(out), states


def test_a_block_list_passes_the_states_on_nested_in_the_twin_and_the_module(one_device):
    """The first block takes ``(tokens, [h, c])`` and hands ``(out, [h, c])``
    to the next; the twin returns what the last returns, nested so, and the
    inference Module its leaves."""
    x, _, states = batch()
    lm, decoder = fresh_model(one_device['initial']), Decoder(prefix='decoder_')
    decoder.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    out, (h, c) = decoder(*lm(x, states))
    expected = [out.asnumpy(), h.asnumpy(), c.asnumpy()]
    values = {n: p.data().copy() for b in (lm, decoder) for n, p in b.collect_params().items()}
    pipe = Pipeline([lm, decoder], TWO, sample=(x, states), batch_axis=1, chunks=2)
    pipe.initialize()
    out, (h, c) = pipe(x, states)
    for ours, theirs in zip((out, h, c), expected):
        assert_exact(ours.asnumpy(), theirs)
    mod = pipe.module(loss=None)
    mod.bind(PAIRS, for_training=False)
    mod.init_params(arg_params=values, aux_params={})
    mod.forward(mx.io.DataBatch([x] + states), is_train=False)
    for ours, theirs in zip(mod.get_outputs(), expected):
        assert_exact(ours.asnumpy(), theirs)


def test_awd_lstm_states_nested_two_deep_split_over_three_devices():
    """GluonNLP's ``AWDRNN`` (tiny, no dropout) keeps ``[h, c]`` per layer:
    ``[[h0, c0], [h1, c1], [h2, c2]]`` in and out, seven leaves in order."""
    import gluonnlp  # pylint: disable=import-outside-toplevel
    net = gluonnlp.model.AWDRNN('lstm', vocab_size=VOCAB, embed_size=16, hidden_size=24,
                                num_layers=3, tie_weights=True, dropout=0, weight_drop=0,
                                drop_h=0, drop_i=0, drop_e=0, prefix='awd_')
    mx.random.seed(0)
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    x = batch()[0]
    states = [[s + 0.1 for s in layer] for layer in net.begin_state(batch_size=N,
                                                                    func=mx.nd.zeros)]
    out, ends = net(x, states)
    expected = [out.asnumpy()] + [s.asnumpy() for layer in ends for s in layer]
    values = {n: p.data().copy() for n, p in net.collect_params().items()}
    pipe = Pipeline(net, 'cpu:0,cpu:1,cpu:2', sample=(x, states), batch_axis=1, chunks=2)
    assert pipe.inputs == ('data0', [['data1', 'data2'], ['data3', 'data4'],
                                     ['data5', 'data6']])
    pipe.initialize()
    out, ends = pipe(x, states)
    assert [len(layer) for layer in ends] == [2, 2, 2]
    for ours, theirs in zip([out] + [s for layer in ends for s in layer], expected):
        assert_exact(ours.asnumpy(), theirs)
    leaves = [x] + [s for layer in states for s in layer]
    mod = pipe.module(loss=None)
    mod.bind(list(zip(pipe.input_names, [a.shape for a in leaves])), for_training=False)
    mod.init_params(arg_params=values, aux_params={})
    mod.forward(mx.io.DataBatch(leaves), is_train=False)
    for ours, theirs in zip(mod.get_outputs(), expected):
        assert_exact(ours.asnumpy(), theirs)


def _flat(nested):
    """The arrays of ``nested`` lists and tuples, in order (the graph's inputs)."""
    if isinstance(nested, (list, tuple)):
        return [a for part in nested for a in _flat(part)]
    return [nested]


def _schedule_steps(make, leaves, schedule, chunks=2, replicas=1, virtual=None, steps=3):
    """The outputs of the last step and the parameters after ``steps`` SGD
    steps of the softmax loss on ``make()``'s output 0, its states out too,
    under ``schedule`` (a new batch each step): GPipe's one graph, or the
    stage runtime."""
    net, values = make()
    devices = ','.join('cpu:%d' % i for i in range(2 * replicas))
    pipe = Pipeline(net, devices, sample=leaves(0)[0], batch_axis=1, chunks=chunks,
                    replicas=replicas, schedule=schedule, virtual=virtual)
    mod = pipe.module(loss='softmax', output=0)
    sample, label = leaves(0)
    mod.bind(list(zip(pipe.input_names, [a.shape for a in _flat(sample)])),
             [('softmax_label', label.shape)])
    mod.init_params(arg_params=values, aux_params={})
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': LR})
    for step in range(steps):
        sample, label = leaves(step)
        mod.forward_backward(mx.io.DataBatch(_flat(sample), [label]))
        mod.update()
    outputs = [o.asnumpy() for o in mod.get_outputs()]
    return mod, outputs, {n: v.asnumpy() for n, v in mod.get_params()[0].items()}


def _lm_values():
    mx.random.seed(0)
    net = language_model()
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    return net, {n: p.data().copy() for n, p in net.collect_params().items()}


def _lm_batch(step):
    x, y, states = batch(step)
    return (x, states), y


def _awd_values():
    import gluonnlp  # pylint: disable=import-outside-toplevel
    net = gluonnlp.model.AWDRNN('lstm', vocab_size=VOCAB, embed_size=16, hidden_size=24,
                                num_layers=3, tie_weights=True, dropout=0, weight_drop=0,
                                drop_h=0, drop_i=0, drop_e=0, prefix='awd_')
    mx.random.seed(0)
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    return net, {n: p.data().copy() for n, p in net.collect_params().items()}


def _awd_batch(step):
    x, y, _ = batch(step)
    rng = np.random.default_rng(100 + step)
    states = [[mx.nd.array(0.1 * rng.normal(size=(1, N, size))) for _ in range(2)]
              for size in (24, 24, 16)]
    return (x, states), y


def _user_gpipe(num_stages, microbatches):
    from mp_symbolic.core import schedule  # pylint: disable=import-outside-toplevel
    return schedule.gpipe(num_stages, microbatches)


@pytest.mark.parametrize('make, leaves, schedule, replicas, virtual', [
    (_lm_values, _lm_batch, '1f1b', 1, None),
    (_lm_values, _lm_batch, '1f1b', 2, None),
    (_lm_values, _lm_batch, 'interleaved', 1, 2),
    (_lm_values, _lm_batch, _user_gpipe, 1, None),
    (_awd_values, _awd_batch, '1f1b', 1, None),
])
def test_tnc_networks_under_the_stage_runtime_train_as_the_gpipe_graph(make, leaves, schedule,
                                                                      replicas, virtual):
    """Tokens ``(T, N)``, states ``(L, N, C)``, outputs ``(T, N, V)``: each
    split into micro-batches and replicas on axis 1 and joined there; three
    SGD steps give GPipe's one graph's outputs and parameters."""
    _, expected_out, expected = _schedule_steps(make, leaves, 'gpipe', replicas=replicas)
    mod, out, params = _schedule_steps(make, leaves, schedule, replicas=replicas,
                                       virtual=virtual)
    assert type(mod.runtimes[0]).__name__ == 'StageRuntime'
    assert [o.shape for o in out] == [o.shape for o in expected_out]
    assert out[0].shape[:2] == (T, N) and out[1].shape[1] == N
    assert [s for _, s in mod.output_shapes] == [o.shape for o in out]
    for ours, theirs in zip(out, expected_out):
        assert_exact(ours, theirs)
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=EXACT, err_msg=name)


def test_tnc_states_cross_two_nodes_under_1f1b_as_in_one_process(tmp_path):
    """``AWDRNN``'s ``(T, N)`` tokens, ``(1, N, C)`` states and ``(T, N, E)``
    activations cross between two node processes split on axis 1: after
    three SGD steps every parameter, once on the node of its stage, and
    the last node's outputs equal one process's bit for bit."""
    import os  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import recurrent_nodes_worker  # pylint: disable=import-outside-toplevel
    from conftest import reserved_port, run_node_workers  # pylint: disable=import-outside-toplevel
    from test_nodes import WORKER  # pylint: disable=import-outside-toplevel
    worker = os.path.join(os.path.dirname(WORKER), 'recurrent_nodes_worker.py')
    out = str(tmp_path / 'node')
    with reserved_port() as port:
        run_node_workers(worker, out, 2, port, timeout=120)
    held = {}
    for rank in range(2):
        with np.load('%s_%d.npz' % (out, rank)) as data:
            mine = {k: v for k, v in data.items() if k.startswith('param:')}
            outputs = [data[k] for k in sorted(data) if k.startswith('output:')]
        assert mine and not set(mine) & set(held)
        held.update(mine)
    expected, expected_outputs = recurrent_nodes_worker.train()
    assert sorted(held) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(held[name], value, err_msg=name)
    assert outputs and outputs[0].shape[:2] == (recurrent_nodes_worker.T, recurrent_nodes_worker.N)
    for ours, theirs in zip(outputs, expected_outputs):
        np.testing.assert_array_equal(ours, theirs)


def test_the_stage_runtime_reads_the_metric_and_output_shapes_as_the_one_graph():
    """Two replicas of two micro-batches: each replica's labels sliced on
    their axis 1 for the metric, and the outputs' shapes the whole batch's."""
    found = []
    for schedule in ('gpipe', '1f1b'):
        net, values = _lm_values()
        (x, states), y = _lm_batch(0)
        pipe = Pipeline(net, 'cpu:0,cpu:1,cpu:2,cpu:3', sample=(x, states), batch_axis=1,
                        chunks=2, replicas=2, schedule=schedule)
        mod = pipe.module(loss='softmax', output=0)
        mod.bind(list(zip(pipe.input_names, [a.shape for a in [x] + states])),
                 [('softmax_label', y.shape)])
        mod.init_params(arg_params=values, aux_params={})
        mod.forward(mx.io.DataBatch([x] + states, [y]), is_train=False)
        metric = mx.metric.Accuracy(axis=2)
        mod.update_metric(metric, [y])
        found.append((type(mod.runtimes[0]).__name__, metric.num_inst, metric.sum_metric,
                      [s for _, s in mod.output_shapes]))
    assert (found[0][0], found[1][0]) == ('FusedRuntime', 'StageRuntime')
    assert found[1][1:] == found[0][1:]
    assert found[0][1] == T * N and found[0][3] == [(T, N, VOCAB), (LAYERS, N, HIDDEN),
                                                    (LAYERS, N, HIDDEN)]
