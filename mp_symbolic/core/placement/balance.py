"""How many blocks each pipeline stage gets (torchgpipe's ``balance``): given,
by parameter count (the default), or by measured time. Invariant: every
stage gets at least one block, contiguous, solved exactly (:func:`solve`)."""
import mxnet as mx
import numpy as np

from ..base.checks import DeviceSpecError, is_int
from ..base.compat import embedding_ids, fresh_variables
from ..base.timing import median_seconds

__all__ = []


class BalanceError(ValueError):
    """A ``balance`` that cannot split the blocks over the devices."""


class CutError(BalanceError):
    """A graph that cannot be cut as asked (too few ops, a bad balance, ...)."""


class TooManyStages(DeviceSpecError, BalanceError):
    """More stages than blocks (or ops): a ``DeviceSpecError`` and a
    ``BalanceError`` alike; the stages per device asked for, where more than
    one, are counted in the message."""


def check_stage_count(num_stages, count, unit='blocks', per_replica=False, virtual=1):
    """Raises :class:`TooManyStages` unless ``count`` blocks (``unit``: blocks,
    layers, ops) can fill ``num_stages`` stages (``per_replica``: one
    replica's; ``virtual`` per device), one each."""
    if num_stages <= count:
        return
    whole = {'ops': 'graph'}.get(unit, unit)
    if virtual > 1:
        raise TooManyStages('too many stages for the %s (devices per replica: %d, %d stages on '
                            'each: %d stages, %s: %d); expected at most one stage per %s'
                            % (whole, num_stages // virtual, virtual, num_stages, unit, count,
                               unit[:-1]))
    raise TooManyStages('too many devices for the %s (devices%s: %d, %s: %d); expected at most '
                        'one device per %s' % (whole, ' per replica' if per_replica else '',
                                               num_stages, unit, count, unit[:-1]))


def balance_kind(balance, has_sample, unit='blocks', error=BalanceError):
    """What a ``balance=`` asks for: ``'size'`` (``None``), ``'time'`` or
    ``'given'`` (a list of ``unit`` per stage).

    Raises:
        error: another string, or ``'time'`` without a sample.
    """
    if balance is None:
        return 'size'
    if isinstance(balance, str):
        if balance != 'time':
            raise error("balance: expected None, 'time' or a list of %s per stage, found %r"
                        % (unit, balance))
        if not has_sample:
            raise error("balance='time': expected sample= (a batch or its shape) to time the "
                        '%s on, found none' % unit)
        return 'time'
    return 'given'


def check_balance(balance, num_items, num_stages, unit='blocks'):
    """A user's list of ``unit`` per stage (summing to ``num_items``) as a tuple
    of ints.

    Raises:
        BalanceError: not one positive integer per device, or another sum.
    """
    try:
        balance = tuple(balance)
    except TypeError:
        raise BalanceError("balance: expected None, 'time' or a list of %s per stage, "
                           'found %r' % (unit, balance)) from None
    if not all(is_int(b) for b in balance):
        raise BalanceError('balance: expected integers (%s per stage), found %r'
                           % (unit, balance))
    if len(balance) != num_stages:
        raise BalanceError('balance: expected one entry per device (devices: %d), found %d '
                           'entries %r' % (num_stages, len(balance), balance))
    if min(balance) < 1:
        raise BalanceError('balance: expected at least one %s per stage, found %r'
                           % (unit[:-1], balance))
    if sum(balance) != num_items:
        raise BalanceError('balance: expected %s per stage summing to the %d %s, '
                           'found %r (sum %d)' % (unit, num_items, unit, balance, sum(balance)))
    return tuple(int(b) for b in balance)


def solve(costs, num_stages, cross=None, slack=0.0, unit='blocks', virtual=1):
    """Blocks (or ops) per stage, contiguous, each stage at least one: first the
    smallest largest stage cost ``B``; then, among splits whose every stage
    costs at most ``B * (1 + slack)``, the fewest bytes crossing; then the
    smaller sum of squared stage costs; then the earlier cut.

    Args:
        costs: Non-negative cost of each block (op), in order.
        cross: Bytes crossing a cut after each position (``None``: balance only).
        unit: What the costs are of, for the message.
        virtual: The stages per device of ``num_stages``, for the message.

    Returns:
        A tuple of ``num_stages`` positive ints summing to ``len(costs)``.

    Raises:
        BalanceError: more stages than blocks (ops), or fewer than one.
    """
    n = len(costs)
    if num_stages < 1:
        raise BalanceError('expected at least one device, found %d' % num_stages)
    check_stage_count(num_stages, n, unit, virtual=virtual)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    # bottleneck[k][i]: smallest largest stage over splits of items[:i] into k stages
    inf = np.inf
    bottleneck = np.full((num_stages + 1, n + 1), inf)
    bottleneck[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            j = np.arange(k - 1, i)
            bottleneck[k][i] = np.min(np.maximum(bottleneck[k - 1][j], prefix[i] - prefix[j]))
    best = bottleneck[num_stages][n]
    cap = best * (1.0 + slack) + 1e-9 * max(1.0, abs(best))
    cross = np.zeros(n) if cross is None else np.asarray(cross, dtype=np.float64)
    # ties are judged relative to the costs' scale, so that float noise stays out of them
    scale = max(float(prefix[-1]) ** 2, 1e-300)
    # (bytes, sum of squares) of the best split of items[:i] into k stages within cap
    size = np.full((num_stages + 1, n + 1), inf)
    squares = np.full((num_stages + 1, n + 1), inf)
    cut = np.zeros((num_stages + 1, n + 1), dtype=np.int64)
    size[0][0] = squares[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            j = np.arange(k - 1, i)
            stage = prefix[i] - prefix[j]
            ok = (stage <= cap) & np.isfinite(size[k - 1][j])
            if not ok.any():
                continue
            # a cut before items[j] (j > 0) makes cross[j - 1] bytes cross
            b = size[k - 1][j] + np.where(j > 0, cross[np.maximum(j - 1, 0)], 0.0)
            q = squares[k - 1][j] + stage * stage
            b, q = np.where(ok, b, inf), np.where(ok, q, inf)
            # lexicographic (bytes, squares, j)
            pick = np.lexsort((j, np.round(q / scale, 9), np.round(b, 3)))[0]
            size[k][i], squares[k][i], cut[k][i] = b[pick], q[pick], j[pick]
    assert np.isfinite(size[num_stages][n])  # the bottleneck split itself is within cap
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = int(cut[k][i])
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))


def even_split(total, parts):
    """Sizes of ``parts`` contiguous parts of ``total``, the first ones larger by
    one where it does not divide: ``even_split(7, 3) == [3, 2, 2]``."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def stage_of_block(balance):
    """``(2, 1)`` -> ``(0, 0, 1)``."""
    return tuple(s for s, count in enumerate(balance) for _ in range(count))


def param_counts(blocks):
    """Elements of every parameter (auxiliary states included) of each block.

    Raises:
        BalanceError: a parameter's shape is not known yet.
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
    """Median seconds of one forward and backward pass of each block bound alone
    on ``ctx`` with random parameters, fed the shape (``sample_shape``, batch
    first) the previous block outputs; the blocks' own parameters untouched."""
    rng = np.random.default_rng(seed)
    shape, times = tuple(sample_shape), []
    for block in blocks:
        with fresh_variables(block):
            out = block(mx.sym.var('x'))
        times.append(time_forward_backward(out, {'x': shape}, ctx, rng, repeats))
        shape = out.infer_shape(x=shape)[1][0]
    return times


def time_forward_backward(symbol, input_shapes, ctx, rng, repeats=5, input_dtypes=None):
    """Median seconds of one forward and backward pass of ``symbol`` bound alone
    on ``ctx`` on ``input_shapes`` (``{name: shape}``, float32 but
    ``input_dtypes``), its arrays random from ``rng`` (integers ones), every
    floating-point argument but Embedding ids with a gradient."""
    no_gradient = embedding_ids(symbol, input_shapes)
    dtypes = dict(input_dtypes or {})
    exe = symbol.simple_bind(ctx, grad_req={
        a: 'null' if a in no_gradient or not np.issubdtype(dtypes.get(a, np.float32), np.floating)
        else 'write' for a in symbol.list_arguments()}, type_dict=dtypes or None, **input_shapes)
    for array in exe.arg_arrays + exe.aux_arrays:
        array[:] = rng.normal(0.0, 0.1, array.shape) \
            if np.issubdtype(array.dtype, np.floating) else 1
    head_grads = [mx.nd.ones(o.shape, ctx=ctx, dtype=o.dtype) for o in exe.outputs]

    def step():
        exe.forward(is_train=True)
        exe.backward(out_grads=head_grads)
    return median_seconds(step, repeats, warmup=1)


def balance_by_size(blocks, partitions):
    """Blocks per stage for ``partitions`` stages, the largest stage's parameter
    count as small as it can be (torchgpipe's ``balance_by_size``).

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
