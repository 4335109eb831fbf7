"""Where a tensor leaves a pipeline stage or a tensor-parallel shard: the
communication vocabulary, in one place.

After Megatron-LM's ``p2p_communication.py`` (``send_forward``,
``recv_forward``, ``send_backward``, ``recv_backward``) and
torch.distributed.pipelining's ``PipelineStage``: the runtime
(:mod:`~mp_symbolic.core.stages`) never copies a boundary tensor itself; it
posts each receive with the array the tensor lands in, and hands each tensor
it produces to a *transport*, which matches the two.

A message is one boundary tensor of one micro-batch along a :class:`Link`
(``producer`` stage, ``consumer`` stage, ``tensor``: the index of the
producer's output among its sends), in one direction: forward (the
activation, producer to consumer) or backward (its gradient, consumer to
producer). A tensor that several later stages read has one link per reader;
their gradients are summed where they land (the first written, the others
added), in the order the runtime issues the backwards.
A tied parameter's link (:func:`~mp_symbolic.core.stages.tied_sends`)
carries one message each way per batch, as micro-batch 0's: the parameter,
and the sum of its gradients over the reader's micro-batches.

The transport here is :class:`LocalTransport`: both stages in this process,
each message one copy between the two stages' arrays, pushed to MXNet's
engine like any op (a cross-device copy where the devices differ), so the
devices still overlap. Its receives are posted when the receiving array is
free to be written (a forward's input at its forward; a backward's output
gradients at the forward that made the outputs, so a gradient can land as
soon as it is sent) and complete when the matching send is issued.

Tensor-parallel shards meet inside a stage's graph, after Megatron-LM's
``mappings.py``: :func:`copy_to_shards` (every shard reads one input),
:func:`gather_from_shards` (their outputs joined) and
:func:`reduce_from_shards` (their partial outputs summed). Each is an op of
the graph in shard 0's group; MXNet's executor, bound with ``group2ctx``,
inserts the copies between the shards' devices, and its backward pass is
the conjugate (a split, a broadcast).
"""
from collections import namedtuple

import mxnet as mx

from .compat import read_in_own_group

__all__ = []


# -- between the shards of a stage (Megatron's mappings) ----------------------

def copy_to_shards(F, x):
    """``x`` as every shard of a layer reads it: a variable through an op of
    the group in force (a variable read by several groups cannot be bound
    for training, :func:`~mp_symbolic.core.compat.read_in_own_group`)."""
    return read_in_own_group(F, x)


def gather_from_shards(F, parts, attr=None):
    """The shards' outputs joined along the last axis (``attr``: attributes
    of the join, for a layer that reads the parts behind it)."""
    if len(parts) == 1:
        return parts[0]
    if F is mx.sym:
        return F.concat(*parts, dim=-1, name='gather', attr=attr)
    return F.concat(*parts, dim=-1)


def reduce_from_shards(F, parts):
    """The shards' partial outputs summed (Megatron's all-reduce)."""
    return parts[0] if len(parts) == 1 else F.add_n(*parts, name='reduce')


# -- between the stages of a pipeline (Megatron's p2p_communication) -----------


class Link(namedtuple('Link', 'producer consumer tensor')):
    """One boundary tensor between two stages: output ``tensor`` of the
    ``producer`` stage's sends, read by the ``consumer`` stage."""
    __slots__ = ()


class _Done:
    """A receive that is complete once posted (its data is already issued)."""

    @staticmethod
    def wait():
        """Nothing to wait for: MXNet's engine orders the copy."""


DONE = _Done()


def accumulate(dest, value, written, key):
    """Writes ``value`` into ``dest`` (the first time ``key`` lands) or adds
    it (a tensor read by several stages: its gradients sum)."""
    if key in written:
        dest += value.as_in_context(dest.context)
    else:
        value.copyto(dest)
        written.add(key)


class LocalTransport:
    """Both ends of every link in this process.

    A forward message is copied from the producer's output array when the
    consumer posts its receive (the producer keeps that array until its own
    backward, which follows the consumer's); a backward message is copied
    into the array the producer posted, when it is sent (the consumer's
    gradient array is written again by its next backward).
    """

    def __init__(self):
        self._sent, self._posted, self.written = {}, {}, set()

    def begin(self):
        """Forgets the last batch's messages (a batch stopped midway leaves some)."""
        self._sent, self._posted, self.written = {}, {}, set()

    def send_forward(self, microbatch, values):
        """``values``: ``[(link, NDArray)]``, the producer's outputs."""
        for link, value in values:
            self._sent[(link, microbatch)] = value

    def recv_forward(self, microbatch, dests):
        """``dests``: ``[(link, NDArray)]``, the consumer's inputs; returns
        the pending receive (:meth:`wait` it before the forward)."""
        for link, dest in dests:
            self._sent.pop((link, microbatch)).copyto(dest)
        return DONE

    def recv_backward(self, microbatch, dests):
        """``dests``: ``[(link, NDArray)]``, the producer's output gradients
        (one array for the links of one tensor: they sum there)."""
        for link, dest in dests:
            self._posted[(link, microbatch)] = dest
        return DONE

    def send_backward(self, microbatch, values):
        """``values``: ``[(link, NDArray)]``, the consumer's input gradients."""
        for link, value in values:
            dest = self._posted.pop((link, microbatch))
            accumulate(dest, value, self.written, (link.producer, link.tensor, microbatch))

    def send_outputs(self, stage, values):
        """``values``: ``[(k, NDArray)]``, the network's outputs ``stage``
        computed, the batch's micro-batches joined: every stage is in this
        process, where they are read already."""

    def finish(self):
        """Ends the batch: nothing is left in flight in this process."""
