"""The training application: ``python -m mp_symbolic train|compare``, its
config, loop and steppers, and the bundled tasks. A user of the library like
any other; nothing in :mod:`mp_symbolic.core` or :mod:`mp_symbolic.tools`
imports it."""
__all__ = []
