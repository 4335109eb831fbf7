"""The placed graph's passes: functions from a
:class:`~mp_symbolic.core.graph.ir.PlacedGraph` to a new one, in the order a
Pipeline runs them: :func:`label` (:func:`assign_stages`,
:func:`mirror_stages`, :func:`tie_parameters`), :func:`shard_groups`,
:func:`replicate_chunks`, :func:`finish`, and :func:`cut` into one
:class:`StageGraph` per stage.

Invariant: after each pass no variable is read outside its group, as
MXNet's bind needs.
"""
from collections import OrderedDict
from dataclasses import dataclass

from ..placement.balance import CutError
from ..base.compat import UNMIRRORED_OPS, segment_boundaries
from .ir import PlacedGraph, make_node
from .names import (CHUNK_JOIN, CHUNK_SPLIT, IDENTITY_OP, MIRROR_ATTR, chunk_name, is_tied,
                    shard_group, stage_name, tied_name)
from ..parallel.tensor_parallel import device_index

__all__ = ['StageGraph', 'assign_stages', 'mirror_stages', 'tie_parameters', 'label',
           'shard_groups', 'replicate_chunks', 'finish', 'cut', 'unique_names']

# The one GPipe graph copies every op per micro-batch: a graph past this many
# op copies (ops x chunks) is refused rather than built (its build and bind
# cost per copy: docs/pipelining.md).
MAX_CHUNKED_OPS = 8192


def assign_stages(graph, stage_of_op, data_names=(), owners=None):
    """``graph`` with every node's group set: each op its stage's (``stage_of_op``,
    in :meth:`~mp_symbolic.core.graph.ir.PlacedGraph.op_order`); a variable its
    owner's (``owners``, ``{name: stage}``, else its first reader's); the
    inputs and unread variables without a group stage 0's."""
    order = graph.op_order()
    stage = dict(zip(order, stage_of_op))
    groups = {i: stage_name(stage[i]) for i in order}
    owners = dict(owners or {})
    for var, ops in graph.variable_readers().items():
        name = graph.nodes[var].name
        groups[var] = stage_name(0 if name in data_names else owners.get(name, stage[ops[0]]))
    return graph.but([n.but(group=groups.get(n.index, n.group or stage_name(0)))
                      for n in graph.nodes])


def mirror_stages(graph, stages):
    """``graph`` whose ops of ``stages`` carry MXNet's ``__force_mirroring__``
    (recomputed in the backward pass), but those of
    :data:`~mp_symbolic.core.base.compat.UNMIRRORED_OPS`."""
    stages = set(stages)
    return graph.but([n.but(attrs=dict(n.attrs, **{MIRROR_ATTR: 'True'}))
                      if not n.is_variable and n.stage in stages and n.op not in UNMIRRORED_OPS
                      else n for n in graph.nodes])


def label(graph, stage_of_op, data_names=(), owners=None, mirror=()):
    """``graph`` placed by stage: :func:`assign_stages`, :func:`mirror_stages`
    for ``mirror``, then :func:`tie_parameters` (raising CutError)."""
    graph = assign_stages(graph, stage_of_op, data_names, owners)
    if mirror:
        graph = mirror_stages(graph, mirror)
    return tie_parameters(graph, CutError)


def tie_parameters(graph, error=ValueError):
    """``graph`` where every variable read by ops of another group is read by
    them through one ``identity`` op (``<variable>_tied``) in the variable's
    group, listed right after it. MXNet 1.9.1 otherwise sums the gradients on
    a reader's device and fails to save the sum to the variable's. Raises
    ``error`` for an auxiliary state read by ops of two groups."""
    nodes = graph.nodes
    foreign = {}
    for node in nodes:
        for k, entry in enumerate(node.inputs):
            own = nodes[entry.node]
            if own.is_variable and own.group is not None and node.group != own.group:
                if entry.version:
                    raise error('auxiliary state %s is read by ops of %s and %s; expected '
                                'each auxiliary state in one stage'
                                % (own.name, own.group, node.group))
                foreign.setdefault(entry.node, []).append((node.index, k))
    if not foreign:
        return graph
    redirect = {use for uses in foreign.values() for use in uses}
    out, new_index, identity_of = [], {}, {}
    for node in nodes:
        inputs = [(identity_of[e.node], 0, 0) if (node.index, k) in redirect
                  else (new_index[e.node], e.output, e.version)
                  for k, e in enumerate(node.inputs)]
        new_index[node.index] = len(out)
        out.append(node.but(index=len(out), inputs=inputs))
        if node.index in foreign:
            identity_of[node.index] = len(out)
            out.append(make_node(len(out), tied_name(node.name), IDENTITY_OP,
                                 [(new_index[node.index], 0, 0)], node.group))
    return graph.but(out, [(new_index[h.node], h.output, h.version) for h in graph.heads])


def shard_groups(graph, widths):
    """A labelled graph with each tensor-parallel shard's node in its shard's
    group, for stages of ``widths[s]`` devices: a layer call's shards on the
    stage of its first op, a moved weight's ``_tied`` identity with it. Raises
    ValueError for a stage of several devices but not as many as a layer's
    shards."""
    stage_of_layer = {}
    for node in graph.ops:  # in topological order
        if node.layer is not None:
            stage_of_layer.setdefault(node.layer[2], node.stage)
    out, moved = list(graph.nodes), {}
    for node in graph.nodes:
        if node.layer is None:
            continue
        shard, shards, layer = node.layer
        stage = stage_of_layer.get(layer, node.stage)
        try:
            index = device_index(shard, shards, widths[stage])
        except ValueError as err:
            raise ValueError('%s in %s: %s' % (node.name, stage_name(stage), err)) from None
        moved[node.index] = shard_group(stage, index)
        out[node.index] = node.but(group=moved[node.index])
    for node in graph.nodes:
        if is_tied(node.name) and len(node.inputs) == 1 and node.inputs[0].node in moved:
            out[node.index] = out[node.index].but(group=moved[node.inputs[0].node])
    return graph.but(out)


def replicate_chunks(graph, data_name, chunks, last_stage, axis=0):
    """``graph`` on ``chunks`` micro-batches: each input split on ``axis`` in its
    own stage (``chunk``, ``chunk_<name>``), every op copied per chunk
    (``<op>_chunk<m>``), every variable shared, each output's chunks joined in
    ``last_stage`` (``join``, ``join<k>``) through segment boundaries
    (:func:`~mp_symbolic.core.base.compat.segment_boundaries`). The join reads
    the chunks last first, so that the backward pass updates BatchNorm's
    statistics in micro-batch order (docs/batchnorm-chunks.md).

    Args:
        data_name: The input variable, or the names of several.
        axis: The batch axis of every input and output.

    Raises:
        CutError: an input is not one variable of the graph, or ops x chunks
            is above :data:`MAX_CHUNKED_OPS`.
    """
    if chunks == 1:
        return graph
    names = (data_name,) if isinstance(data_name, str) else tuple(data_name)
    nodes = graph.nodes
    ops = len(graph.ops)
    if ops * chunks > MAX_CHUNKED_OPS:
        raise CutError("chunks: expected at most %d micro-batches of this graph's %d ops in one "
                       'graph (ops x chunks at most %d), found %d; the stage runtime '
                       "(schedule='1f1b') runs micro-batches one after another in graphs of "
                       'one micro-batch' % (MAX_CHUNKED_OPS // ops, ops, MAX_CHUNKED_OPS, chunks))
    inputs = {}
    for name in names:
        found = [n.index for n in graph.variables if n.name == name]
        if len(found) != 1:
            raise CutError('chunks: expected one input variable %r, found %d' % (name, len(found)))
        inputs[found[0]] = name
    out, index = [], {}
    for node in graph.variables:
        index[(node.index, None)] = len(out)
        out.append(node.but(index=len(out)))
    split = {}
    for i, name in inputs.items():
        split[i] = len(out)
        out.append(make_node(len(out), CHUNK_SPLIT if len(names) == 1
                             else '%s_%s' % (CHUNK_SPLIT, name), 'split',
                             [(index[(i, None)], 0, 0)], nodes[i].group,
                             attrs={'axis': str(axis), 'num_outputs': str(chunks)}))

    def entry(e, m):
        if e.node in split:
            return (split[e.node], m, 0)
        if nodes[e.node].is_variable:
            return (index[(e.node, None)], e.output, e.version)
        return (index[(e.node, m)], e.output, e.version)

    heads = [[] for _ in graph.heads]
    for m in range(chunks):
        for node in graph.ops:
            index[(node.index, m)] = len(out)
            out.append(node.but(index=len(out), name=chunk_name(node.name, m),
                                inputs=[entry(e, m) for e in node.inputs]))
        for k, head in enumerate(graph.heads):
            heads[k].append(entry(head, m))
    joined = []
    for k, parts in enumerate(heads):
        parts = parts[::-1]  # the last chunk first: its backward runs last
        if last_stage > 0:
            copies, parts = segment_boundaries(parts, stage_name(last_stage), len(out),
                                               '' if len(heads) == 1 else '%d_' % k)
            out += copies
        name = CHUNK_JOIN if len(heads) == 1 else '%s%d' % (CHUNK_JOIN, k)
        group = stage_name(last_stage)
        out.append(make_node(len(out), name + '_reversed', 'Concat', parts, group,
                             attrs={'dim': str(axis), 'num_args': str(chunks)}))
        out.append(make_node(len(out), name + '_parts', 'split', [(len(out) - 1, 0, 0)],
                             group, attrs={'axis': str(axis), 'num_outputs': str(chunks)}))
        out.append(make_node(len(out), name, 'Concat',
                             [(len(out) - 1, m, 0) for m in reversed(range(chunks))], group,
                             attrs={'dim': str(axis), 'num_args': str(chunks)}))
        joined.append((len(out) - 1, 0, 0))
    return graph.but(out, joined)


def finish(graph, placement):
    """``graph`` with every parameter in its owner's (or shard's) group and tied
    where others read it, op copies named apart
    (:func:`~mp_symbolic.core.graph.names.chunk_name`), every node checked to
    carry a group of ``placement``'s plan."""
    owner, shard_of = placement.owner, placement.shard_of
    graph = tie_parameters(graph.but([
        n.but(group=shard_group(owner[n.name], shard_of.get(n.name, 0)))
        if n.is_variable and n.name in owner else n for n in graph.nodes]), CutError)
    groups = set(placement.plan.group2ctx)
    seen, out = {}, []
    for node in graph.nodes:
        if node.group not in groups:  # an internal invariant: every node is built in a scope
            raise AssertionError('node %s has ctx_group %r, expected one of %s'
                                 % (node.name, node.group, sorted(groups)))
        if not node.is_variable:
            count = seen.get(node.name, 0)
            seen[node.name] = count + 1
            if count:
                node = node.but(name=chunk_name(node.name, count))
        out.append(node)
    return graph.but(out)


@dataclass(frozen=True)
class StageGraph:
    """One stage's part of the training graph.

    Attributes:
        stage: Its index.
        graph: The sub-graph (``None`` for a stage with no output); its
            outputs are ``heads`` then ``sends``.
        symbol: The sub-graph as a Symbol, to bind.
        heads: ``[(k, output)]``: the whole graph's output ``k`` is this
            sub-graph's output ``output``.
        sends: ``[(entry, output)]``: outputs later stages read, ``entry`` the
            whole graph's ``(node, index)``.
        receives: ``[(variable, producer stage, entry)]``: inputs that are
            another stage's outputs.
        inputs: The data and label variables this stage reads.
    """
    stage: int
    graph: object
    symbol: object
    heads: tuple
    sends: tuple
    receives: tuple
    inputs: tuple


def cut(graph, num_stages):
    """``graph`` (every node in its stage's group, its data and label variables
    ``'input'`` nodes) as one :class:`StageGraph` per stage; raises CutError
    where a stage reads a later stage's output or a parameter is read by two."""
    placed = graph
    stage_of = {n.index: n.stage for n in placed.ops}
    readers, param_readers = {}, {}
    for node in placed.ops:
        for src, k, _ in node.inputs:
            source = placed.nodes[src]
            if source.is_variable:
                if source.role != 'input':
                    param_readers.setdefault(source.name, set()).add(node.stage)
            elif source.stage > node.stage:
                raise CutError('schedule: expected every stage to read earlier stages only, '
                               'found %s (stage %d) reading %s (stage %d)'
                               % (node.name, node.stage, source.name, source.stage))
            elif source.stage < node.stage:
                readers.setdefault((src, k), set()).add(node.stage)
    for name, stages in param_readers.items():
        if len(stages) > 1:
            raise CutError('schedule: expected each parameter read by one stage, found %s read '
                           'by stages %s' % (name, sorted(stages)))
    for head in placed.heads:
        if head.node not in stage_of:
            raise CutError('schedule: expected the graph\'s outputs computed by a stage, found '
                           'variable %s' % placed.nodes[head.node].name)
    return [_stage_graph(placed, s, stage_of, readers) for s in range(num_stages)]


def _stage_graph(graph, s, stage_of, readers):
    out, index, received = [], {}, OrderedDict()
    inputs = []
    for node in graph.ops:
        if stage_of[node.index] != s:
            continue
        entries = []
        for src, k, v in node.inputs:
            source = graph.nodes[src]
            if source.is_variable:
                if src not in index:
                    if source.role == 'input':  # the data or label, read here
                        source = source.but(group=stage_name(s))
                        inputs.append(source.name)
                    index[src] = len(out)
                    out.append(source.but(index=len(out)))
                entries.append((index[src], k, v))
            elif stage_of[src] == s:
                entries.append((index[src], k, v))
            else:
                if (src, k) not in received:
                    name = '%s_output%d_to_stage%d' % (source.name, k, s)
                    received[(src, k)] = (len(out), name)
                    out.append(make_node(len(out), name, 'null', (), stage_name(s), 'input'))
                entries.append((received[(src, k)][0], 0, 0))
        index[node.index] = len(out)
        out.append(node.but(index=len(out), inputs=entries))
    heads, own = [], []
    for k, (src, idx, v) in enumerate(graph.heads):
        if stage_of[src] == s:
            own.append((k, len(heads)))
            heads.append((index[src], idx, v))
    sends = []
    for (src, idx) in sorted(e for e in readers if stage_of[e[0]] == s):
        sends.append(((src, idx), len(heads)))
        heads.append((index[src], idx, 0))
    receives = tuple((name, stage_of[src], (src, k)) for (src, k), (_, name) in received.items())
    # a received tensor (a variable here) that ops of another group read, the
    # shards of a tensor-parallel layer, is read through an identity in its own
    placed = tie_parameters(PlacedGraph(tuple(out), (), graph.attrs).but(heads=heads),
                            CutError) if heads else None
    return StageGraph(s, placed, None if placed is None else placed.to_symbol(), tuple(own),
                      tuple(sends), receives, tuple(inputs))


def unique_names(graph):
    """``graph`` whose op names are unique: later ones get ``_<k>``."""
    seen = {n.name for n in graph.variables}
    out = []
    for node in graph.nodes:
        if not node.is_variable:
            name, k = node.name, 1
            while name in seen:
                name = '%s_%d' % (node.name, k)
                k += 1
            seen.add(name)
            node = node.but(name=name)
        out.append(node)
    return graph.but(out)
