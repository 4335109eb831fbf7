"""The micro-batched K-stage MLP of the pipeline benchmark, bound and stepped.

:func:`build_chunked_symbol` is the training graph that
``mp_symbolic.Pipeline(blocks, devices, chunks=M)`` builds (the library
builds it: its micro-batches, their boundary copies and the join).
:func:`bind` binds a training symbol the way the benchmark measures it, and
:class:`StepLoop` runs training steps on the executor.
"""
import json

import mxnet as mx
from mxnet.gluon import nn
import numpy as np

from mp_symbolic import Pipeline
from mp_symbolic.core.base.compat import split_bind
from mp_symbolic.core.graph.graphcut import load
from mp_symbolic.core.graph.names import CHUNK_JOIN, CHUNK_SPLIT, DATA_NAME, GROUP_ATTR, LABEL_NAME, stage_name
from mp_symbolic.core.base.scoped import environ

__all__ = ['LR', 'stage_devices', 'build_chunked_symbol', 'bind', 'StepLoop']

LR = 1e-4  # SGD step of StepLoop


def stage_devices(num_stages):
    """``{'stage<s>': mx.cpu(s)}``: the one place stages meet devices here."""
    return {stage_name(s): mx.cpu(s) for s in range(num_stages)}


def build_chunked_symbol(num_stages, num_chunks, num_hiddens, mirror_stages=(),
                         layers_per_stage=1, order_forward=False):
    """The K-stage MLP with its batch split into M micro-batches, as a training symbol.

    ``data`` (batch, num_hiddens) is split on stage 0; each chunk runs through
    every stage's ``Dense(num_hiddens, activation='relu')`` layers with the
    stage's shared weights (``s<stage>[_<layer>]_weight``); the chunks are
    joined on the last stage and fed to a ``SoftmaxOutput`` over
    ``num_hiddens`` classes (label ``softmax_label``, (batch,)). It is the
    graph ``mp_symbolic.Pipeline(blocks, devices, chunks=M).training_symbol('softmax')``
    builds, because the Pipeline builds it.

    Args:
        mirror_stages: Stages whose ops get ``__force_mirroring__='True'``:
            the backward pass recomputes their outputs instead of keeping them.
        layers_per_stage: ``Dense`` + ``relu`` layers per stage.
        order_forward: Make each chunk's first op wait for the stage-0
            output of the chunk the graph runs before it (through
            ``0 * BlockGrad(sum(.))``, no gradient; the one graph runs its
            chunks last first): the engine then queues that chunk's copy to
            stage 1 before the next chunk's work on stage 0, instead of
            after several chunks'.

    Raises:
        ValueError: fewer than one stage or chunk.
    """
    if num_stages < 1 or num_chunks < 1:
        raise ValueError('expected num_stages >= 1 and num_chunks >= 1, found %d and %d'
                         % (num_stages, num_chunks))
    blocks = [nn.Dense(num_hiddens, activation='relu', in_units=num_hiddens,
                       prefix='s%d%s_' % (s, _layer(i)))
              for s in range(num_stages) for i in range(layers_per_stage)]
    pipe = Pipeline(blocks, [mx.cpu(s) for s in range(num_stages)],
                    balance=[layers_per_stage] * num_stages, chunks=num_chunks,
                    mirror=tuple(mirror_stages))
    symbol = pipe.training_symbol('softmax')
    return _ordered(symbol, num_chunks) if order_forward and num_chunks > 1 else symbol


def _ordered(symbol, num_chunks):
    """``symbol`` with each chunk's input but the first the graph runs
    waiting for the stage-0 output of the chunk it runs before:
    ``chunk[m] + 0 * BlockGrad(sum(out0[p]))``."""
    graph = json.loads(symbol.tojson())
    nodes = graph['nodes']
    split = next(i for i, n in enumerate(nodes) if n['name'] == CHUNK_SPLIT)
    stage0 = stage_name(0)
    # the last stage-0 op reading each chunk's input, transitively, in node order
    chunk_of = {}
    for i, node in enumerate(nodes):
        for src, idx, _ in node['inputs']:
            if src == split:
                chunk_of[i] = idx
            elif src in chunk_of and not node['name'].startswith(CHUNK_JOIN):
                chunk_of.setdefault(i, chunk_of[src])
    last0 = {}
    for i, m in chunk_of.items():
        if nodes[i].get('attrs', {}).get(GROUP_ATTR) == stage0:
            last0[m] = max(last0.get(m, -1), i)
    runs = sorted(range(num_chunks), key=lambda m: min(i for i, c in chunk_of.items() if c == m))
    before = dict(zip(runs[1:], runs))
    out, index, waited = [], {}, {}
    for i, node in enumerate(nodes):
        waits = [idx for src, idx, _ in node['inputs'] if src == split and idx in before]
        for m in waits:
            if m in waited:
                continue
            prev = [index[last0[before[m]]], 0, 0]
            attrs = {GROUP_ATTR: stage0}
            for op, name, inputs, extra in (
                    ('sum', 'after%d_sum' % m, [prev], {'keepdims': 'True'}),
                    ('BlockGrad', 'after%d_stop' % m, None, {}),
                    ('_mul_scalar', 'after%d_zero' % m, None, {'scalar': '0'}),
                    ('broadcast_add', 'after%d' % m, 'chunk', {})):
                if inputs is None:
                    inputs = [[len(out) - 1, 0, 0]]
                elif inputs == 'chunk':
                    inputs = [[index[split], m, 0], [len(out) - 1, 0, 0]]
                out.append({'op': op, 'name': name, 'attrs': dict(attrs, **extra),
                            'inputs': inputs})
            waited[m] = len(out) - 1
        node = dict(node)
        node['inputs'] = [[waited[idx], 0, 0] if src == split and idx in waited
                          else [index[src], idx, v] for src, idx, v in node['inputs']]
        index[i] = len(out)
        out.append(node)
    graph['nodes'] = out
    graph['heads'] = [[index[src], idx, v] for src, idx, v in graph['heads']]
    return load(graph)


def _layer(i):
    """Name part of a stage's i-th layer: none for the first, so one layer per
    stage gives ``s0_weight``."""
    return '_%d' % i if i else ''


def bind(symbol, batch_size, num_hiddens, group2ctx=None, env=None, seed=0):
    """``symbol`` bound for training on ``group2ctx`` (None: all on ``cpu(0)``).

    ``MXNET_EXEC_BULK_EXEC_TRAIN=0`` and the ``env`` entries are set only
    around ``simple_bind``, where MXNet reads them (and
    ``MXNET_BACKWARD_DO_MIRROR``): without bulking each op is its own entry
    in the profiler trace, so the chunk of each op can be inferred. A split
    graph is bound as the library binds one (:func:`mp_symbolic.core.base.compat.split_bind`).
    Parameters are drawn from ``seed``: every variant starts alike.
    """
    # No gradient for the inputs, as Module binds them (inputs_need_grad=False).
    grad_req = {n: 'null' if n in (DATA_NAME, LABEL_NAME) else 'write'
                for n in symbol.list_arguments()}
    with environ(**dict({'MXNET_EXEC_BULK_EXEC_TRAIN': '0'}, **(env or {}))), \
            split_bind(group2ctx):
        exe = symbol.simple_bind(mx.cpu(0), group2ctx=group2ctx, grad_req=grad_req,
                                 data=(batch_size, num_hiddens), softmax_label=(batch_size,))
    rng = np.random.RandomState(seed)
    scale = 1 / np.sqrt(num_hiddens)
    for name, arr in exe.arg_dict.items():
        if name == LABEL_NAME:
            arr[:] = rng.randint(0, num_hiddens, size=arr.shape)
        else:
            arr[:] = rng.uniform(-scale, scale, size=arr.shape) if name != DATA_NAME else \
                rng.normal(size=arr.shape)
    return exe


class StepLoop:
    """``run(n)``: n training steps (forward, backward, SGD on each weight's device)."""

    def __init__(self, exe):
        self.exe = exe
        self.params = [(exe.arg_dict[n], exe.grad_dict[n]) for n in sorted(exe.arg_dict)
                       if n not in (DATA_NAME, LABEL_NAME)]

    def run(self, num_steps):
        for _ in range(num_steps):
            self.exe.forward(is_train=True)
            self.exe.backward()
            for weight, grad in self.params:
                mx.nd.sgd_update(weight, grad, lr=LR, out=weight)
