"""The kill tests' harness: a save run in forked processes, one of which
SIGKILLs itself right after its k-th file operation, for k = 1, 2, ...
until a k where the save ends first.

A kill test's child script (run by :func:`killed_points`) builds each
attempt from :func:`one` or :func:`two` (one forked process, or two node
processes talking through :class:`Pipes`), arms the process it kills with
:func:`arm`, and hands the attempts to :func:`kill_each`, which prints the
points it killed at. The test then reads the folder each point left.
"""
import json
import os
import shutil
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The file-system calls counted as file operations: each counts once it returns.
COUNTED = ('replace', 'rename', 'symlink', 'fsync', 'remove', 'unlink', 'rmdir', 'mkdir',
           'write', 'close')


def arm(k, makedirs=False, opens=False):
    """Makes this process SIGKILL itself right after its ``k``-th counted
    call: each of :data:`COUNTED` (and ``os.makedirs`` with ``makedirs``)
    and ``shutil.rmtree`` once it returns, and with ``opens`` each file
    opened (the ``open`` audit event, as it is raised)."""
    count = [0]

    def kill():
        count[0] += 1
        if count[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(real):
        def counted(*args, **kwargs):
            try:
                return real(*args, **kwargs)
            finally:
                kill()
        return counted
    names = COUNTED + (('makedirs',) if makedirs else ())
    for module, name in [(os, n) for n in names] + [(shutil, 'rmtree')]:
        setattr(module, name, wrap(getattr(module, name)))
    if opens:
        sys.addaudithook(lambda event, args: kill() if event == 'open' else None)


class Pipes:
    """The ``broadcast``/``gather`` of a group of two nodes over two pipes:
    a node whose peer is killed reads the end of its pipe and fails, as a
    torch.distributed operation fails when its peer dies."""

    def __init__(self, rank, read, write):
        self.rank, self.count = rank, 2
        self.read, self.write = os.fdopen(read), os.fdopen(write, 'w')

    def _send(self, value):
        self.write.write(json.dumps(value) + '\n')
        self.write.flush()

    def _receive(self):
        line = self.read.readline()
        if not line:
            raise ConnectionError('node %d hung up' % (1 - self.rank))
        return json.loads(line)

    def broadcast(self, value, source):
        if self.rank == source:
            self._send(value)
            return value
        return self._receive()

    def gather(self, value):
        self._send(value)
        other = self._receive()
        return [value, other] if self.rank == 0 else [other, value]


def _run_and_exit(run, *args):
    try:
        run(*args)
    except BaseException:  # pylint: disable=broad-except
        os._exit(1)
    os._exit(0)


def one(run):
    """Runs ``run()`` in a forked process; returns ``[status]``, its wait
    status (0 when it returned, 1 in the exit code when it raised)."""
    pid = os.fork()
    if pid == 0:
        _run_and_exit(run)
    return [os.waitpid(pid, 0)[1]]


def two(run):
    """Runs ``run(rank, group)`` in two forked processes, ranks 0 and 1,
    whose ``group`` is a :class:`Pipes` between them; returns their wait
    statuses, rank 0's first."""
    down, up = os.pipe(), os.pipe()  # node 0 -> node 1, node 1 -> node 0
    pids = []
    for rank, (read, write) in enumerate([(up[0], down[1]), (down[0], up[1])]):
        pid = os.fork()
        if pid == 0:
            for fd in down + up:
                if fd not in (read, write):
                    os.close(fd)
            _run_and_exit(run, rank, Pipes(rank, read, write))
        pids.append(pid)
    for fd in down + up:
        os.close(fd)
    return [os.waitpid(pid, 0)[1] for pid in pids]


def kill_each(base, attempt, victim=0):
    """For k = 1, 2, ...: ``attempt(k, folder)`` (``folder`` is
    ``base/kNNN``) returns the wait statuses of its processes, of which the
    ``victim``-th was armed with ``k``. Goes on while that one was killed by
    SIGKILL; at the first k where all exited 0, removes that folder and
    prints the killed points as a JSON list. Exits naming k on any other
    ending."""
    killed = []
    for k in range(1, 1000):
        folder = os.path.join(base, 'k%03d' % k)
        ended = attempt(k, folder)
        if os.WIFSIGNALED(ended[victim]) and os.WTERMSIG(ended[victim]) == signal.SIGKILL:
            killed.append(k)
        elif not any(ended):
            shutil.rmtree(folder)
            break
        else:
            sys.exit('k=%d: expected process %d killed or all done, found statuses %s'
                     % (k, victim, ended))
    print(json.dumps(killed))


def killed_points(script, args, timeout):
    """Runs the child ``script`` (``python -c``) with ``args``; returns the
    points :func:`kill_each` printed, after asserting the child ended well
    and killed at every point from 1 on, none skipped."""
    proc = subprocess.run([sys.executable, '-c', script] + [str(a) for a in args],
                          env=dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0'),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed = json.loads(proc.stdout)
    assert killed == list(range(1, len(killed) + 1)), killed
    return killed
