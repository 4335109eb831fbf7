"""The one place that decides which device runs which pipeline stage: a
*device plan* maps blocks to contiguous stages, each stage to one device or
several (tensor-parallel, ``cpu:0+cpu:1,cpu:2``), for each replica. Every
variant takes its ``group2ctx`` from it."""
from dataclasses import dataclass
import re

import mxnet as mx

from .balance import check_stage_count, even_split, stage_of_block
from ..base.checks import DeviceSpecError, excerpt as _excerpt, positive_int
from ..graph.names import shard_group, stage_name  # pylint: disable=unused-import  (their home is names)

__all__ = []

# ASCII digits only: Python's \d also matches '０' and '٣', which int() would
# silently read as 0 and 3.
_DEVICE_RE = re.compile(r'^(cpu|gpu):([0-9]+)$')
# cpu(N) ids only name stand-in devices; MXNet keeps per-device state for each,
# so an absurd id is refused rather than allocated for.
MAX_CPU_ID = 63


def format_device(ctx):
    """``mx.gpu(1)`` -> ``'gpu:1'``, the form ``--devices`` takes."""
    return '%s:%d' % (ctx.device_type, ctx.device_id)


def format_stage(devices):
    """A stage's device(s) in the ``--devices`` form: ``'cpu:1'``, ``'cpu:1+cpu:2'``."""
    if isinstance(devices, mx.Context):
        return format_device(devices)
    return '+'.join(format_device(d) for d in devices)


def parse_devices(spec, num_gpus=None, unique=True):
    """Parses ``'cpu:0,gpu:1'`` into ``[mx.cpu(0), mx.gpu(1)]``, and
    ``'cpu:0+cpu:1,cpu:2'`` into ``[(mx.cpu(0), mx.cpu(1)), mx.cpu(2)]`` (a
    stage of two devices, then one of one).

    Args:
        spec: Comma-separated ``cpu:N`` / ``gpu:N`` entries, or several such
            joined by ``+`` for a stage of several devices.
        num_gpus: GPUs MXNet can see; ``None`` asks MXNet.
        unique: Refuse a device listed twice.

    Raises:
        DeviceSpecError: an entry is malformed, a device is listed twice, or
            a GPU is not there.
    """
    if not isinstance(spec, str):
        raise DeviceSpecError("expected a device list such as 'cpu:0,cpu:1,cpu:2' or a list of "
                              "mx.Context, found %s" % type(spec).__name__)
    entries = [e.strip() for e in spec.split(',')] if spec.strip() else []
    if not entries:
        raise DeviceSpecError("expected a comma-separated device list such as "
                              "'cpu:0,cpu:1,cpu:2', found an empty string")
    devices = []
    for group in entries:
        parts = [e.strip() for e in group.split('+')]
        stage = tuple(_parse_device(e, spec) for e in parts)
        devices.append(stage[0] if len(stage) == 1 else stage)
    return check_devices(devices, num_gpus, unique)


def _parse_device(entry, spec):
    """One ``cpu:N`` / ``gpu:N`` entry of ``spec`` -> its context."""
    match = _DEVICE_RE.match(entry)
    if not match:
        raise DeviceSpecError("expected devices of the form 'cpu:N' or 'gpu:N' (N in ASCII "
                              "digits), found %s in %s" % (_excerpt(ascii(entry)),
                                                           _excerpt(ascii(spec))))
    kind, index = match.group(1), int(match.group(2))
    if kind == 'cpu' and index > MAX_CPU_ID:
        raise DeviceSpecError('expected cpu:N with N at most %d, found %r in %s'
                              % (MAX_CPU_ID, entry, _excerpt(repr(spec))))
    if kind == 'gpu' and index > 2 ** 31 - 1:
        raise DeviceSpecError('expected a GPU index MXNet can hold, found %s in %s'
                              % (_excerpt(repr(entry)), _excerpt(repr(spec))))
    return mx.cpu(index) if kind == 'cpu' else mx.gpu(index)


def flat_devices(devices):
    """The contexts of a device list whose stages may be tuples, in order."""
    flat = []
    for entry in devices:
        flat += list(entry) if isinstance(entry, (tuple, list)) else [entry]
    return flat


def check_devices(devices, num_gpus=None, unique=True):
    """``devices`` (contexts, or tuples of them for a stage of several) checked,
    as a list.

    Raises:
        DeviceSpecError: an entry not an ``mx.Context`` or a non-empty tuple of
            them, a device listed twice, or a GPU not there.
    """
    devices = [tuple(e) if isinstance(e, (tuple, list)) else e for e in devices]
    if any(isinstance(e, tuple) and not e for e in devices):
        raise DeviceSpecError('expected each stage to hold at least one device, found an empty '
                              'tuple in %s' % _excerpt(repr(devices)))
    devices = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in devices]
    flat = flat_devices(devices)
    seen = set()
    for ctx in flat:
        if not isinstance(ctx, mx.Context):
            raise DeviceSpecError('expected devices as mx.Context (mx.cpu(0), mx.gpu(1)) or a '
                                  "string such as 'cpu:0,cpu:1', found %r" % (ctx,))
        if ctx.device_type == 'cpu' and ctx.device_id > MAX_CPU_ID:
            raise DeviceSpecError('expected cpu devices up to mx.cpu(%d), found mx.cpu(%d)'
                                  % (MAX_CPU_ID, ctx.device_id))
        if unique and ctx in seen:
            raise DeviceSpecError('expected each device once, found %s twice in %s'
                                  % (format_device(ctx),
                                     _excerpt(','.join(format_stage(d) for d in devices))))
        seen.add(ctx)
    gpus = [d for d in flat if d.device_type == 'gpu']
    if gpus and unique:  # a list of several nodes' devices: each node checks its own
        if num_gpus is None:
            num_gpus = _visible_gpus()
        missing = [format_device(d) for d in gpus if d.device_id >= num_gpus]
        if missing:
            raise DeviceSpecError('%s requested but MXNet sees %d GPU(s)%s'
                                  % (_excerpt(', '.join(missing)), num_gpus,
                                     '' if num_gpus else ' (use cpu:N devices)'))
    return devices


def _visible_gpus():
    try:
        return mx.context.num_gpus()
    except mx.base.MXNetError:  # a CUDA build on a machine without a driver
        return 0


def default_devices(num_stages, num_gpus=None):
    """``(devices, note)``: one device per stage, GPUs if MXNet sees enough, else
    CPU stand-ins, and a line saying which."""
    if num_gpus is None:
        num_gpus = _visible_gpus()
    if num_gpus >= num_stages:
        return [mx.gpu(i) for i in range(num_stages)], \
            'devices: %d GPUs found, one stage on each' % num_stages
    return [mx.cpu(i) for i in range(num_stages)], \
        ('devices: MXNet sees %d GPU(s), fewer than the %d stages; using cpu(0..%d) '
         'as stand-in devices' % (num_gpus, num_stages, num_stages - 1))


def partition(num_blocks, num_stages):
    """Stage index of each block: contiguous, as even as counts allow, no stage empty.

    >>> partition(3, 2)
    (0, 0, 1)

    Raises:
        DeviceSpecError: more stages than blocks, or fewer than one stage.
    """
    if num_stages < 1:
        raise DeviceSpecError('expected at least one device, found %d' % num_stages)
    check_stage_count(num_stages, num_blocks, 'layers')
    return stage_of_block(even_split(num_blocks, num_stages))


@dataclass(frozen=True)
class DevicePlan:
    """Blocks -> stages -> devices, for each replica. A stage of several devices
    (tensor-parallel shards) is a tuple of contexts in ``devices`` /
    ``replica_devices``, which then keep its first device.

    Attributes:
        devices: Device of each stage of replica 0.
        stage_of_layer: Stage index of each block (layer), contiguous from 0.
        replica_devices: ``replica_devices[r][s]``: device of stage ``s`` in
            replica ``r``; ``(devices,)`` without replicas.
        stage_devices: ``stage_devices[r][s]``: the devices of stage ``s`` in
            replica ``r``; shard ``i`` runs on ``stage_devices[r][s][i]``.
        node_of_stage: The node process that runs each stage (all 0 in one
            process); a device belongs to its node, so it may be listed once
            per node.
    """
    devices: tuple
    stage_of_layer: tuple
    replica_devices: tuple = None
    stage_devices: tuple = None
    node_of_stage: tuple = None

    def __post_init__(self):
        replicas = self.replica_devices
        if replicas is None:
            replicas = (tuple(self.devices),)
        stages = tuple(tuple(tuple(d) if isinstance(d, (tuple, list)) else (d,)
                             for d in devices) for devices in replicas)
        if self.stage_devices is None:
            object.__setattr__(self, 'stage_devices', stages)
        object.__setattr__(self, 'replica_devices',
                           tuple(tuple(s[0] for s in devices) for devices in self.stage_devices))
        object.__setattr__(self, 'devices', self.replica_devices[0])
        if self.node_of_stage is None:
            object.__setattr__(self, 'node_of_stage', (0,) * len(self.devices))
        widths = {tuple(len(s) for s in devices) for devices in self.stage_devices}
        if len(widths) > 1:
            raise DeviceSpecError('expected every replica to give each stage as many devices, '
                                  'found devices per stage %s' % ' and '.join(
                                      str(list(w)) for w in sorted(widths)))

    @property
    def num_stages(self):
        return len(self.devices)

    @property
    def num_nodes(self):
        """Node processes the stages are divided over."""
        return max(self.node_of_stage) + 1

    def stages_of_node(self, node):
        """The stages node ``node`` runs, in order."""
        return tuple(s for s, n in enumerate(self.node_of_stage) if n == node)

    @property
    def num_replicas(self):
        return len(self.replica_devices)

    @property
    def balance(self):
        """Blocks per stage (torchgpipe's ``balance``)."""
        return tuple(self.stage_of_layer.count(s) for s in range(self.num_stages))

    def width(self, stage):
        """Devices of stage ``stage`` (the shards its tensor-parallel layers take)."""
        return len(self.stage_devices[0][stage])

    @property
    def group2ctx(self):
        """``{'stage0': ctx0, ...}`` of replica 0 (shards' groups included)."""
        return self.group2ctxs[0]

    @property
    def group2ctxs(self):
        """One ``group2ctx`` per replica, for ``Module(group2ctxs=[...])``."""
        return [{shard_group(s, i): d for s, stage in enumerate(devices)
                 for i, d in enumerate(stage)}
                for devices in self.stage_devices]

    @property
    def all_devices(self):
        """Every device, replica by replica, stage by stage (shards included)."""
        return [d for devices in self.stage_devices for stage in devices for d in stage]

    def stage_label(self, stage):
        """The stage's device(s) in each replica: ``'cpu(1)+cpu(2), cpu(4)+cpu(5)'``;
        over nodes, its node first: ``'node 1 cpu(0)'``."""
        devices = ', '.join('+'.join(str(d) for d in devices[stage])
                            for devices in self.stage_devices)
        return devices if self.num_nodes == 1 else 'node %d %s' % (self.node_of_stage[stage],
                                                                   devices)

    @property
    def spec(self):
        """The plan's devices in the ``--devices`` form (``'cpu:0+cpu:1,cpu:2'``)."""
        return ','.join(format_stage(stage) for devices in self.stage_devices
                        for stage in devices)

    def device_of_layer(self, layer):
        return self.devices[self.stage_of_layer[layer]]

    @property
    def first_device(self):
        return self.devices[0]

    @property
    def last_device(self):
        return self.devices[-1]


def resolve_devices(devices, num_gpus=None, unique=True):
    """A ``--devices`` string or a list of contexts as a checked list of contexts
    (``unique=False``: devices of several nodes)."""
    if isinstance(devices, str):
        return parse_devices(devices, num_gpus, unique)
    if isinstance(devices, mx.Context):
        devices = [devices]
    try:
        devices = list(devices)
    except TypeError:
        raise DeviceSpecError("expected a device list such as 'cpu:0,cpu:1,cpu:2' or a list of "
                              'mx.Context, found %r' % (devices,)) from None
    if not devices:
        raise DeviceSpecError('expected at least one device, found an empty list')
    return check_devices(devices, num_gpus, unique)


def split_replicas(devices, replicas):
    """``R*K`` devices listed replica by replica -> ``R`` tuples of ``K``; raises
    DeviceSpecError unless ``replicas`` is a positive integer dividing them."""
    positive_int('replicas', replicas, DeviceSpecError)
    if len(devices) % replicas:
        raise DeviceSpecError('expected a device count that is a multiple of the replicas '
                              '(R x K devices, listed replica by replica), found %d devices for '
                              '%d replicas' % (len(devices), replicas))
    k = len(devices) // replicas
    return tuple(tuple(devices[r * k:(r + 1) * k]) for r in range(replicas))


def make_plan(num_layers, devices=None, num_gpus=None, stage_of_layer=None, replicas=1):
    """Builds and validates the device plan.

    Args:
        num_layers: Blocks (layers) of the network.
        devices: A ``--devices`` string, a list of contexts, or ``None`` for
            :func:`default_devices` (one device per layer).
        num_gpus: GPUs MXNet can see; ``None`` asks MXNet.
        stage_of_layer: Stage of each layer; ``None``: :func:`partition`.
        replicas: Copies of the plan; ``devices`` then lists ``replicas x K``
            devices, replica by replica.

    Returns:
        ``(plan, note)``; ``note`` a line to print when the default devices
        were chosen, else ``None``.

    Raises:
        DeviceSpecError: see :func:`parse_devices`, :func:`partition` and
            :func:`split_replicas`.
    """
    note = None
    if devices is None:
        devices, note = default_devices(num_layers * replicas, num_gpus)
    else:
        devices = resolve_devices(devices, num_gpus)
    replica_devices = split_replicas(devices, replicas)
    if stage_of_layer is None:
        stage_of_layer = partition(num_layers, len(replica_devices[0]))
    return DevicePlan(replica_devices[0], tuple(stage_of_layer), replica_devices), note
