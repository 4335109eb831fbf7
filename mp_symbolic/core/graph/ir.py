"""The placed graph, typed: every node of a Symbol with its op, inputs, stage,
shard and role, the form the passes (:mod:`~mp_symbolic.core.graph.passes`)
take and return.

:meth:`PlacedGraph.from_json` reads MXNet's JSON into :class:`Node` values,
the trace's marks into fields never written back; :meth:`PlacedGraph.to_json`
and :meth:`PlacedGraph.to_symbol` make the JSON at the edges only (bind,
export, plots). Invariant: every walk of a graph in the library and the
export reads a :class:`PlacedGraph` (:func:`as_placed`).
"""
from collections import namedtuple
from dataclasses import dataclass, field, replace
import json
from types import MappingProxyType

from .names import BLOCK_ATTR, GATHER_ATTR, GROUP_ATTR, SHARD_ATTR, parse_group, \
    parse_shard_mark

__all__ = ['Entry', 'Node', 'PlacedGraph', 'ROLES', 'as_placed', 'load', 'make_node',
           'op_order', 'variable_readers']

# What a node is: an input (data or label) variable, a parameter, an
# auxiliary state (BatchNorm's running mean and variance: updated in place by
# its op), or an op.
ROLES = ('input', 'parameter', 'state', 'op')
_NODE_FIELDS = ('op', 'name', 'inputs', 'attrs')  # what a Node reads of MXNet's JSON node
_EMPTY = MappingProxyType({})
# The typed graphs of the Symbols read last: (symbol, inputs) -> graph. Each entry holds its
# Symbol, so its id is not reused while the entry lives; a Symbol's graph does not change.
_READ = {}
_READ_KEPT = 16


class Entry(namedtuple('Entry', 'node output version')):
    """What a node reads: output ``output`` of node ``node`` (an index);
    ``version`` is MXNet's (1 where an op writes a variable in place)."""
    __slots__ = ()


@dataclass(frozen=True)
class Node:
    """One node of a placed graph.

    Attributes:
        index: Its position in the graph.
        name: MXNet's name of the op or variable.
        op: The op's name; ``'null'`` for a variable.
        inputs: ``(Entry, ...)``: the entries it reads.
        group: Its ``ctx_group`` name, or ``None``.
        role: One of :data:`ROLES`.
        layer: ``(index, shards, layer call)`` for a tensor-parallel shard's op
            or weight, else ``None``.
        block: The index of the block that made an op of a traced block list,
            else ``None``.
        attrs: Its other MXNet attributes, read-only.
        extra: Any other field of MXNet's JSON node, kept as read.
    """
    index: int
    name: str
    op: str
    inputs: tuple
    group: object
    role: str
    layer: object = None
    block: object = None
    attrs: object = field(default_factory=lambda: _EMPTY)
    extra: object = field(default_factory=lambda: _EMPTY)

    @property
    def stage(self):
        """The pipeline stage of its group, or ``None``."""
        parsed = parse_group(self.group)
        return None if parsed is None else parsed[0]

    @property
    def shard(self):
        """The tensor-parallel shard of its stage (0 for the stage's own group), or
        ``None``."""
        parsed = parse_group(self.group)
        return None if parsed is None else parsed[1]

    @property
    def is_variable(self):
        """Whether it is a variable (an input, a parameter or a state)."""
        return self.op == 'null'

    def but(self, **changes):
        """A copy with ``changes`` (field values; ``attrs`` a dict)."""
        if 'attrs' in changes:
            changes['attrs'] = MappingProxyType(dict(changes['attrs']))
        if 'inputs' in changes:
            changes['inputs'] = tuple(Entry(*e) for e in changes['inputs'])
        return replace(self, **changes)


def make_node(index, name, op, inputs=(), group=None, role='op', attrs=None, layer=None):
    """A new :class:`Node` (``inputs`` as ``(node, output, version)``)."""
    return Node(index, name, op, tuple(Entry(*e) for e in inputs), group, role, layer=layer,
                attrs=MappingProxyType(dict(attrs or {})))


@dataclass(frozen=True)
class PlacedGraph:
    """A graph's nodes (:class:`Node`, in topological order, each at its own
    ``index``), outputs (``(Entry, ...)``) and MXNet's graph attributes."""
    nodes: tuple
    heads: tuple
    attrs: object = field(default_factory=lambda: _EMPTY)

    @classmethod
    def from_json(cls, graph, inputs=(), states=()):
        """The typed form of ``graph`` (``json.loads(symbol.tojson())``, unchanged),
        the variables of ``inputs`` ``'input'`` nodes, of ``states`` ``'state'``."""
        inputs, states = set(inputs), set(states)
        nodes = []
        for i, raw in enumerate(graph['nodes']):
            attrs = dict(raw.get('attrs', {}))
            group = attrs.pop(GROUP_ATTR, None)
            mark = attrs.pop(SHARD_ATTR, None)
            block = attrs.pop(BLOCK_ATTR, None)
            attrs.pop(GATHER_ATTR, None)  # the trace's own, read on its Symbols only
            if raw['op'] != 'null':
                role = 'op'
            else:
                role = ('input' if raw['name'] in inputs else
                        'state' if raw['name'] in states else 'parameter')
            nodes.append(Node(
                i, raw['name'], raw['op'], tuple(Entry(*e) for e in raw.get('inputs', ())),
                group, role, layer=None if mark is None else parse_shard_mark(mark),
                block=None if block is None else int(block), attrs=MappingProxyType(attrs),
                extra=MappingProxyType({k: v for k, v in raw.items() if k not in _NODE_FIELDS})))
        return cls(tuple(nodes), tuple(Entry(*h) for h in graph['heads']),
                   MappingProxyType(json.loads(json.dumps(graph.get('attrs', {})))))

    @classmethod
    def from_symbol(cls, symbol, inputs=()):
        """The typed form of ``symbol``'s graph (auxiliary states ``'state'`` nodes,
        ``inputs`` ``'input'`` nodes); the last few Symbols' graphs are kept, so
        asking again for one returns the same graph."""
        key = (id(symbol), tuple(inputs))
        kept = _READ.get(key)
        if kept is not None and kept[0] is symbol and cls is PlacedGraph:
            return kept[1]
        graph = cls.from_json(json.loads(symbol.tojson()), inputs,
                              symbol.list_auxiliary_states())
        if cls is PlacedGraph:
            if len(_READ) >= _READ_KEPT:
                del _READ[next(iter(_READ))]
            _READ[key] = (symbol, graph)
        return graph

    def but(self, nodes=None, heads=None):
        """A copy with other ``nodes`` (each at its index) or ``heads``."""
        nodes = self.nodes if nodes is None else tuple(nodes)
        if any(n.index != i for i, n in enumerate(nodes)):  # an internal invariant
            raise AssertionError('node %s listed at another index than its own'
                                 % next(n.name for i, n in enumerate(nodes) if n.index != i))
        return PlacedGraph(nodes, self.heads if heads is None else
                           tuple(Entry(*h) for h in heads), self.attrs)

    def in_mxnet_order(self):
        """The graph with its nodes in the order MXNet writes them (depth-first
        post-order from the outputs), as a round trip through a Symbol would give;
        a node no output reads is left out."""
        order, seen = [], set()
        for head in self.heads:
            stack = [(head.node, 0)]
            while stack:
                index, k = stack.pop()
                if k == 0 and index in seen:
                    continue
                node = self.nodes[index]
                deps = [e.node for e in node.inputs] + list(node.extra.get('control_deps', ()))
                if k < len(deps):
                    stack.append((index, k + 1))
                    if deps[k] not in seen:
                        stack.append((deps[k], 0))
                elif index not in seen:
                    seen.add(index)
                    order.append(index)
        if order == list(range(len(self.nodes))):
            return self
        new = {old: i for i, old in enumerate(order)}
        nodes = []
        for old in order:
            node = self.nodes[old]
            extra = node.extra
            if 'control_deps' in extra:
                extra = dict(extra, control_deps=[new[d] for d in extra['control_deps']])
            nodes.append(replace(node.but(index=new[old], inputs=[
                (new[e.node], e.output, e.version) for e in node.inputs]),
                                 extra=MappingProxyType(dict(extra))))
        return self.but(nodes, [(new[h.node], h.output, h.version) for h in self.heads])

    def compose(self, inner, inputs):
        """This graph with its variables named in ``inputs`` (``{name: output
        index}``) replaced by outputs of ``inner``, as MXNet's
        ``symbol(**kwargs)`` composes them, in MXNet's order."""
        out, moved, replaced = list(inner.nodes), {}, {}

        def entry(e):
            return replaced[e.node] if e.node in replaced else \
                (moved[e.node], e.output, e.version)

        for node in self.nodes:
            if node.is_variable and node.name in inputs:
                replaced[node.index] = tuple(inner.heads[inputs[node.name]])
                continue
            moved[node.index] = len(out)
            out.append(node.but(index=len(out), inputs=[entry(e) for e in node.inputs]))
        return PlacedGraph(tuple(out), tuple(Entry(*entry(h)) for h in self.heads),
                           self.attrs).in_mxnet_order()

    def to_json(self):
        """The graph as MXNet's JSON (a new dict); the group as ``ctx_group``, no mark
        of the trace."""
        nodes = []
        for node in self.nodes:
            attrs = dict(node.attrs)
            if node.group is not None:
                attrs[GROUP_ATTR] = node.group
            raw = {'op': node.op, 'name': node.name, 'inputs': [list(e) for e in node.inputs]}
            if attrs:
                raw['attrs'] = attrs
            raw.update(json.loads(json.dumps(dict(node.extra))))
            nodes.append(raw)
        return {'nodes': nodes, 'heads': [list(h) for h in self.heads],
                'attrs': json.loads(json.dumps(dict(self.attrs)))}

    def to_symbol(self):
        """The graph as a Symbol."""
        return load(self.to_json())

    @property
    def ops(self):
        """The op nodes, in order."""
        return tuple(n for n in self.nodes if not n.is_variable)

    @property
    def variables(self):
        """The variable nodes, in order."""
        return tuple(n for n in self.nodes if n.is_variable)

    @property
    def num_stages(self):
        """One more than the last stage any node is on (0 for none)."""
        stages = [n.stage for n in self.nodes if n.stage is not None]
        return max(stages) + 1 if stages else 0

    def ops_of_stage(self, stage):
        """The op nodes of ``stage`` (its shards' too), in order."""
        return tuple(n for n in self.ops if n.stage == stage)

    def op_indices_by_stage(self, num_stages):
        """``[[op index, ...] of stage 0, ...]`` for ``num_stages`` stages."""
        return [[n.index for n in self.ops_of_stage(s)] for s in range(num_stages)]

    def source(self, entry):
        """The node an input entry ``(node, output, ...)`` reads."""
        return self.nodes[entry[0]]

    def reader_counts(self):
        """``{node index: how many nodes read it}``."""
        counts = {}
        for node in self.nodes:
            for source in {e.node for e in node.inputs}:
                counts[source] = counts.get(source, 0) + 1
        return counts

    def upstream(self, entries):
        """The nodes the entries ``entries`` read, directly or not (theirs included),
        in index order."""
        seen, pending = set(), [e[0] for e in entries]
        while pending:
            i = pending.pop()
            if i not in seen:
                seen.add(i)
                pending.extend(e.node for e in self.nodes[i].inputs)
        return [self.nodes[i] for i in sorted(seen)]

    def output_node(self, k=0):
        """The node that computes the graph's output ``k``."""
        return self.nodes[self.heads[k].node]

    def op_order(self):
        """Indices of the op nodes in a topological order (:func:`op_order`)."""
        for node in self.nodes:
            if any(e.node >= node.index for e in node.inputs):
                raise AssertionError('node %s reads a node listed after it' % node.name)
        return [n.index for n in self.ops]

    def variable_readers(self):
        """``{variable node index: [op node indices that read it, in order]}``."""
        readers = {}
        for node in self.nodes:
            for e in node.inputs:
                if self.nodes[e.node].is_variable:
                    readers.setdefault(e.node, [])
                    if node.index not in readers[e.node]:
                        readers[e.node].append(node.index)
        return readers


def load(graph):
    """The Symbol of a JSON graph (``arg_nodes`` and ``node_row_ptr`` recomputed)."""
    from .. import kernels  # pylint: disable=import-outside-toplevel  (imports MXNet)
    graph = dict(graph)
    graph['arg_nodes'] = [i for i, n in enumerate(graph['nodes']) if n['op'] == 'null']
    graph.pop('node_row_ptr', None)
    return kernels.load_symbol_json(json.dumps(graph))


def as_placed(graph):
    """``graph`` typed: a :class:`PlacedGraph` as it is, a Symbol or MXNet's
    JSON read once (:meth:`PlacedGraph.from_symbol`, :meth:`PlacedGraph.from_json`)."""
    if isinstance(graph, PlacedGraph):
        return graph
    if hasattr(graph, 'tojson'):
        return PlacedGraph.from_symbol(graph)
    return PlacedGraph.from_json(graph)


def op_order(graph):
    """Indices of the op nodes of ``graph`` (a :class:`PlacedGraph` or its JSON)
    in a topological order (MXNet's own, checked)."""
    return as_placed(graph).op_order()


def variable_readers(graph):
    """``{variable node index: [op node indices that read it, in order]}`` of
    ``graph`` (a :class:`PlacedGraph` or its JSON)."""
    return as_placed(graph).variable_readers()
