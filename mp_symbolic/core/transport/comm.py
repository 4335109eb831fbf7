"""Where a tensor leaves a pipeline stage or a tensor-parallel shard (after
Megatron-LM's ``p2p_communication.py`` and ``mappings.py``); overview in
docs/how-it-works.md.

* :class:`Transport`: point to point, the boundary tensors of one replica's
  stages, registered by name (:func:`register_transport`) and chosen in one
  place (:func:`check_transport`, :func:`open_transport`).
* :class:`ControlPlane`: the node processes together, made by
  :func:`control`.
* :func:`copy_to_shards`, :func:`gather_from_shards`,
  :func:`reduce_from_shards`: where a stage's shards meet, each an op of the
  graph in shard 0's group (MXNet copies between the shards' devices).

A message is one boundary tensor of one micro-batch along a :class:`Link`,
forward (the activation) or backward (its gradient). A tensor several later
stages read has one link per reader; their gradients sum where they land.
A tied parameter's link carries one message each way per batch, as
micro-batch 0's: the parameter, and its gradient summed over the reader's
micro-batches.
"""
import abc
from collections import namedtuple
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Type

import mxnet as mx

from ..base.checks import excerpt
from ..base.compat import read_in_own_group
from ..graph.names import GATHER_ATTR

__all__ = []


# -- between the shards of a stage (Megatron's mappings) ----------------------

def copy_to_shards(F, x):
    """``x`` as every shard of a layer reads it: a variable through an op of the
    group in force (:func:`~mp_symbolic.core.base.compat.read_in_own_group`)."""
    return read_in_own_group(F, x)


def gather_from_shards(F, parts, flatten=None, axis=-1):
    """The shards' outputs joined along ``axis``.

    Args:
        F: ``mx.sym`` or ``mx.nd``.
        parts: Each shard's output, in shard order (one: returned as it is).
        flatten: For a join along the last axis: whether the layer after it
            flattens its input; the join is then marked so that a layer of as
            many shards reads each part (:func:`parts_behind`). ``None``: not
            marked.
        axis: The axis joined.
    """
    if len(parts) == 1:
        return parts[0]
    if F is not mx.sym:
        return F.concat(*parts, dim=axis)
    if axis != -1:
        return F.concat(*parts, dim=axis)
    return F.concat(*parts, dim=axis, name='gather', attr=None if flatten is None else
                    {GATHER_ATTR: '%d:%d' % (len(parts), flatten)})


def parts_behind(x, shards, flatten):
    """The shard outputs behind a marked join (:func:`gather_from_shards`) that a
    layer of ``shards`` shards reads directly, or ``None`` where ``x`` is not
    such a join of that many shards, flattened where the reader flattens."""
    if not isinstance(x, mx.sym.Symbol) or shards == 1:
        return None
    mark = x.attr(GATHER_ATTR)
    if mark is None:
        return None
    count, flat = (int(v) for v in mark.split(':'))
    children = x.get_children()
    if count != shards or (flatten and not flat) or len(children) != shards:
        return None
    return [children[i] for i in range(shards)]


def reduce_from_shards(F, parts):
    """The shards' partial outputs summed (Megatron's all-reduce)."""
    return parts[0] if len(parts) == 1 else F.add_n(*parts, name='reduce')


# -- between the stages of a pipeline (Megatron's p2p_communication) -----------


class Link(namedtuple('Link', 'producer consumer tensor')):
    """One boundary tensor between two stages: output ``tensor`` of the
    ``producer`` stage's sends, read by the ``consumer`` stage."""
    __slots__ = ()


Values = Sequence[Tuple[Link, mx.nd.NDArray]]
Outputs = Sequence[Tuple[int, mx.nd.NDArray]]


class Pending(abc.ABC):
    """Receives posted and not yet landed (what a ``recv_*`` returns)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Returns once every message has landed in (or been added to) its array.

        Raises:
            NodeFailure: (between processes) the sender died or stopped answering.
        """


class _Done(Pending):
    """A receive that is complete once posted (its data is already issued)."""

    def wait(self) -> None:
        """Nothing to wait for: MXNet's engine orders the copy."""


DONE = _Done()


def accumulate(dest, value, written, key):
    """Writes ``value`` into ``dest`` the first time ``key`` lands, and adds it
    after."""
    if key in written:
        dest += value.as_in_context(dest.context)
    else:
        value.copyto(dest)
        written.add(key)


@dataclass(frozen=True)
class Route:
    """What one replica's transport carries.

    Attributes:
        nodes: This process's :class:`~mp_symbolic.core.transport.nodes.Nodes`,
            or ``None`` (every stage in this process).
        node_of_stage: The node of each stage.
        links: Every link of the stages with its spec, in the same order on
            every node (:func:`~mp_symbolic.core.engine.stages.links`).
        microbatches: Micro-batches per batch.
        replica: The replica whose stages these are.
    """
    nodes: Any
    node_of_stage: Tuple[int, ...]
    links: Tuple[Tuple[Link, Any], ...]
    microbatches: int
    replica: int


class Transport(abc.ABC):
    """Point to point: the boundary tensors of one replica's stages.

    Per batch the stage runtime calls :meth:`begin`; then, in the schedule's
    issue order, ``recv_*`` with the arrays the tensors land in (waiting the
    returned :class:`Pending` before the action that reads them) and ``send_*``
    with the arrays an action produced, once it is issued; then
    :meth:`finish`. Invariant: every ``(link, micro-batch)`` is sent and
    received once in each direction, backward messages of one tensor's links
    summed in one array (:func:`accumulate`); nothing outside the arrays given
    is read or written.

    Attributes:
        between_nodes: Whether it carries links between node processes (one
            that does not is refused with ``nodes``).
    """
    between_nodes: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def for_route(cls, route: Route) -> 'Transport':
        """The transport of one replica's stages (see :class:`Route`)."""

    @abc.abstractmethod
    def begin(self) -> None:
        """Starts a batch, forgetting any message a stopped batch left."""

    @abc.abstractmethod
    def send_forward(self, microbatch: int, values: Values) -> None:
        """``values``: ``[(link, NDArray)]``, the producer's outputs."""

    @abc.abstractmethod
    def recv_forward(self, microbatch: int, dests: Values) -> Pending:
        """``dests``: ``[(link, NDArray)]``, the consumer's inputs."""

    @abc.abstractmethod
    def send_backward(self, microbatch: int, values: Values) -> None:
        """``values``: ``[(link, NDArray)]``, the consumer's input gradients."""

    @abc.abstractmethod
    def recv_backward(self, microbatch: int, dests: Values) -> Pending:
        """``dests``: ``[(link, NDArray)]``, the producer's output gradients (one
        array for the links of one tensor)."""

    @abc.abstractmethod
    def send_outputs(self, stage: int, values: Outputs) -> None:
        """``values``: ``[(k, NDArray)]``, the network's outputs ``stage`` computed
        (micro-batches joined), for every process that does not run ``stage``."""

    @abc.abstractmethod
    def recv_outputs(self, stage: int, dests: Outputs) -> Pending:
        """Posts the receives of the network's outputs ``dests`` (``[(k,
        NDArray)]``) that ``stage``, on another process, computes."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Ends the batch once every send has left.

        Raises:
            NodeFailure: (between processes) a receiver died or stopped answering.
        """


class LocalTransport(Transport):
    """Both ends of every link in this process: a forward message is copied when
    the consumer posts its receive, a backward one into the producer's posted
    array when it is sent; MXNet's engine orders the copies."""

    def __init__(self):
        self._sent, self._posted, self.written = {}, {}, set()

    @classmethod
    def for_route(cls, route):
        return cls()

    def begin(self):
        self._sent, self._posted, self.written = {}, {}, set()

    def send_forward(self, microbatch, values):
        for link, value in values:
            self._sent[(link, microbatch)] = value

    def recv_forward(self, microbatch, dests):
        for link, dest in dests:
            self._sent.pop((link, microbatch)).copyto(dest)
        return DONE

    def recv_backward(self, microbatch, dests):
        for link, dest in dests:
            self._posted[(link, microbatch)] = dest
        return DONE

    def send_backward(self, microbatch, values):
        for link, value in values:
            dest = self._posted.pop((link, microbatch))
            accumulate(dest, value, self.written, (link.producer, link.tensor, microbatch))

    def send_outputs(self, stage, values):
        """Nothing to send: every stage is in this process."""

    def recv_outputs(self, stage, dests):
        """Refused: no stage runs in another process.

        Raises:
            ValueError: always.
        """
        raise ValueError('transport: expected stage %d in this process (a local transport '
                         'has no other), found it on another' % stage)

    def finish(self):
        """Nothing is left in flight in this process."""


# -- the transports by name, and the one choice -----------------------------

TRANSPORTS: Dict[str, Type[Transport]] = {}
LOCAL, GLOO = 'local', 'gloo'


def register_transport(name: str, kind: Type[Transport]) -> Type[Transport]:
    """Makes ``kind`` the transport ``name``; returns ``kind``.

    Raises:
        TypeError: ``kind`` is not a :class:`Transport` subclass.
        ValueError: ``name`` is not a non-empty string, or is taken.
    """
    if not (isinstance(kind, type) and issubclass(kind, Transport)):
        raise TypeError('transport %s: expected a subclass of comm.Transport, found %s'
                        % (excerpt(repr(name)), excerpt(repr(kind))))
    if not isinstance(name, str) or not name:
        raise ValueError('transport: expected a name (a non-empty string), found %s'
                         % excerpt(repr(name)))
    if TRANSPORTS.get(name, kind) is not kind:
        raise ValueError('transport %r: expected a new name, found it taken by %s'
                         % (name, TRANSPORTS[name].__name__))
    TRANSPORTS[name] = kind
    return kind


register_transport(LOCAL, LocalTransport)


def _registered():
    if GLOO not in TRANSPORTS:
        # its module registers it, and imports torch only on first use
        from . import nodes  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
    return TRANSPORTS


def check_transport(name: Optional[str], nodes: Any = None) -> str:
    """The transport a Pipeline's stages use: ``name``, or by default ``'local'``
    in one process and ``'gloo'`` over node processes.

    Raises:
        ValueError: ``name`` is not registered, or does not cross processes
            and ``nodes`` is given.
    """
    kinds = _registered()
    if name is None:
        return LOCAL if nodes is None else GLOO
    if not isinstance(name, str) or name not in kinds:
        raise ValueError('transport: expected one of %s (comm.register_transport adds one), '
                         'found %s' % (', '.join(repr(k) for k in kinds), excerpt(repr(name))))
    if nodes is not None and not kinds[name].between_nodes:
        raise ValueError('transport: expected one that crosses node processes with nodes=%d, '
                         'found %r (%s carries links within one process only)'
                         % (nodes.count, name, kinds[name].__name__))
    return name


def open_transport(name: str, route: Route) -> Transport:
    """The registered transport ``name`` (:func:`check_transport`) for
    ``route``."""
    return _registered()[name].for_route(route)


# -- the node processes together ----------------------------------------------

class ControlPlane(abc.ABC):
    """The node processes of one job together, each call made by every node in
    the same order.

    Attributes:
        rank: This node's number, 0 to ``count - 1``.
        count: The nodes of the job.
    """
    rank: int
    count: int

    @abc.abstractmethod
    def barrier(self) -> None:
        """Returns once every node has called it.

        Raises:
            NodeFailure: a node died, or did not come within the node timeout.
        """

    @abc.abstractmethod
    def broadcast(self, value: Any, source: int) -> Any:
        """``value`` of node ``source`` on every node (JSON-able; tuples come back as
        lists).

        Raises:
            NodeError: ``value`` (on ``source``) is not JSON-able or too long.
            NodeFailure: a node died, stopped answering or sent no message.
        """

    @abc.abstractmethod
    def broadcast_array(self, value: Any, source: int, shape: Sequence[int],
                        dtype: Any) -> Any:
        """The numpy array ``value`` of node ``source`` on every node; every node
        gives its ``shape`` and ``dtype``.

        Raises:
            NodeError: ``value`` (on ``source``) is not of ``shape``.
            NodeFailure: a node died or stopped answering.
        """

    @abc.abstractmethod
    def gather(self, value: Any) -> List[Any]:
        """Every node's ``value`` (JSON-able), in rank order, on every node.

        Raises:
            NodeError: ``value`` is not JSON-able or too long.
            NodeFailure: a node died, stopped answering or sent no message.
        """

    @abc.abstractmethod
    def agree(self, facts: Dict[str, Any]) -> None:
        """Checks that every node holds the same ``facts`` (JSON-able values, the
        same keys on every node).

        Raises:
            NodeError: a value differs from node 0's (field and values named).
            NodeFailure: a node died or stopped answering.
        """


class OneProcess(ControlPlane):
    """The control plane of one process: each call returns at once, with this
    process's values."""
    rank, count = 0, 1

    def barrier(self) -> None:
        return None

    def broadcast(self, value: Any, source: int) -> Any:
        return value

    def broadcast_array(self, value: Any, source: int, shape: Sequence[int],
                        dtype: Any) -> Any:
        import numpy as np  # pylint: disable=import-outside-toplevel
        array = np.require(value, dtype=dtype, requirements='C')
        if array.shape != tuple(shape):
            from .nodes import NodeError  # pylint: disable=import-outside-toplevel
            raise NodeError('nodes: expected an array of shape %s to send, found %s'
                            % (tuple(shape), array.shape))
        return array

    def gather(self, value: Any) -> List[Any]:
        return [value]

    def agree(self, facts: Dict[str, Any]) -> None:
        return None


def control(nodes: Any, what: str = 'commit a checkpoint',
            node_of_stage: Optional[Sequence[int]] = None) -> ControlPlane:
    """The control plane of ``nodes`` (this process's joined
    :class:`~mp_symbolic.core.transport.nodes.Nodes`), to do ``what`` together
    (named, with ``node_of_stage``, in a failure's line); :class:`OneProcess`
    where ``nodes`` is ``None``."""
    if nodes is None:
        return OneProcess()
    from .nodes import Group  # pylint: disable=import-outside-toplevel
    return Group(nodes, what, node_of_stage)
