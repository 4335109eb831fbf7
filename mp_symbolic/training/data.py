"""Batches staged on their devices once per epoch.

Each epoch's examples are shuffled by ``(seed, epoch)`` alone, so every
variant, device plan and resumed run sees the same batches in the same order.
The epoch's inputs are copied to the first stage's device and its labels to
the last stage's in one transfer each; a batch is then a view of those arrays
(no per-step conversion from numpy). A last batch smaller than ``batch_size``
is dropped: a bound executor has a fixed batch shape.
"""
import mxnet as mx
import numpy as np

__all__ = []


def steps_per_epoch(num_examples, batch_size):
    return num_examples // batch_size


def epoch_order(num_examples, epoch, seed=0):
    """The permutation of epoch ``epoch``; depends only on ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def staged_batches(X, y, batch_size, epoch, seed, data_ctx, label_ctx, shard=(0, 1)):
    """Yields ``(X_batch, y_batch)`` NDArray views for one epoch.

    Args:
        X, y: numpy arrays, examples first.
        data_ctx, label_ctx: Devices of the first and last stage.
        shard: ``(rank, parts)``: this worker's part of every global batch of
            ``batch_size`` examples (data-parallel workers each take their
            consecutive slice, so together they see exactly the global batch).
    """
    rank, parts = shard
    steps = steps_per_epoch(len(X), batch_size)
    order = epoch_order(len(X), epoch, seed)[:steps * batch_size]
    local = batch_size // parts
    # (steps, batch) -> this worker's columns -> (steps * local,)
    order = order.reshape(steps, batch_size)[:, rank * local:(rank + 1) * local].ravel()
    X_epoch = mx.nd.array(X[order], ctx=data_ctx, dtype=np.float32)
    y_epoch = mx.nd.array(y[order], ctx=label_ctx, dtype=np.float32)
    for i in range(steps):
        yield X_epoch[i * local:(i + 1) * local], y_epoch[i * local:(i + 1) * local]
