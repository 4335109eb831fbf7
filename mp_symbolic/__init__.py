"""Model parallelism for Gluon networks on Apache MXNet 1.x.

* :class:`Pipeline` splits a list of Gluon ``HybridBlock`` s into stages, one
  device each, by tagging every op and parameter with a ``ctx_group``;
  ``pipe.module(loss=...)`` is an ``mx.mod.Module`` bound to those devices
  (``fit``, ``score``, ``predict``, ``save_checkpoint`` work as usual), and the
  Pipeline itself is the imperative Gluon twin.
* :class:`Trainer` is ``gluon.Trainer`` for parameters on any devices (stages,
  replicas or both).
* :mod:`~mp_symbolic.placement` maps stages to devices, :mod:`~mp_symbolic.balance`
  decides how many blocks each stage gets.

The command line (``python -m mp_symbolic train|compare``) trains the two
example workloads in :mod:`mp_symbolic.tasks`. Names below are imported on
first use, so that ``python -m mp_symbolic --help`` answers without loading
MXNet.
"""
import importlib
import os

# MXNet logs a line each time it binds a graph with its oneDNN subgraph
# backend; it reads this once, so it is set before anything binds.
os.environ.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')

__all__ = ['Pipeline', 'PipelineModule', 'PerDeviceUpdater', 'Trainer', 'TrainConfig',
           'DevicePlan', 'DeviceSpecError', 'BalanceError', 'make_plan', 'parse_devices',
           'stage_name']

_MODULE_OF = {
    'Pipeline': 'pipeline', 'PipelineModule': 'module', 'PerDeviceUpdater': 'module',
    'Trainer': 'trainer', 'TrainConfig': 'config', 'DevicePlan': 'placement',
    'DeviceSpecError': 'placement', 'make_plan': 'placement', 'parse_devices': 'placement',
    'stage_name': 'placement', 'BalanceError': 'balance',
}


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError('module %r has no attribute %r' % (__name__, name))
    return getattr(importlib.import_module('.' + _MODULE_OF[name], __name__), name)


def __dir__():
    return sorted(list(globals()) + __all__)
