"""Faults that used to hang, train on quietly or end in a traceback: a frozen
process under ``launch``, ``sample`` on a FIFO or a huge length, task arguments
that JSON cannot store, labels and inputs the loss cannot take, forged
optimizer states. Each test failed before its fix."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import cli_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')
PYTHON = sys.executable
TRAIN = ['--epochs', '1', '--num-examples', '200', '--devices', 'cpu:0,cpu:1', '--no-progress',
         '--no-memory']


def run(argv, timeout=120, **kwargs):
    return subprocess.run([PYTHON] + argv, cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout, check=False, **kwargs)


def one_line_error(result, status=2):
    """The single stderr line of a refusal (no traceback), after checking the status."""
    assert result.returncode == status, (result.stdout, result.stderr)
    assert 'Traceback' not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), result.stderr
    return lines[0]


def one_line_error_in_process(argv, capsys):
    """The single stderr line of ``python -m mp_symbolic argv`` run through
    ``cli.main`` in this process, after checking its status is 2: the same
    refusal as :func:`one_line_error`'s without a 2-3 s MXNet start; each
    family of refusals keeps one case end to end."""
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    capsys.readouterr()
    status = cli_status(cli.main, argv[2:] if argv[:2] == ['-m', 'mp_symbolic'] else argv)
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), err
    return lines[0]


# -- a frozen process ends the job ------------------------------------------------------------

def test_a_stopped_server_ends_the_job_within_the_stopped_timeout(tmp_path, port):
    from tests.test_launch import assert_nothing_left, job_pids  # pylint: disable=import-outside-toplevel
    out_path, err_path = tmp_path / 'out', tmp_path / 'err'
    with open(out_path, 'w') as out, open(err_path, 'w') as err:
        proc = subprocess.Popen(
            [PYTHON, '-m', 'mp_symbolic', 'launch', '--port', str(port), '--workers', '1',
             '--servers', '1', '--stopped-timeout', '1', '--', PYTHON, 'tests/dist_worker.py',
             '--steps', '100000'], cwd=ROOT, env=ENV, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 90
        while not all(text in out_path.read_text() for text in ('[worker 0] step 1',
                                                                 'launch: pids: ')) \
                and time.monotonic() < deadline:
            time.sleep(0.05)  # the kvstore is up: the server serves the worker's pushes
        server = job_pids(out_path.read_text())['server 0']
        os.kill(server, signal.SIGSTOP)
        proc.wait(timeout=60)  # a job that waited on the stopped server would hang here
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    assert proc.returncode == 1
    last = err_path.read_text().splitlines()[-1]
    assert last.startswith('error: server 0 (pid %d) has been stopped for ' % server), last
    # ended by the stopped timeout (the stopped one gets SIGCONT with the others' SIGTERM)
    assert last.endswith(' s (--stopped-timeout 1); stopped the other 2 processes of the job')
    assert_nothing_left(out_path.read_text(), port, num_processes=3)


@pytest.mark.parametrize('value', ['0', '-1', 'inf', 'nan'])
def test_a_stopped_timeout_that_is_not_positive_is_refused(value, capsys):
    argv = ['-m', 'mp_symbolic', 'launch', '--workers', '1', '--servers', '1',
            '--stopped-timeout', value, '--', 'true']
    line = one_line_error(run(argv)) if value == '0' else one_line_error_in_process(argv, capsys)
    assert line == (
        'error: --stopped-timeout: expected a positive number of seconds, found %s' % value)


# -- sample: a subcommand, bounded, one line ---------------------------------------------------

SAMPLE_FORMS = [['-m', 'mp_symbolic', 'sample'], ['-m', 'mp_symbolic.training.sample']]


@pytest.fixture(scope='module')
def garbage_onnx(tmp_path_factory):
    path = tmp_path_factory.mktemp('sample') / 'garbage.onnx'
    path.write_bytes(b'\x0a\xff\xff\xff\xff\x0f' + bytes(range(256)))  # not a ModelProto
    return str(path)


@pytest.mark.parametrize('form', SAMPLE_FORMS, ids=['subcommand', 'module'])
def test_sample_on_a_fifo_is_refused_instead_of_blocking(form, tmp_path):
    fifo = str(tmp_path / 'model.onnx')
    os.mkfifo(fifo)
    result = run(form + ['--model', fifo], timeout=60)
    assert one_line_error(result) == ('error: --model: expected an ONNX file, found %s that is '
                                      'not a regular file' % fifo)


@pytest.mark.parametrize('form', SAMPLE_FORMS, ids=['subcommand', 'module'])
def test_sample_on_a_file_that_is_not_onnx_is_one_line(form, garbage_onnx):
    line = one_line_error(run(form + ['--model', garbage_onnx]))
    assert line.startswith('error: --model: expected an ONNX file, found %s that is not one '
                           '(DecodeError: ' % garbage_onnx), line


@pytest.mark.parametrize('flags, message', [
    (['--length', '100000000'], '--length: expected 0 to 10000 characters, found 100000000'),
    (['--length', '-1'], '--length: expected 0 to 10000 characters, found -1'),
    (['--seed', '-1'], '--seed: expected an integer in 0..4294967295, found -1'),
    (['--seed', str(2 ** 32)], '--seed: expected an integer in 0..4294967295, found 4294967296'),
    (['--temperature', 'inf'], '--temperature: expected a number >= 0, found inf'),
])
def test_sample_options_out_of_range_are_refused_before_the_model_loads(flags, message, tmp_path,
                                                                        capsys):
    # The model is a FIFO: an option checked after the model loads would hang or name the file.
    fifo = str(tmp_path / 'model.onnx')
    os.mkfifo(fifo)
    argv = SAMPLE_FORMS[0] + ['--model', fifo] + flags
    if flags[0] == '--length' and flags[1] == '-1':  # one case end to end
        assert one_line_error(run(argv)) == 'error: ' + message
    else:
        assert one_line_error_in_process(argv, capsys) == 'error: ' + message


# The signal lands as soon as the entry point handles signals: the whole
# command takes about 0.35 s (the ONNX path imports no MXNet), so a later one
# would race its end on an idle machine.
@pytest.mark.parametrize('form, delay', [(SAMPLE_FORMS[0], 0.0), (SAMPLE_FORMS[1], 0.0)],
                         ids=['subcommand', 'module'])
def test_sample_interrupted_while_starting_is_one_line(form, delay, garbage_onnx):
    from tests.test_audit import _signal_after  # pylint: disable=import-outside-toplevel
    status, _, stderr = _signal_after(form + ['--model', garbage_onnx], signal.SIGINT, delay)
    assert status == 130, stderr
    assert stderr == 'error: interrupted before any work; nothing was written (SIGINT)\n'


# -- data the loss or the network cannot take: refused before training -------------------------

DATA_TASK = '''
import mxnet as mx
import numpy as np
from mxnet import gluon
import mp_symbolic
X = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
y = (X[:, 0] > 0).astype(np.float32)
class Raising(mx.io.NDArrayIter):
    def next(self):
        raise OSError('disk gone')
class Endless(mx.io.NDArrayIter):
    def next(self):  # the same batch, for ever
        return mx.io.DataBatch([mx.nd.array(X[:16])], [mx.nd.array(y[:16])], pad=0)
def task():
    return mp_symbolic.Task(name='x', blocks=[gluon.nn.Dense(2, in_units=4)], loss='softmax',
                            batch_size=16, num_epochs=1, %s)
'''


@pytest.mark.parametrize('data, message', [
    ("train=(X, np.where(y > 0, 7, 0))",
     'train: expected class indices 0..1 (the network has 2 outputs), found 30 labels that are '
     'not, the first 7'),
    ("train=(X, y), val=(X, -y)",
     'val: expected class indices 0..1 (the network has 2 outputs), found 30 labels that are '
     'not, the first -1'),
    ("train=(X, np.stack([y, 1 - y], axis=1))",
     "train: expected labels of shape () per example (class indices) for the loss 'softmax', "
     "found (2,)"),
    ("train=(X + 1j, y)", 'train: expected real numbers, found arrays of complex64 and float32'),
    ("train=(X, y), val=(X[:0], y[:0])",
     'val: expected at least one example, found none (X (0, 4))'),
    ("train=Raising(X, y, batch_size=16)",
     'train: expected a DataIter that can be read, found Raising raising OSError: disk gone'),
    ("train=mx.io.NDArrayIter({'a': X, 'b': X}, y, batch_size=16)",
     'train: expected examples the blocks can take, found examples of shape (4,), (4,): '
     'expected one batch or shape per input of the network, found 2 '
     "(Dense.hybrid_forward() got multiple values for argument 'weight')"),
    ("train=(X, np.where(y > 0, 1e39, 0))",  # float64 1e39 is inf as float32
     'train: expected finite labels as float32 (within +-3.4e38), found NaN or infinity'),
    ("train=(X, y), val=(X * 1e39, y)",
     'val: expected finite values as float32 (within +-3.4e38), found NaN or infinity in X'),
    ("train=Endless(X, y, batch_size=16), max_data_bytes=4096",  # 320 bytes a batch
     'train: expected a DataIter of at most 4096 bytes of examples and labels as float32 '
     '(max_data_bytes), found more after 13 batches (one that never ends?)'),
    ("train=(X, y), max_data_bytes=1024",
     'train: expected at most 1024 bytes of examples and labels as float32 (max_data_bytes), '
     'found 1280 bytes'),
], ids=['label-7', 'label-minus-1', 'two-columns', 'complex', 'empty-val', 'iter-raises',
        'two-data-arrays', 'label-1e39', 'value-1e39', 'endless-iter', 'too-many-bytes'])
def test_data_the_network_cannot_take_is_one_line_before_training(tmp_path, capsys, data,
                                                                  message):
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    path = tmp_path / 'data_task.py'
    path.write_text(DATA_TASK % data)
    status = cli.main(['train', '--task', str(path), '--devices', 'cpu:0', '--out',
                       str(tmp_path / 'out'), '--no-progress', '--no-memory'])
    assert status == 2
    assert capsys.readouterr().err == 'error: --task %s: %s\n' % (path, message)
    assert not (tmp_path / 'out').exists()


# -- task arguments are stored exactly, or refused before training -------------------------------

ARG_TASK = '''
import numpy as np
from mxnet import gluon
import mp_symbolic
def task(x=None):
    X = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    return mp_symbolic.Task(name='x', blocks=[gluon.nn.Dense(1, in_units=4)], loss='l2',
                            train=(X, X[:, 0]), batch_size=16, num_epochs=1, lr=0.01)
'''

@pytest.mark.parametrize('value, found', [
    ("b'abc'", "x=b'abc' (bytes)"),
    ('{1,2}', 'x={1, 2} (set)'),
    ('1j', 'x=1j (complex)'),
    ('...', 'x=Ellipsis (ellipsis)'),
    ('{3:4}', 'x={3: 4} (a dict key that is not a string: 3)'),
    ("[1,{'a':{2:3}}]", "x=[1, {'a': {2: 3}}] (a dict key that is not a string: 2)"),
])
def test_task_arguments_json_cannot_store_exactly_are_refused_before_training(tmp_path, capsys,
                                                                               value, found):
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    path = tmp_path / 'arg_task.py'  # a task that takes x: it trained, then the commit failed
    path.write_text(ARG_TASK)
    status = cli.main(['train', '--task', str(path), '--task-arg', 'x=' + value, '--devices',
                       'cpu:0', '--out', str(tmp_path / 'out'), '--no-progress', '--no-memory'])
    assert status == 2
    assert capsys.readouterr().err == (
        'error: --task-arg: expected values summary.json stores exactly (numbers, strings, '
        'True, False, None, lists, dicts with string keys), found %s\n' % found)
    assert not (tmp_path / 'out').exists()


# -- optimizer states read from a file are checked ---------------------------------------------

def _momentum_trainer():
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mxnet import autograd, gluon  # pylint: disable=import-outside-toplevel
    from mp_symbolic import Trainer  # pylint: disable=import-outside-toplevel
    net = gluon.nn.Dense(3, in_units=2, prefix='dense0_')
    net.initialize(ctx=mx.cpu(0))
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
    with autograd.record():
        loss = net(mx.nd.ones((4, 2))).sum()
    loss.backward()
    trainer.step(4)
    return trainer


def _forge(path, meta=None, arrays=None):
    """An .npz in the states' own layout: ``meta`` as JSON text, then ``a0``, ``a1``, ..."""
    import json  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    with np.load(path) as data:
        saved_meta = json.loads(str(data['meta']))
        saved_arrays = [data['a%d' % i] for i in range(len(data.files) - 1)]
    meta = saved_meta if meta is None else meta(saved_meta)
    arrays = saved_arrays if arrays is None else arrays(saved_arrays)
    text = meta if isinstance(meta, str) else json.dumps(meta)
    np.savez(path, meta=np.array(text), **{'a%d' % i: a for i, a in enumerate(arrays)})


def _deep(meta):
    meta['params']['dense0_weight']['state'] = {'t': 'tuple', 'items': [{'t': 'none'}]}
    spec = meta['params']['dense0_weight']['state']
    for _ in range(20):
        spec['items'] = [{'t': 'list', 'items': []}]
        spec = spec['items'][0]
    return meta


@pytest.mark.parametrize('forge, message', [
    (lambda p: p.write_bytes(p.read_bytes()[:200]), 'is not a readable optimizer-state file: '
                                                   'BadZipFile: '),
    (lambda p: _forge(p, meta=lambda m: {k: v for k, v in m.items() if k != 'params'}),
     'params: expected a dict of states by parameter name, found NoneType'),
    (lambda p: _forge(p, meta=lambda m: dict(m, params={'dense0_weight': {
        'count': 1, 'state': {'t': 'nd', 'a': 'x'}}})),
     "dense0_weight: expected a state naming one of the 2 arrays, found 'x'"),
    (lambda p: _forge(p, meta=lambda m: dict(m, num_update=-3)),
     'num_update: expected an integer >= 0, found -3'),
    (lambda p: _forge(p, meta=lambda m: '[' * 100000 + ']' * 100000),
     'is not a readable optimizer-state file: RecursionError: '),
    (lambda p: _forge(p, meta=_deep),
     'dense0_weight: expected a state of NDArrays, tuples and None nested at most 8 deep'),
    (lambda p: _forge(p, arrays=lambda a: [x.astype('int32') for x in a]),
     'array 0: expected floating-point optimizer state, found dtype int32'),
    (lambda p: _forge(p, arrays=lambda a: [x * float('nan') for x in a]),
     'array 0: expected finite values, found NaN or infinity'),
    (lambda p: _forge(p, arrays=lambda a: [x.reshape(-1) for x in a]),
     "dense0_weight: expected a state of the parameter's shape (3, 2), found shape (6,)"),
], ids=['truncated', 'no-params', 'index-not-int', 'negative-count', 'nested-json',
        'nested-state', 'int-dtype', 'nan', 'wrong-shape'])
def test_forged_or_truncated_states_are_refused_by_trainer_load_states(tmp_path, forge,
                                                                        message):
    from mp_symbolic import OptimizerStateError  # pylint: disable=import-outside-toplevel
    trainer = _momentum_trainer()
    path = tmp_path / 'states.npz'
    trainer.save_states(str(path))
    forge(path)
    with pytest.raises(OptimizerStateError) as raised:
        trainer.load_states(str(path))
    assert str(raised.value).startswith(str(path)) and message in str(raised.value)
    assert '\n' not in str(raised.value)


def test_resume_with_the_states_of_another_model_is_one_line(tmp_path, capsys):
    import shutil  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.optim.optstate import load_states, save_states  # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.store import Store  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    run_dir = tmp_path / 'run'
    assert cli.main(['train', '--out', str(run_dir), '--momentum', '0.9'] + TRAIN) == 0
    snap = Store(str(run_dir)).current()
    states = next(n for n in snap.files if n.endswith('.states'))
    # The states of --widths 2,3,3,1: the same parameter names, other shapes.
    other = load_states(os.path.join(snap.folder, states))
    shapes = {'layer0_weight': (3, 2), 'layer0_bias': (3,), 'layer1_weight': (3, 3),
              'layer1_bias': (3,), 'layer2_weight': (1, 3), 'layer2_bias': (1,)}
    for name, entry in other['params'].items():
        other['arrays'][entry['state']['a']] = np.zeros(shapes[name], np.float32)

    def write(folder):  # the run's snapshot with the other model's states, manifest fixed
        for name in snap.files:
            shutil.copy(os.path.join(snap.folder, name), folder)
        save_states(os.path.join(folder, states), other)

    forged = tmp_path / 'forged'
    with Store(str(forged), kind='training').locked() as store:
        store.commit(write, snap.meta)
    capsys.readouterr()
    status = cli.main(['train', '--resume', str(forged), '--epochs', '2', '--devices',
                       'cpu:0,cpu:1', '--no-progress', '--no-memory'])
    err = capsys.readouterr().err
    assert status == 2 and err.count('\n') == 1 and err.startswith('error: '), err
    assert err.endswith("%s: layer0_weight: expected a state of the parameter's shape (2, 2), "
                        "found shape (3, 2)\n" % states), err


# -- messages quote an excerpt, not a whole value ------------------------------------------------

@pytest.mark.parametrize('spec, start', [
    (','.join('cpu:%d' % i for i in range(3000)),
     "expected cpu:N with N at most 63, found 'cpu:64' in 'cpu:0,cpu:1,"),
    (','.join('cpu:%d' % (i % 60) for i in range(3000)),
     'expected each device once, found cpu:0 twice in cpu:0,cpu:1,'),
    (','.join('gpu:%d' % i for i in range(3000)), 'gpu:0, gpu:1, gpu:2,'),
    ('cpu:0,' + 'x' * 10000, "expected devices of the form 'cpu:N' or 'gpu:N' (N in ASCII "
                             "digits), found 'xxx"),
], ids=['cpu-64', 'twice', 'gpus', 'long-entry'])
def test_a_device_list_of_thousands_is_quoted_as_an_excerpt(spec, start):
    from mp_symbolic.core.placement.devices import DeviceSpecError, parse_devices  # pylint: disable=import-outside-toplevel
    with pytest.raises(DeviceSpecError) as raised:
        parse_devices(spec, num_gpus=0)
    message = str(raised.value)
    assert message.startswith(start), message
    assert len(message) < 300 and '...' in message, message


def test_a_python_pipeline_over_thousands_of_contexts_is_refused_at_the_first_past_the_bound():
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mp_symbolic import DeviceSpecError, Pipeline  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.tasks import digits  # pylint: disable=import-outside-toplevel
    with pytest.raises(DeviceSpecError, match=r'^expected cpu devices up to mx.cpu\(63\), '
                                              r'found mx.cpu\(64\)$'):
        Pipeline(digits.build_blocks(), [mx.cpu(i) for i in range(5000)])


def test_gpipe_chunks_past_the_one_graphs_bound_are_refused_before_it_is_built(capsys, tmp_path):
    from mp_symbolic.core.graph.graphcut import MAX_CHUNKED_OPS  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    assert cli_status(main, ['train', '--chunks', '10000', '--batch-size', '10000', '--epochs',
                             '1', '--out', str(tmp_path / 'out')]) == 2
    assert not list((tmp_path / 'out').glob('snap-*'))  # nothing committed
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --chunks: expected at most %d micro-batches of this "
                              "graph's 3 ops in one graph (ops x chunks at most %d), found "
                              "10000; the stage runtime (schedule='1f1b')"
                              % (MAX_CHUNKED_OPS // 3, MAX_CHUNKED_OPS)), err


@pytest.mark.parametrize('argv, start', [
    (['--out', 'x' * 100000], '--out: expected a path this system can open (names of at most '
                              '255 bytes, 4096 in all), found xxxx'),
    (['--resume', 'x' * 100000], '--resume: expected a path this system can open'),
    (['--task', 'x' * 100000], '--task xxxx'),
    (['--task', '/x/' + 'x' * 100000 + '.py'], '--task /x/xxxx'),
    (['--task-arg', 'x' * 100000], 'argument --task-arg: expected KEY=VALUE with KEY a Python '
                                   "name, found 'xxxx"),
], ids=['out', 'resume', 'task', 'task-file', 'task-arg'])
def test_a_value_of_100_kb_is_quoted_as_an_excerpt(argv, start, capsys):
    line = one_line_error_in_process(['train'] + argv + TRAIN, capsys)
    assert start in line and '...' in line and len(line) < 400, line[:400]


def _state(pid):
    try:
        with open('/proc/%d/stat' % pid) as f:
            return f.read().rsplit(')', 1)[1].split()[0]
    except OSError:
        return None


def _children_of(pid):
    """Pids whose parent is ``pid``, from ``/proc``."""
    found = []
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                with open('/proc/%s/stat' % entry) as f:
                    ppid = int(f.read().rsplit(')', 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry))
    return found


def test_a_stopped_command_of_a_workers_shell_ends_the_job(tmp_path, port):
    from tests.test_launch import assert_nothing_left, job_pids  # pylint: disable=import-outside-toplevel
    out_path, err_path = tmp_path / 'out', tmp_path / 'err'
    with open(out_path, 'w') as out, open(err_path, 'w') as err:
        # the shell waits for sleep (no exec: a command follows), as a script would
        proc = subprocess.Popen(
            [PYTHON, '-m', 'mp_symbolic', 'launch', '--port', str(port), '--workers', '1',
             '--servers', '1', '--stopped-timeout', '1', '--', 'sh', '-c',
             'echo ready; sleep 600; true'], cwd=ROOT, env=ENV, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while not all(text in out_path.read_text() for text in ('[worker 0] ready',
                                                                 'launch: pids: ')) \
                and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker's line may come before the launcher's own
        shell = job_pids(out_path.read_text())['worker 0']
        sleeps = []
        while not sleeps and time.monotonic() < deadline:
            sleeps = _children_of(shell)
            time.sleep(0.05)
        os.kill(sleeps[0], signal.SIGSTOP)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    assert proc.returncode == 1
    last = err_path.read_text().splitlines()[-1]
    assert last.startswith('error: a process of worker 0 (pid %d) has been stopped for '
                           % sleeps[0]), last
    assert last.endswith(' s (--stopped-timeout 1); stopped the other 2 processes of the job')
    assert_nothing_left(out_path.read_text(), port, num_processes=3)
    deadline = time.monotonic() + 5  # the stopped sleep is gone too (its new parent reaps it)
    while os.path.exists('/proc/%d' % sleeps[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    state = _state(sleeps[0])
    assert state in (None, 'Z'), state


# -- the suite: tests share pytest workers ---------------------------------------------------

@pytest.mark.xdist_group('signals-between-tests')
def test_a_finished_command_run_in_process_ignores_sigint_and_sigterm(tmp_path):
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    assert cli.main(['train', '--out', str(tmp_path / 'run'), '--epochs', '1', '--num-examples',
                     '100', '--devices', 'cpu:0', '--no-progress', '--no-memory']) == 0
    # as the command wants while its process exits; the next test must not inherit it
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN


@pytest.mark.xdist_group('signals-between-tests')
def test_the_next_test_starts_commands_that_receive_sigint_and_sigterm():
    code = ('import signal\nprint(signal.getsignal(signal.SIGINT) is signal.default_int_handler, '
            'signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)')
    result = subprocess.run([PYTHON, '-c', code], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ['True', 'True'], result.stdout + result.stderr
