"""Every MXNet 1.9.1 behaviour this library works around, in one place.

Each workaround says what MXNet does, why it matters for a graph split over
devices, and what is done instead; ``tests/test_mxnet_traps.py`` pins each
behaviour, so that when MXNet changes (or the user runs on GPUs) a failing
test says which workaround can go.
"""
from contextlib import contextmanager
import os
import sys

import mxnet as mx

from .scoped import captured_stderr, environ

__all__ = []


@contextmanager
def split_bind(group2ctx):
    """Around a bind of a graph split over several devices: MXNet's oneDNN
    subgraph backend off.

    That backend (``MXNET_SUBGRAPH_BACKEND``, read at every bind) fuses
    convolution, BatchNorm and activation ops for inference without looking
    at ``ctx_group``; a fused op that straddles two devices then fails at run
    time ("The size of NDArray doesn't match the requested MKLDNN memory
    desc"). A graph on one device keeps the fusion. MXNet logs a line for
    ``NONE`` at every bind; that line is dropped, anything else it writes
    passes through.
    """
    devices = set(group2ctx.values()) if group2ctx else set()
    if len(devices) < 2:
        yield
        return
    with environ(MXNET_SUBGRAPH_BACKEND='NONE'):
        with captured_stderr() as lines:
            yield
    for line in lines:
        if 'MXNET_SUBGRAPH_BACKEND=NONE is detected' not in line:
            print(line, file=sys.stderr)


def onednn_active():
    """Whether MXNet runs CPU operators through oneDNN (MKLDNN) in this process."""
    if os.environ.get('MXNET_MKLDNN_ENABLED', '1').lower() in ('0', 'false'):
        return False
    return mx.runtime.Features().is_enabled('MKLDNN')


def gradient_only_kvstore():
    """Around ``Module.init_optimizer``: the kvstore sums gradients only.

    MXNet's Module decides ``update_on_kvstore`` from
    ``MXNET_UPDATE_ON_KVSTORE`` (default 1) when it creates the kvstore; with
    it, the kvstore holds one copy of each weight and its optimizer state and
    runs the update itself, on the kvstore's device. A model-parallel module
    updates each parameter on its own stage's device, with its state beside
    it (saved by name, so a run resumes onto any plan): 0 here.
    """
    return environ(MXNET_UPDATE_ON_KVSTORE='0')


def profiler_cpu_limit():
    """The first ``cpu(i)`` MXNet's profiler cannot record.

    MXNet 1.9.1's profiler keeps one row per core, then ``cpu pinned/`` and
    ``cpu shared/``; an op on ``cpu(N)`` past them aborts the process
    (``Check failed: idx < DeviceCount()``), so such plans are refused up
    front.
    """
    return (os.cpu_count() or 1) + 2


def unprofilable(devices):
    """The ``cpu(i)`` of ``devices`` (contexts or their strings) that MXNet's
    profiler cannot record (see :func:`profiler_cpu_limit`), as ``'cpu:i'``."""
    limit = profiler_cpu_limit()
    over = []
    for device in devices:
        ctx = device if isinstance(device, mx.Context) else _context(str(device))
        if ctx.device_type == 'cpu' and ctx.device_id >= limit:
            over.append('cpu:%d' % ctx.device_id)
    return sorted(set(over), key=lambda name: int(name[4:]))


def _context(text):
    """``'cpu(3)'`` or ``'cpu:3'`` -> ``mx.cpu(3)``."""
    kind, _, rest = text.replace(':', '(').partition('(')
    return mx.Context(kind.strip(), int(rest.strip(')')))
