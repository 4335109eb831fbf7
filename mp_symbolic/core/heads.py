"""Loss heads: their training form (MXNet's ``*Output`` ops), their Gluon
twin, and the inference form an export replaces them with.

MXNet's ``*Output`` ops pass a prediction through in the forward pass and
back-propagate the loss gradient per sample, unaveraged (``Module`` scales by
``1 / batch_size`` through the optimizer's ``rescale_grad``):

=========== ============================ ============================= ===========
``loss``    training head                Gluon twin (per sample)       inference
=========== ============================ ============================= ===========
``'l2'``    ``LinearRegressionOutput``   ``L2Loss`` (0.5 (p - y)^2)    identity
``'softmax'`` ``SoftmaxOutput``          ``SoftmaxCrossEntropyLoss``   softmax
                                          (summed over positions)
``'logistic'`` ``LogisticRegressionOutput`` ``SigmoidBinaryCrossEntropyLoss`` sigmoid
=========== ============================ ============================= ===========

Each head is one :class:`Head` record in :data:`HEADS` (its op, Gluon loss,
inference form, label, default metric, batch loss), read by the graph, the
imperative twin, the task and the export.
"""
from dataclasses import dataclass, field

import mxnet as mx
from mxnet import gluon

__all__ = []


def _mean_square(output, label):
    return mx.nd.mean(mx.nd.square(output - label.reshape(output.shape)))


def _cross_entropy(output, label):
    picked = mx.nd.pick(output, label, axis=-1)
    return -mx.nd.mean(mx.nd.log(mx.nd.maximum(picked, 1e-12)))


def _binary_cross_entropy(output, label):
    p = mx.nd.clip(output, 1e-12, 1 - 1e-12)
    label = label.reshape(output.shape)
    return -mx.nd.mean(label * mx.nd.log(p) + (1 - label) * mx.nd.log(1 - p))


class PositionSummedSoftmaxCELoss(gluon.loss.Loss):
    """Softmax cross-entropy over the last axis, summed over every other
    axis but the batch: ``(N, C)`` -> ``(N,)`` as Gluon's
    ``SoftmaxCrossEntropyLoss``, and ``(N, T, C)`` -> ``(N,)`` summed over
    the T positions, where Gluon's averages them. ``SoftmaxOutput`` (with
    ``preserve_shape``) back-propagates each position's gradient unaveraged,
    so this is its twin: a sequence model's gradients agree."""

    def __init__(self, **kwargs):
        super().__init__(weight=None, batch_axis=0, **kwargs)

    def hybrid_forward(self, F, pred, label):  # pylint: disable=arguments-differ
        nll = -F.pick(F.log_softmax(pred, axis=-1), label, axis=-1)  # (N, ...)
        return F.sum(F.reshape(nll, shape=(0, -1)), axis=1)


@dataclass(frozen=True)
class Head:
    """One loss head, everything the library says about it in one record.

    Attributes:
        loss: The name users give (``loss='softmax'``).
        op: MXNet's training op (``SoftmaxOutput``).
        node: The head node's name (``'softmax'`` makes MXNet's default label
            name ``softmax_label``).
        inference: What the op's forward pass computes, the form an export
            replaces it with: ``'identity'``, ``'softmax'`` or ``'sigmoid'``.
        label: What the per-epoch line calls the batch loss.
        metric: The default metric (an ``mx.metric`` name).
        gluon_loss: Makes the Gluon loss whose gradient equals the op's.
        batch_loss: ``(head output, label) -> the batch's mean loss``.
        predict: Raw outputs (the imperative twin's) -> the head's output
            (``None``: the same).
        classes: Whether labels are class indices of the last axis.
        op_args: Arguments of the op beyond data, label and name.
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


HEADS = {head.loss: head for head in (
    Head('l2', 'LinearRegressionOutput', 'regression', 'identity', 'batch MSE', 'mse',
         gluon.loss.L2Loss, _mean_square),
    # over the last axis, as the Gluon twin, the batch loss and the inference
    # form take it: (N, C) with labels (N,), and (N, T, C) with labels (N, T)
    # (MXNet's default would take the softmax over axis 1 there)
    Head('softmax', 'SoftmaxOutput', 'softmax', 'softmax', 'cross-entropy', 'acc',
         PositionSummedSoftmaxCELoss, _cross_entropy,
         lambda output: mx.nd.softmax(output, axis=-1), classes=True,
         op_args={'preserve_shape': True}),
    Head('logistic', 'LogisticRegressionOutput', 'logistic', 'sigmoid',
         'binary cross-entropy', 'binary accuracy', gluon.loss.SigmoidBinaryCrossEntropyLoss,
         _binary_cross_entropy, mx.nd.sigmoid),
)}
LOSSES = tuple(HEADS)
# Node name of each head; 'softmax' makes MXNet's default label name 'softmax_label'.
HEAD_NAMES = {name: head.node for name, head in HEADS.items()}
# Training head op -> what its forward pass computes at inference (MAERegressionOutput:
# MXNet's, not made here, exported all the same).
INFERENCE_FORMS = dict({head.op: head.inference for head in HEADS.values()},
                       MAERegressionOutput='identity')


def make_head(loss, prediction, label):
    """The training head on ``prediction``.

    Args:
        loss: ``'l2'``, ``'softmax'``, ``'logistic'``, or a callable
            ``loss(prediction, label) -> Symbol`` (a head of your own, e.g.
            built with ``mx.sym.MakeLoss``).
        prediction, label: Symbols.

    Raises:
        ValueError: ``loss`` is none of these, or the callable returns no Symbol.
    """
    if callable(loss) and not isinstance(loss, str):
        head = loss(prediction, label)
        if not isinstance(head, mx.sym.Symbol):
            raise ValueError('loss: expected the callable to return an mx.sym.Symbol, found %s'
                             % type(head).__name__)
        return head
    if loss not in HEADS:
        raise ValueError('loss: expected %s or a callable (prediction, label) -> Symbol, '
                         'found %r' % (', '.join(repr(l) for l in LOSSES), loss))
    head = HEADS[loss]
    return getattr(mx.sym, head.op)(data=prediction, label=label, name=head.node,
                                    **head.op_args)


def gluon_loss(loss):
    """The Gluon loss whose gradient equals the training head's.

    Raises:
        ValueError: ``loss`` is not one of :data:`LOSSES`.
    """
    if loss not in HEADS:
        raise ValueError('loss: expected one of %s for the imperative twin, found %r'
                         % (', '.join(LOSSES), loss))
    return HEADS[loss].gluon_loss()


def inference_form(head_op, head_attrs, prediction):
    """``prediction`` through the inference form of a training head.

    Args:
        head_op: The head's op name (``'SoftmaxOutput'``, ...).
        head_attrs: The head node's attributes (``multi_output``, ...).
        prediction: The head's data input.

    Returns:
        A Symbol, or ``None`` if ``head_op`` is not a known head.
    """
    form = INFERENCE_FORMS.get(head_op)
    if form == 'identity':
        return prediction
    if form == 'sigmoid':
        return mx.sym.sigmoid(prediction, name='sigmoid_out')
    if form == 'softmax':
        multi = str(head_attrs.get('multi_output', 'False')).lower() in ('true', '1')
        return mx.sym.softmax(prediction, axis=1 if multi else -1, name='softmax_out')
    return None


def predict_form(loss, output):
    """An NDArray of raw outputs (the imperative twin's) in the form the
    training head returns: probabilities for ``'softmax'`` / ``'logistic'``."""
    head = HEADS.get(loss) if isinstance(loss, str) else None
    return output if head is None or head.predict is None else head.predict(output)
