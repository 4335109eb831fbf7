"""Clock readings for the benchmark, each after ``mx.nd.waitall()``.

MXNet runs operators asynchronously: without ``waitall()`` a clock read
measures how fast Python queued work, not how fast it ran. Every reading is
the library's one clock (:mod:`mp_symbolic.core.base.timing`).
"""
import os
import platform
import statistics

import mxnet as mx

from mp_symbolic.core.base import timing
from mp_symbolic.training.tasks.regression import full_mse

__all__ = ['throughput', 'time_to_accuracy', 'machine_info']


def throughput(variants, batch_size, num_steps, repeats, warmup):
    """Median samples/s of ``repeats`` timed runs of ``num_steps`` steps each.

    Repeats go round-robin over the variants, so a change in machine load
    during the run touches every variant alike instead of the last ones.

    Args:
        variants: ``{name: object with run(num_steps)}``.
        warmup: Untimed steps first (graph binding, memory pools, oneDNN primitives).

    Returns:
        ``{name: (median, [samples/s of each repeat])}``.
    """
    for variant in variants.values():
        variant.run(warmup)
    times = timing.repeat({name: lambda v=variant: v.run(num_steps)
                           for name, variant in variants.items()}, repeats, warmup=0)
    rates = {name: [num_steps * batch_size / t for t in ts] for name, ts in times.items()}
    return {name: (statistics.median(r), r) for name, r in rates.items()}


def time_to_accuracy(variant, X, y, steps_per_epoch, target, max_epochs, max_seconds):
    """Training time until the full-data MSE is at most ``target``.

    The MSE is checked once per epoch, off the clock.

    Returns:
        ``(seconds, reached, epochs run, last MSE)``: ``reached`` is False
        when a cap stopped the run first; ``seconds`` is then the training
        time until it stopped (a lower bound).
    """
    elapsed, mse = 0.0, float('nan')
    for epoch in range(1, max_epochs + 1):
        elapsed += timing.seconds(lambda: variant.run(steps_per_epoch))
        mse = full_mse(variant.params(), X, y)
        if mse <= target:
            return elapsed, True, epoch, mse
        if elapsed >= max_seconds:
            break
    return elapsed, False, epoch, mse


def machine_info():
    """``{'cores', 'cpu', 'mxnet', 'python', 'load'}`` of this machine."""
    cpu = platform.processor() or 'unknown'
    try:
        with open('/proc/cpuinfo') as f:
            names = [line.split(':', 1)[1].strip() for line in f
                     if line.startswith('model name')]
        cpu = names[0] if names else cpu
    except OSError:
        pass  # not Linux: keep platform's answer
    return {'cores': os.cpu_count(), 'cpu': cpu, 'mxnet': mx.__version__,
            'python': platform.python_version(),
            'load': '%.2f %.2f %.2f' % os.getloadavg()}
