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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')
PYTHON = sys.executable
TRAIN = ['--epochs', '1', '--num-examples', '64', '--devices', 'cpu:0,cpu:1', '--no-progress',
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


# -- a frozen process ends the job ------------------------------------------------------------

def test_a_stopped_server_ends_the_job_within_the_stopped_timeout(tmp_path):
    from tests.test_launch import assert_nothing_left, free_port, job_pids  # pylint: disable=import-outside-toplevel
    port = free_port()
    out_path, err_path = tmp_path / 'out', tmp_path / 'err'
    with open(out_path, 'w') as out, open(err_path, 'w') as err:
        proc = subprocess.Popen(
            [PYTHON, '-m', 'mp_symbolic', 'launch', '--port', str(port), '--workers', '1',
             '--servers', '1', '--stopped-timeout', '1', '--', PYTHON, 'tests/dist_worker.py',
             '--steps', '100000'], cwd=ROOT, env=ENV, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 90
        while '[worker 0] step 1' not in out_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # the kvstore is up: the server serves the worker's pushes
        server = job_pids(out_path.read_text())['server 0']
        os.kill(server, signal.SIGSTOP)
        start = time.monotonic()
        proc.wait(timeout=60)
        seconds = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    assert proc.returncode == 1
    last = err_path.read_text().splitlines()[-1]
    assert last.startswith('error: server 0 (pid %d) has been stopped for ' % server), last
    assert last.endswith(' s (--stopped-timeout 1); stopped the other 2 processes of the job')
    # The timeout, a poll, and the others' SIGTERM (the stopped one gets SIGCONT with it).
    assert seconds < 1 + 3.0 + 1, seconds
    assert_nothing_left(out_path.read_text(), port, num_processes=3)


@pytest.mark.parametrize('value', ['0', '-1', 'inf', 'nan'])
def test_a_stopped_timeout_that_is_not_positive_is_refused(value):
    result = run(['-m', 'mp_symbolic', 'launch', '--workers', '1', '--servers', '1',
                  '--stopped-timeout', value, '--', 'true'])
    assert one_line_error(result) == (
        'error: --stopped-timeout: expected a positive number of seconds, found %s' % value)
