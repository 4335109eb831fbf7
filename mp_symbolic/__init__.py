"""Model parallelism in Apache MXNet 1.x, taught through one small network.

The network (:mod:`~mp_symbolic.model`) is three HybridBlocks whose ops and
parameters carry a ``ctx_group``; :mod:`~mp_symbolic.placement` maps groups to
devices; :mod:`~mp_symbolic.train` trains the symbolic graph (Module or
executor API) and its imperative Gluon twin on that plan.

The names below are imported on first use, so that ``python -m mp_symbolic
--help`` answers without loading MXNet.
"""
import importlib
import os

# MXNet logs a line each time it binds a graph with its oneDNN subgraph
# backend; it reads this once, so it is set before anything binds.
os.environ.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')

__all__ = ['TrainConfig', 'StageDense', 'build_net', 'inference_symbol', 'training_symbol',
           'stage_name', 'DevicePlan', 'DeviceSpecError', 'make_plan', 'parse_devices']

_MODULE_OF = {
    'TrainConfig': 'config', 'StageDense': 'model', 'build_net': 'model',
    'inference_symbol': 'model', 'training_symbol': 'model', 'stage_name': 'model',
    'DevicePlan': 'placement', 'DeviceSpecError': 'placement', 'make_plan': 'placement',
    'parse_devices': 'placement',
}


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError('module %r has no attribute %r' % (__name__, name))
    return getattr(importlib.import_module('.' + _MODULE_OF[name], __name__), name)


def __dir__():
    return sorted(list(globals()) + __all__)
