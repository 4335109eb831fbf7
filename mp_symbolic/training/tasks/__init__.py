"""Finding a task: a bundled one by name, a ``.py`` file, or a module.

``--task regression``, ``digits``, ``zoo`` and ``lm`` are the files beside
this one; ``--task my_task.py`` loads a file of the user's, ``--task pkg.mod`` an
importable module. Each defines ``task(**kwargs)`` returning an
:class:`mp_symbolic.Task`; ``--task-arg KEY=VALUE`` values are its keyword
arguments, and a ``seed`` parameter, if it has one, receives ``--seed``.
"""
import importlib
import importlib.util
import inspect
import os
import sys

from ...core.base.checks import raised

from ...tools.files import shown_path

__all__ = []

BUNDLED = ('regression', 'digits', 'zoo', 'lm')
DEFAULT_TASK = 'regression'  # the seed question's, what `train` runs without --task


class TaskLoadError(ValueError):
    """A task that cannot be loaded; the message says what was expected and
    what was found.

    Attributes:
        arg: The ``task()`` argument the error is about, or ``None``.
        spec: The task as given (``--task``).
    """

    def __init__(self, message, arg=None):
        super().__init__(message)
        self.arg = arg
        self.spec = None


def _load_module(spec):
    if spec in BUNDLED:
        return importlib.import_module('.' + spec, __name__)
    if spec.endswith('.py') or os.sep in spec:
        if not os.path.isfile(spec):
            raise TaskLoadError('expected a task file, found no file %s' % shown_path(spec))
        name = 'mp_symbolic_task_' + ''.join(c if c.isalnum() else '_' for c in
                                              os.path.splitext(os.path.basename(spec))[0])
        module_spec = importlib.util.spec_from_file_location(name, spec)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:  # pylint: disable=broad-except
            sys.modules.pop(name, None)
            raise TaskLoadError('expected a Python file that imports, found %s'
                                % raised(err)) from None
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as err:
        if err.name and spec.startswith(err.name):
            raise TaskLoadError('expected %s, a .py file or an importable module, found no '
                                'such module' % ', '.join(BUNDLED)) from None
        raise TaskLoadError('expected a module that imports, found %s' % raised(err)) from None
    except Exception as err:  # pylint: disable=broad-except
        raise TaskLoadError('expected a module that imports, found %s' % raised(err)) from None


def load_task(spec, task_args=(), seed=0):
    """The :class:`~mp_symbolic.Task` of ``spec``, made with ``task_args``.

    Returns:
        ``(task, arguments)``: the Task, and every keyword argument
        ``task()`` was called with, its defaults included (``seed`` aside),
        so that a checkpoint records what made its task.

    Args:
        spec: A bundled task's name, a ``.py`` path, or a module name.
        task_args: ``(key, value)`` pairs passed to ``task()`` as keyword
            arguments.
        seed: Passed as ``seed=`` when ``task()`` has such a parameter.

    Raises:
        TaskLoadError: no such task, it does not import, it has no
            ``task()``, ``task()`` raises or returns something else than a
            Task. A ``ValueError`` of ``task()`` whose message starts with
            the name of a given argument (``'widths: expected ...'``) keeps
            that name first, so the caller can name the flag.
    """
    try:
        return _load_task(spec, task_args, seed)
    except TaskLoadError as err:
        err.spec = spec
        raise


def _load_task(spec, task_args, seed):
    from mp_symbolic.core.task import Task, TaskError  # pylint: disable=import-outside-toplevel
    module = _load_module(spec)
    make = getattr(module, 'task', None)
    if not callable(make):
        raise TaskLoadError('expected a function task(**kwargs) returning mp_symbolic.Task, '
                            'found %s' % ('no task' if make is None else
                                          'task of type %s' % type(make).__name__))
    kwargs = dict(task_args)
    try:
        signature = inspect.signature(make)
    except (TypeError, ValueError):
        signature = None
    params = signature.parameters if signature is not None else {}
    arguments = dict(kwargs)
    for name, param in params.items():
        if name != 'seed' and name not in arguments and param.default is not param.empty \
                and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            arguments[name] = param.default
    if 'seed' in params and 'seed' not in kwargs:
        kwargs['seed'] = seed
    if signature is not None:
        try:  # the arguments first: a TypeError inside task() is task()'s own
            signature.bind(**kwargs)
        except TypeError as err:
            raise TaskLoadError('expected task() to take the given --task-arg names, found '
                                'TypeError: task() %s' % err) from None
    try:
        task = make(**kwargs)
    except ValueError as err:
        field, sep, _ = str(err).partition(': ')
        if sep and field in kwargs and not isinstance(err, TaskError):
            raise TaskLoadError(str(err).partition(': ')[2], arg=field) from None
        raise TaskLoadError('expected task() to return a Task, found it raised %s'
                            % raised(err)) from None
    except Exception as err:  # pylint: disable=broad-except
        raise TaskLoadError('expected task() to return a Task, found it raised %s'
                            % raised(err)) from None
    if not isinstance(task, Task):
        raise TaskLoadError('expected task() to return an mp_symbolic.Task, found %s'
                            % ('None' if task is None else type(task).__name__))
    return task, arguments
