"""The micro-batched K-stage MLP of the pipeline benchmark, bound and stepped.

:func:`build_chunked_symbol` builds, with plain ``mx.sym``, the graph
``mp_symbolic.Pipeline(blocks, devices, chunks=M)`` builds: the one place to
swap it in. :func:`bind` binds a training symbol the way the benchmark
measures it, and :class:`StepLoop` runs training steps on the executor.
"""

import mxnet as mx
import numpy as np

from mp_symbolic.core.compat import split_bind
from mp_symbolic.core.scoped import environ

__all__ = ['LR', 'stage_devices', 'build_chunked_symbol', 'bind', 'StepLoop']

LR = 1e-4  # SGD step of StepLoop


def stage_devices(num_stages):
    """``{'stage<s>': mx.cpu(s)}``: the one place stages meet devices here."""
    return {'stage%d' % s: mx.cpu(s) for s in range(num_stages)}


def build_chunked_symbol(num_stages, num_chunks, num_hiddens, mirror_stages=(),
                         layers_per_stage=1, order_forward=False):
    """The K-stage MLP with its batch split into M micro-batches, as a training symbol.

    ``data`` (batch, num_hiddens) is split on stage 0; each chunk runs through
    every stage's ``FullyConnected`` + ``relu`` with the stage's shared
    weights; the chunks are concatenated on the last stage and fed to a
    ``SoftmaxOutput`` over ``num_hiddens`` classes (label ``softmax_label``,
    (batch,)). Every op and variable carries ``ctx_group='stage<s>'``. This
    is the graph ``mp_symbolic.Pipeline(blocks, devices, chunks=M)`` builds.

    Args:
        mirror_stages: Stages whose ops get ``__force_mirroring__='True'``:
            the backward pass recomputes their outputs instead of keeping them.
        layers_per_stage: ``FullyConnected`` + ``relu`` pairs per stage.
        order_forward: Make chunk m's first op wait for chunk m - 1's stage-0
            output (through ``0 * BlockGrad(sum(.))``, no gradient): the
            engine then queues the copy of chunk m - 1 to stage 1 before
            chunk m's work on stage 0, instead of after several chunks'.

    Raises:
        ValueError: fewer than one stage or chunk.
    """
    if num_stages < 1 or num_chunks < 1:
        raise ValueError('expected num_stages >= 1 and num_chunks >= 1, found %d and %d'
                         % (num_stages, num_chunks))

    def scope(s):
        extra = {'__force_mirroring__': 'True'} if s in mirror_stages else {}
        return mx.AttrScope(ctx_group='stage%d' % s, **extra)

    weights, biases = [], []
    for s in range(num_stages):
        with scope(s):
            weights.append([mx.sym.var('s%d%s_weight' % (s, _layer(i)))
                            for i in range(layers_per_stage)])
            biases.append([mx.sym.var('s%d%s_bias' % (s, _layer(i)))
                           for i in range(layers_per_stage)])
    with scope(0):
        data = mx.sym.var('data')
        chunks = (mx.sym.split(data, num_outputs=num_chunks, axis=0, name='split')
                  if num_chunks > 1 else [data])
    outs, stage0_out = [], None
    for m in range(num_chunks):
        h = chunks[m]  # (batch / M, num_hiddens)
        if order_forward and stage0_out is not None:
            with scope(0):
                after = 0 * mx.sym.BlockGrad(mx.sym.sum(stage0_out, keepdims=True))  # (1, 1)
                h = mx.sym.broadcast_add(h, after, name='after_c%d' % (m - 1))
        for s in range(num_stages):
            with scope(s):
                for i in range(layers_per_stage):
                    h = mx.sym.FullyConnected(h, weight=weights[s][i], bias=biases[s][i],
                                              num_hidden=num_hiddens,
                                              name='s%d_fc%s_c%d' % (s, _layer(i), m))
                    h = mx.sym.relu(h, name='s%d_relu%s_c%d' % (s, _layer(i), m))
            if s == 0:
                stage0_out = h
        outs.append(h)
    with scope(num_stages - 1):
        out = mx.sym.concat(*outs, dim=0, name='concat') if num_chunks > 1 else outs[0]
        return mx.sym.SoftmaxOutput(out, mx.sym.var('softmax_label'), name='softmax')


def _layer(i):
    """Name part of a stage's i-th layer: none for the first, so one layer per
    stage gives ``s0_weight``, ``s0_fc_c0``."""
    return '_%d' % i if i else ''


def bind(symbol, batch_size, num_hiddens, group2ctx=None, env=None, seed=0):
    """``symbol`` bound for training on ``group2ctx`` (None: all on ``cpu(0)``).

    ``MXNET_EXEC_BULK_EXEC_TRAIN=0`` and the ``env`` entries are set only
    around ``simple_bind``, where MXNet reads them (and
    ``MXNET_BACKWARD_DO_MIRROR``): without bulking each op is its own entry
    in the profiler trace, so the chunk of each op can be inferred. A split
    graph is bound as the library binds one (:func:`mp_symbolic.core.compat.split_bind`).
    Parameters are drawn from ``seed``: every variant starts alike.
    """
    # No gradient for the inputs, as Module binds them (inputs_need_grad=False).
    grad_req = {n: 'null' if n in ('data', 'softmax_label') else 'write'
                for n in symbol.list_arguments()}
    with environ(**dict({'MXNET_EXEC_BULK_EXEC_TRAIN': '0'}, **(env or {}))), \
            split_bind(group2ctx):
        exe = symbol.simple_bind(mx.cpu(0), group2ctx=group2ctx, grad_req=grad_req,
                                 data=(batch_size, num_hiddens), softmax_label=(batch_size,))
    rng = np.random.RandomState(seed)
    scale = 1 / np.sqrt(num_hiddens)
    for name, arr in exe.arg_dict.items():
        if name == 'softmax_label':
            arr[:] = rng.randint(0, num_hiddens, size=arr.shape)
        else:
            arr[:] = rng.uniform(-scale, scale, size=arr.shape) if name != 'data' else \
                rng.normal(size=arr.shape)
    return exe


class StepLoop:
    """``run(n)``: n training steps (forward, backward, SGD on each weight's device)."""

    def __init__(self, exe):
        self.exe = exe
        self.params = [(exe.arg_dict[n], exe.grad_dict[n]) for n in sorted(exe.arg_dict)
                       if n not in ('data', 'softmax_label')]

    def run(self, num_steps):
        for _ in range(num_steps):
            self.exe.forward(is_train=True)
            self.exe.backward()
            for weight, grad in self.params:
                mx.nd.sgd_update(weight, grad, lr=LR, out=weight)
