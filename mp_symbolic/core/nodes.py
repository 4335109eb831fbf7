"""Node processes: a pipeline's stages divided over several processes (on
one host or many), and the transport that carries their boundary tensors.

MXNet has no point-to-point transport between processes (its ps-lite
kvstore only sums what workers push), so, as Megatron-LM
(``p2p_communication.py``), DeepSpeed (``runtime/pipe/p2p.py``) and
torch.distributed.pipelining do, the tensors go through
torch.distributed's ``isend``/``irecv``: gloo between CPU devices, NCCL
between GPUs. An NDArray becomes a torch tensor by one copy of MXNet's
into a buffer of torch's seen through DLPack (so that MXNet may write the
array again while the send is in flight, and an array in oneDNN's layout
arrives in the default one), and a received tensor is read back through
DLPack.

The stages are divided over the nodes in stage order, contiguous, the
devices of a replica evenly (:func:`node_of_devices`); every node runs the
same schedule filtered to its stages, in the one issue order every node
computes alike, so a node's receive always waits for an action that comes
earlier in that order and no node waits for ever on another that is alive
(:mod:`~mp_symbolic.core.schedule`). Sends never block: a transfer
overlaps the next action's compute.

torch is imported here only, on the first use of a node process group:
a Pipeline of one node never loads it. GluonCV 0.10 refuses to import
wherever torch 2 is importable (its version check raises, dmlc/gluon-cv
#1768), so torch may live apart: where ``import torch`` finds none, the
folder ``torch-site`` of this Python's environment (``make setup`` installs
torch there) is appended to ``sys.path`` first.

Rendezvous: the variables torchrun sets, and ``python -m mp_symbolic
launch --nodes N`` sets for its node processes (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``).
"""
import atexit
from dataclasses import dataclass
import datetime
import importlib
import importlib.util
import os
import sys
import time

import mxnet as mx

from .balance import even_split, stage_of_block
from .checks import excerpt, positive_int
from .comm import DONE, Link, LocalTransport, accumulate

__all__ = []

RENDEZVOUS = ('MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE')
TORCH_SITE = 'torch-site'  # torch installed apart from GluonCV's sight (see the module's text)
NODE_TIMEOUT = 300.0  # default seconds a node waits on another before the job ends
MAX_NODES = 1024
# the tags of the network's outputs a node sends the others, past every link's
OUTPUT_TAG = 1 << 30
MAX_OUTPUTS = 1 << 12  # outputs per replica the tags leave room for


def torch(part=None):
    """torch, or its module ``torch.<part>``, imported on first use.

    Raises:
        NodeError: torch is not installed (``make setup`` installs it; or
            ``pip install 'mxnet-model-parallel[nodes]'``).
    """
    name = 'torch' if part is None else 'torch.' + part
    if name in sys.modules:
        return sys.modules[name]
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


class NodeError(ValueError):
    """A node plan that cannot run: the message is one line."""


class NodeFailure(RuntimeError):
    """Another node died, hung up or stopped answering: the message is one
    line naming it and its stages."""


def node_of_devices(devices_per_replica, nodes):
    """The node of each device of a replica: ``nodes`` contiguous runs, as
    even as the count allows (``node_of_devices(3, 2) == (0, 0, 1)``).

    Raises:
        NodeError: more nodes than devices (a node would hold no stage).
    """
    nodes = positive_int('nodes', nodes, NodeError)
    if nodes > MAX_NODES:
        raise NodeError('nodes: expected at most %d, found %d' % (MAX_NODES, nodes))
    if nodes > devices_per_replica:
        raise NodeError('nodes: expected at most as many nodes as devices per replica (%d), '
                        'found %d (a node would hold no stage)' % (devices_per_replica, nodes))
    return stage_of_block(even_split(devices_per_replica, nodes))


@dataclass(frozen=True)
class Nodes:
    """This process's place among the node processes of a job.

    Attributes:
        count: Node processes in the job.
        rank: This one's (0 to ``count - 1``).
        timeout: Seconds a node waits on another (a receive, a barrier)
            before the job ends.
        address: ``MASTER_ADDR:MASTER_PORT`` of the rendezvous.
    """
    count: int
    rank: int
    timeout: float
    address: str


def from_environment(count, timeout=None, environ=None):
    """The :class:`Nodes` of this process for a job of ``count`` nodes,
    from the rendezvous variables torchrun and ``launch --nodes`` set.

    Raises:
        NodeError: a variable is missing or malformed, the job's
            ``WORLD_SIZE`` is not ``count``, or ``timeout`` is not a
            positive number of seconds.
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
    """Joins this process to the job's process group (once per process;
    waits until every node has joined, at most the node timeout).

    Args:
        gpus: Whether this node's stages run on GPUs: the tensors then go by
            NCCL (from GPU memory, through DLPack), the small messages (the
            plan, the losses, a commit's steps) by a gloo group beside it.
            Untested here: the machines this was written on have no GPU.

    Raises:
        NodeFailure: the other nodes did not join within the timeout, or
            the rendezvous could not be reached.
    """
    dist = torch('distributed')
    if dist.is_initialized():
        if dist.get_world_size() != nodes.count or dist.get_rank() != nodes.rank:
            raise NodeError('nodes: expected one job per process, found this process already '
                            'node %d of %d' % (dist.get_rank(), dist.get_world_size()))
        return
    timeout = datetime.timedelta(seconds=nodes.timeout)
    host, port = nodes.address.rsplit(':', 1)
    # torchrun hosts the store in its agent and keeps it across restarts; the
    # keys of a killed attempt's process group stay in it, and a restarted
    # node would connect to its dead peer's address (seen with torch 2.13):
    # each attempt gets keys of its own. Without torchrun, node 0 hosts it.
    agent = os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True'
    attempt = '%s/%s' % (os.environ.get('TORCHELASTIC_RUN_ID', 'job'),
                         os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))
    try:
        store = dist.TCPStore(host, int(port), nodes.count, is_master=not agent and
                              nodes.rank == 0, timeout=timeout)
        dist.init_process_group('nccl' if gpus else 'gloo',
                                store=dist.PrefixStore('mp_symbolic/' + attempt, store),
                                rank=nodes.rank, world_size=nodes.count, timeout=timeout)
        if gpus:
            _CONTROL.append(dist.new_group(backend='gloo', timeout=timeout))
    except (RuntimeError, ValueError, OSError) as err:
        raise NodeFailure('nodes: node %d of %d could not join the others at %s within %g s '
                          '(--node-timeout): %s' % (nodes.rank, nodes.count, nodes.address,
                                                    nodes.timeout, _first_line(err))) from None
    atexit.register(leave)


def leave():
    """Destroys this process's process group, if it has one (at exit, while
    the interpreter is whole). Left to the interpreter's end, gloo's threads
    still hold their last works' tensors, and releasing those there aborted
    a node now and then ("terminate called without an active exception",
    SIGABRT after a finished run; pytorch/pytorch#179291). Local: it waits
    on no other node."""
    dist = torch('distributed')
    if dist.is_initialized():
        _CONTROL.clear()
        dist.destroy_process_group()


def agree(nodes, facts, node_of_stage=None):
    """Checks that every node made the same plan: ``facts`` (a dict of
    JSON-able values, the same keys on every node) gathered from all.

    Raises:
        NodeError: a node's value differs from node 0's (the message names
            the field and both values).
        NodeFailure: a node died or stopped answering meanwhile.
    """
    dist = torch('distributed')
    gathered = [None] * nodes.count
    try:
        dist.all_gather_object(gathered, facts, group=_control())
    except RuntimeError as err:
        raise _collective(nodes, 'compare their plans', err, None, node_of_stage) from None
    for rank, theirs in enumerate(gathered):
        for key, value in facts.items():
            if theirs.get(key) != gathered[0].get(key):
                raise NodeError('nodes: expected every node to make the same plan, found node '
                                '%d\'s %s %s where node 0\'s is %s (are the flags the same on '
                                'every host?)' % (rank, key, excerpt(repr(theirs.get(key))),
                                                  excerpt(repr(gathered[0].get(key)))))


def barrier(nodes, what, node_of_stage=None):
    """Waits until every node gets here.

    Raises:
        NodeFailure: a node died, or did not come within the node timeout.
    """
    dist = torch('distributed')
    try:
        dist.barrier(group=_control())
    except RuntimeError as err:
        raise _collective(nodes, what, err, None, node_of_stage) from None


def broadcast(nodes, value, source, what, node_of_stage=None):
    """``value`` of node ``source`` on every node (a JSON-able object).

    Raises:
        NodeFailure: a node died or stopped answering meanwhile.
    """
    dist = torch('distributed')
    box = [value]
    try:
        dist.broadcast_object_list(box, src=source, group=_control())
    except RuntimeError as err:
        raise _collective(nodes, what, err, source, node_of_stage) from None
    return box[0]


class Group:
    """The node processes as :func:`~mp_symbolic.tools.store.commit_across`
    takes them: ``rank``, ``broadcast`` and ``gather`` of JSON-able values.

    Args:
        nodes: This process's :class:`Nodes` (joined: :func:`join`).
        what: What the nodes do together, for the failure's line.
    """

    def __init__(self, nodes, what='commit a checkpoint', node_of_stage=None):
        self.nodes, self.what, self.node_of_stage = nodes, what, node_of_stage
        self.rank, self.count = nodes.rank, nodes.count

    def broadcast(self, value, source):
        return broadcast(self.nodes, value, source, self.what, self.node_of_stage)

    def gather(self, value):
        """Every node's ``value``, in rank order, on every node.

        Raises:
            NodeFailure: a node died or stopped answering.
        """
        dist = torch('distributed')
        gathered = [None] * self.count
        try:
            dist.all_gather_object(gathered, value, group=_control())
        except RuntimeError as err:
            raise _collective(self.nodes, self.what, err, None, self.node_of_stage) from None
        return gathered


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
    """The :class:`NodeFailure` of a collective (a broadcast from ``source``,
    a gather, a barrier) that failed on this node."""
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


def to_torch(value):
    """An NDArray's values as a torch tensor of their own (on the array's
    device: CPU, or the GPU for NCCL), in the default (row-major) layout,
    once MXNet has written them.

    An array a oneDNN operator wrote (a convolution's output on CPU) may
    hold its values in oneDNN's own blocked layout, of which MXNet makes
    no DLPack view (``to_dlpack_for_read`` fails: "We can't generate TBlob
    for MKLDNN data"). MXNet's own copy (``copyto``, as ``asnumpy`` does)
    reorders them to the default layout: the values are copied by MXNet
    into a buffer of torch's, the one copy the send needs anyway."""
    tensor = _empty_like(value)
    if tensor.numel():
        value.copyto(from_torch(tensor)).wait_to_read()
    return tensor


def from_torch(tensor):
    """A torch tensor as an NDArray sharing its memory."""
    dlpack = torch('utils.dlpack')
    return mx.nd.from_dlpack(dlpack.to_dlpack(tensor))


def _empty_like(dest):
    device = 'cpu' if dest.context.device_type in ('cpu', 'cpu_pinned', 'cpu_shared') else \
        'cuda:%d' % dest.context.device_id
    return torch().empty(dest.shape, dtype=_torch_dtype(dest.dtype), device=device)


class _Received:
    """Receives in flight from other nodes, landing in their arrays on :meth:`wait`."""

    def __init__(self, transport, items, forward):
        self.transport, self.items, self.forward = transport, items, forward

    def wait(self):
        """Waits for every message; each lands in (forward) or adds to
        (backward: gradients of a tensor several stages read) its array.

        Raises:
            NodeFailure: the sending node died or stopped answering.
        """
        start = time.perf_counter()
        for work, buffer, dest, link, microbatch in self.items:
            self.transport.wait(work, link.producer if self.forward else link.consumer)
            value = from_torch(buffer)
            if self.forward:
                value.copyto(dest)
            else:
                accumulate(dest, value, self.transport.local.written,
                           (link.producer, link.tensor, microbatch))
        self.transport.stats['receive_wait_s'] += time.perf_counter() - start


class TorchTransport:
    """The boundary tensors of one replica's stages when other node
    processes run some of them: links within this node as
    :class:`~mp_symbolic.core.comm.LocalTransport` carries them, links to
    another node through torch.distributed's ``isend``/``irecv``, one tag
    per link, direction and micro-batch.

    Args:
        nodes: This process's :class:`Nodes`.
        node_of_stage: The node of each stage.
        links: Every link of the stages, in the order every node has
            (:func:`~mp_symbolic.core.stages.links`).
        microbatches: Micro-batches per batch.
        replica: The replica these stages belong to (its own tags).
    """

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

    def _remote(self, stage):
        return self.node_of_stage[stage] != self.nodes.rank

    def _tag(self, link, backward, microbatch):
        return ((self._base + self._index[link]) * 2 + backward) * self.microbatches + microbatch


    def wait(self, work, stage):
        """Waits for ``work``, a transfer with ``stage``'s node.

        Raises:
            NodeFailure: that node died, hung up or did not answer within
                the node timeout.
        """
        try:
            work.wait()
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

    def _send(self, values, backward, microbatch):
        dist = torch('distributed')
        local = []
        for link, value in values:
            peer = link.producer if backward else link.consumer
            if not self._remote(peer):
                local.append((link, value))
                continue
            tensor = to_torch(value)
            self.stats['sent_bytes'] += tensor.numel() * tensor.element_size()
            self.stats['sent'] += 1
            work = dist.isend(tensor, self.node_of_stage[peer],
                              tag=self._tag(link, backward, microbatch))
            self._sent.append((work, tensor, peer))
        return local

    def _receive(self, dests, backward, microbatch):
        dist = torch('distributed')
        local, items = [], []
        for link, dest in dests:
            peer = link.consumer if backward else link.producer
            if not self._remote(peer):
                local.append((link, dest))
                continue
            buffer = _empty_like(dest)
            work = dist.irecv(buffer, self.node_of_stage[peer],
                              tag=self._tag(link, backward, microbatch))
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
        """Sends the network's outputs ``values`` (``[(k, NDArray)]``: output
        ``k``, the batch's micro-batches joined) that ``stage``, run here,
        computed, to every other node, which posted their receives
        (:meth:`recv_outputs`) at the batch's start."""
        dist = torch('distributed')
        for k, value in values:
            tensor = to_torch(value)
            for node in range(self.nodes.count):
                if node == self.nodes.rank:
                    continue
                work = dist.isend(tensor, node, tag=self._output_tag(k))
                self.stats['outputs_bytes'] += tensor.numel() * tensor.element_size()
                self.stats['outputs_sent'] += 1
                self._sent.append((work, tensor, self.node_of_stage.index(node)))

    def recv_outputs(self, stage, dests):
        """Posts the receives of the network's outputs ``dests`` (``[(k,
        NDArray)]``) that ``stage``, run on another node, computes; returns
        the pending receive (wait it before reading them)."""
        dist = torch('distributed')
        items = []
        for k, dest in dests:
            buffer = _empty_like(dest)
            work = dist.irecv(buffer, self.node_of_stage[stage], tag=self._output_tag(k))
            items.append((work, buffer, dest, Link(stage, None, k), None))
        return _Received(self, items, forward=True)

    def finish(self):
        """Waits for this batch's sends (their buffers go, their errors surface).

        Raises:
            NodeFailure: a receiving node died or stopped answering.
        """
        sent, self._sent = self._sent, []
        for work, _, peer in sent:
            self.wait(work, peer)
