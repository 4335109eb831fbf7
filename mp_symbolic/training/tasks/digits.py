"""A real data set: scikit-learn's bundled 8x8 handwritten digits (1 797
images, 10 classes; shipped inside the package, nothing is downloaded).

A small CNN of Gluon's own blocks (convolution, BatchNorm, ReLU, pooling,
dense), trained with a softmax head; judged by accuracy on a held-out fifth of
the images (stratified, fixed by the seed).
"""
from mxnet import gluon
import numpy as np

import mp_symbolic

__all__ = []

HELD_OUT = 0.2
TARGET_ACCURACY = 0.95  # what `make train-digits` is expected to reach


def build_blocks():
    """Conv-BN-ReLU-pool twice, then two dense layers: (N, 1, 8, 8) -> (N, 10)."""
    nn = gluon.nn
    return [nn.Conv2D(16, 3, padding=1, in_channels=1, prefix='conv0_'),
            nn.BatchNorm(in_channels=16, prefix='bn0_'),
            nn.Activation('relu', prefix='relu0_'),
            nn.MaxPool2D(2, prefix='pool0_'),                     # (N, 16, 4, 4)
            nn.Conv2D(32, 3, padding=1, in_channels=16, prefix='conv1_'),
            nn.BatchNorm(in_channels=32, prefix='bn1_'),
            nn.Activation('relu', prefix='relu1_'),
            nn.MaxPool2D(2, prefix='pool1_'),                     # (N, 32, 2, 2)
            nn.Flatten(prefix='flatten0_'),
            nn.Dense(64, activation='relu', in_units=128, prefix='dense0_'),
            nn.Dense(10, in_units=64, prefix='dense1_')]


def load_digits():
    """``(X, y)``: images (1797, 1, 8, 8) scaled to [0, 1], labels (1797,) float32."""
    from sklearn.datasets import load_digits as sklearn_digits  # pylint: disable=import-outside-toplevel
    X, y = sklearn_digits(return_X_y=True)
    return (X.reshape(-1, 1, 8, 8) / 16.0).astype(np.float32), y.astype(np.float32)


def split(X, y, seed=0, held_out=HELD_OUT):
    """A stratified split: ``held_out`` of each class is held out."""
    rng = np.random.default_rng(seed)
    test = []
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        test += list(idx[:int(round(held_out * len(idx)))])
    mask = np.zeros(len(y), dtype=bool)
    mask[test] = True
    return X[~mask], y[~mask], X[mask], y[mask]


def evaluate(params, predict, data):
    """Held-out accuracy; ``predict(X)`` returns class probabilities."""
    del params
    accuracy = float(np.mean(np.argmax(predict(data.X_val), axis=1) == data.y_val))
    lines = ['held-out accuracy: %.2f%% (%d of %d images)'
             % (100 * accuracy, int(round(accuracy * len(data.y_val))), len(data.y_val))]
    return mp_symbolic.Report(
        metrics={'held_out_accuracy': accuracy, 'held_out_examples': len(data.y_val)},
        lines=lines, score=1.0 - accuracy, short='acc %.2f%%' % (100 * accuracy),
        score_name='error rate')


def task(seed=0):
    """The digits CNN as a :class:`~mp_symbolic.Task`; ``seed`` (``--seed``)
    fixes the held-out split."""
    X_train, y_train, X_test, y_test = split(*load_digits(), seed=seed)
    return mp_symbolic.Task(
        name='digits', blocks=build_blocks(), loss='softmax', train=(X_train, y_train),
        val=(X_test, y_test), metric='acc', batch_size=64, num_epochs=10, optimizer='sgd',
        lr=0.1, momentum=0.8, evaluate=evaluate,
        description="a CNN on scikit-learn's 8x8 digits (a stratified fifth held out)")
