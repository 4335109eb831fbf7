"""The seed question's regression: ``y = 2*x0 - 3.4*x1 + 4.2 + 0.001*noise``.

The network is Gluon's own ``Dense`` layers (2 -> 2 -> 2 -> 1 by default, no
activation, the question's initialisation: Xavier magnitude 2.24, bias 0.5),
trained with an L2 head. With no non-linearity it is one affine map, so what
it learned can be read off its parameters and compared with the true map.
"""
import mxnet as mx
from mxnet import gluon
import numpy as np

__all__ = []

NAME = 'regression'
LOSS = 'l2'
LABEL_NAME = 'label'
METRIC = 'batch MSE'
# Defaults of the flags this task reads (see mp_symbolic.training.config.TrainConfig).
DEFAULTS = {'widths': (2, 2, 2, 1), 'num_examples': 10000, 'batch_size': 100, 'num_epochs': 5,
            'optimizer': 'sgd', 'lr': 0.02, 'momentum': 0.0}

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


def load(cfg):
    """``(X, y, X_held_out, y_held_out)``: the synthetic data; every example
    is trained on, and the full-data MSE judges the fit (no held-out part)."""
    X, y = make_dataset(cfg.num_examples, cfg.seed)
    return X, y, X, y


def sample_shape(cfg):
    return (cfg.widths[0],)


def batch_loss(output, label):
    """The batch MSE, on the output's device: ``(batch, 1)`` -> scalar."""
    return mx.nd.mean(mx.nd.square(output - label))


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
    """Judges the trained network.

    Args:
        params: Name -> numpy array.
        predict: Unused here (the map is read off the parameters).
        data: What :func:`load` returned.

    Returns:
        ``(metrics, lines, score)``: a JSON-ready dict, report lines, and the
        figure that says whether training helped (lower is better).
    """
    del predict
    X, y = data[0], data[1]
    mse = full_mse(params, X, y)
    W, b = end_to_end_map(params)
    metrics = {'final_mse': mse, 'learned_w': W.tolist(), 'learned_b': b.tolist(),
               'map_error': map_error(params)}
    lines = ['full-data MSE: %.3e' % mse,
             'learned map: y = %s . x + %s   (true: [2, -3.4] . x + 4.2; max error %.2e)'
             % (np.array2string(W.ravel(), precision=5), np.array2string(b, precision=5),
                metrics['map_error'])]
    return metrics, lines, mse
