"""The public task interface: a task file the project never saw gets what the
bundled tasks get (train, commit, resume onto another plan, export with
parity; under launch: test_constants.py's task file), and every task that
cannot work is one line."""
import ast
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import cli_status

ROOT = Path(__file__).resolve().parents[1]

# A task file of the kind a user writes: scikit-learn's bundled breast-cancer
# data, an MLP whose blocks have no prefix= and no in_units.
OWN_TASK = '''
import mxnet as mx
import numpy as np
from mxnet import gluon
from sklearn.datasets import load_breast_cancer
import mp_symbolic

def task(hidden=16, seed=0):
    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(axis=0)) / X.std(axis=0)
    order = np.random.default_rng(seed).permutation(len(X))
    train, val = order[:448], order[448:]
    init = mx.init.Xavier()
    blocks = [gluon.nn.Dense(hidden, activation='relu', weight_initializer=init),
              gluon.nn.Dense(hidden, activation='relu', weight_initializer=init),
              gluon.nn.Dense(2, weight_initializer=init)]
    return mp_symbolic.Task(name='cancer', blocks=blocks, loss='softmax',
                            train=(X[train], y[train]), val=(X[val], y[val]), metric='acc',
                            batch_size=32, num_epochs=3, lr=0.1, momentum=0.9,
                            description='breast cancer, an MLP of %d units' % hidden)
'''


def _run(*argv, cwd=ROOT, timeout=300):
    return subprocess.run([sys.executable, '-m'] + list(argv), cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _in_process(module, *argv):
    """:func:`_run`'s result, through ``python -m module``'s ``main(argv)`` in
    this process: the same command without MXNet's 2-3 s start, for runs whose
    outcome (files, output) is checked and not the process (its signals, its
    exit through the interpreter), which :func:`_run` keeps for one case."""
    # pylint: disable=import-outside-toplevel
    from export.__main__ import main as export_main
    from export.predict import main as predict_main
    from mp_symbolic.training import cli
    main = {'mp_symbolic': cli.main, 'export': export_main, 'export.predict': predict_main}[module]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli_status(main, list(argv))
    return subprocess.CompletedProcess([module, *argv], status, out.getvalue(), err.getvalue())


@pytest.fixture(scope='module')
def own_task(tmp_path_factory):
    path = tmp_path_factory.mktemp('task') / 'cancer_task.py'
    path.write_text(OWN_TASK)
    return path


@pytest.fixture(scope='module')
def trained(own_task, tmp_path_factory):
    out = tmp_path_factory.mktemp('runs') / 'cancer'
    # in a process of its own, as the resume below: a task file's blocks without
    # prefix= are named by a per-process counter, and a resume finds them by name
    result = _run('mp_symbolic', 'train', '--task', str(own_task), '--task-arg', 'hidden=12',
                  '--devices', 'cpu:0,cpu:1,cpu:2', '--out', str(out), '--no-progress',
                  '--no-memory')
    assert result.returncode == 0, result.stderr
    return out, result


def _summary(out):
    return json.loads((out / 'current' / 'summary.json').read_text())


@pytest.mark.slow
def test_own_task_trains_and_commits_a_checkpoint(trained):
    out, result = trained
    assert 'cancer: symbolic (module API) model-parallel training, 3 blocks in 3 stage(s)' \
        in result.stdout
    assert re.search(r'validation accuracy: 0\.9\d+ \(121 examples\)', result.stdout), \
        result.stdout
    summary = _summary(out)
    assert summary['config']['task_args'] == {'hidden': 12}
    assert summary['epoch'] == 3 and summary['complete']
    assert summary['description'] == 'breast cancer, an MLP of 12 units'
    assert (out / 'current' / 'cancer-symbol.json').is_file()


@pytest.mark.slow
def test_own_task_resumes_onto_a_plan_of_another_size(trained):
    out, _ = trained
    result = _run('mp_symbolic', 'train', '--resume', str(out), '--epochs', '5',
                  '--devices', 'cpu:1,cpu:2', '--no-progress', '--no-memory')
    assert result.returncode == 0, result.stderr
    assert 'resumed from %s after epoch 3' % out in result.stdout
    summary = _summary(out)
    assert summary['epoch'] == 5 and summary['devices'] == ['cpu:1', 'cpu:2']
    assert len(summary['epoch_losses']) == 5


def test_own_task_exports_to_onnx_that_scores_what_the_module_scored(trained, own_task,
                                                                      tmp_path):
    out, _ = trained
    result = _in_process('export', '--checkpoint', str(out), '--out', str(tmp_path / 'export'))
    assert result.returncode == 0, result.stderr
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel
    sys.path.insert(0, str(own_task.parent))
    try:
        import cancer_task  # pylint: disable=import-outside-toplevel
    finally:
        sys.path.pop(0)
    task = cancer_task.task(hidden=12)
    X_val, y_val = task.val
    session = ort.InferenceSession(str(tmp_path / 'export' / 'current' / 'cancer.onnx'),
                                   providers=['CPUExecutionProvider'])
    probs = session.run(None, {'data': X_val.astype(np.float32)})[0]
    accuracy = float(np.mean(np.argmax(probs, axis=1) == y_val))
    assert accuracy == pytest.approx(_summary(out)['validation_accuracy'], abs=1e-9)

    np.save(tmp_path / 'x.npy', X_val.astype(np.float32))
    # the ONNX file end to end, the symbol/params pair in this process
    for run, model, devices in ((_run, 'cancer.onnx', []),
                                (_in_process, 'cancer-symbol.json', ['--devices', 'cpu:0,cpu:1'])):
        predicted = run('export.predict', '--model', str(tmp_path / 'export' / 'current' / model),
                        '--input', str(tmp_path / 'x.npy'), '--output', str(tmp_path / 'y.npy'),
                        *devices)
        assert predicted.returncode == 0, predicted.stderr
        np.testing.assert_allclose(np.load(tmp_path / 'y.npy'), probs, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_own_task_profiles_measures_memory_and_compares(own_task, tmp_path):
    result = _run('mp_symbolic', 'train', '--task', str(own_task), '--devices', 'cpu:0,cpu:1',
                  '--epochs', '1', '--chunks', '2', '--profile', '--out', str(tmp_path / 'p'),
                  '--no-progress')
    assert result.returncode == 0, result.stderr
    assert 'memory per device, after one step' in result.stdout
    assert (tmp_path / 'p' / 'profile.json').stat().st_size > 1000
    result = _in_process('mp_symbolic', 'compare', '--task', str(own_task), '--devices',
                         'cpu:0,cpu:1', '--epochs', '1', '--out', str(tmp_path / 'c'),
                         '--no-progress')
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r'imperative MP\s+accuracy 0\.\d+', result.stdout), result.stdout


def test_own_task_divergence_stops_the_run_keeping_the_last_checkpoint(own_task, tmp_path):
    result = _in_process('mp_symbolic', 'train', '--task', str(own_task), '--devices', 'cpu:0',
                         '--lr', '1e5', '--epochs', '3', '--out', str(tmp_path / 'd'),
                         '--no-progress', '--no-memory')
    assert result.returncode == 1
    assert result.stderr.startswith('error: training diverged'), result.stderr


def _bad_task(tmp_path, body):
    path = tmp_path / 'bad_task.py'
    path.write_text(textwrap.dedent(body))
    return str(path)


SHAPES_MISFIT = '''
import numpy as np
from mxnet import gluon
import mp_symbolic
def task():
    X = np.zeros((64, 3, 4, 4), np.float32)
    return mp_symbolic.Task(name='x', blocks=[gluon.nn.Conv1D(4, 3, in_channels=5)],
                            train=(X, np.zeros(64)))
'''

LABELS_MISFIT = '''
import numpy as np
from mxnet import gluon
import mp_symbolic
def task():
    return mp_symbolic.Task(name='x', blocks=[gluon.nn.Dense(3, in_units=4)], loss='l2',
                            train=(np.zeros((64, 4)), np.zeros((64, 2))))
'''


UNWORKABLE = [
    ('def task():\n    return None\n', 'expected task() to return an mp_symbolic.Task, found None'),
    ('x = 1\n', 'expected a function task(**kwargs) returning mp_symbolic.Task, found no task'),
    ('def task():\n    raise RuntimeError("no data here")\n',
     'expected task() to return a Task, found it raised RuntimeError: no data here '
     '(bad_task.py, line 2)'),
    ('def task(:\n', 'expected a Python file that imports, found SyntaxError'),
    ('import mp_symbolic\ndef task():\n    return mp_symbolic.Task(name="x", blocks=[], '
     'train=None, batch_size=0)\n',
     'expected task() to return a Task, found it raised TaskError: batch_size: expected a '
     'positive integer, found 0'),
    ('import numpy as np\nimport mp_symbolic\ndef build():\n    raise RuntimeError("no such '
     'width")\ndef task():\n    return mp_symbolic.Task(name="x", blocks=build, loss="l2", '
     'train=(np.zeros((8, 3)), np.zeros((8, 1))), batch_size=4)\n',
     'blocks: expected blocks() to return the network, found it raised RuntimeError: no such '
     'width (bad_task.py, line 4)'),
    (SHAPES_MISFIT, 'train: expected examples the blocks can take, found examples of shape '
                    '(3, 4, 4)'),
    (LABELS_MISFIT, "train: expected labels that fit the network's output and the loss 'l2', "
                    'found labels of shape (2,) per example'),
]


def _train_refusal(argv, capsys, end_to_end):
    """``(status, stderr)`` of ``python -m mp_symbolic train argv``.

    End to end (a subprocess: exit status, stderr and no traceback as a user
    sees them) for one case of a family; the others through ``cli.main`` in
    this process, the same code without a 2-3 s MXNet start each.
    """
    if end_to_end:
        result = _run('mp_symbolic', 'train', *argv)
        assert 'Traceback' not in result.stderr, result.stderr
        return result.returncode, result.stderr
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    capsys.readouterr()
    status = cli_status(cli.main, ['train'] + list(argv))
    return status, capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize('body, message', UNWORKABLE)
def test_a_task_that_cannot_work_is_one_line_naming_the_file(tmp_path, capsys, body, message):
    path = _bad_task(tmp_path, body)
    status, stderr = _train_refusal(['--task', path, '--devices', 'cpu:0', '--out',
                                     str(tmp_path / 'out'), '--no-progress', '--no-memory'],
                                    capsys, end_to_end=(body, message) == UNWORKABLE[0])
    assert status == 2
    assert stderr.count('\n') == 1, stderr
    assert stderr.startswith('error: --task %s: ' % path), stderr
    assert message in stderr, stderr
    assert not (tmp_path / 'out' / 'current').exists()


BAD_TASK_FLAGS = [
    (['--task', 'no_such_module_here'],
     'error: --task no_such_module_here: expected regression, digits, zoo, lm, a .py file or an '
     'importable module, found no such module'),
    (['--task', 'nowhere.py'], 'error: --task nowhere.py: expected a task file, found no file '
                               'nowhere.py'),
    (['--task', 'digits', '--task-arg', 'widths=2,1'],
     "error: --task digits: expected task() to take the given --task-arg names, found "
     "TypeError: task() got an unexpected keyword argument 'widths'"),
    (['--task-arg', 'widths=3,1'], '--widths: expected input width 2 and output width 1'),
    (['--task-arg', 'num_examples=0'], '--num-examples: expected a positive integer'),
    (['--task-arg', '1x=2'], 'argument --task-arg: expected KEY=VALUE with KEY a Python name'),
]


@pytest.mark.parametrize('argv, message', BAD_TASK_FLAGS)
def test_bad_task_flags_are_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(ROOT)  # where the subprocess runs: a relative --task is looked up here
    status, stderr = _train_refusal(['--out', str(tmp_path / 'out'), '--no-progress', *argv],
                                    capsys, end_to_end=argv == BAD_TASK_FLAGS[-1][0])
    assert status == 2
    assert stderr.count('\n') == 1 and message in stderr, stderr


def test_task_args_reach_the_task_function(tmp_path):
    result = _in_process('mp_symbolic', 'train', '--task-arg', 'widths=2,3,1', '--task-arg',
                         'num_examples=500', '--epochs', '1', '--devices', 'cpu:0,cpu:1', '--out',
                         str(tmp_path / 'out'), '--no-progress', '--no-memory', '--lr', '0.01')
    assert 'layer1_weight' in result.stdout and 'layer2_weight' not in result.stdout
    assert _summary(tmp_path / 'out')['config']['task_args'] == {
        'widths': [2, 3, 1], 'num_examples': 500}


# -- the layers, from the tree ---------------------------------------------------------------

def _imports(path):
    """Absolute module names ``path`` imports (relative ones resolved)."""
    package = '.'.join(path.relative_to(ROOT).with_suffix('').parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split('.')[:len(package.split('.')) - node.level + 1]
                names.add('.'.join(base + ([node.module] if node.module else [])))
            else:
                names.add(node.module)
    return names


def _sources(folder):
    return sorted((ROOT / folder).rglob('*.py'))


def test_core_imports_only_mxnet_numpy_and_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {'mxnet', 'numpy', 'mp_symbolic'}
    for path in _sources('mp_symbolic/core'):
        for name in _imports(path):
            top = name.split('.')[0]
            assert top in allowed, '%s imports %s' % (path, name)
            assert not name.startswith(('mp_symbolic.tools', 'mp_symbolic.training')), \
                '%s imports %s' % (path, name)


@pytest.mark.parametrize('folder', ['mp_symbolic/tools', 'export'])
def test_tools_and_export_import_no_training_code(folder):
    for path in _sources(folder):
        for name in _imports(path):
            assert not name.startswith('mp_symbolic.training'), '%s imports %s' % (path, name)


def test_generic_code_does_not_know_the_bundled_tasks():
    """The library does not know its examples: no task name or layer-name
    pattern of theirs outside their own files."""
    generic = _sources('mp_symbolic/core') + _sources('mp_symbolic/tools') + \
        _sources('export') + [ROOT / 'mp_symbolic/training' / name for name in
                              ('loop.py', 'config.py', 'compare.py', 'symbolic.py',
                               'imperative.py', 'data.py')]
    for path in generic:
        code = re.sub(r'("""|\'\'\').*?\1', '', path.read_text(), flags=re.S)  # docstrings
        code = '\n'.join(line.split('#')[0] for line in code.splitlines())
        if path.name == 'heads.py':  # the L2 head is MXNet's LinearRegressionOutput
            code = code.replace("'LinearRegressionOutput', 'regression'", '')
        for word in ("'regression'", "'digits'", 'final_mse', 'held_out_accuracy', 'layer(\\d'):
            assert word not in code, '%s mentions %s' % (path, word)


@pytest.mark.parametrize('field, value', [('lr', 0.0), ('lr', 1e-31), ('lr', 2e6), ('lr', True),
                                          ('momentum', 1.0), ('momentum', -0.1),
                                          ('batch_size', 0), ('batch_size', 2.0)])
def test_a_task_and_a_flag_refuse_the_same_values_in_the_same_words(field, value):
    import numpy as np  # pylint: disable=import-outside-toplevel
    from mxnet.gluon import nn  # pylint: disable=import-outside-toplevel
    from mp_symbolic import Task  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.config import TrainConfig  # pylint: disable=import-outside-toplevel
    X, y = np.zeros((4, 2), np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError) as by_task:
        Task(name='t', blocks=[nn.Dense(1)], train=(X, y), loss='l2', **{field: value})
    with pytest.raises(ValueError) as by_flag:
        TrainConfig(**{field: value})
    expected = str(by_flag.value).split(', found')[0]
    assert expected.startswith(field + ': expected ')
    assert str(by_task.value).split(', found')[0] == expected


def test_the_graph_vocabulary_has_one_home():
    """The names the library writes into a graph (the ctx_group attribute, the
    tied identity's suffix, the shard mark, chunk copies, input and label
    names) are spelled in core/graph/names.py alone; the rest imports them."""
    words = ("'__ctx_group__'", "'__tp_shard__'", "'__force_mirroring__'", "'_tied'",
             "'_chunk", "split('/', 2)", "'softmax_label'")
    for path in _sources('mp_symbolic') + _sources('export'):
        if path.name == 'names.py':
            continue
        code = re.sub(r'("""|\'\'\').*?\1', '', path.read_text(), flags=re.S)  # docstrings
        code = '\n'.join(line.split('#')[0] for line in code.splitlines())
        for word in words:
            assert word not in code, '%s spells %s' % (path.relative_to(ROOT), word)


def test_the_public_names_fit_on_one_screen():
    import mp_symbolic  # pylint: disable=import-outside-toplevel
    assert len(mp_symbolic.__all__) <= 30
    for name in mp_symbolic.__all__:
        assert getattr(mp_symbolic, name) is not None


def test_the_public_names_load_no_training_code_and_train_config_stays_readable():
    code = ('import sys\nimport mp_symbolic\nfrom mp_symbolic import Pipeline, Trainer\n'
            'print(any(m.startswith("mp_symbolic.training") for m in sys.modules))\n'
            'from mp_symbolic.training import TrainConfig\n'
            'print(mp_symbolic.TrainConfig is TrainConfig, "TrainConfig" in mp_symbolic.__all__)')
    result = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env=dict(os.environ))
    assert result.stdout.split() == ['False', 'True', 'False'], result.stdout + result.stderr


def test_help_answers_without_loading_mxnet():
    code = ('import sys\nfrom mp_symbolic.training.cli import main\n'
            'for argv in (["--help"], ["train", "--help"], ["launch", "--help"]):\n'
            '    try:\n        main(argv)\n    except SystemExit:\n        pass\n'
            'print("mxnet" in sys.modules)')
    result = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env=dict(os.environ))
    assert result.stdout.strip().splitlines()[-1] == 'False', result.stdout + result.stderr


def test_a_task_refuses_an_lr_schedule_it_cannot_call():
    import numpy as np  # pylint: disable=import-outside-toplevel
    from mxnet.gluon import nn  # pylint: disable=import-outside-toplevel
    from mp_symbolic import Task, TaskError  # pylint: disable=import-outside-toplevel
    X, y = np.zeros((4, 2), np.float32), np.zeros(4, np.float32)
    with pytest.raises(TaskError) as raised:
        Task(name='t', blocks=[nn.Dense(1)], train=(X, y), loss='l2', lr_schedule=0.1)
    assert str(raised.value).startswith('lr_schedule: expected None or a callable (lr, steps) '
                                        '-> mx.lr_scheduler.LRScheduler, found ')
