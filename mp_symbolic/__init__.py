"""Model parallelism in Apache MXNet 1.x, taught through one small network.

The network (:mod:`~mp_symbolic.model`) is three HybridBlocks whose ops and
parameters carry a ``ctx_group``; :mod:`~mp_symbolic.placement` maps groups to
devices; :mod:`~mp_symbolic.train` trains the symbolic graph (Module or
executor API) and its imperative Gluon twin on that plan.
"""
from .config import TrainConfig
from .model import StageDense, build_net, inference_symbol, stage_name, training_symbol
from .placement import DevicePlan, DeviceSpecError, make_plan, parse_devices

__all__ = ['TrainConfig', 'StageDense', 'build_net', 'inference_symbol', 'training_symbol',
           'stage_name', 'DevicePlan', 'DeviceSpecError', 'make_plan', 'parse_devices']
