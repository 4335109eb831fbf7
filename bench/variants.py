"""The training loops the benchmark runs, behind one interface.

Each variant is an object with ``run(num_steps)`` (steps on its own batch
stream, left unsynchronised) and ``params()`` (numpy, ``layer<i>_weight`` is
``(out, in)``), so one harness times them all. The project's variants train
with :class:`~mp_symbolic.config.TrainConfig`'s SGD and batch order; the seed's
loop keeps its own Adam (lr 0.001) and its in-order batches.
"""
from collections import OrderedDict
from dataclasses import replace

import mxnet as mx
from mxnet import autograd, gluon

from mp_symbolic.config import TrainConfig
from mp_symbolic.data import batches
from mp_symbolic.model import build_net
from mp_symbolic.placement import make_plan
from mp_symbolic.train import create_optimizer, make_stepper

from .seed_loop import SeedLoop

__all__ = ['HybridStepper', 'StepLoop', 'VARIANTS', 'make_variant', 'BASELINE',
           'REFERENCE', 'SEED']

REFERENCE = 'symbolic MP (Module)'
BASELINE = 'symbolic 1-device'
SEED = 'seed loop (Adam 1e-3)'
THREE = 'cpu:0,cpu:1,cpu:2'
VARIANTS = (REFERENCE, 'symbolic MP (executor)', BASELINE, 'imperative MP',
            'Gluon hybridized 1-device', SEED)


class HybridStepper:
    """The Gluon network hybridized on ``cpu(0)``, one ``gluon.Trainer``;
    ``step(X, y)`` as the project's steppers."""

    def __init__(self, cfg, init, ctx=mx.cpu(0)):
        self.ctx = ctx
        self.net = build_net(cfg.widths, (0,) * cfg.num_layers)
        self.net.initialize(ctx=ctx)
        for name, param in self.net.collect_params().items():
            param.set_data(mx.nd.array(init[name]))
        self.net.hybridize(static_alloc=True, static_shape=True)
        self.trainer = gluon.Trainer(self.net.collect_params(), create_optimizer(cfg),
                                     kvstore=None)
        self._loss_fn = gluon.loss.L2Loss()

    def step(self, X, y):
        X, y = mx.nd.array(X, ctx=self.ctx), mx.nd.array(y, ctx=self.ctx)
        with autograd.record():
            pred = self.net(X)
            loss = self._loss_fn(pred, y)
        loss.backward()
        self.trainer.step(1)  # rescale_grad is already 1 / batch_size
        # the batch MSE, left unread, as every project stepper returns it
        return mx.nd.mean(mx.nd.square(pred.detach() - y))

    def params(self):
        return OrderedDict((n, p.data().asnumpy()) for n, p in self.net.collect_params().items())


class StepLoop:
    """Runs a stepper over ``mp_symbolic.data.batches``, epoch after epoch."""

    def __init__(self, stepper, X, y, cfg):
        self.stepper = stepper
        self._epoch_batches = lambda epoch: batches(X, y, cfg.batch_size, epoch, cfg.seed)
        self._epoch = 0
        self._it = self._epoch_batches(0)

    def run(self, num_steps):
        for _ in range(num_steps):
            batch = next(self._it, None)
            if batch is None:
                self._epoch += 1
                self._it = self._epoch_batches(self._epoch)
                batch = next(self._it)
            self.stepper.step(*batch)

    def params(self):
        return self.stepper.params()


def make_variant(name, X, y, batch_size, init):
    """The variant ``name`` (one of :data:`VARIANTS`), ready to ``run``.

    Raises:
        ValueError: ``name`` is not in :data:`VARIANTS`.
    """
    cfg = TrainConfig(batch_size=batch_size, num_examples=len(X), progress=False)
    three, _ = make_plan(cfg.num_layers, THREE)
    one, _ = make_plan(cfg.num_layers, 'cpu:0')
    if name == SEED:
        loop = SeedLoop(three.devices, batch_size=batch_size, init=init)
        return _SeedVariant(loop, X, y)
    if name == 'Gluon hybridized 1-device':
        stepper = HybridStepper(cfg, init)
    elif name in (REFERENCE, 'symbolic MP (executor)', BASELINE, 'imperative MP'):
        variant = 'imperative' if name == 'imperative MP' else 'symbolic'
        api = 'executor' if 'executor' in name else 'module'
        stepper = make_stepper(replace(cfg, variant=variant, api=api),
                               one if name == BASELINE else three, init)
    else:
        raise ValueError('unknown variant %r; expected one of %s' % (name, ', '.join(VARIANTS)))
    return StepLoop(stepper, X, y, cfg)


class _SeedVariant:
    def __init__(self, loop, X, y):
        self.loop, self.X, self.y = loop, X, y

    def run(self, num_steps):
        self.loop.run(self.X, self.y, num_steps)

    def params(self):
        return self.loop.params()
