"""``python -m mp_symbolic launch``: start one MXNet distributed-kvstore job.

MXNet's distributed kvstore (``dist_sync``, ``dist_async``) runs on ps-lite:
one scheduler, S servers and W workers, each a process that learns its role
and where the scheduler listens from ``DMLC_*`` environment variables. A
server or scheduler needs no program of its own: with ``DMLC_ROLE=server`` or
``scheduler``, ``import mxnet`` runs ps-lite's loop and exits when the job
ends (``mxnet/kvstore/kvstore_server.py``). A worker runs the training
command and calls ``mx.kv.create('dist_sync')``.

The launcher in MXNet's source tree (``tools/launch.py``) hands this to
dmlc-core's tracker (``dmlc_tracker``), which the wheel does not ship. This
module is a small replacement: it plans the processes (:func:`plan_job`),
then runs them on this machine (``--mode local``), runs them through ssh
(``--mode ssh``), or prints the command of each for its host
(``--mode manual``). While the job runs, it relays every child's output
prefixed with its name, and if any process dies before the job ends it stops
all the others, so that no process is left waiting on ps-lite's barrier. The
children die with the launcher: SIGINT, SIGTERM and SIGHUP (a closed
terminal) stop the job, and a launcher killed by SIGKILL, which can run no
code, takes them along through the parent-death signal each child asks the
kernel for before its command starts (``prctl(PR_SET_PDEATHSIG)``; a process
such a child starts in turn is its own to end).

A process that is stopped (SIGSTOP, Ctrl-Z in its own terminal, a debugger)
does not die, and the rest of the job would wait for it forever: ps-lite's
heartbeat (``PS_HEARTBEAT_INTERVAL``, ``PS_HEARTBEAT_TIMEOUT``) only records
when each node was last heard of, for a replacement node joining later; it
never ends a job. So the launcher watches the state of each child it
started, and of every process in the child's process group, in
``/proc/PID/stat`` and ends the job once one has stayed stopped for
``--stopped-timeout`` seconds.
"""
import argparse
import contextlib
import ctypes
import ipaddress
import os
import secrets
import shlex
import shutil
import signal
import socket
from stat import S_ISBLK, S_ISCHR, S_ISDIR, S_ISFIFO, S_ISREG, S_ISSOCK
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from ..core.base.checks import MAX_NODES, positive_int

__all__ = []

# The secret a job's node processes prove they share (core/transport/nodes.py; not imported: MXNet).
NODE_SECRET = 'MP_SYMBOLIC_NODE_SECRET'
# Set in a launched worker: it tells the launcher its kvstore rank (announce_rank) on stdout.
RANK_LINE = 'MP_SYMBOLIC_LAUNCH_RANK_LINE'
RANK_MARK = '@mp_symbolic launch: kvstore rank '  # its line's start: never relayed
MODES = ('local', 'ssh', 'manual')
# First words of COMMAND that are ``python -m mp_symbolic`` subcommands.
# What a server and the scheduler run: importing MXNet with DMLC_ROLE set runs them.
SERVER_ARGV = (sys.executable, '-c', 'import mxnet')
STOP_GRACE = 3.0  # seconds between SIGTERM and SIGKILL when stopping the job
POLL = 0.05       # seconds between checks of the children
STOPPED_TIMEOUT = 5.0  # default seconds a child may stay stopped before the job is ended

EXIT_FAILED = 1
EXIT_USAGE = 2
MAX_HOSTFILE_BYTES = 1 << 20  # far more than any cluster's host names


@dataclass(frozen=True)
class Node:
    """One process of the job.

    Attributes:
        role: ``'scheduler'``, ``'server'`` or ``'worker'``.
        index: Its number among the processes of its role (0 for the scheduler).
        host: The host it runs on, as the hostfile names it (the ssh target).
        env: The ``DMLC_*`` variables it needs, as ``((name, value), ...)``.
        argv: Its command.
    """
    role: str
    index: int
    host: str
    env: tuple
    argv: tuple

    @property
    def name(self):
        """``'scheduler'``, ``'server 0'``, ``'worker 1'``, ...: the output prefix."""
        return 'scheduler' if self.role == 'scheduler' else '%s %d' % (self.role, self.index)


# The package's own command line: ``python -m mp_symbolic``.
PROGRAM = (sys.executable, '-m', __name__.split('.')[0])


# What ps-lite reads to find its role and the scheduler; launch sets each for every process.
DMLC_VARIABLES = ('DMLC_ROLE', 'DMLC_PS_ROOT_URI', 'DMLC_PS_ROOT_PORT', 'DMLC_NUM_SERVER',
                  'DMLC_NUM_WORKER')


def check_dist_environment(kvstore, environ=os.environ):
    """Raises unless a ``dist_*`` ``kvstore`` has its job around it: the
    ``DMLC_*`` variables a launched process gets (MXNet aborts with a
    traceback on the first one missing).

    Raises:
        ValueError: ``'kvstore: expected ...'``, naming the missing variables.
    """
    missing = [name for name in DMLC_VARIABLES if not environ.get(name)]
    if str(kvstore).startswith('dist') and missing:
        raise ValueError('kvstore: expected %s in a process python -m mp_symbolic launch '
                         'started (it sets the DMLC_* variables that say where the scheduler '
                         'is), found %s unset; run python -m mp_symbolic launch --workers W '
                         '--servers S -- train ...' % (kvstore, ', '.join(missing)))


def worker_argv(command, subcommands=()):
    """The command a worker runs for the launch's ``COMMAND``.

    A command naming one of ``subcommands`` (the package's own, such as
    ``train``) becomes ``<this python> -m mp_symbolic train ... --kvstore
    dist_sync`` (unless it already has ``--kvstore``); ``FILE.py ...`` becomes
    ``<this python> FILE.py ...`` (a script of yours, run by the launcher's
    Python); anything else runs as given.
    """
    command = list(command)
    if command[0].endswith('.py'):
        return (sys.executable, *command)
    if command[0] not in subcommands:
        return tuple(command)
    if not any(arg == '--kvstore' or arg.startswith('--kvstore=') for arg in command):
        command += ['--kvstore', 'dist_sync']
    return PROGRAM + tuple(command)


def node_argv(command, num_nodes, subcommands=()):
    """The command node processes run for the launch's ``COMMAND``:
    :func:`worker_argv`'s, with ``--nodes N`` added to one of
    ``subcommands`` (unless it already has ``--nodes``) instead of a kvstore."""
    command = list(command)
    if command[0] in subcommands and not any(
            arg == '--nodes' or arg.startswith('--nodes=') for arg in command):
        command += ['--nodes', str(num_nodes)]
    if command[0] in subcommands:
        return PROGRAM + tuple(command)
    return worker_argv(command, subcommands)


def plan_nodes(command, num_nodes, hosts, port, subcommands=()):
    """The node processes of one job of pipeline stages over nodes: node
    ``k`` on host ``k mod len(hosts)``, each with the rendezvous
    torch.distributed reads (``MASTER_ADDR``: the first host, ``MASTER_PORT``,
    ``RANK``, ``WORLD_SIZE``) and ``--nodes N`` added to a package command.

    Raises:
        ValueError: ``num_nodes`` is not a positive integer, ``hosts`` or
            ``command`` is empty.
    """
    positive_int('--nodes', num_nodes)
    if not command:
        raise ValueError('expected a command after --, as in "launch --nodes 2 -- train '
                         '--devices cpu:0,cpu:1", found none')
    if not hosts:
        raise ValueError('expected at least one host, found none')
    argv = node_argv(command, num_nodes, subcommands)
    nodes = []
    for k in range(num_nodes):
        host = hosts[k % len(hosts)][0]
        env = (('MASTER_ADDR', hosts[0][1]), ('MASTER_PORT', str(port)), ('RANK', str(k)),
               ('WORLD_SIZE', str(num_nodes)), ('LOCAL_RANK', str(k // len(hosts))))
        nodes.append(Node('node', k, host, env, argv))
    return nodes


def read_hostfile(path):
    """The host names in ``path``: one a line, ``#`` starts a comment.

    Raises:
        ValueError: The file cannot be read, is not a regular file (a FIFO,
            a device, a directory), is over 1 MiB or not UTF-8, names no
            host, or a line has more than one word.
    """
    try:
        # O_NONBLOCK: a FIFO with no writer opens at once (a blocking open waits
        # for one), and is refused below, as /dev/zero is, before any read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            kind = _file_kind(os.fstat(fd).st_mode)
            if kind is None:
                with open(fd, 'rb', closefd=False) as f:
                    data = f.read(MAX_HOSTFILE_BYTES + 1)
        finally:
            os.close(fd)
        if kind is not None:
            raise ValueError('--hostfile: expected a regular file of host names, found %s, '
                             'which is %s' % (path, kind))
        lines = data.decode('utf-8').splitlines()
    except OSError as err:
        raise ValueError('--hostfile: cannot read %s (%s)' % (path, err.strerror)) from None
    except UnicodeDecodeError:
        raise ValueError('--hostfile: expected host names as UTF-8 text in %s, found bytes '
                         'that are not' % path) from None
    if len(data) > MAX_HOSTFILE_BYTES:
        raise ValueError('--hostfile: expected a list of hosts of at most %d bytes, found more '
                         'in %s' % (MAX_HOSTFILE_BYTES, path))
    hosts = []
    for number, line in enumerate(lines, 1):
        words = line.split('#', 1)[0].split()
        if len(words) > 1:
            raise ValueError('--hostfile: expected one host name a line, found %r on line %d '
                             'of %s' % (line.strip(), number, path))
        hosts.extend(words)
    if not hosts:
        raise ValueError('--hostfile: expected at least one host name, found none in %s' % path)
    return hosts


def _file_kind(mode):
    """What a file of ``mode`` (``st_mode``) is, or None for a regular file."""
    for test, kind in ((S_ISDIR, 'a directory'), (S_ISFIFO, 'a FIFO'),
                       (S_ISCHR, 'a character device'), (S_ISBLK, 'a block device'),
                       (S_ISSOCK, 'a socket')):
        if test(mode):
            return kind
    return None if S_ISREG(mode) else 'not a regular file'


def resolve_host(host):
    """The IPv4 address of ``host``, as ps-lite's ``DMLC_*`` variables take it.

    Raises:
        ValueError: ``host`` has no IPv4 address.
    """
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError('unknown host %r: expected a host name or IPv4 address this machine '
                         'can resolve (%s)' % (host, err)) from None


def is_loopback(address):
    return ipaddress.ip_address(address).is_loopback


def free_port():
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(('', 0))
        return sock.getsockname()[1]


def check_port_free(port):
    """Raises ValueError if the scheduler could not listen on ``port`` here.

    The scheduler binds every interface (``tcp://*:port``), as this check does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ does
        try:
            sock.bind(('', port))
        except OSError as err:
            raise ValueError('--port: expected a free port for the scheduler, found port %d '
                             'in use (%s)' % (port, err.strerror)) from None


def plan_job(command, num_workers, num_servers, hosts, port, subcommands=()):
    """The processes of one job: the scheduler, then the servers, then the workers.

    Args:
        command: The workers' command (see :func:`worker_argv`).
        subcommands: The package's own commands (see :func:`worker_argv`).
        hosts: ``[(host name, IPv4 address), ...]``. The scheduler runs on the
            first; servers and workers go round-robin over all of them.
        port: The port the scheduler listens on.

    Returns:
        A list of :class:`Node`.

    Raises:
        ValueError: ``num_workers`` or ``num_servers`` is below 1, ``hosts``
            is empty or ``command`` is empty.
    """
    positive_int('--workers', num_workers)
    positive_int('--servers', num_servers)
    if not command:
        raise ValueError('expected a command after --, as in '
                         '"launch --workers 2 --servers 1 -- python worker.py", found none')
    if not hosts:
        raise ValueError('expected at least one host, found none')
    root_address = hosts[0][1]

    def node(role, index, host_index, argv):
        host, address = hosts[host_index % len(hosts)]
        env = (('DMLC_ROLE', role), ('DMLC_PS_ROOT_URI', root_address),
               ('DMLC_PS_ROOT_PORT', str(port)), ('DMLC_NUM_SERVER', str(num_servers)),
               ('DMLC_NUM_WORKER', str(num_workers)), ('DMLC_NODE_HOST', address))
        return Node(role, index, host, env, tuple(argv))

    return ([node('scheduler', 0, 0, SERVER_ARGV)] +
            [node('server', i, i, SERVER_ARGV) for i in range(num_servers)] +
            [node('worker', i, i, worker_argv(command, subcommands))
             for i in range(num_workers)])


def shell_line(node, cwd, exec_=False, extra_env=()):
    """One shell line that runs ``node`` on its host: ``cd DIR && env VAR=... CMD``.

    With ``exec_``, the shell replaces itself with the command (``exec env ...``),
    so that ending the shell's session ends the command. ``extra_env``:
    ``((name, value), ...)`` set after the node's own.
    """
    env = ' '.join('%s=%s' % (k, shlex.quote(v)) for k, v in node.env + tuple(extra_env))
    return 'cd %s && %senv %s %s' % (shlex.quote(cwd), 'exec ' if exec_ else '', env,
                                      shlex.join(node.argv))


def manual_script(nodes, cwd):
    """The text ``--mode manual`` prints: for each process, a comment naming it
    and its host, then the line to paste into a shell on that host."""
    lines = ['# One line per process: run each on the host its comment names, in any order.',
             '# Every host needs this directory, the same data and the same Python '
             'environment.']
    for node in nodes:
        lines.append('# %s on %s' % (node.name, node.host))
        lines.append(shell_line(node, cwd))
    return '\n'.join(lines)


def _plural(count, word):
    return '%d %s' % (count, word if count == 1 else word + ('es' if word.endswith('s') else 's'))


def _how_ended(info):
    """``'exited with status 3'`` or ``'was killed by SIGKILL'`` from ``os.waitid``."""
    if info.si_code == os.CLD_EXITED:
        return 'exited with status %d' % info.si_status
    try:
        name = signal.Signals(info.si_status).name
    except ValueError:
        name = 'signal %d' % info.si_status
    return 'was killed by %s' % name


def _stat(pid):
    """``(state, process group)`` of ``pid`` from ``/proc/PID/stat``, or None
    where ``/proc`` cannot tell (the process is gone, or not Linux)."""
    try:
        with open('/proc/%s/stat' % pid, 'rb') as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses; the last ')' ends it.
    fields = stat[stat.rfind(b')') + 1:].split()
    try:
        return fields[0], int(fields[2])
    except (IndexError, ValueError):
        return None


STOPPED_STATES = (b'T', b't')  # stopped by a signal, or by a tracer
GROUP_SCAN = 1.0  # seconds between scans of /proc for stopped processes (one read each)


def _stopped_in_groups(groups):
    """``{process group: pid of a stopped process in it}`` for ``groups``."""
    found = {}
    try:
        entries = os.listdir('/proc')
    except OSError:
        return found
    for entry in entries:
        if entry.isdigit():
            stat = _stat(entry)
            if stat is not None and stat[0] in STOPPED_STATES and stat[1] in groups:
                found.setdefault(stat[1], int(entry))
    return found


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent thread ends
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork
except (OSError, AttributeError):
    _PRCTL = None  # not Linux: a child outlives a killed launcher


def _dies_with(parent):
    """A ``preexec_fn``: the child gets SIGKILL when the launcher (pid
    ``parent``) ends, even by SIGKILL; one whose launcher died before the
    request took effect (it was adopted meanwhile) ends at once."""
    def request():
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
    return request


class _Child:
    """A running process of the job, its own process group leader.

    Its exit is observed with ``waitid(WNOWAIT)``, which leaves it a zombie
    until :meth:`reap`: its pid, and so its process group id, cannot be reused
    while the launcher may still signal the group.
    """

    def __init__(self, node, argv, env, out, err, lock):
        self.node = node
        self.rank = None  # a worker's kvstore rank, once it announced it (announce_rank)
        self._info = None
        self.last_output = time.monotonic()  # when it last wrote to stdout or stderr
        self.stopped_since = None  # monotonic time it was first seen stopped, None if running
        self.stopped_pid = None    # the stopped process: this one, or another of its group
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=_dies_with(os.getpid()))
        self.threads = [threading.Thread(target=_relay, daemon=True,
                                         args=(pipe, sink, lock, self, pipe is self.proc.stdout))
                        for pipe, sink in ((self.proc.stdout, out), (self.proc.stderr, err))]
        for thread in self.threads:
            thread.start()

    @property
    def pid(self):
        return self.proc.pid

    @property
    def prefix(self):
        """``'[worker 1] '``, then ``'[worker 1, rank 0] '`` once the worker
        announced its kvstore rank: what every relayed line starts with."""
        if self.rank is None:
            return '[%s] ' % self.node.name
        return '[%s, rank %d] ' % (self.node.name, self.rank)

    def ended(self):
        """``os.waitid`` result once the process has ended, else None (it is not reaped)."""
        if self.proc.returncode is not None:
            return self._info
        self._info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return self._info

    def stopped_for(self, now, stopped_in_group=None):
        """Seconds this process, or ``stopped_in_group`` (a pid of its process
        group), has been seen stopped without a break (0 if none is)."""
        stat = _stat(self.pid) if self.ended() is None else None
        if stat is not None and stat[0] in STOPPED_STATES:
            self.stopped_pid = self.pid
        elif stopped_in_group is not None and self.ended() is None:
            self.stopped_pid = stopped_in_group  # a command of a shell script, say
        else:
            self.stopped_since = self.stopped_pid = None
            return 0.0
        if self.stopped_since is None:
            self.stopped_since = now
        return now - self.stopped_since

    def signal_group(self, signum):
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone

    def reap(self):
        self.ended()
        self.proc.wait()
        for thread in self.threads:
            thread.join(timeout=1.0)


MAX_LINE_BYTES = 1 << 20  # a longer line is relayed in pieces of this size


def _relay(pipe, sink, lock, child, stdout=False):
    """Copies ``pipe`` line by line to ``sink``, each line after
    ``child.prefix``. Any bytes read (a line, or a progress bar redrawn
    without one) set ``child.last_output``: the child's sign of progress. On
    a worker's ``stdout``, the line :func:`announce_rank` prints sets
    ``child.rank`` and is not relayed."""
    def emit(lines):
        with lock:
            for raw in lines:
                text = raw.decode('utf-8', 'replace').rstrip('\r')
                if stdout and child.node.role == 'worker' and text.startswith(RANK_MARK):
                    rank = text[len(RANK_MARK):]
                    if rank.isdigit():
                        child.rank = int(rank)
                        continue
                try:
                    sink.write(child.prefix + text + '\n')
                    sink.flush()
                except (BrokenPipeError, ValueError):
                    pass  # the launcher's own output is gone; keep draining the child

    pending = b''
    for data in iter(lambda: pipe.read1(1 << 16), b''):
        child.last_output = time.monotonic()
        *lines, pending = (pending + data).split(b'\n')
        while len(pending) > MAX_LINE_BYTES:
            lines.append(pending[:MAX_LINE_BYTES])
            pending = pending[MAX_LINE_BYTES:]
        emit(lines)
    if pending:
        emit([pending])
    pipe.close()


def _stop(children):
    """SIGTERM to every child's process group, SIGKILL after ``STOP_GRACE``,
    then reap them all."""
    children = [c for c in children if c.proc.returncode is None]  # not reaped yet
    for child in children:
        child.signal_group(signal.SIGTERM)
        child.signal_group(signal.SIGCONT)  # a stopped process acts on SIGTERM only once resumed
    deadline = time.monotonic() + STOP_GRACE
    while time.monotonic() < deadline and any(c.ended() is None for c in children):
        time.sleep(POLL)
    for child in children:
        child.signal_group(signal.SIGKILL)  # also grandchildren that outlived their parent
    for child in children:
        child.reap()


def run_job(nodes, timeout, argv_of=lambda node: node.argv, extra_env=None,
            out=None, err=None, stopped_timeout=STOPPED_TIMEOUT, progress_timeout=None):
    """Runs the job's processes until they all end; stops them all on a fault.

    Args:
        nodes: From :func:`plan_job`.
        timeout: Seconds the scheduler and servers get to end by themselves
            after every worker exited 0 (and the others, after the scheduler
            exited 0).
        argv_of: ``node -> argv`` actually started (ssh mode wraps it).
        extra_env: Variables added to this process's environment for every child.
        out, err: Where the children's stdout and stderr lines go (default:
            this process's). Each line is prefixed with ``[<node name>] ``.
        stopped_timeout: Seconds a child may stay stopped (state T or t in
            ``/proc``) before the job is ended; None: never.
        progress_timeout: Seconds a worker may go without writing anything
            to its stdout or stderr (counted from its start) before the job
            is ended, naming the worker silent the longest; None: never. The
            scheduler and servers print nothing as they work and are not
            watched.

    Returns:
        The launcher's exit status: 0 if every process exited 0; 1 if one
        died, exited non-zero, stayed stopped or silent, or outlived the timeout; 128 + the signal
        number if this process got SIGINT, SIGTERM or SIGHUP (each stops the
        job). One line says which. A launcher killed outright (SIGKILL) takes
        its children with it: each gets SIGKILL when it ends (Linux's
        parent-death signal).
    """
    out, err = out or sys.stdout, err or sys.stderr
    lock = threading.Lock()
    received = []
    # A hang-up (the terminal or the ssh session closed) stops the job as SIGTERM does.
    previous = {s: signal.signal(s, lambda signum, _: received.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    start = time.monotonic()
    children = []
    env = dict(os.environ, **(extra_env or {}))

    def finish(status, message):
        _stop(children)
        with lock:
            print(message, file=err if status else out, flush=True)
        return status

    try:
        for node in nodes:
            try:
                children.append(_Child(node, argv_of(node), dict(env, **dict(node.env)),
                                       out, err, lock))
            except OSError as error:
                return finish(EXIT_FAILED, 'error: cannot start %s (%s); stopped the %s '
                              'started before it' % (node.name, error,
                                                     _plural(len(children), 'process')))
        with lock:
            print('launch: pids: %s' % ', '.join('%s %d' % (c.node.name, c.pid) for c in children),
                  file=out, flush=True)
        over_since = ended_first = None
        scanned, in_groups = float('-inf'), {}  # the children's groups' stopped processes
        while True:
            if received:
                name = signal.Signals(received[0]).name
                running = sum(c.ended() is None for c in children)
                return finish(128 + received[0], 'error: launch interrupted by %s; stopped the '
                              '%s of the job' % (name, _plural(running, 'running process')))
            ended = [(c, c.ended()) for c in children]
            if any(_failed(info) for _, info in ended):
                ended = _first_cause(children, ended)
                child, info = next((c, i) for c, i in ended if _failed(i))
                others = sum(i is None for _, i in ended)
                return finish(EXIT_FAILED, 'error: %s (pid %d) %s; %s' % (
                    child.node.name, child.pid, _how_ended(info),
                    'stopped the other %s of the job' % _plural(others, 'process')
                    if others else 'no other process of the job was running'))
            running = [c for c, info in ended if info is None]
            now = time.monotonic()
            if stopped_timeout is not None and now - scanned >= GROUP_SCAN:
                in_groups = _stopped_in_groups({c.pid for c in running})
                scanned = now
            for child in running if stopped_timeout is not None else ():
                if child.stopped_for(now, in_groups.get(child.pid)) >= stopped_timeout:
                    others = len(running) - 1
                    return finish(EXIT_FAILED, 'error: %s (pid %d) has been stopped for %.1f s '
                                  '(--stopped-timeout %g); %s' % (
                                      child.node.name if child.stopped_pid == child.pid else
                                      'a process of %s' % child.node.name,
                                      child.stopped_pid, now - child.stopped_since,
                                      stopped_timeout,
                                      'stopped the other %s of the job' % _plural(
                                          others, 'process')
                                      if others else 'no other process of the job was running'))
            silent = [c for c in running if c.node.role in ('worker', 'node')
                      and progress_timeout is not None
                      and now - c.last_output >= progress_timeout]
            if silent:
                return finish(EXIT_FAILED, _silent_message(running, now, progress_timeout))
            if not running:
                return finish(0, 'launch: %s: all exited 0 in %.1f s' % (
                    ', '.join(_plural(sum(n.role == role for n in nodes), role)
                              for role in ('node', 'worker', 'server')
                              if any(n.role == role for n in nodes)),
                    time.monotonic() - start))
            # Once every worker, or the scheduler, has exited 0, the job is over:
            # the rest get `timeout` seconds to end by themselves (node processes
            # are peers: their job is over when all have ended).
            if over_since is None and any(n.role == 'scheduler' for n in nodes):
                roles = {c.node.role for c in running}
                if 'worker' not in roles or 'scheduler' not in roles:
                    over_since = time.monotonic()
                    ended_first = 'every worker' if 'worker' not in roles else 'the scheduler'
            elif over_since is not None and time.monotonic() - over_since > timeout:
                return finish(EXIT_FAILED, 'error: %s exited 0 but %s did not end within '
                              '%g s after; stopped %s' % (
                                  ended_first, ', '.join(c.node.name for c in running),
                                  timeout, 'it' if len(running) == 1 else 'them'))
            time.sleep(POLL)
    finally:
        _stop(children)  # a no-op after finish(); guards against an exception in between
        for signum, handler in previous.items():
            signal.signal(signum, handler)


CAUSE_GRACE = 0.5  # seconds a failed exit waits for a peer's death by a signal to show


def _failed(info):
    return info is not None and not (info.si_code == os.CLD_EXITED and info.si_status == 0)


def _killed(info):
    return info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)


def _first_cause(children, ended):
    """``ended`` with the failed children first, one killed by a signal before
    one that exited non-zero: a survivor may exit within moments of its killed
    peer, and be seen first. A failed exit waits up to ``CAUSE_GRACE`` for such
    a death among the processes still running."""
    deadline = time.monotonic() + CAUSE_GRACE
    while not any(_killed(i) for _, i in ended) and any(i is None for _, i in ended) \
            and time.monotonic() < deadline:
        time.sleep(POLL / 4)
        ended = [(c, c.ended()) for c in children]
    return sorted(ended, key=lambda ci: (not _failed(ci[1]), not _killed(ci[1])))


def _silent_message(running, now, progress_timeout):
    """The line that ends a job whose worker printed nothing for
    ``progress_timeout`` seconds. Under dist_sync the other workers wait for a
    wedged one and fall silent with it, at the same step: output cannot tell
    which is wedged, so every worker silent for half the time or more is
    named, the longest first."""
    silent = sorted((c for c in running if c.node.role == 'worker'
                     and now - c.last_output >= progress_timeout / 2),
                    key=lambda c: c.last_output)
    names = ', '.join('%s (pid %d)' % (c.node.name, c.pid) for c in silent)
    if len(silent) == 1:
        others = len(running) - 1
        return 'error: %s has printed nothing for %.1f s (--progress-timeout %g); %s' % (
            names, now - silent[0].last_output, progress_timeout,
            'stopped the other %s of the job' % _plural(others, 'process')
            if others else 'no other process of the job was running')
    return ('error: %s have printed nothing for %.1f s (--progress-timeout %g), each wedged or '
            'waiting for one that is; stopped the %s of the job'
            % (names, now - silent[0].last_output, progress_timeout,
               _plural(len(running), 'running process')))


_ABORTING = []  # non-empty inside abort_on_error()
_HELD = []      # the worker's dist kvstores, kept from MXNet's destructor (see hold_kvstore)


def announce_rank(kvstore):
    """In a worker the launcher started: prints the line that tells it
    ``kvstore``'s rank (a dist kvstore's, which ps-lite's scheduler assigns
    and need not be the worker's index), so that its lines are relayed as
    ``[worker i, rank r]`` from then on. Elsewhere (no launcher, a kvstore
    that is not dist) this prints nothing."""
    if os.environ.get(RANK_LINE) and 'dist' in kvstore.type:
        print('%s%d' % (RANK_MARK, kvstore.rank), flush=True)


def hold_kvstore(kvstore):
    """Keeps a worker's dist kvstore alive until :func:`abort_on_error` ends.

    MXNet's kvstore destructor waits in ps-lite's barrier for every other
    worker. A worker whose training fails drops its kvstore as the exception
    unwinds, long before :func:`abort_on_error` can end it, and waits there
    forever while the others wait in theirs (or in the kvstore's start-up
    barrier): the job hangs. Held here, the kvstore is released only when
    the worker's code ended well; after an error the process ends without
    the barrier and the launcher stops the rest. Outside
    :func:`abort_on_error` this does nothing.
    """
    if _ABORTING:
        _HELD.append(kvstore)


@contextlib.contextmanager
def abort_on_error():
    """In a worker: an uncaught exception or a non-zero ``sys.exit`` ends the
    process at once (``os._exit``), so the launcher sees it fail.

    A worker that leaves Python normally runs MXNet's kvstore destructor, which
    waits in ps-lite's exit barrier for every other worker. After an error the
    others never come (they wait for this worker's gradients), so the failed
    worker would hang instead of exiting, and the job with it. Use it around
    the worker's code::

        with abort_on_error():
            main()

    The traceback (or the exit message) is printed and the output flushed
    first; the status is ``sys.exit``'s, or 1 for an exception. A kvstore
    given to :func:`hold_kvstore` inside the block is released only when the
    block ends well.
    """
    _ABORTING.append(True)
    try:
        yield
    except SystemExit as exit_:
        if exit_.code is None or exit_.code == 0:
            _HELD.clear()  # every worker got this far: the exit barrier is met
            raise
        if not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
        _abort(exit_.code if isinstance(exit_.code, int) else 1)
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
        _abort(1)
    else:
        _HELD.clear()
    finally:
        _ABORTING.pop()


def _abort(status):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # pylint: disable=protected-access


def add_launch_parser(commands, subcommands=None):
    """Adds the ``launch`` subcommand to ``commands`` (argparse subparsers).

    Args:
        subcommands: ``{name: check}``: the package's own commands a worker
            may run (``train``, ...), each with a function that checks the
            worker's arguments (``check(['train', ...])``) before any process
            starts, raising ``ValueError`` (or exiting, as argparse does) with
            one line.
    """
    subcommands = dict(subcommands or {})
    parser = commands.add_parser(
        'launch', help='run one distributed-kvstore job (a scheduler, servers and workers) '
                       'or one pipeline over node processes (--nodes)',
        description='Start one MXNet distributed-kvstore (ps-lite) job: a scheduler, '
                    'S servers and W workers, each worker running COMMAND; or, with --nodes '
                    'N, N node processes of one pipeline, each running COMMAND. A COMMAND '
                    'that starts with %s runs "python -m mp_symbolic COMMAND --kvstore '
                    'dist_sync" (with --nodes: "--nodes N"), its options checked before '
                    'any process starts; one that '
                    'starts with a FILE.py runs "python FILE.py ..." with the launcher\'s '
                    'Python; any other runs as given. Every output line is '
                    'prefixed with its process; if any process dies, the others are '
                    'stopped and the launcher exits 1.' % (' or '.join(subcommands) or 'no name'),
        usage='python -m mp_symbolic launch (--workers W --servers S | --nodes N) '
              '[--port P] [--hostfile FILE] [--mode local|ssh|manual] [--timeout SECONDS] '
              '[--stopped-timeout SECONDS] [--progress-timeout SECONDS] -- COMMAND...')
    parser.add_argument('--workers', type=int, default=None, metavar='W',
                        help='worker processes; each runs COMMAND')
    parser.add_argument('--servers', type=int, default=None, metavar='S',
                        help='parameter-server processes')
    parser.add_argument('--nodes', type=int, default=None, metavar='N',
                        help='instead of a kvstore job: N node processes of one pipeline, '
                             'its stages divided over them (each runs COMMAND, a package '
                             'command given --nodes N), with the rendezvous torch.distributed '
                             'reads (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE); node k on '
                             'host k of the hostfile, round-robin')
    parser.add_argument('--port', type=int, default=None, metavar='P',
                        help='port the scheduler listens on (default: a free port here)')
    parser.add_argument('--hostfile', default=None, metavar='FILE',
                        help='hosts, one a line (# comments): the scheduler runs on the first, '
                             'servers and workers round-robin over all')
    parser.add_argument('--mode', choices=MODES, default='local',
                        help='local: every process on this machine; ssh: each through '
                             '"ssh HOST"; manual: print the command of each process for its '
                             'host (default: %(default)s)')
    parser.add_argument('--timeout', type=float, default=60.0, metavar='SECONDS',
                        help='seconds the scheduler and servers get to end after the '
                             'workers exited 0 (default: %(default)g)')
    parser.add_argument('--stopped-timeout', type=float, default=STOPPED_TIMEOUT,
                        metavar='SECONDS',
                        help='seconds a process of the job may stay stopped (SIGSTOP, a '
                             'debugger) before the job is ended (in ssh mode: its ssh) '
                             '(default: %(default)g)')
    parser.add_argument('--progress-timeout', type=float, default=None, metavar='SECONDS',
                        help='seconds a worker may print nothing (no line, no progress-bar '
                             'redraw, on stdout or stderr; counted from its start) before the '
                             'job is ended, naming it: a worker alive but wedged (default: off)')
    parser.add_argument('job_command', nargs=argparse.REMAINDER, metavar='COMMAND',
                        help='the workers\' command, after --')
    parser.set_defaults(run=lambda args: run_launch(args, subcommands))
    return parser


def _hosts(args):
    """``[(host, address)]`` for the run, checked against ``--mode``."""
    if args.hostfile is None:
        if args.mode == 'ssh':
            raise ValueError('--mode ssh: expected --hostfile naming the hosts, found none')
        return [('127.0.0.1', '127.0.0.1')]
    hosts = [(host, resolve_host(host)) for host in read_hostfile(args.hostfile)]
    if args.mode == 'local':
        remote = [host for host, address in hosts if not is_loopback(address)]
        if remote:
            raise ValueError('--mode local runs every process on this machine, but %s in %s is '
                             'not a loopback address; expected --mode ssh or --mode manual'
                             % (remote[0], args.hostfile))
    return hosts


def _check(args, subcommands):
    """Checks the launch's flags and the workers' command; returns ``(nodes,
    port)``. Raises ValueError."""
    if not args.timeout > 0:
        raise ValueError('--timeout: expected a positive number of seconds, found %g'
                         % args.timeout)
    if not 0 < args.stopped_timeout < float('inf'):
        raise ValueError('--stopped-timeout: expected a positive number of seconds, found %g'
                         % args.stopped_timeout)
    if args.progress_timeout is not None and not 0 < args.progress_timeout < float('inf'):
        raise ValueError('--progress-timeout: expected a positive number of seconds, found %g'
                         % args.progress_timeout)
    if args.port is not None and not 0 < args.port < 65536:
        raise ValueError('--port: expected a port number in 1..65535, found %d' % args.port)
    if args.nodes is not None and (args.workers is not None or args.servers is not None):
        raise ValueError('--nodes: expected it alone or --workers and --servers (a kvstore '
                         'job), found both')
    if args.nodes is None and (args.workers is None or args.servers is None):
        raise ValueError('expected --workers W and --servers S (a kvstore job) or --nodes N '
                         '(a pipeline over node processes), found %s'
                         % ('--workers alone' if args.workers is not None else
                            '--servers alone' if args.servers is not None else 'none of them'))
    if args.nodes is not None and args.nodes > MAX_NODES:  # each would refuse it, started
        raise ValueError('--nodes: expected at most %d node processes, found %d'
                         % (MAX_NODES, args.nodes))
    command = args.job_command[1:] if args.job_command[:1] == ['--'] else args.job_command
    if command and command[0] in subcommands:  # the processes' options, before any starts
        subcommands[command[0]](list(node_argv(command, args.nodes, subcommands)[
            len(PROGRAM):]) if args.nodes is not None else command)
    hosts = _hosts(args)
    port = args.port if args.port is not None else free_port()
    if args.nodes is not None:
        nodes = plan_nodes(command, args.nodes, hosts, port, subcommands)
    else:
        nodes = plan_job(command, args.workers, args.servers, hosts, port, subcommands)
    if args.mode == 'local':
        if args.port is not None:
            check_port_free(port)
        program = nodes[-1].argv[0]
        script = command[0] if command[0].endswith('.py') else None
        if script is not None and not os.path.isfile(script):
            raise ValueError('expected COMMAND\'s script %s to be a file, found %s'
                             % (script, 'a directory' if os.path.isdir(script) else 'none'))
        if shutil.which(program) is None:
            raise ValueError('expected COMMAND to start with a program, found %r, which is '
                             'not an executable file or on PATH' % program)
    return nodes, port


def run_launch(args, subcommands=None):
    """Runs ``launch`` for parsed ``args``; returns the exit status.

    Args:
        subcommands: See :func:`add_launch_parser`.
    """
    try:
        nodes, port = _check(args, dict(subcommands or {}))
    except ValueError as error:
        print('error: %s' % error, file=sys.stderr)
        return EXIT_USAGE
    cwd = os.getcwd()
    if args.mode == 'manual':
        print(manual_script(nodes, cwd))
        return 0
    if args.nodes is not None:
        print('launch: %s, rendezvous at %s:%d (%s mode)' % (
            _plural(args.nodes, 'node'), dict(nodes[0].env)['MASTER_ADDR'], port, args.mode),
            flush=True)
    else:
        print('launch: scheduler at %s:%d, %s, %s (%s mode)' % (
            dict(nodes[0].env)['DMLC_PS_ROOT_URI'], port, _plural(args.servers, 'server'),
            _plural(args.workers, 'worker'), args.mode), flush=True)
    if args.mode == 'ssh':
        # Tested only with a stand-in ssh (none on the machine this was written on).
        # -tt gives the remote command a terminal, so ending ssh hangs it up and ends it.
        return run_job(nodes, args.timeout, argv_of=lambda node: (
            'ssh', '-tt', '-o', 'BatchMode=yes', node.host,
            shell_line(node, cwd, exec_=True, extra_env=((RANK_LINE, '1'),))),
            stopped_timeout=args.stopped_timeout,
            progress_timeout=args.progress_timeout)
    # Unbuffered Python output, so lines are relayed as they are printed; workers tell their rank.
    extra_env = {'PYTHONUNBUFFERED': '1', RANK_LINE: '1'}
    if args.nodes is not None:  # only this job's nodes know it (core/transport/nodes.py checks it)
        extra_env[NODE_SECRET] = os.environ.get(NODE_SECRET) or secrets.token_hex(32)
    return run_job(nodes, args.timeout, extra_env=extra_env,
                   stopped_timeout=args.stopped_timeout, progress_timeout=args.progress_timeout)
