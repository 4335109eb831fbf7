"""Tools around the library: the crash-safe checkpoint store, the ps-lite
launcher, profiler traces and memory per device. They import the library
(:mod:`mp_symbolic.core`), never the training application."""
__all__ = []
