"""``python -m bench.peer``: the project's GPT against the same GPT in PyTorch.

torch runs only in the benchmark's own processes (a test process may have
imported GluonCV, which refuses to import beside torch 2).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bench import peer
from bench.nodes import _ask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, **peer.THREADS)
ROWS = ('one process, explicit attention', 'one process, SDPA',
        '2 processes 1F1B, 2 micro-batches')
VARIANT = 'MXNET_EXEC_BULK_EXEC_TRAIN=0'   # a --project-env row
VARIANT_ROW = 'one process, explicit attention, ' + VARIANT


@pytest.fixture(scope='module')
def quick(tmp_path_factory):
    """``(stdout, figures of width 32)`` of one quick run with a ``--project-env`` row."""
    out = tmp_path_factory.mktemp('peer') / 'peer.json'
    result = subprocess.run([sys.executable, '-m', 'bench.peer', '--quick', '--out', str(out),
                             '--project-env', VARIANT],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, json.loads(out.read_text())['32']


@pytest.mark.slow
def test_quick_run_prints_every_row_after_each_pytorch_copy_matches_the_first_loss(quick):
    text, figures = quick
    assert "width 32: first step's loss" in text
    for row in ROWS:
        line = next(line for line in text.splitlines() if line.strip().startswith(row))
        assert len(line.split()) >= len(row.split()) + 5, line   # times, ratio, each round
    assert 'GEMM peak of one thread' in text and 'MFU' in text
    assert "first step's probabilities" in text
    assert len(figures['losses']) == 4
    for value in figures['losses'].values():
        assert peer.same_loss(figures['loss'], value)
    assert all(d <= peer.SOFTMAX_ATOL for d in figures['softmax_diff'].values())
    assert "second step's loss, after one Adam update" in text
    assert len(figures['second_losses']) == 4
    for value in figures['second_losses'].values():
        assert peer.same_loss(figures['second_loss'], value)
    for name in ROWS:
        assert len(figures['times'][name]) == 2
        assert all(s > 0 for pair in figures['times'][name] for s in pair)


@pytest.mark.slow
def test_quick_run_prints_each_sides_cpu_time_and_a_row_under_the_project_env_given(quick):
    text, figures = quick
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if 'CPU time a step' in line)
    for row in ROWS + (VARIANT_ROW,):   # a row of wall times above, of CPU times below
        assert any(line.strip().startswith(row) for line in lines[:start]), row
        assert any(line.strip().startswith(row) for line in lines[start:]), row
    assert peer.same_loss(figures['loss'], figures['losses']['the project, ' + VARIANT])
    for name in ROWS + (VARIANT_ROW,):
        assert len(figures['cpu'][name]) == 2
        assert all(s > 0 for pair in figures['cpu'][name] for s in pair)
        assert figures['cpu_medians'][name]['ratio'] > 0
        # the Python threads' share of the project's CPU time: a part of it, not all
        assert 0 < figures['cpu_medians'][name]['project_python_s'] < \
            figures['cpu_medians'][name]['project_s']


def test_a_project_env_not_of_name_value_pairs_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        peer.main(['--project-env', 'MXNET_ENGINE_TYPE'])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m bench.peer: error: argument --project-env: expected NAME=VALUE pairs "
        "separated by commas, found 'MXNET_ENGINE_TYPE'")


def _server(role, width=32):
    return subprocess.Popen([sys.executable, '-m', 'bench.peer', peer.SERVE, role, '--width',
                             str(width), '--layers', '1', '--batch', '4'], cwd=ROOT, env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_the_first_output_tells_a_pytorch_copy_with_one_weight_changed_apart(tmp_path):
    values, changed = str(tmp_path / 'initial.npz'), str(tmp_path / 'changed.npz')
    project = _server('project')
    try:
        loss = _ask([project], 'init ' + values)[0]['loss']
    finally:
        project.stdin.close()
        project.wait(timeout=60)
    arrays = dict(np.load(values))
    arrays['block0_attention_query_weight'] = arrays['block0_attention_query_weight'] * 1.5
    np.savez(changed, **arrays)
    torch = _server('torch')
    try:   # each ``init`` builds both PyTorch models afresh from the file it names
        first = {name: _ask([torch], 'init ' + path)[0]
                 for name, path in (('same', values), ('changed', changed))}
    finally:
        torch.stdin.close()
        torch.wait(timeout=60)
    for attention in ('explicit', 'sdpa'):
        same, other = first['same'][attention], first['changed'][attention]
        assert peer.same_loss(loss, same['loss'])
        assert same['softmax_diff'] <= peer.SOFTMAX_ATOL
        assert other['softmax_diff'] > peer.SOFTMAX_ATOL, other


def test_micro_batch_counts_that_do_not_divide_the_batch_are_refused_in_one_line():
    result = subprocess.run([sys.executable, '-m', 'bench.peer', '--chunks', '4,3'], cwd=ROOT,
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        'python -m bench.peer: error: --chunks: expected divisors of --batch (16), found 3')
    assert 'Traceback' not in result.stderr


@pytest.mark.slow
def test_initial_values_without_the_models_parameters_end_a_pytorch_process_in_one_line(
        tmp_path):
    path = str(tmp_path / 'other.npz')
    np.savez(path, other_weight=np.zeros((3, 4), np.float32))
    proc = subprocess.Popen([sys.executable, '-m', 'bench.peer', peer.SERVE, 'torch', '--width',
                             '32', '--layers', '1', '--batch', '4'], cwd=ROOT, env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    stdout, stderr = proc.communicate('init %s\n' % path, timeout=300)
    assert proc.returncode == 1
    assert stdout == ''
    assert stderr.strip().splitlines()[-1] == (
        'error: initial values: expected embed_token_weight, found none')
    assert 'Traceback' not in stderr
