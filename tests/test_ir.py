"""The typed placed graph (:class:`mp_symbolic.core.graph.ir.PlacedGraph`): each
node's stage, shard and role are what the placement decided, for block lists
and whole networks, with tensor-parallel shards, tied weights and BatchNorm
states; the stage runtime's cut, the twin and the export read them from it."""
import io
import json
import os
import tokenize

import mxnet as mx
from mxnet import gluon
import pytest

from mp_symbolic import Pipeline
from mp_symbolic.core.graph import names
from mp_symbolic.core.graph.ir import ROLES, PlacedGraph
from mp_symbolic.core.graph.names import GROUP_ATTR, SHARD_ATTR, shard_group
from mp_symbolic.training.tasks import digits, gpt, lm

from bench.graph_json import build_counts, counting, export_counts
from export.inference import stage_layout

TINY = gpt.GPTConfig(vocab_size=23, block_size=12, num_layers=2, num_heads=2, num_hiddens=8)


def _pipelines():
    yield 'digits blocks', Pipeline(digits.build_blocks(), 'cpu:0,cpu:1,cpu:2',
                                    sample=(4, 1, 8, 8))
    yield 'lm whole, 2 shards', Pipeline(gpt.build_network(TINY, lm.sharded_layers(2)),
                                         'cpu:0,cpu:1+cpu:2', sample=(4, TINY.block_size))
    yield 'lm blocks, 2 shards', Pipeline(gpt.build_blocks(TINY, lm.sharded_layers(2)),
                                          'cpu:0+cpu:1,cpu:2+cpu:3',
                                          sample=(4, TINY.block_size))


@pytest.mark.parametrize('name,pipe', list(_pipelines()), ids=lambda v: v if isinstance(v, str)
                         else '')
def test_every_node_has_the_stage_and_shard_its_placement_gave(name, pipe):
    placement = pipe.placement
    placed = placement.labelled()
    raw = placed.to_json()['nodes']
    assert {n.role for n in placed.nodes} <= set(ROLES)
    assert placed.num_stages == pipe.plan.num_stages
    params = set(placement.owner)
    seen = set()
    for node in placed.nodes:
        assert node.group == raw[node.index]['attrs'][GROUP_ATTR]  # MXNet's ctx_group
        assert GROUP_ATTR not in node.attrs and SHARD_ATTR not in raw[node.index]['attrs']
        assert node.group == shard_group(node.stage, node.shard), node.name
        if node.role == 'input':
            assert node.name in placement.input_names
        elif node.is_variable:
            # every parameter sits on the stage and shard its placement gives it
            assert node.name in params, node.name
            assert (node.stage, node.shard) == (placement.owner[node.name],
                                                placement.shard_of.get(node.name, 0)), node.name
            seen.add(node.name)
    assert seen == params  # every parameter is in the graph once
    # the ops of each stage, as the twin runs them, are the graph's ops, each once
    by_stage = placed.op_indices_by_stage(pipe.plan.num_stages)
    assert sorted(i for ops in by_stage for i in ops) == [n.index for n in placed.ops]
    assert all(by_stage), 'a stage with no op'


def test_batchnorm_states_are_states_on_their_ops_stage():
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Dense(8, in_units=4), gluon.nn.BatchNorm(in_channels=8),
                gluon.nn.Dense(3, in_units=8))
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=(4, 4), balance=[2, 1])
    symbol = pipe.symbol()
    placed = PlacedGraph.from_symbol(symbol, pipe.placement.input_names)
    states = {n.name for n in placed.nodes if n.role == 'state'}
    assert states == set(symbol.list_auxiliary_states()) and states
    for op in placed.ops:
        for entry in op.inputs:
            source = placed.source(entry)
            if source.role == 'state':
                assert source.stage == op.stage == 0


def test_the_json_form_is_the_graph_itself_and_a_copy():
    pipe = Pipeline(digits.build_blocks(), 'cpu:0,cpu:1', sample=(4, 1, 8, 8))
    symbol = pipe.symbol()
    placed = PlacedGraph.from_symbol(symbol)
    graph, theirs = placed.to_json(), json.loads(symbol.tojson())
    assert (graph['nodes'], graph['heads'], graph['attrs']) == \
        (theirs['nodes'], theirs['heads'], theirs['attrs'])
    assert placed.to_symbol().tojson() == symbol.tojson()
    graph['nodes'][0]['name'] = 'changed'  # a new dict each time: the graph is not changed
    assert placed.to_json() == placed.but().to_json() != graph
    assert placed.to_symbol().tojson() == symbol.tojson()
    with pytest.raises(TypeError):
        placed.nodes[0].attrs['x'] = '1'  # read-only


def test_a_graph_without_groups_has_nodes_on_no_stage():
    x = mx.sym.var('data')
    placed = PlacedGraph.from_symbol(mx.sym.FullyConnected(x, num_hidden=2, name='fc'),
                                     inputs=['data'])
    assert placed.num_stages == 0
    assert [(n.name, n.role, n.stage, n.shard) for n in placed.nodes] == [
        ('data', 'input', None, None), ('fc_weight', 'parameter', None, None),
        ('fc_bias', 'parameter', None, None), ('fc', 'op', None, None)]


def test_export_reads_the_stages_the_pipeline_placed():
    pipe = Pipeline(digits.build_blocks(), 'cpu:0,cpu:1,cpu:2', sample=(4, 1, 8, 8))
    symbol = pipe.symbol()
    layout = stage_layout(symbol)
    placed = PlacedGraph.from_symbol(symbol)
    assert list(layout) == ['stage%d' % s for s in range(pipe.plan.num_stages)]
    for s, entry in enumerate(layout.values()):
        assert entry['ops'] == [n.name for n in placed.ops_of_stage(s)]


@pytest.mark.parametrize('name,pipe', list(_pipelines()), ids=lambda v: v if isinstance(v, str)
                         else '')
def test_the_traces_marks_are_read_into_nodes_and_reach_no_graph_mxnet_sees(name, pipe):
    """A trace's marks (a block list's block, a shard's layer call) are the
    typed nodes' fields: every op of a block list knows its block, every
    shard its layer, and neither mark is in a graph bound, exported or
    checkpointed."""
    traced = pipe.placement.traced.placed
    if 'blocks' in name:
        stage_of_block = pipe.plan.stage_of_layer
        assert all(op.block is not None for op in traced.ops)
        assert [stage_of_block[op.block] for op in traced.ops] == \
            list(pipe.placement.traced.stage_of_op)
    else:
        assert all(n.block is None for n in traced.nodes)
    if 'shards' in name:
        assert any(n.layer is not None for n in pipe.placement.labelled().ops)
    for symbol in (pipe.training_symbol('softmax'), pipe.training_symbol('softmax', chunks=2),
                   pipe.training_symbol('softmax', unsplit=True), pipe.symbol()):
        text = symbol.tojson()
        assert not [mark for mark in names.TRACE_ATTRS if mark in text]


def _attributes(symbol):
    """Every double-underscore attribute key on ``symbol``'s nodes."""
    return {key for node in json.loads(symbol.tojson())['nodes']
            for key in node.get('attrs', {}) if key.startswith('__')}


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_bound_graph_carries_no_attribute_mxnet_does_not_read(schedule):
    """The graphs a Module binds (its one graph; under 1F1B each stage's
    too) carry of the library's attributes only those MXNet reads
    (names.MXNET_ATTRS), beside Gluon's on its variables: no mark of the
    trace (a column layer's join, a shard, a block)."""
    net, sample = gpt.build_network(TINY, lm.sharded_layers(2)), (4, TINY.block_size)
    pipe = Pipeline(net, 'cpu:0+cpu:1,cpu:2+cpu:3', sample=sample, chunks=2, schedule=schedule)
    mod = pipe.module('softmax')
    mod.bind([('data', sample)], [('softmax_label', sample)])
    stages = mod._stages or ()  # pylint: disable=protected-access
    bound = [mod.symbol] + [g.symbol for g in stages if g.symbol is not None]
    allowed = set(names.MXNET_ATTRS) | set(names.GLUON_ATTRS)
    for symbol in bound + [mod.export_symbol]:
        assert _attributes(symbol) <= allowed, _attributes(symbol) - allowed
    assert names.MIRROR_ATTR in _attributes(Pipeline(
        net, 'cpu:0+cpu:1,cpu:2+cpu:3', sample=sample, mirror=True).module('softmax').symbol)


def _string_literals(path):
    with open(path, encoding='utf-8') as f:
        for token in tokenize.generate_tokens(io.StringIO(f.read()).readline):
            if token.type == tokenize.STRING:
                yield token.string.strip('\'"'), token.start[0]


def test_every_attribute_the_library_writes_is_declared_in_names():
    """No double-underscore attribute is spelled outside core/graph/names.py: the
    library and the export name each one through it (names.ATTRS, and
    Gluon's names.GLUON_ATTRS). Python's own names and the node messages'
    array key are no graph attribute."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    not_attributes = {'__main__', '__name__', '__ndarray__'}
    found = []
    for package in ('mp_symbolic', 'export'):
        for folder, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                path = os.path.join(folder, name)
                if not name.endswith('.py') or path.endswith(os.path.join('core', 'graph', 'names.py')):
                    continue
                found += ['%s:%d %s' % (os.path.relpath(path, root), line, text)
                          for text, line in _string_literals(path)
                          if text.startswith('__') and text.endswith('__') and len(text) > 4
                          and text not in not_attributes]
    assert not found
    assert set(names.TRACE_ATTRS) <= set(names.ATTRS) and \
        not set(names.TRACE_ATTRS) & set(names.MXNET_ATTRS)


@pytest.mark.parametrize('whole', [False, True], ids=['block list', 'whole network'])
@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_module_build_reads_the_json_once_and_writes_each_graph_it_binds_once(schedule, whole):
    """Building a Module reads MXNet's JSON into the typed graph at most once
    (where a block list's trace ends; a whole network's was read when it was
    placed), and writes one JSON per graph it binds: the one graph, and
    under 1F1B each of the 3 stages' too; binding reads and writes none."""
    built, bound = build_counts(schedule, whole)
    assert built['from_json'] == (0 if whole else 1)
    assert built['to_json'] == (1 if schedule == 'gpipe' else 1 + 3)
    assert bound['from_json'] == bound['to_json'] == bound['Symbol.tojson'] == 0


def test_a_symbol_is_read_into_the_typed_graph_once_and_an_export_reads_each_symbol_once(tmp_path):
    """PlacedGraph.from_symbol keeps the graphs of the Symbols read last: the
    same Symbol (and inputs) gives the same graph without a second JSON read;
    another Symbol, or other inputs, are read. An export of a checkpoint
    reads as many JSONs as the Symbols it makes (it read 48 for 8 before)."""
    symbol = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=2, name='fc')
    with counting() as counts:
        first = PlacedGraph.from_symbol(symbol)
        assert PlacedGraph.from_symbol(symbol) is first
        assert counts['from_json'] == counts['Symbol.tojson'] == 1
        as_input = PlacedGraph.from_symbol(symbol, inputs=('data',))
        assert as_input is not first and as_input.nodes[0].role == 'input'
        other = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=3, name='fc')
        assert PlacedGraph.from_symbol(other) is not first
        assert counts['from_json'] == 3
    exported = export_counts(str(tmp_path))
    assert 0 < exported['from_json'] <= 10 and exported['Symbol.tojson'] <= exported['from_json'] + 2


def test_a_block_lists_trace_is_made_once_and_again_only_after_a_parameter_changes():
    """Placement.traced: one trace of a block list, read once, until a
    parameter's attributes change (here its lr_mult, which Gluon writes on
    its variable); the graph then carries the new value."""
    blocks = [gluon.nn.Dense(4, in_units=4), gluon.nn.Dense(2, in_units=4)]
    for block in blocks:
        block.initialize()
    placement = Pipeline(blocks, 'cpu:0,cpu:1').placement
    first = placement.traced
    assert placement.traced is first and placement.labelled() == placement.labelled()
    weight = blocks[1].weight
    weight.lr_mult = 2.0
    again = placement.traced
    assert again is not first and placement.traced is again
    node = next(n for n in again.placed.variables if n.name == weight.name)
    assert float(node.attrs['__lr_mult__']) == 2.0
