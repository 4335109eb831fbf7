"""The HybridBlocks tag every op and every variable with its stage's ctx_group."""
import mxnet as mx
import pytest

from mp_symbolic.model import build_net, inference_symbol, stage_name, training_symbol


def _groups(symbol):
    return {node.name: node.attr('ctx_group') for node in symbol.get_internals()}


@pytest.mark.parametrize('stage_of_layer', [(0, 1, 2), (0, 0, 1), (0, 0, 0)])
def test_every_node_and_variable_carries_its_stage_group(stage_of_layer):
    net = build_net((2, 2, 2, 1), stage_of_layer)
    groups = _groups(training_symbol(net))
    for layer, stage in enumerate(stage_of_layer):
        for name in ('layer%d_weight' % layer, 'layer%d_bias' % layer, 'layer%d_fc' % layer):
            assert groups[name] == stage_name(stage), name
    assert groups['data'] == stage_name(stage_of_layer[0])
    assert groups['label'] == stage_name(stage_of_layer[-1])
    assert groups['regression'] == stage_name(stage_of_layer[-1])
    assert all(g is not None for g in groups.values()), groups


def test_scope_inside_hybrid_forward_misses_the_variables_and_binding_fails():
    """Why StageDense tags around the whole forward: a scope inside
    hybrid_forward tags the ops but not the parameter variables, and the
    model-parallel bind for training then fails."""
    class InnerScope(mx.gluon.HybridBlock):
        def __init__(self, group, **kwargs):
            super().__init__(**kwargs)
            self.group = group
            self.weight = self.params.get('weight', shape=(2, 2))

        def hybrid_forward(self, F, x, weight):  # pylint: disable=arguments-differ
            with mx.AttrScope(ctx_group=self.group):
                return F.FullyConnected(x, weight, no_bias=True, num_hidden=2)

    first, second = InnerScope('stage0', prefix='a_'), InnerScope('stage1', prefix='b_')
    out = mx.sym.LinearRegressionOutput(second(first(mx.sym.var('data'))), mx.sym.var('label'))
    groups = _groups(out)
    assert groups['a_fullyconnected0'] == 'stage0'
    assert groups['a_weight'] is None and groups['b_weight'] is None
    with pytest.raises(RuntimeError, match='Trying to save gradient to cpu'):
        out.simple_bind(ctx=mx.cpu(0), group2ctx={'stage0': mx.cpu(0), 'stage1': mx.cpu(1)},
                        data=(4, 2), label=(4, 2))


def test_inference_symbol_has_data_input_only():
    sym = inference_symbol(build_net())
    assert sym.list_arguments() == ['data', 'layer0_weight', 'layer0_bias', 'layer1_weight',
                                    'layer1_bias', 'layer2_weight', 'layer2_bias']
    _, out_shapes, _ = sym.infer_shape(data=(7, 2))
    assert out_shapes == [(7, 1)]


@pytest.mark.parametrize('widths, stages', [((2,), None), ((2, 0, 1), None),
                                            ((2, 2, 1), (0,)), ((2, 2, 2, 1), (2, 1, 0)),
                                            ((2, 2, 2, 1), (0, 2, 2)), ((2, 2, 1), (1, 1))])
def test_bad_net_shape_raises(widths, stages):
    with pytest.raises(ValueError):
        build_net(widths, stages)
