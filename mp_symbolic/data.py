"""The seed question's synthetic data: ``y = 2*x0 - 3.4*x1 + 4.2 + 0.001*noise``.

Both variants draw batches from :func:`batches`, so with the same seed they see
the same examples in the same order.
"""
import numpy as np

__all__ = ['TRUE_W', 'TRUE_B', 'NOISE_STD', 'make_dataset', 'batches']

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


def batches(X, y, batch_size, epoch, seed=0):
    """Yields shuffled ``(X_batch, y_batch)`` numpy pairs for one epoch.

    The order depends only on ``(seed, epoch)``. A last batch smaller than
    ``batch_size`` is dropped: a bound symbolic executor has a fixed batch
    shape.
    """
    order = np.random.default_rng([seed, epoch]).permutation(len(X))
    for start in range(0, len(X) - batch_size + 1, batch_size):
        idx = order[start:start + batch_size]
        yield X[idx], y[idx]
