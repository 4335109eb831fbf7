"""Sizes in bytes as people write them (``'2GiB'``, ``'512MB'``, ``'1.5G'``)
and as the planner prints them. Imports no MXNet: the command line reads
``--memory-per-device`` with it before MXNet loads."""
import math
import re

from ..base.checks import excerpt

__all__ = []

_UNITS = {'': 1, 'B': 1}
for _i, _p in enumerate('KMGT', 1):
    _UNITS[_p] = _UNITS[_p + 'IB'] = 1024 ** _i
    _UNITS[_p + 'B'] = 1000 ** _i
_SIZE = re.compile(r'^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([A-Za-z]*)\s*$')


def parse_size(value, name='memory_per_device'):
    """Bytes of a size: a positive number, or a string such as ``'2GiB'``,
    ``'512MB'``, ``'1.5G'``: ``K`` or ``KiB`` to ``T`` or ``TiB`` are powers of
    1024, ``KB`` to ``TB`` of 1000, ``B`` or nothing bytes, in any case.

    Raises:
        ValueError: anything else, or below one byte (one line naming ``name``).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ''
    else:
        match = _SIZE.match(value) if isinstance(value, str) else None
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError('%s: expected a size such as 2GiB, 512MB, 1.5G or a number of '
                             'bytes, found %s' % (name, excerpt(repr(value))))
        number, unit = float(match.group(1)), match.group(2).upper()
    size = number * _UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise ValueError('%s: expected a finite size of at least one byte, found %s'
                         % (name, excerpt(repr(value))))
    return int(size)


def format_size(size):
    """``1536`` -> ``'1.5 KiB'``."""
    for unit, scale in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
        if size >= scale:
            return '%.1f %s' % (size / scale, unit)
    return '%d B' % size
