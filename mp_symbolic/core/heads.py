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
"""
import mxnet as mx
from mxnet import gluon

__all__ = []

LOSSES = ('l2', 'softmax', 'logistic')
# Node name of each head; 'softmax' makes MXNet's default label name 'softmax_label'.
HEAD_NAMES = {'l2': 'regression', 'softmax': 'softmax', 'logistic': 'logistic'}
_HEAD_OPS = {'l2': mx.sym.LinearRegressionOutput, 'softmax': mx.sym.SoftmaxOutput,
             'logistic': mx.sym.LogisticRegressionOutput}
# Training head op -> what its forward pass computes at inference.
INFERENCE_FORMS = {'LinearRegressionOutput': 'identity', 'MAERegressionOutput': 'identity',
                   'SoftmaxOutput': 'softmax', 'LogisticRegressionOutput': 'sigmoid'}


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
    if loss not in _HEAD_OPS:
        raise ValueError('loss: expected %s or a callable (prediction, label) -> Symbol, '
                         'found %r' % (', '.join(repr(l) for l in LOSSES), loss))
    if loss == 'softmax':
        # over the last axis, as the Gluon twin, the batch loss and the
        # inference form take it: (N, C) with labels (N,) as before, and
        # (N, T, C) with labels (N, T) (MXNet's default would take the
        # softmax over axis 1 there)
        return mx.sym.SoftmaxOutput(data=prediction, label=label, preserve_shape=True,
                                    name=HEAD_NAMES[loss])
    return _HEAD_OPS[loss](data=prediction, label=label, name=HEAD_NAMES[loss])


def gluon_loss(loss):
    """The Gluon loss whose gradient equals the training head's.

    Raises:
        ValueError: ``loss`` is not one of :data:`LOSSES`.
    """
    if loss == 'l2':
        return gluon.loss.L2Loss()
    if loss == 'softmax':
        return PositionSummedSoftmaxCELoss()
    if loss == 'logistic':
        return gluon.loss.SigmoidBinaryCrossEntropyLoss()
    raise ValueError('loss: expected one of %s for the imperative twin, found %r'
                     % (', '.join(LOSSES), loss))


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
    if loss == 'softmax':
        return mx.nd.softmax(output, axis=-1)
    if loss == 'logistic':
        return mx.nd.sigmoid(output)
    return output
