"""How many blocks each pipeline stage gets.

Three ways, as in torchgpipe (``balance``) and DeepSpeed (``partition_method``):

* a list of ints: blocks per stage, given by the user;
* by parameter count (the default): contiguous stages whose largest
  parameter count is as small as it can be;
* by time: each block's forward + backward time on a sample batch, measured
  here, and the slowest stage made as fast as it can be.

Every stage gets at least one block and every block a stage: the partition is
solved exactly over contiguous splits (DeepSpeed's partitioner once emptied a
stage, #4053, and dropped trailing blocks, #4312).
"""
import statistics
import time

import mxnet as mx
import numpy as np

__all__ = []


class BalanceError(ValueError):
    """A ``balance`` that cannot split the blocks over the devices."""


def check_balance(balance, num_blocks, num_stages):
    """Validates a user's blocks-per-stage list.

    Returns:
        ``balance`` as a tuple of ints.

    Raises:
        BalanceError: not one positive integer per device, or not summing to
            the number of blocks.
    """
    try:
        balance = tuple(balance)
    except TypeError:
        raise BalanceError("balance: expected None, 'time' or a list of blocks per stage, "
                           'found %r' % (balance,)) from None
    if not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in balance):
        raise BalanceError('balance: expected integers (blocks per stage), found %r'
                           % (balance,))
    if len(balance) != num_stages:
        raise BalanceError('balance: expected one entry per device (devices: %d), found %d '
                           'entries %r' % (num_stages, len(balance), balance))
    if min(balance) < 1:
        raise BalanceError('balance: expected at least one block per stage, found %r'
                           % (balance,))
    if sum(balance) != num_blocks:
        raise BalanceError('balance: expected blocks per stage summing to the %d blocks, '
                           'found %r (sum %d)' % (num_blocks, balance, sum(balance)))
    return tuple(int(b) for b in balance)


def solve(costs, num_stages):
    """Blocks per stage minimising the largest stage cost.

    Contiguous stages, each non-empty. Ties are broken by the smaller sum of
    squared stage costs (the more even split), then by the earlier cut.

    Args:
        costs: Non-negative cost of each block, in order.
        num_stages: Stages to make (``1 <= num_stages <= len(costs)``).

    Returns:
        A tuple of ``num_stages`` positive ints summing to ``len(costs)``.

    Raises:
        BalanceError: more stages than blocks, or fewer than one.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise BalanceError('too many devices for the blocks (devices: %d, blocks: %d); '
                           'expected at most one device per block' % (num_stages, n))
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    inf = (float('inf'), float('inf'))
    # best[k][i]: (max, sum of squares) of the best split of blocks[:i] into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                c = prefix[i] - prefix[j]
                cand = (max(best[k - 1][j][0], c), best[k - 1][j][1] + c * c)
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))


def stage_of_block(balance):
    """``(2, 1)`` -> ``(0, 0, 1)``."""
    return tuple(s for s, count in enumerate(balance) for _ in range(count))


def param_counts(blocks):
    """Elements of every parameter (auxiliary states included) of each block.

    Raises:
        BalanceError: a parameter's shape is not known yet (deferred
            initialisation); give the layer its input size or a ``sample``.
    """
    counts = []
    for i, block in enumerate(blocks):
        total = 0
        for name, param in block.collect_params().items():
            shape = param.shape
            if shape is None or any(d == 0 for d in shape):
                raise BalanceError('balance by parameter count: expected every parameter shape '
                                   'to be known, found %s of block %d with shape %s (give the '
                                   'layer its input size, or pass sample=)'
                                   % (name, i, shape))
            total += int(np.prod(shape))
        counts.append(total)
    return counts


def forward_backward_times(blocks, sample_shape, ctx, repeats=5, seed=0):
    """Median seconds of one forward + backward pass of each block alone.

    Each block is bound by itself on ``ctx`` with random parameters, fed the
    shape the previous block outputs, and timed with ``mx.nd.waitall()``
    around each pass. The blocks' own parameters are not touched.

    Args:
        sample_shape: Shape of one input batch, batch dimension first.
        ctx: Device to time on.
    """
    rng = np.random.default_rng(seed)
    shape, times = tuple(sample_shape), []
    for block in blocks:
        for param in block.collect_params().values():
            param._var = None  # pylint: disable=protected-access
        out = block(mx.sym.var('x'))
        for param in block.collect_params().values():
            param._var = None  # pylint: disable=protected-access
        exe = out.simple_bind(ctx, grad_req='write', x=shape)
        times.append(time_forward_backward(exe, ctx, rng, repeats))
        shape = exe.outputs[0].shape
    return times


def time_forward_backward(exe, ctx, rng, repeats=5):
    """Median seconds of one forward + backward pass of the bound executor
    ``exe`` on ``ctx``, its arrays filled from ``rng``, with
    ``mx.nd.waitall()`` around each pass (the first, which allocates, untimed)."""
    for array in exe.arg_arrays + exe.aux_arrays:
        array[:] = rng.normal(0.0, 0.1, array.shape)
    head_grads = [mx.nd.ones(o.shape, ctx=ctx) for o in exe.outputs]
    samples = []
    for i in range(repeats + 1):
        mx.nd.waitall()
        start = time.perf_counter()
        exe.forward(is_train=True)
        exe.backward(out_grads=head_grads)
        mx.nd.waitall()
        if i:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def balance_by_size(blocks, partitions):
    """Blocks per stage for ``partitions`` stages, the largest stage's
    parameter count as small as it can be (torchgpipe's ``balance_by_size``
    counts memory the same way: parameters dominate a stage's share).

    Raises:
        BalanceError: a parameter shape is not known yet, or more stages
            than blocks.
    """
    return solve(param_counts(blocks), partitions)


def balance_by_time(blocks, sample, device=None, *, partitions, repeats=5):
    """Blocks per stage for ``partitions`` stages, the slowest stage's
    measured forward + backward time as small as it can be (torchgpipe's
    ``balance_by_time``). Pass the result as ``Pipeline(balance=...)``.

    Args:
        blocks: The Gluon blocks, in order.
        sample: A batch (numpy or NDArray) or its shape.
        device: Where to time them (default ``cpu(0)``); the device kind the
            pipeline will run on.
        partitions: Number of stages.
        repeats: Timed passes per block (their median counts).

    Raises:
        BalanceError: more stages than blocks.
    """
    shape = tuple(sample) if isinstance(sample, (tuple, list)) else tuple(sample.shape)
    costs = forward_backward_times(blocks, shape, device or mx.cpu(0), repeats=repeats)
    return solve(costs, partitions)
