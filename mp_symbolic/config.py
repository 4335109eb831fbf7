"""Training configuration: one frozen dataclass, one field per CLI flag."""
from dataclasses import dataclass, fields
import os

__all__ = ['TrainConfig', 'VARIANTS', 'APIS', 'OPTIMIZERS']

VARIANTS = ('symbolic', 'imperative')
APIS = ('module', 'executor')
OPTIMIZERS = ('sgd', 'adam')


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs.

    Raises:
        ValueError: a field is out of range; the message names the field and
            the value found.
    """
    # 'symbolic' (ctx_group graph bound with group2ctx) or 'imperative' (Gluon + autograd).
    variant: str = 'symbolic'
    # Symbolic variant only: 'module' (mx.mod.Module, group2ctxs) or 'executor'
    # (Symbol.simple_bind, group2ctx).
    api: str = 'module'
    # '--devices' string such as 'cpu:0,cpu:1,cpu:2'; None: three GPUs if present, else cpu(0..2).
    devices: str = None
    # Layer widths, input first; (2, 2, 2, 1) is the seed's network. Data has 2 features, 1 target.
    widths: tuple = (2, 2, 2, 1)
    # Synthetic examples (the seed uses 10 000).
    num_examples: int = 10000
    # Examples per step (the seed uses 100); a last, smaller batch is dropped.
    batch_size: int = 100
    # Passes over the data; 5 reaches full-data MSE ~1e-6 (the noise floor) with the default SGD.
    num_epochs: int = 5
    # 'sgd' or 'adam'. Plain SGD converges in one epoch here; the seed's Adam at
    # lr 1e-3 needs 16 epochs.
    optimizer: str = 'sgd'
    # Learning rate; gradients are averaged over the batch (rescale_grad = 1 / batch_size).
    lr: float = 0.02
    # SGD momentum (must stay 0 with Adam).
    momentum: float = 0.0
    # Seeds the data, the batch order and the initial parameters.
    seed: int = 0
    # Output folder; None: artifacts/<variant>/.
    out: str = None
    # Show a tqdm progress bar.
    progress: bool = True
    # Write an MXNet profiler trace (Chrome trace format) to <out>/profile.json.
    profile: bool = False

    def __post_init__(self):
        def bad(name, expected):
            raise ValueError('%s: expected %s, found %r' % (name, expected, getattr(self, name)))

        if self.variant not in VARIANTS:
            bad('variant', ' or '.join(VARIANTS))
        if self.api not in APIS:
            bad('api', ' or '.join(APIS))
        if self.optimizer not in OPTIMIZERS:
            bad('optimizer', ' or '.join(OPTIMIZERS))
        object.__setattr__(self, 'widths', tuple(self.widths))
        if (len(self.widths) < 2 or not all(_is_int(w) and w >= 1 for w in self.widths)):
            bad('widths', 'at least two positive integers')
        if self.widths[0] != 2 or self.widths[-1] != 1:
            bad('widths', 'input width 2 and output width 1 (the data has 2 features, 1 target)')
        if any(a * b >= 2 ** 31 for a, b in zip(self.widths, self.widths[1:])):
            bad('widths', 'layers of fewer than 2**31 weights each (MXNet 1.x indexes '
                          'tensors with 32-bit integers)')
        for name in ('num_examples', 'batch_size', 'num_epochs'):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                bad(name, 'a positive integer')
        if self.batch_size > self.num_examples:
            bad('batch_size', 'at most num_examples (%d)' % self.num_examples)
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr <= _FLOAT32_MAX):
            bad('lr', 'a positive number a float32 can hold')
        if not (isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1):
            bad('momentum', 'a number in [0, 1)')
        if not _is_int(self.seed) or self.seed < 0:
            bad('seed', 'a non-negative integer')
        # Flags that would otherwise be silently ignored.
        if self.optimizer != 'sgd' and self.momentum != 0:
            bad('momentum', '0 with optimizer %r (momentum is an SGD setting)' % self.optimizer)
        if self.variant == 'imperative' and self.api != 'module':
            bad('api', "'module' (the default) with variant 'imperative' "
                       '(the API choice is for the symbolic variant)')

    def check_profiler_devices(self, devices):
        """Raises ValueError if MXNet's profiler cannot record on ``devices``.

        MXNet 1.9.1's profiler keeps one row per core, plus two, and aborts
        the process (``Check failed: idx < DeviceCount()``) on ``cpu(N)`` past
        them.
        """
        limit = (os.cpu_count() or 1) + 2
        over = ['cpu:%d' % d.device_id for d in devices
                if d.device_type == 'cpu' and d.device_id >= limit]
        if self.profile and over:
            raise ValueError('profile: expected cpu:N devices with N below %d on this %d-core '
                             'machine (MXNet\'s profiler aborts past them), found %s'
                             % (limit, limit - 2, ', '.join(over)))

    @property
    def num_layers(self):
        return len(self.widths) - 1

    @property
    def out_dir(self):
        return self.out if self.out is not None else os.path.join('artifacts', self.variant)

    def optimizer_params(self):
        """Keyword arguments for ``mx.optimizer.create`` (without rescale_grad)."""
        params = {'learning_rate': self.lr}
        if self.optimizer == 'sgd':
            params['momentum'] = self.momentum
        return params

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}


_FLOAT32_MAX = 3.4028234663852886e38


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)
