"""The training loop of the question this project answers, made importable.

Origin: the code of the StackOverflow question "Simple example of mxnet model
parallelism" (a Gluon ``Block`` per layer, each on its own GPU, updated by a
hand-written ``mytrainer`` because ``gluon.Trainer`` refuses parameters on
different devices). Its logic is kept step for step: ``myDenseBlock`` moves
its input with ``as_in_context``, weights are ``(in, out)`` used as
``nd.dot(x, w) + b``, one Adam updater (lr 0.001) is shared by all
parameters, ``mytrainer`` checks ``_fresh_grad`` before each update, and the
loss is read with ``error.asnumpy()`` every 10 iterations.

What changed, so it can be imported, measured and tested: the global
``ctxList`` became the ``ctx_list`` argument (``cpu(0..2)`` stand in for the
GPUs), the data, batch size and step count are arguments, printing goes
through a ``log`` callable, the stale-gradient ``print`` + ``assert False``
became an exception, and the initial parameters can be given (in this
project's ``(out, in)`` layout) so that every loop starts from the same point.
Nothing runs at import.
"""
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import Block
import numpy as np

__all__ = ['myDenseBlock', 'build_net', 'square_loss', 'mytrainer', 'SeedLoop']


class myDenseBlock(Block):  # the seed's name; pylint: disable=invalid-name
    """A custom layer on device ``ctx``: ``(batch, in) -> (batch, out)``."""

    def __init__(self, ctx, size_input, size_output, **kwargs):
        super().__init__(**kwargs)
        self.ctx = ctx
        self.size_input = size_input
        self.size_output = size_output
        with self.name_scope():
            self.w = self.params.get('weight', init=mx.init.Xavier(magnitude=2.24),
                                     shape=(size_input, size_output), grad_req='write')
            self.b = self.params.get('bias', init=mx.init.Constant(0.5),
                                     shape=(size_output,), grad_req='write')

    def forward(self, x):  # pylint: disable=arguments-differ
        x = x.as_in_context(self.ctx)
        with x.context:
            return nd.dot(x, self.w.data()) + self.b.data()


def build_net(ctx_list, widths=(2, 2, 2, 1)):
    """The seed's ``Sequential`` of ``myDenseBlock``, layer ``i`` initialised on
    ``ctx_list[i]``."""
    net = gluon.nn.Sequential()
    with net.name_scope():
        for i, ctx in enumerate(ctx_list):
            net.add(myDenseBlock(ctx, size_input=widths[i], size_output=widths[i + 1]))
    for block in net:
        block.collect_params().initialize(ctx=block.ctx)
    return net


def square_loss(yhat, y):
    return nd.mean((yhat - y) ** 2)


def mytrainer(updaters, params, ignore_stale_grad=False):
    """The seed's update: each parameter by its updater, if its gradient is fresh.

    Raises:
        RuntimeError: a parameter's gradient was not written since its last
            update (the failure the question reports on MXNet < 1.0).
    """
    for i, param in enumerate(params):
        if params[param].grad_req == 'null':
            continue
        if not ignore_stale_grad:
            for data in params[param].list_data():
                if not data._fresh_grad:  # pylint: disable=protected-access
                    raise RuntimeError('`%s` on context %s has not been updated'
                                       % (params[param].name, str(data.context)))
        for upd, arr, grad in zip(updaters, params[param].list_data(),
                                  params[param].list_grad()):
            if not ignore_stale_grad or arr._fresh_grad:  # pylint: disable=protected-access
                upd(i, grad, arr)
                arr._fresh_grad = False  # pylint: disable=protected-access


class SeedLoop:
    """The seed's loop, resumable: :meth:`run` continues where it stopped.

    Args:
        ctx_list: Device of each layer, e.g. ``[mx.cpu(0), mx.cpu(1), mx.cpu(2)]``.
        batch_size: Examples per step (the seed uses 100).
        lr: Adam learning rate (the seed uses 0.001).
        init: Optional ``{'layer<i>_weight': (out, in), 'layer<i>_bias': (out,)}``
            numpy arrays to start from instead of the blocks' initialisers.
    """

    def __init__(self, ctx_list, batch_size=100, lr=0.001, init=None):
        self.ctx_list = list(ctx_list)
        self.batch_size = batch_size
        self.net = build_net(self.ctx_list)
        if init is not None:
            for i, block in enumerate(self.net):
                block.w.set_data(nd.array(init['layer%d_weight' % i].T))
                block.b.set_data(nd.array(init['layer%d_bias' % i]))
        opt = mx.optimizer.create('adam', learning_rate=lr, rescale_grad=1 / batch_size)
        self.updaters = [mx.optimizer.get_updater(opt)]
        self.iteration = -1
        self.results = []  # [iteration, batch MSE] every 10 iterations, as in the seed

    def run(self, X, y, num_steps, log=None):
        """Runs ``num_steps`` iterations of the seed's loop body on ``(X, y)``.

        Batches are the seed's: ``np.array_split`` of the examples in order,
        one after the other, epoch after epoch.
        """
        train_groups = np.array_split(np.arange(X.shape[0]), X.shape[0] / self.batch_size)
        ctx_list = self.ctx_list
        for _ in range(num_steps):
            self.iteration += 1
            e, ii = divmod(self.iteration, len(train_groups))
            idx = train_groups[ii]
            xtrain, ytrain = X[idx, :], y[idx]

            xtrain = nd.array(xtrain)
            xtrain = xtrain.as_in_context(ctx_list[0])

            ytrain = nd.array(ytrain).reshape((-1, 1))
            ytrain = ytrain.as_in_context(ctx_list[0])

            with autograd.record():
                yhat = self.net(xtrain)
                error = square_loss(yhat, ytrain.as_in_context(ctx_list[-1]))
            error.backward()

            mytrainer(self.updaters, self.net.collect_params())

            if self.iteration % 10 == 0:
                self.results.append([self.iteration, error.asnumpy().item()])
                if log is not None:
                    log('epoch= {:5,d}, iter= {:6,d},  error= {:6.3E}'.format(
                        e, self.iteration, error.asnumpy().item()))

    def params(self):
        """Parameters in this project's layout: ``layer<i>_weight`` is ``(out, in)``."""
        out = {}
        for i, block in enumerate(self.net):
            out['layer%d_weight' % i] = block.w.data().asnumpy().T
            out['layer%d_bias' % i] = block.b.data().asnumpy()
        return out
