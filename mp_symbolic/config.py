"""Training configuration: one frozen dataclass, one field per CLI flag.

Fields left ``None`` take the task's default (``mp_symbolic.tasks.<task>.DEFAULTS``):
the regression trains in a few seconds with plain SGD, the digits CNN with
SGD + momentum.
"""
from dataclasses import dataclass, fields
import os

__all__ = ['TrainConfig', 'VARIANTS', 'APIS', 'OPTIMIZERS', 'KVSTORES', 'MAX_EPOCHS',
           'RESUME_IDENTITY', 'resume_config']

VARIANTS = ('symbolic', 'imperative')
APIS = ('module', 'executor')
OPTIMIZERS = ('sgd', 'adam')
KVSTORES = ('local', 'device', 'dist_sync')
MAX_EPOCHS = 100000
MAX_EXAMPLES = 10 ** 8        # synthetic examples: 800 MB of float32 features at most
_TASK_FIELDS = ('widths', 'num_examples')  # the regression's own flags


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs.

    Raises:
        ValueError: a field is out of range; the message names the field and
            the value found.
    """
    # 'regression' (the seed question's 2-2-2-1 network) or 'digits' (a CNN on 8x8 digits).
    task: str = 'regression'
    # 'symbolic' (ctx_group graph bound with group2ctx) or 'imperative' (Gluon + autograd).
    variant: str = 'symbolic'
    # Symbolic variant only: 'module' (mx.mod.Module, group2ctxs) or 'executor'
    # (Symbol.simple_bind, group2ctx).
    api: str = 'module'
    # '--devices' string such as 'cpu:0,cpu:1,cpu:2'; None: three GPUs if present, else cpu(0..2).
    devices: str = None
    # Regression only: layer widths, input first; None: (2, 2, 2, 1), the seed's network.
    widths: tuple = None
    # Regression only: synthetic examples; None: 10 000 (the seed's).
    num_examples: int = None
    # Examples per step; a last, smaller batch is dropped. None: 100 (regression), 64 (digits).
    batch_size: int = None
    # Passes over the data. None: 5 (regression reaches the noise floor), 10 (digits).
    num_epochs: int = None
    # 'sgd' or 'adam'. None: 'sgd'.
    optimizer: str = None
    # Learning rate; gradients are averaged over the batch. None: 0.02 (regression), 0.1 (digits).
    lr: float = None
    # SGD momentum (must stay 0 with Adam). None: 0 (regression), 0.9 (digits).
    momentum: float = None
    # Seeds the data, the batch order and the initial parameters.
    seed: int = 0
    # Output folder; None: artifacts/<variant>/ (regression), artifacts/digits[-imperative]/.
    out: str = None
    # Show a tqdm progress bar.
    progress: bool = True
    # Write an MXNet profiler trace (Chrome trace format) to <out>/profile.json.
    profile: bool = False
    # Symbolic variant: micro-batches per batch (GPipe); must divide the batch size.
    chunks: int = 1
    # Data-parallel copies of the pipeline; --devices lists replicas x stages devices.
    replicas: int = 1
    # Sums gradients across replicas or processes: 'local', 'device', 'dist_sync'.
    # None: 'local' with several replicas, else no kvstore.
    kvstore: str = None
    # Blocks per stage (a tuple), 'time', or None (balanced by parameter count).
    balance: object = None
    # Symbolic variant: every stage's ops recomputed in the backward pass (MXNet's mirroring).
    mirror: bool = False
    # Symbolic variant: measure memory per device (the plan beside one device) before
    # training, in child processes (about two seconds each); the command line turns it on.
    memory: bool = False
    # Commit a checkpoint (weights + optimizer state) every this many epochs, and at the end.
    checkpoint_every: int = 1
    # A training folder whose last committed checkpoint this run continues.
    resume: str = None

    def __post_init__(self):
        def bad(name, expected):
            raise ValueError('%s: expected %s, found %r' % (name, expected, getattr(self, name)))

        from .tasks import TASKS, get_task  # pylint: disable=import-outside-toplevel
        if self.task not in TASKS:
            bad('task', ' or '.join(TASKS))
        defaults = get_task(self.task).DEFAULTS
        for name in _TASK_FIELDS:
            if name not in defaults and getattr(self, name) is not None:
                bad(name, 'it unset with task %r (it is a regression setting)' % self.task)
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.variant not in VARIANTS:
            bad('variant', ' or '.join(VARIANTS))
        if self.api not in APIS:
            bad('api', ' or '.join(APIS))
        if self.optimizer not in OPTIMIZERS:
            bad('optimizer', ' or '.join(OPTIMIZERS))
        if self.widths is not None:
            object.__setattr__(self, 'widths', tuple(self.widths))
            if (len(self.widths) < 2 or not all(_is_int(w) and w >= 1 for w in self.widths)):
                bad('widths', 'at least two positive integers')
            if self.widths[0] != 2 or self.widths[-1] != 1:
                bad('widths', 'input width 2 and output width 1 (the data has 2 features, '
                              '1 target)')
            if sum(a * b + b for a, b in zip(self.widths, self.widths[1:])) > 2 ** 28:
                bad('widths', 'at most 2**28 parameters in all (1 GiB of float32 weights, '
                              'before gradients and optimizer state)')
        for name in ('batch_size', 'num_epochs', 'chunks', 'replicas', 'checkpoint_every'):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                bad(name, 'a positive integer')
        if self.num_epochs > MAX_EPOCHS:
            bad('num_epochs', 'at most %d' % MAX_EPOCHS)
        if self.num_examples is not None:
            if not _is_int(self.num_examples) or not 1 <= self.num_examples <= MAX_EXAMPLES:
                bad('num_examples', 'a positive integer at most %d' % MAX_EXAMPLES)
            if self.batch_size > self.num_examples:
                bad('batch_size', 'at most num_examples (%d)' % self.num_examples)
        if not (isinstance(self.lr, (int, float)) and 1e-30 <= self.lr <= 1e6):
            bad('lr', 'a number in [1e-30, 1e6]')
        if not (isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1):
            bad('momentum', 'a number in [0, 1)')
        if not _is_int(self.seed) or not 0 <= self.seed < 2 ** 32:
            bad('seed', 'an integer in [0, 2**32) (MXNet seeds with 32 bits)')
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
        # Flags that would otherwise be silently ignored.
        if self.optimizer != 'sgd' and self.momentum != 0:
            bad('momentum', '0 with optimizer %r (momentum is an SGD setting)' % self.optimizer)
        if self.variant == 'imperative':
            for name, default in (('api', 'module'), ('chunks', 1), ('replicas', 1),
                                  ('kvstore', None), ('mirror', False)):
                if getattr(self, name) != default:
                    bad(name, '%r (the default) with variant \'imperative\' (it is a setting '
                              'of the symbolic variant)' % (default,))
        if self.api == 'executor' and (self.replicas > 1 or self.kvstore is not None):
            bad('api', "'module' with replicas or a kvstore (the executor API binds one "
                       'replica and sums no gradients)')
        if self.batch_size % (self.chunks * self.replicas):
            bad('batch_size', 'a multiple of chunks x replicas (%d x %d)'
                % (self.chunks, self.replicas))
        if self.replicas > 1 and self.kvstore is None:
            object.__setattr__(self, 'kvstore', 'local')

    def check_profiler_devices(self, devices):
        """Raises ValueError if MXNet's profiler cannot record on ``devices``.

        MXNet 1.9.1's profiler keeps one row per core, plus two, and aborts
        the process (``Check failed: idx < DeviceCount()``) on ``cpu(N)`` past
        them.
        """
        from .trace import profiler_cpu_limit  # pylint: disable=import-outside-toplevel
        limit = profiler_cpu_limit()
        over = ['cpu:%d' % d.device_id for d in devices
                if d.device_type == 'cpu' and d.device_id >= limit]
        if self.profile and over:
            raise ValueError('profile: expected cpu:N devices with N below %d on this %d-core '
                             'machine (MXNet\'s profiler aborts past them), found %s'
                             % (limit, limit - 2, ', '.join(over)))

    @property
    def out_dir(self):
        if self.out is not None:
            return self.out
        if self.resume is not None:
            return self.resume
        if self.task == 'regression':
            return os.path.join('artifacts', self.variant)
        return os.path.join('artifacts', self.task + ('' if self.variant == 'symbolic'
                                                      else '-' + self.variant))

    def optimizer_params(self):
        """Keyword arguments for ``mx.optimizer.create`` (without rescale_grad)."""
        params = {'learning_rate': self.lr}
        if self.optimizer == 'sgd':
            params['momentum'] = self.momentum
        return params

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}


# What makes a run the same run: a resume must keep these. Devices, stages,
# chunks, replicas, the API and the epoch count may change.
RESUME_IDENTITY = ('task', 'variant', 'widths', 'num_examples', 'batch_size', 'optimizer',
                   'lr', 'momentum', 'seed')


def resume_config(saved, given):
    """The config of a resumed run.

    Args:
        saved: The checkpoint's config (``summary.json``'s ``config``).
        given: The fields set explicitly for this run (flags given).

    Returns:
        A :class:`TrainConfig`: ``saved``'s identity (:data:`RESUME_IDENTITY`)
        with ``given``'s other fields.

    Raises:
        ValueError: a given identity field differs from the checkpoint's, or
            the checkpoint's config is not one this version can read.
    """
    if not isinstance(saved, dict) or not all(k in saved for k in RESUME_IDENTITY):
        raise ValueError('resume: expected a checkpoint recording its training config, found '
                         '%r' % (sorted(saved) if isinstance(saved, dict) else saved,))
    values = {}
    for name in RESUME_IDENTITY:
        if name == 'widths' and not (saved[name] is None or isinstance(saved[name], list)):
            raise ValueError('resume: expected the checkpoint\'s widths to be a list, found %s'
                             % type(saved[name]).__name__)
        value = saved[name]
        if name == 'widths' and value is not None:
            value = tuple(value)
        if name in given and given[name] is not None and given[name] != value:
            if value is None:  # e.g. --widths for a task that has none
                raise ValueError('%s: expected none with resume (the checkpoint\'s %s run does '
                                 'not set it), found %r' % (name, saved['task'], given[name]))
            raise ValueError('%s: expected the checkpoint\'s %r with resume (or leave it out), '
                             'found %r' % (name, value, given[name]))
        values[name] = value
    for name, value in given.items():
        if name not in RESUME_IDENTITY:
            values[name] = value
    if 'balance' in values and isinstance(values['balance'], list):
        values['balance'] = tuple(values['balance'])
    return TrainConfig(**values)


def _utf8(text):
    try:
        text.encode('utf-8')
        return True
    except UnicodeEncodeError:
        return False


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)
