"""MXNet 1.9.1's own behaviour that model parallelism has to work around.
Each test documents a trap; if one starts failing, MXNet changed."""
import json
import os
import subprocess
import sys

import mxnet as mx
from mxnet import autograd, gluon
import numpy as np
import pytest

from mp_symbolic import Pipeline
from mp_symbolic.core.base import compat
from mp_symbolic.core.graph import passes
from mp_symbolic.core.base.compat import split_bind
from mp_symbolic.core.graph.ir import PlacedGraph
from mp_symbolic.core.base.scoped import environ
from mp_symbolic.training.tasks import digits, gpt, regression

from conftest import ROOT, THREE_DEVICES


def _groups(symbol):
    return {node.name: node.attr('ctx_group') for node in symbol.get_internals()}


def test_scope_inside_hybrid_forward_misses_the_variables_and_binding_fails():
    """Why the Pipeline tags around each block's whole call: a scope inside
    hybrid_forward tags the ops but not the parameter variables, and the
    model-parallel bind for training then fails."""
    class InnerScope(gluon.HybridBlock):
        def __init__(self, group, **kwargs):
            super().__init__(**kwargs)
            self.group = group
            self.weight = self.params.get('weight', shape=(2, 2))

        def hybrid_forward(self, F, x, weight):  # pylint: disable=arguments-differ
            with mx.AttrScope(ctx_group=self.group):
                return F.FullyConnected(x, weight, no_bias=True, num_hidden=2)

    first, second = InnerScope('stage0', prefix='a_'), InnerScope('stage1', prefix='b_')
    out = mx.sym.LinearRegressionOutput(second(first(mx.sym.var('data'))), mx.sym.var('label'))
    groups = _groups(out)
    assert groups['a_fullyconnected0'] == 'stage0'
    assert groups['a_weight'] is None and groups['b_weight'] is None
    with pytest.raises(RuntimeError, match='Trying to save gradient to cpu'):
        out.simple_bind(ctx=mx.cpu(0), group2ctx={'stage0': mx.cpu(0), 'stage1': mx.cpu(1)},
                        data=(4, 2), label=(4, 2))


def test_gluon_caches_parameter_variables_with_their_first_attributes():
    """Why the Pipeline clears the cache before each build."""
    dense = gluon.nn.Dense(2, in_units=2, prefix='d_')
    with mx.AttrScope(ctx_group='stage0'):
        dense(mx.sym.var('x'))
    with mx.AttrScope(ctx_group='stage1'):
        again = dense(mx.sym.var('x'))
    assert _groups(again)['d_weight'] == 'stage0'
    compat.reset_variables(dense)  # the workaround: a fresh variable takes the scope in force
    with mx.AttrScope(ctx_group='stage1'):
        fresh = dense(mx.sym.var('x'))
    assert _groups(fresh)['d_weight'] == 'stage1'
    # compat.fresh_variables: fresh within, and forgotten afterwards, even after an error
    with pytest.raises(ZeroDivisionError):
        with compat.fresh_variables([dense]), mx.AttrScope(ctx_group='stage2'):
            assert _groups(dense(mx.sym.var('x')))['d_weight'] == 'stage2'
            raise ZeroDivisionError
    with mx.AttrScope(ctx_group='stage3'):
        assert _groups(dense(mx.sym.var('x')))['d_weight'] == 'stage3'


def test_graph_wide_mirroring_cannot_bind_a_segment_boundary_copy():
    """Why micro-batch outputs keep no boundary copy under
    MXNET_BACKWARD_DO_MIRROR=1 (compat.segment_boundaries): the recomputed
    copy has no dtype, and the bind fails; without the copies it binds."""
    blocks = [gluon.nn.Dense(8, activation='relu', in_units=8) for _ in range(2)]
    pipe = Pipeline(blocks, 'cpu:1,cpu:2', chunks=2)
    shapes = dict(data=(4, 8), softmax_label=(4,))
    with environ(MXNET_BACKWARD_DO_MIRROR='1'):
        built_without = pipe.training_symbol('softmax')
    built_with = pipe.training_symbol('softmax')
    assert 'chunk_boundary0' in built_with.tojson()
    assert 'chunk_boundary0' not in built_without.tojson()
    with environ(MXNET_BACKWARD_DO_MIRROR='1'), split_bind(pipe.plan.group2ctx):
        with pytest.raises(RuntimeError, match='InferType pass cannot decide dtypes'):
            built_with.simple_bind(mx.cpu(1), group2ctx=pipe.plan.group2ctx, **shapes)
        built_without.simple_bind(mx.cpu(1), group2ctx=pipe.plan.group2ctx, **shapes)


def test_an_embedding_cannot_be_recomputed_so_mirroring_keeps_its_output():
    """Why compat.UNMIRRORED_OPS: MXNet 1.9.1 asks a recomputed Embedding for
    an output nothing reads (req kNullOp) and its forward checks kWriteTo, so
    any graph with a mirrored Embedding fails its backward pass. Mirroring a
    stage leaves its Embedding out; the other ops keep the mark, and the
    stage trains."""
    def embedded(mirror_embedding):
        emb = mx.sym.Embedding(mx.sym.var('data'), input_dim=10, output_dim=4, name='emb')
        if mirror_embedding:
            emb._set_attr(__force_mirroring__='True')  # pylint: disable=protected-access
        return mx.sym.tanh(emb, name='act')

    def step(symbol):
        ex = symbol.simple_bind(mx.cpu(0), data=(2, 3),
                                grad_req={'data': 'null', 'emb_weight': 'write'})
        ex.arg_dict['data'][:] = mx.nd.array([[1, 2, 3], [4, 5, 6]])
        ex.forward(is_train=True)
        ex.backward(mx.nd.ones(ex.outputs[0].shape))
        mx.nd.waitall()

    with pytest.raises(mx.base.MXNetError, match='kWriteTo'):
        step(embedded(True))
    graph = PlacedGraph.from_symbol(embedded(False))
    graph = graph.but([n.but(group='stage0') for n in graph.nodes])
    mirrored = passes.mirror_stages(graph, [0])
    marks = {n.name: n.attrs.get('__force_mirroring__') for n in mirrored.ops}
    assert marks == {'emb': None, 'act': 'True'}
    step(mirrored.to_symbol())


def _net_on_three_devices():
    pipe = Pipeline(regression.build_blocks(), THREE_DEVICES)
    pipe.initialize()
    return pipe


def test_one_gluon_trainer_refuses_parameters_on_different_devices():
    with pytest.raises(AssertionError, match='same set of contexts'):
        gluon.Trainer(_net_on_three_devices().collect_params(), 'sgd', {'learning_rate': 0.1})


def test_hybridized_net_ignores_ctx_group_and_refuses_split_parameters():
    """CachedOp runs the whole graph on the input's device."""
    pipe = _net_on_three_devices()
    net = gluon.nn.HybridSequential(prefix='')
    net.add(*pipe.blocks)
    net.hybridize()
    with pytest.raises(mx.base.MXNetError, match='CachedOp requires all inputs to live on '
                                                 'the same context'):
        net(mx.nd.ones((4, 2), ctx=mx.cpu(0))).wait_to_read()


def test_backward_inside_or_outside_record_gives_the_same_gradients():
    """The seed asks where ``backward()`` goes: either place works."""
    X = mx.nd.array(np.arange(8, dtype=np.float32).reshape(4, 2) / 8, ctx=mx.cpu(0))
    y = mx.nd.ones((4, 1), ctx=mx.cpu(2))
    grads = []
    for inside in (True, False):
        mx.random.seed(0)
        pipe = _net_on_three_devices()
        with autograd.record():
            loss = gluon.loss.L2Loss()(pipe(X), y)
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append({n: p.grad().asnumpy() for n, p in pipe.collect_params().items()})
    for name in grads[0]:
        np.testing.assert_array_equal(grads[0][name], grads[1][name])
        assert np.abs(grads[0][name]).max() > 0


# -- the behaviours mp_symbolic.core.base.compat works around ---------------------------------------
# (oneDNN's subgraph fusion across ctx_group is pinned in test_load_model.py:
# test_split_bind_without_the_onednn_workaround_fails_on_the_digits_cnn)

def _module_update_on_kvstore(env):
    import os  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.base.scoped import environ  # pylint: disable=import-outside-toplevel
    data = mx.sym.var('data')
    net = mx.sym.LinearRegressionOutput(mx.sym.FullyConnected(data, num_hidden=1, name='fc'),
                                        name='out')
    mod = mx.mod.Module(net, data_names=['data'], label_names=['out_label'],
                        context=[mx.cpu(0), mx.cpu(1)])
    mod.bind([('data', (4, 2))], [('out_label', (4, 1))])
    mod.init_params()
    saved = os.environ.pop('MXNET_UPDATE_ON_KVSTORE', None)
    try:
        with environ(**env):
            mod.init_optimizer(kvstore='local', optimizer='sgd')
    finally:
        if saved is not None:
            os.environ['MXNET_UPDATE_ON_KVSTORE'] = saved
    return mod._update_on_kvstore  # pylint: disable=protected-access


def test_module_updates_on_the_kvstore_unless_told_not_to():
    """compat.gradient_only_kvstore: by default Module lets the kvstore run
    every update on one device; MXNET_UPDATE_ON_KVSTORE=0 keeps it local."""
    assert _module_update_on_kvstore({}) is True
    assert _module_update_on_kvstore({'MXNET_UPDATE_ON_KVSTORE': '0'}) is False


def test_module_keeps_a_host_copy_of_every_parameter_on_cpu0_beside_its_devices():
    """core/engine/device_module.py: a Module bound on cpu(1) and cpu(2) alone
    still holds every parameter a second time on cpu(0) (made at bind,
    filled by init_params, handed out by get_params), the whole model on one
    device beside a split's shares."""
    data = mx.sym.var('data')
    with mx.AttrScope(ctx_group='stage0'):
        hidden = mx.sym.FullyConnected(data, num_hidden=8, name='fc0')
    with mx.AttrScope(ctx_group='stage1'):
        out = mx.sym.FullyConnected(hidden, num_hidden=2, name='fc1')
    mod = mx.mod.Module(out, label_names=None, context=mx.cpu(1),
                        group2ctxs={'stage0': mx.cpu(1), 'stage1': mx.cpu(2)})
    mod.bind(data_shapes=[('data', (4, 3))])
    mod.init_params()
    kept = mod._arg_params  # pylint: disable=protected-access
    assert sorted(kept) == ['fc0_bias', 'fc0_weight', 'fc1_bias', 'fc1_weight']
    assert {str(a.context) for a in kept.values()} == {'cpu(0)'}
    arrays = mod._exec_group.execs[0].arg_dict  # pylint: disable=protected-access
    assert arrays['fc0_weight'].context == mx.cpu(1) and arrays['fc1_weight'].context == mx.cpu(2)
    assert mod.get_params()[0]['fc1_weight'] is kept['fc1_weight']


def test_profiler_aborts_past_its_device_rows(tmp_path):
    """compat.profiler_cpu_limit: an op on cpu(N), N >= cores + 2, recorded by
    the profiler, aborts the whole process."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.base.compat import profiler_cpu_limit  # pylint: disable=import-outside-toplevel
    # one child, each device in a fork of it (a process of its own, one profiler each)
    code = ('import os\nimport mxnet as mx\n'
            'for name, index, path in (("below", %d, %r), ("past", %d, %r)):\n'
            '    pid = os.fork()\n'
            '    if pid == 0:\n'
            '        mx.profiler.set_config(profile_all=True, filename=path)\n'
            '        mx.profiler.set_state("run")\n'
            '        x = mx.nd.ones((2,), ctx=mx.cpu(index)) * 2\n'
            '        mx.nd.waitall()\n'
            '        mx.profiler.set_state("stop")\n'
            '        print(name, "survived", flush=True)\n'
            '        os._exit(0)\n'
            '    print(name, "exit status", os.waitpid(pid, 0)[1], flush=True)\n')
    proc = subprocess.run([sys.executable, '-c', code % (
        profiler_cpu_limit() - 1, str(tmp_path / 'a.json'), profiler_cpu_limit(),
        str(tmp_path / 'b.json'))], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[:2] == ['below survived', 'below exit status 0']
    assert lines[2].startswith('past exit status ') and lines[2] != 'past exit status 0'
    assert len(lines) == 3  # the process past the rows never printed


# one child; each profiled step in a fork of it (MXNet's profiler: one trace per process)
_SEGMENT_PROBE = """
import sys
from bench.bn_chunks import _profile_forked
sys.exit(_profile_forked('cpu:0,cpu:1,cpu:2', [(4, sys.argv[1], True), (4, sys.argv[2], False)]))
"""


@pytest.mark.slow
def test_a_bulked_segment_over_two_devices_runs_op_by_op(tmp_path):
    """Why micro-batch outputs pass through a copy before the join
    (compat.segment_boundaries): MXNet bulks consecutive ops of its schedule
    into one engine operation, but gives up on a run that spans two devices,
    and with micro-batches one chunk's last-stage ops are followed by the next
    chunk's first-stage ops. Without the copies, the digits CNN's first
    device runs most of its convolution, BatchNorm and pooling ops (forward
    and backward) one engine operation at a time; with them, every one of
    them in a bulked segment, with bitwise the same gradients."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    import os  # pylint: disable=import-outside-toplevel
    from bench.bn_chunks import without_segment_boundaries  # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.trace import load_trace, op_intervals  # pylint: disable=import-outside-toplevel
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    unbulked, engine_ops, grads = {}, {}, {}
    paths = {variant: str(tmp_path / ('%s.json' % variant)) for variant in ('with', 'without')}
    proc = subprocess.run([sys.executable, '-c', _SEGMENT_PROBE, paths['with'], paths['without']],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for variant, path in paths.items():
        first = op_intervals(load_trace(path))['cpu/0']
        unbulked[variant] = {name for _, _, name in first if not name.startswith('[')}
        engine_ops[variant] = len(first)
        grads[variant] = np.load(path + '.npy')
    pipe = Pipeline(digits.build_blocks(), 'cpu:0,cpu:1,cpu:2', chunks=4)
    assert without_segment_boundaries(pipe.training_symbol('softmax'))[1] == 3
    assert {'Convolution', '_backward_Convolution', 'BatchNorm'} <= unbulked['without']
    assert unbulked['with'] == {'CopyCPU2CPU'}  # the stage's outputs, sent to the next device
    assert engine_ops['with'] * 2 < engine_ops['without']
    np.testing.assert_array_equal(grads['with'], grads['without'])


def _step_8x8(pipe, group2ctx, bind_scope, batch_size=64):
    """Two forward/backward passes of the Pipeline's training graph on one
    fixed batch from fixed parameters; outputs and gradients as numpy."""
    symbol = pipe.training_symbol('softmax')
    with bind_scope:
        exe = symbol.simple_bind(mx.cpu(0), group2ctx=group2ctx, data=(batch_size, 1, 8, 8),
                                 softmax_label=(batch_size,))
    rng = np.random.default_rng(0)
    for name in sorted(exe.arg_dict):
        exe.arg_dict[name][:] = rng.uniform(-0.3, 0.3, exe.arg_dict[name].shape)
    exe.arg_dict['data'][:] = rng.uniform(0, 1, (batch_size, 1, 8, 8))
    exe.arg_dict['softmax_label'][:] = rng.integers(0, 10, batch_size)
    for name, arr in exe.aux_dict.items():
        arr[:] = 1 if name.endswith('var') else 0
    for _ in range(2):  # the stale layout can be left by the first step
        exe.forward(is_train=True)
        exe.backward()
    result = {n: g.asnumpy() for n, g in exe.grad_dict.items() if g is not None}
    result['output'] = exe.outputs[0].asnumpy()
    return result


@pytest.mark.parametrize('balance, chunks', [((6, 5), 2), ((7, 4), 1)])
def test_cross_device_copy_writes_through_a_stale_onednn_layout(balance, chunks):
    """Why split binds get ``NNVM_EXEC_MATCH_RANGE=0`` (mp_symbolic.core.base.compat):
    the executor's cross-device copy of a gradient lands in storage another
    array left in a oneDNN layout of other dims, and the next oneDNN op fails
    (BatchNorm's backward with bn1 ending stage 0, relu's with relu1 ending
    it, one chunk or two). With every intermediate array in storage of its
    own, the same graph runs and matches the one-device graph."""
    if not compat.onednn_active():
        pytest.skip('oneDNN is off in this process or this build')
    pipe = Pipeline(digits.build_blocks(), 'cpu:0,cpu:1', balance=list(balance), chunks=chunks)
    group2ctx = pipe.plan.group2ctx
    with pytest.raises(mx.base.MXNetError, match="doesn't match the requested MKLDNN memory"):
        _step_8x8(pipe, group2ctx, environ(**compat.SUBGRAPH_BACKEND))
    got = _step_8x8(pipe, group2ctx, split_bind(group2ctx, pipe.training_symbol('softmax')))
    want = _step_8x8(pipe, {g: mx.cpu(0) for g in group2ctx}, split_bind(None))
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def _equal_size_cnn():
    """A CNN whose stage 0 holds (N, 16, 8, 8) and (N, 64, 4, 4): arrays of
    one size and other dims, which MXNet's planner lets share storage."""
    nn = gluon.nn
    return [nn.Conv2D(16, 3, padding=1, in_channels=1, prefix='c0_'),
            nn.BatchNorm(in_channels=16, prefix='b0_'), nn.Activation('relu', prefix='r0_'),
            nn.MaxPool2D(2, prefix='p0_'),
            nn.Conv2D(64, 3, padding=1, in_channels=16, prefix='c1_'),
            nn.BatchNorm(in_channels=64, prefix='b1_'), nn.Activation('relu', prefix='r1_'),
            nn.MaxPool2D(2, prefix='p1_'), nn.Flatten(prefix='f_'),
            nn.Dense(10, in_units=256, prefix='d_')]


def test_cross_device_copy_through_a_stale_layout_of_the_same_size_gives_wrong_gradients():
    """The same trap, silent: where the stale oneDNN layout has the copied
    array's size but other dims, nothing fails and the gradients are wrong
    (so sharing storage only between arrays of one size,
    ``NNVM_EXEC_MATCH_RANGE=1``, is no cure either). One chunk is enough."""
    if not compat.onednn_active():
        pytest.skip('oneDNN is off in this process or this build')
    pipe = Pipeline(_equal_size_cnn(), 'cpu:0,cpu:1', balance=[7, 3])
    group2ctx = pipe.plan.group2ctx
    want = _step_8x8(pipe, {g: mx.cpu(0) for g in group2ctx}, split_bind(None))
    for match_range in ('16', '1'):  # MXNet's default, and sizes matched exactly
        wrong = _step_8x8(pipe, group2ctx, environ(NNVM_EXEC_MATCH_RANGE=match_range,
                                                      **compat.SUBGRAPH_BACKEND))
        assert max(np.abs(wrong[n] - want[n]).max() for n in want) > 1.0, match_range
    got = _step_8x8(pipe, group2ctx, split_bind(group2ctx, pipe.training_symbol('softmax')))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


_LM_CFG = gpt.GPTConfig(vocab_size=29, block_size=16, num_layers=2, num_heads=2, num_hiddens=16)


def _lm_steps(pipe, group2ctx, bind_scope, batch_size=8):
    """Three forward/backward passes of the language model's training graph on
    one fixed batch from fixed parameters; outputs and gradients as numpy."""
    symbol = pipe.training_symbol('softmax')
    T = _LM_CFG.block_size
    with bind_scope:
        exe = symbol.simple_bind(mx.cpu(0), group2ctx=group2ctx, data=(batch_size, T),
                                 softmax_label=(batch_size, T),
                                 grad_req={n: 'null' if n in ('data', 'softmax_label') else 'write'
                                           for n in symbol.list_arguments()})
    rng = np.random.default_rng(0)
    for name in sorted(exe.arg_dict):
        exe.arg_dict[name][:] = rng.normal(0, 0.3, exe.arg_dict[name].shape)
    exe.arg_dict['data'][:] = rng.integers(0, _LM_CFG.vocab_size, (batch_size, T))
    exe.arg_dict['softmax_label'][:] = rng.integers(0, _LM_CFG.vocab_size, (batch_size, T))
    for _ in range(3):  # a stale layout would be left by one pass for the next
        exe.forward(is_train=True)
        exe.backward()
    result = {n: g.asnumpy() for n, g in exe.grad_dict.items() if g is not None}
    result['output'] = exe.outputs[0].asnumpy()
    return result


@pytest.mark.parametrize('whole, devices, chunks', [(False, 'cpu:0,cpu:1', 1),
                                                    (False, 'cpu:0,cpu:1,cpu:2', 2),
                                                    (True, 'cpu:0,cpu:1', 4),
                                                    (True, 'cpu:0,cpu:1,cpu:2', 1)])
def test_a_split_graph_without_convolutions_shares_storage_and_computes_what_one_device_does(
        whole, devices, chunks):
    """Why compat.split_bind keeps MXNet's storage sharing for graphs with no
    op of compat.ONEDNN_LAYOUT_OPS: the language model (dense layers, norms,
    softmax, batch_dot, elementwise ops) split over stages, bound with shared
    storage, computes what one device does, pass after pass; the CNNs above
    fail or go wrong under the same sharing. If MXNet ever leaves a blocked
    layout behind these ops, this fails, and the op belongs in the set."""
    if not compat.onednn_active():
        pytest.skip('oneDNN is off in this process or this build')
    blocks = gpt.build_blocks(_LM_CFG)
    net = gpt.GPT(blocks) if whole else blocks
    pipe = Pipeline(net, devices, chunks=chunks, sample=(1, _LM_CFG.block_size))
    group2ctx = pipe.plan.group2ctx
    symbol = pipe.training_symbol('softmax')
    env = compat.split_bind_environ(group2ctx.values(), symbol)
    # storage shared (no NNVM_EXEC_MATCH_RANGE), in the planner's plan of fewest bytes
    assert env == {**compat.SUBGRAPH_BACKEND, **compat.SEARCHED_MEMORY}
    got = _lm_steps(pipe, group2ctx, split_bind(group2ctx, symbol))
    want = _lm_steps(pipe, {g: mx.cpu(0) for g in group2ctx}, split_bind(None))
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_only_graphs_with_layout_ops_bind_split_without_storage_sharing():
    """compat.split_bind_environ: the digits CNN's split gets storage of its
    own, the language model's keeps MXNet's sharing; an unknown graph (no
    symbol) is treated as one that needs it."""
    if not compat.onednn_active():
        pytest.skip('oneDNN is off in this process or this build')
    devices = [mx.cpu(0), mx.cpu(1)]
    cnn = Pipeline(digits.build_blocks(), 'cpu:0,cpu:1').training_symbol('softmax')
    lm_graph = Pipeline(gpt.build_blocks(_LM_CFG), 'cpu:0,cpu:1',
                        sample=(1, 16)).training_symbol('softmax')
    assert compat.split_bind_environ(devices, cnn) == {**compat.SUBGRAPH_BACKEND,
                                                       **compat.UNSHARED_MEMORY}
    assert compat.split_bind_environ(devices, None) == compat.split_bind_environ(devices, cnn)
    assert compat.split_bind_environ(devices, lm_graph) == {**compat.SUBGRAPH_BACKEND,
                                                            **compat.SEARCHED_MEMORY}
    # one device keeps the fusion and the sharing, planned for the fewest bytes
    assert compat.split_bind_environ(devices[:1], cnn) == compat.SEARCHED_MEMORY


def test_the_planner_search_over_match_ranges_makes_no_plan_without_storage_sharing():
    """Why compat.UNSHARED_MEMORY turns MXNet's search over match ranges off,
    and split_bind_environ leaves the search out where the caller's
    environment shares no storage: with ``NNVM_EXEC_MATCH_RANGE=0`` and
    ``NNVM_AUTO_SEARCH_MATCH_RANGE=1`` the planner tries no match range at
    all and the bind fails. The digits CNN's split, bound by split_bind in a
    caller's environment with the search on, binds."""
    pipe = Pipeline(digits.build_blocks(), 'cpu:0,cpu:1')
    group2ctx = pipe.plan.group2ctx
    symbol = pipe.training_symbol('softmax')
    shapes = dict(data=(4, 1, 8, 8), softmax_label=(4,))
    with environ(NNVM_EXEC_MATCH_RANGE='0', NNVM_AUTO_SEARCH_MATCH_RANGE='1'):
        with pytest.raises(RuntimeError, match='Cannot find attribute storage_id'):
            symbol.simple_bind(mx.cpu(0), **shapes)
    with environ(NNVM_AUTO_SEARCH_MATCH_RANGE='1'), split_bind(group2ctx, symbol):
        symbol.simple_bind(mx.cpu(0), group2ctx=group2ctx, **shapes)
    lm_graph = Pipeline(gpt.build_blocks(_LM_CFG), 'cpu:0,cpu:1',
                        sample=(1, 16)).training_symbol('softmax')
    with environ(NNVM_EXEC_MATCH_RANGE='0'):
        assert compat.split_bind_environ(group2ctx.values(), lm_graph) == compat.SUBGRAPH_BACKEND


def test_fully_connected_gives_its_bias_a_zero_gradient_when_its_weight_has_none():
    """Why docs/any-network.md says to freeze a Dense layer whole: with
    oneDNN, FullyConnected's backward skips its bias when the weight's
    grad_req is 'null' (Module's fixed_param_names, Gluon's grad_req), on one
    device as on a split."""
    if not compat.onednn_active():
        pytest.skip('oneDNN is off in this process')
    out = mx.sym.FullyConnected(mx.sym.var('data'), mx.sym.var('w'), mx.sym.var('b'),
                                num_hidden=3)
    grads = {}
    for weight_req in ('write', 'null'):
        exe = out.simple_bind(mx.cpu(0), data=(4, 5),
                              grad_req={'data': 'null', 'w': weight_req, 'b': 'write'})
        for arr in exe.arg_arrays:
            arr[:] = 0.5
        exe.forward(is_train=True)
        exe.backward(mx.nd.ones((4, 3)))
        grads[weight_req] = exe.grad_dict['b'].asnumpy()
    np.testing.assert_array_equal(grads['write'], [4, 4, 4])  # the batch's sum
    np.testing.assert_array_equal(grads['null'], [0, 0, 0])


# -- gradients MXNet cannot compute or place (compat.embedding_ids, compat.lengths_outside_gradient,
# -- compat.tie_parameters,
# -- compat.updates_by_device, compat.read_on) ---------------------------------------------------

def _backward(symbol, grad_req, group2ctx=None, **shapes):
    exe = symbol.simple_bind(mx.cpu(0), group2ctx=group2ctx, grad_req=grad_req, **shapes)
    for array in exe.arg_arrays:
        array[:] = 1
    exe.forward(is_train=True)
    exe.backward([mx.nd.ones(o.shape) for o in exe.outputs])
    mx.nd.waitall()
    return exe


@pytest.mark.parametrize('through_an_op', [False, True])
def test_embedding_backward_refuses_a_gradient_for_its_ids(through_an_op):
    """Why balance='time' times a block whose input an Embedding reads
    without the input's gradient (compat.embedding_ids), and why the
    vocabulary-parallel embedding computes its shards' ids outside the
    gradient (compat.ids_outside_gradient): asked for the ids' gradient,
    directly or through the ops that compute them, the backward pass fails."""
    x, w = mx.sym.var('x'), mx.sym.var('w')
    out = mx.sym.Embedding(x - 1 if through_an_op else x, w, input_dim=5, output_dim=4)
    assert compat.embedding_ids(out, ['x']) == {'x'}
    with pytest.raises(mx.base.MXNetError, match="Embedding layer doesn't support calculate "
                                                 'data gradient'):
        _backward(out, {'x': 'write', 'w': 'write'}, x=(2, 3))
    exe = _backward(out, {'x': 'null', 'w': 'write'}, x=(2, 3))
    assert exe.grad_dict['w'].asnumpy().sum() == 2 * 3 * 4  # every looked-up row, once each
    stopped = mx.sym.Embedding(compat.ids_outside_gradient(mx.sym, x - 1), w, input_dim=5,
                               output_dim=4)
    _backward(stopped, {'x': 'write', 'w': 'write'}, x=(2, 3))


def _softmax_by_length_gradients(symbol, length_req):
    """The gradient of ``x`` (and the lengths after the pass) of ``symbol``
    (reading variables ``x``, ``lengths`` and ``w``), its lengths' gradient
    asked for as ``length_req``."""
    rng = np.random.default_rng(0)
    x, w = mx.nd.array(rng.normal(size=(2, 5))), mx.nd.array(rng.normal(size=(2, 5)))
    lengths = mx.nd.array([2, 4], dtype='int32')
    grads = {'x': mx.nd.zeros(x.shape), 'lengths': mx.nd.zeros(lengths.shape, dtype='int32')}
    exe = symbol.bind(mx.cpu(0), {'x': x, 'lengths': lengths, 'w': w}, args_grad=grads,
                      grad_req={'x': 'write', 'lengths': length_req, 'w': 'null'})
    exe.forward(is_train=True)
    exe.backward()
    return exe.grad_dict['x'].asnumpy(), exe.arg_dict['lengths'].asnumpy()


def test_softmax_by_length_zeroes_the_lengths_it_reads_when_their_gradient_is_asked_for():
    """Why the stage runtime binds each stage with its lengths outside the
    gradient (compat.lengths_outside_gradient): softmax with ``use_length``,
    asked for the gradient of a length an op computed, writes that gradient
    (zeros) where the length is and reads the lengths back as 0, so the
    scores get no gradient at all. A length read from a variable keeps its
    storage; asked for no gradient, the backward is right."""
    x, lengths, w = mx.sym.var('x'), mx.sym.var('lengths'), mx.sym.var('w')

    def scores(computed):
        length = mx.sym.reshape(lengths, shape=(-1,)) if computed else lengths
        return mx.sym.make_loss(mx.sym.sum(
            mx.sym.softmax(x, length, axis=-1, use_length=True) * w))

    expected, _ = _softmax_by_length_gradients(scores(True), 'null')
    assert np.abs(expected).sum() > 0
    # the scores past each row's length (2 and 4) get no gradient
    assert expected[0, 2:].tolist() == [0, 0, 0] and expected[1, 4] == 0
    for req in ('write', 'add'):
        zeroed, kept = _softmax_by_length_gradients(scores(True), req)
        np.testing.assert_array_equal(zeroed, np.zeros_like(expected))
        np.testing.assert_array_equal(kept, [2, 4])  # the variable: its own storage
        from_variable, _ = _softmax_by_length_gradients(scores(False), req)
        np.testing.assert_allclose(from_variable, expected, rtol=1e-6)
        stopped = compat.lengths_outside_gradient(PlacedGraph.from_symbol(scores(True)))
        stopped = stopped.to_symbol()
        assert stopped.list_arguments() == scores(True).list_arguments()
        fixed, _ = _softmax_by_length_gradients(stopped, req)
        np.testing.assert_allclose(fixed, expected, rtol=1e-6)
    plain = mx.sym.softmax(x, axis=-1)
    placed = PlacedGraph.from_symbol(plain)
    assert compat.lengths_outside_gradient(placed) is placed  # nothing to stop


def _read_by_two_groups(through):
    """``sum(fc_a(x) + fc_b(x))``: the variable ``x`` of group a read by ops
    of groups a and b (``through``: how they read it)."""
    with mx.AttrScope(ctx_group='a'):
        x = mx.sym.var('x')
        source = through(x)
    outs = []
    for group in ('a', 'b'):
        with mx.AttrScope(ctx_group=group):
            outs.append(mx.sym.FullyConnected(source, mx.sym.var('w' + group), num_hidden=2,
                                              no_bias=True, name='fc' + group))
    with mx.AttrScope(ctx_group='a'):
        return mx.sym.MakeLoss(mx.sym.sum(outs[0] + outs[1]))


def test_a_variable_read_by_two_groups_cannot_save_its_summed_gradient():
    """Why a tied weight, and a tensor-parallel layer's input, is read by
    the other groups through one identity in its own group
    (passes.tie_parameters on the graph, compat.read_in_own_group while
    tracing): MXNet sums the variable's gradients on one reader's device and
    then refuses to save the sum to the variable's device. Through the
    identity the bind succeeds and the gradient is the sum of both uses."""
    group2ctx = {'a': mx.cpu(0), 'b': mx.cpu(1)}
    req = {'x': 'write', 'wa': 'write', 'wb': 'write'}
    plain = _read_by_two_groups(lambda x: x)
    with pytest.raises(RuntimeError, match='Trying to save gradient to cpu'):
        _backward(plain, req, group2ctx, x=(4, 3))
    tied = passes.tie_parameters(PlacedGraph.from_symbol(plain)).to_symbol()
    traced = _read_by_two_groups(lambda x: compat.read_in_own_group(mx.sym, x))
    for symbol in (tied, traced):
        exe = _backward(symbol, req, group2ctx, x=(4, 3))
        # d/dx sum(x wa^T + x wb^T) with every weight 1: 2 + 2 per element
        np.testing.assert_array_equal(exe.grad_dict['x'].asnumpy(), np.full((4, 3), 4.0))
        assert exe.grad_dict['x'].context == mx.cpu(0)


_FUSED_UPDATE_PROBE = """
import json, sys
import mxnet as mx
from mp_symbolic.core.base.compat import updates_by_device
from mp_symbolic.tools.trace import load_trace, op_intervals
weights = [mx.nd.ones((3,), ctx=mx.cpu(i)) for i in (0, 1)]
grads = [mx.nd.ones((3,), ctx=mx.cpu(i)) for i in (0, 1)]
updater = mx.optimizer.get_updater(mx.optimizer.SGD(learning_rate=0.5, momentum=0.9))
updater([0, 1], grads, weights)  # the states are made, untraced
mx.nd.waitall()
mx.profiler.set_config(profile_imperative=True, filename=sys.argv[1])
mx.profiler.set_state('run')
updater([0, 1], grads, weights)  # together
mx.nd.waitall()
for part in updates_by_device([0, 1], grads, weights):  # split
    updater(*part)
mx.nd.waitall()
mx.profiler.set_state('stop')
mx.profiler.dump()
ops = sorted((start, end, device, name)
             for device, v in op_intervals(load_trace(sys.argv[1])).items()
             for start, end, name in v)
# the first op is the update of both together; the rest started after it ended
seen = {'together': [ops[0][2:]],
        'split': sorted(op[2:] for op in ops[1:] if op[0] >= ops[0][1])}
seen['weights'] = [w.asnumpy().tolist() for w in weights]
print(json.dumps(seen))
"""


def test_the_updater_fuses_the_updates_of_two_devices_into_one_op_on_one_device(tmp_path):
    """Why each optimizer call gets one device's arrays
    (compat.updates_by_device, in PerDeviceUpdater and Trainer): handed the
    weights of cpu(0) and cpu(1) together, MXNet's Updater runs one
    multi_sgd_mom_update on cpu(0) over both (the values come out right only
    because the cpu(i) share one memory); split, one op on each device. In
    a child process: the profiler is the process's."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    import os  # pylint: disable=import-outside-toplevel
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, '-c', _FUSED_UPDATE_PROBE,
                           str(tmp_path / 'trace.json')], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen['together'] == [['cpu/0', 'multi_sgd_mom_update']]
    assert seen['split'] == [['cpu/0', 'multi_sgd_mom_update'], ['cpu/1', 'multi_sgd_mom_update']]
    # on CPU the values are right either way: three momentum steps (lr 0.5,
    # momentum 0.9, gradient 1) of 0.5, 0.95 and 1.355 from 1
    np.testing.assert_allclose(seen['weights'], [[-1.805] * 3] * 2, rtol=1e-6)


def test_a_gluon_parameter_refuses_to_be_read_on_a_device_it_does_not_live_on():
    """Why the imperative twin reads a tied weight through compat.read_on:
    Parameter.data(ctx) refuses every device but its own, and a block reads
    its parameters on its input's device. Within read_on the parameter reads
    a copy on the reading device, and afterwards it is as it was."""
    param = gluon.Parameter('w', shape=(2,))
    param.initialize(mx.init.One(), ctx=mx.cpu(0))
    with pytest.raises(RuntimeError, match='was not initialized on context cpu.1.'):
        param.data(mx.cpu(1))
    with compat.read_on([(param, mx.cpu(0))], mx.cpu(1)):
        assert param.data(mx.cpu(1)).context == mx.cpu(1)
        np.testing.assert_array_equal(param.data(mx.cpu(1)).asnumpy(), [1, 1])
    assert param.list_ctx() == [mx.cpu(0)]
    with pytest.raises(RuntimeError, match='was not initialized on context cpu.1.'):
        param.data(mx.cpu(1))


def test_a_device_kvstore_keeps_every_keys_optimizer_state_on_one_device():
    """Why Trainer leaves the update to each device when parameters live on
    different devices (compat.kvstore_may_update): a 'device' kvstore that
    runs the optimizer keeps the state of keys pushed from cpu(1) and from
    cpu(2) both on one other device (cpu_pinned(0) on CPU), not beside them."""
    kv = mx.kv.create('device')
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    for key, device in ((0, mx.cpu(1)), (1, mx.cpu(2))):
        kv.init(key, mx.nd.zeros((4,), ctx=device))
        kv.push(key, [mx.nd.ones((4,), ctx=device)])
        kv.pull(key, mx.nd.zeros((4,), ctx=device))
    mx.nd.waitall()
    states = kv._updater.states  # pylint: disable=protected-access
    assert len({state.context for state in states.values()}) == 1
    assert states[0].context not in (mx.cpu(1), mx.cpu(2))
    params = [gluon.Parameter(name, shape=(4,)) for name in ('a', 'b')]
    params[0].initialize(ctx=mx.cpu(1))
    params[1].initialize(ctx=mx.cpu(2))
    assert not compat.kvstore_may_update(params)
    assert compat.kvstore_may_update(params[:1])


def test_a_gluon_parameter_says_it_has_no_values_only_by_raising_runtime_error():
    """``compat.initialized`` reads ``list_ctx()``'s ``RuntimeError`` as "not
    initialised"; a parameter whose initialisation waits for its shape
    (deferred) lists the devices it will be made on."""
    from mxnet import gluon  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.base.compat import initialized  # pylint: disable=import-outside-toplevel
    param = gluon.Parameter('p', shape=(2, 3))
    with pytest.raises(RuntimeError):
        param.list_ctx()
    assert not initialized(param)
    deferred = gluon.nn.Dense(4)
    deferred.initialize(ctx=mx.cpu(1))
    assert deferred.weight.list_ctx() == [mx.cpu(1)] and initialized(deferred.weight)
    param.initialize()
    assert initialized(param) and param.list_ctx() == [mx.cpu(0)]


def test_an_inference_bind_keeps_the_fully_connected_weights_of_its_first_forward():
    """Why verification binds each perturbed reference afresh
    (``export.verify.OneDeviceReference.sensitivity``): an executor bound for
    inference (no gradients) runs MXNet's oneDNN subgraph, whose
    FullyConnected keeps the weights it read on its first forward; new
    values written into its arrays afterwards, in place or by
    ``copy_params_from``, change nothing. A training bind reads them anew."""
    if not compat.onednn_active():
        pytest.skip('oneDNN is off in this process or this build')
    x = mx.sym.var('data')
    fc = mx.sym.FullyConnected(x, num_hidden=4, name='fc')
    rng = np.random.RandomState(0)
    values = {'data': rng.rand(3, 5), 'fc_weight': rng.rand(4, 5), 'fc_bias': rng.rand(4)}

    def outputs(grad_req):
        exe = fc.simple_bind(mx.cpu(0), data=(3, 5), grad_req=grad_req)
        for name, value in values.items():
            exe.arg_dict[name][:] = value
        first = exe.forward(is_train=False)[0].asnumpy()
        exe.arg_dict['fc_weight'][:] = 2 * values['fc_weight']
        return first, exe.forward(is_train=False)[0].asnumpy()

    with environ(MXNET_SUBGRAPH_VERBOSE='0'):
        first, second = outputs('null')
        np.testing.assert_array_equal(second, first)  # the new weights are not read
        first, second = outputs('write')
    expected = values['data'] @ (2 * values['fc_weight']).T + values['fc_bias']
    np.testing.assert_allclose(second, expected, rtol=1e-5)


# one child; each bind in a fork of it, before any op (MXNet reads
# MXNET_MKLDNN_ENABLED once, at the first); argv: one JSON list of variants
_DECONVOLUTION_PROBE = """
import json, os, sys
variants = json.loads(sys.argv[1])
import mxnet as mx
import numpy as np
for name, env, c_in, c_out, side, shared in variants:
    pid = os.fork()
    if pid == 0:
        os.environ.update(env)
        x = mx.sym.split(mx.sym.var('data'), num_outputs=2, axis=0)
        w = mx.sym.var('w')
        outs = [mx.sym.Deconvolution(x[m], weight=w if shared else mx.sym.var('w%d' % m),
                                     kernel=(4, 4), stride=(2, 2), pad=(1, 1),
                                     num_filter=c_out, no_bias=True) for m in range(2)]
        loss = mx.sym.MakeLoss(mx.sym.sum(mx.sym.square(mx.sym.concat(*outs, dim=0))))
        exe = loss.simple_bind(mx.cpu(0), data=(2, c_in, side, side))
        for array in exe.arg_dict.values():
            array[:] = 0.1
        exe.forward(is_train=True)
        exe.backward()
        print(name, 'gradient', float(exe.grad_dict['w' if shared else 'w0'].asnumpy().sum()),
              flush=True)
        os._exit(0)
    print(name, 'exit status', os.waitpid(pid, 0)[1], flush=True)
"""


@pytest.mark.slow
def test_deconvolution_backward_writes_an_unallocated_weight_gradient_through_a_null_pointer():
    """compat.unallocated_weight_gradients: two Deconvolutions reading one
    weight (the copies of one op per micro-batch) each write a gradient of
    it into an intermediate array; oneDNN's backward writes that gradient
    through a null pointer when nothing wrote the array's storage before,
    and the process dies of a segmentation fault, no error given. Without
    storage sharing (the split bind's NNVM_EXEC_MATCH_RANGE=0) that is
    every such gradient; with MXNet's sharing, one device, it is a
    gradient larger than any array freed before it. Each op with a weight
    of its own, or oneDNN off, runs."""
    import json  # pylint: disable=import-outside-toplevel
    import os  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    if not compat.onednn_active():
        pytest.skip('oneDNN is off in this process or this build')
    unshared = dict(compat.UNSHARED_MEMORY)
    variants = [('unshared', unshared, 8, 8, 8, True),
                ('unshared-own-weights', unshared, 8, 8, 8, False),
                ('unshared-onednn-off', dict(unshared, MXNET_MKLDNN_ENABLED='0'), 8, 8, 8, True),
                ('shared', {}, 8, 8, 8, True),
                ('shared-large-weight', {}, 64, 64, 2, True)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, '-c', _DECONVOLUTION_PROBE, json.dumps(variants)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    status = {line.split()[0]: int(line.split()[-1]) for line in proc.stdout.splitlines()
              if ' exit status ' in line}
    ran = {line.split()[0] for line in proc.stdout.splitlines() if ' gradient ' in line}
    assert set(status) == {v[0] for v in variants}
    # MXNet's own handler of SIGSEGV says so and exits with status 255
    died = {name for name, code in status.items() if code}
    assert died == {'unshared', 'shared-large-weight'}
    assert proc.stderr.count('Segmentation fault: 11') == len(died)
    assert ran == {'unshared-own-weights', 'unshared-onednn-off', 'shared'}


def test_an_inference_deconvolution_keeps_its_weight_array_in_a_onednn_layout():
    """compat.write_into: bound for inference, oneDNN's Deconvolution
    reorders its weight array itself into a blocked layout after its first
    forward pass; writing into the array with ``[:]`` then fails, a copy
    writes the value (read back, and computed with by a new bind)."""
    if not compat.onednn_active():
        pytest.skip('oneDNN is off in this process or this build')
    up = mx.sym.Deconvolution(mx.sym.var('data'), weight=mx.sym.var('w'), kernel=(4, 4),
                              stride=(2, 2), pad=(1, 1), num_filter=16, no_bias=True)
    value = np.random.default_rng(0).normal(size=(16, 16, 4, 4)).astype(np.float32)
    args = {'data': mx.nd.ones((1, 16, 8, 8)), 'w': mx.nd.array(value)}
    exe = up.bind(mx.cpu(0), args=args, grad_req='null')
    exe.forward(is_train=False)
    first = exe.outputs[0].asnumpy()
    with pytest.raises(mx.base.MXNetError, match=r"IsMKLDNNData\(\): We can't generate TBlob"):
        args['w'][:] = value * 2
    compat.write_into(args['w'], value * 2)
    np.testing.assert_array_equal(args['w'].asnumpy(), value * 2)
    exe = up.bind(mx.cpu(0), args=args, grad_req='null')
    exe.forward(is_train=False)
    np.testing.assert_allclose(exe.outputs[0].asnumpy(), first * 2, rtol=1e-5, atol=1e-5)


def test_mxnet_loads_scikit_learn_as_it_loads_itself():
    """Why the commands turn that import away (tools/startup.py): this
    process loaded MXNet with nothing turned away, and scikit-learn came
    with it, for the legacy FeedForward's base class alone."""
    assert 'sklearn' in sys.modules
    assert mx.model.BASE_ESTIMATOR.__module__ == 'sklearn.base'


_COMMAND_THEN_SKLEARN = """
import runpy, sys
import mp_symbolic.tools.interrupts as interrupts  # the standard library's modules only
interrupts.end_process = sys.exit  # the command ends, and this process goes on
sys.argv = ['mp_symbolic'] + sys.argv[1:]
try:
    runpy.run_module('mp_symbolic', run_name='__main__', alter_sys=True)
except SystemExit as stop:
    status = stop.code
import mxnet
loaded = 'sklearn' in sys.modules
from sklearn.datasets import load_digits
print(status, loaded, mxnet.model.BASE_ESTIMATOR.__name__, load_digits().data.shape[0])
"""


@pytest.mark.slow
def test_a_command_loads_mxnet_without_scikit_learn_and_a_task_still_imports_it():
    done = subprocess.run([sys.executable, '-c', _COMMAND_THEN_SKLEARN, 'plan', '--task',
                           'regression', '--devices', 'cpu:0,cpu:1'], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-4:] == ['0', 'False', 'object', '1797'], done.stdout[-2000:]


@pytest.mark.slow
def test_binding_and_training_over_devices_never_add_or_remove_an_environment_entry():
    """MXNet's engine threads call ``getenv`` inside operators (LayerNorm at
    every call) while the Python thread binds the next graph: adding or
    removing an entry reallocates or shifts the C library's environment array
    under that read, so the library's variables get their entries at import
    and are only given values afterwards."""
    code = (
        "import os\n"
        "HELD = ('MXNET_SUBGRAPH_BACKEND', 'NNVM_EXEC_MATCH_RANGE',\n"
        "        'NNVM_AUTO_SEARCH_MATCH_RANGE', 'MXNET_UPDATE_ON_KVSTORE')\n"
        "for key in HELD:\n"
        "    os.environ.pop(key, None)\n"
        "import mxnet as mx\n"
        "import numpy as np\n"
        "from mxnet.gluon import nn\n"
        "from mp_symbolic import Pipeline\n"
        "changed = []\n"
        "put, unset = os.putenv, os.unsetenv\n"
        "def spy_put(key, value):\n"
        "    if key not in os.environ._data:\n"
        "        changed.append(('added', key))\n"
        "    put(key, value)\n"
        "def spy_unset(key):\n"
        "    changed.append(('removed', key))\n"
        "    unset(key)\n"
        "os.putenv, os.unsetenv = spy_put, spy_unset\n"
        "blocks = [nn.HybridSequential() for _ in range(2)]\n"
        "blocks[0].add(nn.Dense(16, activation='relu'), nn.LayerNorm())\n"
        "blocks[1].add(nn.Dense(2))\n"
        "pipe = Pipeline(blocks, 'cpu:0,cpu:1', chunks=2, sample=(16, 4))\n"
        "mod = pipe.module(loss='softmax')\n"
        "X = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)\n"
        "data = mx.io.NDArrayIter(X, (X[:, 0] > 0).astype(np.float32), batch_size=16)\n"
        "mod.fit(data, optimizer='sgd', num_epoch=1, initializer=mx.init.Xavier())\n"
        "print('changed', changed, [os.environ.get(key) for key in HELD])\n")
    job = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=300, check=False, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert job.returncode == 0, job.stderr[-2000:]
    assert "changed [] ['', '', '', '1']" in job.stdout, job.stdout[-2000:]
