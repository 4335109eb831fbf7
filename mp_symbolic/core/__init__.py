"""The library: a Pipeline over devices, its Module, Trainer and task type.

Imports MXNet and the standard library only. The public names are those of
:mod:`mp_symbolic`; the modules here are internal.
"""
__all__ = []
