"""Tensor parallelism for a network of Gluon's own layers (after DeepSpeed's
AutoTP): its ``Dense`` and ``Embedding`` children swapped, in place, for
the layers of :mod:`~mp_symbolic.core.parallel.tensor_parallel`, keeping
their parameter names and values.

* ``'auto'`` finds each MLP and self-attention in the traced graph and
  shards it Megatron-LM's way: column, per shard (or by heads,
  :class:`HeadParallel`), then row: one sum at the block's end.
* A plan ``{pattern: 'column' | 'row' | 'vocab' | 'replicate'}``: the
  first ``fnmatch`` pattern over a layer's name or its parameters' names
  decides.

docs/tensor-parallel.md shows both forms.
"""
import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import partial
import re

import mxnet as mx
from mxnet import gluon

from ..graph import nesting
from . import tensor_parallel
from ..transport.comm import gather_from_shards, reduce_from_shards
from ..placement.balance import even_split
from ..base.checks import excerpt
from ..base.compat import fresh_variables, initialized, read_in_own_group
from ..placement.devices import DeviceSpecError, resolve_devices
from ..graph.ir import PlacedGraph
from .tensor_parallel import (ColumnParallelDense, PerShard, RowParallelDense,
                              VocabParallelEmbedding, ShardedBlock)

__all__ = []



@dataclass(frozen=True)
class Kind:
    """How a plan's kind takes the layers its pattern names.

    Attributes:
        layers: The layer types it takes (``ATTENTION``: an attention block,
            :meth:`_Pass._attention`); empty: any layer.
        expected: What the refusal of another layer says it expects.
        axis: The weight axis that must divide into the shards, or ``None``.
        divides, unit: The refusal's words for that axis.
        take: The :class:`_Pass` method that takes a layer in the plan's
            first round (``(pass, block, columns)``), or ``None``.
    """
    layers: tuple
    expected: str = ''
    axis: int = None
    divides: str = ''
    unit: str = ''
    take: str = None


ATTENTION = 'attention'
# the plan's kinds: what each takes, and what it does with it
PLAN_KINDS = OrderedDict([
    ('column', Kind((gluon.nn.Dense, ATTENTION), 'a Dense layer or an attention block (query, '
                    'key and value, a head count) for column', 0, 'units that divide', 'units',
                    '_take_column')),
    ('row', Kind((gluon.nn.Dense,), 'a Dense layer for row', 1, 'input units that divide',
                 'input units')),
    ('vocab', Kind((gluon.nn.Embedding,), 'an Embedding for vocab', 0,
                   'a vocabulary that divides', 'rows', '_take_vocab')),
    ('replicate', Kind((), take='_take_replicate')),
])
KINDS = tuple(PLAN_KINDS)

# ops that act on each element alone (or on two arrays of one shape): run on a
# shard's units they give that shard's part of the result
ELEMENTWISE = frozenset([
    'Activation', 'LeakyReLU', 'relu', 'sigmoid', 'tanh', 'erf', 'exp', 'log', 'softsign',
    'Dropout', 'identity', '_copy', 'Cast', 'clip', 'square', 'sqrt', 'negative', 'abs',
    '_mul_scalar', '_plus_scalar', '_minus_scalar', '_rminus_scalar', '_div_scalar',
    '_rdiv_scalar', '_power_scalar', '_rpower_scalar', '_maximum_scalar', '_minimum_scalar',
    'elemwise_mul', 'elemwise_add', 'elemwise_sub', 'elemwise_div', '_mul', '_plus', '_add',
    '_sub', '_minus', '_div', '_power', '_maximum', '_minimum'])
HEAD_ATTRS = ('_num_heads', 'num_heads', '_heads', 'heads', 'n_head', 'num_attention_heads')
HEAD_DIM_ATTRS = ('head_dim', '_head_dim')
UNIT_ATTRS = ('units', '_units', '_query_units', '_key_units', '_value_units')
_ROLE = re.compile(r'(?:^|_)(q|k|v|query|key|value)(?:_|$)')
_OUT = re.compile(r'(?:^|_)(proj|out|o|dense|output)(?:_|$)')


@dataclass
class Sharding:
    """What the pass did, layer by layer (``print(pipe)`` shows it).

    Attributes:
        mode: ``'auto'`` or ``'plan'``.
        shards: Parts of each sharded layer (the devices of a stage).
        entries: ``(layer name, what)``, in the network's order.
    """
    mode: str
    shards: int
    entries: list = field(default_factory=list)

    def lines(self):
        """The report: a heading, then one line per layer."""
        head = 'tensor parallel (%s, %d shard%s):' % (self.mode, self.shards,
                                                      '' if self.shards == 1 else 's')
        return [head] + ['  %s: %s' % entry for entry in self.entries]


# -- one dense layer as a function, for a block's own code run per shard ------

def _fc(F, x, weight, bias, units, flatten, act, name):
    y = F.FullyConnected(x, weight, bias, no_bias=bias is None, num_hidden=units,
                         flatten=flatten, name=name)
    return y if act is None else F.Activation(y, act_type=act, name=name + '_' + act)


def _act(dense):
    act = getattr(dense, 'act', None)
    return None if act is None else act._act_type  # pylint: disable=protected-access


class HeadParallel(ShardedBlock):
    """An attention block of the user's run once per shard on that shard's heads:
    its query, key and value weights split by whole heads, its head count and
    widths the shard's, its own ``hybrid_forward`` unchanged.
    ``combine='concat'``: the first output stays in parts for the row layer
    after it, any other is joined on axis 1. ``combine='sum'``: the block
    holds its row-parallel output projection and the shards' outputs are
    summed.

    Args:
        block: The user's block (its parameters move here).
        shards: Parts.
        heads: Its head count (a multiple of ``shards``).
        columns: ``[(attribute, Parameter or Dense)]``: the query, key and
            value weights.
        row: ``(attribute, Dense)``: the output projection inside the block,
            or ``None``.
        combine: ``'concat'`` or ``'sum'``.
    """

    def __init__(self, block, shards, heads, columns, row=None, combine='concat'):
        super().__init__(shards, prefix=block.prefix)
        object.__setattr__(self, '_user', block)   # not a child: its parameters are here
        self.heads, self._combine_by = heads, combine
        # plain values, not the Dense layers (they leave the network)
        self._columns = []   # (attribute, dense?, units, keys, flatten, activation)
        for attr, source in columns:
            dense = isinstance(source, gluon.nn.Dense)
            weight = source.weight if dense else source
            keys = [self._key(p) for p in ((source.weight, source.bias) if dense else (source,))
                    if p is not None]
            for param in [p for p in ((source.weight, source.bias) if dense else (source,))
                          if p is not None]:
                self.add_param(self._key(param), param.shape, 0,
                               even_split(param.shape[0], shards), init=param.init,
                               dtype=param.dtype, allow_deferred_init=True)
            self._columns.append((attr, dense, weight.shape[0], keys,
                                  source._flatten if dense else False,  # pylint: disable=protected-access
                                  _act(source) if dense else None))
        self._row = None     # (attribute, weight key, bias key, units, flatten, activation)
        if row is not None:
            attr, dense = row
            self.add_param(self._key(dense.weight), dense.weight.shape, 1,
                           even_split(dense.weight.shape[1], shards), init=dense.weight.init,
                           dtype=dense.weight.dtype, allow_deferred_init=True)
            if dense.bias is not None:
                self.add_param(self._key(dense.bias), dense.bias.shape, None,
                               init=dense.bias.init, dtype=dense.bias.dtype,
                               allow_deferred_init=True)
            self._row = (attr, self._key(dense.weight),
                         None if dense.bias is None else self._key(dense.bias),
                         dense.weight.shape[0], dense._flatten, _act(dense))  # pylint: disable=protected-access
        self._attrs = {a: getattr(block, a) for a in HEAD_ATTRS + UNIT_ATTRS
                       if isinstance(getattr(block, a, None), int)
                       and not isinstance(getattr(block, a), bool)}

    def _key(self, param):
        return param.name[len(self.prefix):]

    def _view(self, F, params, part):
        """The user's block as shard ``part`` sees it (``None``: whole), its dense
        children functions of ``params``: a shallow copy; the user's block is
        unchanged."""
        view = copy.copy(self._user)
        shadow = partial(object.__setattr__, view)
        scale = 1 if part is None else self.shards
        for attr, value in self._attrs.items():
            # the head count and the query/key/value widths, as the shard has them
            if (attr in HEAD_ATTRS and value == self.heads) or \
                    (attr in UNIT_ATTRS and value in (c[2] for c in self._columns)):
                shadow(attr, value // scale)
        kwargs = {}
        tag = '' if part is None else 'shard%d_' % part
        for attr, dense, units, keys, flatten, act in self._columns:
            if dense:
                shadow(attr, partial(
                    _fc, F, weight=params[keys[0]], bias=params[keys[1]] if len(keys) > 1 else None,
                    units=units // scale, flatten=flatten, act=act, name=tag + attr))
            else:
                kwargs[attr] = params[keys[0]]
        if self._row is not None:
            attr, weight, bias, units, flatten, act = self._row
            # shard 0 holds the bias; the activation follows the sum (in combine)
            shadow(attr, partial(_fc, F, weight=params[weight],
                                 bias=None if bias is None else params.get(bias),
                                 units=units, flatten=flatten,
                                 act=act if part is None else None, name=tag + attr))
        return view, kwargs

    def prepare(self, F, *x):  # pylint: disable=arguments-differ
        if F is mx.sym and self.shards > 1:
            # every shard's group reads the inputs: a variable, through an op of its own
            x = tuple(read_in_own_group(F, v, 'input%d' % j) for j, v in enumerate(x))
        return x if len(x) > 1 else x[0]

    def shard_forward(self, F, i, *x, **params):  # pylint: disable=arguments-differ
        view, kwargs = self._view(F, params, i if self.shards > 1 else None)
        return view.hybrid_forward(F, *x, **kwargs)

    def unsplit_forward(self, F, *x, **params):  # pylint: disable=arguments-differ
        view, kwargs = self._view(F, params, None)
        return view.hybrid_forward(F, *x, **kwargs)

    def combine(self, F, parts, *x):
        if self.shards == 1:
            return parts[0]
        if self._combine_by == 'sum':
            y = reduce_from_shards(F, parts)
            act = self._row[5]
            return y if act is None else F.Activation(y, act_type=act)
        if not isinstance(parts[0], (list, tuple)):
            return gather_from_shards(F, parts, False)
        outs = [gather_from_shards(F, [p[0] for p in parts], False)]
        for j in range(1, len(parts[0])):
            outs.append(gather_from_shards(F, [p[j] for p in parts], axis=1))
        return type(parts[0])(outs) if isinstance(parts[0], tuple) else outs

    def __repr__(self):
        return '%s(%s, %d heads, %d shards)' % (type(self).__name__, type(self._user).__name__,
                                                self.heads, self.shards)


# -- the block tree -------------------------------------------------------------

def _walk(block, parent=None, key=None):
    """``(parent, key, block)`` of ``block`` and every block under it, in order."""
    yield parent, key, block
    for name, child in block._children.items():  # pylint: disable=protected-access
        yield from _walk(child, block, name)


def _swap(parent, key, old, new):
    """``parent``'s child ``key`` replaced by ``new``, and every attribute that
    held it (through Gluon's ``setattr``, the old attribute deleted first)."""
    parent._children[key] = new  # pylint: disable=protected-access
    for attr, value in list(vars(parent).items()):
        if value is old:
            delattr(parent, attr)
            setattr(parent, attr, new)
        elif isinstance(value, (list, tuple)) and any(v is old for v in value):
            setattr(parent, attr, type(value)(new if v is old else v for v in value))
    parent._clear_cached_op()  # pylint: disable=protected-access


def _carry_values(old_params, new_block):
    """The old layer's values split into the new layer's shards, on the old
    layer's devices (none where it was not initialised)."""
    values = {p.name: p.data(p.list_ctx()[0]) for p in old_params if initialized(p)}
    if not values:
        return
    ctx = next(p.list_ctx() for p in old_params if initialized(p))
    shards = tensor_parallel.split_params(values, new_block.sharded)
    for param in new_block.collect_params().values():
        if param.name in shards:
            param.initialize(ctx=ctx, default_init=mx.init.Zero())
            param.set_data(shards[param.name].astype(param.dtype))


# -- the traced graph -------------------------------------------------------------

class _Graph:
    """The network's traced graph: which op feeds which, and which block wrote
    each op (the longest prefix of its name)."""

    def __init__(self, blocks, names):
        with fresh_variables(blocks):
            out = blocks[0](*nesting.map_names(mx.sym.var, names))
            for block in blocks[1:]:
                out = block(out)
            symbol = mx.sym.Group(nesting.flatten(out)[0]) if isinstance(out, (list, tuple)) \
                else out
        graph = PlacedGraph.from_symbol(symbol)
        self.nodes = graph.nodes
        self.consumers = [[] for _ in self.nodes]
        for node in self.nodes:
            for src, _, _ in node.inputs:
                self.consumers[src].append(node.index)
        for src, _, _ in graph.heads:
            self.consumers[src].append(-1)
        self.tree = [(p, k, b) for top in blocks for p, k, b in _walk(top)]
        by_prefix = sorted(((b.prefix, b) for _, _, b in self.tree), key=lambda e: -len(e[0]))
        self.writer = [None if n.is_variable else
                       next((b for p, b in by_prefix if n.name.startswith(p)), None)
                       for n in self.nodes]
        weights = {b.weight.name: b for _, _, b in self.tree
                   if isinstance(b, (gluon.nn.Dense, gluon.nn.Embedding))}
        self.fc_of = {}    # Dense -> its FullyConnected node (its first use)
        for node in graph.ops:
            if node.op in ('FullyConnected', 'Embedding') and len(node.inputs) > 1:
                layer = weights.get(graph.source(node.inputs[1]).name)
                if layer is not None:
                    self.fc_of.setdefault(layer, node.index)

    def data_input(self, i):
        return self.nodes[i].inputs[0].node

    def between(self, a):
        """``(S, b)``: the element-wise ops ``S`` from node ``a`` to the next
        dense node ``b`` that reads them, each read only there, or ``None``."""
        members, frontier = set(), [a]
        while frontier:
            i = frontier.pop()
            for c in self.consumers[i]:
                if c == -1:
                    return None
                op = self.nodes[c].op
                if op == 'FullyConnected':
                    if self.data_input(c) != i:
                        return None
                    continue
                if c in members:
                    continue
                if op not in ELEMENTWISE:
                    return None
                members.add(c)
                frontier.append(c)
        readers = {c for i in members | {a} for c in self.consumers[i]} - members
        if len(readers) != 1:
            return None
        b = readers.pop()
        for i in members:
            # nothing from outside the chain (a weight, another branch) joins it
            if any(s not in members and s != a for s, _, _ in self.nodes[i].inputs):
                return None
        return members, b

    def ops_of(self, block):
        return {i for i, w in enumerate(self.writer) if w is block}


def _descendants(block):
    return {id(b) for _, _, b in _walk(block)}


def _has_params(block):
    return len(block.collect_params().keys()) > 0


# -- the pass ---------------------------------------------------------------------

def shards_of(devices):
    """The shard count for ``devices``: the device count of its stages of
    several devices, or 1; raises DeviceSpecError where they differ."""
    counts = sorted({len(d) if isinstance(d, (list, tuple)) else 1
                     for d in resolve_devices(devices)} - {1})
    if len(counts) > 1:
        raise DeviceSpecError('tensor_parallel: expected stages of one device count to shard '
                              'over, found stages of %s devices'
                              % ' and '.join(str(c) for c in counts))
    return counts[0] if counts else 1


def check_spec(spec):
    """``spec`` if it is ``'auto'`` or a dict of pattern -> kind; raises
    ValueError otherwise."""
    if spec == 'auto':
        return spec
    if not isinstance(spec, dict) or not spec:
        raise ValueError("tensor_parallel: expected 'auto' or a dict {pattern: 'column' | 'row' "
                         "| 'vocab' | 'replicate'}, found %s" % excerpt(repr(spec)))
    for pattern, kind in spec.items():
        if not isinstance(pattern, str) or kind not in KINDS:
            raise ValueError("tensor_parallel[%r]: expected 'column', 'row', 'vocab' or "
                             "'replicate', found %s" % (pattern, excerpt(repr(kind))))
    return spec


def apply(blocks, spec, devices, names):
    """Shards ``blocks`` (their parameter shapes known) for ``devices``.

    Args:
        blocks: The blocks (one whole network, or a block list in order).
        spec: ``'auto'`` or a plan.
        devices: As :class:`~mp_symbolic.Pipeline` takes them.
        names: The positional inputs as nested names.

    Returns:
        ``(blocks, Sharding)``: the blocks (a top-level layer may be swapped)
        and what was done.

    Raises:
        ValueError: a plan that cannot hold, naming the layer, its shapes and
            the shard count.
    """
    spec = check_spec(spec)
    shards = shards_of(devices)
    report = Sharding('auto' if spec == 'auto' else 'plan', shards)
    blocks = list(blocks)
    if shards == 1:
        report.entries.append(('all layers', 'whole: every stage has one device'))
        return blocks, report
    unknown = [p.name for b in blocks for p in b.collect_params().values()
               if p.shape is None or not all(p.shape)]
    if unknown:
        raise ValueError('sample: expected a batch or its shape to shard a network whose '
                         'parameter shapes are not known yet (%s), found none'
                         % excerpt(', '.join(unknown)))
    graph = _Graph(blocks, names)
    pass_ = _Pass(graph, shards, report, blocks)
    if spec == 'auto':
        pass_.auto()
    else:
        pass_.plan(spec)
    return pass_.blocks, report


class _Pass:
    """One sharding of one network: decisions first, swaps last."""

    def __init__(self, graph, shards, report, blocks):
        self.graph, self.shards, self.report, self.blocks = graph, shards, report, blocks
        self.taken = {}       # id(layer) -> its decision text
        self.swaps = []       # (old block, new block)
        self.parent = {id(b): (p, k) for p, k, b in graph.tree}
        self.order = {id(b): i for i, (_, _, b) in enumerate(graph.tree)}

    def _shared(self, block):
        """``(parameter, other block)`` of a parameter of ``block`` that
        another layer of the network also holds (tied weights), or ``None``."""
        own = {id(p): p for p in block.collect_params().values()}
        inside = _descendants(block)
        for _, _, other in self.graph.tree:
            if id(other) in inside:
                continue
            for param in other._reg_params.values():  # pylint: disable=protected-access
                if id(param) in own:
                    return param.name, other.name
        return None

    # -- attention ------------------------------------------------------------

    def _attention(self, block):
        """``(heads, columns, row, combine)`` of an attention block, or a
        reason (str) it is not one."""
        columns, role_of = [], {}
        for attr, param in block._reg_params.items():  # pylint: disable=protected-access
            match = _ROLE.search(attr)
            if match and attr.endswith('weight'):
                role_of.setdefault(match.group(1)[0], []).append((attr, param))
        denses = [(k, c) for k, c in block._children.items()  # pylint: disable=protected-access
                  if isinstance(c, gluon.nn.Dense)]
        for key, child in denses:
            match = _ROLE.search(key)
            if match:
                role_of.setdefault(match.group(1)[0], []).append((key, child))
        if sorted(role_of) != ['k', 'q', 'v'] or any(len(v) != 1 for v in role_of.values()):
            return None
        columns = [role_of[r][0] for r in 'qkv']
        # an own bias follows its weight
        for attr, param in block._reg_params.items():  # pylint: disable=protected-access
            match = _ROLE.search(attr)
            if match and attr.endswith('bias'):
                columns.append((attr, param))
        used = {id(s) for _, s in columns}
        others = [p for a, p in block._reg_params.items() if id(p) not in used]  # pylint: disable=protected-access
        if others:
            return 'not sharded: parameters besides its query, key and value (%s)' % \
                ', '.join(p.name for p in others)
        outs = [(k, c) for k, c in denses if id(c) not in used and _OUT.search(k)]
        rest = [c for k, c in block._children.items()  # pylint: disable=protected-access
                if id(c) not in used and (not outs or c is not outs[0][1]) and _has_params(c)]
        if rest or len(outs) > 1:
            return 'not sharded: layers with parameters besides its projections (%s)' % \
                ', '.join(c.name for c in rest + [c for _, c in outs[1:]])
        units = [(s.weight if isinstance(s, gluon.nn.Dense) else s).shape[0]
                 for _, s in columns[:3]]
        heads = next((getattr(block, a) for a in HEAD_ATTRS
                      if isinstance(getattr(block, a, None), int)), None)
        if heads is None:
            dims = [getattr(v, a) for v in [block] + list(vars(block).values())
                    for a in HEAD_DIM_ATTRS if isinstance(getattr(v, a, None), int)]
            if dims and units[0] % dims[0] == 0:
                heads = units[0] // dims[0]
        if heads is None:
            return 'not sharded: no head count found (an attribute num_heads or head_dim)'
        if heads % self.shards or any(u % heads for u in units):
            return ('not sharded: %d heads (query, key, value widths %s) do not divide into %d '
                    'shards' % (heads, '/'.join(map(str, units)), self.shards))
        if outs:
            return heads, columns, outs[0], 'sum'
        return heads, columns, None, 'concat'

    def _reader_dense(self, block):
        """The ``Dense`` outside ``block`` whose input is written by ``block``."""
        inside = _descendants(block)
        for layer, i in self.graph.fc_of.items():
            if id(layer) in inside or not isinstance(layer, gluon.nn.Dense):
                continue
            writer = self.graph.writer[self.graph.data_input(i)]
            if writer is not None and id(writer) in inside:
                return layer
        return None

    def _shard_attention(self, block, found, why='by heads'):
        heads, columns, row, combine = found
        new = HeadParallel(block, self.shards, heads, columns, row, combine)
        params = [s.weight if isinstance(s, gluon.nn.Dense) else s for _, s in columns] + \
            [s.bias for _, s in columns if isinstance(s, gluon.nn.Dense) and s.bias is not None]
        if row is not None:
            params += [p for p in (row[1].weight, row[1].bias) if p is not None]
        _carry_values(params, new)
        self.swaps.append((block, new))
        for _, source in columns:
            if isinstance(source, gluon.nn.Dense):
                self.taken[id(source)] = 'inside the attention'
        text = 'attention %s: %d heads, %d per shard, query/key/value column-parallel' % (
            why, heads, heads // self.shards)
        if row is not None:
            self.taken[id(row[1])] = 'inside the attention'
            text += ', %s row-parallel, one sum' % row[0]
        self.taken[id(block)] = text
        if combine == 'concat':
            reader = self._reader_dense(block)
            if reader is not None and id(reader) not in self.taken and not self._shared(reader):
                self._row(reader, 'row-parallel, reads the attention\'s shards (no gather)')
            else:
                self.taken[id(block)] += ' (its output gathered: no dense layer reads it ' \
                                         'directly)'

    # -- dense layers -----------------------------------------------------------

    def _divides(self, where, block, axis, expected, unit):
        """Raises ValueError unless ``block``'s weight axis ``axis`` divides into the
        shards."""
        size = block.weight.shape[axis]
        if size % self.shards:
            raise ValueError('%s: expected %s into %d shards, found %s of weight %s (%d %s)'
                             % (where, expected, self.shards, block.name, block.weight.shape,
                                size, unit))

    def _column(self, dense, why):
        self._dense(ColumnParallelDense, dense, why)

    def _row(self, dense, why):
        self._dense(RowParallelDense, dense, why)

    def _dense(self, layer, dense, why):
        """Swaps ``dense`` for a column or row ``layer`` of its sizes, activation,
        initialisers, prefix and values."""
        new = layer(dense._units, dense.weight.shape[1], self.shards,  # pylint: disable=protected-access
                    activation=_act(dense), use_bias=dense.bias is not None,
                    flatten=dense._flatten, dtype=dense.weight.dtype,  # pylint: disable=protected-access
                    weight_initializer=dense.weight.init,
                    bias_initializer=dense.bias.init if dense.bias else 'zeros',
                    prefix=dense.prefix)
        _carry_values([p for p in (dense.weight, dense.bias) if p is not None], new)
        self.swaps.append((dense, new))
        self.taken[id(dense)] = why

    def _vocab(self, embedding):
        kwargs = embedding._kwargs  # pylint: disable=protected-access
        new = VocabParallelEmbedding(kwargs['input_dim'], kwargs['output_dim'], self.shards,
                                     dtype=kwargs.get('dtype', 'float32'),
                                     weight_initializer=embedding.weight.init,
                                     prefix=embedding.prefix)
        _carry_values([embedding.weight], new)
        self.swaps.append((embedding, new))
        self.taken[id(embedding)] = 'vocabulary-parallel'

    def _per_shard_between(self, first, members):
        """The blocks that wrote the ops ``members`` between column layer ``first``
        and a row layer, each swapped for a :class:`PerShard`; a text saying so,
        or why the ops run on the gathered output."""
        inside = _descendants(first)
        writers = OrderedDict()
        for i in sorted(members):
            writer = self.graph.writer[i]
            if writer is None or id(writer) in inside:
                continue   # the column layer's own activation
            writers[id(writer)] = writer
        for writer in writers.values():
            if _has_params(writer) or id(writer) not in self.parent or \
                    not self.graph.ops_of(writer) <= members or id(first) in _descendants(writer):
                return 'gathered before the element-wise ops (they are in %s\'s own code)' % \
                    writer.name
        units = first.weight.shape[0]
        for writer in writers.values():
            new = PerShard(lambda F, x, b=writer: b(x), units, self.shards,
                           flatten=first._flatten)  # pylint: disable=protected-access
            self.swaps.append((writer, new))
            self.taken[id(writer)] = 'per shard (element-wise, between the two layers)'
        return None

    def _mlp(self, a_layer, a):
        found = self.graph.between(a)
        if found is None:
            return None
        members, b = found
        b_layer = next((l for l, i in self.graph.fc_of.items() if i == b), None)
        if not isinstance(b_layer, gluon.nn.Dense) or id(b_layer) in self.taken:
            return None
        return members, b_layer

    def auto(self):
        """Every attention, then every MLP of the layers left."""
        for _, _, block in self.graph.tree:
            if id(block) in self.taken or isinstance(block, (gluon.nn.Dense, gluon.nn.Embedding)):
                continue
            found = self._attention(block)
            if isinstance(found, str):
                self.taken[id(block)] = found
            elif found is not None and self._shared(block):
                self.taken[id(block)] = 'not sharded: %s is also held by %s' % self._shared(block)
            elif found is not None:
                self._shard_attention(block, found)
        for layer, i in sorted(self.graph.fc_of.items(), key=lambda e: e[1]):
            if id(layer) in self.taken or not isinstance(layer, gluon.nn.Dense):
                continue
            mlp = self._mlp(layer, i)
            if mlp is None:
                continue
            members, b_layer = mlp
            shared = self._shared(layer) or self._shared(b_layer)
            if shared:
                self.taken[id(layer)] = 'whole: first layer of an MLP, %s is also held by %s' \
                    % shared
                continue
            if layer.weight.shape[0] % self.shards:
                self.taken[id(layer)] = ('whole: first layer of an MLP, %d units do not divide '
                                         'into %d shards' % (layer.weight.shape[0], self.shards))
                continue
            gathered = self._per_shard_between(layer, members)
            self._column(layer, 'MLP in, column-parallel')
            self._row(b_layer, 'MLP out, row-parallel' + (
                ', ' + gathered if gathered else ', reads the shards (no gather)'))
        self._finish('whole on the stage\'s first device: not in an attention or MLP pattern')

    # -- a plan -------------------------------------------------------------------

    def plan(self, spec):
        """Each layer as the first pattern that matches it says."""
        matched = {p: 0 for p in spec}
        kind_of = OrderedDict()
        for _, _, block in self.graph.tree:
            # the layers a plan can name: dense layers, embeddings, attention blocks
            if not isinstance(block, (gluon.nn.Dense, gluon.nn.Embedding)) and \
                    self._attention(block) is None:
                continue
            names = [block.name] + [p.name for p in block._reg_params.values()]  # pylint: disable=protected-access
            for pattern, kind in spec.items():
                if any(fnmatchcase(n, pattern) for n in names):
                    matched[pattern] += 1
                    if id(block) not in kind_of:   # the first pattern decides
                        kind_of[id(block)] = (block, pattern, kind)
        unused = [p for p, n in matched.items() if not n]
        if unused:
            raise ValueError('tensor_parallel[%r]: expected a pattern that matches a layer\'s '
                             'name or parameter, found no match (layers: %s)'
                             % (unused[0], excerpt(', '.join(
                                 b.name for _, _, b in self.graph.tree
                                 if isinstance(b, (gluon.nn.Dense, gluon.nn.Embedding))))))
        columns = {}     # id -> the dense layers and attention blocks sharded in parts
        for block, pattern, kind in kind_of.values():
            where = 'tensor_parallel[%r]' % pattern
            rule = PLAN_KINDS[kind]
            shared = self._shared(block)
            if rule.layers and shared:
                raise ValueError('%s: expected a layer whose parameters are its own to shard, '
                                 'found %s sharing %s with %s' % ((where, block.name) + shared))
            self._check_kind(where, rule, block)
            if rule.take is not None:
                getattr(self, rule.take)(block, columns)
        inside = set().union(*[_descendants(b) for b in columns.values()
                               if not isinstance(b, gluon.nn.Dense)])
        for block, pattern, kind in kind_of.values():
            if kind != 'row':
                continue
            if id(block) in inside:   # an attention's own output projection: sharded with it
                continue
            source = self._sharded_source(block, columns)
            if source is None:
                i = self.graph.fc_of.get(block)
                op = '?' if i is None else self.graph.nodes[self.graph.data_input(i)]
                raise ValueError('tensor_parallel[%r]: expected the input of row layer %s (weight '
                                 '%s, %d shards) to be a column layer\'s or a sharded attention\'s '
                                 'output, found %s' % (
                                     pattern, block.name, block.weight.shape, self.shards,
                                     op if isinstance(op, str) else '%s (%s)' % (op.name,
                                                                                 op.op)))
        for block in columns.values():
            if isinstance(block, gluon.nn.Dense):
                self._column(block, 'column-parallel (plan)')
            else:
                self._shard_attention(block, self._attention(block), 'by heads (plan)')
        for block, _, kind in kind_of.values():
            if kind == 'row' and id(block) not in self.taken and id(block) not in inside:
                source, members = self._sharded_source(block, columns)
                gathered = None
                if isinstance(source, gluon.nn.Dense) and members:
                    gathered = self._per_shard_between(source, members)
                self._row(block, 'row-parallel (plan)' + (', ' + gathered if gathered else ''))
        self._finish('whole on the stage\'s first device: no pattern names it')

    def _check_kind(self, where, rule, block):
        """Raises ValueError unless ``rule`` (a :class:`Kind`) takes ``block``."""
        if not rule.layers:
            return
        if not isinstance(block, tuple(t for t in rule.layers if t != ATTENTION)):
            found = self._attention(block) if ATTENTION in rule.layers else None
            if not isinstance(found, tuple):
                raise ValueError('%s: expected %s, found %s (%s%s)'
                                 % (where, rule.expected, block.name, type(block).__name__,
                                    ': ' + found if found else ''))
            return
        if rule.axis is not None:
            self._divides(where, block, rule.axis, rule.divides, rule.unit)

    def _take_column(self, block, columns):
        columns[id(block)] = block

    def _take_vocab(self, block, columns):  # pylint: disable=unused-argument
        self._vocab(block)

    def _take_replicate(self, block, columns):  # pylint: disable=unused-argument
        self.taken[id(block)] = 'whole on the stage\'s first device (replicate)'

    def _sharded_source(self, block, columns):
        """``(column layer or attention block, element-wise ops between)`` that
        feeds row layer ``block``, or ``None``."""
        i = self.graph.fc_of.get(block)
        if i is None:
            return None
        for layer, j in self.graph.fc_of.items():
            if id(layer) in columns:
                found = self.graph.between(j)
                if found is not None and found[1] == i:
                    return layer, found[0]
        writer = self.graph.writer[self.graph.data_input(i)]
        for attention in (b for b in columns.values() if not isinstance(b, gluon.nn.Dense)):
            if writer is not None and id(writer) in _descendants(attention) and \
                    self._attention(attention)[3] == 'concat':
                return attention, set()
        return None

    # -- the swaps ----------------------------------------------------------------

    def _finish(self, whole):
        for old, new in self.swaps:
            parent, key = self.parent[id(old)]
            if parent is None:
                self.blocks = [new if b is old else b for b in self.blocks]
            else:
                _swap(parent, key, old, new)
        for _, _, block in self.graph.tree:
            # a graph a hybridized block cached still holds the layers swapped out
            if isinstance(block, gluon.HybridBlock):
                block._clear_cached_op()  # pylint: disable=protected-access
        for _, _, block in self.graph.tree:
            text = self.taken.get(id(block))
            if text is None and isinstance(block, (gluon.nn.Dense, gluon.nn.Embedding)):
                shared = self._shared(block)
                text = 'whole: %s is also held by %s' % shared if shared else whole
            if text is not None and text != 'inside the attention':
                self.report.entries.append((block.name, text))
