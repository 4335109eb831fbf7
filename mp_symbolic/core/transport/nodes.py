"""Node processes: a pipeline's stages divided over several processes, their
boundary tensors carried by torch.distributed's ``isend``/``irecv``, their
control messages JSON text, never unpickled (docs/nodes.md).

Invariant: every node runs the schedule filtered to its stages, in the one
issue order all nodes compute alike, so a receive waits only on an earlier
action and no node waits for ever on a live one. Sends never block.

torch is imported on first use, from the environment's ``torch-site``
where ``import torch`` finds none (GluonCV 0.10 refuses to import beside
torch 2, dmlc/gluon-cv#1768).
"""
import atexit
import base64
from dataclasses import dataclass
import datetime
import hashlib
import hmac
import importlib
import importlib.util
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time

import mxnet as mx

from ..placement.balance import even_split, stage_of_block
from ..base.checks import MAX_NODES, excerpt, node_count, positive_int  # noqa: F401 (nodes.MAX_NODES)
from .comm import (DONE, GLOO, ControlPlane, Link, LocalTransport, Pending, Transport,
                   accumulate, register_transport)
from ..base.scoped import discarded_stderr, environ as scoped_environ

__all__ = []

RENDEZVOUS = ('MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE')
TORCH_SITE = 'torch-site'  # torch installed apart from GluonCV's sight (see the module's text)
NODE_TIMEOUT = 300.0  # default seconds a node waits on another before the job ends
# the tags of the network's outputs a node sends the others, past every link's
OUTPUT_TAG = 1 << 30
MAX_OUTPUTS = 1 << 12  # outputs per replica the tags leave room for
# the tag of each batch's bucket key a node sends every other (agree_key), past the outputs'
KEY_TAG = 3 << 29
KEY_SLOTS = 16  # int64 values of a key's message: step, kind, length, the key's integers
NODE_SECRET = 'MP_SYMBOLIC_NODE_SECRET'  # the job's shared secret, where set
MAX_MESSAGE_BYTES = 1 << 30  # a control message's largest size (a model's parameters fit)
# the process that started this one (torchrun's agent, launch), before any work
_PARENT = os.getppid()


def torch(part=None):
    """torch, or ``torch.<part>``, imported on first use.

    Raises:
        NodeError: torch is not installed.
    """
    name = 'torch' if part is None else 'torch.' + part
    if name in sys.modules:
        return sys.modules[name]
    _gluoncv_first()
    site = os.path.join(sys.prefix, TORCH_SITE)
    if importlib.util.find_spec('torch') is None and os.path.isdir(site) \
            and site not in sys.path:
        sys.path.append(site)  # after the environment's own packages: they stay first
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise NodeError('nodes: expected torch (its torch.distributed carries the tensors '
                        'between node processes), found none: %s; make setup installs it, or '
                        "pip install 'torch==2.13.0'" % err) from None


def _gluoncv_first():
    """Imports GluonCV, where installed and not imported yet, before torch is
    (it refuses to import once torch 2 is importable); a failure is left for
    its user to meet."""
    if 'torch' in sys.modules or 'gluoncv' in sys.modules or \
            importlib.util.find_spec('gluoncv') is None:
        return
    try:
        importlib.import_module('gluoncv')
    except Exception:  # pylint: disable=broad-except
        pass


class NodeError(ValueError):
    """A node plan that cannot run: the message is one line."""


class NodeFailure(RuntimeError):
    """Another node died, hung up or stopped answering: the message is one
    line naming it and its stages."""


def node_of_devices(devices_per_replica, nodes):
    """The node of each device of a replica, in contiguous runs
    (``node_of_devices(3, 2) == (0, 0, 1)``).

    Raises:
        NodeError: more nodes than devices.
    """
    nodes = node_count(nodes, devices_per_replica, error=NodeError)
    return stage_of_block(even_split(devices_per_replica, nodes))


@dataclass(frozen=True)
class Nodes:
    """This process's place among the node processes of a job: ``count`` nodes,
    this one ``rank``, waiting ``timeout`` seconds on another, the rendezvous
    at ``address`` (``MASTER_ADDR:MASTER_PORT``)."""
    count: int
    rank: int
    timeout: float
    address: str


def from_environment(count, timeout=None, environ=None):
    """The :class:`Nodes` of this process for a job of ``count`` nodes, from the
    rendezvous variables torchrun and ``launch --nodes`` set.

    Raises:
        NodeError: a variable missing or malformed, ``WORLD_SIZE`` not
            ``count``, or ``timeout`` not a positive number of seconds.
    """
    environ = os.environ if environ is None else environ
    count = positive_int('nodes', count, NodeError)
    timeout = NODE_TIMEOUT if timeout is None else timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout < float('inf'):
        raise NodeError('node_timeout: expected a positive number of seconds, found %s'
                        % excerpt(repr(timeout)))
    missing = [name for name in RENDEZVOUS if not environ.get(name)]
    if missing:
        raise NodeError('nodes: expected a rendezvous for %d node processes (%s, as torchrun '
                        'and python -m mp_symbolic launch --nodes set them), found %s unset'
                        % (count, ', '.join(RENDEZVOUS[:-1]) + ' and ' + RENDEZVOUS[-1],
                           ', '.join(missing)))
    values = {}
    for name in ('RANK', 'WORLD_SIZE', 'MASTER_PORT'):
        text = environ[name]
        if not (text.isascii() and text.isdigit()):
            raise NodeError('nodes: expected %s to be a number, found %s'
                            % (name, excerpt(repr(text))))
        values[name] = int(text)
    if values['WORLD_SIZE'] != count:
        raise NodeError('nodes: expected a job of %d node processes, found WORLD_SIZE=%d (each '
                        'process is one node: torchrun --nnodes x --nproc-per-node)'
                        % (count, values['WORLD_SIZE']))
    if values['RANK'] >= count:
        raise NodeError('nodes: expected RANK below WORLD_SIZE=%d, found %d'
                        % (count, values['RANK']))
    if not 0 < values['MASTER_PORT'] < 65536:
        raise NodeError('nodes: expected MASTER_PORT in 1..65535, found %d'
                        % values['MASTER_PORT'])
    return Nodes(count, values['RANK'], float(timeout),
                 '%s:%d' % (environ['MASTER_ADDR'], values['MASTER_PORT']))


_CONTROL = []  # the gloo group of the nodes' small messages, where tensors go by NCCL


def _control():
    return _CONTROL[0] if _CONTROL else None


def join(nodes, gpus=False):
    """Joins this process to the job's process group, once per process, waiting
    at most the node timeout for every node. Node 0 listens on
    ``MASTER_ADDR`` only; with ``MP_SYMBOLIC_NODE_SECRET`` set, each node
    proves it knows the secret. SIGINT or SIGTERM while waiting, or (under
    torchrun) the agent's end, ends the process in one line.

    Args:
        gpus: Whether this node's stages run on GPUs: tensors then go by NCCL,
            small messages by gloo (not tested on a GPU).

    Raises:
        NodeFailure: the nodes did not join in time, the rendezvous could not
            be reached, a node failed to prove the secret, or this node's
            parent has ended.
    """
    dist = torch('distributed')
    if dist.is_initialized():
        if dist.get_world_size() != nodes.count or dist.get_rank() != nodes.rank:
            raise NodeError('nodes: expected one job per process, found this process already '
                            'node %d of %d' % (dist.get_rank(), dist.get_world_size()))
        return
    # torchrun hosts the store in its agent and keeps it across restarts; the
    # keys of a killed attempt's process group stay in it, and a restarted
    # node would connect to its dead peer's address (seen with torch 2.13):
    # each attempt gets keys of its own. Without torchrun, node 0 hosts it.
    agent = os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True'
    if 'TORCHELASTIC_RUN_ID' in os.environ:
        _watch_parent(nodes)
    outcome = []
    worker = threading.Thread(target=_join_or_fail, args=(nodes, gpus, agent, outcome),
                              name='mp_symbolic rendezvous', daemon=True)
    with _signals_recorded() as received, discarded_stderr():
        worker.start()
        while worker.is_alive() and not received:
            worker.join(0.1)  # signal handlers run between the slices
    if received:
        _exit_line('nodes: node %d of %d stopped waiting for the others at %s (%s); nothing '
                   'was written' % (nodes.rank, nodes.count, nodes.address,
                                    signal.Signals(received[0]).name), 128 + received[0])
    if outcome and isinstance(outcome[0], BaseException):
        raise outcome[0]
    atexit.register(leave)


def _join_or_fail(nodes, gpus, agent, outcome):
    """:func:`join`'s wait, in its own thread: ``outcome`` gets True, or
    the :class:`NodeFailure` that ends the node."""
    try:
        _rendezvous(nodes, gpus, agent)
        outcome.append(True)
    except NodeFailure as err:
        outcome.append(err)
    except (RuntimeError, ValueError, OSError) as err:
        outcome.append(NodeFailure(
            'nodes: node %d of %d could not join the others at %s within %g s '
            '(--node-timeout): %s' % (nodes.rank, nodes.count, nodes.address, nodes.timeout,
                                      _first_line(err))))


def _rendezvous(nodes, gpus, agent):
    dist = torch('distributed')
    timeout = datetime.timedelta(seconds=nodes.timeout)
    host, port = nodes.address.rsplit(':', 1)
    attempt = '%s/%s' % (os.environ.get('TORCHELASTIC_RUN_ID', 'job'),
                         os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))
    if not agent and nodes.rank == 0:
        # TCPStore's own socket would listen on every interface
        store = dist.TCPStore(host, int(port), nodes.count, is_master=True, timeout=timeout,
                              master_listen_fd=_listening_socket(host, int(port)),
                              use_libuv=False)
    else:
        store = dist.TCPStore(host, int(port), nodes.count, is_master=False, timeout=timeout)
    store = dist.PrefixStore('mp_symbolic/' + attempt, store)
    _prove(store, nodes, os.environ.get(NODE_SECRET, ''))
    interface = {} if os.environ.get('GLOO_SOCKET_IFNAME') else \
        {'GLOO_SOCKET_IFNAME': _interface_to(host)}
    with scoped_environ(**{k: v for k, v in interface.items() if v}):
        dist.init_process_group('nccl' if gpus else 'gloo', store=store, rank=nodes.rank,
                                world_size=nodes.count, timeout=timeout)
        if gpus:
            _CONTROL.append(dist.new_group(backend='gloo', timeout=timeout))


def _listening_socket(host, port):
    """A socket listening on ``host:port`` only, its descriptor handed over
    (it lives as long as the store that takes it)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock.detach()


SIOCGIFADDR = 0x8915  # netdevice(7): an interface's IPv4 address


def _interface_to(host):
    """The name of this host's network interface that reaches ``host``
    (IPv4), or None where it cannot be told."""
    import fcntl  # pylint: disable=import-outside-toplevel
    import struct  # pylint: disable=import-outside-toplevel
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # sends nothing: picks the route
            local = probe.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:
                    found = fcntl.ioctl(probe.fileno(), SIOCGIFADDR,
                                        struct.pack('256s', name.encode()[:15]))
                except OSError:
                    continue  # no IPv4 address
                if socket.inet_ntoa(found[20:24]) == local:
                    return name
    except (OSError, ValueError):
        pass
    return None


def _proof(secret, rank, count, nonce):
    return hmac.new(secret.encode('utf-8'), ('mp_symbolic node %d of %d: %s'
                                             % (rank, count, nonce)).encode('utf-8'),
                    hashlib.sha256).hexdigest()


def _prove(store, nodes, secret):
    """Node 0 posts a nonce and checks each other node's proof that it knows
    ``secret``; the others post theirs and wait for node 0's verdict.

    Raises:
        NodeFailure: a proof wrong or missing, or refused by node 0.
    """
    if nodes.rank == 0:
        nonce = secrets.token_hex(16) if secret else ''
        store.set('auth/nonce', nonce)
        if not secret:
            return
        for rank in range(1, nodes.count):
            store.wait(['auth/%d' % rank])
            proof = store.get('auth/%d' % rank).decode('ascii', 'replace')
            if not hmac.compare_digest(proof, _proof(secret, rank, nodes.count, nonce)):
                store.set('auth/verdict', 'refused node %d' % rank)
                raise NodeFailure('nodes: node %d did not prove it knows the job\'s secret (%s, '
                                  'the same on every node): refused; node 0 ended'
                                  % (rank, NODE_SECRET))
        store.set('auth/verdict', 'ok')
        return
    nonce = store.get('auth/nonce').decode('ascii', 'replace')
    if nonce and not secret:
        store.set('auth/%d' % nodes.rank, '')
        raise NodeFailure('nodes: node 0 expects every node to know the job\'s secret, found '
                          '%s unset on node %d; node %d ended' % (NODE_SECRET, nodes.rank,
                                                                  nodes.rank))
    if secret and not nonce:
        raise NodeFailure('nodes: node %d has the job\'s secret (%s) but node 0 checks none: '
                          'set it on every node, or on none; node %d ended'
                          % (nodes.rank, NODE_SECRET, nodes.rank))
    if not secret:
        return
    store.set('auth/%d' % nodes.rank, _proof(secret, nodes.rank, nodes.count, nonce))
    verdict = store.get('auth/verdict').decode('ascii', 'replace')
    if verdict != 'ok':
        raise NodeFailure('nodes: node 0 %s (its secret, %s, differs from node %d\'s); node %d '
                          'ended' % (excerpt(verdict), NODE_SECRET, nodes.rank, nodes.rank))


class _signals_recorded:  # pylint: disable=invalid-name
    """Inside the block, SIGINT and SIGTERM (where not ignored, in the main
    thread) only append their number to the list it yields."""

    def __init__(self):
        self.received, self.saved = [], {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(signum) != signal.SIG_IGN:
                    self.saved[signum] = signal.signal(
                        signum, lambda number, _: self.received.append(number))
        return self.received

    def __exit__(self, *_):
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)


_LINE = threading.Lock()  # held by whoever prints the process's last error line


def claim_line():
    """Whether this caller prints the process's error line (False once another
    is printing its own and ending the process)."""
    return _LINE.acquire(blocking=False)


def _exit_line(text, status):
    """Prints ``error: text`` and ends the process at once, unless another error
    line of this process is being printed."""
    if not claim_line():
        return
    try:
        sys.stdout.flush()
        os.write(2, ('error: %s\n' % text).encode('utf-8', 'backslashreplace'))
    except (OSError, ValueError):
        pass  # stderr is gone: the status still tells
    os._exit(status)  # pylint: disable=protected-access


PARENT_POLL = 0.5  # seconds between two looks at the parent process


def _watch_parent(nodes):
    """Ends this process in one line once its parent (torchrun's agent) is gone.

    Raises:
        NodeFailure: it is gone already.
    """
    def gone():
        return 'nodes: node %d\'s parent process (pid %d, torchrun\'s agent) ended; node %d ' \
            'ended' % (nodes.rank, _PARENT, nodes.rank)
    if os.getppid() != _PARENT:
        raise NodeFailure(gone())

    def watch():
        while os.getppid() == _PARENT:
            time.sleep(PARENT_POLL)
        _exit_line(gone(), 1)
    threading.Thread(target=watch, name='mp_symbolic parent watch', daemon=True).start()


def leave():
    """Destroys this process's process group, if any, at exit while the
    interpreter is whole (gloo's threads releasing tensors at its end may
    abort the process, pytorch/pytorch#179291). Waits on no other node."""
    dist = torch('distributed')
    if dist.is_initialized():
        _CONTROL.clear()
        dist.destroy_process_group()


def agree(nodes, facts, node_of_stage=None):
    """:meth:`~mp_symbolic.core.transport.comm.ControlPlane.agree` over
    ``nodes``: every node made the same plan."""
    gathered = _gather(nodes, facts, 'compare their plans', node_of_stage)
    for rank, theirs in enumerate(gathered):
        if not isinstance(theirs, dict):
            raise _malformed(nodes, rank, 'compare their plans',
                             'expected a dict of its plan, found %s' % type(theirs).__name__)
    for rank, theirs in enumerate(gathered):
        for key in facts:
            if theirs.get(key) != gathered[0].get(key):
                raise NodeError('nodes: expected every node to make the same plan, found node '
                                '%d\'s %s %s where node 0\'s is %s (are the flags the same on '
                                'every host?)' % (rank, key, excerpt(repr(theirs.get(key))),
                                                  excerpt(repr(gathered[0].get(key)))))


def _key_message(step, key):
    """The :data:`KEY_SLOTS` int64 values telling batch ``step``'s bucket ``key``.

    Raises:
        NodeError: a key of another kind, or a tuple too long.
    """
    import numbers  # pylint: disable=import-outside-toplevel
    if key is None:
        kind, values = 0, ()
    elif isinstance(key, numbers.Integral) and not isinstance(key, bool):
        kind, values = 1, (int(key),)
    elif isinstance(key, (tuple, list)) and len(key) <= KEY_SLOTS - 3 and all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in key):
        kind, values = 2, tuple(int(v) for v in key)
    else:
        raise NodeError('bucket_key: expected an integer, a tuple of at most %d integers or None '
                        'over node processes, found %s' % (KEY_SLOTS - 3, excerpt(repr(key))))
    message = [step, kind, len(values)] + list(values)
    return message + [0] * (KEY_SLOTS - len(message))


def _key_of(message):
    """The bucket key a :func:`_key_message` tells (``None``, an integer, a tuple)."""
    kind, length = int(message[1]), int(message[2])
    values = tuple(int(v) for v in message[3:3 + max(0, min(length, KEY_SLOTS - 3))])
    return None if kind == 0 else values[0] if kind == 1 and values else values


def agree_key(nodes, step, key, node_of_stage=None):
    """Checks that every node runs batch ``step`` with the same bucket ``key``
    before any of its tensors cross: one int64 message to and from each other
    node, every send posted before any receive is waited.

    Raises:
        NodeError: another node's step or key differs, or a key that is not an
            integer, a tuple of integers or ``None``.
        NodeFailure: a node died or did not answer within the node timeout.
    """
    t = torch()
    dist = torch('distributed')
    mine = t.tensor(_key_message(step, key), dtype=t.int64)
    others = [k for k in range(nodes.count) if k != nodes.rank]
    works, received, k = [], [], None
    try:  # gloo refuses to post to a peer whose connection closed, as it fails a wait
        for k in others:
            works.append((k, dist.isend(mine, k, tag=KEY_TAG)))
        for k in others:
            buffer = t.zeros(KEY_SLOTS, dtype=t.int64)
            received.append((k, buffer, dist.irecv(buffer, k, tag=KEY_TAG)))
        for k, _, work in received + [(k, None, w) for k, w in works]:
            work.wait()
    except RuntimeError as err:
        raise _collective(nodes, 'agree on the bucket key of a batch', err, k,
                          node_of_stage) from None
    for k, buffer, _ in received:
        theirs = buffer.tolist()
        if theirs[:3 + int(theirs[2])] != mine.tolist()[:3 + int(mine[2])]:
            where = 'at step %d' % step if theirs[0] == step else \
                'at step %d (node %d\'s step %d)' % (step, k, theirs[0])
            raise NodeError('nodes: expected every node to run the same bucket keys, found node '
                            '%d\'s bucket_key %s where node %d\'s is %s %s (does every node '
                            'read the same batches?)'
                            % (k, excerpt(repr(_key_of(theirs))), nodes.rank,
                               excerpt(repr(key)), where))


def barrier(nodes, what, node_of_stage=None):
    """:meth:`~mp_symbolic.core.transport.comm.ControlPlane.barrier` over
    ``nodes``."""
    dist = torch('distributed')
    try:
        dist.barrier(group=_control())
    except RuntimeError as err:
        raise _collective(nodes, what, err, None, node_of_stage) from None


def broadcast(nodes, value, source, what, node_of_stage=None):
    """:meth:`~mp_symbolic.core.transport.comm.ControlPlane.broadcast` over
    ``nodes``."""
    t = torch()
    dist = torch('distributed')
    data = encode(value) if nodes.rank == source else b''
    try:
        length = t.tensor([len(data)], dtype=t.long)
        dist.broadcast(length, src=source, group=_control())
        size = _checked_length(nodes, source, int(length[0]), what)
        buffer = t.frombuffer(bytearray(data), dtype=t.uint8) if data else \
            t.empty(size, dtype=t.uint8)
        if size:
            dist.broadcast(buffer, src=source, group=_control())
    except NodeFailure:
        raise
    except RuntimeError as err:
        raise _collective(nodes, what, err, source, node_of_stage) from None
    if nodes.rank == source:
        return decode(data, source)  # as the others read it
    return _parsed(nodes, source, buffer.numpy().tobytes(), what)


def broadcast_array(nodes, value, source, shape, dtype, what, node_of_stage=None):
    """:meth:`~mp_symbolic.core.transport.comm.ControlPlane.broadcast_array`
    over ``nodes``, as the array's raw bytes."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    t = torch()
    dist = torch('distributed')
    if nodes.rank == source:
        array = np.require(value, dtype=dtype, requirements='C')
        if array.shape != tuple(shape):
            raise NodeError('nodes: expected an array of shape %s to send, found %s'
                            % (tuple(shape), array.shape))
    else:
        array = np.empty(tuple(shape), dtype=dtype)
    if array.size:
        try:
            dist.broadcast(t.from_numpy(array.reshape(-1).view(np.uint8)), src=source,
                           group=_control())
        except RuntimeError as err:
            raise _collective(nodes, what, err, source, node_of_stage) from None
    return array


def _gather(nodes, value, what, node_of_stage=None):
    """Every node's ``value`` (JSON-able), in rank order, on every node."""
    t = torch()
    dist = torch('distributed')
    data = encode(value)
    try:
        lengths = t.zeros(nodes.count, dtype=t.long)
        dist.all_gather([lengths[k].unsqueeze(0) for k in range(nodes.count)],
                        t.tensor([len(data)], dtype=t.long), group=_control())
        sizes = [_checked_length(nodes, k, int(n), what) for k, n in enumerate(lengths)]
        longest = max(sizes)
        mine = t.zeros(longest, dtype=t.uint8)
        if data:
            mine[:len(data)] = t.frombuffer(bytearray(data), dtype=t.uint8)
        received = t.empty(longest * nodes.count, dtype=t.uint8)
        if longest:
            dist.all_gather([received[k * longest:(k + 1) * longest]
                             for k in range(nodes.count)], mine, group=_control())
    except NodeFailure:
        raise
    except RuntimeError as err:
        raise _collective(nodes, what, err, None, node_of_stage) from None
    raw = received.numpy()
    return [_parsed(nodes, k, raw[k * longest:k * longest + size].tobytes(), what)
            for k, size in enumerate(sizes)]


class Group(ControlPlane):
    """The :class:`~mp_symbolic.core.transport.comm.ControlPlane` of the joined
    ``nodes``, over gloo; ``what`` they do together and ``node_of_stage`` name
    a failure's line."""

    def __init__(self, nodes, what='commit a checkpoint', node_of_stage=None):
        self.nodes, self.what, self.node_of_stage = nodes, what, node_of_stage
        self.rank, self.count = nodes.rank, nodes.count

    def barrier(self):
        barrier(self.nodes, self.what, self.node_of_stage)

    def broadcast(self, value, source):
        return broadcast(self.nodes, value, source, self.what, self.node_of_stage)

    def broadcast_array(self, value, source, shape, dtype):
        return broadcast_array(self.nodes, value, source, shape, dtype, self.what,
                               self.node_of_stage)

    def gather(self, value):
        return _gather(self.nodes, value, self.what, self.node_of_stage)

    def agree(self, facts):
        agree(self.nodes, facts, self.node_of_stage)


# numpy dtypes a message may carry, by numpy's name of them
_DTYPES = ('bool', 'int8', 'uint8', 'int16', 'uint16', 'int32', 'uint32', 'int64', 'uint64',
           'float16', 'float32', 'float64')
ARRAY_KEY = '__ndarray__'


def _jsonable(value):
    import numpy as np  # pylint: disable=import-outside-toplevel
    if isinstance(value, np.ndarray) and value.dtype.name in _DTYPES:
        data = np.ascontiguousarray(value).astype(value.dtype.newbyteorder('<'), copy=False)
        return {ARRAY_KEY: [value.dtype.name, list(value.shape),
                            base64.b64encode(data.tobytes()).decode('ascii')]}
    if isinstance(value, np.generic) and value.dtype.name in _DTYPES:
        return value.item()
    raise TypeError('%s is not JSON-able' % type(value).__name__)


def encode(value):
    """``value`` as a control message: UTF-8 JSON (numpy arrays as
    ``{"__ndarray__": [dtype, shape, base64]}``).

    Raises:
        NodeError: ``value`` holds something else, or is too long.
    """
    try:
        data = json.dumps(value, default=_jsonable, separators=(',', ':')).encode('utf-8')
    except (TypeError, ValueError, RecursionError) as err:
        raise NodeError('nodes: expected a JSON-able message for the other nodes, found %s'
                        % excerpt(str(err))) from None
    if len(data) > MAX_MESSAGE_BYTES:
        raise NodeError('nodes: expected a message for the other nodes of at most %d bytes, '
                        'found %d' % (MAX_MESSAGE_BYTES, len(data)))
    return data


def _array(obj):
    import numpy as np  # pylint: disable=import-outside-toplevel
    if set(obj) != {ARRAY_KEY}:
        return obj
    dtype, shape, text = obj[ARRAY_KEY]
    if dtype not in _DTYPES or not isinstance(shape, list) or not isinstance(text, str) or \
            not all(type(n) is int and n >= 0 for n in shape):  # pylint: disable=unidiomatic-typecheck
        raise ValueError('an array of dtype %s and shape %s' % (excerpt(repr(dtype)),
                                                                excerpt(repr(shape))))
    data = base64.b64decode(text.encode('ascii'), validate=True)
    kind = np.dtype(dtype).newbyteorder('<')
    if len(data) != kind.itemsize * int(np.prod(shape, dtype=object)):
        raise ValueError('an array of shape %s holding %d bytes' % (shape, len(data)))
    return np.frombuffer(data, dtype=kind).astype(np.dtype(dtype)).reshape(shape)


def decode(data, rank=None):
    """A control message's value (``__ndarray__`` objects as numpy arrays).

    Raises:
        ValueError: ``data`` is not UTF-8 JSON, or holds a malformed array.
    """
    try:
        return json.loads(data.decode('utf-8'), object_hook=_array)
    except (ValueError, TypeError, RecursionError) as err:  # binascii.Error is a ValueError
        raise ValueError('expected JSON text%s, found %s: %s' % (
            '' if rank is None else ' from node %d' % rank, excerpt(repr(data[:40])),
            excerpt(str(err) or type(err).__name__))) from None


def _checked_length(nodes, rank, length, what):
    if not 0 <= length <= MAX_MESSAGE_BYTES:
        raise _malformed(nodes, rank, what, 'expected a message of at most %d bytes, found %d'
                         % (MAX_MESSAGE_BYTES, length))
    return length


def _parsed(nodes, rank, data, what):
    try:
        return decode(data)
    except ValueError as err:
        raise _malformed(nodes, rank, what, str(err)) from None


def _malformed(nodes, rank, what, why):
    """The :class:`NodeFailure` of a message node ``rank`` sent that is not one."""
    return NodeFailure('nodes: node %d sent a message that is not one of this job\'s (to %s: '
                       '%s): refused; node %d ended' % (rank, what, why, nodes.rank))


def _why(nodes, text):
    """Why a transfer with another node failed, from gloo's first line."""
    if 'Timed out' in text:
        return 'did not answer within %g s (--node-timeout): it is stopped, wedged or ' \
            'unreachable' % nodes.timeout
    return 'hung up (its process died or its host is unreachable)'


def describe(node, node_of_stage=None):
    """``'node 1 (stages 2, 3)'`` (``'node 1'`` without the plan)."""
    if node_of_stage is None:
        return 'node %d' % node
    stages = [s for s, n in enumerate(node_of_stage) if n == node]
    return 'node %d (stage%s %s)' % (node, 's' if len(stages) > 1 else '',
                                     ', '.join(map(str, stages)))


def _collective(nodes, what, err, source=None, node_of_stage=None):
    """The :class:`NodeFailure` of a collective that failed on this node."""
    others = [k for k in range(nodes.count) if k != nodes.rank]
    if source is not None and source != nodes.rank:
        others = [source]
    text = _first_line(err)
    if len(others) == 1:
        who, why = describe(others[0], node_of_stage), _why(nodes, text)
    else:
        who = 'one of nodes %s' % ', '.join(map(str, others))
        why = _why(nodes, text)
    return NodeFailure('nodes: %s %s (waited for by node %d to %s); node %d ended (%s)'
                       % (who, why, nodes.rank, what, nodes.rank, text))


def _first_line(err):
    lines = [line for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    # gloo prefixes its messages with the source file: [.../gloo/transport/tcp/pair.cc:553]
    if text.startswith('[') and '] ' in text:
        text = text.split('] ', 1)[1]
    return excerpt(text.split('. ', 1)[0].rstrip('.'), 160)  # its first sentence


_TORCH_DTYPES = {}


def _torch_dtype(dtype):
    import numpy as np  # pylint: disable=import-outside-toplevel
    if not _TORCH_DTYPES:
        t = torch()
        _TORCH_DTYPES.update({np.dtype(np.float32): t.float32, np.dtype(np.float64): t.float64,
                              np.dtype(np.float16): t.float16, np.dtype(np.int32): t.int32,
                              np.dtype(np.int64): t.int64, np.dtype(np.int8): t.int8,
                              np.dtype(np.uint8): t.uint8})
    return _TORCH_DTYPES[np.dtype(dtype)]


def from_torch(tensor):
    """A torch tensor as an NDArray sharing its memory."""
    dlpack = torch('utils.dlpack')
    return mx.nd.from_dlpack(dlpack.to_dlpack(tensor))


def _empty_like(dest):
    device = 'cpu' if dest.context.device_type in ('cpu', 'cpu_pinned', 'cpu_shared') else \
        'cuda:%d' % dest.context.device_id
    return torch().empty(dest.shape, dtype=_torch_dtype(dest.dtype), device=device)


class _Buffer:
    """A torch tensor shaped as an NDArray, and the NDArray sharing its memory
    (``array``), made once for a tag and kept from batch to batch."""

    def __init__(self, like):
        self.tensor = _empty_like(like)
        self.array = from_torch(self.tensor)  # on cpu(0) for every CPU device
        self.like = (like.shape, like.dtype, like.context)
        self.made_for = like  # held, so that no other array takes its place in memory

    def wait_to_write(self):
        """Returns once every operation MXNet's engine has pending on the array
        (a copy out of it) is done, so that torch may write into it again."""
        mx.base.check_call(mx.base._LIB.MXNDArrayWaitToWrite(  # pylint: disable=protected-access
            self.array.handle))

    def fits(self, like):
        """True where ``like`` has the shape, type and device of the array this
        buffer was made for: at once where it is that array (an executor's
        argument or gradient, the same at every batch; its outputs are new
        NDArrays at every forward; an NDArray's shape, type and device never
        change), else read through MXNet's C API."""
        return like is self.made_for or self.like == (like.shape, like.dtype, like.context)


class _Received(Pending):
    """Receives in flight from other nodes, landing in their arrays on
    :meth:`wait`."""

    def __init__(self, transport, items, forward):
        self.transport, self.items, self.forward = transport, items, forward

    def wait(self):
        """Waits for every message, each landing in (forward) or adding to
        (backward) its array.

        Raises:
            NodeFailure: the sending node died or stopped answering.
        """
        start = time.perf_counter()
        self.transport.post_sends()  # a peer may be waiting on them while this waits on it
        for work, buffer, dest, link, microbatch in self.items:
            self.transport.wait(work, link.producer if self.forward else link.consumer)
            value = buffer.array
            if self.forward:
                value.copyto(dest)
            else:
                accumulate(dest, value, self.transport.local.written,
                           (link.producer, link.tensor, microbatch))
        self.transport.stats['receive_wait_s'] += time.perf_counter() - start


class TorchTransport(Transport):
    """The transport ``'gloo'``: links within this node as
    :class:`~mp_symbolic.core.transport.comm.LocalTransport` carries them, to
    another node through ``isend``/``irecv``, one tag per link, direction and
    micro-batch. Arguments as :class:`~mp_symbolic.core.transport.comm.Route`'s
    fields."""

    between_nodes = True

    def __init__(self, nodes, node_of_stage, links, microbatches, replica=0):
        self.nodes, self.node_of_stage = nodes, tuple(node_of_stage)
        self.microbatches = microbatches
        self.local = LocalTransport()
        # what crossed to other nodes, and the time spent waiting for what came
        # from them (benchmarks read it; the runtime does not)
        self.stats = {'sent_bytes': 0, 'sent': 0, 'receive_wait_s': 0.0, 'outputs_bytes': 0,
                      'outputs_sent': 0}
        self._index = {link: k for k, (link, _) in enumerate(links)}
        self._base = replica * len(links)
        self._outputs_base = OUTPUT_TAG + replica * MAX_OUTPUTS
        self._sent = []
        # sends whose copies are issued and not yet posted: (buffer, [(node, tag, stage)])
        self._unposted = []
        # {(tag, 'send' or 'receive'): _Buffer}, kept from batch to batch
        self._buffers = {}

    @classmethod
    def for_route(cls, route):
        return cls(route.nodes, route.node_of_stage, route.links, route.microbatches,
                   route.replica)

    def _remote(self, stage):
        return self.node_of_stage[stage] != self.nodes.rank

    def _tag(self, link, backward, microbatch):
        return ((self._base + self._index[link]) * 2 + backward) * self.microbatches + microbatch


    def wait(self, work, stage):
        """Waits for ``work``, a transfer with ``stage``'s node.

        Raises:
            NodeFailure: that node died, hung up or did not answer in time.
        """
        self._post(work.wait, stage)

    def _post(self, call, stage):
        """``call()``, posting or waiting a transfer with ``stage``'s node.

        Raises:
            NodeFailure: as :meth:`wait`.
        """
        try:
            return call()
        except RuntimeError as err:
            node = self.node_of_stage[stage]
            text = _first_line(err)
            why = _why(self.nodes, text)
            raise NodeFailure('nodes: %s %s; node %d ended (%s)'
                              % (describe(node, self.node_of_stage), why, self.nodes.rank,
                                 text)) from None

    def begin(self):
        self.local.begin()
        self._sent = []
        self._unposted = []

    def _buffer(self, tag, way, like):
        """The kept buffer of ``tag`` and ``way`` (``'send'`` or ``'receive'``),
        made anew where ``like`` does not fit it. Reusing it is safe: every send
        of a batch is waited for by :meth:`finish`, and a received buffer's
        copies out are waited for (``wait_to_write``) before it takes another."""
        buffer = self._buffers.get((tag, way))
        if buffer is None or not buffer.fits(like):
            buffer = self._buffers[(tag, way)] = _Buffer(like)
        elif way == 'receive':
            buffer.wait_to_write()
        return buffer

    def _copy_out(self, value, tag):
        """The kept send buffer of ``tag``, ``value`` copied into it by an op
        issued to MXNet's engine (not waited for). The copy, not a DLPack view
        of ``value``: MXNet reorders oneDNN's blocked layouts as it copies, and
        makes no DLPack view of them."""
        buffer = self._buffer(tag, 'send', value)
        if buffer.tensor.numel():
            value.copyto(buffer.array)
        return buffer

    def post_sends(self):
        """Posts every send whose copy was issued, each once its copy is done.

        A send is posted at the next call to this transport, not as it is
        made: by then the action after it is issued too, so MXNet's engine
        has that to run while this thread waits for the copy.

        Raises:
            NodeFailure: a receiving node died or hung up.
        """
        dist = torch('distributed')
        unposted, self._unposted = self._unposted, []
        for buffer, targets in unposted:
            buffer.array.wait_to_read()
            tensor = buffer.tensor
            for node, tag, stage in targets:
                work = self._post(lambda: dist.isend(tensor, node, tag=tag), stage)
                self._sent.append((work, tensor, stage))

    def _send(self, values, backward, microbatch):
        self.post_sends()  # the sends of the action before: its successor is issued
        local = []
        for link, value in values:
            peer = link.producer if backward else link.consumer
            if not self._remote(peer):
                local.append((link, value))
                continue
            tag = self._tag(link, backward, microbatch)
            buffer = self._copy_out(value, tag)
            self.stats['sent_bytes'] += buffer.tensor.numel() * buffer.tensor.element_size()
            self.stats['sent'] += 1
            self._unposted.append((buffer, [(self.node_of_stage[peer], tag, peer)]))
        return local

    def _receive(self, dests, backward, microbatch):
        dist = torch('distributed')
        local, items = [], []
        for link, dest in dests:
            peer = link.consumer if backward else link.producer
            if not self._remote(peer):
                local.append((link, dest))
                continue
            tag = self._tag(link, backward, microbatch)
            buffer = self._buffer(tag, 'receive', dest)
            work = self._post(lambda: dist.irecv(buffer.tensor, self.node_of_stage[peer],
                                                 tag=tag), peer)
            items.append((work, buffer, dest, link, microbatch))
        return local, items

    def send_forward(self, microbatch, values):
        self.local.send_forward(microbatch, self._send(values, 0, microbatch))

    def recv_forward(self, microbatch, dests):
        local, items = self._receive(dests, 0, microbatch)
        self.local.recv_forward(microbatch, local)
        return _Received(self, items, forward=True) if items else DONE

    def recv_backward(self, microbatch, dests):
        local, items = self._receive(dests, 1, microbatch)
        self.local.recv_backward(microbatch, local)
        return _Received(self, items, forward=False) if items else DONE

    def send_backward(self, microbatch, values):
        self.local.send_backward(microbatch, self._send(values, 1, microbatch))

    def _output_tag(self, k):
        if k >= MAX_OUTPUTS:
            raise NodeError('nodes: expected at most %d outputs of the network, found %d'
                            % (MAX_OUTPUTS, k + 1))
        return self._outputs_base + k

    def send_outputs(self, stage, values):
        """Sends the network's outputs ``values`` to every other node."""
        self.post_sends()
        for k, value in values:
            buffer = self._copy_out(value, self._output_tag(k))
            targets = [(node, self._output_tag(k), self.node_of_stage.index(node))
                       for node in range(self.nodes.count) if node != self.nodes.rank]
            self.stats['outputs_bytes'] += \
                len(targets) * buffer.tensor.numel() * buffer.tensor.element_size()
            self.stats['outputs_sent'] += len(targets)
            self._unposted.append((buffer, targets))

    def recv_outputs(self, stage, dests):
        dist = torch('distributed')
        items = []
        for k, dest in dests:
            buffer = self._buffer(self._output_tag(k), 'receive', dest)
            work = self._post(lambda: dist.irecv(buffer.tensor, self.node_of_stage[stage],
                                                 tag=self._output_tag(k)), stage)
            items.append((work, buffer, dest, Link(stage, None, k), None))
        return _Received(self, items, forward=True)

    def finish(self):
        """Waits for this batch's sends.

        Raises:
            NodeFailure: a receiving node died or stopped answering.
        """
        self.post_sends()
        sent, self._sent = self._sent, []
        for work, _, peer in sent:
            self.wait(work, peer)


register_transport(GLOO, TorchTransport)
