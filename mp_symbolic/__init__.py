"""Model parallelism for Gluon networks on Apache MXNet 1.x.

* :class:`Pipeline` splits Gluon ``HybridBlock`` s into stages, one device
  each, by tagging every op and parameter with a ``ctx_group``;
  ``pipe.module(loss=...)`` is an ``mx.mod.Module`` bound to those devices
  (``fit``, ``score``, ``predict``, ``save_checkpoint`` work as usual), and the
  Pipeline itself is the imperative Gluon twin.
* :class:`ColumnParallelDense`, :class:`RowParallelDense` and
  :class:`VocabParallelEmbedding` split one layer's weight over the devices
  of a stage (``'cpu:0+cpu:1,cpu:2'``): tensor parallelism, Megatron-LM's way;
  :class:`ShardedBlock` is their base, for a parallel layer of one's own.
* :class:`Trainer` is ``gluon.Trainer`` for parameters on any devices (stages,
  replicas or both).
* :class:`Task` describes a workload for ``python -m mp_symbolic train --task FILE``.
* :func:`save_checkpoint` / :func:`read_checkpoint` commit a Module's
  parameters, optimizer state and plan as one unit, and read them back for a
  Pipeline rebuilt in another process, on any plan.
* :func:`memory_table` gives a Module's bytes per device: parameters,
  gradients, optimizer state, auxiliary states, inputs, host copy;
  :func:`estimate_memory` gives the same table for a plan before anything
  is allocated.

The layers, from the tree: :mod:`mp_symbolic.core` (the library; MXNet and
the standard library only), :mod:`mp_symbolic.tools` (store, launcher,
traces, memory), :mod:`mp_symbolic.training` (the command line and the
bundled tasks). The names of ``__all__`` are imported on first use, so that
``python -m mp_symbolic --help`` answers without loading MXNet; the training
application's ``TrainConfig`` is ``mp_symbolic.training.TrainConfig``.
"""
import importlib
import os

# MXNet logs a line each time it binds a graph with its oneDNN subgraph
# backend; it reads this once, so it is set before anything binds.
os.environ.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')

# Each public name and the module it lives in, imported on first use.
_HOMES = {
    'Action': 'core.schedule', 'BalanceError': 'core.placement.balance',
    'CheckpointError': 'tools.checkpoint', 'ColumnParallelDense': 'core.parallel.tensor_parallel',
    'DevicePlan': 'core.placement.devices', 'DeviceSpecError': 'core.placement.devices',
    'OptimizerStateError': 'core.optim.optstate', 'PerDeviceUpdater': 'core.optim.updater',
    'PerShard': 'core.parallel.tensor_parallel', 'Pipeline': 'core.pipeline',
    'PipelineModule': 'core.engine.module', 'Report': 'core.task',
    'RowParallelDense': 'core.parallel.tensor_parallel', 'ScheduleError': 'core.schedule',
    'ShardedBlock': 'core.parallel.tensor_parallel',
    'Task': 'core.task', 'TaskError': 'core.task', 'Trainer': 'core.optim.trainer',
    'VocabParallelEmbedding': 'core.parallel.tensor_parallel', 'balance_by_size': 'core.placement.balance',
    'balance_by_time': 'core.placement.balance', 'estimate_memory': 'tools.planning',
    'make_plan': 'core.placement.devices',
    'memory_table': 'tools.memory', 'parse_devices': 'core.placement.devices', 'read_checkpoint': 'tools.checkpoint',
    'save_checkpoint': 'tools.checkpoint', 'stage_name': 'core.graph.names',
}
__all__ = sorted(_HOMES)


def __getattr__(name):
    # On first use, so that python -m mp_symbolic --help answers without MXNet.
    if name == 'TrainConfig':
        # the training application's (mp_symbolic.training.TrainConfig); read
        # here too, where earlier releases listed it
        from .training.config import TrainConfig  # pylint: disable=import-outside-toplevel
        return TrainConfig
    if name not in _HOMES:
        raise AttributeError('module %r has no attribute %r' % (__name__, name))
    value = getattr(importlib.import_module('.' + _HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
