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

from ..core.task import as_inputs, num_examples

__all__ = []


def steps_per_epoch(num_examples, batch_size):
    return num_examples // batch_size


def epoch_order(num_examples, epoch, seed=0):
    """The permutation of epoch ``epoch``; depends only on ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def staged_batches(X, y, batch_size, epoch, seed, data_ctx, label_ctx, shard=(0, 1)):
    """Yields ``(X_batch, y_batch)`` NDArray views for one epoch.

    Args:
        X, y: numpy arrays, examples first; ``X`` a tuple of arrays for a
            network of several inputs (each batch is then a tuple too).
        data_ctx, label_ctx: Devices of the first and last stage.
        shard: ``(rank, parts)``: this worker's part of every global batch of
            ``batch_size`` examples (data-parallel workers each take their
            consecutive slice, so together they see exactly the global batch).
    """
    rank, parts = shard
    inputs = as_inputs(X)
    steps = steps_per_epoch(num_examples(X), batch_size)
    order = epoch_order(num_examples(X), epoch, seed)[:steps * batch_size]
    local = batch_size // parts
    # (steps, batch) -> this worker's columns -> (steps * local,)
    order = order.reshape(steps, batch_size)[:, rank * local:(rank + 1) * local].ravel()
    X_epoch = [mx.nd.array(x[order], ctx=data_ctx, dtype=np.float32) for x in inputs]
    y_epoch = mx.nd.array(y[order], ctx=label_ctx, dtype=np.float32)
    for i in range(steps):
        batch = tuple(x[i * local:(i + 1) * local] for x in X_epoch)
        yield (batch if isinstance(X, tuple) else batch[0]), y_epoch[i * local:(i + 1) * local]


def padded_batches(X, size):
    """``(inputs, count)`` for ``X`` in order, ``size`` examples at a time:
    ``inputs`` a list of numpy arrays (one per input), the last batch padded
    with zeros to ``size``; ``count`` the examples in it that are real."""
    inputs = as_inputs(X)
    for start in range(0, num_examples(X), size):
        parts = [x[start:start + size] for x in inputs]
        count = len(parts[0])
        batch = []
        for part in parts:
            full = np.zeros((size,) + part.shape[1:], dtype=np.float32)
            full[:count] = part
            batch.append(full)
        yield batch, count
