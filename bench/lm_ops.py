"""``python -m bench.lm_ops``: the language model's norm and attention on each
candidate MXNet 1.9.1 op, forward and backward, alternated in one process.

Every candidate computes the same function on the same float32 inputs (batch
16, context 64, width C, 4 heads) and is bound as its own executor; each
timed run is ``STEPS`` forward and backward passes, the candidates taking
turns (:func:`bench.measure.throughput`'s rounds), so that the machine's
load touches all alike. Printed: milliseconds a forward and backward pass
(median of the rounds) and the largest difference of the output and of every
input's gradient from the reference, relative to the reference's largest
magnitude.

* LayerNorm over C, against MXNet's ``LayerNorm`` op: ``gpt.LayerNorm``
  (``fused=False``, the model's where the fused op cannot be built: means,
  variance and the spreads as ``FullyConnected`` products, ``gamma`` spread
  with each position's deviation in one product),
  ``gamma apart`` (the same with ``gamma`` spread by a product of its own and
  multiplied in apart), ``rsqrt`` (the model's with each position's
  reciprocal deviation by one ``rsqrt`` where ``reciprocal`` and ``sqrt`` take
  two), ``last axis`` (the model's products on the last axis of the input as
  it is, ``flatten=False``, with no reshape: in the model the input's
  gradients from the norm and from the residual path are then one ``add_n``),
  ``InstanceNorm`` (MXNet's ``InstanceNorm`` op over each position's C
  features as one channel, ``gamma`` and ``beta`` by products as the model's)
  and the ``LayerNorm`` op itself (its backward runs MXNet's generic
  reduction on CPU); and, where a C++ compiler builds it, ``fused op``: the
  model's, a custom operator of MXNet's library API, forward and backward
  each one pass a row (:mod:`mp_symbolic.core.kernels`).
* Causal attention of queries, keys and values ``(N, T, C)``, against
  ``gpt._Attend`` in MXNet's ops (the model's where the project's op is not
  chosen: the mask spread over the scores by one ``dot``):
  ``zeros_like mask`` (the mask made by ``zeros_like`` and
  ``broadcast_add``), ``interleaved`` (MXNet's fused
  ``_contrib_interleaved_matmul_selfatt_qk`` / ``_valatt``, the queries, keys
  and values stacked head by head into one ``(T, N, 3C)`` array and the
  result transposed back), ``softmax temperature`` (the scale as
  ``softmax``'s ``temperature`` instead of a product with the queries) and
  ``scores by linalg.gemm`` (the queries' scale, the scores' product and the
  mask's addition in one ``linalg.gemm`` on ``(N h, T, D)`` heads; MXNet
  1.9.1's ONNX exporter has no converter for it); and, where the project's
  library loads, ``products by small_batch_dot`` (the model's attention
  with its two products by the project's ``small_batch_dot``, the kernel
  the CPU runs named: :mod:`mp_symbolic.core.kernels`) and
  ``causal_attention op`` (the project's op, all of the attention in one:
  the model's wherever the library loads).
* The queries, keys and values of ``(N, T, C)`` inputs and the attention on
  them, against the model's three ``FullyConnected`` (``three products``):
  ``one product`` (the three weights and biases concatenated into one
  ``FullyConnected`` of ``3 C`` units, its output's heads made by one
  ``transpose`` and ``split``, as the model would have to with the
  parameters kept under their names).
* The loss head on the output layer's ``(N, T, 166)`` scores and the
  labels, against the model's ``SoftmaxOutput`` (``preserve_shape``; MXNet
  1.9.1 runs its oneDNN softmax at inference only, its generic kernel in
  training): ``SoftmaxOutput, 2-D`` (the scores as ``(N T, 166)`` rows and
  back), ``log_softmax, pick, MakeLoss`` (oneDNN's ``log_softmax``
  forward and backward; its output is each position's loss, not the
  probabilities) and ``softmax out, log_softmax gradient`` (the
  probabilities of oneDNN's ``softmax`` as the output, the gradient that
  one's) and the ``'log_softmax'`` head the language model trains with (the
  same, joined by a ``slice_like``; ``heads.make_head``); only the scores'
  gradient is compared.
* Adam over the model's parameters at width C (``--task lm``'s 36, its
  learning rate and batch), against MXNet's ``Updater`` (one ``Adam.update``
  and ``adam_update`` a parameter): ``updater.adam_step`` (the project's:
  its arguments made in one pass, then one ``fused_adam_update`` of the
  project's library over all parameters, bit for bit ``adam_update``'s; and
  the same without that op, one ``adam_update`` a parameter), and MXNet's multi-tensor
  ``_multi_adamw_update`` at weight decay 0 with Adam's bias-corrected
  learning rate, in one call or one call a size of array; and one
  ``adam_update`` over all parameters at once, where the weights, gradients
  and moments are views of one array each (the op is elementwise and every
  parameter has the same learning rate), by hand and as the project runs it
  (``updater.adam_contiguous``: ``PerDeviceUpdater`` over a
  ``Contiguous``). Printed: ms an
  update and the largest difference of the weights and first moments after
  one update more than the first.

Run with ``OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE`` for one thread, as
docs/lm.md's figures are.
"""
import argparse
import math

import mxnet as mx
import numpy as np

from mp_symbolic.core import kernels
from mp_symbolic.core.graph.heads import make_head
from mp_symbolic.tools.text import columns
from mp_symbolic.training.tasks import gpt

from .measure import throughput

__all__ = ['run', 'main']

BATCH, CONTEXT, HEADS = 16, 64, 4
STEPS = 10
EPSILON = 1e-5


def _centred(F, x, gamma, C):
    """``(centred rows, each row's variance, the column that spreads a row's
    value over its C entries)`` as ``gpt.LayerNorm`` computes them: means
    and spreads as products with constant weights."""
    rows = F.reshape(x, shape=(-1, C))
    ones = F.BlockGrad(F.ones_like(gamma))
    mean_of = F.reshape(ones, shape=(1, C)) * (1.0 / C)
    spread = F.reshape(ones, shape=(C, 1))
    centred = rows - F.FullyConnected(F.FullyConnected(rows, mean_of, no_bias=True, num_hidden=1),
                                      spread, no_bias=True, num_hidden=C)
    return centred, F.FullyConnected(F.square(centred), mean_of, no_bias=True, num_hidden=1), \
        spread


def _gamma_apart(F, x, gamma, beta, C):
    """``gpt.LayerNorm`` with ``gamma`` spread by a product of its own."""
    centred, variance, spread = _centred(F, x, gamma, C)
    scale = F.FullyConnected(F.reciprocal(F.sqrt(variance + EPSILON)), spread,
                             no_bias=True, num_hidden=C)
    each = F.BlockGrad(F.ones_like(variance))
    out = centred * scale * F.FullyConnected(each, F.reshape(gamma, shape=(C, 1)),
                                             no_bias=True, num_hidden=C) \
        + F.FullyConnected(each, F.reshape(beta, shape=(C, 1)), no_bias=True, num_hidden=C)
    return F.reshape_like(out, x)


def _rsqrt(F, x, gamma, beta, C):
    """``gpt.LayerNorm`` with each position's reciprocal deviation by one
    ``rsqrt`` where ``reciprocal`` and ``sqrt`` take two."""
    centred, variance, _ = _centred(F, x, gamma, C)
    scale = F.FullyConnected(F.rsqrt(variance + EPSILON), F.reshape(gamma, shape=(C, 1)),
                             no_bias=True, num_hidden=C)
    each = F.BlockGrad(F.ones_like(variance))
    out = centred * scale + F.FullyConnected(each, F.reshape(beta, shape=(C, 1)),
                                             no_bias=True, num_hidden=C)
    return F.reshape_like(out, x)


def _last_axis(F, x, gamma, beta, C):
    """``gpt.LayerNorm`` with every product on the last axis of ``x`` as it is."""
    ones = F.BlockGrad(F.ones_like(gamma))
    mean_of = F.reshape(ones, shape=(1, C)) * (1.0 / C)
    spread = F.reshape(ones, shape=(C, 1))
    centred = x - F.FullyConnected(
        F.FullyConnected(x, mean_of, no_bias=True, num_hidden=1, flatten=False),
        spread, no_bias=True, num_hidden=C, flatten=False)
    variance = F.FullyConnected(F.square(centred), mean_of, no_bias=True, num_hidden=1,
                                flatten=False)
    scale = F.FullyConnected(F.reciprocal(F.sqrt(variance + EPSILON)),
                             F.reshape(gamma, shape=(C, 1)), no_bias=True, num_hidden=C,
                             flatten=False)
    each = F.BlockGrad(F.ones_like(variance))
    return centred * scale + F.FullyConnected(each, F.reshape(beta, shape=(C, 1)),
                                              no_bias=True, num_hidden=C, flatten=False)


def _instance_norm(F, x, gamma, beta, C):
    """Each position's C features as the one channel of ``InstanceNorm``,
    ``gamma`` and ``beta`` spread by products as ``gpt.LayerNorm`` spreads them."""
    one = F.BlockGrad(F.ones_like(F.slice_axis(gamma, axis=0, begin=0, end=1)))   # (1,)
    normed = F.reshape(F.InstanceNorm(F.reshape(x, shape=(-1, 1, C)), one, one * 0,
                                      eps=EPSILON), shape=(-1, C))                # (R, C)
    each = F.BlockGrad(F.ones_like(F.slice_axis(normed, axis=1, begin=0, end=1)))  # (R, 1)
    out = normed * F.FullyConnected(each, F.reshape(gamma, shape=(C, 1)), no_bias=True,
                                    num_hidden=C) \
        + F.FullyConnected(each, F.reshape(beta, shape=(C, 1)), no_bias=True, num_hidden=C)
    return F.reshape_like(out, x)


NORMS = {
    'LayerNorm op': lambda F, x, g, b, C: F.LayerNorm(x, g, b, axis=-1, eps=EPSILON),
    'gpt.LayerNorm': lambda F, x, g, b, C: gpt.LayerNorm(
        C, fused=False, prefix='ln_').hybrid_forward(F, x, g, b),
    'gamma apart': _gamma_apart,
    'rsqrt': _rsqrt,
    'last axis': _last_axis,
    'InstanceNorm': _instance_norm,
}


FUSED = 'fused op (the model\'s)'
_SAID = []  # the one line saying why the fused op is left out, once a process


def _norms(log):
    """:data:`NORMS`, and :data:`FUSED` where :func:`mp_symbolic.core.kernels.fused_layer_norm`
    builds and loads it (otherwise a line of ``log`` says why it is left out)."""
    loaded, why = kernels.fused_layer_norm()
    if not loaded:
        if not _SAID:
            _SAID.append(why)
            log('norm candidate %s left out: %s' % (FUSED, why))
        return dict(NORMS)
    return dict(NORMS, **{FUSED: lambda F, x, g, b, C: F.fused_layer_norm(x, g, b,
                                                                            eps=EPSILON)})


def _heads(F, x, head_dim):
    return F.transpose(F.reshape(x, shape=(0, 0, -1, head_dim)), axes=(0, 2, 1, 3))


def _future(F, q):
    steps = F.contrib.arange_like(F.BlockGrad(q), axis=1)
    return F.broadcast_greater(F.reshape(steps, shape=(1, -1)), F.reshape(steps, shape=(-1, 1)))


def _zeros_like_mask(F, q, k, v, head_dim):
    future = _future(F, q)
    q, k, v = (_heads(F, part, head_dim) for part in (q * head_dim ** -0.5, k, v))
    scores = F.batch_dot(q, k, transpose_b=True)
    mask = F.BlockGrad(F.broadcast_add(F.zeros_like(scores), future * -1e9))
    out = F.batch_dot(F.softmax(scores + mask, axis=-1), v)
    return F.reshape(F.transpose(out, axes=(0, 2, 1, 3)), shape=(0, 0, -1))


def _temperature(F, q, k, v, head_dim):
    future = _future(F, q)
    q, k, v = (_heads(F, part, head_dim) for part in (q, k, v))
    scores = F.batch_dot(q, k, transpose_b=True)
    mask = F.BlockGrad(F.broadcast_add(F.zeros_like(scores), future * -1e9))
    out = F.batch_dot(F.softmax(scores + mask, axis=-1, temperature=head_dim ** 0.5), v)
    return F.reshape(F.transpose(out, axes=(0, 2, 1, 3)), shape=(0, 0, -1))


def _interleaved(F, q, k, v, head_dim):
    future = _future(F, q)
    parts = [F.reshape(p, shape=(0, 0, -1, head_dim)) for p in (q, k, v)]       # (N, T, h, D)
    qkv = F.reshape(F.transpose(F.stack(*parts, axis=3), axes=(1, 0, 2, 3, 4)),
                    shape=(0, 0, -1))                                           # (T, N, h 3 D)
    scores = F.contrib.interleaved_matmul_selfatt_qk(qkv, heads=HEADS)          # (N h, T, T)
    mask = F.BlockGrad(F.broadcast_add(F.zeros_like(scores), future * -1e9))
    out = F.contrib.interleaved_matmul_selfatt_valatt(qkv, F.softmax(scores + mask, axis=-1),
                                                      heads=HEADS)              # (T, N, C)
    return F.transpose(out, axes=(1, 0, 2))


def _linalg_gemm(F, q, k, v, head_dim):
    heads = [_heads(F, part, head_dim) for part in (q, k, v)]                   # (N, h, T, D)
    q, k, v = (F.reshape(part, shape=(-3, 0, 0)) for part in heads)             # (N h, T, D)
    future = _future(F, q)
    rows = F.reshape(F.ones_like(F.contrib.arange_like(F.BlockGrad(q), axis=0)), shape=(-1, 1))
    mask = F.BlockGrad(F.reshape_like(F.dot(rows, F.reshape(future * -1e9, shape=(1, -1))),
                                      future, lhs_begin=1, lhs_end=2, rhs_begin=0, rhs_end=2))
    scores = F.linalg.gemm(q, k, mask, transpose_b=True, alpha=head_dim ** -0.5, beta=1.0)
    out = F.reshape_like(F.batch_dot(F.softmax(scores, axis=-1), v), heads[0])  # (N, h, T, D)
    return F.reshape(F.transpose(out, axes=(0, 2, 1, 3)), shape=(0, 0, -1))


ATTENTIONS = {
    'gpt._Attend': lambda F, q, k, v, D: gpt._Attend(D)(F, q, k, v),  # pylint: disable=protected-access
    'zeros_like mask': _zeros_like_mask,
    'interleaved': _interleaved,
    'softmax temperature': _temperature,
    'scores by linalg.gemm': _linalg_gemm,
}


def _three_products(F, x, weights, biases, C):
    q, k, v = (F.FullyConnected(x, w, b, num_hidden=C, flatten=False)
               for w, b in zip(weights, biases))
    return gpt._Attend(C // HEADS)(F, q, k, v)  # pylint: disable=protected-access


def _one_product(F, x, weights, biases, C):
    qkv = F.FullyConnected(x, F.concat(*weights, dim=0), F.concat(*biases, dim=0),
                           num_hidden=3 * C, flatten=False)                     # (N, T, 3 C)
    heads = F.transpose(F.reshape(qkv, shape=(0, 0, 3, -1, C // HEADS)),
                        axes=(2, 0, 3, 1, 4))                                   # (3, N, h, T, D)
    q, k, v = (F.reshape(F.transpose(part, axes=(0, 2, 1, 3)), shape=(0, 0, -1))
               for part in F.split(heads, num_outputs=3, axis=0, squeeze_axis=True))
    return gpt._Attend(C // HEADS)(F, q, k, v)  # pylint: disable=protected-access


PROJECTIONS = {
    'three products': _three_products,
    'one product': _one_product,
}


VOCAB = 166   # the corpus' characters: the output layer's width


def _loss_2d(F, x, label):
    rows = F.SoftmaxOutput(F.reshape(x, shape=(-1, VOCAB)), F.reshape(label, shape=(-1,)))
    return F.reshape_like(rows, x)


def _probabilities_out(F, x, label):
    """``softmax``'s probabilities as the output, the gradient of
    ``log_softmax``, ``pick`` and ``MakeLoss`` (each position's loss, times
    0, added to them: the output's values are the probabilities')."""
    loss = F.MakeLoss(-F.pick(F.log_softmax(x, axis=-1), label, axis=-1))
    return F.broadcast_add(F.BlockGrad(F.softmax(x, axis=-1)), F.expand_dims(loss * 0, axis=-1))


LOSSES = {
    'SoftmaxOutput': lambda F, x, label: F.SoftmaxOutput(x, label, preserve_shape=True),
    'SoftmaxOutput, 2-D': _loss_2d,
    'log_softmax, pick, MakeLoss': lambda F, x, label: F.MakeLoss(
        -F.pick(F.log_softmax(x, axis=-1), label, axis=-1)),
    'softmax out, log_softmax gradient': _probabilities_out,
    "the 'log_softmax' head": lambda F, x, label: make_head('log_softmax', x, label),
}


class _LossPass:
    """One loss head bound on ``cpu(0)`` over scores ``x`` and labels:
    ``run(n)`` runs n forward and backward passes (a loss takes no output
    gradient); ``results()`` is the scores' gradient."""

    def __init__(self, symbol, scores, labels):
        self.exe = symbol.simple_bind(mx.cpu(0), x=scores.shape, label=labels.shape,
                                      grad_req={'x': 'write', 'label': 'null'})
        self.exe.arg_dict['x'][:] = scores
        self.exe.arg_dict['label'][:] = labels

    def run(self, num_steps):
        for _ in range(num_steps):
            self.exe.forward(is_train=True)
            self.exe.backward()

    def results(self):
        self.run(1)
        return [self.exe.grad_dict['x'].asnumpy()]


def _losses(rng, repeats, warmup):
    """The loss heads on ``(BATCH, CONTEXT, VOCAB)`` scores, timed and
    compared by the scores' gradient."""
    x, label = mx.sym.var('x'), mx.sym.var('label')
    scores = rng.normal(0, 2.0, (BATCH, CONTEXT, VOCAB))
    labels = rng.integers(0, VOCAB, (BATCH, CONTEXT))
    passes = {name: _LossPass(loss(mx.sym, x, label), scores, labels)
              for name, loss in LOSSES.items()}
    want = passes['SoftmaxOutput'].results()[0]
    error = {name: float(np.abs(p.results()[0] - want).max() / np.abs(want).max())
             for name, p in passes.items()}
    rates = throughput(passes, 1, STEPS, repeats, warmup)
    return {name: {'ms': 1e3 / rates[name][0], 'error': error[name]} for name in passes}


class _Pass:
    """One candidate bound on ``cpu(0)``: ``run(n)`` runs n forward and
    backward passes with the same output gradient."""

    def __init__(self, symbol, values, head_grad):
        self.exe = symbol.simple_bind(mx.cpu(0), **{n: v.shape for n, v in values.items()})
        for name, value in values.items():
            self.exe.arg_dict[name][:] = value
        self.head_grad = mx.nd.array(head_grad)
        self.names = sorted(values)

    def run(self, num_steps):
        for _ in range(num_steps):
            self.exe.forward(is_train=True)
            self.exe.backward(self.head_grad)

    def results(self):
        self.run(1)
        return [self.exe.outputs[0].asnumpy()] + [self.exe.grad_dict[n].asnumpy()
                                                  for n in self.names]


def _compare(candidates, reference, values, head_grad, repeats, warmup):
    passes = {name: _Pass(symbol, values, head_grad) for name, symbol in candidates.items()}
    want = passes[reference].results()
    error = {name: max(float(np.abs(g - w).max() / np.abs(w).max())
                       for g, w in zip(p.results(), want))
             for name, p in passes.items()}
    rates = throughput(passes, 1, STEPS, repeats, warmup)
    return {name: {'ms': 1e3 / rates[name][0], 'error': error[name]} for name in candidates}


ADAM = dict(learning_rate=3e-3, rescale_grad=1.0 / BATCH)   # the task's Adam, batch 16


def _shapes(C):
    """The shapes of the language model's parameters at width ``C`` (``--task lm``),
    and whether each is one no op of the model lays out anew (its updates
    may go to the fused op: ``runtime.plain_names``)."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.engine.runtime import plain_names
    cfg = gpt.GPTConfig(vocab_size=166, block_size=CONTEXT, num_layers=2, num_heads=HEADS,
                        num_hiddens=C)
    net = gpt.build_network(cfg)
    net.initialize(mx.init.Zero())
    net(mx.nd.zeros((1, CONTEXT)))
    params = net.collect_params()
    plain = set(plain_names(net(mx.sym.var('data')), list(params)))
    return [p.shape for p in params.values()], [name in plain for name in params]


def _multi_adamw(sizes):
    """``_multi_adamw_update`` (weight decay 0, ``eta`` 1, Adam's bias-corrected
    learning rate) on the parameters in groups: ``sizes`` True groups the
    parameters of one size together (the op's CPU kernel runs each group's
    largest size over every array in it), else one call over all."""
    def update(updater, indices, grads, weights):
        opt = updater.optimizer
        opt._update_count(indices)  # pylint: disable=protected-access
        t = opt._index_update_count[indices[0]]  # pylint: disable=protected-access
        lr = opt.lr * np.sqrt(1. - opt.beta2 ** t) / (1. - opt.beta1 ** t)
        groups = {}
        for k, w in enumerate(weights):
            groups.setdefault(w.size if sizes else 0, []).append(k)
        for group in groups.values():
            mx.nd.contrib.multi_adamw_update(
                [weights[k] for k in group], [grads[k] for k in group],
                [updater.states[indices[k]][0] for k in group],
                [updater.states[indices[k]][1] for k in group],
                rescale_grad=opt.rescale_grad, lrs=[lr] * len(group), wds=[0.] * len(group),
                etas=[1.] * len(group), out=[weights[k] for k in group], beta1=opt.beta1,
                beta2=opt.beta2, epsilon=opt.epsilon)
    return update


def _adam_step_op_a_parameter(updater, indices, grads, weights):
    """``updater.adam_step`` as it runs where the project's library does not
    load: one ``adam_update`` a parameter."""
    # pylint: disable=import-outside-toplevel,protected-access
    from mp_symbolic.core.optim import updater as module
    held = dict(module._OPS)
    module._OPS[kernels.FUSED_ADAM] = None
    try:
        assert module.adam_step(updater, indices, grads, weights)
    finally:
        module._OPS.clear()
        module._OPS.update(held)


def _flat(updater, indices, grads, weights):
    """One ``adam_update`` over every parameter at once: the weights,
    gradients and both moments are views of one array each (:class:`_Update`
    makes them so), every parameter has the same count and learning rate, and
    the op is elementwise, so it computes what one call a parameter does."""
    opt = updater.optimizer
    opt._update_count(indices)  # pylint: disable=protected-access
    t = opt._index_update_count[indices[0]]  # pylint: disable=protected-access
    lr = opt.lr * (math.sqrt(1. - opt.beta2 ** t) / (1. - opt.beta1 ** t))   # as adam_step
    w, g, m, v = updater.flat
    mx.nd.adam_update(w, g, m, v, out=w, lr=lr, wd=0.0, beta1=opt.beta1, beta2=opt.beta2,
                      epsilon=opt.epsilon, rescale_grad=opt.rescale_grad)


UPDATES = {
    'Updater, one adam_update a parameter': None,
    'updater.adam_step': 'adam_step',
    'updater.adam_step, adam_update a parameter': _adam_step_op_a_parameter,
    'one adam_update over one array': 'flat',
    'updater.adam_contiguous': 'contiguous',
    'multi_adamw, one call': _multi_adamw(False),
    'multi_adamw, one call a size': _multi_adamw(True),
}


class _Update:
    """Adam over the model's parameters at width ``C`` on ``cpu(0)``:
    ``run(n)`` takes n updates with the same gradients."""

    def __init__(self, how, layout, rng_seed):
        # pylint: disable=import-outside-toplevel
        from mp_symbolic.core.optim.updater import Contiguous, PerDeviceUpdater
        shapes, plain = layout
        rng = np.random.RandomState(rng_seed)
        self.weights = [mx.nd.array(rng.normal(0, 0.02, s)) for s in shapes]
        self.grads = [mx.nd.array(rng.normal(0, 1.0, s)) for s in shapes]
        self.indices = list(range(len(shapes)))
        self.updater = mx.optimizer.get_updater(mx.optimizer.Adam(**ADAM))
        self.updater(self.indices, self.grads, self.weights)   # the states, one update
        if how == 'flat':   # every array a view of one array of its kind
            states = [self.updater.states[i] for i in self.indices]
            kinds = [self.weights, self.grads] + [[s[k] for s in states] for k in (0, 1)]
            self.updater.flat = [_views_of_one(arrays) for arrays in kinds]
            self.weights, self.grads = (self.updater.flat[k][1] for k in (0, 1))
            for i, mean, var in zip(self.indices, self.updater.flat[2][1], self.updater.flat[3][1]):
                self.updater.states[i] = (mean, var)
            self.updater.flat = [flat for flat, _ in self.updater.flat]
            self.update = lambda i, g, w: _flat(self.updater, i, g, w)
        elif how == 'contiguous':   # the project's: PerDeviceUpdater over a Contiguous
            flat = Contiguous(self.indices, shapes, mx.cpu(0), 'float32')
            for w, g, view, grad in zip(self.weights, self.grads, flat.weights, flat.grads):
                w.copyto(view)
                g.copyto(grad)
            self.weights, self.grads = flat.weights, flat.grads
            self.update = PerDeviceUpdater(self.updater)
            self.update.hold([flat])
        elif how is None:
            self.update = self.updater
        elif how == 'adam_step':   # as the model's Module runs it
            self.update = PerDeviceUpdater(self.updater)
            self.update.plain([w for w, p in zip(self.weights, plain) if p])
        else:
            self.update = lambda i, g, w: how(self.updater, i, g, w)

    def run(self, num_steps):
        for _ in range(num_steps):
            self.update(self.indices, self.grads, self.weights)

    def results(self):
        self.run(1)
        return [w.asnumpy() for w in self.weights] + [m.asnumpy() for m, _ in (
            self.updater.states[i] for i in self.indices)]


def _views_of_one(arrays):
    """``(flat, views)``: one array holding ``arrays``' values one after the
    other, and a view of it in the shape of each."""
    flat = mx.nd.concat(*[a.reshape((-1,)) for a in arrays], dim=0)
    views, start = [], 0
    for a in arrays:
        views.append(flat[start:start + a.size].reshape(a.shape))
        start += a.size
    return flat, views


def _updates(C, repeats, warmup):
    layout = _shapes(C)
    updates = {name: _Update(how, layout, 0) for name, how in UPDATES.items()}
    results = {name: u.results() for name, u in updates.items()}   # each one update more
    want = results['Updater, one adam_update a parameter']
    error = {name: max(float(np.abs(g - w).max() / np.abs(w).max())
                       for g, w in zip(found, want))
             for name, found in results.items()}
    rates = throughput(updates, 1, STEPS, repeats, warmup)
    return {name: {'ms': 1e3 / rates[name][0], 'error': error[name]} for name in updates}


def _attentions():
    """:data:`ATTENTIONS`, and where the project's library loads the
    attention with its products by ``small_batch_dot`` and the
    ``causal_attention`` op."""
    kernel = kernels.small_batch_dot_kernel()
    if kernel is None:
        return dict(ATTENTIONS)  # the norms' candidate says why, once
    name = 'products by %s (%s)' % (kernels.SMALL_BATCH_DOT, kernel)
    fused = '%s op (%s)' % (kernels.CAUSAL_ATTENTION, kernel)
    return dict(ATTENTIONS, **{name: lambda F, q, k, v, D: gpt._Attend(  # pylint: disable=W0212
        D, product=kernels.SMALL_BATCH_DOT)(F, q, k, v),
                               fused: lambda F, q, k, v, D: getattr(F, kernels.CAUSAL_ATTENTION)(
                                   q, k, v, head_dim=D)})


def run(widths=(64, 256), repeats=9, warmup=3, log=print):
    """Measures and logs every candidate at every width; returns
    ``{'norm' | 'attention' | 'Adam' | 'loss': {width: {candidate: {'ms', 'error'}}}}``."""
    rng = np.random.RandomState(0)
    report = {'norm': {}, 'attention': {}, 'q, k, v': {}, 'Adam': {}, 'loss': {}}
    for C in widths:
        report['Adam'][C] = _updates(C, repeats, warmup)
        report['loss'][C] = _losses(np.random.default_rng(C), repeats, warmup)
        shape = (BATCH, CONTEXT, C)
        x, g, b, q, k, v = (mx.sym.var(n) for n in ('x', 'g', 'b', 'q', 'k', 'v'))
        values = {'x': rng.normal(1.0, 2.0, shape), 'g': rng.normal(1.0, 0.2, (C,)),
                  'b': rng.normal(0.0, 0.2, (C,))}
        report['norm'][C] = _compare({name: norm(mx.sym, x, g, b, C)
                                      for name, norm in _norms(log).items()},
                                     'LayerNorm op', values, rng.normal(size=shape),
                                     repeats, warmup)
        values = {n: rng.normal(size=shape) for n in 'qkv'}
        report['attention'][C] = _compare({name: attention(mx.sym, q, k, v, C // HEADS)
                                           for name, attention in _attentions().items()},
                                          'gpt._Attend', values, rng.normal(size=shape),
                                          repeats, warmup)
        names = [[p + '_weight' for p in 'qkv'], [p + '_bias' for p in 'qkv']]
        values = {n: rng.normal(0.0, 0.1, (C, C) if n in names[0] else (C,))
                  for n in names[0] + names[1]}
        values['x'] = rng.normal(size=shape)
        weights, biases = ([mx.sym.var(n) for n in part] for part in names)
        report['q, k, v'][C] = _compare({name: projection(mx.sym, mx.sym.var('x'), weights,
                                                          biases, C)
                                         for name, projection in PROJECTIONS.items()},
                                        'three products', values, rng.normal(size=shape),
                                        repeats, warmup)
    for part, reference in (('norm', 'LayerNorm op'), ('attention', 'gpt._Attend'),
                            ('q, k, v', 'three products'),
                            ('Adam', 'Updater, one adam_update a parameter'),
                            ('loss', 'SoftmaxOutput')):
        if part == 'loss':
            log('loss head, forward and backward on (%d, %d, %d) scores (the same at every C), '
                'ms a pass (median of %d alternated rounds of %d passes), largest difference '
                'of the scores\' gradient from %s:'
                % (BATCH, CONTEXT, VOCAB, repeats, STEPS, reference))
        elif part == 'q, k, v':
            log('queries, keys and values of (%d, %d, C) inputs and the attention on them, '
                'forward and backward, ms a pass (median of %d alternated rounds of %d passes), '
                'largest difference from %s:' % (BATCH, CONTEXT, repeats, STEPS, reference))
        elif part == 'Adam':
            log('Adam, the update of the model\'s %d parameters at width C after one, ms an '
                'update (median of %d alternated rounds of %d updates), largest difference of '
                'the weights and means after one more from %s:'
                % (len(_shapes(widths[0])[0]), repeats, STEPS, reference))
        else:
            log('%s, forward and backward on (%d, %d, C), ms a pass (median of %d alternated '
                'rounds of %d passes), largest difference from %s:'
                % (part, BATCH, CONTEXT, repeats, STEPS, reference))
        rows = [['candidate'] + ['C=%d ms' % C for C in widths]
                + ['C=%d difference' % C for C in widths]]
        for name in report[part][widths[0]]:
            rows.append([name] + ['%.2f' % report[part][C][name]['ms'] for C in widths]
                        + ['%.1e' % report[part][C][name]['error'] for C in widths])
        for line in columns(rows):
            log('  ' + line)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog='python -m bench.lm_ops',
        description="The language model's LayerNorm and attention on each candidate op, "
                    'forward and backward, alternated in one process.')
    parser.add_argument('--num-hiddens', type=int, nargs='+', default=[64, 256],
                        help='widths, multiples of 4 (default: 64 256)')
    parser.add_argument('--repeats', type=int, default=9)
    parser.add_argument('--quick', action='store_true',
                        help='a smoke run: width 32, 2 rounds (its figures mean little)')
    args = parser.parse_args(argv)
    if args.quick:
        args.num_hiddens, args.repeats = [32], 2
    if any(C < HEADS or C % HEADS for C in args.num_hiddens) or args.repeats < 1:
        parser.error('--num-hiddens, --repeats: expected multiples of %d and a positive count, '
                     'found %s, %d' % (HEADS, ' '.join(map(str, args.num_hiddens)), args.repeats))
    return run(tuple(args.num_hiddens), repeats=args.repeats)


if __name__ == '__main__':
    main()
