"""The plan chosen for you: Pipeline(..., plan='auto', memory_per_device=...),
train --plan auto --memory-per-device SIZE, and plan's ranked candidates."""
from dataclasses import replace
import json
import os
import re
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

import mp_symbolic
from mp_symbolic import Pipeline
from mp_symbolic.core import schedule as schedules
from mp_symbolic.core.planning.estimate import batched_binds
from mp_symbolic.core.planning.planner import Planner, PlanError, simulate
from mp_symbolic.core.planning.sizes import parse_size
from mp_symbolic.training.cli import main
from mp_symbolic.training.tasks import load_task

from bench import estimate as bench

from conftest import cli_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 'cpu:0,cpu:1'
BUDGET = '4KiB'  # the regression's plans need 2.5 to 7 KiB on a device


def _regression():
    task, _ = load_task('regression')
    planner = Planner(loss=task.graph_loss, label_name=task.label,
                      label_shapes=[(task.label, (task.batch_size,) + tuple(task.label_shape))],
                      chunks=(1, 2), schedules=('gpipe',), balances=('size',), repeats=3)
    return task, planner, (task.batch_size,) + tuple(task.sample_shapes[0])


@pytest.fixture(scope='module')
def ranked_output():
    """``plan --plan auto`` on the regression: its exit status and stdout."""
    import io
    from contextlib import redirect_stdout
    out = io.StringIO()
    with redirect_stdout(out):
        status = cli_status(main, ['plan', '--task', 'regression', '--devices', DEVICES,
                                   '--plan', 'auto', '--memory-per-device', BUDGET])
    return status, out.getvalue()


_ROW = re.compile(r'^  (\d+)\s+(--devices .*?)\s{2,}([\d.]+ (?:B|KiB|MiB|GiB))\s+'
                  r'([\d.]+) ms\s+(yes|no)$')


def _size(text):
    number, unit = text.split()
    return float(number) * {'B': 1, 'KiB': 1 << 10, 'MiB': 1 << 20, 'GiB': 1 << 30}[unit]


@pytest.mark.slow
def test_plan_auto_prints_candidates_ranked_by_predicted_time_within_budget_and_why(
        ranked_output):
    status, out = ranked_output
    assert status == 0, out
    rows = [_ROW.match(line).groups() for line in out.splitlines() if _ROW.match(line)]
    assert len(rows) >= 8
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1))
    fits = [r[4] == 'yes' for r in rows]
    assert fits[0] and fits == sorted(fits, reverse=True)  # those that fit come first
    budget = parse_size(BUDGET)
    for _, _, memory, _, fit in rows:
        assert (_size(memory) <= budget) == (fit == 'yes') or abs(_size(memory) - budget) < 52
    times = [float(r[3]) for r in rows if r[4] == 'yes']
    assert times == sorted(times)
    chosen = [line for line in out.splitlines() if line.startswith('chosen: ')]
    assert len(chosen) == 1 and chosen[0].startswith('chosen: %s: the least predicted step '
                                                     'time' % rows[0][1])
    # the memory table that follows is the chosen plan's
    assert re.search(r'^regression: \d stage\(s\) on ', out, re.M)


@pytest.mark.slow
def test_plan_auto_refuses_a_budget_no_plan_fits_in_one_line_with_the_smallest_need():
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'plan', '--task', 'regression',
                           '--devices', 'cpu:0', '--plan', 'auto', '--memory-per-device', '1KiB'],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and 'Traceback' not in done.stderr
    assert lines[0].startswith('error: --memory-per-device: expected a budget a plan fits, '
                               'found 1.0 KiB (1024 bytes) below the smallest memory any of ')
    assert re.search(r'needs on a device: [\d.]+ KiB \(\d+ bytes, --devices cpu:0 ', lines[0])


@pytest.mark.slow
def test_planner_smallest_need_is_the_least_budget_it_accepts():
    task, planner, sample = _regression()
    with pytest.raises(PlanError) as refused:
        planner.choose(task.make_blocks(), DEVICES, sample, 1024)
    smallest = int(re.search(r'needs on a device: [^(]*\((\d+) bytes', str(refused.value))[1])
    assert smallest > 1024
    ranking = planner.choose(task.make_blocks(), DEVICES, sample, smallest)
    assert ranking.best.largest <= smallest
    with pytest.raises(PlanError):
        planner.choose(task.make_blocks(), DEVICES, sample, smallest - 1)


@pytest.mark.parametrize('text, size', [('2GiB', 2 << 30), ('512MB', 512 * 10 ** 6),
                                        ('1.5G', 3 << 29), ('100', 100), ('64 kib', 64 << 10),
                                        ('3KB', 3000), (2048, 2048)])
def test_parse_size_reads_binary_and_decimal_units(text, size):
    assert parse_size(text) == size


def test_memory_per_device_that_is_not_a_size_is_refused_in_one_line(capsys):
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'train', '--plan', 'auto',
                           '--memory-per-device', '2 gigs'], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and 'Traceback' not in done.stderr
    assert done.stderr.strip() == (
        "error: python -m mp_symbolic train: argument --memory-per-device: expected a size "
        "such as 2GiB, 512MB, 1.5G or a number of bytes, found '2 gigs' (see --help)")
    for text, expected in (('0', 'a finite size of at least one byte'),
                           ('-1G', 'a size such as 2GiB'), ('1e400', 'a finite size'),
                           ('2 GiBs', 'a size such as 2GiB'), ('', 'a size such as 2GiB')):
        assert cli_status(main, ['train', '--plan', 'auto', '--memory-per-device=' + text]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and 'argument --memory-per-device: expected %s' % expected \
            in err[0], err
    for bad in ('abc', None, True, float('nan'), 0):
        with pytest.raises(ValueError, match='^memory_per_device: expected a'):
            parse_size(bad)


def test_plan_auto_refuses_a_flag_it_chooses_and_a_budget_without_it(capsys):
    for argv, line in (
            (['--plan', 'auto', '--chunks', '2'],
             'error: --chunks: expected the planner to choose it under --plan auto, found it '
             'given'),
            (['--memory-per-device', '2GiB'],
             'error: --memory-per-device: expected it with --plan auto, found it alone')):
        assert cli_status(main, ['plan', '--task', 'regression'] + argv) == 2
        assert capsys.readouterr().err.strip() == line
    with pytest.raises(ValueError, match="^chunks: expected the planner to choose it"):
        Pipeline(load_task('regression')[0].make_blocks(), DEVICES, sample=(100, 2), chunks=2,
                 plan='auto')
    with pytest.raises(ValueError, match="^memory_per_device: expected it with plan='auto'"):
        Pipeline(load_task('regression')[0].make_blocks(), DEVICES, sample=(100, 2),
                 memory_per_device='1GiB')


@pytest.mark.slow
def test_plan_auto_builds_a_pipeline_whose_estimated_memory_per_device_is_within_budget():
    task, planner, sample = _regression()
    budget = parse_size(BUDGET)
    pipe = Pipeline(task.make_blocks(), DEVICES, sample=sample, plan=planner,
                    memory_per_device=BUDGET)
    chosen = pipe.planned.best.candidate
    assert (pipe.plan.spec, pipe.chunks, pipe.replicas, pipe.schedule) == \
        (chosen.devices, chosen.chunks, chosen.replicas, chosen.schedule)
    assert any(not s.fits for s in pipe.planned.ranked)  # the budget decided
    table = mp_symbolic.estimate_memory(
        pipe, data_shapes=task.data_shapes(task.batch_size, pipe.data_names()),
        label_shapes=[(task.label, (task.batch_size,) + tuple(task.label_shape))],
        loss=task.graph_loss, optimizer='sgd', optimizer_params={'momentum': 0.9})
    assert max(row.total for row in table) <= budget
    assert max(row.total for row in table) == pipe.planned.best.largest


@pytest.mark.slow
def test_plan_auto_on_a_gluoncv_cnn_picks_a_plan_within_budget_that_trains():
    """GluonCV's CIFAR ResNet-20 (BatchNorm, random initial values) under
    plan='auto' and 24 MiB a device: some of its plans need more, the pick's
    estimate is within the budget, and the Pipeline it builds trains."""
    from gluoncv.model_zoo import get_model  # pylint: disable=import-outside-toplevel
    mx.random.seed(0)
    net = get_model('cifar_resnet20_v1', classes=10)
    net.initialize(mx.init.Xavier())
    sample = (32, 3, 32, 32)
    planner = Planner(chunks=(1, 2, 4), schedules=('gpipe', '1f1b'), balances=('size',),
                      repeats=2)
    pipe = Pipeline(net, DEVICES, sample=sample, plan=planner, memory_per_device='24MiB')
    assert any(not s.fits for s in pipe.planned.ranked)  # the budget decided
    table = mp_symbolic.estimate_memory(pipe, optimizer_params={'momentum': 0.9})  # planner's
    assert max(row.total for row in table) <= parse_size('24MiB')
    assert max(row.total for row in table) == pipe.planned.best.largest
    mod = pipe.module()
    mod.bind(data_shapes=[(pipe.data_names()[0], sample)],
             label_shapes=[('softmax_label', (32,))])
    mod.init_params()
    mod.init_optimizer(kvstore='local' if pipe.replicas > 1 else None, optimizer='sgd',
                       optimizer_params={'learning_rate': 0.1, 'momentum': 0.9})
    rng = np.random.default_rng(0)
    batch = mx.io.DataBatch([mx.nd.array(rng.normal(size=sample))],
                            [mx.nd.array(rng.integers(0, 10, 32))])
    for _ in range(2):
        mod.forward_backward(batch)
        mod.update()
    assert np.isfinite(mod.get_outputs()[0].asnumpy()).all()


def test_train_plan_auto_trains_the_chosen_plan(tmp_path, capsys):
    out = str(tmp_path / 'run')
    status = cli_status(main, ['train', '--task', 'regression', '--devices', DEVICES,
                               '--plan', 'auto', '--memory-per-device', BUDGET, '--epochs', '2',
                               '--no-memory', '--no-progress', '--out', out])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    chosen = re.search(r'^plan auto: (--devices \S+)(.*?): the least predicted', printed.out,
                       re.M)
    assert chosen, printed.out
    flags = chosen[2]
    chunks = int(re.search(r'--chunks (\d+)', flags)[1])
    losses = [float(x) for x in re.findall(r'mean batch MSE (\S+)', printed.out)]
    assert len(losses) == 2 and losses[-1] < losses[0]
    summary = mp_symbolic.read_checkpoint(out).summary['config']
    assert summary['chunks'] == chunks and summary['devices'] == chosen[1].split()[1]


def test_simulation_shares_the_cores_the_devices_share():
    two = schedules.gpipe(2, 1)
    cost = {(0, 'F'): 1.0, (0, 'B'): 1.0, (1, 'F'): 1.0, (1, 'B'): 1.0}
    assert simulate(two, cost) == pytest.approx(4.0)  # a chain: nothing runs at once
    # two replicas at once: as fast as one where the devices share nothing,
    # twice as long where two busy devices do one device's work
    assert simulate(two, cost, replicas=2, capacity={2: 2.0, 4: 4.0}) == pytest.approx(4.0)
    assert simulate(two, cost, replicas=2, capacity={2: 1.0}) == pytest.approx(8.0)
    # GPipe's fill and drain on devices sharing nothing: the schedule's own clock
    four = schedules.gpipe(2, 4)
    rows = schedules.timeline(four)
    assert simulate(four, cost, capacity={1: 1.0, 2: 2.0}) == \
        pytest.approx(max(row[-1][1] for row in rows))
    # the same on devices that share one core's work: every action once, in turn
    assert simulate(four, cost, capacity={1: 1.0, 2: 1.0}) == pytest.approx(16.0)


def test_simulation_counts_each_shard_of_a_stage_as_a_busy_device():
    one = schedules.gpipe(1, 1)
    cost = {(0, 'F'): 1.0, (0, 'B'): 1.0}
    # a stage of 2 shards measured alone on 2 devices that do 1.5 devices' work:
    # alone it runs at its measured speed
    assert simulate(one, cost, capacity={2: 1.5}, shards=2) == pytest.approx(2.0)
    # two replicas of it keep 4 devices busy, which do 2 devices' work: each
    # advances at (2 / 4) / (1.5 / 2) of its measured speed
    capacity = {2: 1.5, 4: 2.0}
    assert simulate(one, cost, replicas=2, capacity=capacity, shards=2) == \
        pytest.approx(2.0 * 1.5)
    # as stages of one device the same replicas keep 2 devices busy
    assert simulate(one, cost, replicas=2, capacity=capacity) == pytest.approx(2.0 / 0.75)


@pytest.mark.slow
def test_batched_binds_estimate_what_one_child_per_graph_estimates():
    cells = [bench._cell('regression', schedule='1f1b', chunks=2),  # pylint: disable=W0212
             bench._cell('regression', mirror=True)]  # pylint: disable=protected-access
    alone = [bench.estimate(cell) for cell in cells]
    with batched_binds():
        together = [bench.estimate(cell) for cell in cells]
    assert together == alone
    assert json.dumps(together)  # plain values


@pytest.mark.slow
def test_bench_plan_measures_a_plan_with_sharded_optimizer_state_as_sharded():
    """bench.plan's peak memory of a pick with ZeRO-1 is measured with each
    replica holding its share of the optimizer state, as the plan runs."""
    from bench import plan as bench_plan  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.planning.planner import Candidate  # pylint: disable=import-outside-toplevel
    task, _ = load_task('regression')
    sharded = Candidate('cpu:0,cpu:1', 1, 2, 1, 'gpipe', shard_optimizer=True)
    cell = bench_plan._cell(task, sharded)  # pylint: disable=protected-access
    measured = bench.measure([cell])[0]
    estimated = bench.estimate(cell)
    held = [measured[d]['optimizer'] for d in ('cpu(0)', 'cpu(1)')]
    assert held == [estimated[d]['optimizer'] for d in ('cpu(0)', 'cpu(1)')]
    assert sum(held) == measured['cpu(0)']['params']  # one copy of the state, dealt



@pytest.mark.slow
def test_bench_plan_plans_the_sharded_lm_and_measures_a_sharded_pick_as_sharded(monkeypatch):
    """bench.plan's lm-tp entry plans the language model under
    tensor_parallel='auto' (stages of two shards among its candidates,
    built as the Pipeline builds them), and the peak memory of a sharded
    pick is measured with its layers sharded over the stage's devices, as
    the plan runs and as the estimate has it."""
    from bench import plan as bench_plan  # pylint: disable=import-outside-toplevel
    narrow = bench_plan._planner  # pylint: disable=protected-access

    def planner(task):
        found = narrow(task)
        found.chunks, found.schedules, found.balances = (1,), ('gpipe',), ('size',)
        found.replicas, found.mirror, found.repeats = (1,), False, 2
        return found
    monkeypatch.setattr(bench_plan, '_planner', planner)
    task, ranking, _ = bench_plan.plan('lm-tp', None)
    sharded = [s.candidate for s in ranking.ranked if s.candidate.shards == 2]
    assert [c.devices for c in sharded] == ['cpu:0+cpu:1']
    assert {s.candidate.shards for s in ranking.ranked} == {1, 2}
    cell = bench_plan._cell(task, sharded[0])  # pylint: disable=protected-access
    measured = bench.measure([cell])[0]
    estimated = bench.estimate(cell)
    held = [measured[d]['params'] for d in ('cpu(0)', 'cpu(1)')]
    assert held == [estimated[d]['params'] for d in ('cpu(0)', 'cpu(1)')]
    assert min(held) > 0.3 * sum(held)  # the sharded layers' halves on each device


# -- shards: tensor-parallel stages as candidates ------------------------------------

TP_BUDGET = '1MiB'  # the wide MLP needs 1.4 MiB on a device whole, 0.9 MiB over two shards


class _WideMLP(mx.gluon.HybridBlock):
    """A transformer's MLP, 64 -> 1024 -> 64: 512 KiB of weights, on one
    device 1.5 MiB with their gradients and momentum; one block, so that no
    pipeline of its blocks splits it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.ffn_1 = mx.gluon.nn.Dense(1024, in_units=64, activation='relu',
                                           prefix='ffn_1_')
            self.ffn_2 = mx.gluon.nn.Dense(64, in_units=1024, prefix='ffn_2_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.ffn_2(self.ffn_1(x))


def _wide():
    mx.random.seed(0)
    net = _WideMLP(prefix='wide_')
    net.initialize(mx.init.Xavier())
    return net


def _tp_planner():
    return Planner(chunks=(1, 2), schedules=('gpipe',), balances=('size',), repeats=3)


@pytest.mark.slow
def test_planner_lists_shard_candidates_and_picks_the_sharded_one_only_sharding_fits():
    net = _wide()
    ranking = _tp_planner().choose([net], DEVICES, (8, 64), TP_BUDGET, tensor_parallel='auto')
    shards = {s.candidate.shards for s in ranking.ranked}
    assert shards == {1, 2}
    for s in ranking.ranked:
        assert ('+' in s.candidate.devices) == (s.candidate.shards == 2)
        assert s.candidate.tensor_parallel == 'auto'
    fitting = [s for s in ranking.ranked if s.fits]
    assert fitting and all(s.candidate.shards == 2 for s in fitting)
    assert all(not s.fits for s in ranking.ranked if s.candidate.shards == 1)
    best = ranking.best.candidate
    assert best.devices == 'cpu:0+cpu:1' and best.pipeline_args()['tensor_parallel'] == 'auto'
    assert any('cpu:0+cpu:1' in line for line in ranking.lines())


def test_scoring_shard_candidates_leaves_the_network_given_unchanged():
    net = _wide()
    children = dict(net._children)  # pylint: disable=protected-access
    values = {n: (p.data().asnumpy().copy(), p.list_ctx())
              for n, p in net.collect_params().items()}
    _tp_planner().choose([net], DEVICES, (8, 64), None, tensor_parallel='auto')
    assert dict(net._children) == children  # pylint: disable=protected-access
    assert (type(net.ffn_1), type(net.ffn_2)) == (mx.gluon.nn.Dense, mx.gluon.nn.Dense)
    assert sorted(net.collect_params()) == sorted(values)
    for name, param in net.collect_params().items():
        assert (param.data().asnumpy() == values[name][0]).all()
        assert param.list_ctx() == values[name][1]


@pytest.mark.slow
def test_plan_auto_with_tensor_parallel_auto_trains_the_sharded_pick_within_budget():
    net = _wide()
    pipe = Pipeline([net], DEVICES, sample=(8, 64), plan=_tp_planner(),
                    memory_per_device=TP_BUDGET, tensor_parallel='auto')
    assert pipe.plan.spec == 'cpu:0+cpu:1' == pipe.planned.best.candidate.devices
    assert pipe.sharding.shards == 2
    budget = parse_size(TP_BUDGET)
    shapes = dict(data_shapes=[('data', (8, 64))], label_shapes=[('softmax_label', (8,))],
                  loss='softmax', optimizer='sgd', optimizer_params={'momentum': 0.9})
    estimated = mp_symbolic.estimate_memory(pipe, **shapes)
    assert max(row.total for row in estimated) == pipe.planned.best.largest <= budget
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 64)).astype(np.float32)
    y = rng.integers(0, 64, 64).astype(np.float32)
    mod = pipe.module(loss='softmax')
    losses = []
    mx.random.seed(0)
    mod.fit(mx.io.NDArrayIter(X, y, batch_size=8), num_epoch=3, optimizer='sgd',
            optimizer_params={'learning_rate': 0.1, 'momentum': 0.9},
            eval_metric='ce', initializer=mx.init.Xavier(),
            epoch_end_callback=lambda *_: losses.append(
                mod.score(mx.io.NDArrayIter(X, y, batch_size=8), 'ce')[0][1]))
    assert losses[-1] < losses[0]
    # the arrays each device holds after training: half of every weight, its
    # gradient and momentum on each shard's device, within the budget
    measured = mp_symbolic.memory_table(mod)
    params = sum(p.data().size * 4 for p in net.collect_params().values())
    for device in ('cpu(0)', 'cpu(1)'):
        row = measured[device]
        assert row.optimizer > 0
        assert row.params + row.grads + row.optimizer < 0.6 * 3 * params
        assert row.total <= budget
    assert 3 * params > budget  # whole on one device, they alone would not fit


def test_plan_auto_refuses_a_tensor_parallel_plan_other_than_auto_in_one_line():
    for value in ({'*ffn_1*': 'column'}, 'column', True):
        with pytest.raises(PlanError) as refused:
            Pipeline([_wide()], DEVICES, sample=(8, 64), plan='auto', tensor_parallel=value)
        line = str(refused.value)
        assert '\n' not in line
        assert line.startswith("tensor_parallel: expected None or 'auto' under plan='auto' "
                               "(the planner chooses the shards), found ")
    with pytest.raises(PlanError, match="^tensor_parallel: expected None or 'auto' for the "):
        _tp_planner().choose([_wide()], DEVICES, (8, 64), tensor_parallel='column')



def _two_wide(values=None):
    """Two wide MLPs, a block each (fixed names): two stages can split them."""
    mx.random.seed(0)
    blocks = [_WideMLP(prefix='wide%d_' % i) for i in range(2)]
    for block in blocks:
        block.initialize(mx.init.Xavier())
        for name, param in block.collect_params().items():
            if values is not None:
                param.set_data(values[name])
    return blocks


def _trained(pipe, values, X, y):
    """The outputs of one SGD step of ``pipe``'s Module from ``values``,
    and its parameters after it, by their unsplit names."""
    mod = pipe.module(loss='softmax')
    mod.bind(data_shapes=[('data', X.shape)], label_shapes=[('softmax_label', y.shape)])
    mod.init_params(arg_params=values, aux_params={}, allow_missing=False, allow_extra=True)
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 0.5,
                                                          'momentum': 0.9})
    mod.forward_backward(mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)]))
    mod.update()
    outputs = [o.asnumpy() for o in mod.get_outputs()]
    return outputs, {n: v.asnumpy() for n, v in mod.get_params()[0].items()}


@pytest.mark.slow
def test_shard_plans_over_four_devices_run_and_equal_the_unsharded_plan():
    """Over four devices under tensor_parallel='auto' the planner scores
    two stages of two shards and one stage of four shards; each, built
    from its candidate's Pipeline arguments, trains a step equal to the
    network on one device, its outputs and parameters within float
    tolerance."""
    four = 'cpu:0,cpu:1,cpu:2,cpu:3'
    values = {n: p.data().copy() for b in _two_wide() for n, p in b.collect_params().items()}
    planner = Planner(chunks=(1,), schedules=('gpipe',), balances=('size',), replicas=(1,),
                      mirror=False, repeats=2)
    ranking = planner.choose(_two_wide(values), four, (8, 64), None, tensor_parallel='auto')
    by_spec = {s.candidate.devices: s.candidate for s in ranking.ranked}
    wanted = {'cpu:0+cpu:1,cpu:2+cpu:3': (2, 2), 'cpu:0+cpu:1+cpu:2+cpu:3': (1, 4)}
    for spec, (stages, shards) in wanted.items():
        assert spec in by_spec, sorted(by_spec)
        assert (by_spec[spec].stages, by_spec[spec].shards) == (stages, shards)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(8, 64)).astype(np.float32)
    y = rng.integers(0, 64, 8).astype(np.float32)
    expected, after = _trained(Pipeline(_two_wide(values), 'cpu:0', sample=(8, 64)),
                               values, X, y)
    for spec in wanted:
        pipe = Pipeline(_two_wide(values), sample=(8, 64), **by_spec[spec].pipeline_args())
        assert pipe.plan.spec == spec and pipe.sharding.shards == wanted[spec][1]
        outputs, params = _trained(pipe, values, X, y)
        for ours, theirs in zip(outputs, expected):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
        assert sorted(params) == sorted(after)
        for name, value in after.items():
            np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=1e-6,
                                       err_msg=name)


_SHARDED_TASK = '''
import numpy as np
from mxnet import gluon
import mp_symbolic


class Wide(gluon.HybridBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.up = mp_symbolic.ColumnParallelDense(1024, 64, 2, activation='relu',
                                                      prefix='up_')
            self.down = mp_symbolic.RowParallelDense(64, 1024, 2, prefix='down_')

    def hybrid_forward(self, F, x):
        return self.down(self.up(x))


def task():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 64)).astype(np.float32)
    y = rng.integers(0, 64, 64).astype(np.float32)
    return mp_symbolic.Task(name='wide', blocks=lambda: [Wide(prefix='wide_')], loss='softmax',
                            train=(X, y), batch_size=8, num_epochs=1, lr=0.1, momentum=0.9)
'''


@pytest.mark.slow
def test_train_plan_auto_runs_a_network_of_parallel_layers_on_the_stage_of_shards_it_chose(
        tmp_path, capsys):
    path = tmp_path / 'wide_task.py'
    path.write_text(_SHARDED_TASK)
    argv = ['--task', str(path), '--devices', DEVICES, '--plan', 'auto',
            '--memory-per-device', TP_BUDGET]
    assert cli_status(main, ['plan'] + argv) == 0
    printed = capsys.readouterr().out
    assert re.search(r'^plans of wide on cpu:0, cpu:1, ranked ', printed, re.M), printed
    rows = [_ROW.match(line).groups() for line in printed.splitlines() if _ROW.match(line)]
    specs = {r[1].split()[1]: r[4] for r in rows}
    assert 'cpu:0' in specs and 'cpu:0+cpu:1' in specs  # one device holds both shards, or two
    assert specs['cpu:0'] == 'no' and rows[0][1].split()[1] == 'cpu:0+cpu:1'
    out = str(tmp_path / 'run')
    status = cli_status(main, ['train'] + argv + ['--epochs', '1', '--no-memory',
                                                  '--no-progress', '--out', out])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    chosen = re.search(r'^plan auto: --devices (\S+) ', printed.out, re.M)
    assert chosen and chosen[1] == 'cpu:0+cpu:1', printed.out
    assert mp_symbolic.read_checkpoint(out).summary['config']['devices'] == 'cpu:0+cpu:1'


class _Host:
    """A host of fake timings: a timed call takes the work of the runs it
    stepped (``k`` devices at once do ``capacity`` devices' work) and
    ``slow`` times as long during calls ``busy`` (other work on the host)."""

    def __init__(self, capacity=2.0, busy=range(0), slow=3.0):
        self.capacity, self.busy, self.slow = capacity, busy, slow
        self.calls, self.ran = 0, []

    def seconds(self, fn):
        self.ran = []
        fn()
        kinds = {kind for kind, _, _ in self.ran}
        devices = {device for _, device, _ in self.ran}
        work = sum(cost for _, _, cost in self.ran)
        taken = work / min(len(devices), self.capacity) if kinds == {'step'} else work
        taken *= self.slow if self.calls in self.busy else 1.0
        self.calls += 1
        return taken


def _fake_timings(monkeypatch, host, cores=2):
    """A ``Timings`` of two stand-in CPU devices whose stage graphs' passes
    run on ``host`` (forward 1 s, forward and backward 3 s, times the
    graph's ``scale``)."""
    # pylint: disable=import-outside-toplevel
    import types
    import mxnet as mx
    from mp_symbolic.core.base import timing
    from mp_symbolic.core.engine import stages
    from mp_symbolic.core.planning import planner as planning

    class Run(planning._StageRun):  # pylint: disable=protected-access
        def __init__(self, symbol, shapes, types_, device, inputs, groups=None):
            # pylint: disable=super-init-not-called
            del shapes, types_, inputs, groups
            self.scale, self.device = symbol or 1.0, device

        def forward(self):
            host.ran.append(('forward', self.device, self.scale))

        def step(self, wait=True):
            del wait
            host.ran.append(('step', self.device, 3.0 * self.scale))

    monkeypatch.setattr(timing, 'seconds', host.seconds)
    monkeypatch.setattr(planning, '_StageRun', Run)
    monkeypatch.setattr(planning, '_stage_symbol', lambda placed: None)
    monkeypatch.setattr(stages, 'variable_specs', lambda *args: ({}, {}))
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: set(range(cores)),
                        raising=False)
    found = planning.Timings.__new__(planning.Timings)
    found.search = types.SimpleNamespace(pool=[mx.cpu(0), mx.cpu(1)], batch=8,
                                         planner=types.SimpleNamespace(repeats=5))
    found.stage, found._binds, found._micro = {}, {}, {}  # pylint: disable=protected-access
    found._training_graph = lambda pipe: None  # pylint: disable=protected-access
    found._micro_inputs = lambda pipe, size: [('data', (size, 2))]  # pylint: disable=W0212
    return found


def test_capacity_of_stand_in_cpus_is_at_most_the_cores_the_process_may_use(monkeypatch):
    """Two devices that each run as fast alongside the other as alone
    still do one core's work at once where the process may use one core."""
    timings = _fake_timings(monkeypatch, _Host(capacity=2.0), cores=1)
    assert timings._capacity(None) == {1: 1.0, 2: 1.0}  # pylint: disable=protected-access
    timings = _fake_timings(monkeypatch, _Host(capacity=2.0), cores=2)
    assert timings._capacity(None) == {1: 1.0, 2: 2.0}  # pylint: disable=protected-access


def test_capacity_is_unmoved_by_the_host_load_changing_during_its_probe(monkeypatch):
    """Other work on the host during the probe's first calls, then none:
    the capacity is the devices', as on a host that stays quiet."""
    # pylint: disable=protected-access
    quiet = _fake_timings(monkeypatch, _Host(capacity=1.25))._capacity(None)
    busy = _fake_timings(monkeypatch, _Host(capacity=1.25, busy=range(8)))._capacity(None)
    assert quiet == {1: 1.0, 2: pytest.approx(1.25)}
    assert busy == quiet


def test_retimed_stage_graphs_each_keep_a_pass_a_burst_of_load_left_alone(monkeypatch):
    """A burst of other work on the host as the retiming begins, longer
    than one graph's passes: every graph still keeps its quiet time."""
    host = _Host(busy=range(12))
    timings = _fake_timings(monkeypatch, host)
    for i, scale in enumerate((1.0, 2.0, 0.5)):
        key = ('graph %d' % i, (), 'cpu(0)')
        timings._binds[key] = (scale, {}, {}, 'cpu(0)', set(), None)  # pylint: disable=W0212
        timings.stage[key] = (3 * scale, 6 * scale)  # slowed the first time too
    timings.retime()
    assert [timings.stage[key] for key in timings._binds] == [  # pylint: disable=W0212
        pytest.approx((scale, 2 * scale)) for scale in (1.0, 2.0, 0.5)]


def test_a_forward_slowed_in_one_timing_leaves_a_stage_no_faster_than_its_fastest_step(
        monkeypatch):
    """A burst of other work on the host while the retiming times the
    forward passes, gone as it times the steps: the graph keeps its first
    forward and backward, not the retimed backward (the step less a slowed
    forward), and its forward and backward take no less than a step."""
    host = _Host(busy=range(15))  # the 5 x 3 timed forward passes of one graph
    timings = _fake_timings(monkeypatch, host)
    key = ('graph', (), 'cpu(0)')
    timings._binds[key] = (1.0, {}, {}, 'cpu(0)', set(), None)  # pylint: disable=W0212
    timings._micro[key] = 8  # pylint: disable=protected-access
    timings.stage[key] = (1.0, 2.0)  # a quiet first timing: forward 1 s, step 3 s
    timings.retime()
    assert timings.stage[key] == pytest.approx((1.0, 2.0))
    assert sum(timings.stage[key]) == pytest.approx(3.0)


def test_capacity_of_two_devices_is_what_a_real_step_of_two_replicas_shows(monkeypatch):
    """Two replicas' measured step, each replica's graph taking 3 s alone,
    beyond a step's own cost and the update and sum of gradients: 4.8 s
    of work is two devices doing 1.25 devices' work, whatever the
    synthetic probe read; at most the cores the process may use."""
    from mp_symbolic.core.planning.planner import Candidate  # pylint: disable=C0415
    for cores, expected in ((2, 1.25), (1, 1.0)):
        timings = _fake_timings(monkeypatch, _Host(), cores=cores)
        timings.capacity = {1: 1.0, 2: 2.0}  # the synthetic probe's
        timings.params, timings.update, timings.add = 1000, 1e-6, 1e-7
        timings.stage = {'whole': (1.8, 3.6), 'half': (1.0, 2.0)}
        update, reduce, per_step = 1000 * 1e-6, 2 * 2 * 1000 * 1e-7, 0.5
        timings._probes = {  # pylint: disable=protected-access
            'graph': [Candidate('cpu:0', 1, 1, 1, 'gpipe'), ['whole'], 1, 2,
                      5.4 + update + per_step],
            'replica': [Candidate('cpu:0,cpu:1', 1, 2, 1, 'gpipe'), ['half'], 1, 4,
                        2 * 3.0 / 1.25 + update + reduce + per_step]}
        timings.fit_steps()
        assert timings.capacity == {1: 1.0, 2: pytest.approx(expected)}
        assert timings.steps['graph'] == pytest.approx(per_step)
        if cores == 2:  # the probe's step is all work and per-step cost
            assert timings.steps['replica'] == pytest.approx(0.0, abs=1e-9)


def test_one_graphs_micro_batches_past_the_first_cost_what_its_probe_of_four_shows(
        monkeypatch):
    """One device's one graph measured 0.5 s beyond its work on one
    micro-batch and 0.8 s on four: each micro-batch past the first costs
    0.1 s, so eight cost 0.7 s more than one."""
    from mp_symbolic.core.planning.planner import Candidate  # pylint: disable=C0415
    timings = _fake_timings(monkeypatch, _Host())
    timings.capacity = {1: 1.0, 2: 2.0}
    timings.params, timings.update, timings.add = 0, 0.0, 0.0
    timings.stage = {'whole': (1.8, 3.6), 'quarter': (0.5, 1.0)}
    timings._probes = {  # pylint: disable=protected-access
        'graph': [Candidate('cpu:0', 1, 1, 1, 'gpipe'), ['whole'], 1, 2, 5.4 + 0.5],
        'chunks': [Candidate('cpu:0', 1, 1, 4, 'gpipe'), ['quarter'], 1, 8, 6.0 + 0.8]}
    timings.fit_steps()
    eight = Candidate('cpu:0', 1, 1, 8, 'gpipe')
    made = schedules.make('gpipe', 1, 8)
    assert timings.overhead(eight, made) == pytest.approx(0.5 + 7 * 0.1)
    assert timings.overhead(Candidate('cpu:0', 1, 1, 1, 'gpipe'),
                            schedules.make('gpipe', 1, 1)) == pytest.approx(0.5)


def test_one_graphs_micro_batches_cost_what_each_probed_count_shows_even_less_than_one(
        monkeypatch):
    """One device's one graph measured 0.5 s beyond its work on one
    micro-batch, 0.4 s on two (the device's thread kept busy while the
    step's Python runs) and 0.8 s on four: two micro-batches are predicted
    0.1 s cheaper than one, three halfway between two and four, and eight
    at the last probes' 0.2 s a micro-batch past four."""
    from mp_symbolic.core.planning.planner import Candidate  # pylint: disable=C0415
    timings = _fake_timings(monkeypatch, _Host())
    timings.capacity = {1: 1.0, 2: 2.0}
    timings.params, timings.update, timings.add = 0, 0.0, 0.0
    timings.stage = {'whole': (1.8, 3.6), 'half': (0.9, 1.8), 'quarter': (0.5, 1.0)}
    timings._probes = {  # pylint: disable=protected-access
        'graph': [Candidate('cpu:0', 1, 1, 1, 'gpipe'), ['whole'], 1, 2, 5.4 + 0.5],
        'chunks': [Candidate('cpu:0', 1, 1, 4, 'gpipe'), ['quarter'], 1, 8, 6.0 + 0.8],
        'chunks-2': [Candidate('cpu:0', 1, 1, 2, 'gpipe'), ['half'], 1, 4, 5.4 + 0.4]}
    timings.fit_steps()
    assert timings.steps['chunks'] == {1: 0.0, 2: pytest.approx(-0.1), 4: pytest.approx(0.3)}
    for chunks, beyond in ((1, 0.5), (2, 0.4), (3, 0.6), (4, 0.8), (8, 1.6)):
        made = schedules.make('gpipe', 1, chunks)
        assert timings.overhead(Candidate('cpu:0', 1, 1, chunks, 'gpipe'), made) == \
            pytest.approx(beyond), chunks
    two = Candidate('cpu:0', 1, 1, 2, 'gpipe')
    assert timings.predict(two, ['half'], 1) < timings.predict(
        Candidate('cpu:0', 1, 1, 1, 'gpipe'), ['whole'], 1)


def test_the_stage_runtimes_own_cost_and_an_actions_come_from_two_probes(monkeypatch):
    """1F1B over two stages measured 2.0 s beyond its work with two
    micro-batches (8 actions) and 3.0 s with four (16): the runtime's own
    cost a step is 1.0 s (0.5 s more than one device's one graph) and an
    action's 0.125 s; the interleaved schedule's probe (6.4 s more than
    that cost over 32 actions) is read against that cost."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.planning.planner import Candidate
    timings = _fake_timings(monkeypatch, _Host())
    serial = 6.0
    _pipeline_probes(timings, fused=serial + 0.5 + 0.3, staged=serial + 1.0 + 2.0,
                     interleaved=serial + 1.0 + 6.4)
    timings.stage['half-batch'] = (0.5, 1.0)
    timings._probes['staged-2'] = [  # pylint: disable=protected-access
        Candidate('cpu:0,cpu:1', 2, 1, 2, '1f1b'), ['half-batch'] * 2, 2, 8, serial + 1.0 + 1.0]
    timings.fit_steps()
    assert timings.steps['graph'] == pytest.approx(0.5)
    assert timings.steps['staged'] == pytest.approx(1.0)
    assert timings.steps['action'] == {'1f1b': pytest.approx(0.125),
                                       'interleaved': pytest.approx(0.2)}
    eight = Candidate('cpu:0,cpu:1', 2, 1, 8, '1f1b')
    assert timings.overhead(eight, schedules.make('1f1b', 2, 8)) == pytest.approx(
        1.0 + 32 * 0.125)


@pytest.mark.slow
def test_planning_gluonnlp_bert_with_shards_scores_both_counts_and_leaves_it_unchanged():
    """GluonNLP's BERT under tensor_parallel='auto': the planner scores its
    attention and feed-forward layers split over 2 devices and whole, each on
    a copy, and the network given keeps its layers and values (its classifier
    output, the third, under the softmax loss)."""
    from conftest import bert_batch, small_bert  # pylint: disable=import-outside-toplevel
    net = small_bert()
    kinds = [type(b).__name__ for b in _every_block(net)]
    values = {n: p.data().asnumpy().copy() for n, p in net.collect_params().items()}
    sample = tuple(mx.nd.array(x) for x in bert_batch())
    planner = Planner(output=2, chunks=(1,), schedules=('gpipe',), balances=('size',), repeats=3)
    ranking = planner.choose([net], DEVICES, sample, None, tensor_parallel='auto')
    assert {s.candidate.shards for s in ranking.ranked} == {1, 2}
    assert any(s.candidate.devices == 'cpu:0+cpu:1' for s in ranking.ranked)
    assert [type(b).__name__ for b in _every_block(net)] == kinds
    assert sorted(net.collect_params()) == sorted(values)
    for name, param in net.collect_params().items():
        assert (param.data().asnumpy() == values[name]).all(), name


def _every_block(block):
    yield block
    for child in block._children.values():  # pylint: disable=protected-access
        yield from _every_block(child)


@pytest.mark.slow
def test_plan_auto_on_a_network_of_several_outputs_names_planner_output_in_one_line():
    """GluonNLP's BERT has three outputs: plan='auto' with no output for
    its loss refuses in one line that says to pick it through the
    Pipeline's plan (plan=Planner(output=k)), and so does an output past
    the last; Planner(output=2) plans it."""
    from conftest import bert_batch, small_bert  # pylint: disable=import-outside-toplevel
    net = small_bert()
    sample = tuple(mx.nd.array(x) for x in bert_batch())
    for plan in ('auto', Planner(output=3)):
        with pytest.raises(PlanError) as refused:
            Pipeline([net], DEVICES, sample=sample, plan=plan)
        message = str(refused.value)
        assert '\n' not in message
        assert message.startswith('output: expected plan=Planner(output=k)')
        assert 'the network has 3 outputs' in message
    planner = Planner(output=2, chunks=(1,), schedules=('gpipe',), balances=('size',),
                      stages=(1,), replicas=(1,), mirror=False, repeats=3)
    pipe = Pipeline([net], DEVICES, sample=sample, plan=planner)
    assert pipe.planned.best.candidate.devices == 'cpu:0'


def _pipeline_probes(timings, fused, staged=None, interleaved=None):
    """Probes of one device's graph (a step's own cost 0.5 s) and GPipe's
    one graph over two stages of one micro-batch (0.3 s more: the second
    stage) and of four (``fused`` s), each stage's graph 1 + 2 s of work a
    batch; 1F1B's and the interleaved schedule's measured ``staged`` and
    ``interleaved`` s, where given."""
    from mp_symbolic.core.planning.planner import Candidate  # pylint: disable=C0415
    timings.capacity = {1: 1.0, 2: 2.0}  # two replicas' devices share nothing
    timings.params, timings.update, timings.add = 0, 0.0, 0.0
    timings.stage = {'whole': (2.0, 4.0), 'half': (1.0, 2.0), 'quarter': (0.25, 0.5),
                     'eighth': (0.125, 0.25)}
    timings._probes = {  # pylint: disable=protected-access
        'graph': [Candidate('cpu:0', 1, 1, 1, 'gpipe'), ['whole'], 1, 2, 6.0 + 0.5],
        'split': [Candidate('cpu:0,cpu:1', 2, 1, 1, 'gpipe'), ['half'] * 2, 2, 4, 6.8],
        'fused': [Candidate('cpu:0,cpu:1', 2, 1, 4, 'gpipe'), ['quarter'] * 2, 2, 16, fused]}
    if staged is not None:
        timings._probes['staged'] = [  # pylint: disable=protected-access
            Candidate('cpu:0,cpu:1', 2, 1, 4, '1f1b'), ['quarter'] * 2, 2, 16, staged]
    if interleaved is not None:
        timings._probes['looped'] = [  # pylint: disable=protected-access
            Candidate('cpu:0,cpu:1', 2, 1, 4, 'interleaved'), ['eighth'] * 4, 4, 32,
            interleaved]


def test_gpipes_one_graph_over_two_stages_shares_the_devices_as_its_probes_show(monkeypatch):
    """GPipe's one graph over two stages measured as long as its stages'
    work one after the other (6 s) and the costs beyond it: its devices do
    one device's work at once (capacity 1), where two replicas' do twice,
    and its second stage costs 0.3 s a step; a plan of eight micro-batches
    is predicted at its work in turn, the third stage past that 0.6 s."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.planning.planner import Candidate
    timings = _fake_timings(monkeypatch, _Host())
    _pipeline_probes(timings, fused=6.0 + 0.5 + 0.3)
    timings.fit_steps()
    assert timings.steps['split'] == pytest.approx(0.3)
    assert timings.pipelined['graph'] == pytest.approx(1.0, abs=1e-6)
    assert timings.capacity[2] == 2.0  # the replicas' devices still share nothing
    eight = Candidate('cpu:0,cpu:1', 2, 1, 8, 'gpipe')
    assert timings.predict(eight, ['eighth'] * 2, 2) == pytest.approx(6.0 + 0.5 + 0.3, rel=1e-6)
    three = Candidate('cpu:0,cpu:1,cpu:2', 3, 1, 1, 'gpipe')
    assert timings.overhead(three, schedules.make('gpipe', 3, 1)) == pytest.approx(0.5 + 0.6)
    # the same graph measured at the simulated span of devices that share nothing
    free = timings.predict(Candidate('cpu:0,cpu:1', 2, 1, 4, 'gpipe'), ['quarter'] * 2, 2,
                           overhead=False, capacity={})
    _pipeline_probes(timings, fused=free + 0.5 + 0.3)
    timings.fit_steps()
    assert timings.pipelined['graph'] == pytest.approx(2.0, abs=1e-6)


def test_recomputation_in_gpipes_one_graph_costs_what_its_probe_shows(monkeypatch):
    """GPipe's one graph over two stages of four micro-batches, recomputed,
    measured 0.6 s beyond its recomputed stage graphs' work and the costs
    the same plan has without recomputation: each micro-batch past the
    first costs 0.2 s more recomputed, so eight cost 1.4 s more, one
    nothing, and a plan without recomputation nothing."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.planning.planner import Candidate
    timings = _fake_timings(monkeypatch, _Host())
    _pipeline_probes(timings, fused=6.0 + 0.5 + 0.3)
    timings.stage['quarter, recomputed'] = (0.25, 0.75)
    timings._probes['mirror'] = [  # pylint: disable=protected-access
        Candidate('cpu:0,cpu:1', 2, 1, 4, 'gpipe', mirror=True),
        ['quarter, recomputed'] * 2, 2, 16, 8.0 + 0.5 + 0.3 + 0.6]
    timings.fit_steps()
    assert timings.steps['mirror'] == pytest.approx(0.2)
    for chunks, mirror, beyond in ((8, True, 0.8 + 1.4), (8, False, 0.8), (1, True, 0.8)):
        candidate = Candidate('cpu:0,cpu:1', 2, 1, chunks, 'gpipe', mirror=mirror)
        made = schedules.make('gpipe', 2, chunks)
        assert timings.overhead(candidate, made) == pytest.approx(beyond), (chunks, mirror)


def test_stage_runtimes_actions_cost_what_their_schedules_probes_show(monkeypatch):
    """1F1B's probe of 16 actions measured 1.6 s beyond its work and the
    interleaved schedule's of 32 actions 6.4 s: an action costs 0.1 s under
    1F1B and 0.2 s interleaved, each on the capacity GPipe's one graph
    shows for two stages at once."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.planning.planner import Candidate
    timings = _fake_timings(monkeypatch, _Host())
    serial = 6.0  # capacity 1: the stages' work one after the other
    _pipeline_probes(timings, fused=serial + 0.5 + 0.3, staged=serial + 0.5 + 1.6,
                     interleaved=serial + 0.5 + 6.4)
    timings.fit_steps()
    assert timings.pipelined == {'graph': pytest.approx(1.0, abs=1e-6),
                                 'staged': pytest.approx(1.0, abs=1e-6)}
    assert timings.steps['action'] == {'1f1b': pytest.approx(0.1, abs=1e-6),
                                       'interleaved': pytest.approx(0.2, abs=1e-6)}
    eight = Candidate('cpu:0,cpu:1', 2, 1, 8, 'interleaved')  # 64 actions of 0.1875 s
    assert timings.predict(eight, ['eighth'] * 4, 4) == pytest.approx(
        64 * 0.1875 + 0.5 + 64 * 0.2, rel=1e-6)


def test_planning_a_whole_network_too_small_for_an_interleaved_probe_skips_that_probe():
    """A whole network of three ops cannot be cut into the interleaved
    schedule's four stages: the planner ranks its other plans, probing
    GPipe's one graph and 1F1B over two stages, and lists the interleaved
    plan among those MXNet or the Pipeline could not make."""
    mx.random.seed(0)
    net = _WideMLP(prefix='whole_')
    net.initialize()
    ranking = Planner(chunks=(4,), balances=('size',), repeats=2).choose(
        net, DEVICES, (8, 64), None)
    probes = set(ranking.timings._probes)  # pylint: disable=protected-access
    assert {'graph', 'split', 'fused', 'staged'} <= probes and 'looped' not in probes
    assert {s.candidate.schedule for s in ranking.ranked} == {'gpipe', '1f1b'}
    assert [c.schedule for c, _ in ranking.failed] == ['interleaved']


def test_candidate_plans_are_the_same_whatever_the_measured_block_times():
    """A time balance is a plan of its own whether or not the block times
    measured in this run balance the stages as the parameter counts do: the
    plans scored are a function of the network, devices and budget."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.placement.balance import balance_by_size
    from mp_symbolic.core.planning.planner import _Search
    task, planner, sample = _regression()
    planner.balances = ('size', 'time')
    search = _Search(planner, task.make_blocks(), [mx.cpu(0), mx.cpu(1)], sample, 0, None, None)
    by_size = tuple(balance_by_size(search.blocks, 2))
    found = []
    for split in ((1, 2), (2, 1)):  # block times that balance as the sizes do, and otherwise
        times = [1.0] * 3
        times[0 if split == (1, 2) else 2] = 3.0  # the heavy block alone on its stage
        search.timings._block_times['all'] = times  # pylint: disable=protected-access
        search.timings._balances.clear()  # pylint: disable=protected-access
        found.append((split == by_size, [(c.stages, c.chunks, c.rule, c.balance or split)
                                         for c in search.candidates()]))
    assert {same for same, _ in found} == {True, False}
    plans = [[plan[:3] for plan in plans] for _, plans in found]
    assert plans[0] == plans[1] and any(rule == 'time' for _, _, rule in plans[0])


def test_a_plan_whose_size_and_time_balances_split_alike_is_scored_once():
    """Block times that balance the stages as the parameter counts do make
    one plan under both rules: scored once, its rule 'size=time' in the
    ranked table, the time-balanced candidates it stands for counted."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.placement.balance import balance_by_size
    from mp_symbolic.core.planning.planner import _Search
    task, planner, sample = _regression()
    planner.balances = ('size', 'time')
    search = _Search(planner, task.make_blocks(), [mx.cpu(0), mx.cpu(1)], sample, 0, None, None)
    by_size = tuple(balance_by_size(search.blocks, 2))
    assert by_size in ((1, 2), (2, 1))
    times = [1.0] * 3
    times[0 if by_size == (1, 2) else 2] = 3.0  # the heavy block alone, as the sizes split
    search.timings._block_times['all'] = times  # pylint: disable=protected-access
    considered = search.candidates()
    timed = [c for c in considered if c.rule == 'time']
    assert timed and all(c.balance == by_size for c in timed)
    with batched_binds():
        ranking = search.run(None)
    plans = [replace(s.candidate, balance=None, rule=None) for s in ranking.ranked]
    assert len(plans) == len(set(plans))  # no plan scored twice
    assert ranking.merged == len(timed)
    split = [s.candidate for s in ranking.ranked if s.candidate.stages > 1]
    assert split and all(c.rule == 'size=time' and c.balance is None for c in split)
    assert {c.rule for c in considered if c.stages == 1} == \
        {s.candidate.rule for s in ranking.ranked if s.candidate.stages == 1} == {'size'}
    lines = ranking.lines()
    for found in split:
        assert found.label() == str(found) + ' (rule size=time)'
        assert any(line.startswith('  ') and found.label() + '  ' in line for line in lines)


def test_bench_plan_reports_tau_over_the_pairs_measured_apart_beside_the_plain_tau():
    """bench.plan's tau over the pairs of plans whose measured gap exceeds
    both plans' run-to-run spread leaves out the pairs the noise orders,
    and the plain tau over every plan stays printed beside it."""
    from bench import plan as bench_plan  # pylint: disable=import-outside-toplevel

    def row(predicted, measured, spread):
        return dict(plan='--devices cpu:0 --chunks %d' % measured, fits=True, memory=1 << 10,
                    predicted=predicted * 1e-3, measured=measured * 1e-3, spread=spread)
    # 10 and 11 ms lie within each other's spread and are predicted the other
    # way round; 30 ms lies beyond both, and is predicted slowest
    rows = [row(2.0, 10, 0.2), row(1.0, 11, 0.2), row(3.0, 30, 0.05)]
    assert bench_plan.resolved_kendall(rows) == (1.0, 2, 3)
    assert bench_plan.kendall([r['predicted'] for r in rows],
                              [r['measured'] for r in rows]) == pytest.approx(1 / 3)
    entry = dict(task='regression', budget=4 << 10, planning=1.0, capacity={1: 1.0},
                 rows=rows, load=[])
    lines = []
    bench_plan.report([entry], lines.append)
    assert "  Kendall's tau, predicted against measured step times: 0.33 over 3 plans" in lines
    assert ("  Kendall's tau over the pairs of plans measured further apart than their "
            "run-to-run spread: 1.00 over 2 of 3 pairs") in lines
    rows[2]['spread'] = 5.0  # every gap within the spread: no pair counted
    assert bench_plan.resolved_kendall(rows) == (None, 0, 3)


def test_bench_plan_prints_the_pipelined_capacity_beside_the_replicas():
    """bench.plan's title line of a task gives the devices' capacity at once
    and, beside it, their capacity while one replica's stages run on them."""
    from bench import plan as bench_plan  # pylint: disable=import-outside-toplevel
    row = dict(plan='--devices cpu:0 --schedule gpipe --chunks 1', fits=True, predicted=1e-3,
               measured=1e-3, spread=0.01, memory=1 << 10)
    entry = dict(task='regression', budget=4 << 10, planning=1.0, capacity={1: 1.0, 2: 1.71},
                 pipelined={'graph': 1.52, 'staged': 1.48}, rows=[row, dict(row)], load=[])
    lines = []
    bench_plan.report([entry], lines.append)
    assert lines[0].endswith('(capacity of the devices at once: 1: 1.00, 2: 1.71; '
                             'pipelined: graph 1.52, staged 1.48)'), lines[0]


def test_a_graph_bounded_by_its_other_sizes_is_no_faster_than_the_fastest_step_of_any(
        monkeypatch):
    """One graph at 8 and 16 examples a micro-batch: the 16's forward is the
    faster, the 8's whole step the faster. The 8's bound takes the faster
    forward and the faster step, not the 16's forward joined to the 8's own
    backward (1.0 + 4.0 s, faster than any step measured)."""
    timings = _fake_timings(monkeypatch, _Host())
    small, large = ('graph', (), 'cpu(0)'), ('graph', (8,), 'cpu(0)')
    timings._micro.update({small: 8, large: 16})  # pylint: disable=protected-access
    timings.stage.update({small: (3.0, 4.0), large: (1.0, 7.0)})
    timings._bound_by_size()  # pylint: disable=protected-access
    assert timings.stage[small] == pytest.approx((1.0, 6.0))
    assert sum(timings.stage[small]) == pytest.approx(min(7.0, 8.0))
    assert timings.stage[large] == pytest.approx((1.0, 7.0))
