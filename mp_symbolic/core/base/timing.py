"""The one clock of the library and of its benchmarks.

MXNet runs operators asynchronously, so every reading here waits for all
of MXNet's work (``mx.nd.waitall()``) before the clock starts and again
before it stops: nothing queued earlier is counted, and everything the
timed call queued is. ``balance_by_time``, the training loop and
``bench/`` all read it.
"""
import statistics
import time

import mxnet as mx

__all__ = []


def seconds(fn):
    """Seconds ``fn()`` takes, until every operation it queued has run."""
    mx.nd.waitall()
    start = time.perf_counter()
    fn()
    mx.nd.waitall()
    return time.perf_counter() - start


def repeat(runs, repeats, warmup=1, passes=1):
    """Seconds of ``repeats`` timed calls of each run (:func:`seconds`),
    after ``warmup`` untimed calls of each (binding, memory pools, oneDNN
    primitives are made on the first ones); with ``passes`` above 1, each
    of the ``repeats`` is the fastest of that many calls in a row (the
    run's memory warm, as in a run of steps).

    Several runs are timed round-robin, one call of each in turn, so that a
    change in the machine's load during the measurement touches every run
    alike instead of the last ones.

    Args:
        runs: A callable, or ``{name: callable}``.
        repeats: Timed calls of each.
        warmup: Untimed calls of each first.
        passes: Calls in a row a timed repeat keeps the fastest of.

    Returns:
        ``[seconds of each call]`` for one callable; ``{name: [seconds]}``
        for a dict.
    """
    named = runs if isinstance(runs, dict) else {None: runs}
    for _ in range(warmup):
        for fn in named.values():
            fn()
    times = {name: [] for name in named}
    for _ in range(repeats):
        for name, fn in named.items():
            times[name].append(min(seconds(fn) for _ in range(passes)))
    return times if isinstance(runs, dict) else times[None]


def median_seconds(fn, repeats, warmup=1):
    """The median of :func:`repeat` ``(fn, repeats, warmup)``."""
    return statistics.median(repeat(fn, repeats, warmup))
