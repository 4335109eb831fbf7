"""Model-parallel training: the symbolic variant (Module or executor API) and
its imperative Gluon twin, behind one small "stepper" interface.

A stepper owns a placed network and its optimizer state; ``step(X, y)`` runs
forward, backward and one update on a batch and returns the batch MSE as an
NDArray (left unread, so steps are not synchronised). :func:`fit` runs the
epochs. Tests drive the steppers directly to compare variants step by step.

References: MXNet 1.9.1 ``tests/python/unittest/test_model_parallel.py``
(executor + ``group2ctx``), ``test_module.py::test_module_ctx_group``
(Module + ``group2ctxs``).
"""
from collections import OrderedDict
from dataclasses import dataclass, field
import glob
import os
import time

import mxnet as mx
from mxnet import autograd, gluon
import numpy as np
from tqdm import tqdm

from .checkpoint import save_checkpoint, write_json, write_text
from .data import batches, make_dataset
from .metrics import end_to_end_map, full_mse, map_error
from .model import DATA_NAME, LABEL_NAME, build_net, training_symbol
from .placement import format_device, make_plan
from .text import columns

__all__ = ['initial_params', 'create_optimizer', 'PerDeviceUpdater', 'ModuleStepper',
           'ExecutorStepper', 'ImperativeStepper', 'plan_symbol', 'make_stepper', 'fit', 'train',
           'TrainResult', 'TrainingDiverged', 'CHECKPOINT_NAME']

CHECKPOINT_NAME = 'regression'


class TrainingDiverged(RuntimeError):
    """Training ended with a non-finite loss; nothing was written."""


def initial_params(widths, seed=0):
    """Initial parameters, as numpy arrays, from the blocks' own initialisers.

    Drawn once on ``cpu(0)`` so that every variant and device plan starts from
    the same values for the same seed.
    """
    net = build_net(widths)
    mx.random.seed(seed)
    net.initialize(ctx=mx.cpu(0))
    return OrderedDict((name, p.data().asnumpy())
                       for name, p in net.collect_params().items())


def create_optimizer(cfg):
    """``cfg``'s optimizer; gradients averaged over the batch (``rescale_grad``)."""
    return mx.optimizer.create(cfg.optimizer, rescale_grad=1.0 / cfg.batch_size,
                               **cfg.optimizer_params())


class PerDeviceUpdater:
    """Wraps an ``mx.optimizer.Updater`` so each call updates one device's arrays.

    MXNet's Updater fuses up to ``MXNET_OPTIMIZER_AGGREGATION_SIZE`` (4)
    parameters into one ``multi_*_update`` op, grouping them by dtype only:
    handed the parameters of several devices at once (as ``Module.update``
    does), one op would run on one device over another device's weights. This
    splits each call by device and keeps the fusion within a device.
    """

    def __init__(self, updater):
        self.updater = updater

    def __call__(self, index, grad, weight):
        if not isinstance(index, (list, tuple)):
            return self.updater(index, grad, weight)
        by_device = OrderedDict()
        for i, g, w in zip(index, grad, weight):
            by_device.setdefault(w.context, []).append((i, g, w))
        for items in by_device.values():
            indices, grads, weights = zip(*items)
            self.updater(list(indices), list(grads), list(weights))
        return None

    def __getattr__(self, name):  # get_states, set_states, optimizer, ...
        return getattr(self.updater, name)


class _SymbolicStepper:
    """Shared by the two symbolic steppers: ``self._exec`` is the bound executor."""

    def __init__(self, plan):
        self.plan = plan
        self._label_ctx = plan.last_device

    def _loss(self, pred, y):
        # (batch, 1) on the last stage's device -> scalar, left unread
        return mx.nd.mean(mx.nd.square(pred - mx.nd.array(y, ctx=self._label_ctx)))

    @property
    def param_names(self):
        return [n for n in self._exec.arg_dict if n not in (DATA_NAME, LABEL_NAME)]

    def params(self):
        return OrderedDict((n, self._exec.arg_dict[n].asnumpy()) for n in self.param_names)

    def grads(self):
        return OrderedDict((n, self._exec.grad_dict[n].asnumpy()) for n in self.param_names)

    def placement(self):
        """``[(name, array device, gradient device or None)]`` as MXNet reports them."""
        return [(n, self._exec.arg_dict[n].context,
                 self._exec.grad_dict[n].context if self._exec.grad_dict.get(n) is not None
                 else None)
                for n in self._exec.arg_dict]

    def cross_device_copies(self):
        """``_CrossDeviceCopy`` nodes MXNet inserted when it bound the graph
        with ``group2ctx``, as ``(forward, backward)`` copies per step.

        Read from ``debug_str()``: the placed graph, one ``Op:<op>, Name=<node>``
        line per node.
        """
        names = [line.split('Name=', 1)[1] for line in self._exec.debug_str().splitlines()
                 if line.startswith('Op:_CrossDeviceCopy,')]
        backward = sum('_backward' in n for n in names)
        return len(names) - backward, backward


class ModuleStepper(_SymbolicStepper):
    """The symbolic graph trained through ``mx.mod.Module(..., group2ctxs=...)``."""

    def __init__(self, symbol, plan, cfg, init):
        super().__init__(plan)
        self.module = mx.mod.Module(symbol, data_names=(DATA_NAME,), label_names=(LABEL_NAME,),
                                    context=plan.first_device, group2ctxs=plan.group2ctx)
        self.module.bind(data_shapes=[(DATA_NAME, (cfg.batch_size, cfg.widths[0]))],
                         label_shapes=[(LABEL_NAME, (cfg.batch_size, cfg.widths[-1]))])
        self.module.init_params(arg_params={k: mx.nd.array(v) for k, v in init.items()},
                                aux_params={}, allow_missing=False)
        # kvstore=None: no parameter server; the Module's updater updates in place.
        self.module.init_optimizer(kvstore=None, optimizer=create_optimizer(cfg))
        # pylint: disable=protected-access
        self.module._updater = PerDeviceUpdater(self.module._updater)
        self._exec = self.module._exec_group.execs[0]  # pylint: disable=protected-access

    def step(self, X, y):
        batch = mx.io.DataBatch(data=[mx.nd.array(X)], label=[mx.nd.array(y)])
        self.module.forward(batch, is_train=True)
        self.module.backward()
        self.module.update()
        return self._loss(self.module.get_outputs()[0], y)


class ExecutorStepper(_SymbolicStepper):
    """The symbolic graph bound with ``Symbol.simple_bind(..., group2ctx=...)``,
    updated by an optimizer updater in a plain loop."""

    def __init__(self, symbol, plan, cfg, init):
        super().__init__(plan)
        grad_req = {n: 'null' if n in (DATA_NAME, LABEL_NAME) else 'write'
                    for n in symbol.list_arguments()}
        self._exec = symbol.simple_bind(
            ctx=plan.first_device, group2ctx=plan.group2ctx, grad_req=grad_req,
            **{DATA_NAME: (cfg.batch_size, cfg.widths[0]),
               LABEL_NAME: (cfg.batch_size, cfg.widths[-1])})
        for name, value in init.items():
            mx.nd.array(value).copyto(self._exec.arg_dict[name])
        self._updater = PerDeviceUpdater(
            mx.optimizer.get_updater(create_optimizer(cfg)))

    def step(self, X, y):
        self._exec.forward(is_train=True, **{DATA_NAME: X, LABEL_NAME: y})
        self._exec.backward()
        names = self.param_names
        # weight, gradient and optimizer state of each parameter share its device
        self._updater(list(range(len(names))), [self._exec.grad_dict[n] for n in names],
                      [self._exec.arg_dict[n] for n in names])
        return self._loss(self._exec.outputs[0], y)


class ImperativeStepper:
    """The same blocks in Gluon, each layer's parameters on its stage's device.

    ``gluon.Trainer`` requires all its parameters on the same set of devices,
    so there is one Trainer per device, each updating that device's
    parameters; ``step()`` on each after one backward pass.
    """

    def __init__(self, plan, cfg, init):
        self.plan = plan
        self.net = build_net(cfg.widths, plan.stage_of_layer)
        by_device = OrderedDict()
        for i, layer in enumerate(self.net):
            ctx = plan.device_of_layer(i)
            for name, param in layer.collect_params().items():
                param.initialize(ctx=ctx)
                param.set_data(mx.nd.array(init[name]))
                by_device.setdefault(ctx, OrderedDict())[name] = param
        self.trainers = [gluon.Trainer(params, create_optimizer(cfg),
                                       kvstore=None)
                         for params in by_device.values()]
        self._loss_fn = gluon.loss.L2Loss()  # 0.5 * (pred - y)**2 per sample

    def step(self, X, y):
        X = mx.nd.array(X, ctx=self.plan.first_device)
        y = mx.nd.array(y, ctx=self.plan.last_device)
        with autograd.record():
            pred = self.net(X)  # each layer copies its input to its own device
            loss = self._loss_fn(pred, y)
        loss.backward()  # outside record(): computing gradients needs no recording
        for trainer in self.trainers:
            # rescale_grad is already 1 / batch_size; step(1) keeps it so
            trainer.step(1)
        return mx.nd.mean(mx.nd.square(pred.detach() - y))

    def _collect(self, what):
        return OrderedDict((name, getattr(p, what)().asnumpy())
                           for name, p in self.net.collect_params().items())

    def params(self):
        return self._collect('data')

    def grads(self):
        return self._collect('grad')

    def placement(self):
        return [(name, p.data().context, p.grad().context)
                for name, p in self.net.collect_params().items()]


def plan_symbol(cfg, plan):
    """The training symbol of ``cfg``'s network, its layers tagged with ``plan``'s stages."""
    return training_symbol(build_net(cfg.widths, plan.stage_of_layer))


def make_stepper(cfg, plan, init):
    """The stepper for ``cfg.variant`` / ``cfg.api`` on ``plan``."""
    if cfg.variant == 'imperative':
        return ImperativeStepper(plan, cfg, init)
    symbol = plan_symbol(cfg, plan)
    cls = ModuleStepper if cfg.api == 'module' else ExecutorStepper
    return cls(symbol, plan, cfg, init)


@dataclass
class TrainResult:
    """What :func:`fit` measured."""
    step_losses: list           # batch MSE of every step, in order
    epoch_losses: list          # mean batch MSE of each epoch
    params: dict                # name -> numpy array, after training
    final_mse: float            # full-data MSE after training
    learned_w: list             # end-to-end weight (out, in)
    learned_b: list             # end-to-end bias (out,)
    map_error: float            # max |learned - true| over the map's entries
    wall_time: float            # seconds, training loop only, after mx.nd.waitall()
    samples_per_sec: float
    placement: list = field(default_factory=list)  # [(name, device, grad device)]
    files: dict = field(default_factory=dict)


def fit(stepper, X, y, cfg, log=print):
    """Runs ``cfg.num_epochs`` epochs of ``stepper`` on ``(X, y)``.

    Args:
        log: Called with each line of per-epoch output.
    """
    step_losses, epoch_losses = [], []
    steps_per_epoch = len(X) // cfg.batch_size
    # disable=None: no bar when stderr is not a terminal
    bar = tqdm(total=cfg.num_epochs * steps_per_epoch, unit='batch', leave=False,
               disable=None if cfg.progress else True, desc='train')
    mx.nd.waitall()
    start = time.perf_counter()
    for epoch in range(cfg.num_epochs):
        losses = []
        for X_batch, y_batch in batches(X, y, cfg.batch_size, epoch, cfg.seed):
            losses.append(stepper.step(X_batch, y_batch))
            bar.update()
        # one synchronisation per epoch: (steps,) on the last stage's device
        values = mx.nd.stack(*losses).asnumpy().ravel().tolist()
        step_losses += values
        epoch_losses.append(float(np.mean(values)))
        bar.set_postfix(mse='%.3g' % epoch_losses[-1])
        with tqdm.external_write_mode():  # clears the bar while the line is written
            log('epoch %d/%d  mean batch MSE %.4e' % (epoch + 1, cfg.num_epochs,
                                                     epoch_losses[-1]))
    mx.nd.waitall()
    wall = time.perf_counter() - start
    bar.close()
    params = stepper.params()
    W, b = end_to_end_map(params)
    return TrainResult(step_losses=step_losses, epoch_losses=epoch_losses, params=params,
                       final_mse=full_mse(params, X, y), learned_w=W.tolist(),
                       learned_b=b.tolist(), map_error=map_error(params), wall_time=wall,
                       samples_per_sec=cfg.num_epochs * steps_per_epoch * cfg.batch_size / wall,
                       placement=stepper.placement())


def placement_table(placement):
    """Lines of a table: each array -> its device (and its gradient's)."""
    return columns([('array', 'device', 'grad device')] +
                   [(n, d, g if g is not None else '-') for n, d, g in placement])


def train(cfg, log=print):
    """Trains ``cfg.variant`` end to end, prints the report, writes the
    checkpoint, and returns the :class:`TrainResult`.

    Raises:
        DeviceSpecError: ``cfg.devices`` cannot make a device plan.
        TrainingDiverged: the loss became NaN or infinite.
    """
    plan, note = make_plan(cfg.num_layers, cfg.devices)
    if note:
        log(note)
    name = cfg.variant + ('' if cfg.variant == 'imperative' else ' (%s API)' % cfg.api)
    log('%s model-parallel training, %d layers on %d device(s):'
        % (name, cfg.num_layers, plan.num_stages))
    for line in plan.describe():
        log('  ' + line)
    X, y = make_dataset(cfg.num_examples, cfg.seed)
    stepper = make_stepper(cfg, plan, initial_params(cfg.widths, cfg.seed))
    log('placement (as MXNet reports it):')
    for line in placement_table(stepper.placement()):
        log('  ' + line)

    if cfg.profile:
        profile_path = os.path.join(cfg.out_dir, 'profile.json')
        os.makedirs(cfg.out_dir, exist_ok=True)
        # Ops, executors and C API calls; memory counters say nothing about
        # placement and are left out.
        mx.profiler.set_config(profile_symbolic=True, profile_imperative=True,
                               profile_api=True, profile_memory=False,
                               aggregate_stats=True, filename=profile_path)
        mx.profiler.set_state('run')
    try:
        result = fit(stepper, X, y, cfg, log)
    finally:
        if cfg.profile:
            mx.nd.waitall()
            mx.profiler.set_state('stop')
            mx.profiler.dump()
            stats_path = os.path.join(cfg.out_dir, 'profile-stats.txt')
            write_text(stats_path, mx.profiler.dumps(reset=True))
    log('full-data MSE: %.3e' % result.final_mse)
    if not np.isfinite(result.final_mse):
        raise TrainingDiverged('training diverged (full-data MSE %s after %d epochs of %s at '
                               'lr %g); no checkpoint written; try a smaller --lr'
                               % (result.final_mse, cfg.num_epochs, cfg.optimizer, cfg.lr))
    W, b = np.array(result.learned_w), np.array(result.learned_b)
    log('learned map: y = %s . x + %s   (true: [2, -3.4] . x + 4.2; max error %.2e)'
        % (np.array2string(W.ravel(), precision=4), np.array2string(b, precision=4),
           result.map_error))
    log('training: %.2f s wall, %.0f samples/s' % (result.wall_time, result.samples_per_sec))

    prefix = os.path.join(cfg.out_dir, CHECKPOINT_NAME)
    symbol = plan_symbol(cfg, plan)
    sym_path, params_path = save_checkpoint(
        prefix, cfg.num_epochs, symbol,
        {k: mx.nd.array(v) for k, v in result.params.items()})
    # A params file of an earlier run with other epochs would sit beside the new
    # symbol and be taken for its pair.
    for stale in glob.glob(glob.escape(prefix) + '-[0-9][0-9][0-9][0-9].params'):
        if stale != params_path:
            os.remove(stale)
            log('removed %s (an earlier run)' % stale)
    result.files = {'symbol': sym_path, 'params': params_path}
    if cfg.profile:
        result.files['profile'] = profile_path
        result.files['profile_stats'] = stats_path
        log('profile: %s (open in chrome://tracing or ui.perfetto.dev), %s'
            % (profile_path, stats_path))
    summary_path = os.path.join(cfg.out_dir, 'summary.json')
    write_json(summary_path, {
        'config': cfg.to_dict(),
        'devices': [format_device(d) for d in plan.devices],
        'stage_of_layer': list(plan.stage_of_layer),
        'final_mse': result.final_mse, 'learned_w': result.learned_w,
        'learned_b': result.learned_b, 'map_error': result.map_error,
        'wall_time_s': result.wall_time, 'samples_per_sec': result.samples_per_sec,
        'epoch_losses': result.epoch_losses,
        'files': {k: os.path.basename(v) for k, v in result.files.items()},
        'mxnet_version': mx.__version__,
    })
    log('checkpoint: %s, %s' % (sym_path, params_path))
    return result
