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
bundled tasks). The names of ``__all__`` are imported on first use, so that
``python -m mp_symbolic --help`` answers without loading MXNet; the training
application's ``TrainConfig`` is ``mp_symbolic.training.TrainConfig``.
"""
import os

# MXNet logs a line each time it binds a graph with its oneDNN subgraph
# backend; it reads this once, so it is set before anything binds.
os.environ.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')

__all__ = [
    'BalanceError', 'CheckpointError', 'ColumnParallelDense', 'DevicePlan', 'DeviceSpecError',
    'OptimizerStateError', 'PerDeviceUpdater', 'PerShard', 'Pipeline', 'PipelineModule',
    'Report', 'RowParallelDense', 'Task', 'TaskError', 'Trainer', 'VocabParallelEmbedding',
    'balance_by_size', 'balance_by_time', 'make_plan', 'parse_devices', 'read_checkpoint',
    'save_checkpoint', 'stage_name',
]


def _public():
    """The public names, each imported from its module by name."""
    # pylint: disable=import-outside-toplevel
    from .core.balance import BalanceError, balance_by_size, balance_by_time
    from .core.devices import DevicePlan, DeviceSpecError, make_plan, parse_devices
    from .core.module import PipelineModule
    from .core.names import stage_name
    from .core.optstate import OptimizerStateError
    from .core.pipeline import Pipeline
    from .core.task import Report, Task, TaskError
    from .core.tensor_parallel import (ColumnParallelDense, PerShard, RowParallelDense,
                                       VocabParallelEmbedding)
    from .core.trainer import Trainer
    from .core.updater import PerDeviceUpdater
    from .tools.checkpoint import CheckpointError, read_checkpoint, save_checkpoint
    return {value.__name__: value for value in (
        BalanceError, balance_by_size, balance_by_time, DevicePlan, DeviceSpecError, make_plan,
        parse_devices, PipelineModule, stage_name, OptimizerStateError, Pipeline, Report, Task,
        TaskError, ColumnParallelDense, PerShard, RowParallelDense, VocabParallelEmbedding,
        Trainer, PerDeviceUpdater, CheckpointError, read_checkpoint, save_checkpoint)}


def __getattr__(name):
    # On first use, so that python -m mp_symbolic --help answers without MXNet.
    if name == 'TrainConfig':
        # the training application's (mp_symbolic.training.TrainConfig); read
        # here too, where earlier releases listed it
        from .training.config import TrainConfig  # pylint: disable=import-outside-toplevel
        return TrainConfig
    if name not in __all__:
        raise AttributeError('module %r has no attribute %r' % (__name__, name))
    names = _public()
    globals().update(names)
    return names[name]


def __dir__():
    return sorted(list(globals()) + __all__)
