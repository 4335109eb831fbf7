"""Optimizer state sharded across replicas (ZeRO stage 1):
``Pipeline(..., shard_optimizer=True)`` and ``train --shard-optimizer``.

Each replica of a stage holds and updates the optimizer state of its share
of the stage's parameters; the values equal the unsharded run's bit for
bit, each replica's optimizer bytes are its share (measured and estimated
alike), and a checkpoint holds the whole state by name, so a run resumes at
any number of replicas."""
import re
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import mp_symbolic
from mp_symbolic import Pipeline
from mp_symbolic.core.optim.optstate import OptimizerStateError
from mp_symbolic.core.optim.zero import owners
from mp_symbolic.tools.checkpoint import read_checkpoint
from mp_symbolic.tools.memory import (counted_storage, format_bytes, memory_table,
                                      start_storage_profile)
from mp_symbolic.training.cli import main

from conftest import cli_status

WIDTHS = (24, 24, 24, 24, 24, 24, 10)
BATCH = 16


def _blocks():
    return [gluon.nn.Dense(w, activation='relu' if i < len(WIDTHS) - 1 else None,
                           prefix='zd%d_' % i) for i, w in enumerate(WIDTHS)]


def _devices(replicas, stages=2):
    return ','.join('cpu:%d' % i for i in range(replicas * stages))


def _module(replicas, shard, schedule='gpipe', optimizer='adam'):
    pipe = Pipeline(_blocks(), _devices(replicas), sample=(BATCH, 20), replicas=replicas,
                    schedule=schedule, chunks=2, shard_optimizer=shard)
    mod = pipe.module('softmax')
    mod.bind([('data', (BATCH, 20))], [('softmax_label', (BATCH,))])
    mx.random.seed(1)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(kvstore='local' if replicas > 1 else None, optimizer=optimizer,
                       optimizer_params={'learning_rate': 0.01})
    return pipe, mod


def _steps(mod, num_steps):
    rng = np.random.RandomState(0)
    for _ in range(num_steps):
        batch = mx.io.DataBatch([mx.nd.array(rng.randn(BATCH, 20))],
                                [mx.nd.array(rng.randint(0, 10, BATCH))])
        mod.forward_backward(batch)
        mod.update()
    mx.nd.waitall()


def _values(mod):
    arg_params, _ = mod.get_params()
    return {n: v.asnumpy() for n, v in arg_params.items()}


@pytest.mark.parametrize('schedule, replicas', [('gpipe', 2), ('1f1b', 2), ('gpipe', 4)])
def test_sharded_adam_holds_the_unsharded_parameters_and_states_bit_for_bit(schedule, replicas):
    _, plain = _module(replicas, False, schedule)
    _, sharded = _module(replicas, True, schedule)
    _steps(plain, 12)
    _steps(sharded, 12)
    found = sharded.optimizer_owners()
    assert sorted(k for _, k in found.values()) != [0] * len(found)  # shared, not all on one
    expected, got = _values(plain), _values(sharded)
    assert sorted(expected) == sorted(got)
    for name, value in expected.items():
        assert value.tobytes() == got[name].tobytes(), name
    for arrays in sharded._exec_group.param_arrays:  # every replica holds the owner's values
        for copy in arrays[1:]:
            assert copy.asnumpy().tobytes() == arrays[0].asnumpy().tobytes()
    states, sharded_states = plain.optimizer_states(), sharded.optimizer_states()
    assert sorted(states['params']) == sorted(sharded_states['params'])
    for name, entry in states['params'].items():
        other = sharded_states['params'][name]
        assert entry['count'] == other['count']
        for i, j in zip(entry['state']['items'], other['state']['items']):
            assert states['arrays'][i['a']].tobytes() == \
                sharded_states['arrays'][j['a']].tobytes(), name


@pytest.mark.slow
def test_each_replica_holds_its_share_of_the_optimizer_bytes_as_estimated():
    pipe, plain = _module(2, False)
    sharded_pipe, sharded = _module(2, True)
    _steps(plain, 1)
    _steps(sharded, 1)
    before = {r.device: r.optimizer for r in memory_table(plain)}
    after = {r.device: r.optimizer for r in memory_table(sharded)}
    stages = pipe.plan.replica_devices
    for s in range(2):
        whole = before[str(stages[0][s])]
        assert before[str(stages[1][s])] == whole  # unsharded: each replica the whole
        shares = [after[str(stages[k][s])] for k in range(2)]
        assert sum(shares) == whole and 0 < min(shares)
        largest = max(8 * a[0].size for a in sharded._exec_group.param_arrays)
        assert max(shares) - min(shares) <= largest
    shapes = dict(data_shapes=[('data', (BATCH, 20))], label_shapes=[('softmax_label', (BATCH,))],
                  optimizer='adam')
    estimated = {r.device: r.optimizer
                 for r in mp_symbolic.estimate_memory(sharded_pipe, **shapes)}
    assert {d: b for d, b in estimated.items() if b} == after


def test_each_replica_allocates_only_its_share_of_the_optimizer_state(monkeypatch):
    """What the storage profiler counts at the first update (when Adam's
    states are made) is each device's share, as its table says: a device
    holding every parameter's moments (in one array beside its parameters'
    one) would hold the whole state where it owns a share."""
    monkeypatch.setenv('MP_SYMBOLIC_CONTIGUOUS', '1')  # parameters as views of one array
    # one stage a replica: the profiler counts cpu(0) and cpu(1) in rows of their own
    sharded = Pipeline(_blocks(), 'cpu:0,cpu:1', sample=(BATCH, 20), replicas=2, chunks=2,
                       shard_optimizer=True).module('softmax')
    sharded.bind([('data', (BATCH, 20))], [('softmax_label', (BATCH,))])
    sharded.init_params(mx.init.Xavier())
    sharded.init_optimizer(kvstore='local', optimizer='adam',
                           optimizer_params={'learning_rate': 0.01})
    rng = np.random.RandomState(0)
    sharded.forward_backward(mx.io.DataBatch([mx.nd.array(rng.randn(BATCH, 20))],
                                             [mx.nd.array(rng.randint(0, 10, BATCH))]))
    mx.nd.waitall()
    path = start_storage_profile()
    sharded.update()
    made = counted_storage(path)
    held = {r.device: r.optimizer for r in memory_table(sharded)}
    for device in ('cpu(0)', 'cpu(1)'):
        assert made[device.replace('(', '/').rstrip(')')] == held[device] > 0


def test_a_sharded_module_refuses_the_optimizer_state_of_another_model():
    _, mod = _module(2, True)
    _steps(mod, 1)
    states = mod.optimizer_states()
    states['params']['other_weight'] = states['params']['zd0_weight']
    with pytest.raises(OptimizerStateError, match='found state for other_weight$'):
        mod.set_optimizer_states(states)


def test_owners_balance_each_stage_by_bytes():
    params = [('a', 0, 100), ('b', 0, 60), ('c', 0, 50), ('d', 0, 10), ('e', 1, 7)]
    found = owners(params, 2)
    assert found == {'a': 0, 'b': 1, 'c': 1, 'd': 0, 'e': 0}
    assert owners(list(reversed(params)), 2) == found  # whatever the order given


def test_one_replica_shards_nothing_and_updates_as_unsharded():
    _, plain = _module(1, False)
    _, sharded = _module(1, True)
    _steps(plain, 3)
    _steps(sharded, 3)
    assert sharded.optimizer_owners() is None
    expected, got = _values(plain), _values(sharded)
    assert all(expected[n].tobytes() == got[n].tobytes() for n in expected)


def test_shard_optimizer_that_is_not_a_bool_is_refused():
    with pytest.raises(ValueError, match=r"^shard_optimizer: expected True or False, found 'yes'$"):
        Pipeline(_blocks(), _devices(2), sample=(BATCH, 20), replicas=2, shard_optimizer='yes')


@pytest.mark.parametrize('flags, message', [
    (['--variant', 'imperative'], "error: --shard-optimizer: expected False (the default) with "
                                  "variant 'imperative'"),
    (['--api', 'executor'], "error: --api: expected 'module' with shard_optimizer"),
])
def test_shard_optimizer_where_it_cannot_apply_is_refused_in_one_line(capsys, tmp_path, flags,
                                                                        message):
    status = cli_status(main, ['train', '--shard-optimizer', '--epochs', '1', '--no-progress',
                               '--out', str(tmp_path / 'out')] + flags)
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(message) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / 'out').exists()


TRAIN = ['train', '--task', 'digits', '--optimizer', 'adam', '--no-progress', '--no-memory',
         '--batch-size', '32']


def _train(capsys, out, *flags):
    """``python -m mp_symbolic`` + :data:`TRAIN` ``--out out`` + ``flags``
    through the command's ``main`` in this process (the folder it writes is
    the same; no MXNet start); returns what it printed."""
    capsys.readouterr()
    status = cli_status(main, TRAIN + ['--out', str(out)] + list(flags))
    said = capsys.readouterr()
    assert status == 0, said.out[-2000:] + said.err[-2000:]
    return said.out


def _files(folder):
    checkpoint = read_checkpoint(str(folder))
    return {path[-6:]: open(path, 'rb').read()
            for path in (checkpoint.params_path, checkpoint.states_path)}


def test_a_sharded_run_checkpoints_the_whole_state_and_resumes_at_one_and_four_replicas(
        tmp_path, capsys):
    two = ['--devices', _devices(2), '--replicas', '2', '--epochs', '1']
    _train(capsys, tmp_path / 'sharded', *two, '--shard-optimizer')
    _train(capsys, tmp_path / 'plain', *two)
    # the checkpoint of the sharded run is the unsharded run's, byte for byte
    assert _files(tmp_path / 'sharded') == _files(tmp_path / 'plain')
    for replicas, shard in ((1, ['--no-shard-optimizer']), (4, ['--shard-optimizer'])):
        again = ['--devices', _devices(replicas), '--replicas', str(replicas), '--epochs', '2']
        said = _train(capsys, tmp_path / ('r%d' % replicas), '--resume',
                      str(tmp_path / 'sharded'), *again, *shard)
        assert ('--shard-optimizer off (was on)' in said) == (replicas == 1), said
        _train(capsys, tmp_path / ('plain-r%d' % replicas), '--resume',
               str(tmp_path / 'plain'), *again, '--no-shard-optimizer')
        resumed = read_checkpoint(str(tmp_path / ('r%d' % replicas)))
        assert resumed.epoch == 2
        assert _files(tmp_path / ('r%d' % replicas)) == \
            _files(tmp_path / ('plain-r%d' % replicas))


def test_train_measures_replica_zeros_share_of_the_optimizer_state(tmp_path, capsys):
    """The table train measures after one step (replica 0's devices) holds
    the optimizer state of replica 0's share, the bytes that replica holds
    in the run."""
    assert cli_status(main, ['train', '--widths', '2,64,64,64,64,1', '--optimizer', 'adam',
                             '--epochs', '1', '--no-progress', '--devices', _devices(2),
                             '--replicas', '2', '--shard-optimizer',
                             '--out', str(tmp_path / 'run')]) == 0
    said = capsys.readouterr().out
    assert 'this plan, replica 0 (its share of the sharded optimizer state)' in said
    held = dict((d, int(b)) for d, b in re.findall(r'(cpu\(\d\)) (\d+)', said.split(
        'optimizer state sharded over')[1].splitlines()[0]))
    measured = read_checkpoint(str(tmp_path / 'run')).summary['memory_per_device']['split']
    assert {d: row['optimizer'] for d, row in measured.items()} == \
        {d: held[d] for d in ('cpu(0)', 'cpu(1)')}
    assert held['cpu(0)'] + held['cpu(2)'] == 8 * (2 * 64 + 64 + 64 * 64 + 64)  # stage 0 whole


LAUNCHED = ['train', '--task', 'digits', '--optimizer', 'adam', '--no-progress', '--no-memory',
            '--batch-size', '32', '--epochs', '2']


def _launch(out, how, *flags, memory=False):
    """Digests and share lines of a launched run; with ``memory``, measured
    tables too, and its stdout last among the shares."""
    launched = [f for f in LAUNCHED if not (memory and f == '--no-memory')]
    job = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'launch'] + how + ['--'] +
                         launched + ['--out', str(out)] + list(flags), capture_output=True,
                         text=True, timeout=600, check=False)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
    digests = set(re.findall(r'parameters sha256: ([0-9a-f]{64})$', job.stdout, re.M))
    shares = re.findall(r'\] optimizer state sharded over (\d) replica\(s\) x (\d) worker\(s\): '
                        r'this process holds the state of (\d+) of its (\d+) trained', job.stdout)
    return digests, shares + [job.stdout] if memory else shares


def _parts(folder):
    checkpoint = read_checkpoint(str(folder))
    paths = checkpoint.part_paths or [checkpoint.params_path, checkpoint.states_path]
    return [open(path, 'rb').read() for path in paths]


def _resumes_at_one_and_four_replicas(tmp_path, capsys, folder):
    for replicas in (1, 4):
        out = tmp_path / ('resumed-r%d' % replicas)
        _train(capsys, out, '--resume', str(folder), '--devices', _devices(replicas), '--replicas',
               str(replicas), '--epochs', '3', '--shard-optimizer')
        resumed = read_checkpoint(str(out))
        assert resumed.epoch == 3
        assert len(resumed.load_states()['params']) == 12  # the whole state, every parameter


def _tables_against_shares(stdout):
    """Per worker, the optimizer column of its measured table and the bytes
    its share line reports, by device, both as :func:`format_bytes` prints."""
    found = {}
    for label, rest in re.findall(r'^\[worker (\d)(?:, rank \d)?\] (.*)$', stdout, re.M):
        share = re.search(r'this process holds the state .* bytes \((.*)\)$', rest)
        row = re.match(r'\s+(cpu\(\d\))\s+\S+ \S+\s+\S+ \S+\s+(\S+ \S+)\s', rest)
        mine = found.setdefault(label, {'table': {}, 'share': {}, 'title': ''})
        if share:
            mine['share'] = {d: format_bytes(int(b)) for d, b in
                             re.findall(r'(cpu\(\d\)) (\d+)', share.group(1))}
        elif row and 'this plan' in mine['title']:
            mine['table'][row.group(1)] = row.group(2)
        elif rest.startswith('  ') and not rest.startswith('    '):
            mine['title'] = rest
            rank = re.search(r"worker (\d)'s replica", rest)
            mine['rank'] = int(rank.group(1)) if rank else mine.get('rank')
    return found


@pytest.mark.slow
def test_two_dist_sync_workers_share_the_state_and_checkpoint_the_unsharded_run(tmp_path,
                                                                                 capsys):
    how = ['--workers', '2', '--servers', '1']
    digests, shares = _launch(tmp_path / 'sharded', how, '--devices', 'cpu:0,cpu:1',
                              '--shard-optimizer', memory=True)
    # each worker's measured table holds its own share of the state, at its share of the batch
    tables = _tables_against_shares(shares.pop())
    assert len(tables) == 2 and all(t['share'] and t['table'] == t['share']
                                    for t in tables.values()), tables
    # and the estimate of each rank's, made before anything is bound
    from mp_symbolic.training.tasks.digits import build_blocks
    assert sorted(t['rank'] for t in tables.values()) == [0, 1]
    for table in tables.values():
        estimate = mp_symbolic.estimate_memory(
            build_blocks(), 'cpu:0,cpu:1', sample=(16, 1, 8, 8), optimizer='adam',
            shard_optimizer=True, workers=2, rank=table['rank'])
        assert {r.device: format_bytes(r.optimizer) for r in estimate.rows} == table['share']
    plain, _ = _launch(tmp_path / 'plain', how, '--devices', 'cpu:0,cpu:1')
    assert len(digests) == 1 and digests == plain  # both workers, bit for bit the unsharded
    assert sorted(s[:2] for s in shares) == [('1', '2'), ('1', '2')]
    held = sorted(int(s[2]) for s in shares)
    assert sum(held) == 12 and held[0] > 0  # each worker its share, every parameter once
    assert _parts(tmp_path / 'sharded') == _parts(tmp_path / 'plain')
    _resumes_at_one_and_four_replicas(tmp_path, capsys, tmp_path / 'sharded')


@pytest.mark.slow
def test_two_nodes_shard_each_stage_over_its_replicas_as_one_process(tmp_path, capsys):
    devices = ['--devices', _devices(2), '--replicas', '2']
    digests, shares = _launch(tmp_path / 'sharded', ['--nodes', '2'], *devices,
                              '--shard-optimizer')
    plain, _ = _launch(tmp_path / 'plain', ['--nodes', '2'], *devices)
    assert len(digests) == 1 and digests == plain
    assert len(shares) == 2 and all(s[:2] == ('2', '1') for s in shares)
    assert sum(int(s[3]) for s in shares) == 12  # each node its stages' parameters
    assert _parts(tmp_path / 'sharded') == _parts(tmp_path / 'plain')
    _resumes_at_one_and_four_replicas(tmp_path, capsys, tmp_path / 'sharded')


class _OneWorkerOfTwo:
    """Worker ``rank`` of a two-worker ``dist_sync`` kvstore, in one process:
    what is pushed is kept (the other worker's share taken as zeros) and
    pulled back. MXNet's dist kvstore reads a pushed CPU array's buffer as
    it is (``send_buf.data()``, src/kvstore/kvstore_dist.h), which refuses
    an array oneDNN keeps in its own layout; ``to_dlpack_for_read`` makes
    the same check, so every push is recorded with whether it passes."""

    type, num_workers = 'dist_sync', 2

    def __init__(self, rank):
        self.rank, self.kept, self.refused = rank, {}, []

    def push(self, key, value, priority=0):
        # pylint: disable=unused-argument
        for array in value if isinstance(value, (list, tuple)) else [value]:
            try:
                array.to_dlpack_for_read()
            except mx.base.MXNetError:
                self.refused.append(key)
            self.kept[key] = array.copy()

    def pull(self, key, out=None, priority=0):
        # pylint: disable=unused-argument
        for array in out if isinstance(out, (list, tuple)) else [out]:
            self.kept[key].copyto(array)


def test_a_weight_oneDNN_left_in_its_own_layout_is_pushed_to_dist_sync_workers_readable():
    """An inference pass leaves a convolution's weight in oneDNN's layout
    until the next training pass reorders it; where that reorder has not
    run by the owner's push (a race the engine's order allows), MXNet's
    dist kvstore failed with ``Check failed: !IsMKLDNNData()``."""
    from mp_symbolic.training.tasks.digits import build_blocks
    pipe = Pipeline(build_blocks(), 'cpu:0,cpu:1', sample=(BATCH, 1, 8, 8), chunks=1,
                    shard_optimizer=True)
    mod = pipe.module('softmax')
    mod.bind([('data', (BATCH, 1, 8, 8))], [('softmax_label', (BATCH,))])
    mx.random.seed(1)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(optimizer='adam', optimizer_params={'learning_rate': 0.01})
    rng = np.random.RandomState(0)
    batch = mx.io.DataBatch([mx.nd.array(rng.randn(BATCH, 1, 8, 8))],
                            [mx.nd.array(rng.randint(0, 10, BATCH))])
    mod.forward_backward(batch)
    for rank in (0, 1):  # each worker's pushes: one owns the weight, the other not
        mod._kvstore = kvstore = _OneWorkerOfTwo(rank)  # pylint: disable=protected-access
        mod.forward(batch, is_train=False)  # oneDNN reorders the convolutions' weights
        mx.nd.waitall()
        mod.update()
        mx.nd.waitall()
        assert 'conv1_weight' in kvstore.kept and kvstore.refused == []
