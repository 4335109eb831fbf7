"""A task file whose data is a bucketed DataIter (batches of several
lengths, each with its ``bucket_key`` and ``provide_data``) trains through
the command line on every schedule, with replicas, resumed and over two
nodes, to the parameters one device reaches; nodes that read other batches
end in one line."""
import re

import numpy as np
import pytest

from mp_symbolic import read_checkpoint
from test_tasks import _in_process

BUCKET_TASK = '''"""A tiny language model trained on batches of three lengths, bucketed."""
import os

import mxnet as mx
import numpy as np
from mxnet import gluon

import mp_symbolic


class LengthBatches(mx.io.DataIter):
    """Batches of token ids, each batch of one length, as a bucketing
    iterator gives them: ``bucket_key`` the length, ``provide_data`` its
    shapes; an epoch's order depends only on ``(seed, epoch)``."""

    def __init__(self, seed, batches=24, batch_size=8, lengths=(4, 6, 8), vocab=10,
                 endless=False):
        super().__init__(batch_size)
        self.endless = endless
        rng = np.random.default_rng(seed)
        self.seed, self.epoch, self.cursor = seed, 0, 0
        self.default_bucket_key = max(lengths)
        self.batches = []
        for _ in range(batches):
            x = rng.integers(0, vocab, (batch_size, int(rng.choice(lengths))))
            self.batches.append((x.astype(np.float32), ((x + 1) % vocab).astype(np.float32)))
        self.order = list(range(batches))

    @property
    def provide_data(self):
        return [mx.io.DataDesc('data', (self.batch_size, self.default_bucket_key))]

    @property
    def provide_label(self):
        return [mx.io.DataDesc('softmax_label', (self.batch_size, self.default_bucket_key))]

    def set_epoch(self, epoch):
        self.epoch = epoch

    def reset(self):
        self.order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.batches))
        self.cursor = 0

    def next(self):
        if self.cursor == len(self.order) and not self.endless:
            raise StopIteration
        x, y = self.batches[self.order[self.cursor % len(self.order)]]
        self.cursor += 1
        return mx.io.DataBatch(
            data=[mx.nd.array(x)], label=[mx.nd.array(y)], bucket_key=x.shape[1],
            provide_data=[mx.io.DataDesc('data', x.shape)],
            provide_label=[mx.io.DataDesc('softmax_label', y.shape)])


def task(seed=0, vocab=10, seed_by_node=False, batches=24, endless=False):
    if seed_by_node:  # each node its own batches: what a task must not do
        seed += int(os.environ.get('RANK', '0'))
    init = mx.init.Xavier()
    blocks = [gluon.nn.Embedding(vocab, 16, weight_initializer=mx.init.Normal(1.0),
                                 prefix='embed_'),
              gluon.nn.Dense(32, flatten=False, activation='tanh', weight_initializer=init,
                             prefix='hidden_'),
              gluon.nn.Dense(32, flatten=False, activation='tanh', weight_initializer=init,
                             prefix='hidden2_'),
              gluon.nn.Dense(vocab, flatten=False, weight_initializer=init, prefix='out_')]
    return mp_symbolic.Task(
        name='buckets', blocks=blocks, loss='softmax',
        train=LengthBatches(seed, batches, vocab=vocab, endless=endless),
        val=LengthBatches(seed + 1, batches=4, vocab=vocab), batch_size=8, num_epochs=3, lr=0.1,
        max_data_bytes=1 << 20)
'''


@pytest.fixture(scope='module')
def bucket_task(tmp_path_factory):
    path = tmp_path_factory.mktemp('task') / 'bucket_task.py'
    path.write_text(BUCKET_TASK)
    return path


def _train(task, out, *argv):
    result = _in_process('mp_symbolic', 'train', '--task', str(task), '--out', str(out),
                         '--no-progress', '--no-memory', *argv)
    assert result.returncode == 0, result.stderr
    return result


def _params(out):
    """The committed checkpoint's parameters (of one process or of each
    node's part), name -> numpy."""
    _, arg, _ = read_checkpoint(str(out)).load()
    return {k: v.asnumpy() for k, v in arg.items()}


@pytest.fixture(scope='module')
def one_device(bucket_task, tmp_path_factory):
    out = tmp_path_factory.mktemp('runs') / 'one'
    result = _train(bucket_task, out, '--devices', 'cpu:0')
    return _params(out), result


def _assert_equal_params(found, expected):
    assert sorted(found) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(found[name], value, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize('argv', [
    ('--devices', 'cpu:0,cpu:1', '--schedule', '1f1b', '--chunks', '2'),
    ('--devices', 'cpu:0,cpu:1', '--schedule', 'interleaved', '--chunks', '2'),
    ('--devices', 'cpu:0,cpu:1', '--chunks', '2'),
    ('--devices', 'cpu:0,cpu:1,cpu:2,cpu:3', '--schedule', '1f1b', '--chunks', '2',
     '--replicas', '2'),
], ids=['1f1b', 'interleaved', 'gpipe', '1f1b-replicas'])
def test_bucketed_task_ends_with_the_parameters_of_one_device(bucket_task, one_device, tmp_path,
                                                              argv):
    expected, single = one_device
    result = _train(bucket_task, tmp_path / 'run', *argv)
    _assert_equal_params(_params(tmp_path / 'run'), expected)
    # the report reads the validation batches at their lengths, as on one device
    line = [l for l in result.stdout.splitlines() if l.startswith('validation accuracy')]
    assert line and line[0] in single.stdout


def test_bucketed_task_resumed_ends_where_an_uninterrupted_run_ends(bucket_task, one_device,
                                                                    tmp_path):
    out = tmp_path / 'run'
    plan = ('--devices', 'cpu:0,cpu:1', '--schedule', '1f1b', '--chunks', '2')
    _train(bucket_task, out, *plan, '--epochs', '2')
    result = _train(bucket_task, tmp_path / 'more', *plan, '--resume', str(out), '--epochs', '3',
                    '--out', str(tmp_path / 'more'))
    assert 'resumed from %s after epoch 2' % out in result.stdout
    _assert_equal_params(_params(tmp_path / 'more'), one_device[0])


@pytest.mark.parametrize('argv, line', [
    (('train', '--batch-size', '4'), "error: --batch-size: expected the bucketed DataIter's "
     "batch size 8 (its batches are made by the task), found 4"),
    (('train', '--variant', 'imperative'), "error: --variant: expected 'symbolic' with a "
     "bucketed DataIter (the Module binds each bucket), found 'imperative'"),
    (('train', '--api', 'executor'), "error: --api: expected 'module' with a bucketed DataIter "
     "(the Module binds each bucket), found 'executor'"),
    (('compare',), "error: --task {task}: train: expected arrays or a DataIter of one shape to "
     "compare (the imperative twin and the executor API take arrays), found a bucketed "
     "DataIter"),
    (('train', '--task-arg', 'batches=0'), "error: --task {task}: train: expected a DataIter "
     "with at least one batch, found none"),
    (('train', '--task-arg', 'endless=True'), "error: --task {task}: train: expected a DataIter "
     "of at most 1048576 bytes of examples and labels as float32 (max_data_bytes), found more "
     "after 2587 batches (one that never ends?)"),
], ids=['batch-size', 'imperative', 'executor', 'compare', 'empty', 'endless'])
def test_bucketed_task_refuses_what_cannot_apply_in_one_line(bucket_task, tmp_path, argv, line):
    result = _in_process('mp_symbolic', argv[0], '--task', str(bucket_task), '--out',
                         str(tmp_path / 'run'), '--no-progress', *argv[1:])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [line.format(task=bucket_task)], result.stderr
    assert not (tmp_path / 'run').exists()  # nothing written, not even the folder


# -- over nodes: every node reads the same batches -----------------------------------------

NODE_PLAN = ['--devices', 'cpu:0,cpu:1', '--schedule', '1f1b', '--chunks', '2']


def _launch_task(task, out, port, *argv):
    from test_nodes import _launch  # pylint: disable=import-outside-toplevel
    return _launch(['--nodes', '2', '--', 'train', '--task', str(task), '--out', str(out),
                    '--no-progress', '--no-memory'] + NODE_PLAN + list(argv), port)


@pytest.mark.slow
def test_bucketed_task_over_two_nodes_ends_with_the_parameters_of_one_device(
        bucket_task, one_device, tmp_path, port):
    result = _launch_task(bucket_task, tmp_path / 'nodes', port)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].startswith('launch: 2 nodes: all exited 0 in')
    _assert_equal_params(_params(tmp_path / 'nodes'), one_device[0])  # one part per node


@pytest.mark.slow
def test_nodes_reading_other_batches_end_in_one_line_naming_the_step_and_both_keys(
        bucket_task, tmp_path, port):
    result = _launch_task(bucket_task, tmp_path / 'nodes', port, '--task-arg',
                          'seed_by_node=True')
    assert result.returncode != 0
    errors = [l for l in result.stdout.splitlines() + result.stderr.splitlines()
              if 'error: ' in l and 'bucket' in l]
    assert errors and all(
        re.search(r"found node \d's bucket_key \d where node \d's is \d at step \d+ \(does every "
                  r"node read the same batches\?\)$", l) for l in errors), result.stdout
    assert 'Traceback' not in result.stdout + result.stderr


def _iterators():
    """The bucket task file's ``LengthBatches`` class, and mp_symbolic."""
    namespace = {}
    exec(compile(BUCKET_TASK, 'bucket_task.py', 'exec'), namespace)  # pylint: disable=exec-used
    return namespace['LengthBatches'], namespace['mp_symbolic']


@pytest.mark.parametrize('fields, line', [
    (dict(val=(np.zeros((8, 4)), np.zeros((8, 4)))),
     'val: expected a bucketed DataIter like train (one with default_bucket_key) or None'),
    (dict(evaluate=lambda params, predict, data: None),
     'evaluate: expected None with a bucketed DataIter (the metric is read batch by batch; '
     'evaluate takes arrays)'),
    (dict(input_shape=(8,)), "input_shape: expected None with a bucketed DataIter (its "
     "provide_data gives the default bucket's shapes)"),
    (dict(lr_schedule=lambda lr, steps: None), 'lr_schedule: expected None with a bucketed '
     'DataIter (its batches are not counted before they come)'),
], ids=['val', 'evaluate', 'input_shape', 'lr_schedule'])
def test_a_bucketed_task_refuses_fields_that_need_arrays_naming_them(fields, line):
    batches, mp_symbolic = _iterators()
    with pytest.raises(mp_symbolic.TaskError) as raised:
        mp_symbolic.Task(name='b', blocks=[], train=batches(0), **fields)
    assert str(raised.value).startswith(line + ', found ')


def test_a_bucketed_task_refuses_a_dist_kvstore_naming_it(bucket_task):
    """Each ``dist_sync`` worker trains its shard of every batch of arrays; a
    bucketed DataIter's batches are the task's, not split between workers."""
    from mp_symbolic.training.config import TrainConfig  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.tasks import load_task  # pylint: disable=import-outside-toplevel
    task, _ = load_task(str(bucket_task), {}, 0)
    with pytest.raises(ValueError) as raised:
        TrainConfig(kvstore='dist_sync').with_task(task)
    assert str(raised.value) == ("kvstore: expected local or device with a bucketed DataIter "
                                 "(its batches are not split between workers), found "
                                 "'dist_sync'")
