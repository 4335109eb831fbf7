"""The project's custom operators for the benchmarks: those of
:mod:`mp_symbolic.core.kernels`, built on first use and loaded into the
process (``fused_layer_norm``, ``mp_symbolic/core/kernels/fused_layer_norm.cc``).
"""
from mp_symbolic.core.kernels import fused_layer_norm

__all__ = ['fused_layer_norm']
