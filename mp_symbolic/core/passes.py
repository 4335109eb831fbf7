"""The placed graph's passes: functions from a graph to a new graph, each a
copy (the graph given is left as it is), in the order a Pipeline runs them.

A graph here is MXNet's JSON form of a Symbol (``json.loads(symbol.tojson())``;
:class:`~mp_symbolic.core.ir.PlacedGraph` reads it typed). From a trace
(:class:`~mp_symbolic.core.graphcut.Cut` for a whole network,
:func:`~mp_symbolic.core.placement.trace_blocks` for a block list):

1. **assign stages**, :func:`assign_stages`: every op its stage's
   ``ctx_group``, every parameter its owner's;
2. **mirror**, :func:`mirror_stages`: the ops of chosen stages recompute their
   outputs in backward (MXNet's ``__force_mirroring__``);
3. **tie**, :func:`tie_parameters`: a variable read in another group than its
   own is read through one identity in its own (the MXNet 1.9.1 bind
   failure it avoids is pinned in ``tests/test_mxnet_traps.py``;
   :func:`label` is these three);
4. **place shards**, :func:`shard_groups`: each tensor-parallel shard in its
   stage device's group, then tied again;
5. **chunk**, :func:`replicate_chunks`: the graph on ``M`` micro-batches, one
   graph (the one-graph GPipe);
6. **finish**, :func:`finish`: parameters in their owners' groups, tied,
   copies of an op named apart, every node checked to carry a group;
7. **split**, :func:`cut`: one :class:`StageGraph` per stage, what the stage
   runtime binds.

:func:`unique_names` gives the ops of a trace names of their own (a block
called twice). MXNet reads the JSON at the edges only: to bind, to export,
to draw (:func:`~mp_symbolic.core.ir.load`).
"""
from collections import OrderedDict
from dataclasses import dataclass
import json

from .balance import CutError
from .compat import segment_boundaries
from .ir import PlacedGraph, load, op_order, variable_readers
from .names import (CHUNK_JOIN, CHUNK_SPLIT, GROUP_ATTR, IDENTITY_OP, MIRROR_ATTR, SHARD_ATTR,
                    chunk_name, is_tied, parse_group, parse_shard_mark, shard_group, stage_name,
                    tied_name)
from .tensor_parallel import device_index

__all__ = ['StageGraph', 'assign_stages', 'mirror_stages', 'tie_parameters', 'label',
           'shard_groups', 'replicate_chunks', 'finish', 'cut', 'unique_names']

# The one GPipe graph copies every op per micro-batch: building and binding it
# took 2 to 5 ms per copy here (the regression's 5 ops at 10,000 chunks: 4.5
# minutes on a loaded machine), so a graph past this many op copies is refused
# rather than built (the language model's 357 ops: up to 22 chunks).
MAX_CHUNKED_OPS = 8192


def _set_group(node, group):
    node.setdefault('attrs', {})[GROUP_ATTR] = group


def assign_stages(graph, stage_of_op, data_names=(), owners=None):
    """A copy of ``graph`` with every node's ``ctx_group`` set: each op its
    stage's; a variable its owner's (``owners``, else the stage of the first
    op that reads it); the inputs (``data_names``) and a variable no op
    reads stage 0's.

    Args:
        stage_of_op: Stage of each op in :func:`~mp_symbolic.core.ir.op_order`.
        owners: ``{variable name: stage}`` for variables whose stage the user
            chose.
    """
    graph = json.loads(json.dumps(graph))
    nodes = graph['nodes']
    order = op_order(graph)
    stage = dict(zip(order, stage_of_op))
    for i in order:
        _set_group(nodes[i], stage_name(stage[i]))
    owners = dict(owners or {})
    for var, ops in variable_readers(graph).items():
        name = nodes[var]['name']
        if name in data_names:
            _set_group(nodes[var], stage_name(0))
            continue
        _set_group(nodes[var], stage_name(owners.get(name, stage[ops[0]])))
    for node in nodes:  # a variable no op reads
        if node['op'] == 'null' and GROUP_ATTR not in node.get('attrs', {}):
            _set_group(node, stage_name(0))
    return graph


def mirror_stages(graph, stages):
    """A copy of ``graph`` whose ops of ``stages`` carry MXNet's
    ``__force_mirroring__``: the backward pass recomputes their outputs
    instead of keeping them (compute traded for activation memory)."""
    graph = json.loads(json.dumps(graph))
    stages = set(stages)
    for node in graph['nodes']:
        group = parse_group(node.get('attrs', {}).get(GROUP_ATTR))
        if node['op'] != 'null' and group is not None and group[0] in stages:
            node['attrs'][MIRROR_ATTR] = 'True'
    return graph


def label(graph, stage_of_op, data_names=(), owners=None, mirror=()):
    """A copy of ``graph`` placed by stage: :func:`assign_stages`, then
    :func:`mirror_stages` for the stages ``mirror`` names, then
    :func:`tie_parameters` (a variable read by ops of several stages read
    through one ``identity`` op in its own).

    Raises:
        CutError: an auxiliary state read by ops of two stages (it is written
            in place, it cannot be copied).
    """
    graph = assign_stages(graph, stage_of_op, data_names, owners)
    if mirror:
        graph = mirror_stages(graph, mirror)
    return tie_parameters(graph, CutError)


def tie_parameters(graph, error=ValueError):
    """A copy of ``graph`` (JSON) where every variable read by ops of a
    ``ctx_group`` other than its own is read by those ops through one
    ``identity`` op (``<variable>_tied``) in the variable's group. Variables
    without a group are left as they are.

    **What MXNet does.** A variable read by ops of two groups gets the sum of
    its gradients (``sum_grad``) on one reader's device, and the bind then
    fails to save it to the variable's ("Trying to save gradient to cpu(0)
    while its source node sum_grad computes it on cpu(1)"). **Why it
    matters.** A tied weight is read by the stages of its readers; a
    tensor-parallel layer's input by every shard. **What is done instead.**
    The readers read one identity op in the variable's group: the sum over
    the uses is that op's gradient and lands on the owner's device
    (:func:`~mp_symbolic.core.compat.read_in_own_group` does the same while
    a graph is traced).

    Args:
        graph: The graph's JSON (``json.loads(symbol.tojson())``); not changed.
        error: The exception class to raise.

    Raises:
        error: an auxiliary state read by ops of two groups (written in
            place, it cannot be read through a copy).
    """
    graph = json.loads(json.dumps(graph))
    nodes = graph['nodes']
    foreign = {}
    for i, node in enumerate(nodes):
        for k, (src, _, version) in enumerate(node['inputs']):
            if nodes[src]['op'] != 'null':
                continue
            own = nodes[src].get('attrs', {}).get(GROUP_ATTR)
            if own is not None and node.get('attrs', {}).get(GROUP_ATTR) != own:
                if version:
                    raise error('auxiliary state %s is read by ops of %s and %s; expected '
                                'each auxiliary state in one stage'
                                % (nodes[src]['name'], own, node['attrs'][GROUP_ATTR]))
                foreign.setdefault(src, []).append((i, k))
    if not foreign:
        return graph
    # Rebuild the node list with each identity right after its variable.
    redirect = {(i, k) for uses in foreign.values() for i, k in uses}
    new_nodes, new_index, identity_of = [], {}, {}
    for i, node in enumerate(nodes):
        node['inputs'] = [[identity_of[src], 0, 0] if (i, k) in redirect
                          else [new_index[src], idx, v]
                          for k, (src, idx, v) in enumerate(node['inputs'])]
        new_index[i] = len(new_nodes)
        new_nodes.append(node)
        if i in foreign:
            identity_of[i] = len(new_nodes)
            new_nodes.append({'op': IDENTITY_OP, 'name': tied_name(node['name']),
                              'attrs': {GROUP_ATTR: node['attrs'][GROUP_ATTR]},
                              'inputs': [[new_index[i], 0, 0]]})
    graph['nodes'] = new_nodes
    graph['heads'] = [[new_index[src], idx, v] for src, idx, v in graph['heads']]
    return graph


def shard_groups(graph, widths):
    """A copy of a labelled graph (JSON, every node in a ``stage<s>`` group)
    with each node tagged by :func:`~mp_symbolic.core.tensor_parallel.mark_shards`
    in its shard's group, for stages of ``widths[s]`` devices. A layer call's
    shards all go to the stage of its first op (a cut in topological order
    could otherwise put shard 0 and shard 1 of one layer on two stages). An
    ``identity`` through which other stages read a moved weight
    (``<weight>_tied``) moves with it.

    Raises:
        ValueError: a stage of several devices, but not as many as the
            shards of a layer with ops in it.
    """
    graph = json.loads(json.dumps(graph))
    stage_of = {stage_name(s): s for s in range(len(widths))}
    stage_of_layer = {}
    for node in graph['nodes']:  # in topological order
        mark = node.get('attrs', {}).get(SHARD_ATTR)
        if mark is not None and node['op'] != 'null':
            stage_of_layer.setdefault(parse_shard_mark(mark)[2],
                                      stage_of[node['attrs'][GROUP_ATTR]])
    moved = {}
    for i, node in enumerate(graph['nodes']):
        attrs = node.get('attrs', {})
        if SHARD_ATTR not in attrs:
            continue
        shard, shards, layer = parse_shard_mark(attrs[SHARD_ATTR])
        stage = stage_of_layer.get(layer, stage_of[attrs[GROUP_ATTR]])
        try:
            index = device_index(shard, shards, widths[stage])
        except ValueError as err:
            raise ValueError('%s in %s: %s' % (node['name'], stage_name(stage), err)) from None
        attrs[GROUP_ATTR] = moved[i] = shard_group(stage, index)
    for node in graph['nodes']:
        if is_tied(node['name']) and len(node['inputs']) == 1 and \
                node['inputs'][0][0] in moved:
            node['attrs'][GROUP_ATTR] = moved[node['inputs'][0][0]]
    return graph


def replicate_chunks(graph, data_name, chunks, last_stage, axis=0):
    """``graph`` run on ``chunks`` micro-batches of its inputs: each input
    split along the batch axis in its own stage (``chunk``; ``chunk_<name>``
    for several inputs), every op copied per chunk (copies after the first
    named ``<op>_chunk<m>``), every variable shared, each output's chunks
    joined in ``last_stage`` (``join``; ``join<k>`` for several outputs), each
    but the last through a segment boundary when there are several stages
    (:func:`mp_symbolic.core.compat.segment_boundaries`).

    Args:
        data_name: The input variable, or the names of several.
        axis: The batch axis of every input and output, where they are split
            and joined.

    Raises:
        CutError: an input is not a variable of the graph.
    """
    if chunks == 1:
        return json.loads(json.dumps(graph))
    names = (data_name,) if isinstance(data_name, str) else tuple(data_name)
    nodes = graph['nodes']
    ops = sum(1 for n in nodes if n['op'] != 'null')
    if ops * chunks > MAX_CHUNKED_OPS:
        raise CutError("chunks: expected at most %d micro-batches of this graph's %d ops in one "
                       'graph (ops x chunks at most %d), found %d; the stage runtime '
                       "(schedule='1f1b') runs micro-batches one after another in graphs of "
                       'one micro-batch' % (MAX_CHUNKED_OPS // ops, ops, MAX_CHUNKED_OPS, chunks))
    inputs = {}
    for name in names:
        found = [i for i, n in enumerate(nodes) if n['op'] == 'null' and n['name'] == name]
        if len(found) != 1:
            raise CutError('chunks: expected one input variable %r, found %d' % (name, len(found)))
        inputs[found[0]] = name
    out, index = [], {}
    for i, node in enumerate(nodes):
        if node['op'] == 'null':
            index[(i, None)] = len(out)
            out.append(json.loads(json.dumps(node)))
    split = {}
    for i, name in inputs.items():
        split[i] = len(out)
        out.append({'op': 'split', 'name': CHUNK_SPLIT if len(names) == 1
                    else '%s_%s' % (CHUNK_SPLIT, name),
                    'attrs': {'axis': str(axis), 'num_outputs': str(chunks),
                              GROUP_ATTR: nodes[i]['attrs'][GROUP_ATTR]},
                    'inputs': [[index[(i, None)], 0, 0]]})
    heads = [[] for _ in graph['heads']]
    for m in range(chunks):
        for i, node in enumerate(nodes):
            if node['op'] == 'null':
                continue
            copy = json.loads(json.dumps(node))
            copy['name'] = chunk_name(node['name'], m)
            entries = []
            for src, idx, v in node['inputs']:
                if src in split:
                    entries.append([split[src], m, 0])
                elif nodes[src]['op'] == 'null':
                    entries.append([index[(src, None)], idx, v])
                else:
                    entries.append([index[(src, m)], idx, v])
            copy['inputs'] = entries
            index[(i, m)] = len(out)
            out.append(copy)
        for k, (src, idx, v) in enumerate(graph['heads']):
            if src in split:
                heads[k].append([split[src], m, 0])
            elif nodes[src]['op'] == 'null':
                heads[k].append([index[(src, None)], idx, v])
            else:
                heads[k].append([index[(src, m)], idx, v])
    joined = []
    for k, parts in enumerate(heads):
        if last_stage > 0:
            copies, parts = segment_boundaries(parts, stage_name(last_stage), len(out),
                                               '' if len(heads) == 1 else '%d_' % k)
            out += copies
        out.append({'op': 'Concat', 'name': CHUNK_JOIN if len(heads) == 1
                    else '%s%d' % (CHUNK_JOIN, k),
                    'attrs': {'dim': str(axis), 'num_args': str(chunks),
                              GROUP_ATTR: stage_name(last_stage)},
                    'inputs': parts})
        joined.append([len(out) - 1, 0, 0])
    return {'nodes': out, 'heads': joined, 'attrs': graph['attrs']}


def finish(symbol, placement):
    """``symbol`` (a Symbol) with every parameter in its owner's group (its
    shard's, for a tensor-parallel one: ``placement.owner``,
    ``placement.shard_of``) and read through :func:`tie_parameters` where
    others read it; copies of an op (micro-batches) named apart
    (:func:`~mp_symbolic.core.names.chunk_name`); every node checked to
    carry a group of ``placement``'s plan. A Symbol again."""
    graph = json.loads(symbol.tojson())
    owner, shard_of = placement.owner, placement.shard_of
    for node in graph['nodes']:
        if node['op'] == 'null' and node['name'] in owner:
            node['attrs'][GROUP_ATTR] = shard_group(owner[node['name']],
                                                    shard_of.get(node['name'], 0))
    tied = tie_parameters(graph, CutError)
    if tied != json.loads(symbol.tojson()):
        symbol, graph = load(tied), tied
    groups = set(placement.plan.group2ctx)
    seen = {}
    for node in graph['nodes']:
        group = node.get('attrs', {}).get(GROUP_ATTR)
        if group not in groups:  # an internal invariant: every node is built in a scope
            raise AssertionError('node %s has ctx_group %r, expected one of %s'
                                 % (node['name'], group, sorted(groups)))
        if node['op'] != 'null':
            count = seen.get(node['name'], 0)
            seen[node['name']] = count + 1
            if count:
                node['name'] = chunk_name(node['name'], count)
    if not any(count > 1 for count in seen.values()):
        return symbol
    return load(graph)


@dataclass(frozen=True)
class StageGraph:
    """One stage's part of the training graph.

    Attributes:
        stage: Its index.
        symbol: The sub-graph; its outputs are ``heads`` then ``sends``.
        heads: ``[(k, output)]``: the whole graph's output ``k`` is this
            sub-graph's output ``output``.
        sends: Outputs read by later stages: ``[(entry, output)]``, ``entry``
            the ``(node, index)`` of the whole graph.
        receives: ``[(variable, producer stage, entry)]``: inputs that are
            another stage's outputs.
        inputs: The data and label variables this stage reads.
    """
    stage: int
    symbol: object
    heads: tuple
    sends: tuple
    receives: tuple
    inputs: tuple


def cut(symbol, num_stages, input_names):
    """``symbol`` (every node tagged with its stage's ``ctx_group``) as one
    :class:`StageGraph` per stage.

    Args:
        input_names: The data and label variables: each stage that reads
            one gets it as an input of its own.

    Raises:
        CutError: a stage reads an output of a later stage, or a parameter is
            read by two stages (the Pipeline reads a tied weight through an
            identity op in its owner's stage, so neither happens on its graphs).
    """
    placed = PlacedGraph.from_symbol(symbol, input_names)
    stage_of = {n.index: n.stage for n in placed.ops}
    readers, param_readers = {}, {}
    for node in placed.ops:
        for src, k in node.inputs:
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
    for src, _ in placed.heads:
        if src not in stage_of:
            raise CutError('schedule: expected the graph\'s outputs computed by a stage, found '
                           'variable %s' % placed.nodes[src].name)
    graph = placed.to_json()
    return [_stage_graph(graph, s, stage_of, readers, input_names) for s in range(num_stages)]


def _stage_graph(graph, s, stage_of, readers, input_names):
    nodes = graph['nodes']
    out, index, received = [], {}, OrderedDict()
    inputs = []
    for i, node in enumerate(nodes):
        if stage_of.get(i) != s:
            continue
        entries = []
        for src, k, v in node['inputs']:
            if nodes[src]['op'] == 'null':
                if src not in index:
                    var = json.loads(json.dumps(nodes[src]))
                    if var['name'] in input_names:  # the data or label, read here
                        var.setdefault('attrs', {})[GROUP_ATTR] = stage_name(s)
                        inputs.append(var['name'])
                    index[src] = len(out)
                    out.append(var)
                entries.append([index[src], k, v])
            elif stage_of[src] == s:
                entries.append([index[src], k, v])
            else:
                if (src, k) not in received:
                    name = '%s_output%d_to_stage%d' % (nodes[src]['name'], k, s)
                    received[(src, k)] = (len(out), name)
                    out.append({'op': 'null', 'name': name, 'inputs': [],
                                'attrs': {GROUP_ATTR: stage_name(s)}})
                entries.append([received[(src, k)][0], 0, 0])
        copy = json.loads(json.dumps(node))
        copy['inputs'] = entries
        index[i] = len(out)
        out.append(copy)
    heads, own = [], []
    for k, (src, idx, v) in enumerate(graph['heads']):
        if stage_of[src] == s:
            own.append((k, len(heads)))
            heads.append([index[src], idx, v])
    sends = []
    for (src, idx) in sorted(e for e in readers if stage_of[e[0]] == s):
        sends.append(((src, idx), len(heads)))
        heads.append([index[src], idx, 0])
    receives = tuple((name, stage_of[src], (src, k)) for (src, k), (_, name) in received.items())
    # a received tensor (a variable here) that ops of another group read, the
    # shards of a tensor-parallel layer, is read through an identity in its own
    symbol = load(tie_parameters({'nodes': out, 'heads': heads, 'attrs': graph.get('attrs', {})},
                                 CutError)) if heads else None
    return StageGraph(s, symbol, tuple(own), tuple(sends), receives, tuple(inputs))


def unique_names(graph):
    """A copy of ``graph`` whose op names are unique (a block called twice in
    one network makes two ops of one name): later ones get ``_<k>``."""
    graph = json.loads(json.dumps(graph))
    seen = {n['name'] for n in graph['nodes'] if n['op'] == 'null'}
    for node in graph['nodes']:
        if node['op'] == 'null':
            continue
        name, k = node['name'], 1
        while name in seen:
            name = '%s_%d' % (node['name'], k)
            k += 1
        node['name'] = name
        seen.add(name)
    return graph
