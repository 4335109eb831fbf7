"""The placed graph, typed: every node of a Symbol with its op, inputs, stage,
shard and role, read from the graph in one place.

MXNet keeps a graph as JSON (``symbol.tojson()``): nodes with an ``op``
(``'null'`` for a variable), ``inputs`` as ``[node, output, version]`` and
string ``attrs``, where a stage lives as the ``ctx_group`` name
(:func:`~mp_symbolic.core.names.stage_name`,
:func:`~mp_symbolic.core.names.shard_group`). :class:`PlacedGraph` reads that
once into :class:`Node` values, so the stage runtime's cut, the twin, the
placement, the export, the checkpoint reader and the plots ask a node its
stage (``node.stage``) instead of each parsing ``'stage2_shard1'`` on its
own. The JSON form stays at the edges: MXNet binds it, the exporter writes
it, the plots draw it (:meth:`PlacedGraph.to_json`,
:meth:`PlacedGraph.to_symbol`).
"""
from dataclasses import dataclass
import json
from types import MappingProxyType

from .names import GROUP_ATTR, SHARD_ATTR, parse_group, parse_shard_mark

__all__ = ['Node', 'PlacedGraph', 'ROLES', 'load', 'op_order', 'variable_readers']

# What a node is: an input (data or label) variable, a parameter, an
# auxiliary state (BatchNorm's running mean and variance: updated in place by
# its op), or an op.
ROLES = ('input', 'parameter', 'state', 'op')


@dataclass(frozen=True)
class Node:
    """One node of a placed graph.

    Attributes:
        index: Its position in the graph (what other nodes' ``inputs`` name).
        name: MXNet's name of the op or variable.
        op: The op's name; ``'null'`` for a variable.
        inputs: ``((node, output), ...)``: the entries it reads.
        group: Its ``ctx_group`` name, or ``None``.
        stage: The pipeline stage that group belongs to, or ``None`` (no
            group, or one that names no stage).
        shard: The tensor-parallel shard of that stage (0 for the stage's
            own group), or ``None`` with ``stage``.
        role: One of :data:`ROLES`.
        layer: For a tensor-parallel shard's op or weight, ``(index,
            shards, layer call)`` from its mark while the graph is being
            placed; ``None`` otherwise.
        attrs: Every attribute, read-only.
    """
    index: int
    name: str
    op: str
    inputs: tuple
    group: object
    stage: object
    shard: object
    role: str
    layer: object
    attrs: object

    @property
    def is_variable(self):
        """Whether it is a variable (an input, a parameter or a state)."""
        return self.op == 'null'


@dataclass(frozen=True)
class PlacedGraph:
    """A graph's nodes (:class:`Node`, in the graph's topological order) and
    outputs (``((node, output), ...)``)."""
    nodes: tuple
    heads: tuple
    _json: object

    @classmethod
    def from_json(cls, graph, inputs=(), states=()):
        """The typed view of ``graph`` (``json.loads(symbol.tojson())``, not
        changed).

        Args:
            inputs: The names of the data and label variables.
            states: The names of the auxiliary states
                (``symbol.list_auxiliary_states()``).
        """
        inputs, states = set(inputs), set(states)
        nodes = []
        for i, raw in enumerate(graph['nodes']):
            attrs = raw.get('attrs', {})
            group = attrs.get(GROUP_ATTR)
            parsed = parse_group(group)
            mark = attrs.get(SHARD_ATTR)
            if raw['op'] != 'null':
                role = 'op'
            else:
                role = ('input' if raw['name'] in inputs else
                        'state' if raw['name'] in states else 'parameter')
            nodes.append(Node(i, raw['name'], raw['op'],
                              tuple((e[0], e[1]) for e in raw.get('inputs', ())), group,
                              None if parsed is None else parsed[0],
                              None if parsed is None else parsed[1], role,
                              None if mark is None else parse_shard_mark(mark),
                              MappingProxyType(dict(attrs))))
        return cls(tuple(nodes), tuple((h[0], h[1]) for h in graph['heads']), graph)

    @classmethod
    def from_symbol(cls, symbol, inputs=()):
        """The typed view of ``symbol``'s graph; its auxiliary states are
        ``'state'`` nodes, the variables named in ``inputs`` ``'input'`` nodes."""
        return cls.from_json(json.loads(symbol.tojson()), inputs,
                             symbol.list_auxiliary_states())

    def to_json(self):
        """A copy of the graph's JSON (MXNet's form: to bind, export or draw)."""
        return json.loads(json.dumps(self._json))

    def to_symbol(self):
        """The graph as a Symbol."""
        import mxnet as mx  # pylint: disable=import-outside-toplevel
        return mx.sym.load_json(json.dumps(self._json))

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
        """The node an input entry ``(node, output)`` reads."""
        return self.nodes[entry[0]]


def load(graph):
    """The Symbol of a JSON graph (``arg_nodes`` and ``node_row_ptr`` recomputed)."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    graph = dict(graph)
    graph['arg_nodes'] = [i for i, n in enumerate(graph['nodes']) if n['op'] == 'null']
    graph.pop('node_row_ptr', None)
    return mx.sym.load_json(json.dumps(graph))


def op_order(graph):
    """Indices of the op (non-variable) nodes in a topological order.

    MXNet writes nodes in a depth-first post-order, which is topological;
    this checks it (an input listed after its reader is an internal error).
    """
    order = []
    for i, node in enumerate(graph['nodes']):
        if any(src >= i for src, _, _ in node['inputs']):
            raise AssertionError('node %s reads a node listed after it' % node['name'])
        if node['op'] != 'null':
            order.append(i)
    return order


def variable_readers(graph):
    """``{variable node index: [op node indices that read it, in order]}``."""
    readers = {}
    for i, node in enumerate(graph['nodes']):
        for src, _, _ in node['inputs']:
            if graph['nodes'][src]['op'] == 'null':
                readers.setdefault(src, [])
                if i not in readers[src]:
                    readers[src].append(i)
    return readers
