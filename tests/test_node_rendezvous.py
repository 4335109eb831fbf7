"""The node processes' join and control plane: what a peer sends is parsed
as JSON, never unpickled; a job's secret keeps out a process that does not
know it; the rendezvous listens on MASTER_ADDR only; a node waiting there
ends on SIGINT or SIGTERM, and a node whose torchrun agent died ends, each
in one line; a node that cannot reach its rendezvous says so in one line."""
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from mp_symbolic.core.transport import nodes as node_processes
from conftest import node_env
from test_nodes import REGRESSION, ROOT, _cmdline, _environ, _gone, _pids

FAKE_PEER = os.path.join(ROOT, 'tests', 'fake_peer.py')
SECRET = 'MP_SYMBOLIC_NODE_SECRET'  # the job's secret, as torchrun users set it


def _node(rank, port, out, *flags, **env):
    """Node ``rank`` of a 2-node regression job on 127.0.0.1:``port``."""
    return subprocess.Popen([sys.executable, '-m', 'mp_symbolic'] + REGRESSION +
                            ['--epochs', '100000', '--nodes', '2', '--out', str(out)] +
                            list(flags), env=node_env(rank, 2, port, **env), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ended(procs, timeout=120):
    """Each process's ``(returncode, stdout, stderr)``; every one is killed after."""
    try:
        return [(p,) + p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _address(text):
    """``'0100007F:1F90'`` (or its 32-digit IPv6 form) of /proc/net/tcp: the address."""
    host, port = text.split(':')
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntoa(raw[::-1]), int(port, 16)
    words = b''.join(raw[k:k + 4][::-1] for k in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listening(pid):
    """``[(address, port)]`` of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir('/proc/%d/fd' % pid):
        try:
            link = os.readlink('/proc/%d/fd/%s' % (pid, fd))
        except OSError:
            continue
        if link.startswith('socket:['):
            inodes.add(link[len('socket:['):-1])
    found = []
    for table in ('tcp', 'tcp6'):
        with open('/proc/%d/net/%s' % (pid, table)) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == '0A' and fields[9] in inodes:  # LISTEN
                    found.append(_address(fields[1]))
    return found


@pytest.mark.slow
@pytest.mark.parametrize('secret', [None, 'the job secret'])
def test_a_peer_sending_a_pickle_runs_no_code_and_node_0_ends_in_one_line(tmp_path, port,
                                                                          secret):
    """A process that joins as node 1 and sends what ``all_gather_object``
    sends (a pickle that would create a file): node 0 parses it as JSON,
    refuses it in one line and nothing runs. With a job's secret the
    same process, not knowing it, is refused at the rendezvous."""
    planted = tmp_path / 'planted'
    extra = {} if secret is None else {SECRET: secret}
    node0 = _node(0, port, tmp_path / 'run', '--node-timeout', '60', **extra)
    peer = subprocess.Popen([sys.executable, FAKE_PEER,
                             'pickle' if secret is None else 'wrong-secret', str(planted)],
                            env=node_env(1, 2, port), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    (node0, _, stderr), = _ended([node0])
    peer.kill()
    peer.communicate()
    assert not planted.exists(), stderr[-3000:]
    assert node0.returncode == 1, stderr[-3000:]
    lines = stderr.strip().splitlines()
    if secret is None:
        expected = "error: nodes: node 1 sent a message that is not one of this job's " \
            "(to compare their plans: expected JSON text, found b'\\x80"
    else:
        expected = "error: nodes: node 1 did not prove it knows the job's secret " \
            "(MP_SYMBOLIC_NODE_SECRET, the same on every node): refused; node 0 ended"
    assert len(lines) == 1 and lines[0].startswith(expected), stderr[-3000:]


@pytest.mark.slow
def test_nodes_with_different_secrets_are_refused_in_one_line_each(tmp_path, port):
    procs = [_node(k, port, tmp_path / 'run', '--node-timeout', '60',
                   **{SECRET: 'secret %d' % k}) for k in range(2)]
    ended = _ended(procs)
    for rank, (proc, _, stderr) in enumerate(ended):
        assert proc.returncode == 1, stderr[-3000:]
        assert len(stderr.strip().splitlines()) == 1, stderr[-3000:]
    assert ended[0][2].startswith("error: nodes: node 1 did not prove it knows the job's secret")
    assert ended[1][2].startswith('error: nodes: node 0 refused node 1 (its secret, '
                                  'MP_SYMBOLIC_NODE_SECRET, differs from node 1\'s)')


@pytest.mark.slow
def test_every_listening_socket_of_a_local_node_job_is_on_the_loopback(tmp_path, port):
    """Under ``launch --nodes 2`` on 127.0.0.1, while the nodes train: node
    0's store and every node's gloo listen on 127.0.0.1 only; each node
    has the job's secret, which the launcher does not."""
    out = tmp_path / 'run'
    proc = subprocess.Popen(
        [sys.executable, '-m', 'mp_symbolic', 'launch', '--port', str(port), '--nodes', '2',
         '--'] + REGRESSION + ['--epochs', '100000', '--out', str(out)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0'),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = None
        for line in proc.stdout:
            if line.startswith('launch: pids: '):
                pids = _pids(line)
            if line.startswith('[node 1] epoch 1/'):
                break
        assert pids is not None and proc.poll() is None, proc.communicate()
        sockets = {name: listening(pid) for name, pid in pids.items()}
        secrets = {_environ(pid).get(SECRET) for pid in pids.values()}
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert ('127.0.0.1', port) in sockets['node 0'], sockets
    assert all(len(found) >= 1 for found in sockets.values()), sockets
    assert {address for found in sockets.values() for address, _ in found} == {'127.0.0.1'}, \
        sockets
    assert len(secrets) == 1 and len(secrets.pop() or '') == 64
    assert SECRET not in os.environ


@pytest.mark.slow
@pytest.mark.parametrize('signum, status', [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=['SIGTERM', 'SIGINT'])
def test_a_node_waiting_at_the_rendezvous_ends_on_a_signal_within_seconds(tmp_path, port, signum,
                                                                         status):
    """A lone node 0 of 2 with ``--node-timeout 3000000``, once it listens."""
    proc = _node(0, port, tmp_path / 'run', '--node-timeout', '3000000')
    try:
        deadline = time.monotonic() + 120
        while port not in [number for _, number in listening(proc.pid)]:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)  # waiting in torch's rendezvous
        start = time.monotonic()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=10)
        took = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == status, stderr[-3000:]
    assert took < 5, took
    assert stderr.splitlines() == ['error: nodes: node 0 of 2 stopped waiting for the others at '
                                   '127.0.0.1:%d (%s); nothing was written'
                                   % (port, signal.Signals(signum).name)], stderr[-3000:]


@pytest.mark.slow
def test_a_node_that_cannot_reach_its_rendezvous_prints_one_line_only(tmp_path, port):
    """Node 1, nothing listening on the port: its whole stderr is one line."""
    (proc, _, stderr), = _ended([_node(1, port, tmp_path / 'run', '--node-timeout', '3')])
    assert proc.returncode == 1, stderr[-3000:]
    assert stderr.splitlines() == [
        'error: nodes: node 1 of 2 could not join the others at 127.0.0.1:%d within 3 s '
        '(--node-timeout): The client socket has timed out after 3000ms while trying to '
        'connect to (127.0.0.1, %d)' % (port, port)], stderr[-3000:]


@pytest.mark.slow
def test_nodes_whose_torchrun_agent_is_killed_end_within_seconds_in_one_line(tmp_path, port):
    """torchrun's agent killed by SIGKILL while its two nodes train: both
    end, each saying why."""
    from mp_symbolic.tools.store import Store  # pylint: disable=import-outside-toplevel
    out = tmp_path / 'run'
    argv = [sys.executable, '-m', 'mp_symbolic.tools.torchrun', '--nnodes', '1',
            '--nproc-per-node', '2', '--rdzv-backend', 'c10d',
            '--rdzv-endpoint', '127.0.0.1:%d' % port, '-m', 'mp_symbolic'] + REGRESSION + \
        ['--epochs', '100000', '--nodes', '2', '--out', str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')
    for name in node_processes.RENDEZVOUS:
        env.pop(name, None)
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    nodes = []
    try:
        while Store(str(out)).current() is None and proc.poll() is None:
            time.sleep(0.2)  # until the nodes committed their first checkpoint together
        nodes = [pid for pid in map(int, filter(str.isdigit, os.listdir('/proc')))
                 if _environ(pid).get('RANK') in ('0', '1') and str(out) in _cmdline(pid)]
        assert len(nodes) == 2 and proc.poll() is None, nodes
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        while not _gone(nodes) and time.monotonic() - start < 30:
            time.sleep(0.05)
        took = time.monotonic() - start
        stdout = proc.stdout.read() if _gone(nodes) else ''
    finally:
        proc.kill()
        for pid in nodes:
            if not _gone([pid]):
                os.kill(pid, signal.SIGKILL)
    assert took < 10, took  # a few seconds, on two cores shared with other work
    # each node in one line: its agent gone, or (having seen that first) the other gone
    errors = [l for l in stdout.splitlines() if l.startswith('error: ')]
    parent = "error: nodes: node %d's parent process (pid {}, torchrun's agent) ended; node " \
        "%d ended".format(proc.pid)
    for rank in (0, 1):
        assert len([l for l in errors if l == parent % (rank, rank) or l.startswith(
            'error: nodes: node %d (stage %d) hung up' % (1 - rank, 1 - rank))]) == 1, \
            stdout[-3000:]
    assert len(errors) == 2 and any(parent % (k, k) in errors for k in (0, 1)), stdout[-3000:]


def test_control_messages_are_json_and_numpy_arrays_keep_their_dtype_and_values():
    value = {'plan': ('a', 2), 'loss': np.float32(0.25), 'none': None,
             'weights': np.arange(6, dtype=np.float32).reshape(2, 3) / 7, 'nan': float('nan')}
    data = node_processes.encode(value)
    assert data.startswith(b'{"plan":["a",2],"loss":0.25,')
    got = node_processes.decode(data)
    assert got['plan'] == ['a', 2] and got['none'] is None and np.isnan(got['nan'])
    assert got['weights'].dtype == np.float32
    np.testing.assert_array_equal(got['weights'], value['weights'])


@pytest.mark.parametrize('data, message', [
    (b'\x80\x04K\x01.', "expected JSON text, found b'\\x80\\x04K\\x01.'"),
    (b'{"__ndarray__": ["object", [1], "AA=="]}', "an array of dtype 'object'"),
    (b'{"__ndarray__": ["float32", [2], "AAAAAA=="]}', 'an array of shape [2] holding 4 bytes'),
    (b'[' * 100000, 'maximum recursion depth exceeded'),
])
def test_a_control_message_that_is_not_json_or_holds_a_malformed_array_is_refused(data,
                                                                                  message):
    with pytest.raises(ValueError) as err:
        node_processes.decode(data)
    assert message in str(err.value) and '\n' not in str(err.value)


def test_a_control_message_over_the_limit_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(node_processes, 'MAX_MESSAGE_BYTES', 10)
    with pytest.raises(node_processes.NodeError, match=r'^nodes: expected a message for the '
                       r'other nodes of at most 10 bytes, found 12$'):
        node_processes.encode('0123456789')
    with pytest.raises(node_processes.NodeError, match='expected a JSON-able message'):
        node_processes.encode({'x': object()})


class _Told:
    """Node 1 of a :class:`~mp_symbolic.core.transport.nodes.Group` to which node 0
    broadcasts ``replies``, in turn."""
    rank, count = 1, 2

    def __init__(self, *replies):
        self.replies = list(replies)

    def broadcast(self, _value, _source):
        return self.replies.pop(0)

    def gather(self, value):
        return [None, value]


@pytest.mark.parametrize('replies, message', [
    (([1, 2],), 'node 0 sent list where a staging folder was expected'),
    ((None, {'ok': 'folder'}), 'node 0 sent dict where how the commit ended was expected'),
    ((None, ['ok']), 'node 0 sent list where how the commit ended was expected'),
    ((None, ['ok', 3]), 'node 0 sent list where how the commit ended was expected'),
])
def test_a_commit_across_nodes_refuses_what_node_0_sends_of_another_type(replies, message):
    from mp_symbolic.tools.store import PartError, commit_across  # pylint: disable=import-outside-toplevel
    with pytest.raises(PartError, match='^%s$' % message):
        commit_across(None, _Told(*replies), lambda folder: None, None)


def test_a_commit_across_nodes_takes_node_0s_outcome_as_a_list():
    from mp_symbolic.tools.store import commit_across  # pylint: disable=import-outside-toplevel
    assert commit_across(None, _Told(None, ['ok', '/shared/run/1']), lambda folder: None,
                         None) == '/shared/run/1'
