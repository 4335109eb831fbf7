"""The typed placed graph (:class:`mp_symbolic.core.ir.PlacedGraph`): each
node's stage, shard and role are what the placement decided, for block lists
and whole networks, with tensor-parallel shards, tied weights and BatchNorm
states; the stage runtime's cut, the twin and the export read them from it."""
import json

import mxnet as mx
from mxnet import gluon
import pytest

from mp_symbolic import Pipeline
from mp_symbolic.core.ir import ROLES, PlacedGraph
from mp_symbolic.core.names import BLOCK_ATTR, GROUP_ATTR, SHARD_ATTR, shard_group
from mp_symbolic.training.tasks import digits, gpt, lm

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
        assert SHARD_ATTR not in text and BLOCK_ATTR not in text
