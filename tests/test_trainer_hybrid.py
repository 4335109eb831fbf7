"""``mp_symbolic.Trainer`` on hybrid placements: a Pipeline's imperative twin
with replicas (each parameter on one device per replica) and with chunks,
tied to one replica, to one chunk and to the symbolic twin (PipelineModule);
and from several processes with dist_sync."""
import importlib.util
import os
import re
import subprocess
import sys

import mxnet as mx
from mxnet import autograd, gluon
import numpy as np
import pytest

from mp_symbolic import Pipeline, Trainer
from mp_symbolic.training.tasks import regression

FOUR = 'cpu:0,cpu:1,cpu:2,cpu:3'
TWO = 'cpu:0,cpu:1'
MOMENTUM = {'learning_rate': 0.1, 'momentum': 0.9}
BATCH = 32
TOL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, 'examples', 'gluon_dist_sync.py')


def _batch(step):
    X, y = regression.make_dataset(BATCH, seed=step)
    return mx.nd.array(X), mx.nd.array(y)


def _reference_params():
    pipe = Pipeline(regression.build_blocks(), TWO)
    mx.random.seed(0)
    pipe.initialize()
    return pipe.get_params()


def _pipe(devices, replicas=1, chunks=1):
    pipe = Pipeline(regression.build_blocks(), devices, replicas=replicas, chunks=chunks)
    pipe.initialize()  # random values, replaced by the shared start
    pipe.set_params(*_reference_params())
    return pipe


def _step(pipe, trainer, X, y):
    with autograd.record():
        out = pipe(X)
        loss = gluon.loss.L2Loss()(out, y.as_in_context(out.context))
    loss.backward()
    trainer.step(X.shape[0])
    return out


def _train(pipe, steps=range(3), **trainer_kwargs):
    trainer = Trainer(pipe.collect_params(), 'sgd', dict(MOMENTUM), **trainer_kwargs)
    for step in steps:
        _step(pipe, trainer, *_batch(step))
    return trainer


def _values(pipe):
    """Every copy of every parameter: ``{name: [numpy array per copy]}``."""
    return {n: [a.asnumpy() for a in p.list_data()] for n, p in pipe.collect_params().items()}


def _assert_close(values, reference):
    assert set(values) == set(reference)
    for name, copies in values.items():
        for copy in copies:
            np.testing.assert_allclose(copy, reference[name][0], rtol=TOL, atol=TOL,
                                       err_msg=name)


@pytest.mark.parametrize('kvstore', ['local', 'device'])
def test_two_replicas_on_four_devices_equal_one_replica_after_three_momentum_steps(kvstore):
    one = _pipe(TWO)
    _train(one)
    two = _pipe(FOUR, replicas=2)
    trainer = _train(two, kvstore=kvstore)
    assert trainer.kvstore.type == kvstore
    assert trainer._update_on_kvstore is False  # pylint: disable=protected-access
    _assert_close(_values(two), _values(one))
    for stage, param in two._params_of_stage():  # pylint: disable=protected-access
        assert param.list_ctx() == [mx.cpu(stage), mx.cpu(2 + stage)]
        first, second = param.list_data()
        np.testing.assert_array_equal(first.asnumpy(), second.asnumpy(), err_msg=param.name)
        assert param.list_grad()[1].context == mx.cpu(2 + stage)


@pytest.mark.parametrize('kvstore', ['local', 'device'])
def test_updating_on_the_kvstore_gives_what_updating_each_copy_gives(kvstore):
    local = _pipe(FOUR, replicas=2)
    _train(local, kvstore=kvstore, update_on_kvstore=False)
    on_kvstore = _pipe(FOUR, replicas=2)
    trainer = _train(on_kvstore, kvstore=kvstore, update_on_kvstore=True)
    assert trainer._update_on_kvstore is True  # pylint: disable=protected-access
    _assert_close(_values(on_kvstore), _values(local))


def test_allreduce_grads_then_update_equals_step():
    stepped = _pipe(FOUR, replicas=2)
    _train(stepped)
    pipe = _pipe(FOUR, replicas=2)
    trainer = Trainer(pipe.collect_params(), 'sgd', dict(MOMENTUM))
    for step in range(3):
        X, y = _batch(step)
        with autograd.record():
            out = pipe(X)
            loss = gluon.loss.L2Loss()(out, y.as_in_context(out.context))
        loss.backward()
        trainer.allreduce_grads()
        for param in pipe.collect_params().values():  # both copies hold the summed gradient
            first, second = (g.asnumpy() for g in param.list_grad())
            np.testing.assert_array_equal(first, second, err_msg=param.name)
        trainer.update(BATCH)
    _assert_close(_values(pipe), _values(stepped))


def test_the_lr_scheduler_counts_one_update_per_step_on_any_placement():
    """Per-device updaters each count their own updates; the schedule must
    still advance once per step, as gluon.Trainer's does on one device."""
    def learning_rates(pipe, trainer_class):
        schedule = mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.1)
        trainer = trainer_class(pipe.collect_params(), 'sgd',
                                {'learning_rate': 0.1, 'lr_scheduler': schedule})
        rates = []
        for step in range(6):
            _step(pipe, trainer, *_batch(step))
            rates.append(trainer.learning_rate)
        return rates
    expected = learning_rates(_pipe('cpu:0'), gluon.Trainer)
    assert expected == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025]
    assert learning_rates(_pipe(FOUR, replicas=2), Trainer) == expected
    assert learning_rates(_pipe('cpu:2,cpu:0'), Trainer) == expected


def test_row_sparse_gradients_of_a_replicated_embedding_match_dense_ones():
    def run(sparse_grad):
        embed = gluon.nn.Embedding(10, 3, sparse_grad=sparse_grad, prefix='embed_')
        dense = gluon.nn.Dense(1, in_units=6, prefix='dense_')
        pipe = Pipeline([embed, gluon.nn.Flatten(), dense], FOUR, replicas=2, balance=[1, 2])
        mx.random.seed(0)
        pipe.initialize()
        # no momentum: SGD's lazy update skips the momentum of rows not in a batch
        trainer = Trainer(pipe.collect_params(), 'sgd', {'learning_rate': 0.1})
        for step in range(3):
            X = mx.nd.array(np.random.RandomState(step).randint(0, 10, (8, 2)))
            with autograd.record():
                loss = pipe(X).sum()
            loss.backward()
            trainer.step(8)
        return pipe
    sparse, dense = run(True), run(False)
    assert sparse.blocks[0].weight.list_grad()[0].stype == 'row_sparse'
    assert sparse.blocks[0].weight.list_ctx() == [mx.cpu(0), mx.cpu(2)]
    _assert_close(_values(sparse), _values(dense))


def test_replicas_return_the_whole_batch_on_the_last_stage_of_the_first_replica():
    one, two = _pipe(TWO), _pipe(FOUR, replicas=2)
    X, _ = _batch(0)
    out = two(X)
    assert out.context == mx.cpu(1) and out.shape == (BATCH, 1)
    np.testing.assert_allclose(out.asnumpy(), one(X).asnumpy(), rtol=TOL, atol=TOL)


def test_every_update_runs_on_one_device_and_state_stays_beside_its_copy():
    pipe = _pipe(FOUR, replicas=2)
    trainer = Trainer(pipe.collect_params(), 'adam', {'learning_rate': 0.01})
    calls, update = [], trainer.optimizer.update_multi_precision

    def recording(index, weight, grad, state):
        calls.append({w.context for w in (weight if isinstance(weight, list) else [weight])})
        return update(index, weight, grad, state)
    trainer.optimizer.update_multi_precision = recording
    _step(pipe, trainer, *_batch(0))
    assert calls and all(len(devices) == 1 for devices in calls), calls
    assert set().union(*calls) == {mx.cpu(i) for i in range(4)}
    # pylint: disable=protected-access
    for ctx, updater in zip(trainer._contexts, trainer._updaters):
        for index, (mean, var) in updater.states.items():
            assert ctx in trainer._params[index].list_ctx()
            assert mean.context == var.context == ctx


@pytest.mark.parametrize('replicas, devices', [(1, TWO), (2, FOUR)])
def test_chunks_in_the_imperative_twin_equal_the_symbolic_twin_and_one_chunk(replicas, devices):
    """Four micro-batches imperatively, four in the PipelineModule's graph,
    and one chunk imperatively: the same parameters after three steps."""
    imperative = _pipe(devices, replicas=replicas, chunks=4)
    X, _ = _batch(0)
    np.testing.assert_allclose(imperative(X).asnumpy(), _pipe(TWO)(X).asnumpy(),
                               rtol=TOL, atol=TOL)
    _train(imperative, kvstore='device')
    one_chunk = _pipe(devices, replicas=replicas)
    _train(one_chunk, kvstore='device')

    symbolic = Pipeline(regression.build_blocks(), devices, replicas=replicas, chunks=4)
    mod = symbolic.module(loss='l2')
    mod.bind(data_shapes=[('data', (BATCH, 2))], label_shapes=[('softmax_label', (BATCH, 1))])
    arg_params, aux_params = _reference_params()
    mod.init_params(arg_params=arg_params, aux_params=aux_params)
    mod.init_optimizer(kvstore='device', optimizer='sgd', optimizer_params=dict(MOMENTUM))
    for step in range(3):
        X, y = _batch(step)
        mod.forward_backward(mx.io.DataBatch([X], [y]))
        mod.update()
    module_values = {n: [v.asnumpy()] for n, v in mod.get_params()[0].items()}

    _assert_close(_values(imperative), module_values)
    _assert_close(_values(one_chunk), module_values)


def test_a_batch_that_does_not_split_into_replicas_and_chunks_is_refused():
    pipe = _pipe(FOUR, replicas=2, chunks=3)
    with pytest.raises(ValueError, match=r'expected a multiple of chunks x replicas '
                                         r'\(3 x 2 = 6\), found 32'):
        pipe(_batch(0)[0])


@pytest.mark.parametrize('target, saved_on_kvstore, loaded_on_kvstore', [
    ((TWO, 1), None, None), (('cpu:3,cpu:2', 1), None, None),
    (('cpu:2,cpu:3,cpu:0,cpu:1', 2), None, None), ((TWO, 1), True, None),
    (('cpu:2,cpu:3,cpu:0,cpu:1', 2), None, True)])
def test_states_saved_on_two_replicas_load_onto_another_placement_and_continue_identically(
        tmp_path, target, saved_on_kvstore, loaded_on_kvstore):
    """Three steps, save, three more on two replicas equals three steps, save,
    load on another placement (one replica, or the replicas' devices swapped),
    three more there; also to and from the state a kvstore keeps
    (update_on_kvstore=True)."""
    reference = _pipe(FOUR, replicas=2)
    trainer = _train(reference, update_on_kvstore=saved_on_kvstore)
    trainer.save_states(str(tmp_path / 'states.npz'))
    saved = reference.get_params()
    for step in range(3, 6):
        _step(reference, trainer, *_batch(step))

    devices, replicas = target
    moved = _pipe(devices, replicas=replicas)
    moved.set_params(*saved)
    other = Trainer(moved.collect_params(), 'sgd', dict(MOMENTUM),
                    update_on_kvstore=loaded_on_kvstore)
    other.load_states(str(tmp_path / 'states.npz'))
    for step in range(3, 6):
        _step(moved, other, *_batch(step))
    _assert_close(_values(moved), _values(reference))
    assert moved.blocks[0].weight.list_ctx() == \
        [devices_[0] for devices_ in moved.plan.replica_devices]


def test_a_stale_gradient_on_one_replica_is_reported():
    pipe = _pipe(FOUR, replicas=2)
    trainer = _train(pipe, steps=[0])
    with autograd.record():  # only replica 1 (cpu(2), cpu(3)) takes part
        h = pipe.blocks[0](_batch(1)[0].as_in_context(mx.cpu(2))).as_in_context(mx.cpu(3))
        loss = pipe.blocks[2](pipe.blocks[1](h)).sum()
    loss.backward()
    with pytest.raises(UserWarning, match=r'Parameter `layer0_bias` on context cpu\(0\) has '
                                          r'not been updated by backward'):
        trainer.step(BATCH)
    before = _values(pipe)
    trainer.step(BATCH, ignore_stale_grad=True)  # skips the stale copies only, as Gluon
    after = _values(pipe)
    for name in before:
        np.testing.assert_array_equal(after[name][0], before[name][0], err_msg=name)
        assert not np.array_equal(after[name][1], before[name][1]), name


def test_a_stale_gradient_is_reported_also_when_the_kvstore_updates():
    """gluon.Trainer leaves the fresh-gradient flags set when the kvstore runs
    the optimizer, so its check never fires again; this one does."""
    net = gluon.nn.Dense(1, in_units=2)
    net.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    trainer = Trainer(net.collect_params(), 'sgd', kvstore='local', update_on_kvstore=True)
    with autograd.record():
        losses = [net(mx.nd.ones((1, 2), ctx=c)).sum() for c in (mx.cpu(0), mx.cpu(1))]
    autograd.backward(losses)
    trainer.step(2)
    assert trainer._update_on_kvstore  # pylint: disable=protected-access
    with pytest.raises(UserWarning, match='has not been updated by backward since last `step`'):
        trainer.step(2)


def test_no_kvstore_for_copies_is_refused():
    with pytest.raises(ValueError, match=r'kvstore: expected one .* copies of layer0_bias '
                                         r'\(on cpu\(0\), cpu\(2\)\), found None'):
        Trainer(_pipe(FOUR, replicas=2).collect_params(), 'sgd', kvstore=None)


def test_a_model_parallel_pipeline_needs_no_kvstore():
    pipe = _pipe(TWO)
    trainer = _train(pipe, steps=[0])
    assert trainer.kvstore is None
    with pytest.raises(ValueError, match='update_on_kvstore: expected False or None without a '
                                         'kvstore'):
        _train(pipe, steps=[1], update_on_kvstore=True)


def test_two_dist_sync_workers_end_with_the_same_parameters_as_one_process(tmp_path):
    """examples/gluon_dist_sync.py under the launcher: both workers print the
    same digest, and rank 0's parameters equal one process on the whole batch."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    job = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'launch', '--workers', '2',
                          '--servers', '1', '--', EXAMPLE, '--steps', '10',
                          '--save', str(tmp_path / 'dist.params')],
                         capture_output=True, text=True, timeout=120, check=False, env=env,
                         cwd=ROOT)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
    digests = re.findall(r'^\[worker (\d)\] parameters sha256: ([0-9a-f]{64})$', job.stdout,
                         re.M)
    assert sorted(w for w, _ in digests) == ['0', '1']
    assert digests[0][1] == digests[1][1]
    assert 'launch: 2 workers, 1 server: all exited 0' in job.stdout

    spec = importlib.util.spec_from_file_location('gluon_dist_sync', EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    one, _, _ = example.train(steps=10, kvstore='local')
    dist = mx.nd.load(str(tmp_path / 'dist.params'))
    for name, value in one.get_params()[0].items():
        np.testing.assert_allclose(dist[name].asnumpy(), value.asnumpy(), rtol=TOL, atol=TOL,
                                   err_msg=name)
