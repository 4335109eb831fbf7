"""Your own model from Python: a Pipeline's Module checkpointed through the
store and continued on another plan with Gluon's automatic names shifted, and
MXNet's Module contract kept (``bind(force_rebind=True)``)."""
import os

import mxnet as mx
from mxnet import gluon
import numpy as np
import pytest

import mp_symbolic
from mp_symbolic import Pipeline

EPOCHS = 2


def _net():
    # no prefix=: Gluon names these dense<N>_ by a per-process counter
    return [gluon.nn.Dense(16, activation='relu'), gluon.nn.Dense(16, activation='relu'),
            gluon.nn.Dense(3)]


def _data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(96, 5)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.float32) + (X[:, 1] > 0.5)
    return X, y


def _fit(mod, begin, end, seed=0):
    X, y = _data()
    np.random.seed(seed)  # NDArrayIter shuffles with numpy's global generator
    mx.random.seed(seed)
    it = mx.io.NDArrayIter(X, y, batch_size=16, shuffle=True)
    for epoch in range(begin, end):
        np.random.seed(seed + epoch)
        it = mx.io.NDArrayIter(X, y, batch_size=16, shuffle=True)
        mod.fit(it, begin_epoch=epoch, num_epoch=epoch + 1, optimizer='sgd',
                optimizer_params={'learning_rate': 0.1, 'momentum': 0.9},
                initializer=mx.init.Xavier(), force_init=False)
    return mod


def _params(mod):
    arg, aux = mod.get_params()
    return [v.asnumpy() for v in list(arg.values()) + list(aux.values())]


def test_a_checkpoint_continues_on_another_plan_with_other_automatic_names(tmp_path):
    # One set of blocks for the uninterrupted run and the first half: MXNet's
    # Module draws initial values in the order of the parameters' sorted
    # names, so two networks whose names sort differently (dense9_ and
    # dense10_) would start apart.
    blocks = _net()
    mx.random.seed(1)
    whole = _fit(Pipeline(blocks, 'cpu:0,cpu:1,cpu:2', sample=(16, 5)).module(), 0, 2 * EPOCHS)

    mx.random.seed(1)
    first = _fit(Pipeline(blocks, 'cpu:0,cpu:1,cpu:2', sample=(16, 5)).module(), 0, EPOCHS)
    saved = mp_symbolic.save_checkpoint(first, str(tmp_path / 'run'), epoch=EPOCHS)
    assert saved.epoch == EPOCHS and (tmp_path / 'run' / 'current').is_symlink()

    _net()  # moves Gluon's name counter on: the rebuilt network has other names
    pipe = Pipeline(_net(), 'cpu:1,cpu:2', sample=(16, 5))
    mod = pipe.module()
    names = {p.name for p in pipe.collect_params().values()}
    assert not names & set(first.get_params()[0])
    checkpoint = mp_symbolic.read_checkpoint(str(tmp_path / 'run'))
    mod.restore(checkpoint)
    _fit(mod, checkpoint.epoch, 2 * EPOCHS)

    for a, b in zip(_params(whole), _params(mod)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    arg, _ = mod.get_params()
    for name in arg:
        assert name in names


def test_a_saved_module_exports_from_its_folder(tmp_path):
    from export.exporter import export_checkpoint  # pylint: disable=import-outside-toplevel
    mod = _fit(Pipeline(_net(), 'cpu:0,cpu:1', sample=(16, 5)).module(), 0, 1)
    mp_symbolic.save_checkpoint(mod, str(tmp_path / 'run'), epoch=1, name='mlp')
    paths, report = export_checkpoint(str(tmp_path / 'run'), str(tmp_path / 'export'),
                                      log=lambda line: None)
    assert report['ok'] and os.path.basename(paths['onnx']) == 'mlp.onnx'


def test_a_checkpoint_of_another_network_is_refused_in_one_line(tmp_path):
    first = _fit(Pipeline(_net(), 'cpu:0,cpu:1', sample=(16, 5)).module(), 0, 1)
    mp_symbolic.save_checkpoint(first, str(tmp_path / 'run'), epoch=1)
    other = Pipeline([gluon.nn.Dense(16, activation='relu'), gluon.nn.Dense(3)], 'cpu:0',
                     sample=(16, 5)).module()
    with pytest.raises(ValueError, match=r'^checkpoint: expected the 4 parameters of this '
                                         r'network, found 6'):
        other.restore(mp_symbolic.read_checkpoint(str(tmp_path / 'run')))


def test_save_checkpoint_refuses_an_unbound_module(tmp_path):
    mod = Pipeline(_net(), 'cpu:0,cpu:1', sample=(16, 5)).module()
    with pytest.raises(ValueError, match='^module: expected it bound with parameters'):
        mp_symbolic.save_checkpoint(mod, str(tmp_path / 'run'), epoch=1)
    assert not (tmp_path / 'run').exists()


def _step(mod, X, y):
    mod.forward(mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)]), is_train=True)
    mod.backward()
    mod.update()


@pytest.mark.parametrize('make', ['pipeline', 'plain'])
def test_update_after_force_rebind_changes_the_new_executors_weights(make):
    """``bind(force_rebind=True)`` makes a new executor group: the update that
    follows must change its weights, as plain ``mx.mod.Module``'s does."""
    X, y = _data()
    pipe = Pipeline(_net(), 'cpu:0,cpu:1', sample=(16, 5))
    if make == 'pipeline':
        mod = pipe.module()
    else:
        mod = mx.mod.Module(pipe.training_symbol('softmax'), context=mx.cpu(0))
    mod.bind([('data', (16, 5))], [('softmax_label', (16,))])
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(kvstore=None, optimizer='sgd', optimizer_params={'learning_rate': 0.5})
    _step(mod, X[:16], y[:16])
    mod.bind([('data', (32, 5))], [('softmax_label', (32,))], force_rebind=True)
    before = _params(mod)
    _step(mod, X[:32], y[:32])
    changed = [not np.array_equal(a, b) for a, b in zip(before, _params(mod))]
    assert all(changed), changed
