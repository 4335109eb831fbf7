"""The value checks every boundary shares, each raising ``field: expected X,
found Y`` so a value is refused in the same words wherever it enters."""
import os
import traceback

__all__ = []

# A learning rate: below 1e-30 a float32 update is lost in rounding; above 1e6
# nothing trains. Task and TrainConfig share it.
LR_RANGE = (1e-30, 1e6)
LR_EXPECTED = 'a number in [1e-30, 1e6]'
MOMENTUM_EXPECTED = 'a number in [0, 1)'
POSITIVE_EXPECTED = 'a positive integer'
EXCERPT_LIMIT = 80  # characters of a value quoted in a message
# Node processes one job may have (here, without MXNet, so that the launcher and
# TrainConfig refuse more before any process starts, as mp_symbolic.core.transport.nodes does)
MAX_NODES = 1024


class DeviceSpecError(ValueError):
    """A ``--devices`` value that cannot become a device plan (defined without
    MXNet, for the ONNX predictor)."""


def excerpt(text, limit=EXCERPT_LIMIT):
    """``text`` cut to ``limit`` characters, ``...`` marking the cut."""
    return text if len(text) <= limit else text[:limit - 3] + '...'


def raised(err):
    """``'ValueError: message (my_task.py, line 12)'``: an error of the user's
    code on one line, with its innermost frame outside this package."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not os.path.abspath(f.filename).startswith(package + os.sep)]
    where = ' (%s, line %d)' % (os.path.basename(frames[-1].filename), frames[-1].lineno) \
        if frames else ''
    message = ' '.join(str(err).split())
    return '%s%s%s' % (type(err).__name__, ': ' + message if message else '', where)


def is_int(value):
    """Whether ``value`` is an integer (a ``bool`` is not one; numpy's are)."""
    return isinstance(value, int) and not isinstance(value, bool) or \
        type(value).__module__ == 'numpy' and type(value).__name__.startswith(('int', 'uint'))


def is_positive_int(value):
    """Whether ``value`` is an integer of at least 1."""
    return is_int(value) and value >= 1


def positive_int(field, value, error=ValueError):
    """``value`` as an ``int``.

    Raises:
        error: ``value`` is not an integer of at least 1.
    """
    if not is_positive_int(value):
        raise error('%s: expected %s, found %r' % (field, POSITIVE_EXPECTED, value))
    return int(value)


def node_count(nodes, devices_per_replica=None, most_devices=None, error=ValueError):
    """``nodes`` checked as :func:`mp_symbolic.core.transport.nodes.node_of_devices`
    checks it, as far as the devices are known.

    Args:
        devices_per_replica: The devices of one replica, where known.
        most_devices: Otherwise the most there can be (``None``: no bound).

    Raises:
        error: ``nodes`` is not a positive integer, is above
            :data:`MAX_NODES`, or above the devices of a replica.
    """
    nodes = positive_int('nodes', nodes, error)
    if nodes > MAX_NODES:
        raise error('nodes: expected at most %d, found %d' % (MAX_NODES, nodes))
    if devices_per_replica is not None and nodes > devices_per_replica:
        raise error('nodes: expected at most as many nodes as devices per replica (%d), '
                    'found %d (a node would hold no stage)' % (devices_per_replica, nodes))
    if devices_per_replica is None and most_devices is not None and nodes > most_devices:
        raise error('nodes: expected at most as many nodes as devices per replica (at most %d '
                    'where the devices are not given), found %d (a node would hold no stage)'
                    % (most_devices, nodes))
    return nodes


def is_lr(value):
    """Whether ``value`` is a learning rate in :data:`LR_RANGE`."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        LR_RANGE[0] <= value <= LR_RANGE[1]


def is_momentum(value):
    """Whether ``value`` is an SGD momentum, in ``[0, 1)``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1


def tied_owners(tied, names, num_stages, what, error=ValueError):
    """``tied`` (``{parameter name: stage}`` or ``None``) checked as
    ``{name: int stage}``.

    Args:
        what: What the names are the parameters of, for the message.

    Raises:
        error: a name not in ``names``, or a stage out of range.
    """
    owners = {}
    for name, stage in (tied or {}).items():
        if name not in names:
            raise error('tied: expected parameter names of %s, found %r' % (what, name))
        if not is_int(stage) or not 0 <= stage < num_stages:
            raise error('tied: expected a stage index below %d for %s, found %r'
                        % (num_stages, name, stage))
        owners[name] = int(stage)
    return owners


def cache_dir(environ=None):
    """Where the project keeps what it works out once a machine (the BLAS
    kernel's verdict, built operators): ``$XDG_CACHE_HOME/mp_symbolic`` (an
    absolute ``XDG_CACHE_HOME`` only), else ``~/.cache/mp_symbolic``."""
    environ = os.environ if environ is None else environ
    base = environ.get('XDG_CACHE_HOME', '')
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser('~'), '.cache')
    return os.path.join(base, 'mp_symbolic')


FUSED_NORM = 'MP_SYMBOLIC_FUSED_NORM'  # the language model's norm: auto | 0 | 1
FUSED_ADAM = 'MP_SYMBOLIC_FUSED_ADAM'  # Adam's update in one op a device: auto | 0
SMALL_BATCH_DOT = 'MP_SYMBOLIC_SMALL_BATCH_DOT'  # the language model's attention: 0 | auto | 1
FUSED_ATTENTION = 'MP_SYMBOLIC_FUSED_ATTENTION'  # the language model's attention: auto | 0 | 1


def _switch(name, choices, environ, default='auto'):
    environ = os.environ if environ is None else environ
    value = environ.get(name, default)
    if value.strip().lower() not in choices:
        raise ValueError('%s: expected %s or %s, found %r'
                         % (name, ', '.join(choices[:-1]), choices[-1], value))
    return value.strip().lower()


def fused_norm_switch(environ=None):
    """``MP_SYMBOLIC_FUSED_NORM`` as ``'auto'`` (also where unset), ``'0'``
    or ``'1'``; ``ValueError`` of one line for anything else."""
    return _switch(FUSED_NORM, ('auto', '0', '1'), environ)


def small_batch_dot_switch(environ=None):
    """``MP_SYMBOLIC_SMALL_BATCH_DOT`` as ``'0'`` (also where unset),
    ``'auto'`` or ``'1'``; ``ValueError`` of one line for anything else."""
    return _switch(SMALL_BATCH_DOT, ('auto', '0', '1'), environ, default='0')


def fused_attention_switch(environ=None):
    """``MP_SYMBOLIC_FUSED_ATTENTION`` as ``'auto'`` (also where unset),
    ``'0'`` or ``'1'``; ``ValueError`` of one line for anything else."""
    return _switch(FUSED_ATTENTION, ('auto', '0', '1'), environ)


def fused_adam_switch(environ=None):
    """``MP_SYMBOLIC_FUSED_ADAM`` as ``'auto'`` (also where unset) or ``'0'``;
    ``ValueError`` of one line for anything else."""
    return _switch(FUSED_ADAM, ('auto', '0'), environ)
