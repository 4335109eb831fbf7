"""Initial values are a function of the seed and each parameter's name only
(:mod:`mp_symbolic.core.optim.initial`): ``init_params(initializer=...)``,
``fit(initializer=...)`` and the twin's ``initialize`` give every plan the
same values, bit for bit: one device, stages, micro-batches, schedules,
replicas, tensor-parallel shards, node processes."""
import os

import mxnet as mx
import numpy as np
import pytest

from mp_symbolic.core.optim.initial import Drawn

import init_worker
from conftest import reserved_port, run_node_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, 'tests', 'init_worker.py')

PLANS = [
    dict(devices='cpu:0,cpu:1'),
    dict(devices='cpu:0,cpu:1,cpu:2'),
    dict(devices='cpu:0,cpu:1,cpu:2', chunks=2, schedule='1f1b'),
    dict(devices='cpu:0,cpu:1,cpu:2', chunks=2, schedule='gpipe'),
    dict(devices='cpu:0,cpu:1', chunks=4, schedule='interleaved', virtual=2),
    dict(devices='cpu:0,cpu:1,cpu:2,cpu:3', replicas=2),
    dict(devices='cpu:0+cpu:1,cpu:2', shards=2),
    dict(devices='cpu:0,cpu:1', twin=True),
    dict(devices='cpu:0+cpu:1,cpu:2', shards=2, twin=True),
]


def _ids(table):
    return ['-'.join('%s=%s' % i for i in c.items() if i[0] != 'run') for c in table]


def _equal(got, expected):
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.fixture(scope='module')
def one_device():
    return init_worker.initial('cpu:0')


@pytest.mark.parametrize('plan', PLANS, ids=_ids(PLANS))
def test_init_params_with_an_initializer_gives_every_plan_the_initial_values_of_one_device(
        one_device, plan):
    _equal(init_worker.initial(**plan), one_device)


def test_an_initial_value_depends_on_the_parameters_name_not_on_what_else_is_drawn():
    def values(names):
        drawn = Drawn(mx.init.Uniform(1.0))
        arrays = {n: mx.nd.zeros((3, 4)) for n in names}
        mx.random.seed(7)
        for name in names:
            drawn(mx.init.InitDesc(name), arrays[name])
        drawn.close()
        return {n: a.asnumpy() for n, a in arrays.items()}
    alone = values(['b_weight'])['b_weight']
    np.testing.assert_array_equal(values(['a_weight', 'b_weight', 'c_weight'])['b_weight'], alone)
    others = values(['c_weight', 'b_weight'])
    np.testing.assert_array_equal(others['b_weight'], alone)
    assert not np.array_equal(others['c_weight'], alone)


def test_init_params_leaves_the_random_state_alike_on_every_plan_and_numpys_as_it_was():
    def after(devices):
        state = np.random.get_state()
        init_worker.initial(devices)
        assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state()[1:3],
                                                        state[1:3]))
        return mx.nd.random.uniform(shape=(5,)).asnumpy()
    np.testing.assert_array_equal(after('cpu:0,cpu:1,cpu:2'), after('cpu:0'))


def _run(folder, port, count, table, timeout=300):
    """``init_worker.py`` as ``count`` node processes over ``table``: per
    configuration, every array they hold by name (no two nodes holding the
    same one)."""
    out = os.path.join(folder, 'init')
    run_node_workers(WORKER, out, count, port, table, timeout)
    results = []
    for k in range(len(table)):
        held = {}
        for rank in range(count):
            with np.load('%s%d_%d.npz' % (out, k, rank)) as data:
                mine = dict(data)
            assert mine and not set(mine) & set(held), sorted(set(mine) & set(held))
            held.update(mine)
        results.append(held)
    return results


NODE_PLANS = [
    dict(run='initial', devices='cpu:0,cpu:1'),
    dict(run='initial', devices='cpu:0,cpu:1,cpu:2', chunks=2, schedule='gpipe'),
    dict(run='initial', devices='cpu:0,cpu:1,cpu:2,cpu:3', chunks=2, replicas=2),
    dict(run='initial', devices='cpu:0+cpu:1,cpu:2+cpu:3', shards=2),
    dict(run='initial', devices='cpu:0,cpu:1', chunks=4, schedule='interleaved', virtual=2),
    dict(run='fitted', devices='cpu:0,cpu:1,cpu:2'),
]


@pytest.fixture(scope='module')
def two_nodes(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp('init'))
    with reserved_port() as port:
        return _run(folder, port, 2, NODE_PLANS)


@pytest.mark.parametrize('k', range(len(NODE_PLANS) - 1), ids=_ids(NODE_PLANS[:-1]))
def test_init_params_over_two_nodes_gives_the_initial_values_of_one_device(
        two_nodes, one_device, k):
    _equal(two_nodes[k], one_device)


def test_fit_with_an_initializer_over_two_nodes_ends_with_one_process_parameters(two_nodes):
    # the Python route of docs/nodes.md, after mx.random.seed(0)
    config = dict(NODE_PLANS[-1])
    del config['run']
    _equal(two_nodes[-1], init_worker.fitted(**config))
