"""``mp_symbolic.Trainer``: gluon.Trainer's interface for parameters that
live on different devices."""
import mxnet as mx
from mxnet import autograd, gluon
import numpy as np
import pytest

from mp_symbolic import Pipeline, Trainer
from mp_symbolic.core.optim.optstate import OptimizerStateError
from mp_symbolic.training.tasks import regression

from conftest import THREE_DEVICES


def _placed(devices=THREE_DEVICES, seed=0):
    pipe = Pipeline(regression.build_blocks(), devices)
    mx.random.seed(seed)
    pipe.initialize()
    return pipe


def _step(pipe, trainer, X, y):
    with autograd.record():
        loss = gluon.loss.L2Loss()(pipe(X), y.as_in_context(pipe.plan.last_device))
    loss.backward()
    trainer.step(X.shape[0])
    return loss.mean().asscalar()


def _batch(seed=0):
    X, y = regression.make_dataset(32, seed)
    return mx.nd.array(X), mx.nd.array(y)


def test_steps_parameters_on_three_devices_where_gluon_trainer_refuses():
    pipe = _placed()
    with pytest.raises(AssertionError, match='same set of contexts'):
        gluon.Trainer(pipe.collect_params(), 'sgd', {'learning_rate': 0.1})
    trainer = Trainer(pipe.collect_params(), 'sgd', {'learning_rate': 0.05})
    before = {n: p.data().asnumpy() for n, p in pipe.collect_params().items()}
    losses = [_step(pipe, trainer, *_batch()) for _ in range(20)]
    assert losses[-1] < losses[0] / 3
    for name, param in pipe.collect_params().items():
        assert not np.allclose(param.data().asnumpy(), before[name]), name
        assert param.data().context == param.grad().context
    assert {p.data().context for p in pipe.collect_params().values()} == \
        {mx.cpu(0), mx.cpu(1), mx.cpu(2)}


def test_learning_rate_can_be_read_and_set():
    trainer = Trainer(_placed().collect_params(), 'adam', {'learning_rate': 0.01})
    assert trainer.learning_rate == 0.01
    trainer.set_learning_rate(0.5)
    assert trainer.learning_rate == 0.5 and trainer.optimizer.learning_rate == 0.5


def test_a_stale_gradient_is_reported_as_gluon_does():
    pipe = _placed()
    trainer = Trainer(pipe.collect_params(), 'sgd', {'learning_rate': 0.1})
    _step(pipe, trainer, *_batch())
    with pytest.raises(UserWarning, match='has not been updated by backward since last `step`'):
        trainer.step(32)
    trainer.step(32, ignore_stale_grad=True)


@pytest.mark.parametrize('optimizer, params', [('sgd', {'learning_rate': 0.05, 'momentum': 0.9}),
                                               ('adam', {'learning_rate': 0.01})])
def test_states_saved_on_one_placement_load_onto_another_and_continue_identically(
        tmp_path, optimizer, params):
    """Saved by parameter name, without devices: three steps, save, three
    more, equals three steps, save, load on another plan, three more."""
    reference = _placed(THREE_DEVICES)
    trainer = Trainer(reference.collect_params(), optimizer, dict(params))
    for step in range(3):
        _step(reference, trainer, *_batch(step))
    trainer.save_states(str(tmp_path / 'states.npz'))
    saved = {n: p.data().asnumpy() for n, p in reference.collect_params().items()}
    for step in range(3, 6):
        _step(reference, trainer, *_batch(step))

    moved = _placed('cpu:3,cpu:1')
    moved.set_params(saved)
    other = Trainer(moved.collect_params(), optimizer, dict(params))
    other.load_states(str(tmp_path / 'states.npz'))
    for step in range(3, 6):
        _step(moved, other, *_batch(step))
    for name, param in moved.collect_params().items():
        np.testing.assert_allclose(param.data().asnumpy(),
                                   reference.collect_params()[name].data().asnumpy(),
                                   rtol=1e-6, atol=1e-7, err_msg=name)
    assert moved.blocks[0].weight.list_ctx() == [mx.cpu(3)]


def test_loading_another_optimizers_state_is_refused(tmp_path):
    pipe = _placed()
    trainer = Trainer(pipe.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
    _step(pipe, trainer, *_batch())
    trainer.save_states(str(tmp_path / 's.npz'))
    with pytest.raises(OptimizerStateError, match='expected optimizer state of adam, found '
                                                  'state of sgd'):
        Trainer(pipe.collect_params(), 'adam').load_states(str(tmp_path / 's.npz'))
    (tmp_path / 'bad.npz').write_bytes(b'not a state file')
    with pytest.raises(OptimizerStateError, match='is not a readable optimizer-state file'):
        trainer.load_states(str(tmp_path / 'bad.npz'))


def test_a_parameter_on_two_devices_gets_the_summed_gradient_on_each_copy():
    """Where this class used to refuse a parameter on several devices, it now
    does what gluon.Trainer does: both copies take the gradient of the whole
    batch and stay equal."""
    net = gluon.nn.Dense(2, in_units=2)
    net.initialize(mx.init.One(), ctx=[mx.cpu(0), mx.cpu(1)])
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 1.0})
    with autograd.record():
        losses = [net(mx.nd.ones((1, 2), ctx=ctx)).sum() for ctx in (mx.cpu(0), mx.cpu(1))]
    autograd.backward(losses)
    trainer.step(1)
    for ctx in (mx.cpu(0), mx.cpu(1)):  # each copy's gradient is 1: 1 - 2 and 0 - 2
        np.testing.assert_array_equal(net.weight.data(ctx).asnumpy(), -np.ones((2, 2)))
        np.testing.assert_array_equal(net.bias.data(ctx).asnumpy(), -2 * np.ones(2))
