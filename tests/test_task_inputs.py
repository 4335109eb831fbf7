"""A task of several inputs: ``train=((X0, X1), y)``, ``([X0, X1], y)`` or a
DataIter of two data arrays trains on every route (Module, executor, the twin; a whole network and
a block list) to the same weights as one device, resumes as if never stopped,
and its checkpoint exports; a task whose arrays do not fit the network's
inputs is refused in one line."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import cli_status, make_config
from mp_symbolic.training.loop import train

QUIET = dict(log=lambda line: None)

TASK = '''
import mxnet as mx
from mxnet import gluon
import numpy as np

import mp_symbolic


class Merge(gluon.HybridBlock):
    """Reads a feature vector and a 4x4 map: the network's two inputs."""

    def __init__(self, hidden=8, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.vector = gluon.nn.Dense(hidden, activation='tanh', prefix='vector_')
            self.map = gluon.nn.Dense(hidden, activation='tanh', prefix='map_')

    def hybrid_forward(self, F, vector, grid):
        return F.concat(self.vector(vector), self.map(grid.reshape((0, -1))), dim=1)


class Whole(gluon.HybridBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.merge = Merge(prefix='merge_')
            self.mix = gluon.nn.Dense(8, activation='tanh', prefix='mix_')
            self.out = gluon.nn.Dense(1, prefix='out_')

    def hybrid_forward(self, F, vector, grid):
        return self.out(self.mix(self.merge(vector, grid)))


def task(form='whole', source='arrays', case='good'):
    rng = np.random.default_rng(0)
    vector = rng.normal(size=(96, 6)).astype(np.float32)
    grid = rng.normal(size=(96, 4, 4)).astype(np.float32)
    y = (vector[:, :1] - grid[:, :1, 0]).astype(np.float32)
    train, val = ((vector, grid), y), ((vector[:32], grid[:32]), y[:32])
    if source == 'iter':
        train = mx.io.NDArrayIter({'data0': vector, 'data1': grid}, y, batch_size=32)
    elif source == 'list':  # a list of the inputs, as a tuple
        train = ([vector, grid], y)
    if case == 'one input':
        train, val = (vector, y), None
    elif case == 'three inputs':
        train, val = ((vector, grid, grid), y), None
    elif case == 'val inputs':
        val = (vector[:32], y[:32])
    elif case == 'lengths':
        train = ((vector, grid[:50]), y)
    if form == 'whole':
        blocks = lambda: Whole(prefix='net_')
    else:
        blocks = lambda: [Merge(prefix='net_merge_'), gluon.nn.Dense(8, activation='tanh',
                          prefix='net_mix_'), gluon.nn.Dense(1, prefix='net_out_')]
    return mp_symbolic.Task(name='two-inputs', blocks=blocks, train=train, val=val, loss='l2',
                            batch_size=16, num_epochs=3, lr=0.5)
'''


@pytest.fixture(scope='module')
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp('task') / 'two_inputs.py'
    path.write_text(TASK)
    return str(path)


def _train(task_file, out, **fields):
    fields.setdefault('devices', 'cpu:0,cpu:1')
    cfg = make_config(task=task_file, progress=False, memory=False, out=str(out), **fields)
    return train(cfg, **QUIET)


@pytest.mark.parametrize('form', ['whole', 'blocks'])
def test_a_task_of_two_inputs_trains_to_one_devices_weights_on_every_route(
        task_file, tmp_path, form):
    one = _train(task_file, tmp_path / 'one', devices='cpu:0', task_args={'form': form})
    routes = [dict(), dict(api='executor'), dict(variant='imperative'), dict(chunks=2),
              dict(task_args={'form': form, 'source': 'iter'}),
              dict(task_args={'form': form, 'source': 'list'})]
    for i, route in enumerate(routes):
        route.setdefault('task_args', {'form': form})
        result = _train(task_file, tmp_path / str(i), **route)
        assert sorted(result.params) == sorted(one.params), route
        for name, value in one.params.items():
            np.testing.assert_allclose(result.params[name], value, rtol=1e-5, atol=1e-6,
                                       err_msg='%s %s' % (route, name))


def test_a_task_of_two_inputs_resumes_as_if_never_stopped_and_exports(task_file, tmp_path,
                                                                       capsys):
    whole = _train(task_file, tmp_path / 'whole', num_epochs=3)
    _train(task_file, tmp_path / 'first', num_epochs=1, checkpoint_every=1)
    resumed = _train(task_file, tmp_path / 'resumed', num_epochs=3,
                     resume=str(tmp_path / 'first'))
    for name, value in whole.params.items():
        np.testing.assert_array_equal(resumed.params[name], value, err_msg=name)
    # the checkpoint records both inputs' shapes: the exporter needs no --input-shape
    from export.__main__ import main as export_main  # pylint: disable=import-outside-toplevel
    capsys.readouterr()
    assert export_main(['--checkpoint', str(tmp_path / 'whole'), '--out',
                        str(tmp_path / 'export'), '--verify-batches', '1,5']) == 0
    printed = capsys.readouterr().out
    assert 'data0' in printed and 'data1' in printed, printed
    assert os.path.exists(tmp_path / 'export' / 'current' / 'two-inputs.onnx')


MISFITS = [
    ('one input', "train: expected examples the blocks can take, found examples of shape (6,): "
                  'expected one batch or shape per input of the network, found 1'),
    ('three inputs', 'found examples of shape (6,), (4, 4), (4, 4): expected one batch or '
                     'shape per input of the network, found 3'),
    ('val inputs', 'val: expected examples of shape (6,), (4, 4) like train, found (6,)'),
    ('lengths', 'train: expected X[1] of shape (examples, ...) and y with one label per '
                'example, found X[1] (50, 4, 4) and y (96, 1)'),
]


@pytest.mark.parametrize('case, message', MISFITS)
def test_arrays_that_do_not_fit_the_inputs_are_refused_in_one_line(task_file, capsys, case,
                                                                    message):
    argv = ['train', '--task', task_file, '--task-arg', 'case=%s' % case, '--devices',
            'cpu:0,cpu:1', '--no-memory', '--out', os.devnull + '-never']
    if case == MISFITS[0][0]:  # one case end to end: the exit status and stderr a user sees
        run = subprocess.run([sys.executable, '-m', 'mp_symbolic'] + argv,
                             capture_output=True, text=True, cwd=os.path.dirname(
                                 os.path.dirname(os.path.abspath(__file__))))
        status, stderr = run.returncode, run.stderr
    else:  # the rest through the same main() in this process, without MXNet's start
        from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
        capsys.readouterr()
        status, stderr = cli_status(cli.main, argv), capsys.readouterr().err
    assert status == 2, stderr
    assert message in stderr and 'Traceback' not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


def test_a_list_of_arrays_is_several_inputs_and_a_list_of_rows_one_array():
    from mxnet import gluon  # pylint: disable=import-outside-toplevel
    from mp_symbolic import Task  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    X0, X1, y = rng.normal(size=(8, 3)), rng.normal(size=(8, 5)), rng.normal(size=(8, 1))
    several = Task(name='t', blocks=[gluon.nn.Dense(1)], loss='l2', train=([X0, X1], y)).data()
    assert [x.shape for x in several.X] == [(8, 3), (8, 5)]
    assert all(x.dtype == np.float32 for x in several.X)
    rows = Task(name='t', blocks=[gluon.nn.Dense(1)], loss='l2',
                train=([[0.0, 1.0], [1.0, 0.0]] * 4, [[0.0]] * 8)).data()
    assert rows.X.shape == (8, 2)


LENGTHS_TASK = '''
import numpy as np
from mxnet import gluon

import mp_symbolic


class Scaled(gluon.HybridBlock):
    """A feature vector's layer, scaled by one number per example (as BERT reads
    its valid lengths: one per sequence)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, activation='tanh', prefix='dense_')
            self.out = gluon.nn.Dense(1, prefix='out_')

    def hybrid_forward(self, F, vector, scale):
        return self.out(F.broadcast_mul(self.dense(vector), scale.reshape((-1, 1))))


def task():
    rng = np.random.default_rng(0)
    vector = rng.normal(size=(64, 6)).astype(np.float32)
    scale = rng.integers(1, 5, 64).astype(np.float32)
    y = (vector[:, :1] * scale[:, None] / 4).astype(np.float32)
    return mp_symbolic.Task(name='scaled', blocks=lambda: Scaled(prefix='net_'),
                            train=((vector, scale), y), loss='l2', batch_size=16,
                            num_epochs=2, lr=0.1)
'''


def test_an_input_of_one_number_per_example_among_several_trains_as_on_one_device(tmp_path):
    path = tmp_path / 'scaled.py'
    path.write_text(LENGTHS_TASK)
    one = _train(str(path), tmp_path / 'one', devices='cpu:0')
    split = _train(str(path), tmp_path / 'split', chunks=2)
    assert sorted(split.params) == sorted(one.params)
    for name, value in one.params.items():
        assert np.isfinite(value).all(), name
        np.testing.assert_allclose(split.params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
