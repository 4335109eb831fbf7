"""A model-zoo network on the 8x8 digits (``--task zoo --task-arg
model=resnet18_v1``): any name ``mxnet.gluon.model_zoo.vision.get_model``
knows, fed the digits scaled to its input, as one ``HybridBlock`` that
:class:`~mp_symbolic.Pipeline` cuts whole (no pretrained weights; nothing is
downloaded).
"""
from mxnet import gluon
from mxnet.gluon.model_zoo import vision

import mp_symbolic
from mp_symbolic.core.base.checks import positive_int

from . import digits

__all__ = []


def zoo_names():
    """Every name ``vision.get_model`` knows (read from its own error message,
    the only place MXNet 1.9.1 lists them)."""
    try:
        vision.get_model('')
    except ValueError as err:
        return [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
    raise AssertionError('vision.get_model accepted an empty name')


class DigitsZooNet(gluon.HybridBlock):
    """``(N, 1, 8, 8)`` digits -> ``(N, classes)``: each image enlarged by
    nearest-neighbour ``scale`` times, its one channel repeated to three,
    then the zoo network (no pretrained weights).

    Args:
        name: A ``vision.get_model`` name (``'resnet18_v1'``, ...).
        scale: Enlargement: the network sees ``8 * scale`` pixels a side.
        classes: Output classes.

    Raises:
        ValueError: an unknown name, or a scale below 1.
    """

    def __init__(self, name='resnet18_v1', scale=4, classes=10, **kwargs):
        super().__init__(**kwargs)
        if name not in zoo_names():
            raise ValueError('name: expected one of %s, found %r' % (', '.join(zoo_names()), name))
        self.scale = positive_int('scale', scale)
        with self.name_scope():
            self.net = vision.get_model(name, classes=classes)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        if self.scale > 1:
            x = F.UpSampling(x, scale=self.scale, sample_type='nearest')  # (N, 1, 8s, 8s)
        x = F.repeat(x, repeats=3, axis=1)                               # (N, 3, 8s, 8s)
        return self.net(x)


def build_network(name='resnet18_v1', scale=4, classes=10):
    """The zoo network ``name`` for the digits (see :class:`DigitsZooNet`)."""
    return DigitsZooNet(name, scale, classes, prefix='zoo_')


def task(model='resnet18_v1', scale=4, seed=0):
    """The digits, classified by the zoo network ``model`` cut whole over the
    devices, as a :class:`~mp_symbolic.Task`.

    Args:
        model: A ``vision.get_model`` name.
        scale: The network sees ``8 * scale`` pixels a side.
        seed: Fixes the held-out split (``--seed``).
    """
    X_train, y_train, X_test, y_test = digits.split(*digits.load_digits(), seed=seed)
    return mp_symbolic.Task(
        name=model, blocks=build_network(model, scale), loss='softmax',
        train=(X_train, y_train), val=(X_test, y_test), metric='acc', batch_size=64,
        num_epochs=3, optimizer='sgd', lr=0.05, momentum=0.9, evaluate=digits.evaluate,
        out_dir='artifacts/zoo-{name}',
        description="scikit-learn's 8x8 digits by the model zoo's %s, %dx%d input"
                    % (model, 8 * scale, 8 * scale))
