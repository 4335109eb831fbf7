"""The training loops the benchmark runs, behind one interface.

Each variant is an object with ``run(num_steps)`` (steps on its own batch
stream, left unsynchronised) and ``params()`` (numpy, ``layer<i>_weight`` is
``(out, in)``), so one harness times them all. The project's variants train
with :class:`~mp_symbolic.training.config.TrainConfig`'s SGD and batch order; the seed's
loop keeps its own Adam (lr 0.001) and its in-order batches.

``bare executor (floor)`` is the least a step can cost on the model-parallel
plan: the bound graph's forward, backward and per-device update, fed batches
already staged on the stage devices (one on-device copy into the bound
arrays per input), with no loss read and no bookkeeping. The Module path is
measured against it.
"""
from collections import OrderedDict
from dataclasses import replace

import mxnet as mx
from mxnet import autograd, gluon

from mp_symbolic.training.config import TrainConfig
from mp_symbolic.training.data import staged_batches
from mp_symbolic.training.symbolic import ExecutorStepper, create_optimizer
from mp_symbolic.training.tasks import regression
from mp_symbolic.training.loop import build_pipeline, load, make_stepper

from .seed_loop import SeedLoop

__all__ = ['HybridStepper', 'StepLoop', 'VARIANTS', 'make_variant', 'BASELINE',
           'REFERENCE', 'SEED', 'FLOOR']

REFERENCE = 'symbolic MP (Module)'
BASELINE = 'symbolic 1-device'
SEED = 'seed loop (Adam 1e-3)'
FLOOR = 'bare executor (floor)'
THREE = 'cpu:0,cpu:1,cpu:2'
VARIANTS = (REFERENCE, 'symbolic MP (executor)', FLOOR, BASELINE, 'imperative MP',
            'Gluon hybridized 1-device', SEED)


class HybridStepper:
    """The Gluon network hybridized on ``cpu(0)``, one ``gluon.Trainer``;
    ``step(X, y)`` as the project's steppers."""

    def __init__(self, cfg, init, ctx=mx.cpu(0)):
        self.ctx, self.cfg = ctx, cfg
        self.net = gluon.nn.HybridSequential(prefix='')
        self.net.add(*regression.build_blocks())
        self.net.initialize(ctx=ctx)
        for name, param in self.net.collect_params().items():
            param.set_data(mx.nd.array(init[name]))
        self.net.hybridize(static_alloc=True, static_shape=True)
        self.trainer = gluon.Trainer(self.net.collect_params(), create_optimizer(cfg),
                                     kvstore=None)
        self._loss_fn = gluon.loss.L2Loss()

    def batches(self, X, y, epoch):
        return staged_batches(X, y, self.cfg.batch_size, epoch, self.cfg.seed, self.ctx,
                              self.ctx)

    def step(self, X, y):
        with autograd.record():
            pred = self.net(X)
            loss = self._loss_fn(pred, y)
        loss.backward()
        self.trainer.step(1)  # rescale_grad is already 1 / batch_size
        # the batch MSE, left unread, as every project stepper returns it
        return mx.nd.mean(mx.nd.square(pred.detach() - y))

    def params(self):
        return OrderedDict((n, p.data().asnumpy()) for n, p in self.net.collect_params().items())


class FloorStepper:
    """The executor stepper's step without its loss read: a copy of each
    staged batch into the bound arrays, forward, backward, per-device update."""

    def __init__(self, pipe, task, cfg, init, X, y):
        self.stepper = ExecutorStepper(pipe, task, cfg, (init, {}), (1,))
        self.loop = StepLoop(self.stepper, X, y, step='update_step')

    def run(self, num_steps):
        self.loop.run(num_steps)

    def params(self):
        return self.stepper.params()


class StepLoop:
    """Runs a stepper over its staged batches, epoch after epoch."""

    def __init__(self, stepper, X, y, step='step'):
        self.stepper = stepper
        self._step = getattr(stepper, step)
        self._epoch_batches = lambda epoch: stepper.batches(X, y, epoch)
        self._epoch = 0
        self._it = iter(self._epoch_batches(0))

    def run(self, num_steps):
        for _ in range(num_steps):
            batch = next(self._it, None)
            if batch is None:
                self._epoch += 1
                self._it = iter(self._epoch_batches(self._epoch))
                batch = next(self._it)
            self._step(*batch)

    def params(self):
        return self.stepper.params()


def make_variant(name, X, y, batch_size, init):
    """The variant ``name`` (one of :data:`VARIANTS`), ready to ``run``.

    Args:
        init: Initial parameters, name -> numpy array.

    Raises:
        ValueError: ``name`` is not in :data:`VARIANTS`.
    """
    task, cfg = load(TrainConfig(batch_size=batch_size, task_args={'num_examples': len(X)},
                                 progress=False, devices=THREE))
    if name == SEED:
        pipe, _ = build_pipeline(cfg, task)
        loop = SeedLoop(pipe.plan.devices, batch_size=batch_size, init=init)
        return _SeedVariant(loop, X, y)
    if name == 'Gluon hybridized 1-device':
        return StepLoop(HybridStepper(cfg, init), X, y)
    if name == FLOOR:
        return FloorStepper(build_pipeline(cfg, task)[0], task, cfg, init, X, y)
    if name in (REFERENCE, 'symbolic MP (executor)', BASELINE, 'imperative MP'):
        variant = 'imperative' if name == 'imperative MP' else 'symbolic'
        api = 'executor' if 'executor' in name else 'module'
        run_cfg = replace(cfg, variant=variant, api=api,
                          devices='cpu:0' if name == BASELINE else THREE)
        pipe, _ = build_pipeline(run_cfg, task)
        return StepLoop(make_stepper(run_cfg, pipe, task, (init, {}), (1,)), X, y)
    raise ValueError('unknown variant %r; expected one of %s' % (name, ', '.join(VARIANTS)))


class _SeedVariant:
    def __init__(self, loop, X, y):
        self.loop, self.X, self.y = loop, X, y

    def run(self, num_steps):
        self.loop.run(self.X, self.y, num_steps)

    def params(self):
        return self.loop.params()
