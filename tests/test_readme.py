"""Every shell command in README.md and in the walkthroughs it links
(docs/your-own-model.md) runs as written, in a copy of this folder, and so
does every refusal that README.md and the pages under docs/ show.

``sh`` blocks are commands that must succeed (benchmark targets run with
``QUICK=1``, a smoke run; ``make test`` is this suite and is not run again).
In ``text`` blocks, a ``$ command`` line followed by an ``error:`` line shows
a refusal: the command must fail with status 2 and print that line. A
``python`` block whose first line is ``# NAME.py`` is the file ``NAME.py``
that a later command runs. Commands starting with ``python`` run in the
project's environment, as the README says (``.venv/bin`` first on PATH).
The walkthroughs the README links run in ``tests/test_walkthrough.py``, in
a copy of their own, beside this file's on another pytest worker.
The other pages under docs/ contribute their refusals (their long commands
are benchmarks and multi-host jobs), run after those commands, and the
examples they show with what they print: a ``text`` block whose first line
is ``$ python NAME.py``, for a ``NAME.py`` the page shows, runs it, and the
command must succeed and print the block's other lines.
"""
import glob
import os
import re
import shlex
import shutil
import subprocess

import pytest

from conftest import cli_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BLOCK_RE = re.compile(r'^```(\w*)\n(.*?)^```', re.M | re.S)
SKIP = {'make test'}  # this suite
QUICK = ('make bench', 'make bench-export', 'make bench-dist', 'make bench-pipeline')


def _blocks(path=os.path.join(ROOT, 'README.md')):
    with open(path) as f:
        return _BLOCK_RE.findall(f.read())


def _commands(body):
    """Lines of a shell block, ``\\`` continuations joined, comments dropped."""
    commands, pending = [], ''
    for line in body.splitlines():
        line = pending + line.strip()
        if line.endswith('\\'):
            pending = line[:-1] + ' '
            continue
        pending = ''
        if line and not line.startswith('#'):
            commands.append(re.sub(r'\s+#\s.*$', '', line))
    return commands


def _refusals(body):
    """``$ command`` lines of a text block followed by an ``error:`` line."""
    lines = body.splitlines()
    return [('refuse', line[2:], after) for line, after in zip(lines, lines[1:])
            if line.startswith('$ ') and after.startswith('error: ')]


# Walkthroughs the README links, each run in order in a copy of its own
# (tests/test_walkthrough.py): each writes its own folders under artifacts/.
WALKTHROUGHS = ('docs/your-own-model.md',)


def _readme_steps(pages=('README.md',) + WALKTHROUGHS):
    """``[(kind, text, expected)]`` of ``pages`` in order (README.md, then
    the walkthroughs it links): files to write, commands to run."""
    steps = []
    blocks = [b for page in pages for b in _blocks(os.path.join(ROOT, page))]
    for lang, body in blocks:
        if lang == 'python' and re.match(r'# (\w+\.py)\b', body):
            steps.append(('file', re.match(r'# (\w+\.py)\b', body).group(1), body))
        elif lang == 'sh':
            steps += [('run', c, None) for c in _commands(body) if c not in SKIP]
        elif lang == 'text':
            steps += _refusals(body)
    return steps


def _output(body, files):
    """``[('output', command, printed lines)]`` of a text block showing what
    ``python NAME.py`` prints, for a file ``NAME.py`` of ``files``."""
    lines = body.splitlines()
    shown = re.match(r'\$ (python (\w+\.py))$', lines[0]) if lines else None
    if shown is None or shown.group(2) not in files or \
            any(line.startswith(('$ ', 'error: ')) for line in lines[1:]):
        return []
    return [('output', shown.group(1), lines[1:])]


def _docs_refusals():
    """The refusals the pages under docs/ show, page by page, after the
    files (``# NAME.py`` blocks) they show; and the output of such a file
    run (:func:`_output`)."""
    steps = []
    for path in sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md'))):
        if os.path.relpath(path, ROOT) in WALKTHROUGHS:
            continue
        files = set()
        for lang, body in _blocks(path):
            if lang == 'python' and re.match(r'# (\w+\.py)\b', body):
                files.add(re.match(r'# (\w+\.py)\b', body).group(1))
                steps.append(('file', re.match(r'# (\w+\.py)\b', body).group(1), body))
            elif lang == 'text':
                steps += _refusals(body) + _output(body, files)
    return steps


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
    """A copy of this folder (sources, mtimes kept) sharing its .venv."""
    if not os.path.exists(os.path.join(ROOT, '.venv', 'bin', 'python')):
        pytest.skip('no .venv here: run through make test')
    work = str(tmp_path_factory.mktemp('readme') / 'project')
    shutil.copytree(ROOT, work, symlinks=True, ignore=shutil.ignore_patterns(
        '.venv', 'artifacts', '.git', 'build', '*.egg-info', '__pycache__', '.pytest_cache',
        'my_model.py', 'my_resume.py', 'my_task.py', 'wine_rows.npy', 'x.csv', 'y.npy',
        'states.npz', 'hosts', 'load_export.py', 'bn_relu*', 'split.py', 'bert_split.py',
        'lm_states.py'))
    os.symlink(os.path.join(ROOT, '.venv'), os.path.join(work, '.venv'))
    return work


def _env(work):
    env = dict(os.environ, PATH=os.path.join(work, '.venv', 'bin') + os.pathsep +
               os.environ.get('PATH', ''), MXNET_SUBGRAPH_VERBOSE='0')
    env.pop('PYTHONPATH', None)
    return env


def test_the_readme_has_commands_to_run():
    kinds = [kind for kind, _, _ in _readme_steps()]
    assert kinds.count('run') >= 10 and 'refuse' in kinds and kinds.count('file') >= 3
    assert _docs_refusals()
    assert ('output', 'python lm_states.py') in [s[:2] for s in _docs_refusals()]


IN_PROCESS = 'python -m mp_symbolic '


def _refused_in_process(text, workdir, capsys, monkeypatch):
    """``(status, stderr)`` of a ``python -m mp_symbolic`` refusal run through
    the command's ``main`` in this process, from ``workdir``: the same argv
    and folder, without MXNet's 2-3 s start."""
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    monkeypatch.chdir(workdir)
    capsys.readouterr()
    status = cli_status(main, shlex.split(text[len(IN_PROCESS):]))
    return status, capsys.readouterr().err


def run_steps(steps, workdir, capsys, monkeypatch):
    """The failures of ``steps`` run in order in ``workdir``. Refusals: the
    first end to end, the rest of ``python -m mp_symbolic``'s through its
    ``main`` in this process."""
    failures, end_to_end = [], True
    for kind, text, expected in steps:
        if kind == 'file':
            with open(os.path.join(workdir, text), 'w') as f:
                f.write(expected)
            continue
        if kind == 'refuse' and not end_to_end and text.startswith(IN_PROCESS):
            status, stderr = _refused_in_process(text, workdir, capsys, monkeypatch)
            if status != 2 or stderr.strip().splitlines() != [expected]:
                failures.append('%s -> exit %s, stderr %r; expected exit 2 and %r'
                                % (text, status, stderr[-300:], expected))
            continue
        end_to_end = end_to_end and kind != 'refuse'
        command = text + (' QUICK=1' if text.startswith(QUICK) else '')
        done = subprocess.run(['bash', '-c', command], cwd=workdir, env=_env(workdir),
                              capture_output=True, text=True, timeout=900, check=False,
                              stdin=subprocess.DEVNULL)
        if kind == 'output' and (done.returncode != 0 or
                                 done.stdout.strip().splitlines() != expected):
            failures.append('%s -> exit %d, stdout %r; expected exit 0 and %r'
                            % (text, done.returncode, (done.stdout + done.stderr)[-500:],
                               expected))
        if kind == 'run' and done.returncode != 0:
            failures.append('%s -> exit %d: %s' % (text, done.returncode,
                                                   (done.stderr or done.stdout)[-500:]))
        elif kind == 'refuse':
            lines = done.stderr.strip().splitlines()
            if done.returncode != 2 or lines != [expected]:
                failures.append('%s -> exit %d, stderr %r; expected exit 2 and %r'
                                % (text, done.returncode, done.stderr[-300:], expected))
    return failures


@pytest.mark.slow
def test_every_readme_command_runs_as_written(workdir, capsys, monkeypatch):
    """README.md's commands in order, then the refusals and examples of the
    pages under docs/ (the walkthroughs it links run in a copy of their own,
    ``tests/test_walkthrough.py``: they read nothing the README writes)."""
    failures = run_steps(_readme_steps(('README.md',)) + _docs_refusals(), workdir, capsys,
                         monkeypatch)
    assert not failures, '\n'.join(failures)
