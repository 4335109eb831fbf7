"""Model parallelism for Gluon networks on Apache MXNet 1.x.

* :class:`Pipeline` splits Gluon ``HybridBlock`` s into stages, one device
  each, by tagging every op and parameter with a ``ctx_group``;
  ``pipe.module(loss=...)`` is an ``mx.mod.Module`` bound to those devices
  (``fit``, ``score``, ``predict``, ``save_checkpoint`` work as usual), and the
  Pipeline itself is the imperative Gluon twin.
* :class:`ColumnParallelDense`, :class:`RowParallelDense` and
  :class:`VocabParallelEmbedding` split one layer's weight over the devices
  of a stage (``'cpu:0+cpu:1,cpu:2'``): tensor parallelism, Megatron-LM's way.
* :class:`Trainer` is ``gluon.Trainer`` for parameters on any devices (stages,
  replicas or both).
* :class:`Task` describes a workload for ``python -m mp_symbolic train --task FILE``.
* :func:`save_checkpoint` / :func:`read_checkpoint` commit a Module's
  parameters, optimizer state and plan as one unit, and read them back for a
  Pipeline rebuilt in another process, on any plan.

The layers, from the tree: :mod:`mp_symbolic.core` (the library; MXNet and
the standard library only), :mod:`mp_symbolic.tools` (store, launcher,
traces, memory), :mod:`mp_symbolic.training` (the command line and the
bundled tasks). Names below are imported on first use, so that
``python -m mp_symbolic --help`` answers without loading MXNet.
"""
import importlib
import os

# MXNet logs a line each time it binds a graph with its oneDNN subgraph
# backend; it reads this once, so it is set before anything binds.
os.environ.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')

_MODULE_OF = {
    'Pipeline': 'core.pipeline', 'PipelineModule': 'core.module',
    'PerDeviceUpdater': 'core.updater', 'Trainer': 'core.trainer', 'Task': 'core.task', 'Report': 'core.task',
    'balance_by_time': 'core.balance', 'balance_by_size': 'core.balance',
    'DevicePlan': 'core.devices', 'make_plan': 'core.devices',
    'parse_devices': 'core.devices', 'stage_name': 'core.names',
    'DeviceSpecError': 'core.devices', 'BalanceError': 'core.balance',
    'TaskError': 'core.task', 'OptimizerStateError': 'core.optstate',
    'save_checkpoint': 'tools.checkpoint', 'read_checkpoint': 'tools.checkpoint',
    'CheckpointError': 'tools.checkpoint', 'TrainConfig': 'training.config',
    'ColumnParallelDense': 'core.tensor_parallel', 'RowParallelDense': 'core.tensor_parallel',
    'VocabParallelEmbedding': 'core.tensor_parallel', 'PerShard': 'core.tensor_parallel',
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError('module %r has no attribute %r' % (__name__, name))
    return getattr(importlib.import_module('.' + _MODULE_OF[name], __name__), name)


def __dir__():
    return sorted(list(globals()) + __all__)
