"""The memory estimate of a plan over node processes, node by node
(mp_symbolic.estimate_memory(..., nodes=N), python -m mp_symbolic plan
--nodes N), against the tables the node processes of a real job measure."""
import numpy as np
import pytest

import mp_symbolic
from mp_symbolic import Pipeline
from mp_symbolic.core.planning.estimate import batched_binds
from mp_symbolic.training.cli import main
from mp_symbolic.training.tasks import load_task

from bench import estimate as bench

from conftest import cli_status

# the language model under GPipe (over nodes, on the stage runtime), a GluonCV
# ResNet with BatchNorm, and the CNN with BatchNorm under 1F1B: each over two
# node processes, node 1's temporary space on its cpu(0) beside its stage on cpu(1);
# under 1F1B, the language model and the CIFAR ResNet, whose node 1's cpu(0)
# holds that temporary space alone: oneDNN's windows (a softmax's backward
# pass taking without asking after a dense layer's; a convolution's data
# reordered beside its weight)
CELL = bench._cell  # pylint: disable=protected-access
CELLS = [CELL(model, nodes=2, **plan) for model, plan in (
    ('lm', {}), ('resnet18_v1b', {}), ('digits', {'schedule': '1f1b', 'chunks': 4}),
    ('lm', {'schedule': '1f1b', 'chunks': 4}),
    ('cifar_resnet20_v1', {'schedule': '1f1b', 'chunks': 4}))]


@pytest.fixture(scope='module')
def cells():
    """Each cell's tables, node by node: estimated in this process (no
    rendezvous), measured by the node processes of a job on 127.0.0.1."""
    return [(cell, bench.estimate(cell), bench.measure_nodes(cell)) for cell in CELLS]


@pytest.mark.slow
def test_each_nodes_estimate_is_within_5_percent_of_its_measured_table_and_never_5_percent_under(
        cells):
    for cell, estimated, measured in cells:
        assert len(estimated) == len(measured) == 2, bench.label(cell)
        for node, (guess, got) in enumerate(zip(estimated, measured)):
            assert sorted(guess) == sorted(got), (bench.label(cell), node)
            devices, _ = bench.errors(got, guess)
            for device, (total, estimate, error) in devices.items():
                assert abs(error) <= 0.05, (bench.label(cell), node, device, total, estimate)


@pytest.mark.slow
def test_each_nodes_rows_of_arrays_are_its_measured_bytes_exactly(cells):
    for cell, estimated, measured in cells:
        for node, (guess, got) in enumerate(zip(estimated, measured)):
            for device, row in got.items():
                for category in ('params', 'grads', 'optimizer', 'aux', 'inputs', 'module_copy'):
                    assert guess[device][category] == row[category], \
                        (bench.label(cell), node, device, category)


@pytest.mark.slow
def test_the_nodes_hold_the_parameters_of_the_plan_once_between_them(cells):
    for cell, estimated, _ in cells:
        whole = bench.estimate(dict(cell, nodes=None))
        for category in ('params', 'grads', 'optimizer', 'aux'):
            assert sum(row[category] for table in estimated for row in table.values()) == \
                sum(row[category] for row in whole.values()), (bench.label(cell), category)


def _over_nodes(monkeypatch, rank):
    """A Pipeline over 2 nodes as node ``rank`` makes it, the other node
    answering as one that makes the same plan."""
    from mp_symbolic.core import pipeline  # pylint: disable=import-outside-toplevel
    for name, value in {'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': '1', 'RANK': str(rank),
                        'WORLD_SIZE': '2'}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(pipeline.node_processes, 'join', lambda *args, **kwargs: None)

    class Agreeing:  # the other node, making the same plan
        def agree(self, facts):
            return facts

    monkeypatch.setattr(pipeline.comm, 'control', lambda *args: Agreeing())


def test_a_pipeline_over_nodes_is_estimated_as_its_own_node_of_the_plan(monkeypatch):
    task, _ = load_task('regression')
    with batched_binds():  # one bind child for the ten estimates
        for schedule in ('gpipe', '1f1b'):
            whole = mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1',
                                                sample=(100, 2), schedule=schedule, nodes=2)
            for rank in (0, 1):
                _over_nodes(monkeypatch, rank)
                pipe = Pipeline(task.make_blocks(), 'cpu:0,cpu:1', sample=(100, 2), nodes=2,
                                schedule=schedule)
                assert pipe.local_stages == (rank,)
                table = mp_symbolic.estimate_memory(pipe, sample=(100, 2))
                assert table.as_dict() == whole[rank].as_dict(), (schedule, rank)
                other = mp_symbolic.estimate_memory(pipe, sample=(100, 2), node=1 - rank)
                assert other.as_dict() == whole[1 - rank].as_dict(), (schedule, rank)
                # its stage's parameters on its device, none of the other's
                assert table['cpu(%d)' % rank].params > 0
                assert ('cpu(1)' in table.devices) == (rank == 1)


def test_estimate_memory_refuses_a_node_not_among_the_nodes_in_one_line():
    task, _ = load_task('regression')
    with pytest.raises(ValueError) as refused:
        mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1', sample=(100, 2),
                                    nodes=2, node=2)
    assert str(refused.value) == 'node: expected a node of the 2 (0 to 1), found 2'
    with pytest.raises(ValueError) as refused:
        mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1', sample=(100, 2), node=1)
    assert str(refused.value) == ('node: expected a node with nodes (their count), found '
                                  'node=1 without nodes')
    with pytest.raises(ValueError) as refused:
        mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1', sample=(100, 2), nodes=3)
    assert str(refused.value) == ('nodes: expected at most as many nodes as devices per '
                                  'replica (2), found 3 (a node would hold no stage)')


@pytest.mark.parametrize('given, message', [
    ({'nodes': True}, 'nodes: expected a positive integer, found True'),
    ({'nodes': 1.0}, 'nodes: expected a positive integer, found 1.0'),
    ({'node': False}, 'node: expected a node with nodes (their count), found node=False '
                      'without nodes'),
    ({'nodes': 1, 'node': 0.0}, 'node: expected a node with nodes (their count), found '
                                'node=0.0 without nodes')])
def test_estimate_memory_refuses_a_bool_or_non_integer_nodes_or_node_in_one_line(given, message):
    """``True == 1`` and ``2.0 == 2``: neither is taken as a count of processes."""
    task, _ = load_task('regression')
    with pytest.raises(ValueError) as refused:
        mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1', sample=(100, 2), **given)
    assert str(refused.value) == message


def test_estimate_memory_takes_numpy_integers_for_nodes_and_node():
    task, _ = load_task('regression')
    with batched_binds():
        tables = [mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1',
                                              sample=(100, 2), nodes=count(2), node=count(1))
                  for count in (int, np.int64)]
    assert tables[1].as_dict() == tables[0].as_dict()


def test_estimate_memory_refuses_other_nodes_than_the_pipelines_own_in_one_line(monkeypatch):
    task, _ = load_task('regression')
    _over_nodes(monkeypatch, 0)
    pipe = Pipeline(task.make_blocks(), 'cpu:0,cpu:1', sample=(100, 2), nodes=2)
    with pytest.raises(ValueError) as refused:
        mp_symbolic.estimate_memory(pipe, sample=(100, 2), nodes=1)
    assert str(refused.value) == "nodes: expected the Pipeline's own 2 nodes or none, found 1"
    with pytest.raises(ValueError) as refused:
        mp_symbolic.estimate_memory(pipe, sample=(100, 2), nodes=2.0)
    assert str(refused.value) == 'nodes: expected a positive integer, found 2.0'


def test_plan_over_nodes_prints_each_nodes_table_and_the_largest_device(capsys):
    status = cli_status(main, ['plan', '--task', 'lm', '--devices', 'cpu:0,cpu:1',
                               '--chunks', '4', '--schedule', '1f1b', '--nodes', '2'])
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    assert '--nodes 2' in out[0]
    assert [line.strip() for line in out if line.startswith('  node')] == [
        'node 0 (stage 0):', 'node 1 (stage 1):']
    rows = [line.split()[0] for line in out if line.startswith('    cpu')]
    assert rows == ['cpu(0)', 'cpu(0)', 'cpu(1)']  # node 1's temporary space on its cpu(0)
    assert out[-1].startswith('total ') and "on 2 node(s); the most on node 0's cpu(0)" in out[-1]
