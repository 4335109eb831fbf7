"""The three-layer regression network, written once as Gluon HybridBlocks.

Every layer is a :class:`StageDense`: a fully connected layer that belongs to
one pipeline *stage*, named ``stage0``, ``stage1``, ... . The same block serves
both variants of the project:

* called on a :class:`mxnet.symbol.Symbol`, it tags its op **and its
  parameter variables** with ``ctx_group=<stage>``, so the graph can be bound
  model-parallel with ``group2ctx`` (the symbolic variant);
* called on an :class:`mxnet.ndarray.NDArray`, it first moves its input to the
  device that holds its parameters; autograd records that copy, so gradients
  flow back across devices (the imperative variant).

The tagging pattern follows MXNet's own ``test_model_parallel.py`` and
``test_module.py::test_module_ctx_group``. This file imports only MXNet.
"""
import mxnet as mx
from mxnet import gluon

__all__ = ['StageDense', 'build_net', 'stage_name', 'inference_symbol',
           'training_symbol', 'DATA_NAME', 'LABEL_NAME', 'OUTPUT_NAME']

DATA_NAME = 'data'
LABEL_NAME = 'label'
OUTPUT_NAME = 'regression'  # name of the loss head; its output is the prediction


def stage_name(stage):
    """The ``ctx_group`` name of pipeline stage ``stage`` (``'stage0'``, ...)."""
    return 'stage%d' % stage


class StageDense(gluon.HybridBlock):
    """``y = x W^T + b`` on one pipeline stage.

    Args:
        in_units: Input width.
        units: Output width.
        stage: Index of the pipeline stage; the block's ``ctx_group`` is
            ``stage_name(stage)``.

    The weight has MXNet's ``FullyConnected`` layout ``(units, in_units)``;
    initialisation is the seed question's (Xavier, magnitude 2.24; bias 0.5).
    """

    def __init__(self, in_units, units, stage, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.ctx_group = stage_name(stage)
        with self.name_scope():
            self.weight = self.params.get(
                'weight', shape=(units, in_units),
                init=mx.init.Xavier(magnitude=2.24))
            self.bias = self.params.get(
                'bias', shape=(units,), init=mx.init.Constant(0.5))

    def forward(self, x):  # pylint: disable=arguments-differ
        if isinstance(x, mx.sym.Symbol):
            # The parameter variables are created inside HybridBlock.forward,
            # so the scope must enclose all of it (a scope inside
            # hybrid_forward would tag the ops but not the variables).
            with mx.AttrScope(ctx_group=self.ctx_group):
                return super().forward(x)
        # Imperative: run where this stage's parameters live. The copy is an
        # autograd-recorded op, so the gradient flows back to the previous
        # stage's device.
        return super().forward(x.as_in_context(self.weight.list_ctx()[0]))

    def hybrid_forward(self, F, x, weight, bias):  # pylint: disable=arguments-differ
        # (batch, in_units) -> (batch, units)
        return F.FullyConnected(x, weight, bias, num_hidden=self.units, name='fc')


def build_net(widths=(2, 2, 2, 1), stage_of_layer=None):
    """The network as a ``HybridSequential`` of :class:`StageDense` layers.

    Args:
        widths: Layer widths, input first: ``(2, 2, 2, 1)`` is the seed's
            2 -> 2 -> 2 -> 1 network (three layers).
        stage_of_layer: Stage index of each layer: starting at 0, each layer in
            the same stage as the previous one or the next. Default: one stage
            per layer.

    Returns:
        The (uninitialised) network. Parameters are named ``layer<i>_weight``
        and ``layer<i>_bias``.

    Raises:
        ValueError: ``widths`` has fewer than two entries or a non-positive
            width, or ``stage_of_layer`` does not give one stage per layer.
    """
    widths = tuple(widths)
    if len(widths) < 2 or any(int(w) != w or w < 1 for w in widths):
        raise ValueError('widths must be at least two positive integers '
                         '(input width first), got %r' % (widths,))
    num_layers = len(widths) - 1
    if stage_of_layer is None:
        stage_of_layer = tuple(range(num_layers))
    stage_of_layer = tuple(stage_of_layer)
    if len(stage_of_layer) != num_layers or stage_of_layer[0] != 0 or any(
            b - a not in (0, 1) for a, b in zip(stage_of_layer, stage_of_layer[1:])):
        raise ValueError('stage_of_layer must give each of the %d layers a stage, contiguous '
                         'and starting at 0 (such as (0, 0, 1)), got %r'
                         % (num_layers, stage_of_layer))
    net = gluon.nn.HybridSequential(prefix='')
    for i in range(num_layers):
        # Created outside net.name_scope() so the names stay 'layer<i>_...'.
        net.add(StageDense(widths[i], widths[i + 1], stage_of_layer[i],
                           prefix='layer%d_' % i))
    return net


def inference_symbol(net):
    """The network as a Symbol: ``data`` (batch, in) -> prediction (batch, out).

    ``data`` is tagged with the first layer's stage, every op and parameter
    with its own layer's stage.
    """
    with mx.AttrScope(ctx_group=net[0].ctx_group):
        data = mx.sym.var(DATA_NAME)
    return net(data)


def training_symbol(net):
    """:func:`inference_symbol` plus an L2 loss head on the last stage.

    ``LinearRegressionOutput`` passes the prediction through in the forward
    pass and back-propagates ``prediction - label`` per sample, the gradient of
    ``0.5 * (prediction - label)**2`` (Gluon's ``L2Loss``).
    """
    out = inference_symbol(net)
    with mx.AttrScope(ctx_group=net[len(net) - 1].ctx_group):
        label = mx.sym.var(LABEL_NAME)
        return mx.sym.LinearRegressionOutput(data=out, label=label, name=OUTPUT_NAME)
