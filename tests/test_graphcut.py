"""Any network split whole (mp_symbolic/graphcut.py through Pipeline), and
weights tied across stages: the split graph, the imperative twin and the
network on one device agree; the cut balances, counts the bytes that cross,
and is the same every time.

The sweep over every model-zoo network runs a representative subset by
default; ``MP_ZOO_SWEEP=1`` runs all of them (a few minutes)."""
import itertools
import json
import os
import subprocess
import sys
import warnings

import mxnet as mx
from mxnet import autograd, gluon
from mxnet.gluon import nn
from mxnet.gluon.model_zoo import vision
import numpy as np
import onnxruntime
import pytest

from mp_symbolic import BalanceError, Pipeline
from mp_symbolic.core.graph import graphcut
from mp_symbolic.core.engine import twin
from mp_symbolic.core.placement.balance import solve
from mp_symbolic.training.config import TrainConfig, resume_config
from mp_symbolic.tools.checkpoint import read_checkpoint
from mp_symbolic.core.graph.heads import gluon_loss
from mp_symbolic.tools.memory import device_memory
from mp_symbolic.core.base.compat import onednn_active
from mp_symbolic.core.base import compat
from mp_symbolic.core.base.compat import split_bind
from mp_symbolic.core.base.scoped import environ
from mp_symbolic.training.tasks import digits
from mp_symbolic.training.tasks.zoo import build_network, zoo_names
from mp_symbolic.training.loop import train

from export.__main__ import main as export_main
from conftest import chain


def _devices(k, first=1):
    return [mx.cpu(i) for i in range(first, first + k)]


def _values(net):
    """Name -> numpy value of every parameter (initialised on cpu(0))."""
    return {n: p.data().asnumpy() for n, p in net.collect_params().items()}


def _bind(symbol, group2ctx, shapes, values, grad_req='null'):
    with split_bind(group2ctx):
        exe = symbol.simple_bind(mx.cpu(0), group2ctx=group2ctx, grad_req=grad_req, **shapes)
    for name, array in list(exe.arg_dict.items()) + list(exe.aux_dict.items()):
        if name in values:
            array[:] = values[name]
    return exe


# -- a network with a skip connection over three boundaries --------------------

class SkipNet(gluon.HybridBlock):
    """``(N, 4)`` -> ``(N, 8)``: ``fc3(fc2(relu(h))) + h`` with ``h = fc1(x)``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.fc1 = nn.Dense(8, in_units=4)
            self.fc2 = nn.Dense(3, in_units=8)
            self.fc3 = nn.Dense(8, in_units=3)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        h = self.fc1(x)                       # (N, 8)
        return self.fc3(self.fc2(F.relu(h))) + h


def test_bytes_crossing_count_a_skip_connection_at_every_boundary_it_spans():
    net = SkipNet(prefix='skip_')
    # ops: fc1, relu, fc2, fc3, add
    pipe = Pipeline(net, 'cpu:1,cpu:2,cpu:3,cpu:4', balance=[2, 1, 1, 1], sample=(5, 4))
    # relu's 8 floats + h's 8; fc2's 3 + h; fc3's 8 + h (float32, per sample)
    assert pipe.cut.boundary_bytes == [64, 44, 64]
    text = str(pipe)
    assert 'stage1 -> stage2: 44 bytes per sample' in text
    assert 'ops: skip_dense1_fwd' in text and 'parameters: skip_dense1_weight' in text


def test_skip_connection_over_boundaries_gives_one_device_outputs_and_gradients():
    mx.random.seed(1)
    net = SkipNet(prefix='skip_')
    net.initialize(mx.init.Xavier())
    values = _values(net)
    X = mx.nd.random.normal(shape=(5, 4))
    head = mx.nd.random.normal(shape=(5, 8))
    with autograd.record():
        out = net(X)
    out.backward(head)
    pipe = Pipeline(net, 'cpu:1,cpu:2,cpu:3,cpu:4', balance=[2, 1, 1, 1])
    exe = _bind(pipe.symbol(), pipe.plan.group2ctx, {'data': (5, 4)}, values, 'write')
    exe.arg_dict['data'][:] = X
    exe.forward(is_train=True)
    exe.backward(head)
    np.testing.assert_allclose(exe.outputs[0].asnumpy(), out.asnumpy(), rtol=1e-5, atol=1e-6)
    for name, param in net.collect_params().items():
        assert exe.grad_dict[name].context == pipe.plan.devices[pipe.cut.owner[name]]
        np.testing.assert_allclose(exe.grad_dict[name].asnumpy(), param.grad().asnumpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


# -- the cut -------------------------------------------------------------------

def _brute_force_bottleneck(costs, k):
    best = float('inf')
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        bounds = (0,) + cuts + (len(costs),)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize('seed', range(5))
def test_cut_makes_the_largest_stage_as_small_as_it_can_be(seed):
    costs = list(np.random.default_rng(seed).integers(0, 20, size=9).astype(float))
    sizes = solve(costs, 3, slack=0.0)
    assert len(sizes) == 3 and min(sizes) >= 1 and sum(sizes) == 9
    bounds = np.cumsum((0,) + sizes)
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == _brute_force_bottleneck(costs, 3)


def test_cut_prefers_fewer_bytes_among_near_balanced_cuts():
    costs = [1.0] * 6
    cross = [5, 5, 9, 1, 5]  # bytes crossing a cut after each op
    assert solve(costs, 2, cross, slack=0.0) == (3, 3)
    assert solve(costs, 2, cross, slack=0.4) == (4, 2)
    assert solve(costs, 2, None, slack=0.4) == (3, 3)


def test_resnet18_cut_is_the_same_every_time_and_balanced_by_parameters():
    net = vision.resnet18_v1(classes=10)
    net.initialize()
    first = Pipeline(net, 'cpu:1,cpu:2,cpu:3,cpu:4', sample=(2, 3, 32, 32))
    again = Pipeline(net, 'cpu:1,cpu:2,cpu:3,cpu:4', sample=(2, 3, 32, 32))
    assert first.symbol().tojson() == again.symbol().tojson()
    assert first.balance == again.balance and first.cut.boundary_bytes == again.cut.boundary_bytes
    costs = first.cut.costs
    prefix = np.concatenate([[0.0], np.cumsum(costs)])

    def largest(sizes):
        bounds = np.cumsum((0,) + tuple(sizes))
        return max(prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:]))

    best = min(max(prefix[a], prefix[b] - prefix[a], prefix[c] - prefix[b], prefix[-1] - prefix[c])
               for a, b, c in itertools.combinations(range(1, len(costs)), 3))
    assert best <= largest(first.balance) <= 1.1 * best
    # among the near-balanced cuts it took one crossing no more bytes than the tightest
    tight = solve(costs, 4, slack=0.0)
    stage_of = [s for s, n in enumerate(tight) for _ in range(n)]
    tight_bytes = graphcut.crossing_bytes(first.cut.graph, stage_of,
                                          first.cut.activation_bytes)
    assert sum(first.cut.boundary_bytes) * 2 <= sum(tight_bytes)



def test_the_cut_benchmark_row_sets_the_cut_beside_the_tightest_balance():
    """bench/graphcut.py's row (python -m bench.graphcut): the cut taken and
    the tightest balance, both over every op, the tightest never larger."""
    from bench.graphcut import measure  # pylint: disable=import-outside-toplevel
    row = measure('resnet18_v1', 2)
    assert sum(row['sizes']) == sum(row['tight_sizes']) == row['ops']
    assert row['tight_largest'] <= row['largest']
    assert sum(row['bytes']) <= sum(row['tight_bytes'])

@pytest.mark.parametrize('make, sample, num_ops', [
    (lambda: SkipNet(prefix='skip_'), (8, 4), 5),
    (lambda: TiedLM(prefix='lm_'), (16, 4), 9),  # Embedding: no gradient for its ids
])
def test_balance_by_time_measures_every_op(make, sample, num_ops):
    pipe = Pipeline(make(), 'cpu:1,cpu:2', balance='time', sample=sample)
    assert len(pipe.cut.costs) == num_ops and all(t > 0 for t in pipe.cut.costs)
    assert sum(pipe.balance) == num_ops


@pytest.mark.parametrize('kwargs, error, message', [
    (dict(balance=[2, 2]), BalanceError, 'balance: expected ops per stage summing to the 5 ops, '
                                         'found (2, 2) (sum 4)'),
    (dict(balance=[4, 0, 1]), BalanceError, 'balance: expected one entry per device (devices: 2), '
                                            'found 3 entries (4, 0, 1)'),
    (dict(balance='fast'), BalanceError, "balance: expected None, 'time' or a list of ops"),
    (dict(tied={'nothing': 1}), BalanceError, "tied: expected parameter names of the network, "
                                              "found 'nothing'"),
    (dict(devices='cpu:1,cpu:2,cpu:3,cpu:4,cpu:5,cpu:6'), ValueError,
     'too many devices for the graph (devices: 6, ops: 5)'),
])
def test_bad_cut_arguments_say_what_was_expected(kwargs, error, message):
    kwargs = dict(kwargs)
    devices = kwargs.pop('devices', 'cpu:1,cpu:2')
    with pytest.raises(error, match=message.replace('(', r'\(').replace(')', r'\)')):
        Pipeline(SkipNet(prefix='skip_'), devices, **kwargs)


def test_whole_network_of_unknown_shapes_needs_a_sample():
    with pytest.raises(ValueError, match='sample: expected a batch or its shape to split a '
                                         'whole network'):
        Pipeline(vision.resnet18_v1(classes=10), 'cpu:1,cpu:2')


# -- ResNet-18 whole on four devices -------------------------------------------

@pytest.fixture(scope='module')
def resnet():
    mx.random.seed(0)
    net = vision.resnet18_v1(classes=10)
    net.initialize(mx.init.Xavier())
    X = np.random.default_rng(0).uniform(size=(8, 3, 32, 32)).astype(np.float32)
    expected = net(mx.nd.array(X)).asnumpy()
    pipe = Pipeline(net, 'cpu:1,cpu:2,cpu:3,cpu:4', sample=(4, 3, 32, 32))
    arg, aux = pipe.get_params()
    return net, pipe, X, expected, arg, aux


def test_resnet18_whole_places_parameters_on_all_four_devices_and_predicts_as_one_device(
        resnet):
    net, pipe, X, expected, arg, aux = resnet
    mod = pipe.module(loss='softmax')
    # one batch: see test_onednn_fails_the_second_inference_pass_of_some_split_resnets
    data = mx.io.NDArrayIter(X, np.zeros(len(X), dtype=np.float32), batch_size=8)
    mod.bind(data.provide_data, data.provide_label, for_training=False)
    mod.set_params(arg, aux)
    exe = mod.executors[0]
    where = {name: exe.arg_dict[name].context for name in arg}
    where.update({name: exe.aux_dict[name].context for name in aux})
    assert set(where.values()) == set(_devices(4))
    for name, ctx in where.items():
        assert ctx == pipe.plan.devices[pipe.cut.owner[name]], name
    probabilities = mod.predict(data).asnumpy()
    np.testing.assert_allclose(probabilities, mx.nd.softmax(mx.nd.array(expected)).asnumpy(),
                               atol=1e-5)
    pipe.initialize()  # the imperative twin: each parameter on its stage's device
    assert net.collect_params()[net.prefix + 'dense0_weight'].list_ctx() == [mx.cpu(4)]
    np.testing.assert_allclose(pipe(mx.nd.array(X)).asnumpy(), expected, atol=1e-5)


def test_imperative_twin_of_a_whole_resnet_trains_as_the_zoo_network():
    """Under autograd.record: the same outputs, gradients and BatchNorm running
    statistics as the zoo network on one device."""
    mx.random.seed(2)
    net = vision.resnet18_v1(classes=10)
    net.initialize(mx.init.Xavier())
    X = mx.nd.random.uniform(shape=(4, 3, 32, 32))
    net(X)
    params = net.collect_params()
    start = {n: p.data().copy() for n, p in params.items()}
    with autograd.record():
        expected = net(X)
    expected.backward()
    grads = {n: p.grad().asnumpy() for n, p in params.items() if p.grad_req != 'null'}
    after = {n: p.data().asnumpy() for n, p in params.items()}
    for name, param in params.items():
        param.set_data(start[name])
    pipe = Pipeline(net, 'cpu:1,cpu:2,cpu:3', sample=(4, 3, 32, 32))
    pipe.initialize()
    with autograd.record():
        out = pipe(X.as_in_context(mx.cpu(1)))
    out.backward()
    assert out.context == mx.cpu(3)
    np.testing.assert_allclose(out.asnumpy(), expected.asnumpy(), rtol=1e-5, atol=1e-6)
    for name, param in params.items():
        device = pipe.plan.devices[pipe.cut.owner[name]]
        assert param.list_ctx() == [device], name
        np.testing.assert_allclose(param.data(device).asnumpy(), after[name], rtol=1e-5,
                                   atol=1e-6, err_msg=name)  # running statistics moved alike
        if name in grads:
            np.testing.assert_allclose(param.grad(device).asnumpy(), grads[name], rtol=1e-5,
                                       atol=1e-6, err_msg=name)


@pytest.mark.skipif(not onednn_active(), reason='a oneDNN trap')
def test_a_split_resnet_runs_inference_twice_only_with_unshared_storage(resnet):
    """MXNet 1.9.1 with oneDNN: a split ResNet-18 bound for inference only
    (grad_req null), cut inside its first residual stage, runs its first
    forward pass and, with the memory planner's storage sharing on, fails
    the second ("The size of NDArray doesn't match the requested MKLDNN
    memory desc": a cross-device copy writes through a stale oneDNN layout,
    see compat.split_bind_environ). With the whole split_bind environment
    (NNVM_EXEC_MATCH_RANGE=0 too) it predicts what one device does. When the
    first half fails, MXNet no longer has the trap."""
    net, _, X, expected, arg, aux = resnet
    pipe = Pipeline(net, 'cpu:1,cpu:2', balance=[10, 58], sample=(4, 3, 32, 32))
    group2ctx = pipe.plan.group2ctx
    with environ(**compat.SUBGRAPH_BACKEND):  # the subgraph workaround alone
        exe = pipe.symbol().simple_bind(mx.cpu(0), group2ctx=group2ctx, grad_req='null',
                                        data=(4, 3, 32, 32))
    for name, array in list(exe.arg_dict.items()) + list(exe.aux_dict.items()):
        if name in arg or name in aux:
            array[:] = {**arg, **aux}[name]
    exe.forward(data=X[:4])[0].wait_to_read()
    with pytest.raises(mx.base.MXNetError, match="doesn't match the requested MKLDNN"):
        exe.forward(data=X[:4])[0].asnumpy()
    exe = _bind(pipe.symbol(), group2ctx, {'data': (4, 3, 32, 32)}, {**arg, **aux}, 'null')
    for _ in range(2):
        np.testing.assert_allclose(exe.forward(data=X[:4])[0].asnumpy(), expected[:4],
                                   atol=1e-5)


@pytest.mark.slow
def test_resnet18_whole_fits_and_its_checkpoint_exports_with_onnx_parity(resnet, tmp_path):
    _, pipe, X, _, arg, aux = resnet
    mod = pipe.module(loss='softmax')
    data = mx.io.NDArrayIter(X, np.arange(8, dtype=np.float32) % 10, batch_size=4)
    mod.fit(data, num_epoch=1, optimizer='sgd', optimizer_params={'learning_rate': 0.01},
            arg_params=arg, aux_params=aux)
    trained, _ = mod.get_params()
    assert any(not np.array_equal(trained[n].asnumpy(), arg[n].asnumpy()) for n in arg)
    prefix = str(tmp_path / 'resnet18')
    mod.save_checkpoint(prefix, 1)
    groups = {n['attrs']['__ctx_group__'] for n in
              json.loads((tmp_path / 'resnet18-symbol.json').read_text())['nodes']}
    assert groups == {'stage0', 'stage1', 'stage2', 'stage3'}
    out = tmp_path / 'export'
    assert export_main(['--checkpoint', prefix, '--epoch', '1', '--input-shape', '3,32,32',
                        '--out', str(out)]) == 0
    _check_onnx_parity(out / 'current' / 'resnet18.onnx', prefix, 1, (3, 32, 32))


def _check_onnx_parity(onnx_path, prefix, epoch, sample_shape, X=None):
    """onnxruntime on the exported file predicts what the checkpoint predicts
    bound on one device (probabilities: the exported head is softmax)."""
    symbol, arg, aux = mx.model.load_checkpoint(prefix, epoch)
    prediction = symbol.get_children()[0]  # the training head's input
    if X is None:
        X = np.random.default_rng(5).uniform(size=(3,) + sample_shape).astype(np.float32)
    exe = prediction.simple_bind(mx.cpu(0), grad_req='null', data=X.shape)
    exe.copy_params_from(arg, aux, allow_extra_params=True)
    expected = _softmax(exe.forward(data=X)[0].asnumpy())
    session = onnxruntime.InferenceSession(str(onnx_path), providers=['CPUExecutionProvider'])
    got = session.run(None, {session.get_inputs()[0].name: X})[0]
    assert _is_prob(got)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _is_prob(a):
    return np.all(a >= 0) and np.allclose(a.sum(axis=-1), 1.0, atol=1e-5)


def _softmax(a):
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# -- tied weights ----------------------------------------------------------------

VOCAB, DIM, SEQ = 12, 6, 4


def _clipped(F, x):
    # MXNet's Embedding clips out-of-range ids, ONNX's Gather does not: the
    # network clips them itself so both runtimes agree on any input.
    return F.clip(x, 0, VOCAB - 1)


class TiedLM(gluon.HybridBlock):
    """``(N, SEQ)`` token ids -> ``(N, VOCAB)`` scores; the output layer is the
    input embedding's weight (shape ``(VOCAB, DIM)``), tied."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embed = nn.Embedding(VOCAB, DIM)
            self.body = nn.HybridSequential()
            self.body.add(nn.Dense(32, activation='tanh', in_units=SEQ * DIM),
                          nn.Dense(32, activation='tanh', in_units=32),
                          nn.Dense(DIM, in_units=32))
            self.out = nn.Dense(VOCAB, in_units=DIM, use_bias=False, params=self.embed.params)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        h = self.embed(_clipped(F, x)).flatten()   # (N, SEQ * DIM)
        return self.out(self.body(h))                # (N, VOCAB)


class _Embed(gluon.HybridBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embed = nn.Embedding(VOCAB, DIM)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.embed(_clipped(F, x)).flatten()


def _tied_blocks():
    """The same network as a list of blocks: the output Dense shares the
    embedding's weight."""
    embed = _Embed(prefix='lm_')
    return [embed, nn.Dense(32, activation='tanh', in_units=SEQ * DIM, prefix='lm_fc0_'),
            nn.Dense(32, activation='tanh', in_units=32, prefix='lm_fc1_'),
            nn.Dense(DIM, in_units=32, prefix='lm_fc2_'),
            nn.Dense(VOCAB, in_units=DIM, use_bias=False, params=embed.embed.params,
                     prefix='lm_out_')]


def _token_task(n=256, seed=0):
    """Sequences of ids; the label is the first id."""
    X = np.random.default_rng(seed).integers(0, VOCAB, size=(n, SEQ)).astype(np.float32)
    return X, X[:, 0].copy()


def _tied_network(form):
    if form == 'whole':
        net = TiedLM(prefix='lm_')
        return net, net, 'lm_embedding0_weight'
    blocks = _tied_blocks()
    return chain(blocks, prefix='seq_'), blocks, 'lm_embedding0_weight'


@pytest.mark.parametrize('form, tied', [('whole', None), ('list', None), ('whole', 2),
                                        ('list', 2)])
def test_tied_embedding_gets_one_device_gradients_in_module_executor_and_imperative_twin(
        form, tied):
    mx.random.seed(3)
    net, given, weight = _tied_network(form)
    net.initialize(mx.init.Xavier())
    values = _values(net)
    X, y = _token_task(8)
    loss_fn = gluon_loss('softmax')
    with autograd.record():
        loss = loss_fn(net(mx.nd.array(X)), mx.nd.array(y))
    loss.backward()
    expected = {n: p.grad().asnumpy() for n, p in net.collect_params().items()}
    pipe = Pipeline(given, 'cpu:1,cpu:2,cpu:3', balance=None if form == 'whole' else [1, 2, 2],
                    tied=None if tied is None else {weight: tied})
    owner = 0 if tied is None else tied
    assert pipe.tied[weight] == (owner, [0, 2])
    device = mx.cpu(1 + owner)
    # the executor API, through the loss head
    symbol = pipe.training_symbol('softmax')
    exe = _bind(symbol, pipe.plan.group2ctx, {'data': X.shape, 'softmax_label': y.shape},
                values, {a: 'null' if a in ('data', 'softmax_label') else 'write'
                         for a in symbol.list_arguments()})
    exe.forward(is_train=True, data=X, softmax_label=y)
    exe.backward()
    assert exe.arg_dict[weight].context == device and exe.grad_dict[weight].context == device
    for name, grad in expected.items():
        np.testing.assert_allclose(exe.grad_dict[name].asnumpy(), grad, rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    # MXNet's Module: one parameter, one gradient, one optimizer state
    mod = pipe.module(loss='softmax')
    mod.bind([('data', X.shape)], [('softmax_label', y.shape)])
    mod.init_params(arg_params={n: mx.nd.array(v) for n, v in values.items()},
                    allow_missing=False)
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 0.1,
                                                          'momentum': 0.9})
    mod.forward_backward(mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)]))
    group = mod._exec_group  # pylint: disable=protected-access
    grads = dict(zip(group.param_names, (g[0] for g in group.grad_arrays)))
    np.testing.assert_allclose(grads[weight].asnumpy(), expected[weight], rtol=1e-5, atol=1e-6)
    mod.update()
    assert group.param_names.count(weight) == 1
    state = mod.updater.states[group.param_names.index(weight)]
    assert state.context == device
    # the imperative twin: the weight on its owner, read elsewhere through a copy
    net.collect_params().zero_grad()
    pipe.initialize()
    pipe.set_params(values)
    assert net.collect_params()[weight].list_ctx() == [device]
    with autograd.record():
        out = pipe(mx.nd.array(X, ctx=mx.cpu(1)))
        loss = loss_fn(out, mx.nd.array(y, ctx=out.context))
    loss.backward()
    for name, grad in expected.items():
        np.testing.assert_allclose(net.collect_params()[name].grad().asnumpy(), grad,
                                   rtol=1e-5, atol=1e-6, err_msg=name)


def test_tied_network_learns_with_fit_and_exports_with_parity(tmp_path):
    mx.random.seed(4)
    net = TiedLM(prefix='lm_')
    pipe = Pipeline(net, 'cpu:1,cpu:2,cpu:3', sample=(32, SEQ))
    assert 'tied: lm_embedding0_weight lives on stage0, read by stage0, stage2' in str(pipe)
    X, y = _token_task(512)
    mod = pipe.module(loss='softmax')
    data = mx.io.NDArrayIter(X, y, batch_size=32, shuffle=True)
    mod.fit(data, num_epoch=15, optimizer='adam', optimizer_params={'learning_rate': 0.01},
            initializer=mx.init.Xavier())
    X_test, y_test = _token_task(256, seed=1)
    predicted = mod.predict(mx.io.NDArrayIter(X_test, y_test, batch_size=32)).asnumpy()
    accuracy = float(np.mean(predicted.argmax(axis=1) == y_test))
    assert accuracy >= 0.95, accuracy
    prefix = str(tmp_path / 'lm')
    mod.save_checkpoint(prefix, 15)
    out = tmp_path / 'export'
    assert export_main(['--checkpoint', prefix, '--epoch', '15', '--out', str(out)]) == 0
    _check_onnx_parity(out / 'current' / 'lm.onnx', prefix, 15, (SEQ,), X=X_test[:5])


# -- chunks, replicas, memory, the training loop -----------------------------------

def test_micro_batches_through_a_whole_network_give_the_gradients_of_one_batch():
    mx.random.seed(5)
    net = TiedLM(prefix='lm_')
    net.initialize(mx.init.Xavier())
    values = _values(net)
    X, y = _token_task(8)
    grads = []
    for chunks in (1, 4):
        pipe = Pipeline(net, 'cpu:1,cpu:2,cpu:3', chunks=chunks)
        symbol = pipe.training_symbol('softmax')
        exe = _bind(symbol, pipe.plan.group2ctx, {'data': X.shape, 'softmax_label': y.shape},
                    values, {a: 'write' if a in values else 'null'
                             for a in symbol.list_arguments()})
        exe.forward(is_train=True, data=X, softmax_label=y)
        exe.backward()
        grads.append({n: exe.grad_dict[n].asnumpy() for n in values})
    assert 'chunk' in symbol.tojson() and 'lm_dense3_fwd_chunk3' in symbol.tojson()
    boundaries = [n for n in json.loads(symbol.tojson())['nodes']
                  if n['op'] == compat.SEGMENT_BOUNDARY_OP]  # see compat.segment_boundaries
    assert len(boundaries) == 3
    assert {n['attrs']['__ctx_group__'] for n in boundaries} == {'stage2'}
    for name in values:
        np.testing.assert_allclose(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_replicas_of_a_whole_network_step_as_one_replica_and_memory_is_per_device():
    mx.random.seed(6)
    net = SkipNet(prefix='skip_')
    net.initialize(mx.init.Xavier())
    values = {n: mx.nd.array(v) for n, v in _values(net).items()}
    X = np.random.default_rng(6).normal(size=(8, 4)).astype(np.float32)
    y = np.random.default_rng(7).normal(size=(8, 8)).astype(np.float32)
    after = []
    for devices, replicas in (('cpu:1,cpu:2', 1), ('cpu:1,cpu:2,cpu:3,cpu:4', 2)):
        pipe = Pipeline(net, devices, replicas=replicas)
        mod = pipe.module(loss='l2', label_name='label')
        mod.bind([('data', X.shape)], [('label', y.shape)])
        mod.init_params(arg_params=values)
        mod.init_optimizer(kvstore='local', optimizer='sgd',
                           optimizer_params={'learning_rate': 0.1})
        mod.forward_backward(mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)]))
        mod.update()
        after.append({n: v.asnumpy() for n, v in mod.get_params()[0].items()})
        table = device_memory(mod)
        for devices in pipe.plan.replica_devices:
            for stage, ctx in enumerate(devices):
                owned = [n for n in values if pipe.cut.owner[n] == stage]
                assert table[str(ctx)]['params'] == sum(values[n].size * 4 for n in owned)
    for name in after[0]:
        np.testing.assert_allclose(after[1][name], after[0][name], rtol=1e-5, atol=1e-6)


def test_mirrored_stages_of_a_whole_network_carry_the_mirroring_attribute():
    pipe = Pipeline(SkipNet(prefix='skip_'), 'cpu:1,cpu:2', balance=[2, 3], mirror=[1])
    nodes = json.loads(pipe.symbol().tojson())['nodes']
    mirrored = {n['name'] for n in nodes if n.get('attrs', {}).get('__force_mirroring__')}
    assert mirrored == set(pipe.stages[1]) and len(mirrored) == 3


class _DigitsResNet(gluon.HybridBlock):
    """A small residual CNN for the 8x8 digits, as one block."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.conv0 = nn.Conv2D(8, 3, padding=1, in_channels=1)
            self.conv1 = nn.Conv2D(8, 3, padding=1, in_channels=8)
            self.conv2 = nn.Conv2D(8, 3, padding=1, in_channels=8)
            self.out = nn.Dense(10, in_units=8 * 4 * 4)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        h = F.relu(self.conv0(x))                                  # (N, 8, 8, 8)
        h = F.relu(self.conv2(F.relu(self.conv1(h))) + h)
        return self.out(F.Pooling(h, kernel=(2, 2), stride=(2, 2), pool_type='max'))


def test_training_loop_commits_a_whole_network_and_resumes_it_on_another_plan(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr(digits, 'build_blocks', lambda: _DigitsResNet(prefix='res_'))
    quiet = dict(log=lambda line: None)
    fields = dict(task='digits', progress=False, lr=0.05, batch_size=64)
    whole = train(TrainConfig(devices='cpu:0,cpu:1', num_epochs=2, out=str(tmp_path / 'w'),
                              **fields), **quiet)
    train(TrainConfig(devices='cpu:0,cpu:1', num_epochs=1, out=str(tmp_path / 'p'), **fields),
          **quiet)
    saved = read_checkpoint(str(tmp_path / 'p')).summary['config']
    resumed = train(resume_config(saved, {'devices': 'cpu:2,cpu:1,cpu:0', 'num_epochs': 2,
                                          'progress': False, 'resume': str(tmp_path / 'p')}),
                    **quiet)
    assert {str(d) for _, d, _ in resumed.placement} == {'cpu(0)', 'cpu(1)', 'cpu(2)'}
    for name, value in whole.params.items():
        np.testing.assert_allclose(resumed.params[name], value, rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    assert resumed.held_out_accuracy > 0.5  # ten classes: chance is 0.1


@pytest.mark.parametrize('variant, api', [('symbolic', 'executor'), ('imperative', 'module')])
def test_training_loop_trains_a_whole_network_with_the_executor_and_the_imperative_twin(
        tmp_path, monkeypatch, variant, api):
    monkeypatch.setattr(digits, 'build_blocks', lambda: _DigitsResNet(prefix='res_'))
    lines = []
    result = train(TrainConfig(task='digits', variant=variant, api=api, devices='cpu:0,cpu:1',
                               num_epochs=1, progress=False, lr=0.05, out=str(tmp_path)),
                   log=lines.append)
    assert any('ops in 2 stage(s)' in line for line in lines)
    assert any('bytes per sample' in line for line in lines)
    assert {str(d) for _, d, _ in result.placement} == {'cpu(0)', 'cpu(1)'}


# -- the model zoo ------------------------------------------------------------------

SUBSET = ('resnet18_v2', 'mobilenetv2_0.25', 'vgg11')
SIZE = 32


def _zoo_split(name):
    """``None`` if ``name`` split over 2 and over 4 devices predicts what it
    predicts on one device; else why not (one line)."""
    mx.random.seed(0)
    try:
        net = vision.get_model(name, classes=10)
        net.initialize(mx.init.Xavier())
        X = mx.nd.random.uniform(shape=(2, 3, SIZE, SIZE))
        expected = net(X).asnumpy()
    except (mx.base.MXNetError, ValueError) as err:  # Gluon re-raises shape errors as ValueError
        return 'does not build at 3x%dx%d: %s' % (SIZE, SIZE, _reason(err))
    values = _values(net)
    for k in (2, 4):
        try:
            pipe = Pipeline(net, _devices(k), sample=(2, 3, SIZE, SIZE))
            exe = _bind(pipe.symbol(), pipe.plan.group2ctx, {'data': X.shape}, values)
            got = exe.forward(data=X)[0].asnumpy()
        except (mx.base.MXNetError, ValueError) as err:
            return 'over %d devices: %s' % (k, _reason(err))
        if not np.allclose(got, expected, rtol=1e-4, atol=1e-5):
            return 'over %d devices: predictions differ by %g' % (
                k, np.abs(got - expected).max())
        if len({a.context for a in exe.arg_arrays}) != k:
            return 'over %d devices: parameters on fewer devices' % k
    return None


def _reason(err):
    lines = [l.strip() for l in str(err).splitlines() if l.strip() and 'Traceback' not in l
             and not l.strip().startswith(('File', '[bt]'))]
    return lines[-1][:200] if lines else type(err).__name__


# MXNet 1.9.1's oneDNN kernels fail on some arrays copied between devices in a
# split graph (ResNet-50's stride-2 bottlenecks); with MXNET_MKLDNN_ENABLED=0
# the same splits predict exactly. A known limit, reported, not hidden.
ONEDNN_FAILURES = ('No convolution implementation for this request',
                   'could not create a primitive descriptor')


@pytest.mark.parametrize('name', SUBSET)
def test_zoo_network_split_over_two_and_four_devices_predicts_as_on_one(name):
    assert _zoo_split(name) is None


@pytest.mark.skipif(not os.environ.get('MP_ZOO_SWEEP'), reason='the full model-zoo sweep '
                    'takes minutes; set MP_ZOO_SWEEP=1')
def test_every_zoo_network_that_builds_small_splits_or_says_why_not():
    failures = {}
    for name in zoo_names():
        reason = _zoo_split(name)
        if reason is not None:
            failures[name] = reason
    if failures:
        warnings.warn('model-zoo networks not split at 3x%dx%d:\n%s' % (
            SIZE, SIZE, '\n'.join('  %s: %s' % item for item in sorted(failures.items()))))
    unexpected = {n: r for n, r in failures.items() if not r.startswith('does not build')
                  and not any(s in r for s in ONEDNN_FAILURES)}
    assert not unexpected
    # the oneDNN failures split and predict exactly with oneDNN off
    onednn = sorted(n for n, r in failures.items() if any(s in r for s in ONEDNN_FAILURES))
    if onednn:
        code = ('import sys; sys.path.insert(0, "tests"); from test_graphcut import _zoo_split; '
                'print([_zoo_split(n) for n in %r])' % (onednn,))
        out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                             timeout=600, check=False,
                             env=dict(os.environ, MXNET_MKLDNN_ENABLED='0',
                                      MXNET_STORAGE_FALLBACK_LOG_VERBOSE='0'))
        assert out.stdout.strip().splitlines()[-1] == repr([None] * len(onednn)), out.stderr
    assert len(failures) < len(zoo_names()) / 2


def test_zoo_network_for_the_digits_builds_and_splits_whole():
    net = build_network('resnet18_v1', scale=2)
    net.initialize(mx.init.Xavier())
    X = mx.nd.array(digits.load_digits()[0][:4])
    expected = net(X).asnumpy()
    assert expected.shape == (4, 10)
    pipe = Pipeline(net, 'cpu:1,cpu:2', sample=(4, 1, 8, 8))
    exe = _bind(pipe.symbol(), pipe.plan.group2ctx, {'data': X.shape}, _values(net))
    np.testing.assert_allclose(exe.forward(data=X)[0].asnumpy(), expected, atol=1e-5)
    with pytest.raises(ValueError, match="name: expected one of .*found 'resnet9'"):
        build_network('resnet9')


@pytest.mark.parametrize('tied', [None, 2])
def test_the_plan_counts_a_tied_weight_once_on_the_stage_it_lives_on(tied):
    blocks = _tied_blocks()
    weight = 'lm_embedding0_weight'
    pipe = Pipeline(blocks, 'cpu:1,cpu:2,cpu:3', balance=[1, 2, 2],
                    tied=None if tied is None else {weight: tied})
    params = pipe.collect_params()
    size = {n: int(np.prod(p.shape)) for n, p in params.items()}
    counts = [int(line.rsplit('(', 1)[1].split()[0]) for line in pipe.describe()[:3]]
    owner = 0 if tied is None else tied
    stage_params = [{n for b in blocks[a:b] for n in b.collect_params()}
                    for a, b in ((0, 1), (1, 3), (3, 5))]
    want = [sum(size[n] for n in names if n != weight) + (size[weight] if s == owner else 0)
            for s, names in enumerate(stage_params)]
    assert counts == want and sum(counts) == sum(size.values())


def _chain_blocks():
    return [nn.Dense(8, activation='relu', in_units=4, prefix='b0_'),
            nn.Dense(8, activation='tanh', in_units=8, prefix='b1_'),
            nn.Dense(3, in_units=8, prefix='b2_')]


@pytest.mark.parametrize('chunks, mirror', [(1, False), (3, [1])])
def test_a_block_list_builds_the_graph_of_one_network_cut_at_its_block_boundaries(chunks,
                                                                                    mirror):
    """A block list is traced into one graph like a whole network: its graph
    is the whole network's with the cut at the same block boundary (blocks
    [1, 2] are ops [2, 3]), chunks and mirroring included."""
    blocks = Pipeline(_chain_blocks(), 'cpu:0,cpu:1', balance=[1, 2], chunks=chunks,
                      mirror=mirror)
    whole = Pipeline(chain(_chain_blocks()), 'cpu:0,cpu:1', balance=[2, 3], chunks=chunks,
                     mirror=mirror)
    assert blocks.placement.traced.stage_of_op == whole.cut.stage_of_op == (0, 0, 1, 1, 1)
    assert blocks.placement.traced.op_names == whole.cut.op_names
    for loss in (None, 'softmax'):
        assert blocks.training_symbol(loss).tojson() == whole.training_symbol(loss).tojson()
    assert blocks.stage_names == [['b0'], ['b1', 'b2']] and blocks.balance == (1, 2)


def test_a_whole_networks_twin_runs_its_stages_in_gpipe_clock_order(monkeypatch):
    """The imperative twin of a whole network takes the block list's
    schedule: clock k runs stage k - m of micro-batch m (each stage its ops
    of the labelled graph), not one micro-batch through every stage after
    the other; the output is the one-device output."""
    pipe = Pipeline(chain(_chain_blocks()), 'cpu:0,cpu:1,cpu:2', balance=[1, 2, 2], chunks=2)
    pipe.initialize(mx.init.Uniform(0.5))
    placement = pipe.placement
    stages = twin.ops_of_stages(placement, placement.labelled())
    calls, run = [], graphcut.GraphRun.run

    def recording(self, indices):
        indices = list(indices)
        if indices in stages:  # one stage's ops
            calls.append((id(self), stages.index(indices)))
        return run(self, indices)

    monkeypatch.setattr(graphcut.GraphRun, 'run', recording)
    X = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (4, 4)), ctx=mx.cpu(0))
    out = pipe(X)
    runs = list(dict.fromkeys(r for r, _ in calls))
    assert [(runs.index(r), s) for r, s in calls] == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1),
                                                      (1, 2)]
    alone = chain(_chain_blocks())
    alone.initialize()
    for name, param in alone.collect_params().items():
        param.set_data(pipe.collect_params()[name].data(placement.device_of(name)).copyto(
            mx.cpu(0)))
    np.testing.assert_allclose(out.asnumpy(), alone(X).asnumpy(), rtol=1e-6, atol=1e-7)


def test_a_whole_networks_twin_labels_its_graph_once_per_placement(monkeypatch):
    """The twin of a cut network labels its graph on the first forward pass
    only; a second pass runs the same graph and gives the same output."""
    pipe = Pipeline(chain(_chain_blocks()), 'cpu:0,cpu:1', balance=[2, 3], chunks=2)
    pipe.initialize(mx.init.Uniform(0.5))
    calls, labelled = [], graphcut.Cut.labelled

    def counting(self, mirror=()):
        calls.append(mirror)
        return labelled(self, mirror)

    monkeypatch.setattr(graphcut.Cut, 'labelled', counting)
    X = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (4, 4)), ctx=mx.cpu(0))
    first = pipe(X).asnumpy()
    assert len(calls) == 1
    second = pipe(X).asnumpy()
    assert len(calls) == 1
    np.testing.assert_array_equal(second, first)


def test_a_block_lists_graph_carries_the_shapes_and_dtypes_its_layers_have_now():
    """A block list is traced each time a graph is built: a layer that learnt
    its input size, or was cast, after an earlier build shows it in the next."""
    blocks = [nn.Dense(5, prefix='a_'), nn.Dense(2, prefix='b_')]
    pipe = Pipeline(blocks, 'cpu:0,cpu:1', balance=[1, 1])
    pipe.symbol()
    pipe.infer_shape((4, 7))
    for block in blocks:
        block.cast('float16')
    nodes = {n['name']: n for n in json.loads(pipe.symbol().tojson())['nodes']}
    assert nodes['a_weight']['attrs']['__shape__'] == '(5, 7)'
    assert nodes['a_weight']['attrs']['__dtype__'] == '2'  # MXNet's code of float16
