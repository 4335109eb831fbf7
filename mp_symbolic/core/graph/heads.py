"""Loss heads: their training form (MXNet's ``*Output`` ops, or a few ops a
head builds), their Gluon twin, and the inference form an export replaces
them with. Each is one :class:`Head` record in :data:`HEADS`;
:func:`read_head` reads a record back off a graph. docs/how-it-works.md lists
the heads and their class axes."""
from dataclasses import dataclass, field, replace
import functools
import re

import mxnet as mx
from mxnet import gluon

from .ir import PlacedGraph, as_placed, make_node
from .names import GROUP_KEY, other_output_name, prediction_name

__all__ = []


def _mean_square(output, label, **_):
    return mx.nd.mean(mx.nd.square(output - label.reshape(output.shape)))


def _mean_absolute(output, label, **_):
    return mx.nd.mean(mx.nd.abs(output - label.reshape(output.shape)))


def _cross_entropy(output, label, axis=-1, ignore_label=None):
    """Mean ``-log p`` of each position's label class; ``axis`` ``None``: every
    axis but the batch is a class, flattened, as ``SoftmaxOutput`` takes them
    without ``preserve_shape`` or ``multi_output``."""
    if axis is None:
        output = output.reshape((0, -1)) if label.ndim == 1 else output
        axis = -1
    picked = -mx.nd.log(mx.nd.maximum(mx.nd.pick(output, label, axis=axis), 1e-12))
    if ignore_label is None:
        return mx.nd.mean(picked)
    kept = label != ignore_label
    return mx.nd.sum(picked * kept) / mx.nd.maximum(mx.nd.sum(kept), 1)


def _binary_cross_entropy(output, label, **_):
    p = mx.nd.clip(output, 1e-12, 1 - 1e-12)
    label = label.reshape(output.shape)
    return -mx.nd.mean(label * mx.nd.log(p) + (1 - label) * mx.nd.log(1 - p))


class PositionSummedSoftmaxCELoss(gluon.loss.Loss):
    """Softmax cross-entropy over the last axis, summed over every other axis but
    the batch (``(N, T, C)`` -> ``(N,)``): the twin of ``SoftmaxOutput`` with
    ``preserve_shape``, whose gradient is per position, unaveraged."""

    def __init__(self, **kwargs):
        super().__init__(weight=None, batch_axis=0, **kwargs)

    def hybrid_forward(self, F, pred, label):  # pylint: disable=arguments-differ
        nll = -F.pick(F.log_softmax(pred, axis=-1), label, axis=-1)  # (N, ...)
        return F.sum(F.reshape(nll, shape=(0, -1)), axis=1)


def _log_softmax_head(prediction, label, name, axis=-1):
    """The ``'log_softmax'`` head's training graph: its output is ``softmax``'s
    probabilities (``BlockGrad``: no gradient through them), its gradient each
    position's ``softmax - one_hot(label)`` through ``log_softmax``, ``pick``
    and ``MakeLoss`` (``grad_scale`` -1: the picked log-probability's
    gradient is -1), joined by a ``slice_like`` on the batch axis, whose
    forward pass is the probabilities and whose gradient reaches neither."""
    probabilities = mx.sym.BlockGrad(mx.sym.softmax(prediction, axis=axis, name=name + '_prob'),
                                     name=name + '_out')
    # the labels as they are, typed and shaped like the prediction's first class (as
    # SoftmaxOutput types them): pick needs its index's type, which inference from
    # the data alone would otherwise leave unset
    first = mx.sym.squeeze(mx.sym.slice_axis(prediction, axis=axis, begin=0, end=1,
                                             name=name + '_first'), axis=axis,
                           name=name + '_first_class')
    index = mx.sym._internal._identity_with_attr_like_rhs(  # pylint: disable=protected-access
        label, first, name=name + '_index')
    picked = mx.sym.pick(mx.sym.log_softmax(prediction, axis=axis, name=name + '_log'), index,
                         axis=axis, name=name + '_pick')
    loss = mx.sym.MakeLoss(picked, grad_scale=-1.0, name=name + '_loss')
    return mx.sym.slice_like(probabilities, loss, axes=(0,), name=name)


def _log_softmax_parts(graph, node):
    """``(prediction entry, label entry, class axis)`` of the
    :func:`_log_softmax_head` joined at ``node`` of ``graph``, or ``None``
    where ``node`` joins no such head."""
    if node.op != 'slice_like' or len(node.inputs) != 2:
        return None
    out, loss = (graph.source(e) for e in node.inputs)
    if out.op != 'BlockGrad' or loss.op != 'MakeLoss':
        return None
    prob, pick = graph.source(out.inputs[0]), graph.source(loss.inputs[0])
    if not (prob.op == 'softmax' and pick.op == 'pick' and len(pick.inputs) == 2
            and graph.source(pick.inputs[0]).op == 'log_softmax'):
        return None
    index = graph.source(pick.inputs[1])
    if index.op != '_identity_with_attr_like_rhs':
        return None
    return prob.inputs[0], index.inputs[0], int(prob.attrs.get('axis', -1))


def softmax_twin(axis=-1):
    """The Gluon twin of ``SoftmaxOutput`` on class axis ``axis``: -1 sums each
    position's loss; 1 (``multi_output``) averages them."""
    if axis == 1:
        return gluon.loss.SoftmaxCrossEntropyLoss(axis=1)
    return PositionSummedSoftmaxCELoss()


@dataclass(frozen=True)
class Head:
    """One loss head, everything the library says about it in one record.

    Attributes:
        loss: The name users give (``loss='softmax'``).
        op: MXNet's training op (``SoftmaxOutput``).
        node: The head node's name (``'softmax'``: label ``softmax_label``).
        inference: What the op's forward pass computes, the form an export
            replaces it with: ``'identity'``, ``'softmax'`` or ``'sigmoid'``.
        label: What the per-epoch line calls the batch loss.
        metric: The default metric (an ``mx.metric`` name).
        gluon_loss: Makes the Gluon loss whose gradient equals the op's.
        batch_loss: ``(output, label, axis=, ignore_label=) -> mean loss``.
        predict: ``(raw outputs, axis) ->`` the head's output (``None``: same).
        classes: Whether labels are class indices of the class axis.
        op_args: Arguments of the op beyond data, label and name.
        axis: The class axis: -1 or 1; ``None``: every axis but the batch.
        ignore_label: A label value the loss skips, or ``None``.
        build: ``None``: the head is the one ``op`` node. Else ``build(prediction,
            label, name, axis) -> Symbol``, the head's ops, its output node an
            ``op`` node named ``node``, found in a graph by ``made``.
        made: ``(graph, node) -> (prediction entry, label entry, class axis)``
            of a built head ending at ``node``, or ``None`` where none does.
        axes: The class axes the head takes.
    """
    loss: str
    op: str
    node: str
    inference: str
    label: str
    metric: str
    gluon_loss: object
    batch_loss: object
    predict: object = None
    classes: bool = False
    op_args: dict = field(default_factory=dict)
    axis: int = -1
    ignore_label: float = None
    build: object = None
    made: object = None
    axes: tuple = (-1, 1)

    def on_axis(self, axis):
        """This head with its classes on ``axis`` (-1 or 1).

        Raises:
            ValueError: the head does not take classes on ``axis``.
        """
        if not self.classes or axis == self.axis:
            return self
        if axis not in self.axes:
            raise ValueError("loss: expected classes on the last axis for %r (labels of the "
                             "outputs' shape without it), found labels that leave axis %s: "
                             "use loss='softmax'" % (self.loss, axis))
        if self.build is not None:
            return replace(self, axis=axis)
        return replace(self, axis=axis, op_args={'multi_output': True} if axis == 1
                       else {'preserve_shape': True})

    def ends(self, graph, node):
        """Whether this head's training form ends at ``node`` of ``graph``."""
        return node.op == self.op and (self.made is None or self.made(graph, node) is not None)

    def mean_loss(self, output, label):
        """The batch's mean loss from the head's output, on its device."""
        return self.batch_loss(output, label, axis=self.axis, ignore_label=self.ignore_label)

    def make_gluon_loss(self):
        """The Gluon loss whose gradient equals the op's."""
        return self.gluon_loss(axis=self.axis) if self.classes else self.gluon_loss()

    def predict_form(self, output):
        """Raw outputs (the imperative twin's) as the head's output."""
        return output if self.predict is None else self.predict(output, self.axis)

    def metric_object(self):
        """The default metric (an ``mx.metric.Accuracy`` on the class axis for a
        head of classes), or its name."""
        return mx.metric.Accuracy(axis=self.axis) if self.classes and self.axis is not None \
            else self.metric


HEADS = {head.loss: head for head in (
    Head('l2', 'LinearRegressionOutput', 'regression', 'identity', 'batch MSE', 'mse',
         gluon.loss.L2Loss, _mean_square),
    # over the last axis by default, as the Gluon twin, the batch loss and the
    # inference form take it: (N, C) with labels (N,), and (N, T, C) with
    # labels (N, T) (MXNet's default would flatten every axis but the batch);
    # on_axis(1) for (N, C, H, W) with labels (N, H, W)
    Head('softmax', 'SoftmaxOutput', 'softmax', 'softmax', 'cross-entropy', 'acc',
         softmax_twin, _cross_entropy,
         lambda output, axis: mx.nd.softmax(output, axis=axis), classes=True,
         op_args={'preserve_shape': True}),
    Head('logistic', 'LogisticRegressionOutput', 'logistic', 'sigmoid',
         'binary cross-entropy', 'binary accuracy', gluon.loss.SigmoidBinaryCrossEntropyLoss,
         _binary_cross_entropy, lambda output, axis: mx.nd.sigmoid(output)),
    # 'softmax''s output, loss and gradient (to float32 rounding) on the last
    # axis, its gradient through oneDNN's log_softmax where SoftmaxOutput runs
    # MXNet's generic softmax in training (docs/lm.md measures both)
    Head('log_softmax', 'slice_like', 'softmax', 'softmax', 'cross-entropy', 'acc',
         softmax_twin, _cross_entropy,
         lambda output, axis: mx.nd.softmax(output, axis=axis), classes=True,
         build=_log_softmax_head, made=_log_softmax_parts, axes=(-1,)),
)}
LOSSES = tuple(HEADS)
# MXNet's own head, not made here (no loss name), read back off a graph and exported.
_MAE = Head('mae', 'MAERegressionOutput', 'mae', 'identity', 'batch MAE', 'mae',
            gluon.loss.L1Loss, _mean_absolute)
# Node name of each head; 'softmax' makes MXNet's default label name 'softmax_label'.
HEAD_NAMES = {name: head.node for name, head in HEADS.items()}
# Training head op -> its record, and what its forward pass computes at inference
# (the heads of one op; a built head is found by its record's ``made``).
_BY_OP = {head.op: head for head in list(HEADS.values()) + [_MAE] if head.build is None}
_BUILT = tuple(head for head in HEADS.values() if head.build is not None)
INFERENCE_FORMS = {op: head.inference for op, head in _BY_OP.items()}
# Heads whose gradient MXNet divides by the label's size over its axis 0.
BATCH_SCALED_OPS = ('LinearRegressionOutput', 'LogisticRegressionOutput', 'MAERegressionOutput')


# MXNet's loss ops that read a label as their second input (SVMOutput is
# not made here, and is read back like the others).
LABELLED_OPS = tuple(_BY_OP) + ('SVMOutput',)


def head_at(graph, node):
    """The :class:`Head` whose training form ends at ``node`` of ``graph`` (a
    ``PlacedGraph``), or ``None``."""
    head = _BY_OP.get(node.op)
    if head is not None:
        return head
    return next((head for head in _BUILT if head.ends(graph, node)), None)


def labels_of(graph):
    """The names of the variables ``graph`` (Symbol, JSON or ``PlacedGraph``)
    feeds its loss heads as labels."""
    graph = as_placed(graph)
    return {graph.source(node.inputs[1]).name for node in graph.ops
            if node.op in LABELLED_OPS and len(node.inputs) > 1} | {
                graph.source(head.made(graph, node)[1]).name for node in graph.ops
                for head in _BUILT if head.ends(graph, node)}


def head_of(loss):
    """The :class:`Head` of ``loss`` (a name or a record), or ``None`` for a
    callable head."""
    if isinstance(loss, Head):
        return loss
    return HEADS.get(loss) if isinstance(loss, str) else None


def class_axis(output_shape, label_shape=None):
    """The class axis of a softmax head on outputs of ``output_shape`` (batch
    first) with labels of ``label_shape``: -1 where the labels drop the last
    axis, 1 where they drop axis 1 (``(N, C, H, W)`` with ``(N, H, W)``),
    ``None`` where neither. Where both fit, or without labels: 1 for outputs
    of 4 axes or more, else -1."""
    output_shape = tuple(output_shape)
    by_rank = 1 if len(output_shape) >= 4 else -1
    if label_shape is None:
        return by_rank
    label_shape = tuple(label_shape)
    last = label_shape == output_shape[:-1]
    second = len(output_shape) >= 3 and label_shape == output_shape[:1] + output_shape[2:]
    if last and second:
        return by_rank
    return -1 if last else 1 if second else None


def make_head(loss, prediction, label):
    """The training head on the Symbols ``prediction`` and ``label``; ``loss`` is
    ``'l2'``, ``'softmax'``, ``'logistic'``, a :class:`Head` record, or a
    callable ``loss(prediction, label) -> Symbol``.

    Raises:
        ValueError: ``loss`` is none of these, or the callable returns no Symbol.
    """
    if callable(loss) and not isinstance(loss, str):
        head = loss(prediction, label)
        if not isinstance(head, mx.sym.Symbol):
            raise ValueError('loss: expected the callable to return an mx.sym.Symbol, found %s'
                             % type(head).__name__)
        return head
    head = head_of(loss)
    if head is None:
        raise ValueError('loss: expected %s or a callable (prediction, label) -> Symbol, '
                         'found %r' % (', '.join(repr(l) for l in LOSSES), loss))
    if head.build is not None:
        return head.build(prediction, label, head.node, head.axis)
    return getattr(mx.sym, head.op)(data=prediction, label=label, name=head.node,
                                    **head.op_args)


def head_calls(loss):
    """``{op: calls}`` of one training step of the head named ``loss`` alone,
    forward and backward, as MXNet binds it: the ops a profiler trace shows
    for the head (``'l2'``: ``{'LinearRegressionOutput': 1,
    '_backward_linear_reg_out': 1}``).

    Raises:
        ValueError: ``loss`` is not one of :data:`LOSSES`.
    """
    if loss not in HEADS:
        raise ValueError('loss: expected one of %s, found %r' % (', '.join(LOSSES), loss))
    return dict(_bound_calls(loss))


@functools.lru_cache(maxsize=None)
def _bound_calls(loss):
    head = HEADS[loss]
    shape = (2, 3)  # (batch, classes or outputs); the ops do not depend on it
    symbol = make_head(head, mx.sym.var('prediction'), mx.sym.var('label'))
    executor = symbol.simple_bind(mx.cpu(), grad_req={'prediction': 'write', 'label': 'null'},
                                  prediction=shape, label=shape[:1] if head.classes else shape)
    calls = {}
    for line in executor.debug_str().splitlines():  # its forward and backward nodes
        match = re.match(r'(?:Subgraph)?Op:([^,]*), Name=', line)
        if match:
            calls[match.group(1)] = calls.get(match.group(1), 0) + 1
    return tuple(sorted(calls.items()))


SOFTMAX_OPS = ('SoftmaxOutput', 'Softmax')  # 'Softmax': MXNet's older name of the same op
PART_COUNTED_OPS = SOFTMAX_OPS + ('MakeLoss',)  # normalization='valid' counts the part's labels


def _divides_by_batch(node, batch_axis):
    """Whether ``node``'s gradient divisor holds the batch it sees: a regression
    head's with the batch off axis 0, ``SoftmaxOutput``'s with
    ``normalization='batch'`` with the batch on axis 0."""
    if node.op in BATCH_SCALED_OPS:
        return batch_axis != 0
    return node.op in SOFTMAX_OPS and node.attrs.get('normalization') == 'batch' \
        and batch_axis == 0


def scaled_heads(graph, shares, batch_axis=1):
    """``graph`` with the ``grad_scale`` of each head whose gradient divisor holds
    the batch it sees divided by ``shares``, so that a head seeing
    1/``shares`` of one device's batch gives one device's gradients.

    Raises:
        ValueError: a head with ``normalization='valid'`` and ``shares`` above 1.
    """
    if shares == 1:
        return graph
    for n in graph.nodes:
        if n.op in PART_COUNTED_OPS and n.attrs.get('normalization') == 'valid':
            raise ValueError(
                "loss: %s %r has normalization='valid', which divides each part's gradient "
                "by the count of valid entries in that part; split into %d parts "
                "(micro-batches bound alone x replicas) the step is not one device's: "
                "expected normalization='null' or 'batch', or the batch in one part "
                "(schedule='gpipe' with replicas=1, or chunks=1 and replicas=1)"
                % (n.op, n.name, shares))
    return graph.but([n.but(attrs=dict(n.attrs, grad_scale=repr(
        float(n.attrs.get('grad_scale', 1)) / shares))) if _divides_by_batch(n, batch_axis)
                      else n for n in graph.nodes])


def with_head(prediction, loss, label_name, output=None, group=None, shares=1, batch_axis=1):
    """The pass that adds the training head: ``prediction`` (a ``PlacedGraph``
    whose outputs are the network's) with ``loss``'s head (:func:`make_head`)
    and a label variable ``label_name``, the head's nodes in ``group``.

    With several outputs and a named loss, the outputs are the head on output
    ``output``, then the others in order, each through a ``BlockGrad``; a
    callable loss receives every output.

    Args:
        shares: One device's unsplit batch over the batch this head sees
            (:func:`scaled_heads`); 1 leaves the head as MXNet makes it.

    Raises:
        ValueError: ``output`` missing or out of range for several outputs,
            or given for one; ``loss`` none of :func:`make_head`'s; a head
            :func:`scaled_heads` refuses.
    """
    count = len(prediction.heads)
    named = not callable(loss) or isinstance(loss, str)
    if named and count > 1 and (not isinstance(output, int) or isinstance(output, bool)
                                or not 0 <= output < count):
        raise ValueError('output: expected the index of the output the loss reads (the '
                         'network has %d outputs), found %r' % (count, output))
    if (count == 1 or not named) and output not in (None, 0):
        raise ValueError('output: expected None for a network of one output or a callable '
                         'loss (it receives every output), found %r' % (output,))
    record = None if not named else head_of(loss)
    if named and record is None:
        raise ValueError('loss: expected %s or a callable (prediction, label) -> Symbol, '
                         'found %r' % (', '.join(repr(l) for l in LOSSES), loss))
    if record is not None and record.build is not None:  # a built head: its Symbol, read once
        with mx.AttrScope(**({GROUP_KEY: group} if group is not None else {})):
            outputs = [mx.sym.var(prediction_name(k)) for k in range(count)]
            symbols = [make_head(record, outputs[output or 0], mx.sym.var(label_name))] + [
                mx.sym.BlockGrad(outputs[k], name=other_output_name(k))
                for k in range(count) if k != (output or 0)]
        graph = PlacedGraph.from_symbol(symbols[0] if count == 1 else mx.sym.Group(symbols),
                                        (label_name,))
    elif record is not None:  # the head's nodes made here: no Symbol to read
        heads = [(count + 1, 0, 0)]
        nodes = [make_node(k, prediction_name(k), 'null', group=group) for k in range(count)]
        nodes.append(make_node(count, label_name, 'null', group=group, role='input'))
        nodes.append(make_node(count + 1, record.node, record.op,
                               [(output or 0, 0, 0), (count, 0, 0)], group,
                               attrs={k: str(v) for k, v in record.op_args.items()}))
        for k in range(count):
            if k != (output or 0):
                heads.append((len(nodes), 0, 0))
                nodes.append(make_node(len(nodes), other_output_name(k), 'BlockGrad',
                                       [(k, 0, 0)], group))
        graph = PlacedGraph(tuple(nodes), (), prediction.attrs).but(heads=heads)
    else:  # a callable's head: traced on a variable per output, read once
        with mx.AttrScope(**({GROUP_KEY: group} if group is not None else {})):
            outputs = [mx.sym.var(prediction_name(k)) for k in range(count)]
            graph = PlacedGraph.from_symbol(make_head(
                loss, outputs if count > 1 else outputs[0], mx.sym.var(label_name)),
                                            (label_name,))
    graph = scaled_heads(graph, shares, batch_axis)
    return graph.compose(prediction, {prediction_name(k): k for k in range(count)})


def read_head(symbol):
    """The :class:`Head` the first output of a training graph ends in, read off
    its op and attributes (class axis and ignored label included), or ``None``
    where it is no known head."""
    graph = as_placed(symbol)
    node = graph.output_node(0)
    head = head_at(graph, node)
    if head is None or not head.classes:
        return head
    if head.build is not None:
        return head.on_axis(head.made(graph, node)[2])
    attrs = node.attrs

    def flag(name):
        return str(attrs.get(name, 'False')).lower() in ('true', '1')

    axis = 1 if flag('multi_output') else -1 if flag('preserve_shape') else None
    ignore = float(attrs.get('ignore_label', -1)) if flag('use_ignore') else None
    return replace(head, axis=axis, ignore_label=ignore,
                   op_args={k: v for k, v in attrs.items() if not k.startswith('__')})


def gluon_loss(loss):
    """The Gluon loss whose gradient equals the training head's.

    Raises:
        ValueError: ``loss`` is not one of :data:`LOSSES`.
    """
    head = head_of(loss)
    if head is None or head.loss not in HEADS:
        raise ValueError('loss: expected one of %s for the imperative twin, found %r'
                         % (', '.join(LOSSES), loss))
    return head.make_gluon_loss()


def inference_form(head_op, head_attrs, prediction):
    """``prediction`` through the inference form of a training head of op
    ``head_op`` and attributes ``head_attrs``: a Symbol, or ``None`` for an
    unknown head."""
    form = INFERENCE_FORMS.get(head_op)
    if form == 'identity':
        return prediction
    if form == 'sigmoid':
        return mx.sym.sigmoid(prediction, name='sigmoid_out')
    if form == 'softmax':
        multi = str(head_attrs.get('multi_output', 'False')).lower() in ('true', '1')
        return mx.sym.softmax(prediction, axis=1 if multi else -1, name='softmax_out')
    return None


def inference_of(output):
    """``output`` (a Symbol of one output of a training graph) through the
    inference form of the loss head it ends in, or ``None`` where it ends in
    no known head."""
    graph = as_placed(output)
    node = graph.output_node(0)
    head = head_at(graph, node)
    if head is None:
        return None
    if head.build is None:
        return inference_form(node.op, node.attrs, output.get_children()[0])
    probabilities = output.get_children()[0].get_children()[0]   # BlockGrad(softmax)
    return mx.sym.softmax(probabilities.get_children()[0], axis=head.made(graph, node)[2],
                          name='softmax_out')


def predict_form(loss, output):
    """An NDArray of raw outputs in the form the training head returns
    (probabilities for ``'softmax'`` and ``'logistic'``)."""
    head = head_of(loss)
    return output if head is None else head.predict_form(output)
