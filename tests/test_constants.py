"""Gluon's fixed parameters (``grad_req='null'``) stay fixed on every route:
a constant made with ``params.get_constant`` (a hand-made one, and GluonNLP
TransformerEncoder's position table) and a layer frozen with
``collect_params().setattr('grad_req', 'null')`` keep their values bitwise
through training steps, while the other parameters move, and keep no
optimizer state, in the Module (list and whole forms, replicas, micro-batches,
tensor-parallel shards), the bare executor, the imperative twin's Trainer,
``train --task`` with its checkpoints, and resume."""
import os
import re
import subprocess
import sys

import mxnet as mx
from mxnet import gluon
import numpy as np
import pytest

from mp_symbolic import Pipeline, Trainer, read_checkpoint
from mp_symbolic.core.optim.optstate import load_states
from mp_symbolic.core.parallel.tensor_parallel import ColumnParallelDense, RowParallelDense
from mp_symbolic.training.loop import train

from conftest import chain, make_config

BATCH = 8
QUIET = {'log': lambda line: None}


class AddConstant(gluon.HybridBlock):
    """``x + table``, the table a Gluon constant (``params.get_constant``)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.table = self.params.get_constant(
                'table', np.linspace(-1, 1, units, dtype=np.float32).reshape(1, units))

    def hybrid_forward(self, F, x, table):  # pylint: disable=arguments-differ
        return F.broadcast_add(x, table)


class Encoder(gluon.HybridBlock):
    """GluonNLP's TransformerEncoder at tiny sizes, its first output only."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        from gluonnlp.model.transformer import TransformerEncoder  # pylint: disable=import-outside-toplevel
        with self.name_scope():
            self.enc = TransformerEncoder(num_layers=1, units=units, hidden_size=16, num_heads=2,
                                          max_length=6)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.enc(x)[0]  # (batch, length, units)


def _frozen(block):
    block.collect_params().setattr('grad_req', 'null')
    return block


def mlp():
    """A frozen Dense, a hand-made constant, two trained Dense: ``(N, 4) -> (N, 3)``."""
    return [_frozen(gluon.nn.Dense(8, in_units=4, prefix='frozen_')),
            AddConstant(8, prefix='const_'),
            gluon.nn.Dense(8, activation='tanh', in_units=8, prefix='hidden_'),
            gluon.nn.Dense(3, in_units=8, prefix='out_')]


def transformer():
    """A frozen projection, GluonNLP's encoder (position table), a classifier:
    ``(N, 4, 8) -> (N, 3)``."""
    return [_frozen(gluon.nn.Dense(8, flatten=False, in_units=8, prefix='frozen_')),
            Encoder(8, prefix='enc_'), gluon.nn.Dense(3, in_units=32, prefix='out_')]


def tensor_parallel():
    """A frozen column-parallel layer and a trained row-parallel one, then a constant."""
    return [_frozen(ColumnParallelDense(8, 4, 2, activation='relu', prefix='col_')),
            RowParallelDense(8, 8, 2, prefix='row_'), AddConstant(8, prefix='const_'),
            gluon.nn.Dense(3, in_units=8, prefix='out_')]


NETWORKS = {'mlp': (mlp, (4,)), 'transformer': (transformer, (4, 8)),
            'tensor_parallel': (tensor_parallel, (4,))}


def _data(sample_shape, num=BATCH * 2):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(num,) + sample_shape).astype(np.float32)
    return X, rng.integers(0, 3, size=num).astype(np.float32)


def _fixed_and_trained(pipe):
    params = pipe.collect_params()
    fixed = sorted(n for n, p in params.items() if p.grad_req == 'null')
    trained = sorted(n for n, p in params.items() if p.grad_req != 'null')
    return fixed, trained


def _assert_fixed_kept(before, after, fixed, trained):
    assert fixed and trained
    for name in fixed:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    moved = [n for n in trained if not np.array_equal(after[n], before[n])]
    assert moved == trained


def _numpy(values):
    return {k: v.asnumpy() if isinstance(v, mx.nd.NDArray) else v for k, v in values.items()}


def _module_route(pipe, sample_shape, fixed_param_names=()):
    """Two epochs of ``fit`` (SGD with momentum); ``(values before, the module)``."""
    X, y = _data(sample_shape)
    mx.random.seed(0)
    pipe.initialize(mx.init.Xavier())
    before = _numpy(pipe.get_params()[0])
    kwargs = {'fixed_param_names': list(fixed_param_names)} if fixed_param_names else {}
    mod = pipe.module(**kwargs)
    mod.fit(mx.io.NDArrayIter(X, y, batch_size=BATCH), num_epoch=2, optimizer='sgd',
            optimizer_params={'learning_rate': 0.5, 'momentum': 0.9},
            arg_params=pipe.get_params()[0], aux_params=pipe.get_params()[1])
    return before, mod


MODULE_ROUTES = {
    'list': {'devices': 'cpu:0,cpu:1'},
    'whole': {'devices': 'cpu:0,cpu:1', 'whole': True},
    'replicas': {'devices': 'cpu:0,cpu:1,cpu:2,cpu:3', 'replicas': 2},
    'chunks': {'devices': 'cpu:0,cpu:1', 'chunks': 2},
}


@pytest.mark.parametrize('route', sorted(MODULE_ROUTES))
@pytest.mark.parametrize('network', ['mlp', 'transformer'])
def test_module_keeps_constants_and_frozen_layers_fixed_without_state(route, network):
    make, sample_shape = NETWORKS[network]
    options = dict(MODULE_ROUTES[route])
    blocks = make()
    if options.pop('whole', False):
        blocks = chain(blocks, prefix='net_')
    pipe = Pipeline(blocks, options.pop('devices'), sample=(BATCH,) + sample_shape, **options)
    fixed, trained = _fixed_and_trained(pipe)
    before, mod = _module_route(pipe, sample_shape)
    after, states = _numpy(mod.get_params()[0]), mod.optimizer_states()
    _assert_fixed_kept(before, after, fixed, trained)
    assert sorted(states['params']) == trained  # momentum for every trained one, none else


@pytest.mark.parametrize('whole', [False, True])
def test_tensor_parallel_shards_of_a_frozen_layer_stay_fixed_without_state(whole):
    make, sample_shape = NETWORKS['tensor_parallel']
    if whole:  # the first stage's two devices hold both tensor-parallel layers' shards
        pipe = Pipeline(chain(make(), prefix='net_'), 'cpu:0+cpu:1,cpu:2',
                        sample=(BATCH,) + sample_shape)
    else:
        pipe = Pipeline(make(), 'cpu:0,cpu:1+cpu:2', balance=[1, 3],
                        sample=(BATCH,) + sample_shape)
    before, mod = _module_route(pipe, sample_shape)
    after, states = _numpy(mod.get_params()[0]), mod.optimizer_states()
    # by their unsplit names, as the Module gives them out
    fixed = ['col_bias', 'col_weight', 'const_table']
    trained = ['out_bias', 'out_weight', 'row_bias', 'row_weight']
    assert sorted(before) == sorted(fixed + trained)
    _assert_fixed_kept(before, after, fixed, trained)
    assert sorted(states['params']) == trained


def test_fixed_param_names_given_to_module_are_kept_with_the_gluon_ones():
    make, sample_shape = NETWORKS['mlp']
    blocks = make()
    pipe = Pipeline(blocks, 'cpu:0,cpu:1', sample=(BATCH,) + sample_shape)
    fixed, trained = _fixed_and_trained(pipe)
    # trained in Gluon, fixed by the caller (the whole layer: with oneDNN, MXNet 1.9.1's
    # FullyConnected gives its bias a zero gradient when its weight gets none)
    mine = [blocks[2].weight.name, blocks[2].bias.name]
    before, mod = _module_route(pipe, sample_shape, fixed_param_names=mine)
    after, states = _numpy(mod.get_params()[0]), mod.optimizer_states()
    rest = [n for n in trained if n not in mine]
    _assert_fixed_kept(before, after, fixed + mine, rest)
    assert sorted(states['params']) == rest


@pytest.mark.parametrize('network', ['mlp', 'transformer'])
def test_trainer_keeps_constants_and_frozen_layers_fixed_without_state(network):
    make, sample_shape = NETWORKS[network]
    pipe = Pipeline(make(), 'cpu:0,cpu:1', sample=(BATCH,) + sample_shape)
    fixed, trained = _fixed_and_trained(pipe)
    mx.random.seed(0)
    pipe.initialize(mx.init.Xavier())
    before = _numpy(pipe.get_params()[0])
    trainer = Trainer(pipe.collect_params(), 'sgd', {'learning_rate': 0.5, 'momentum': 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    X, y = _data(sample_shape)
    for start in (0, BATCH):
        with mx.autograd.record():
            loss = loss_fn(pipe(mx.nd.array(X[start:start + BATCH], ctx=mx.cpu(0))),
                           mx.nd.array(y[start:start + BATCH], ctx=mx.cpu(1)))
        loss.backward()
        trainer.step(BATCH)
    _assert_fixed_kept(before, _numpy(pipe.get_params()[0]), fixed, trained)
    assert sorted(trainer.states()['params']) == trained


TASK = '''
import sys
sys.path.insert(0, %r)  # this folder: the networks above
import mp_symbolic
from test_constants import NETWORKS, _data, chain

def task(network='mlp', whole=0):
    make, sample_shape = NETWORKS[network]
    X, y = _data(sample_shape, num=32)
    blocks = chain(make(), prefix='net_') if whole else make()
    return mp_symbolic.Task(name='fixed', blocks=blocks, loss='softmax', train=(X, y),
                            batch_size=8, num_epochs=2, optimizer='sgd', lr=0.05, momentum=0.9)
'''


@pytest.fixture(scope='module')
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp('task') / 'fixed_task.py'
    path.write_text(TASK % os.path.dirname(os.path.abspath(__file__)))
    return str(path)


def _train(task_file, out, **fields):
    cfg = make_config(task=task_file, devices='cpu:0,cpu:1', progress=False, memory=False,
                      out=str(out), **fields)
    return train(cfg, **QUIET)


def _initial(network, whole, seed):
    """The initial values ``train`` draws for the task (seed 0)."""
    from mp_symbolic.training.loop import initial_values  # pylint: disable=import-outside-toplevel
    make, sample_shape = NETWORKS[network]
    blocks = chain(make(), prefix='net_') if whole else make()
    pipe = Pipeline(blocks, 'cpu:0,cpu:1', sample=(8,) + sample_shape)
    return pipe, initial_values(pipe, seed)[0]


@pytest.mark.parametrize('network, whole, variant, api', [
    ('mlp', 0, 'symbolic', 'module'), ('mlp', 1, 'symbolic', 'module'),
    ('mlp', 0, 'symbolic', 'executor'), ('mlp', 0, 'imperative', 'module'),
    ('transformer', 0, 'symbolic', 'module'), ('transformer', 1, 'symbolic', 'module'),
    ('transformer', 1, 'imperative', 'module')])
def test_train_task_and_resume_keep_fixed_parameters_and_save_no_state_for_them(
        task_file, tmp_path, network, whole, variant, api):
    args = {'network': network, 'whole': whole}
    first = _train(task_file, tmp_path / 'run', task_args=args, variant=variant, api=api,
                   num_epochs=1, checkpoint_every=1)
    pipe, init = _initial(network, whole, make_config().seed)
    fixed, trained = _fixed_and_trained(pipe)
    _assert_fixed_kept(init, first.params, fixed, trained)
    resumed = _train(task_file, tmp_path / 'run2', task_args=args, variant=variant, api=api,
                     num_epochs=2, resume=str(tmp_path / 'run'))
    _assert_fixed_kept(init, resumed.params, fixed, trained)
    checkpoint = read_checkpoint(str(tmp_path / 'run2'))
    _, arg_params, _ = checkpoint.load()
    for name in fixed:
        np.testing.assert_array_equal(arg_params[name].asnumpy(), init[name], err_msg=name)
    assert sorted(load_states(checkpoint.states_path)['params']) == sorted(trained)
    assert os.path.exists(checkpoint.params_path)


def _with_stale_state(states, names):
    """``states`` with a momentum for each of ``names``, as a run that trained
    them would have saved."""
    arrays = list(states['arrays'])
    params = dict(states['params'])
    for name, shape in names.items():
        arrays.append(np.ones(shape, np.float32))
        params[name] = {'count': 2, 'state': {'t': 'nd', 'a': len(arrays) - 1}}
    return dict(states, params=params, arrays=arrays)


def _executor_stepper(task_file):
    from mp_symbolic.training.loop import build_pipeline, initial_values, load, make_stepper  # pylint: disable=import-outside-toplevel
    task, cfg = load(make_config(task=task_file, devices='cpu:0,cpu:1', api='executor',
                                 progress=False))
    pipe, _ = build_pipeline(cfg, task)
    return make_stepper(cfg, pipe, task, initial_values(pipe, cfg.seed), task.label_shape)


@pytest.mark.parametrize('route', ['module', 'trainer', 'executor'])
def test_a_saved_state_of_a_fixed_parameter_is_dropped_when_restored(task_file, route):
    make, sample_shape = NETWORKS['mlp']
    if route == 'executor':
        stepper = _executor_stepper(task_file)
        pipe, get, put = stepper.pipe, stepper.optimizer_states, stepper.set_optimizer_states
        X, y = _data(sample_shape)
        for X_batch, y_batch in stepper.batches(X, y, 0):
            stepper.step(X_batch, y_batch)
    else:
        pipe = Pipeline(make(), 'cpu:0,cpu:1', sample=(BATCH,) + sample_shape)
        if route == 'module':
            _, mod = _module_route(pipe, sample_shape)
            get, put = mod.optimizer_states, mod.set_optimizer_states
        else:
            pipe.initialize()
            trainer = Trainer(pipe.collect_params(), 'sgd', {'learning_rate': 0.1,
                                                             'momentum': 0.9})
            get, put = trainer.states, trainer.set_states
    fixed, _ = _fixed_and_trained(pipe)
    params = pipe.collect_params()
    put(_with_stale_state(get(), {n: params[n].shape for n in fixed}))
    assert not set(get()['params']) & set(fixed)


def test_dist_sync_workers_of_a_task_file_agree_and_keep_fixed_parameters_without_state(
        task_file, tmp_path):
    """A task file the project never saw, under ``launch``: both workers end
    with one parameter digest, the run records its dist_sync kvstore, and
    the fixed parameters are kept."""
    job = subprocess.run(
        [sys.executable, '-m', 'mp_symbolic', 'launch', '--workers', '2', '--servers', '1', '--',
         'train', '--task', task_file, '--devices', 'cpu:0,cpu:1', '--epochs', '1',
         '--no-progress', '--no-memory', '--out', str(tmp_path / 'dist')],
        capture_output=True, text=True, timeout=240, check=False)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
    digests = re.findall(r'^\[worker (\d), rank \d\] parameters sha256: (\w+)$', job.stdout, re.M)
    assert sorted(w for w, _ in digests) == ['0', '1'] and len({d for _, d in digests}) == 1, \
        job.stdout
    pipe, init = _initial('mlp', 0, make_config().seed)
    fixed, trained = _fixed_and_trained(pipe)
    checkpoint = read_checkpoint(str(tmp_path / 'dist'))
    assert checkpoint.summary['config']['kvstore'] == 'dist_sync'
    _, arg_params, _ = checkpoint.load()
    _assert_fixed_kept(init, _numpy(arg_params), fixed, trained)
    assert sorted(load_states(checkpoint.states_path)['params']) == trained


def test_the_memory_table_counts_no_gradient_or_state_for_fixed_parameters(task_file):
    from mp_symbolic.training.loop import build_pipeline, load, plan_memory  # pylint: disable=import-outside-toplevel
    task, cfg = load(make_config(task=task_file, devices='cpu:0,cpu:1', progress=False))
    pipe, _ = build_pipeline(cfg, task)
    fixed, trained = _fixed_and_trained(pipe)
    params = pipe.collect_params()
    nbytes = {n: int(np.prod(params[n].shape)) * 4 for n in params}
    measured = plan_memory(cfg, pipe, task, task.label_shape, log=lambda line: None)
    for plan in ('split', 'one_device'):
        rows = measured[plan].values()
        assert sum(r['params'] for r in rows) == sum(nbytes.values())
        assert sum(r['grads'] for r in rows) == sum(nbytes[n] for n in trained)
        assert sum(r['optimizer'] for r in rows) == sum(nbytes[n] for n in trained)  # momentum
