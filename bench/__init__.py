"""Training benchmarks: ``python -m bench``.

Throughput of every training variant side by side in one process (median of
repeats after a warm-up, ``mx.nd.waitall()`` before each clock read), and
time to reach a full-data MSE, printed as ratios.
"""
import sys

CHOICE = None  # what :func:`mp_symbolic.tools.blas.at_start` chose, where it ran
if sys.argv[:1] == ['-m']:
    # ``python -m bench`` or ``python -m bench.NAME`` starting (Python names the
    # module '-m' while it finds it): OpenBLAS at the CPU's kernel, chosen before
    # MXNet loads, as for ``python -m mp_symbolic``; a test importing a benchmark
    # changes nothing.
    from mp_symbolic.tools.blas import at_start
    from mp_symbolic.tools.startup import mxnet_without_sklearn
    CHOICE = at_start()
    mxnet_without_sklearn()  # MXNet loads as where scikit-learn is absent
