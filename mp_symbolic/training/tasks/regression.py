"""The seed question's regression: ``y = 2*x0 - 3.4*x1 + 4.2 + 0.001*noise``.

The network is Gluon's own ``Dense`` layers (2 -> 2 -> 2 -> 1 by default, no
activation, the question's initialisation: Xavier magnitude 2.24, bias 0.5),
trained with an L2 head. With no non-linearity it is one affine map, so what
it learned can be read off its parameters and compared with the true map.
"""
import mxnet as mx
from mxnet import gluon
import numpy as np

import mp_symbolic

__all__ = []

MAX_EXAMPLES = 10 ** 8        # synthetic examples: 800 MB of float32 features at most
MAX_PARAMS = 2 ** 28          # 1 GiB of float32 weights, before gradients and optimizer state

TRUE_W = np.array([2.0, -3.4], dtype=np.float32)
TRUE_B = 4.2
NOISE_STD = 0.001


def make_dataset(num_examples=10000, seed=0):
    """Returns ``X`` (num_examples, 2) and ``y`` (num_examples, 1), float32."""
    rng = np.random.default_rng(seed)
    X = rng.normal(0.0, 1.0, (num_examples, 2)).astype(np.float32)
    noise = NOISE_STD * rng.normal(0.0, 1.0, num_examples)
    y = (X @ TRUE_W + TRUE_B + noise).astype(np.float32).reshape(-1, 1)
    return X, y


def build_blocks(widths=(2, 2, 2, 1)):
    """One ``Dense`` per layer; parameters ``layer<i>_weight``, ``layer<i>_bias``."""
    return [gluon.nn.Dense(widths[i + 1], in_units=widths[i], prefix='layer%d_' % i,
                           weight_initializer=mx.init.Xavier(magnitude=2.24),
                           bias_initializer=mx.init.Constant(0.5))
            for i in range(len(widths) - 1)]


def _layers(params):
    num_layers = len([k for k in params if k.endswith('_weight')])
    return [(np.asarray(params['layer%d_weight' % i], dtype=np.float64),
             np.asarray(params['layer%d_bias' % i], dtype=np.float64))
            for i in range(num_layers)]


def forward_numpy(params, X):
    """The network's prediction for ``X`` (n, in) -> (n, out), in float64."""
    h = np.asarray(X, dtype=np.float64)
    for W, b in _layers(params):
        h = h @ W.T + b
    return h


def full_mse(params, X, y):
    """Mean squared error over the whole data set."""
    return float(np.mean((forward_numpy(params, X) - y) ** 2))


def end_to_end_map(params):
    """The composed affine map ``x -> W x + b`` of all layers:
    ``W = W_L ... W_1``, ``b = W_L(...(W_2 b_1 + b_2)...) + b_L``."""
    layers = _layers(params)
    W = np.eye(layers[0][0].shape[1])
    b = np.zeros(layers[0][0].shape[1])
    for Wi, bi in layers:
        W, b = Wi @ W, Wi @ b + bi
    return W, b


def map_error(params):
    """Largest absolute difference between the learned and the true map."""
    W, b = end_to_end_map(params)
    return float(max(np.max(np.abs(W - TRUE_W)), np.max(np.abs(b - TRUE_B))))


def evaluate(params, predict, data):
    """Judges the trained network by its full-data MSE and the affine map it
    learned (read off the parameters; ``predict`` is not needed)."""
    del predict
    X, y = data.X, data.y
    mse = full_mse(params, X, y)
    W, b = end_to_end_map(params)
    metrics = {'final_mse': mse, 'learned_w': W.tolist(), 'learned_b': b.tolist(),
               'map_error': map_error(params)}
    lines = ['full-data MSE: %.3e' % mse,
             'learned map: y = %s . x + %s   (true: [2, -3.4] . x + 4.2; max error %.2e)'
             % (np.array2string(W.ravel(), precision=5), np.array2string(b, precision=5),
                metrics['map_error'])]
    return mp_symbolic.Report(metrics=metrics, lines=lines, score=mse, short='MSE %.3e' % mse,
                              score_name='MSE')


def _check_widths(widths):
    try:
        widths = tuple(widths)
    except TypeError:
        widths = ()
    if len(widths) < 2 or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1
                                  for w in widths):
        raise ValueError('widths: expected at least two positive integers, found %r' % (widths,))
    if widths[0] != 2 or widths[-1] != 1:
        raise ValueError('widths: expected input width 2 and output width 1 (the data has 2 '
                         'features, 1 target), found %r' % (widths,))
    if sum(a * b + b for a, b in zip(widths, widths[1:])) > MAX_PARAMS:
        raise ValueError('widths: expected at most 2**28 parameters in all (1 GiB of float32 '
                         'weights, before gradients and optimizer state), found %r' % (widths,))
    return widths


def task(widths=(2, 2, 2, 1), num_examples=10000, seed=0):
    """The seed question's regression as a :class:`~mp_symbolic.Task`.

    Args:
        widths: Layer widths, input first (2 inputs, 1 output).
        num_examples: Synthetic examples, all trained on (the full-data MSE
            judges the fit; there is no held-out part).
        seed: Seeds the data (``--seed``).
    """
    widths = _check_widths(widths)
    if not isinstance(num_examples, int) or isinstance(num_examples, bool) or \
            not 1 <= num_examples <= MAX_EXAMPLES:
        raise ValueError('num_examples: expected a positive integer at most %d, found %r'
                         % (MAX_EXAMPLES, num_examples))
    X, y = make_dataset(num_examples, seed)
    return mp_symbolic.Task(
        name='regression', blocks=build_blocks(widths), loss='l2', train=(X, y),
        label_name='label', batch_size=100, num_epochs=5, optimizer='sgd',
        lr=0.02, momentum=0.0, evaluate=evaluate, out_dir='artifacts/{variant}',
        description="the seed question's %s linear network on synthetic data"
                    % '-'.join(str(w) for w in widths))
