"""The imperative twin: the same Pipeline run by Gluon and autograd.

Each parameter lives on its stage's device; the Pipeline's forward pass moves
activations from device to device (autograd records those copies, so the
gradient flows back across them), and one :class:`~mp_symbolic.Trainer`
updates every parameter on its own device (``gluon.Trainer`` refuses
parameters on different devices).
"""
from collections import OrderedDict

import mxnet as mx
from mxnet import autograd
import numpy as np

from .data import staged_batches
from ..core.graph.heads import gluon_loss, predict_form
from .symbolic import HostArrays, create_optimizer
from ..core.task import as_inputs, num_examples
from ..core.optim.trainer import Trainer

__all__ = []


class ImperativeStepper:
    """Trains ``pipe`` imperatively; same interface as the symbolic steppers.

    Args:
        pipe: The :class:`~mp_symbolic.Pipeline` (its Gluon parameters are
            placed and set to ``init``).
        task, cfg: The task module and the config.
        init: ``(arg_params, aux_params)`` as numpy dicts.
    """

    def __init__(self, pipe, task, cfg, init, label_shape=None):
        del label_shape
        self.pipe, self.plan, self.task, self.cfg = pipe, pipe.plan, task, cfg
        pipe.set_params(*init)
        self._arg_names = list(init[0])
        self._aux_names = list(init[1])
        self.trainer = Trainer(pipe.collect_params(),
                               create_optimizer(cfg, rescale_grad=1.0, task=task))
        self._loss_fn = gluon_loss(task.graph_loss)

    def batches(self, X, y, epoch):
        return staged_batches(X, y, self.cfg.batch_size, epoch, self.cfg.seed,
                              self.plan.first_device, self.plan.last_device)

    def step(self, X, y):
        with autograd.record():
            out = self.pipe(*as_inputs(X))  # each stage copies its input to its own device
            loss = self._loss_fn(out, y)
        loss.backward()  # outside record(): computing gradients needs no recording
        self.trainer.step(y.shape[0])
        return self.task.batch_loss(predict_form(self.task.graph_loss, out.detach()), y)

    def _collect(self, names, what, lazy=False):
        params = self.pipe.collect_params()
        arrays = OrderedDict((n, getattr(params[n], what)()) for n in names)
        return HostArrays(arrays) if lazy else \
            OrderedDict((n, a.asnumpy()) for n, a in arrays.items())

    def params(self, lazy=False):
        """Every parameter by name (numpy); with ``lazy`` a
        :class:`~mp_symbolic.training.symbolic.HostArrays` (each read when
        asked for, as it is then)."""
        return self._collect(self._arg_names, 'data', lazy)

    def aux(self, lazy=False):
        """Every auxiliary state by name (numpy), as :meth:`params`."""
        return self._collect(self._aux_names, 'data', lazy)

    def grads(self):
        params = self.pipe.collect_params()
        return self._collect([n for n in self._arg_names if params[n].grad_req != 'null'],
                             'grad')

    def placement(self):
        params = self.pipe.collect_params()
        return [(n, params[n].data().context,
                 params[n].grad().context if params[n].grad_req != 'null' else None)
                for n in self._arg_names + self._aux_names]

    def predict(self, X, batch_size=1024):
        outputs = []
        for start in range(0, num_examples(X), batch_size):
            out = self.pipe(*[mx.nd.array(x[start:start + batch_size], ctx=self.plan.first_device)
                              for x in as_inputs(X)])
            outputs.append(predict_form(self.task.graph_loss, out).asnumpy())
        return np.concatenate(outputs)

    def arg_aux(self):
        return self.pipe.get_params()

    def lazy_params(self):
        """:meth:`arg_aux`'s names, each value a function of no arguments
        making that one array on the host (numpy, the same bits) when called."""
        return self.pipe.get_params(lazy=True)

    def set_params(self, arg_params, aux_params, allow_missing=False):
        """Sets the parameters (numpy values or NDArrays), each on its
        device; with ``allow_missing``, those given only (the others keep theirs)."""
        self.pipe.set_params(arg_params, aux_params, allow_missing=allow_missing)

    def held_names(self):
        """The names of the parameters and auxiliary states this process
        holds: every one (a tensor-parallel layer's by its shards')."""
        return list(self.pipe.collect_params())

    def param_shapes(self):
        """``{name: shape}`` of the parameters and auxiliary states this process holds."""
        return {n: p.shape for n, p in self.pipe.collect_params().items()}

    def optimizer_states(self, lazy=False):
        """The Trainer's optimizer state by parameter name (with ``lazy``
        each of its arrays a function making it on the host when called)."""
        return self.trainer.states(lazy=lazy)

    def set_optimizer_states(self, states):
        self.trainer.set_states(states)
