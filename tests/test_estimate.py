"""The memory estimate before allocation (mp_symbolic.estimate_memory and
python -m mp_symbolic plan) against the table one measured step gives."""
import os
import re
import subprocess
import sys

import pytest

import mp_symbolic
from mp_symbolic import Pipeline
from mp_symbolic.core.planning.estimate import PINNED, batched_binds, planned_graph, planner_total
from mp_symbolic.tools.memory import CATEGORIES
from mp_symbolic.training.cli import main
from mp_symbolic.training.tasks import load_task

from bench import estimate as bench

from conftest import cli_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# cheap cells: the GPT under GPipe (one graph) and 1F1B (the stage runtime),
# the CNN with BatchNorm and oneDNN's layouts, GluonNLP's BERT (its dense
# layers on three axes, in micro-batches), its AWD LSTM (the fused RNN op) and
# the regression's dense layers on matrices; the stage runtime's gradients
# added to their arrays through oneDNN's temporary memory (the regression and
# the CNN under 1F1B), the default-layout copy MXNet keeps of a stage's
# BatchNorm output for its head gradient (the CNN under 1F1B and
# interleaved), and a micro-batch's weight gradient in oneDNN's layout (the
# CNN's replicas)
CELLS = [bench._cell(model, **plan) for model, plan in (  # pylint: disable=protected-access
    ('lm', {}), ('lm', {'schedule': '1f1b', 'chunks': 4}), ('digits', {}), ('bert', {}),
    ('bert', {'chunks': 4}), ('awd_lstm', {}), ('regression', {}),
    ('regression', {'schedule': '1f1b', 'chunks': 4}),
    ('digits', {'schedule': '1f1b', 'chunks': 4}),
    ('digits', {'schedule': 'interleaved', 'chunks': 4}),
    ('digits', {'devices': 'cpu:0,cpu:1,cpu:2,cpu:3', 'replicas': 2, 'chunks': 2}),
    ('lm', {'replicas': 2, 'shard_optimizer': True, 'optimizer': 'adam'}))]
# the two replicas of one stage on cpu(0) and cpu(1): their local kvstore's
# buffers in pinned host memory, which the storage profiler counts in the
# row after the cores, a device this plan does not use
ZERO_PICK = CELLS[-1]
REPLICAS = bench._cell('lm', replicas=2, shard_optimizer=True,  # pylint: disable=protected-access
                       optimizer='adam')


@pytest.fixture(scope='module')
def cells():
    """Each cell's estimate (made first, in this process; the graphs bound in
    one child, as the planner binds its candidates': the same estimate as a
    child per graph, test_plan_auto's test of batched_binds) and its measured
    table."""
    with batched_binds():
        estimated = [bench.estimate(cell) for cell in CELLS]
    return list(zip(CELLS, estimated, bench.measure(CELLS)))


def test_estimate_per_device_total_is_within_5_percent_of_the_measured_and_never_5_percent_under(
        cells):
    for cell, estimated, measured in cells:
        devices, _ = bench.errors(measured, estimated)
        assert set(bench.as_profiled(estimated, measured)) == set(measured), bench.label(cell)
        for device, (total, guess, error) in devices.items():
            assert abs(error) <= 0.05, (bench.label(cell), device, total, guess)


def test_estimate_rows_of_arrays_are_the_measured_bytes_exactly(cells):
    for cell, estimated, measured in cells:
        estimated = bench.as_profiled(estimated, measured)
        for device, row in measured.items():
            for category in ('params', 'grads', 'optimizer', 'aux', 'module_copy'):
                assert estimated[device][category] == row[category], \
                    (bench.label(cell), device, category)


def test_kvstore_host_buffers_are_their_own_row_equal_to_the_estimate_not_a_device_off_the_plan(
        cells):
    _, estimated, measured = next(c for c in cells if c[0] is ZERO_PICK)
    assert sorted(measured) == ['cpu(0)', 'cpu(1)', PINNED]
    assert measured[PINNED]['total'] == estimated[PINNED]['total'] > 0


@pytest.mark.slow
def test_dist_sync_workers_host_buffers_are_the_estimates(tmp_path):
    """Two workers, each with two replicas of one stage and its share of
    Adam's state, the Module stepped directly: each worker's measured table,
    the dist kvstore's host buffers in pinned memory among its rows, is its
    estimate's, row for row."""
    job = subprocess.run(
        [sys.executable, '-m', 'mp_symbolic', 'launch', '--workers', '2', '--servers', '1', '--',
         sys.executable, os.path.join(ROOT, 'tests', 'dist_memory_worker.py'),
         __import__('json').dumps(REPLICAS)],
        capture_output=True, text=True, timeout=300, check=False, cwd=str(tmp_path),
        env=dict(os.environ, PYTHONPATH=ROOT))
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
    tables = [__import__('json').loads(m) for m in
              re.findall(r'^\[worker \d, rank \d\] table \d (\{.*\})$', job.stdout, re.M)]
    assert len(tables) == 2, job.stdout[-2000:]
    for table in tables:
        measured, estimated = table['measured'], table['estimated']
        assert sorted(measured) == sorted(estimated) == ['cpu(0)', 'cpu(1)', PINNED]
        assert measured[PINNED]['total'] == estimated[PINNED]['total'] > 0
        devices, _ = bench.errors(measured, estimated)
        assert all(abs(error) <= 0.05 for _, _, error in devices.values()), devices


def test_replayed_memory_plan_totals_what_mxnets_own_planner_reports():
    task, _ = load_task('lm')
    pipe = Pipeline(task.make_blocks(), 'cpu:0,cpu:1', sample=(16, 64), chunks=2)
    symbol = pipe.training_symbol(task.loss)
    graph = planned_graph(symbol, {'data': (16, 64), 'softmax_label': (16, 64)},
                          pipe.plan.group2ctx)
    assert graph.total_mib >= 10  # a plan large enough for whole MiB to tell
    assert planner_total(graph) >> 20 == graph.total_mib


@pytest.mark.slow
def test_estimate_allocates_nothing_on_the_devices():
    code = (
        "import mxnet as mx, json, tempfile, os\n"
        "from mp_symbolic.tools.trace import load_trace, storage_bytes\n"
        "path = os.path.join(tempfile.mkdtemp(), 'm.json')\n"
        "mx.profiler.set_config(profile_memory=True, profile_symbolic=False, "
        "profile_imperative=False, profile_api=False, aggregate_stats=False, filename=path)\n"
        "mx.profiler.set_state('run')\n"
        "mx.nd.zeros((1,)).wait_to_read()\n"
        "import mp_symbolic\n"
        "from mp_symbolic.training.tasks import load_task\n"
        "task, _ = load_task('lm')\n"
        "table = mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1', sample=(16, 64),"
        " chunks=4, schedule='1f1b')\n"
        "mx.nd.waitall(); mx.profiler.set_state('stop'); mx.profiler.dump()\n"
        "print(json.dumps([storage_bytes(load_trace(path)), table.total]))\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout.strip().splitlines()[-1]
    held, estimated = __import__('json').loads(out)
    assert estimated > 5 << 20  # what a step would take
    # the Gluon blocks' own parameters (initialised for the trace) and nothing of the plan
    assert sum(held.values()) < estimated / 10


@pytest.mark.slow
def test_plan_prints_the_measured_tables_rows_and_a_total(capsys):
    status = cli_status(main, ['plan', '--task', 'lm', '--devices', 'cpu:0,cpu:1',
                               '--chunks', '4', '--schedule', '1f1b'])
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    header = next(line for line in out if line.strip().startswith('device'))
    assert header.split() == ['device'] + list(CATEGORIES) + ['other', 'total']
    assert [line.split()[0] for line in out if line.startswith('    cpu')] == ['cpu(0)', 'cpu(1)']
    assert out[-1].startswith('total ') and 'the most on cpu(0)' in out[-1]


def test_plan_refuses_a_batch_the_chunks_do_not_divide_in_one_line():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'plan', '--task', 'digits',
                           '--devices', 'cpu:0,cpu:1', '--chunks', '3'],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stdout == ''
    assert proc.stderr.strip().splitlines() == [
        'error: --batch-size: expected a multiple of chunks x replicas (3 x 1), found 64']


@pytest.mark.parametrize('argv', [
    ['--devices', 'cpu:0,cpu:1', '--schedule', 'interleaved', '--virtual', '4', '--chunks', '2'],
    ['--devices', 'cpu:0,cpu:1', '--chunks', '0'],
    ['--devices', 'cpu:0,cpu:1,cpu:2,cpu:3,cpu:4']])
def test_plan_names_the_flag_of_a_refusal_as_train_does(argv, tmp_path, capsys):
    assert main(['plan', '--task', 'regression'] + argv) == 2
    planned = capsys.readouterr()
    assert main(['train', '--task', 'regression', '--out', str(tmp_path)] + argv) == 2
    trained = capsys.readouterr()
    assert planned.out == ''
    assert planned.err.splitlines() == trained.err.splitlines()[-1:]
    assert re.match(r'error: --(virtual|chunks|devices): ', planned.err), planned.err


def test_plan_names_itself_in_the_refusal_of_a_flag_its_parser_refuses(capsys):
    assert cli_status(main, ['plan', '--task', 'regression', '--memory-per-device', '1x']) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: python -m mp_symbolic plan: argument --memory-per-device: expected a size "
        "such as 2GiB, 512MB, 1.5G or a number of bytes, found '1x' (see --help)"], err


def test_estimate_memory_refuses_an_optimizer_it_does_not_know():
    task, _ = load_task('regression')
    with pytest.raises(ValueError, match=r"^optimizer: expected one of .*found 'novel'$"):
        mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1', sample=(100, 2),
                                    optimizer='novel')


def test_estimate_memory_asks_for_label_shapes_where_a_callable_heads_label_type_is_unknown():
    """A head that casts its label leaves the label's type to the caller: the
    estimate refuses in one line naming the head and what to pass, and takes
    the label's shape."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    task, _ = load_task('regression')

    def casting_mse(prediction, label):
        return mx.sym.MakeLoss(mx.sym.mean(mx.sym.square(
            prediction - mx.sym.Cast(label, dtype='float32'))))

    with pytest.raises(ValueError) as refused:
        mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1', sample=(100, 2),
                                    loss=casting_mse)
    assert str(refused.value) == (
        "label_shapes: expected them with a loss head whose label's type MXNet cannot infer "
        "from the data, found none for loss 'casting_mse'; pass "
        "label_shapes=[('softmax_label', shape)] (the label then float32)")
    table = mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1', sample=(100, 2),
                                        loss=casting_mse,
                                        label_shapes=[('softmax_label', (100, 1))])
    assert table['cpu(1)'].inputs == 100 * 4  # the label, float32, on the last stage


def test_estimate_memory_of_a_pipeline_made_with_a_sample_takes_its_batch_from_it():
    """GluonCV's CIFAR ResNet-20 (BatchNorm) as a Pipeline made with
    sample=: its estimate without a sample is the one with that sample, and
    the network's with the same plan; a Pipeline made without sample= and
    estimated without one is refused in one line."""
    from gluoncv.model_zoo import get_model  # pylint: disable=import-outside-toplevel
    sample = (8, 3, 32, 32)
    net = get_model('cifar_resnet20_v1', classes=10)
    net.initialize()
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=sample, chunks=2, schedule='1f1b')
    table = mp_symbolic.estimate_memory(pipe)
    assert table == mp_symbolic.estimate_memory(pipe, sample=sample)
    assert [row.total for row in table] == [
        row.total for row in mp_symbolic.estimate_memory(net, 'cpu:0,cpu:1', sample=sample,
                                                         chunks=2, schedule='1f1b')]
    assert table['cpu(1)'].aux > 0   # the BatchNorms' running statistics
    task, _ = load_task('regression')
    unsized = Pipeline(task.make_blocks(), 'cpu:0,cpu:1')
    with pytest.raises(ValueError, match=r"^sample: expected the batch \(a shape or arrays\) "
                                         r"or data_shapes, found neither \(nor a Pipeline "
                                         r"made with sample=\)$"):
        mp_symbolic.estimate_memory(unsized)


def test_estimate_memory_refuses_a_rank_not_among_the_workers_in_one_line():
    task, _ = load_task('regression')
    with pytest.raises(ValueError, match=r"^workers, rank: expected a count of dist_sync workers "
                                         r"and a rank below it, found workers=2, rank=2$"):
        mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1', sample=(100, 2),
                                    workers=2, rank=2)


@pytest.mark.slow
def test_the_estimate_after_a_bind_in_the_same_process_equals_one_made_first_and_later_binds_log_nothing():
    # MXNet reads its planner-log switch once per process, at the first bind
    code = (
        "import mxnet as mx, sys\n"
        "import mp_symbolic\n"
        "from mp_symbolic.training.tasks import load_task\n"
        "def estimate():\n"
        "    task, _ = load_task('digits')\n"
        "    return mp_symbolic.estimate_memory(task.make_blocks(), 'cpu:0,cpu:1',"
        " sample=(8, 1, 8, 8)).total\n"
        "def bind():\n"
        "    x = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=4, name='fc')\n"
        "    x.simple_bind(mx.cpu(), data=(2, 3)).forward()\n"
        "    mx.nd.waitall(); sys.stderr.flush()\n"
        "first = estimate() if sys.argv[1] == 'first' else None\n"
        "print('BIND', file=sys.stderr); sys.stderr.flush()\n"
        "bind()\n"
        "print('AFTER', file=sys.stderr); sys.stderr.flush()\n"
        "later = estimate()\n"
        "print('BIND2', file=sys.stderr); sys.stderr.flush()\n"
        "bind()\n"
        "print(first, later)\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    runs = {}
    for order in ('first', 'after'):
        done = subprocess.run([sys.executable, '-c', code, order], capture_output=True,
                              text=True, env=env, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[order] = done
        tail = done.stderr.split('BIND2', 1)[1]
        assert 'memory plan' not in tail.lower() and 'storage' not in tail.lower(), tail[:500]
        assert done.stderr.split('BIND', 1)[1].split('AFTER', 1)[0].strip() == ''
    first, later = runs['first'].stdout.split()[-2:]
    assert first == later == runs['after'].stdout.split()[-1]
