"""GluonCV's FCN as a per-pixel classifier on random images (``--task
bench.fcn_task``): ``(N, 3, size, size)`` images, one of ``classes`` per
pixel, random weights (nothing is downloaded), the auxiliary head left out.
"""
import numpy as np
from mxnet import gluon

import mp_symbolic

__all__ = ['build_network', 'images', 'task']


class FCN(gluon.HybridBlock):
    """``fcn_resnet50_voc`` (``pretrained_base=False``, no auxiliary head):
    ``(N, 3, size, size)`` -> ``(N, 21, size, size)``."""

    def __init__(self, size=64, **kwargs):
        super().__init__(**kwargs)
        # pylint: disable=import-outside-toplevel
        from gluoncv.model_zoo import get_model
        with self.name_scope():
            self.net = get_model('fcn_resnet50_voc', pretrained=False, pretrained_base=False,
                                 aux=False, crop_size=size, base_size=size)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        out = self.net(x)
        return out[0] if isinstance(out, (list, tuple)) else out


def build_network(size=64):
    """The FCN for ``size`` x ``size`` images (see :class:`FCN`)."""
    return FCN(size, prefix='fcn_')


def images(count, size, seed=0):
    """``count`` random images and their labels: ``(images, (count, size, size) classes)``,
    every pixel class 1 (of 21) but those whose first channel is above 2, class 2
    (a task three SGD steps improve)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(count, 3, size, size)).astype(np.float32)
    return X, np.where(X[:, 0] > 2.0, 2.0, 1.0).astype(np.float32)


def task(size=64, num_examples=12, batch_size=4, num_epochs=1, seed=0):
    """FCN trained per pixel (``loss='softmax'`` on axis 1) with SGD.

    Args:
        size: Image side in pixels.
        num_examples: Random images to train on.
        batch_size, num_epochs: As the command line's defaults.
        seed: Fixes the images (``--seed``).
    """
    X, y = images(num_examples, size, seed)
    return mp_symbolic.Task(
        name='fcn', blocks=build_network(size), loss='softmax', train=(X, y),
        batch_size=batch_size, num_epochs=num_epochs, optimizer='sgd', lr=0.01, momentum=0.9,
        out_dir='artifacts/fcn',
        description="GluonCV's fcn_resnet50_voc per pixel, %dx%d random images" % (size, size))
