"""MXNet 1.9.1 behaviour this library works around, each in one place.

Every workaround here names what MXNet does, where in apache/mxnet 1.9.1
it happens, and the test in ``tests/test_mxnet_traps.py`` that pins the
behaviour: when that test starts failing, MXNet changed and the workaround
can go. Imports MXNet and the standard library only.
"""
import os

import mxnet as mx

__all__ = []  # internal: the library applies these itself

# MXNet's graph executor, at each bind of a graph split over several devices.
SUBGRAPH_BACKEND = {'MXNET_SUBGRAPH_BACKEND': 'NONE'}
UNSHARED_MEMORY = {'NNVM_EXEC_MATCH_RANGE': '0'}


def onednn_active():
    """Whether MXNet runs CPU operators through oneDNN (MKLDNN) in this process.

    MXNet reads ``MXNET_MKLDNN_ENABLED`` once, at its first operator; this
    reads the variable as MXNet would and asks the build.
    """
    if os.environ.get('MXNET_MKLDNN_ENABLED', '1').lower() in ('0', 'false'):
        return False
    return mx.runtime.Features().is_enabled('MKLDNN')


def split_bind_environ(devices):
    """The environment a bind of a graph split over ``devices`` needs.

    Two MXNet behaviours, both on CPU with oneDNN, both failing at run time
    with "The size of NDArray doesn't match the requested MKLDNN memory
    desc" (or its ``Check failed: mem.get_desc().get_size() == ...`` form):

    1. **The oneDNN subgraph backend fuses across devices.** That backend
       (``MXNET_SUBGRAPH_BACKEND``, read at every bind) fuses convolution,
       BatchNorm and activation ops without looking at ``ctx_group``; a fused
       op that straddles two devices fails. Off (``NONE``) for split graphs;
       a graph on one device keeps the fusion.
    2. **A cross-device copy writes through a stale oneDNN layout.** The
       executor's memory planner (``src/nnvm/plan_memory.cc``) lets entries
       of similar size (within a factor ``NNVM_EXEC_MATCH_RANGE``, 16) share
       one storage chunk, and the chunk keeps the oneDNN layout (dims and
       blocked format) of whichever entry an oneDNN op last wrote there. Every
       operator clears that layout from its outputs before writing
       (``InvalidateOutputs``, ``src/executor/attach_op_execs_pass.cc``), but
       the cross-device copy is not an operator: ``GraphExecutor`` runs it as
       ``CopyFromTo`` (``src/executor/graph_executor.cc``), and
       ``CopyFromToDnsImpl`` (``src/ndarray/ndarray.cc``) sees the stale
       layout, copies into it with the other entry's dims, and leaves it
       there. The next oneDNN op on the receiving device (BatchNorm's or
       relu's backward, in the digits CNN) builds its primitive from those
       dims and fails on the size. Whether it happens depends on where the
       stages are cut and on the memory plan, with one chunk or many (the
       digits CNN on 3 devices: 7 of 45 balances with ``chunks=1``, 18 of 45
       with 2 or 4). With ``NNVM_EXEC_MATCH_RANGE=0`` (read at every bind)
       the planner gives every entry its own storage (in-place pairs, which
       never involve a copy, still share), so no copy finds a stale layout.
       The price is memory: no reuse between intermediate arrays of a split
       graph (see docs/batchnorm-chunks.md for the figures).

    Args:
        devices: The ``mx.Context`` s of the plan (``group2ctx.values()``).

    Returns:
        ``{name: value}``; empty for a graph on one device.
    """
    devices = set(devices or ())
    if len(devices) < 2:
        return {}
    env = dict(SUBGRAPH_BACKEND)
    if any(d.device_type == 'cpu' for d in devices) and onednn_active():
        env.update(UNSHARED_MEMORY)
    return env
