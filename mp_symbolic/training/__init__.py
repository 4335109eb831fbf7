"""The training application: ``python -m mp_symbolic train|compare``, its
config, loop and steppers, and the bundled tasks. A user of the library like
any other; nothing in :mod:`mp_symbolic.core` or :mod:`mp_symbolic.tools`
imports it. Its config is :class:`TrainConfig` (read on first use, so that
``python -m mp_symbolic --help`` answers without MXNet)."""
__all__ = ['TrainConfig']


def __getattr__(name):
    if name != 'TrainConfig':
        raise AttributeError('module %r has no attribute %r' % (__name__, name))
    from .config import TrainConfig  # pylint: disable=import-outside-toplevel
    return TrainConfig
