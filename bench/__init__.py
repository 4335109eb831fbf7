"""Training benchmarks: ``python -m bench``.

Throughput of every training variant side by side in one process (median of
repeats after a warm-up, ``mx.nd.waitall()`` before each clock read), and
time to reach a full-data MSE, printed as ratios.
"""
