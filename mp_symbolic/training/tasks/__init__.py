"""The workloads the command line trains, each a user of the library.

A task says what data there is, which Gluon blocks make the network, which
loss head trains it, how a batch's loss is read on the device, and how the
trained network is judged. :func:`get_task` returns one by name.
"""
import importlib

__all__ = []

TASKS = ('regression', 'digits')


def get_task(name):
    """The task module named ``name`` (``'regression'`` or ``'digits'``).

    Raises:
        ValueError: no task of that name.
    """
    if name not in TASKS:
        raise ValueError('task: expected %s, found %r' % (' or '.join(TASKS), name))
    return importlib.import_module('.' + name, __name__)
