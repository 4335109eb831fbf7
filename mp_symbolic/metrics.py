"""Numbers reported about a trained network, computed in numpy from its
parameters (independent of the MXNet graph that trained them)."""
import numpy as np

from .data import TRUE_B, TRUE_W

__all__ = ['forward_numpy', 'full_mse', 'end_to_end_map', 'map_error', 'AGREE_RTOL', 'AGREE_ATOL']


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
    """The composed affine map ``x -> W x + b`` of all layers.

    With no non-linearity the network is one affine map: ``W = W_L ... W_1``
    and ``b = W_L(...(W_2 b_1 + b_2)...) + b_L``. For the seed's data it
    should approach ``W = [[2, -3.4]]`` and ``b = [4.2]``.
    """
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


# Two runs "agree" when every loss and parameter satisfies
# |a - b| <= AGREE_ATOL + AGREE_RTOL * |b| (numpy.allclose). float32 arithmetic
# on different devices may round differently; measured differences here are
# far smaller than this.
AGREE_RTOL = 1e-4
AGREE_ATOL = 1e-5
