"""MXNet 1.9.1's own behaviour that model parallelism has to work around.
Each test documents a trap; if one starts failing, MXNet changed."""
import mxnet as mx
from mxnet import autograd, gluon
import numpy as np
import pytest

from mp_symbolic import Pipeline
from mp_symbolic.training.tasks import regression

from conftest import THREE_DEVICES


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


# -- the behaviours mp_symbolic.core.compat works around ---------------------------------------
# (oneDNN's subgraph fusion across ctx_group is pinned in test_load_model.py:
# test_split_bind_without_the_onednn_workaround_fails_on_the_digits_cnn)

def _module_update_on_kvstore(env):
    import os  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.scoped import environ  # pylint: disable=import-outside-toplevel
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


def test_profiler_aborts_past_its_device_rows(tmp_path):
    """compat.profiler_cpu_limit: an op on cpu(N), N >= cores + 2, recorded by
    the profiler, aborts the whole process."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.compat import profiler_cpu_limit  # pylint: disable=import-outside-toplevel
    code = ('import mxnet as mx\n'
            'mx.profiler.set_config(profile_all=True, filename=%r)\n'
            'mx.profiler.set_state("run")\n'
            'x = mx.nd.ones((2,), ctx=mx.cpu(%d)) * 2\n'
            'mx.nd.waitall()\nmx.profiler.set_state("stop")\nprint("survived")\n')
    below = subprocess.run([sys.executable, '-c', code % (str(tmp_path / 'a.json'),
                                                          profiler_cpu_limit() - 1)],
                           capture_output=True, text=True, timeout=120)
    past = subprocess.run([sys.executable, '-c', code % (str(tmp_path / 'b.json'),
                                                         profiler_cpu_limit())],
                          capture_output=True, text=True, timeout=120)
    assert below.returncode == 0 and 'survived' in below.stdout
    assert past.returncode != 0 and 'survived' not in past.stdout
