"""``python -m mp_symbolic launch``: a ps-lite job on loopback runs, agrees, and
never leaves a process behind.

Jobs run ``tests/dist_worker.py`` (a few dist_sync steps of the project's
network) under the real CLI in a subprocess. After every job, each pid the
launcher reported is checked to be gone, and no process on the machine still
carries the job's ``DMLC_PS_ROOT_PORT`` in its environment (that catches
grandchildren too).
"""
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mp_symbolic.training import cli
from mp_symbolic.tools.launch import (RANK_MARK, Node, _Child, plan_job, read_hostfile,
                                      shell_line, worker_argv)

from conftest import cli_status, reserved_port

ROOT = Path(__file__).resolve().parent.parent
WORKER = [sys.executable, 'tests/dist_worker.py']
ENV = dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0',
           PYTHONPATH=os.pathsep.join([str(ROOT)] + os.environ.get('PYTHONPATH', '').split(
               os.pathsep)).rstrip(os.pathsep))
JOB_TIMEOUT = 90  # seconds: a hung launcher fails the test instead of hanging the suite


def launch(*args, port):
    """Runs the launcher to the end; returns ``(CompletedProcess, seconds)``.

    A launcher still running after ``JOB_TIMEOUT`` gets SIGTERM (so that it
    stops its job) and the test fails.
    """
    argv = [sys.executable, '-m', 'mp_symbolic', 'launch', '--port', str(port), *args]
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
        pytest.fail('launcher still running after %d s:\n%s\n%s' % (JOB_TIMEOUT, out, err))
    result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    return result, time.monotonic() - start


def test_a_reserved_port_refuses_other_binds_but_lets_the_scheduler_listen(port):
    with socket.socket() as other:  # a plain bind: another worker's pick, the launcher's default
        with pytest.raises(OSError):
            other.bind(('', port))
    with socket.socket() as scheduler:  # ZeroMQ's listener
        scheduler.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        scheduler.bind(('', port))
        scheduler.listen()


def job_pids(stdout):
    """``{'scheduler': pid, 'server 0': pid, 'worker 0': pid, ...}`` from the launcher's pids line."""
    line = next(l for l in stdout.splitlines() if l.startswith('launch: pids: '))
    return {name: int(pid) for name, pid in
            (item.rsplit(' ', 1) for item in line[len('launch: pids: '):].split(', '))}


def worker_of_rank(stdout, rank):
    """The launcher's name (``'worker i'``) of the worker whose kvstore rank is ``rank``."""
    return re.search(r'^\[(worker \d+)\] rank %d of' % rank, stdout, re.M).group(1)


def processes_of_job(port):
    """Pids of every process whose environment has ``DMLC_PS_ROOT_PORT=<port>``."""
    marker = b'DMLC_PS_ROOT_PORT=%d\0' % port
    found = []
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                with open('/proc/%s/environ' % entry, 'rb') as f:
                    if marker in f.read():
                        found.append(int(entry))
            except OSError:
                pass  # ended meanwhile, or not ours
    return found


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_nothing_left(stdout, port, num_processes):
    pids = job_pids(stdout)
    assert len(pids) == num_processes
    assert [name for name, pid in pids.items() if alive(pid)] == []
    assert processes_of_job(port) == []


def final_params(stdout):
    return {m.group(1): m.group(2)
            for m in re.finditer(r'^\[(worker \d+)\] params (.*)$', stdout, re.M)}


# -- a job that completes ---------------------------------------------------------------------

@pytest.fixture(scope='module')
def finished_job():
    with reserved_port() as port:
        result, seconds = launch('--workers', '2', '--servers', '1', '--', *WORKER, '--steps',
                                 '4', port=port)
    return result, seconds, port


def test_two_workers_finish_with_the_same_parameters_and_distinct_ranks(finished_job):
    result, _, _ = finished_job
    assert result.returncode == 0, result.stderr
    params = final_params(result.stdout)
    assert sorted(params) == ['worker 0', 'worker 1']
    assert params['worker 0'] == params['worker 1']
    ranks = sorted(re.findall(r'^\[worker \d+\] rank (\d+) of 2$', result.stdout, re.M))
    assert ranks == ['0', '1']


def test_every_child_line_is_prefixed_with_its_process(finished_job):
    result, _, _ = finished_job
    prefix = re.compile(r'^\[(scheduler|server 0|worker [01])\] ')
    lines = result.stdout.splitlines()
    assert all(prefix.match(l) or l.startswith('launch: ') for l in lines), lines
    assert all(prefix.match(l) for l in result.stderr.splitlines()), result.stderr
    for name in ('worker 0', 'worker 1'):
        assert sum(l.startswith('[%s] step ' % name) for l in lines) == 4


def test_summary_line_ends_a_clean_job(finished_job):
    result, _, _ = finished_job
    assert re.fullmatch(r'launch: 2 workers, 1 server: all exited 0 in \d+\.\d s',
                        result.stdout.splitlines()[-1])


def test_clean_job_leaves_no_process(finished_job):
    result, _, port = finished_job
    assert_nothing_left(result.stdout, port, num_processes=4)


# -- faults -----------------------------------------------------------------------------------

def test_worker_killed_mid_run_stops_the_job(port):
    result, _ = launch('--workers', '2', '--servers', '1', '--', *WORKER, '--steps', '1000',
                       '--fail-rank', '1', '--fail-after', '2', '--fail-how', 'kill', port=port)
    assert result.returncode == 1  # ended by the kill (a job past JOB_TIMEOUT fails in launch)
    name = worker_of_rank(result.stdout, 1)
    assert result.stderr.splitlines()[-1] == (
        'error: %s (pid %d) was killed by SIGKILL; stopped the other 3 processes of the job'
        % (name, job_pids(result.stdout)[name]))
    assert_nothing_left(result.stdout, port, num_processes=4)


def test_worker_exiting_non_zero_stops_the_job_and_its_grandchildren(port):
    # Each worker leaves a grandchild (sleep) in its process group.
    command = 'sleep 600 & exec %s --steps 1000 --fail-rank 0 --fail-after 1 --fail-how exit3' % (
        shlex.join(WORKER))
    result, _ = launch('--workers', '2', '--servers', '1', '--', 'sh', '-c', command, port=port)
    assert result.returncode == 1  # ended by the exit (a job past JOB_TIMEOUT fails in launch)
    name = worker_of_rank(result.stdout, 0)
    assert result.stderr.splitlines()[-1] == (
        'error: %s (pid %d) exited with status 3; stopped the other 3 processes of the job'
        % (name, job_pids(result.stdout)[name]))
    assert_nothing_left(result.stdout, port, num_processes=4)


@pytest.mark.parametrize('signum, status', [(signal.SIGINT, 130), (signal.SIGTERM, 143),
                                            (signal.SIGHUP, 129)])
def test_signal_to_launcher_stops_the_job(signum, status, tmp_path, port):
    out_path, err_path = tmp_path / 'out', tmp_path / 'err'
    with open(out_path, 'w') as out, open(err_path, 'w') as err:
        proc = subprocess.Popen(
            [sys.executable, '-m', 'mp_symbolic', 'launch', '--port', str(port), '--workers', '1',
             '--servers', '1', '--', 'sh', '-c', 'echo ready; sleep 600'],
            cwd=ROOT, env=ENV, stdout=out, stderr=err)
    deadline = time.monotonic() + JOB_TIMEOUT
    # Up to the worker's first line: every process is started.
    while '[worker 0] ready' not in out_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signum)
    try:
        proc.wait(timeout=JOB_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    assert proc.returncode == status
    assert err_path.read_text().splitlines()[-1] == (
        'error: launch interrupted by %s; stopped the 3 running processes of the job'
        % signum.name)
    assert_nothing_left(out_path.read_text(), port, num_processes=3)


# A process that adopts the orphans of the launcher it starts (a child subreaper), so
# that it can tell how each child of a killed launcher ended: it starts the launcher,
# waits for its pids line and its worker's first line, sends it the signal, and reaps
# each pid the launcher printed. One still running after the guard is killed (with its
# process group) and reported as such: no process outlives the test.
ORPHANS = r'''
import ctypes, json, os, signal, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
signum, guard, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
pids, ready = None, False
for line in launcher.stdout:
    if line.startswith('launch: pids: '):
        pids = dict((n, int(p)) for n, p in (item.rsplit(' ', 1) for item in
                                             line[len('launch: pids: '):].strip().split(', ')))
    ready = ready or line.startswith('[worker 0] ready')
    if pids and ready:
        break
os.kill(launcher.pid, signum)
launcher.wait()
ended, deadline = {}, time.monotonic() + guard
while len(ended) < len(pids) and time.monotonic() < deadline:
    for name, pid in pids.items():
        if name in ended:
            continue
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            info = None
            if not os.path.exists('/proc/%d' % pid):
                ended[name] = 'gone'
        if info is not None:
            ended[name] = ('exited %d' % info.si_status if info.si_code == os.CLD_EXITED
                           else 'killed by %s' % signal.Signals(info.si_status).name)
    time.sleep(0.05)
for name, pid in pids.items():
    if name not in ended:
        ended[name] = 'still running'
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
print(json.dumps({'launcher': launcher.returncode, 'ended': ended}))
'''


def test_a_launcher_killed_by_sigkill_takes_every_process_of_its_job_along(port):
    argv = [sys.executable, '-m', 'mp_symbolic', 'launch', '--port', str(port), '--workers',
            '1', '--servers', '1', '--', 'sh', '-c', 'echo ready; exec sleep 600']
    done = subprocess.run([sys.executable, '-c', ORPHANS, str(int(signal.SIGKILL)),
                           str(JOB_TIMEOUT), *argv], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=2 * JOB_TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        'launcher': -signal.SIGKILL,
        'ended': {name: 'killed by SIGKILL' for name in ('scheduler', 'server 0', 'worker 0')}}
    assert processes_of_job(port) == []


def test_a_worker_alive_but_silent_ends_the_job_naming_it(capsys, tmp_path, port):
    """--progress-timeout: one worker prints a line and then nothing (alive,
    asleep), the other keeps redrawing a progress bar without a newline, and
    the silent scheduler and server are not watched: the job ends naming the
    silent worker, and no process is left."""
    claim = tmp_path / 'claimed'
    script = ('if mkdir %s 2>/dev/null; then echo wedged; exec sleep 600; '
              'else while :; do printf .; sleep 0.1; done; fi' % shlex.quote(str(claim)))
    status = cli_status(cli.main, ['launch', '--port', str(port), '--workers', '2', '--servers',
                                   '1', '--progress-timeout', '2', '--', 'sh', '-c', script])
    out, err = capsys.readouterr()
    assert status == 1
    wedged = re.search(r'^\[(worker \d)\] wedged$', out, re.M).group(1)
    assert re.fullmatch(r'error: %s \(pid %d\) has printed nothing for \d+\.\d s '
                        r'\(--progress-timeout 2\); stopped the other 3 processes of the job'
                        % (wedged, job_pids(out)[wedged]), err.splitlines()[-1]), err
    assert re.search(r'^\[worker \d\] \.+$', out, re.M)  # the bar, relayed at its end
    assert_nothing_left(out, port, num_processes=4)


def test_workers_silent_together_are_each_named(capsys, port):
    """Under dist_sync the workers waiting for a wedged one fall silent with it:
    output cannot tell which is wedged, and the line names each."""
    status = cli_status(cli.main, ['launch', '--port', str(port), '--workers', '2', '--servers',
                                   '1', '--progress-timeout', '2', '--', 'sh', '-c',
                                   'echo ready; exec sleep 600'])
    out, err = capsys.readouterr()
    pids = job_pids(out)
    assert status == 1
    assert re.fullmatch(r'error: worker (\d) \(pid (\d+)\), worker (\d) \(pid (\d+)\) have '
                        r'printed nothing for \d+\.\d s \(--progress-timeout 2\), each wedged '
                        r'or waiting for one that is; stopped the 4 running processes of the job',
                        err.splitlines()[-1]), err
    named = re.findall(r'(worker \d) \(pid (\d+)\)', err.splitlines()[-1])
    assert sorted((n, int(p)) for n, p in named) == [('worker 0', pids['worker 0']),
                                                     ('worker 1', pids['worker 1'])]
    assert_nothing_left(out, port, num_processes=4)


def test_servers_outliving_the_workers_are_stopped_after_the_timeout(port):
    # Workers that never join the kvstore: the scheduler and server wait for them forever.
    result, _ = launch('--workers', '1', '--servers', '1', '--timeout', '1', '--',
                       'sh', '-c', 'exit 0', port=port)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == ('error: every worker exited 0 but scheduler, '
                                              'server 0 did not end within 1 s after; '
                                              'stopped them')
    assert_nothing_left(result.stdout, port, num_processes=3)


# -- several hosts ----------------------------------------------------------------------------

def test_manual_commands_run_as_separate_hosts_complete_the_job(tmp_path, port):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('# two names for this machine stand in for two hosts\n'
                        '127.0.0.1\nlocalhost  # second host\n')
    result, _ = launch('--mode', 'manual', '--hostfile', str(hostfile), '--workers', '2',
                       '--servers', '1', '--', *WORKER, '--steps', '3', port=port)
    assert result.returncode == 0, result.stderr
    hosts = dict(re.findall(r'^# (scheduler|server \d+|worker \d+) on (\S+)$', result.stdout,
                            re.M))
    assert hosts == {'scheduler': '127.0.0.1', 'server 0': '127.0.0.1',
                     'worker 0': '127.0.0.1', 'worker 1': 'localhost'}
    commands = [l for l in result.stdout.splitlines() if l and not l.startswith('#')]
    assert len(commands) == 4
    assert all('DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=%d' % port in c for c in commands)
    procs = [subprocess.Popen(['sh', '-c', c], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, start_new_session=True)
             for c in commands]
    try:
        outputs = [p.communicate(timeout=JOB_TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0, 0, 0]
    params = [re.search(r'^params (.*)$', out, re.M).group(1) for out in outputs[2:]]
    assert params[0] == params[1]


def test_ssh_mode_runs_each_process_through_ssh_to_its_host(tmp_path, port):
    # No ssh here: a stand-in reports its host and runs the remote line locally.
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'ssh').write_text('#!/bin/sh\n'
                                 'for arg; do host=$line; line=$arg; done\n'
                                 'echo "ssh to $host" >&2\n'
                                 'exec sh -c "$line"\n')
    (bin_dir / 'ssh').chmod(0o755)
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('127.0.0.1\nlocalhost\n')
    env = dict(ENV, PATH='%s%s%s' % (bin_dir, os.pathsep, ENV['PATH']))
    result = subprocess.run(
        [sys.executable, '-m', 'mp_symbolic', 'launch', '--mode', 'ssh', '--hostfile',
         str(hostfile), '--port', str(port), '--workers', '2', '--servers', '1', '--',
         *WORKER, '--steps', '2'],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert sorted(re.findall(r'^\[(.*)\] ssh to (\S+)$', result.stderr, re.M)) == [
        ('scheduler', '127.0.0.1'), ('server 0', '127.0.0.1'), ('worker 0', '127.0.0.1'),
        ('worker 1', 'localhost')]
    params = final_params(result.stdout)
    assert len(params) == 2 and params['worker 0'] == params['worker 1']
    assert_nothing_left(result.stdout, port, num_processes=4)


def test_a_workers_lines_name_its_kvstore_rank_from_the_line_that_tells_it():
    """The rank line sets the prefix of the lines after it, on stdout and
    stderr, and is not relayed; a server's identical line is its own output."""
    import io, threading  # pylint: disable=import-outside-toplevel,multiple-imports
    script = ('echo before; echo "%s1"; echo after; sleep 0.2; echo late >&2' % RANK_MARK)
    relayed = {}
    for role in ('worker', 'server'):
        out, err = io.StringIO(), io.StringIO()
        child = _Child(Node(role, 0, '127.0.0.1', (), ()), ('sh', '-c', script), dict(os.environ),
                       out, err, threading.Lock())
        child.reap()
        relayed[role] = out.getvalue() + err.getvalue()
    assert relayed['worker'] == ('[worker 0] before\n[worker 0, rank 1] after\n'
                                 '[worker 0, rank 1] late\n')
    assert relayed['server'] == ('[server 0] before\n[server 0] %s1\n[server 0] after\n'
                                 '[server 0] late\n' % RANK_MARK)


def test_hosts_are_assigned_round_robin_with_the_scheduler_on_the_first():
    hosts = [('a', '10.0.0.1'), ('b', '10.0.0.2')]
    nodes = plan_job(['python', 'w.py'], num_workers=3, num_servers=2, hosts=hosts, port=9000)
    assert [(n.name, n.host) for n in nodes] == [
        ('scheduler', 'a'), ('server 0', 'a'), ('server 1', 'b'),
        ('worker 0', 'a'), ('worker 1', 'b'), ('worker 2', 'a')]
    for node in nodes:
        env = dict(node.env)
        assert env['DMLC_PS_ROOT_URI'] == '10.0.0.1'
        assert env['DMLC_NODE_HOST'] == dict(hosts)[node.host]
        assert env['DMLC_ROLE'] == node.role


def test_shell_line_quotes_arguments_for_the_shell():
    node = plan_job(['python', 'w.py', 'two words', "it's"], 1, 1, [('h', '10.0.0.1')], 9000)[-1]
    words = shlex.split(shell_line(node, '/data/my project'))
    assert words[:3] == ['cd', '/data/my project', '&&']
    assert words[-4:] == ['python', 'w.py', 'two words', "it's"]
    assert 'DMLC_ROLE=worker' in words


def test_hostfile_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / 'hosts'
    path.write_text('# cluster\nnode1\n\n  node2   # the second\n')
    assert read_hostfile(str(path)) == ['node1', 'node2']


# -- which command a worker runs --------------------------------------------------------------

def test_mp_symbolic_subcommand_gets_the_dist_sync_kvstore():
    assert worker_argv(['train', '--epochs', '2'], ('train',)) == (
        sys.executable, '-m', 'mp_symbolic', 'train', '--epochs', '2', '--kvstore', 'dist_sync')


def test_given_kvstore_is_kept():
    assert worker_argv(['train', '--kvstore=dist_async'], ('train',))[-1] == '--kvstore=dist_async'


def test_other_command_runs_as_given():
    assert worker_argv(['python', 'w.py', 'train'], ('train',)) == ('python', 'w.py', 'train')


def test_a_python_script_runs_with_the_launchers_python():
    assert worker_argv(['examples/w.py', '--steps', '2']) == (
        sys.executable, 'examples/w.py', '--steps', '2')


# -- refusals before anything starts ----------------------------------------------------------

BAD_WORKER_COMMANDS = [
    (['train', '...'], 'error: worker command: python -m mp_symbolic train: unrecognized '
                       'arguments: ...'),
    (['train', '--epochs', '0'], 'worker command: --epochs: expected a positive integer'),
    (['train', '--task', 'nowhere.py'], 'worker command: --task nowhere.py: expected a task '
                                        'file, found no file nowhere.py'),
]


def test_a_bad_worker_command_is_refused_before_any_process_starts():
    """End to end, one case of the family (the others: below, in-process)."""
    worker, message = BAD_WORKER_COMMANDS[0]
    result = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'launch', '--workers', '2',
                             '--servers', '1', '--'] + worker,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ''  # not even the launcher's first line: nothing started
    assert result.stderr.count('\n') == 1 and message in result.stderr, result.stderr


@pytest.mark.parametrize('worker, message', BAD_WORKER_COMMANDS)
def test_every_bad_worker_command_is_one_line_and_starts_no_process(capsys, monkeypatch, worker,
                                                                     message):
    assert message in _refused(capsys, monkeypatch, '--workers', '2', '--servers', '1', '--',
                               *worker)


def _refused(capsys, monkeypatch, *args):
    """Runs the CLI in this process with process creation forbidden; returns stderr."""
    def no_process(*_, **__):
        raise AssertionError('a process was started')
    monkeypatch.setattr(subprocess, 'Popen', no_process)
    status = cli_status(cli.main, ['launch', *args])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ''
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: ')
    return lines[0]


@pytest.mark.parametrize('flags, message', [
    (['--workers', '0', '--servers', '1'], '--workers: expected a positive integer, found 0'),
    (['--workers', '-2', '--servers', '1'], '--workers: expected a positive integer, found -2'),
    (['--workers', '2', '--servers', '0'], '--servers: expected a positive integer, found 0'),
    (['--workers', '1', '--servers', '1', '--timeout', '0'], '--timeout: expected a positive'),
    (['--workers', '1', '--servers', '1', '--port', '70000'], '--port: expected a port number'),
    (['--workers', '1', '--servers', '1', '--mode', 'ssh'], '--mode ssh: expected --hostfile'),
    (['--workers', '1', '--servers', '1', '--progress-timeout', '0'],
     '--progress-timeout: expected a positive number of seconds, found 0'),
    (['--workers', '1', '--servers', '1', '--progress-timeout', 'nan'],
     '--progress-timeout: expected a positive number of seconds, found nan'),
])
def test_bad_flag_is_refused_before_start(capsys, monkeypatch, flags, message):
    assert message in _refused(capsys, monkeypatch, *flags, '--', 'python', 'w.py')


def test_port_in_use_is_refused_before_start(capsys, monkeypatch):
    with socket.socket() as sock:
        sock.bind(('', 0))
        sock.listen()
        port = sock.getsockname()[1]
        line = _refused(capsys, monkeypatch, '--workers', '1', '--servers', '1',
                        '--port', str(port), '--', 'python', 'w.py')
    assert line.startswith('error: --port: expected a free port for the scheduler, '
                           'found port %d in use' % port)


def test_unknown_host_is_refused_before_start(capsys, monkeypatch, tmp_path):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('127.0.0.1\nno-such-host.invalid\n')
    line = _refused(capsys, monkeypatch, '--mode', 'manual', '--hostfile', str(hostfile),
                    '--workers', '2', '--servers', '1', '--', 'python', 'w.py')
    assert "unknown host 'no-such-host.invalid'" in line


@pytest.mark.parametrize('mode', ['manual', 'local'])
def test_a_hostfile_that_is_a_fifo_is_refused_in_one_line_without_waiting_for_a_writer(
        tmp_path, mode):
    """A FIFO nobody writes to: open() would wait for a writer for ever."""
    fifo = tmp_path / 'hosts'
    os.mkfifo(fifo)
    start = time.monotonic()
    result = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'launch', '--nodes', '2',
                             '--mode', mode, '--hostfile', str(fifo), '--', 'train',
                             '--devices', 'cpu:0,cpu:1'],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=20)
    assert time.monotonic() - start < 10
    assert (result.returncode, result.stdout) == (2, '')
    assert result.stderr == ('error: --hostfile: expected a regular file of host names, found '
                             '%s, which is a FIFO\n' % fifo)


def test_a_hostfile_that_is_a_directory_is_refused_naming_it(capsys, monkeypatch, tmp_path):
    line = _refused(capsys, monkeypatch, '--mode', 'manual', '--hostfile', str(tmp_path),
                    '--nodes', '2', '--', 'python', 'w.py')
    assert line == ('error: --hostfile: expected a regular file of host names, found %s, which '
                    'is a directory' % tmp_path)


def test_local_mode_refuses_a_remote_host(capsys, monkeypatch, tmp_path):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('10.1.2.3\n')
    line = _refused(capsys, monkeypatch, '--hostfile', str(hostfile),
                    '--workers', '1', '--servers', '1', '--', 'python', 'w.py')
    assert '10.1.2.3' in line and 'expected --mode ssh or --mode manual' in line


def test_missing_command_is_refused_before_start(capsys, monkeypatch):
    assert 'expected a command after --' in _refused(capsys, monkeypatch, '--workers', '1',
                                                     '--servers', '1')


def test_command_that_is_not_a_program_is_refused_before_start(capsys, monkeypatch):
    line = _refused(capsys, monkeypatch, '--workers', '1', '--servers', '1', '--',
                    'no-such-program-xyz', 'w.py')
    assert "found 'no-such-program-xyz'" in line


def test_a_script_that_is_not_there_is_refused_before_start(capsys, monkeypatch, tmp_path):
    line = _refused(capsys, monkeypatch, '--workers', '1', '--servers', '1', '--',
                    str(tmp_path / 'missing.py'))
    assert line == "error: expected COMMAND's script %s to be a file, found none" % (
        tmp_path / 'missing.py')


def test_train_with_dist_sync_outside_launch_is_one_line_naming_launch(capsys, monkeypatch,
                                                                       tmp_path):
    for name in ('DMLC_ROLE', 'DMLC_PS_ROOT_URI', 'DMLC_PS_ROOT_PORT', 'DMLC_NUM_SERVER',
                 'DMLC_NUM_WORKER'):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv('DMLC_NUM_WORKER', '2')  # one of them set by hand: the rest are named
    status = cli_status(cli.main, ['train', '--kvstore', 'dist_sync', '--out',
                                   str(tmp_path / 'run'), '--no-progress', '--no-memory'])
    err = capsys.readouterr().err
    assert status == 2 and err.splitlines() == [
        'error: --kvstore: expected dist_sync in a process python -m mp_symbolic launch started '
        '(it sets the DMLC_* variables that say where the scheduler is), found DMLC_ROLE, '
        'DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER unset; run python -m mp_symbolic '
        'launch --workers W --servers S -- train ...']
    assert not (tmp_path / 'run').exists()


def test_refusal_from_the_command_line_exits_2_with_one_line():
    result = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'launch', '--workers', '0',
                             '--servers', '1', '--', 'python', 'w.py'],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == 'error: --workers: expected a positive integer, found 0\n'
    assert result.stdout == ''


def test_abort_on_error_exits_at_once_with_the_status():
    # os._exit skips interpreter shutdown, where MXNet's kvstore would wait in
    # ps-lite's exit barrier; an atexit handler stands in for that wait here.
    code = ('import atexit, sys\n'
            'from mp_symbolic.tools.launch import abort_on_error\n'
            'atexit.register(lambda: print("shutdown ran"))\n'
            'with abort_on_error():\n'
            '    print("working")\n'
            '    %s\n')
    for body, status in (('sys.exit(3)', 3), ('raise RuntimeError("boom")', 1)):
        result = subprocess.run([sys.executable, '-c', code % body], cwd=ROOT, env=ENV,
                                capture_output=True, text=True, timeout=60)
        assert (result.returncode, result.stdout) == (status, 'working\n')
    assert 'RuntimeError: boom' in result.stderr
    clean = subprocess.run([sys.executable, '-c', code % 'pass'], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=60)
    assert (clean.returncode, clean.stdout) == (0, 'working\nshutdown ran\n')


@pytest.mark.parametrize('command', [['launch', '--nodes', '2', '--mode', 'manual'],
                                     ['launch', '--workers', '2', '--servers', '1',
                                      '--mode', 'manual']])
def test_a_reader_gone_before_the_manual_script_is_printed_ends_it_without_a_traceback(
        command, tmp_path):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('localhost\nlocalhost\n')
    read, write = os.pipe()
    os.close(read)  # `| head` that has already left
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    try:
        done = subprocess.run([sys.executable, '-m', 'mp_symbolic'] + command
                              + ['--hostfile', str(hostfile), '--', 'train'],
                              stdout=write, stderr=subprocess.PIPE, text=True, env=env,
                              timeout=120, check=False)
    finally:
        os.close(write)
    assert done.returncode == 128 + signal.SIGPIPE
    assert done.stderr == ''


def test_a_node_killed_just_after_its_peer_failed_is_the_one_named(port):
    """A survivor may exit moments after its killed peer and be seen first:
    the launcher names the process that a signal killed, not the exit it
    caused."""
    script = ('if [ "$RANK" = 0 ]; then sleep 0.5; exit 3; '
              'else sleep 0.6; kill -9 $$; fi')
    result, _ = launch('--nodes', '2', '--', 'sh', '-c', script, port=port)
    assert result.returncode == 1, result.stderr
    pids = job_pids(result.stdout)
    assert result.stderr.splitlines()[-1] == (
        'error: node 1 (pid %d) was killed by SIGKILL; no other process of the job was running'
        % pids['node 1']), result.stderr
