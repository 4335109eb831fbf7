"""The tolerance within which two runs of the same computation agree.

Two runs "agree" when every loss and parameter satisfies
``|a - b| <= AGREE_ATOL + AGREE_RTOL * |b|`` (``numpy.allclose``). float32
arithmetic on different devices, or summed over micro-batches in another
order, may round differently; measured differences here are far smaller.
"""

__all__ = []

AGREE_RTOL = 1e-4
AGREE_ATOL = 1e-5
