"""The one clock of the library and of its benchmarks: every reading waits for
all of MXNet's asynchronous work (``mx.nd.waitall()``) before the clock
starts and before it stops."""
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
    """Seconds of ``repeats`` timed calls of each run (:func:`seconds`), after
    ``warmup`` untimed calls of each. Several runs are timed round-robin, one
    call of each in turn, so a change in the machine's load touches all alike.

    Args:
        runs: A callable, or ``{name: callable}``.
        repeats: Timed calls of each.
        warmup: Untimed calls of each first.
        passes: Calls in a row each timed repeat keeps the fastest of.

    Returns:
        ``[seconds]`` for one callable; ``{name: [seconds]}`` for a dict.
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
