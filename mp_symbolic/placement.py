"""The one place that decides which device runs which layer.

A *device plan* maps the network's layers to contiguous pipeline stages and
each stage to one device. It is built and validated here, and every variant
(Module, executor, imperative, export) takes its ``group2ctx`` from it, so the
group names in the block attributes, the bind call and the tests are the same.

Device strings follow ``--devices``: ``cpu:0,cpu:1,cpu:2``, ``gpu:0,gpu:1``,
or a mix. ``cpu(0)``, ``cpu(1)``, ... are distinct devices to MXNet (its own
model-parallel tests use them that way), which is how everything here runs
without a GPU.
"""
import re
from dataclasses import dataclass

import mxnet as mx

from .model import stage_name

__all__ = ['DevicePlan', 'DeviceSpecError', 'parse_devices', 'check_devices', 'default_devices',
           'partition', 'make_plan', 'format_device']

_DEVICE_RE = re.compile(r'^(cpu|gpu):(\d+)$')
# cpu(N) ids only name stand-in devices; MXNet keeps per-device state for each,
# so an absurd id is refused rather than allocated for.
MAX_CPU_ID = 63


class DeviceSpecError(ValueError):
    """A ``--devices`` value that cannot become a device plan."""


def format_device(ctx):
    """``mx.gpu(1)`` -> ``'gpu:1'``, the form ``--devices`` takes."""
    return '%s:%d' % (ctx.device_type, ctx.device_id)


def parse_devices(spec, num_gpus=None):
    """Parses ``'cpu:0,gpu:1'`` into ``[mx.cpu(0), mx.gpu(1)]``.

    Args:
        spec: Comma-separated ``cpu:N`` / ``gpu:N`` entries.
        num_gpus: GPUs MXNet can see; ``None`` asks MXNet.

    Raises:
        DeviceSpecError: an entry is malformed, a device is listed twice, or
            a GPU is not there.
    """
    entries = [e.strip() for e in spec.split(',')] if spec.strip() else []
    if not entries:
        raise DeviceSpecError("expected a comma-separated device list such as "
                              "'cpu:0,cpu:1,cpu:2', found an empty string")
    devices = []
    for entry in entries:
        match = _DEVICE_RE.match(entry)
        if not match:
            raise DeviceSpecError("expected devices of the form 'cpu:N' or 'gpu:N', "
                                  "found %r in %r" % (entry, spec))
        kind, index = match.group(1), int(match.group(2))
        if kind == 'cpu' and index > MAX_CPU_ID:
            raise DeviceSpecError('expected cpu:N with N at most %d, found %r in %r'
                                  % (MAX_CPU_ID, entry, spec))
        if kind == 'gpu' and index > 2 ** 31 - 1:
            raise DeviceSpecError('expected a GPU index MXNet can hold, found %r in %r'
                                  % (entry, spec))
        devices.append(mx.cpu(index) if kind == 'cpu' else mx.gpu(index))
    return check_devices(devices, num_gpus)


def check_devices(devices, num_gpus=None):
    """Checks a device list: each device once, every GPU present.

    Returns:
        ``devices`` as a list.

    Raises:
        DeviceSpecError: a device is listed twice, or a GPU is not there.
    """
    devices = list(devices)
    seen = set()
    for ctx in devices:
        if ctx in seen:
            raise DeviceSpecError('expected each device once, found %s twice in %s'
                                  % (format_device(ctx),
                                     ','.join(format_device(d) for d in devices)))
        seen.add(ctx)
    gpus = [d for d in devices if d.device_type == 'gpu']
    if gpus:
        if num_gpus is None:
            num_gpus = _visible_gpus()
        missing = [format_device(d) for d in gpus if d.device_id >= num_gpus]
        if missing:
            raise DeviceSpecError('%s requested but MXNet sees %d GPU(s)%s'
                                  % (', '.join(missing), num_gpus,
                                     '' if num_gpus else ' (use cpu:N devices)'))
    return devices


def _visible_gpus():
    try:
        return mx.context.num_gpus()
    except mx.base.MXNetError:  # a CUDA build on a machine without a driver
        return 0


def default_devices(num_layers, num_gpus=None):
    """One device per layer: GPUs if MXNet sees enough, else CPU stand-ins.

    Returns:
        ``(devices, note)``: the device list and a one-line note saying which
        choice was made, for the caller to print once.
    """
    if num_gpus is None:
        num_gpus = _visible_gpus()
    if num_gpus >= num_layers:
        return [mx.gpu(i) for i in range(num_layers)], \
            'devices: %d GPUs found, one layer on each' % num_layers
    return [mx.cpu(i) for i in range(num_layers)], \
        ('devices: MXNet sees %d GPU(s), fewer than the %d layers; using cpu(0..%d) '
         'as stand-in devices' % (num_gpus, num_layers, num_layers - 1))


def partition(num_layers, num_stages):
    """Stage index of each layer: contiguous, balanced, no stage empty.

    >>> partition(3, 2)
    (0, 0, 1)

    Raises:
        DeviceSpecError: more stages than layers, or fewer than one stage.
    """
    if num_stages < 1:
        raise DeviceSpecError('expected at least one device, found %d' % num_stages)
    if num_stages > num_layers:
        raise DeviceSpecError('too many devices for the layers (devices: %d, layers: %d); '
                              'expected at most one device per layer'
                              % (num_stages, num_layers))
    base, extra = divmod(num_layers, num_stages)
    stages = []
    for stage in range(num_stages):
        stages += [stage] * (base + (1 if stage < extra else 0))
    return tuple(stages)


@dataclass(frozen=True)
class DevicePlan:
    """Layers -> stages -> devices.

    Attributes:
        devices: Device of each stage, ``devices[s]`` for stage ``s``.
        stage_of_layer: Stage index of each layer.
    """
    devices: tuple
    stage_of_layer: tuple

    @property
    def num_stages(self):
        return len(self.devices)

    @property
    def group2ctx(self):
        """``{'stage0': ctx0, ...}`` for ``simple_bind(group2ctx=...)`` and
        ``Module(group2ctxs=...)``."""
        return {stage_name(s): d for s, d in enumerate(self.devices)}

    def device_of_layer(self, layer):
        return self.devices[self.stage_of_layer[layer]]

    @property
    def first_device(self):
        return self.devices[0]

    @property
    def last_device(self):
        return self.devices[-1]

    def describe(self):
        """One line per stage: ``stage0 -> cpu(0): layer 0``."""
        lines = []
        for s, d in enumerate(self.devices):
            layers = [str(i) for i, st in enumerate(self.stage_of_layer) if st == s]
            lines.append('%s -> %s: layer%s %s' % (stage_name(s), d,
                                                    's' if len(layers) > 1 else '',
                                                    ', '.join(layers)))
        return lines


def make_plan(num_layers, devices=None, num_gpus=None):
    """Builds and validates the device plan.

    Args:
        num_layers: Layers of the network (3 for the seed's network).
        devices: A ``--devices`` string, a list of contexts (checked as
            :func:`check_devices` does), or ``None`` for :func:`default_devices`.
        num_gpus: GPUs MXNet can see; ``None`` asks MXNet.

    Returns:
        ``(plan, note)``; ``note`` is a line to print when the default devices
        were chosen, else ``None``.

    Raises:
        DeviceSpecError: see :func:`parse_devices` and :func:`partition`.
    """
    note = None
    if devices is None:
        devices, note = default_devices(num_layers, num_gpus)
    elif isinstance(devices, str):
        devices = parse_devices(devices, num_gpus)
    else:
        devices = check_devices(devices, num_gpus)
    devices = tuple(devices)
    return DevicePlan(devices, partition(num_layers, len(devices))), note
