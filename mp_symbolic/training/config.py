"""Training configuration: one frozen dataclass, one field per CLI flag.

Fields left ``None`` take the task's default (the :class:`~mp_symbolic.Task`'s
``batch_size``, ``num_epochs``, ``optimizer``, ``lr``, ``momentum`` and
``out_dir``), filled in by :meth:`TrainConfig.with_task`. Standard library
only: the command line builds one before loading MXNet.
"""
from dataclasses import dataclass, fields, replace
import json
import math

from ..core.base.checks import LR_EXPECTED, MOMENTUM_EXPECTED, POSITIVE_EXPECTED, is_int, is_lr, \
    is_momentum, is_positive_int, node_count
from ..core.graph.batchnorm import DEFAULT as BATCHNORM_DEFAULT, MODES as BATCHNORM_MODES
from ..core.schedule import DEFAULT, NAMES, VIRTUAL, check_spec
from .tasks import DEFAULT_TASK

__all__ = []

VARIANTS = ('symbolic', 'imperative')
APIS = ('module', 'executor')
OPTIMIZERS = ('sgd', 'adam')
KVSTORES = ('local', 'device', 'dist_sync')
SCHEDULES = NAMES  # Pipeline(schedule=...)'s names (a function is the library's)
MAX_EPOCHS = 100000
# Stages (devices per replica) of the plan made where no devices are given: at
# most this many, fewer for a task of fewer blocks.
DEFAULT_STAGES = 3
# Fields a task gives defaults for.
TASK_DEFAULTS = ('batch_size', 'num_epochs', 'optimizer', 'lr', 'momentum')


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs.

    Raises:
        ValueError: a field is out of range; the message names the field and
            the value found.
    """
    # The task: 'regression' (the seed question's 2-2-2-1 network), 'digits' (a CNN on
    # 8x8 digits), a .py file or a module defining task(**kwargs) -> mp_symbolic.Task.
    task: str = DEFAULT_TASK
    # Keyword arguments of task(), as (key, value) pairs (--task-arg KEY=VALUE).
    task_args: tuple = ()
    # 'symbolic' (ctx_group graph bound with group2ctx) or 'imperative' (Gluon + autograd).
    variant: str = 'symbolic'
    # Symbolic variant only: 'module' (mx.mod.Module, group2ctxs) or 'executor'
    # (Symbol.simple_bind, group2ctx).
    api: str = 'module'
    # '--devices' string such as 'cpu:0,cpu:1,cpu:2'; None: three GPUs if present, else cpu(0..2).
    devices: str = None
    # Examples per step; a last, smaller batch is dropped. None: the task's.
    batch_size: int = None
    # Passes over the data. None: the task's.
    num_epochs: int = None
    # 'sgd' or 'adam'. None: the task's.
    optimizer: str = None
    # Learning rate; gradients are averaged over the batch. None: the task's.
    lr: float = None
    # SGD momentum (must stay 0 with Adam). None: the task's.
    momentum: float = None
    # Seeds the data, the batch order and the initial parameters.
    seed: int = 0
    # Output folder; None: the task's (artifacts/<variant> for the regression,
    # artifacts/<task>[-<variant>] for others), or the --resume folder.
    out: str = None
    # Show a tqdm progress bar.
    progress: bool = True
    # Write an MXNet profiler trace (Chrome trace format) to <out>/profile.json.
    profile: bool = False
    # Symbolic variant: micro-batches per batch (GPipe); must divide the batch size.
    chunks: int = 1
    # Module API: the micro-batches' order, 'gpipe' (one graph, MXNet's engine),
    # '1f1b' (one executor per stage and micro-batch in flight; memory flat in chunks)
    # or 'interleaved' (1F1B over `virtual` stages per device; chunks a multiple of devices).
    schedule: str = DEFAULT
    # Under schedule 'interleaved': stages per device (Pipeline(virtual=...)); None: 2.
    virtual: int = None
    # BatchNorm's running statistics with chunks: 'micro-batch' (each in turn) or
    # 'deferred' (once per batch, the whole batch's: Pipeline(batchnorm=...)).
    batchnorm: str = BATCHNORM_DEFAULT
    # Data-parallel copies of the pipeline; --devices lists replicas x stages devices.
    replicas: int = 1
    # Sums gradients across replicas or processes: 'local', 'device', 'dist_sync'.
    # None: 'local' with several replicas, else no kvstore.
    kvstore: str = None
    # Blocks per stage (a tuple), 'time', or None (balanced by parameter count).
    balance: object = None
    # Node processes the stages are divided over (Pipeline(nodes=...)); each runs this
    # command with its rank from torchrun or `launch --nodes`. 1: every stage here.
    nodes: int = 1
    # Seconds a node waits on another (a receive, a checkpoint) before the job ends;
    # None: 300 (mp_symbolic.core.transport.nodes.NODE_TIMEOUT).
    node_timeout: float = None
    # Symbolic variant: every stage's ops recomputed in the backward pass (MXNet's mirroring).
    mirror: bool = False
    # Module API: each replica (times the dist_sync workers) holds and updates the optimizer
    # state of its share of each stage's parameters (ZeRO stage 1: Pipeline(shard_optimizer=...)).
    shard_optimizer: bool = False
    # Symbolic variant: measure memory per device (the plan beside one device) before
    # training, in child processes (about two seconds each); the command line turns it on.
    memory: bool = False
    # Commit a checkpoint (weights + optimizer state) every this many epochs, and at the end.
    checkpoint_every: int = 1
    # A training folder whose last committed checkpoint this run continues.
    resume: str = None
    # compare: judge agreement on the losses of the first N steps only (a chaotic
    # network's runs drift apart at float32 rounding later); None: every step's loss
    # and every final parameter.
    agree_steps: int = None

    def __post_init__(self):
        def bad(name, expected):
            raise ValueError('%s: expected %s, found %r' % (name, expected, getattr(self, name)))

        if not isinstance(self.task, str) or not self.task.strip():
            bad('task', 'a bundled task name, a .py file or a module name')
        object.__setattr__(self, 'task_args', _freeze(self.task_args))
        if self.variant not in VARIANTS:
            bad('variant', ' or '.join(VARIANTS))
        if self.api not in APIS:
            bad('api', ' or '.join(APIS))
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            bad('optimizer', ' or '.join(OPTIMIZERS))
        for name in ('batch_size', 'num_epochs', 'chunks', 'replicas', 'checkpoint_every',
                     'agree_steps', 'nodes'):
            value = getattr(self, name)
            if value is not None and not is_positive_int(value):
                bad(name, POSITIVE_EXPECTED)
        if self.nodes > 1:  # what the node processes would each refuse, before they start
            node_count(self.nodes, self.devices_per_replica, DEFAULT_STAGES)
        if self.num_epochs is not None and self.num_epochs > MAX_EPOCHS:
            bad('num_epochs', 'at most %d' % MAX_EPOCHS)
        if self.node_timeout is not None and not (
                isinstance(self.node_timeout, (int, float)) and
                not isinstance(self.node_timeout, bool) and 0 < self.node_timeout < math.inf):
            bad('node_timeout', 'a positive number of seconds')
        if self.nodes > 1 and self.variant != 'symbolic':
            raise ValueError("nodes: expected variant 'symbolic' with them (the imperative twin "
                             "runs in one process), found %d nodes with variant %r"
                             % (self.nodes, self.variant))
        if self.nodes > 1 and self.api != 'module':
            raise ValueError("nodes: expected api 'module' with them (the executor API binds "
                             "the one graph in one process), found %d nodes with api %r"
                             % (self.nodes, self.api))
        if self.lr is not None and not is_lr(self.lr):
            bad('lr', LR_EXPECTED)
        if self.momentum is not None and not is_momentum(self.momentum):
            bad('momentum', MOMENTUM_EXPECTED)
        if not is_int(self.seed) or not 0 <= self.seed < 2 ** 32:
            bad('seed', 'an integer in [0, 2**32) (MXNet seeds with 32 bits)')
        if self.schedule not in SCHEDULES:
            bad('schedule', ' or '.join(SCHEDULES))
        check_spec(self.schedule, self.virtual)  # the schedule record's own check of virtual
        if self.batchnorm not in BATCHNORM_MODES:
            bad('batchnorm', ' or '.join(BATCHNORM_MODES))
        if self.kvstore is not None and self.kvstore not in KVSTORES:
            bad('kvstore', ' or '.join(KVSTORES))
        if isinstance(self.balance, str) and self.balance != 'time':
            bad('balance', "'time' or blocks per stage such as 2,1")
        for name in ('out', 'resume'):
            value = getattr(self, name)
            if value is not None and not value.strip():
                bad(name, 'a folder path, not an empty string')
            if value is not None and not _utf8(value):
                raise ValueError('%s: expected a path MXNet can open (UTF-8; it opens files by '
                                 'UTF-8 name), found %a' % (name, value))
        if any(getattr(self, name) is None for name in TASK_DEFAULTS):
            return  # the rest is checked once the task's defaults are in (with_task)
        # Flags that would otherwise be silently ignored.
        if self.optimizer != 'sgd' and self.momentum != 0:
            bad('momentum', '0 with optimizer %r (momentum is an SGD setting)' % self.optimizer)
        if self.variant == 'imperative':
            for name, default in (('api', 'module'), ('chunks', 1), ('replicas', 1),
                                  ('kvstore', None), ('mirror', False), ('schedule', DEFAULT),
                                  ('shard_optimizer', False),
                                  ('batchnorm', BATCHNORM_DEFAULT)):
                if getattr(self, name) != default:
                    bad(name, '%r (the default) with variant \'imperative\' (it is a setting '
                              'of the symbolic variant)' % (default,))
        if self.api == 'executor' and self.shard_optimizer:
            bad('api', "'module' with shard_optimizer (the executor API binds one replica "
                       'and updates every parameter itself)')
        if self.api == 'executor' and (self.replicas > 1 or self.kvstore is not None):
            bad('api', "'module' with replicas or a kvstore (the executor API binds one "
                       'replica and sums no gradients)')
        if self.batch_size % (self.chunks * self.replicas):
            bad('batch_size', 'a multiple of chunks x replicas (%d x %d)'
                % (self.chunks, self.replicas))
        if self.replicas > 1 and self.kvstore is None:
            object.__setattr__(self, 'kvstore', 'local')

    @property
    def devices_per_replica(self):
        """The devices of one replica as ``devices`` lists them (its stages'
        entries over ``replicas``), without MXNet or the task; None where
        ``devices`` is not given or cannot be counted (the device plan
        refuses it)."""
        if not isinstance(self.devices, str):
            return None
        entries = [e.strip() for e in self.devices.split(',')]
        if not all(entries) or len(entries) % self.replicas:
            return None
        return len(entries) // self.replicas

    def check_profiler_devices(self, devices):
        """Raises ValueError if MXNet's profiler cannot record on ``devices``.

        MXNet 1.9.1's profiler keeps one row per core, plus two, and aborts
        the process (``Check failed: idx < DeviceCount()``) on ``cpu(N)`` past
        them.
        """
        # pylint: disable=import-outside-toplevel
        from ..core.base.compat import profiler_cpu_limit, unprofilable
        limit = profiler_cpu_limit()
        over = unprofilable(devices)
        if self.profile and over:
            raise ValueError('profile: expected cpu:N devices with N below %d on this %d-core '
                             'machine (MXNet\'s profiler aborts past them), found %s'
                             % (limit, limit - 2, ', '.join(over)))

    def with_task(self, task):
        """This config with the task's defaults for the fields left ``None``.

        Args:
            task: The :class:`~mp_symbolic.Task`.

        Raises:
            ValueError: the combined values cannot work (the message names
                the field).
        """
        values = {name: getattr(task, name) for name in TASK_DEFAULTS
                  if getattr(self, name) is None}
        if self.optimizer is not None and self.momentum is None and self.optimizer != 'sgd':
            values['momentum'] = 0.0  # the task's SGD momentum does not carry over to Adam
        if self.out is None and self.resume is None:
            values['out'] = task.default_out_dir(self.variant)
        cfg = replace(self, **values)
        if task.bucketed:
            cfg.check_bucketed(task)
            return cfg
        examples = len(task.data().y)  # one label per example, for any number of inputs
        if cfg.batch_size > examples:
            raise ValueError('batch_size: expected at most the task\'s %d training examples, '
                             'found %d' % (examples, cfg.batch_size))
        return cfg

    def check_bucketed(self, task):
        """Raises ValueError naming the flag where this run cannot train the
        task's bucketed DataIter: its batches are the task's, trained as
        they come through the Module of the symbolic variant, one process's
        or each node's.
        """
        desc = task.train.provide_data[0]
        size = (desc.shape if hasattr(desc, 'shape') else desc[1])[0]
        if self.variant != 'symbolic':
            raise ValueError("variant: expected 'symbolic' with a bucketed DataIter (the "
                             "Module binds each bucket), found %r" % self.variant)
        if self.api != 'module':
            raise ValueError("api: expected 'module' with a bucketed DataIter (the Module "
                             "binds each bucket), found %r" % self.api)
        if (self.kvstore or '').startswith('dist'):
            raise ValueError('kvstore: expected local or device with a bucketed DataIter (its '
                             'batches are not split between workers), found %r' % self.kvstore)
        if self.batch_size != size:
            raise ValueError('batch_size: expected the bucketed DataIter\'s batch size %d (its '
                             'batches are made by the task), found %d' % (size, self.batch_size))

    @property
    def out_dir(self):
        """The output folder (``out``, else the ``resume`` folder)."""
        return self.out if self.out is not None else self.resume

    def optimizer_params(self):
        """Keyword arguments for ``mx.optimizer.create`` (without rescale_grad)."""
        params = {'learning_rate': self.lr}
        if self.optimizer == 'sgd':
            params['momentum'] = self.momentum
        return params

    def to_dict(self):
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values['task_args'] = dict(self.task_args)
        return values

    def node_facts(self):
        """What every node process of one job must be given alike
        (:data:`NODE_FIELDS` ``'compared'``), by flag, as JSON values, for
        :func:`mp_symbolic.core.transport.nodes.agree` to compare before any tensor
        crosses."""
        values = self.to_dict()
        return {flag: json.loads(json.dumps(values[name]))
                for name, flag in NODE_FIELDS['compared'].items()}


# Every field, as the node processes of one job hold it.
NODE_FIELDS = {
    # What each node computes, and when the nodes talk (a batch's tensors, an
    # epoch's end, a commit): compared at the start by TrainConfig.node_facts,
    # by the flag that sets it.
    'compared': {'task': '--task', 'task_args': '--task-arg', 'seed': '--seed',
                 'batch_size': '--batch-size', 'num_epochs': '--epochs',
                 'checkpoint_every': '--checkpoint-every', 'optimizer': '--optimizer',
                 'lr': '--lr', 'momentum': '--momentum', 'kvstore': '--kvstore',
                 'mirror': '--mirror'},
    # Compared as the Pipeline's plan, what they make of them (Pipeline(nodes=...)).
    'plan': ('balance', 'chunks', 'schedule', 'virtual', 'replicas', 'batchnorm',
             'shard_optimizer'),
    # The same on every node by construction: nodes is the job's WORLD_SIZE,
    # variant and api are refused unless 'symbolic' and 'module' with nodes,
    # agree_steps is compare's.
    'fixed': ('nodes', 'variant', 'api', 'agree_steps'),
    # Each node's own: its share of the devices (their count per replica is the
    # plan's), paths on its host (the epoch a resume starts from is compared),
    # what it prints or measures, how long it waits on the others.
    'own': ('devices', 'out', 'resume', 'progress', 'profile', 'memory', 'node_timeout'),
}

# What makes a run the same run: a resume must keep these.
RESUME_IDENTITY = ('task', 'task_args', 'variant', 'batch_size', 'optimizer', 'lr',
                   'momentum', 'seed')
# The checkpoint's plan: a resume takes each of these from it unless its flag
# (--devices, --balance, ...) is given, and says which ones changed.
RESUME_PLAN = ('devices', 'balance', 'schedule', 'chunks', 'virtual', 'replicas', 'mirror',
               'api', 'kvstore', 'batchnorm', 'shard_optimizer')

# Fields of the plan a checkpoint written before they existed does not
# record, and what such a run had.
ADDED_PLAN = {'shard_optimizer': False}


def resume_config(saved, given):
    """The config of a resumed run.

    Args:
        saved: The checkpoint's config (``summary.json``'s ``config``).
        given: The fields set explicitly for this run (flags given).

    Returns:
        A :class:`TrainConfig`: ``saved``'s identity (:data:`RESUME_IDENTITY`),
        ``saved``'s plan (:data:`RESUME_PLAN`) where ``given`` does not set
        it, and ``given``'s other fields. Of the plan, blocks per stage
        (``balance`` as numbers) go with the checkpoint's devices, ``virtual``
        with schedule ``'interleaved'`` and a ``'local'`` or ``'device'``
        kvstore with its replicas: each is left to its default when
        ``given`` changes what it goes with. A ``dist_*`` kvstore is never
        taken (the launcher gives it to its workers).

    Raises:
        ValueError: a given identity field differs from the checkpoint's, or
            the checkpoint's config is not one this version can read.
    """
    if not isinstance(saved, dict) or not all(k in saved for k in RESUME_IDENTITY):
        raise ValueError('resume: expected a checkpoint recording its training config, found '
                         '%r' % (sorted(saved) if isinstance(saved, dict) else saved,))
    values = {}
    for name in RESUME_IDENTITY:
        if name == 'task_args' and not isinstance(saved[name], dict):
            raise ValueError('resume: expected the checkpoint\'s task_args to be a dict, found '
                             '%s' % type(saved[name]).__name__)
        value = saved[name]
        if name == 'task_args':
            value = _freeze(value)
            if 'task_args' in given:
                for key, arg in _freeze(given['task_args']):
                    if key not in dict(value):  # e.g. --widths for a task that has none
                        raise ValueError('%s: expected none with resume (the checkpoint\'s %s '
                                         'task does not take it), found %r'
                                         % (key, saved['task'], arg))
                    if dict(value)[key] != arg:
                        raise ValueError('%s: expected the checkpoint\'s %r with resume (or '
                                         'leave it out), found %r' % (key, dict(value)[key], arg))
                given = {k: v for k, v in given.items() if k != 'task_args'}
        elif name in given and given[name] is not None and given[name] != value:
            raise ValueError('%s: expected the checkpoint\'s %r with resume (or leave it out), '
                             'found %r' % (name, value, given[name]))
        values[name] = value
    values.update(_saved_plan(saved, given))
    for name, value in given.items():
        if name not in RESUME_IDENTITY:
            values[name] = value
    if 'balance' in values and isinstance(values['balance'], list):
        values['balance'] = tuple(values['balance'])
    return TrainConfig(**values)


def _saved_plan(saved, given):
    """The fields of :data:`RESUME_PLAN` a resume takes from ``saved``: those
    ``given`` does not set, less the ones that go with a field it changes."""
    plan = {name: saved[name] for name in RESUME_PLAN if name in saved and name not in given}
    if 'devices' in given and not isinstance(plan.get('balance'), (str, type(None))):
        del plan['balance']  # blocks per stage of the checkpoint's devices
    if plan.get('schedule', given.get('schedule')) not in VIRTUAL:
        plan.pop('virtual', None)
    if 'replicas' in given or str(plan.get('kvstore')).startswith('dist'):
        plan.pop('kvstore', None)
    return plan


def plan_changes(saved, cfg, saved_devices=None):
    """What ``cfg`` (a resumed run) changes of the checkpoint's plan, as
    ``['--devices cpu:0,cpu:1 (was cpu:0,cpu:1,cpu:2)', ...]``.

    Args:
        saved: The checkpoint's config.
        saved_devices: The devices the checkpoint trained on (``summary.json``'s
            ``devices``), shown where its config left them to the default.
    """
    def shown(name, value):
        if name == 'devices' and value is None:
            return ','.join(saved_devices) if saved_devices else 'the default'
        if name == 'balance':
            return ('by parameter count' if value is None else
                    value if isinstance(value, str) else ','.join(str(v) for v in value))
        if name in ('mirror', 'shard_optimizer'):
            return 'on' if value else 'off'
        return 'none' if value is None else str(value)

    changes = []
    for name in RESUME_PLAN:
        old, new = saved.get(name, ADDED_PLAN.get(name)), getattr(cfg, name)
        if isinstance(old, list):
            old = tuple(old)
        if name == 'devices' and old is None and new == shown(name, old):
            continue  # the default's devices, now given by name
        if old != new:
            changes.append('--%s %s (was %s)' % (name.replace('_', '-'), shown(name, new),
                                                 shown(name, old)))
    return changes


def _freeze(value):
    """Task arguments as a sorted tuple of ``(key, value)`` pairs, lists made
    tuples (JSON gives lists back), so that a config compares and hashes."""
    def frozen(v):
        return tuple(frozen(x) for x in v) if isinstance(v, (list, tuple)) else v
    if isinstance(value, dict):
        value = value.items()
    pairs = []
    for item in value or ():
        key, arg = item
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError('task_args: expected KEY=VALUE with KEY a Python name, found %r'
                             % (key,))
        problem = _unstorable(arg)
        if problem is not None:
            raise ValueError('task_args: expected values summary.json stores exactly (numbers, '
                             'strings, True, False, None, lists, dicts with string keys), found '
                             '%s=%s (%s)' % (key, _excerpt(repr(arg)), problem))
        pairs.append((key, frozen(arg)))
    return tuple(sorted(pairs))


def _unstorable(value, depth=0):
    """Why ``value`` would not come back from JSON as it went in, or None.

    A task argument is recorded in ``summary.json`` and compared on resume:
    bytes, sets, complex numbers and Ellipsis cannot be written, a dict key
    that is not a string comes back as one, and NaN never equals itself.
    """
    if depth > 32:
        return 'nested more than 32 deep'
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else 'not a finite number'
    if isinstance(value, (list, tuple)):
        items = value
    elif isinstance(value, dict):
        keys = [k for k in value if not isinstance(k, str)]
        if keys:
            return 'a dict key that is not a string: %r' % (keys[0],)
        items = value.values()
    else:
        return type(value).__name__
    for item in items:
        problem = _unstorable(item, depth + 1)
        if problem is not None:
            return problem
    return None


def _excerpt(text, limit=60):
    """``text`` cut to ``limit`` characters for a message (``...`` marks the cut)."""
    return text if len(text) <= limit else text[:limit - 3] + '...'


def _utf8(text):
    try:
        text.encode('utf-8')
        return True
    except UnicodeEncodeError:
        return False
