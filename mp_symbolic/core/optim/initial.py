"""Initial values that depend on the seed and each parameter's name only.

Each parameter is drawn whole on the CPU, MXNet's and numpy's generators
seeded from one base value (taken from MXNet's CPU generator at the call's
first draw) and its name; a tensor-parallel one under its unsplit name and
shape, then sliced. Invariant: a parameter's initial value is the same
whatever the plan, the process or the other parameters drawn. After a call
MXNet's CPU generator is seeded from the base value again (untouched if
nothing was drawn); numpy's is restored. docs/how-it-works.md states the
rule.
"""
import hashlib

import mxnet as mx
from mxnet.initializer import InitDesc
import numpy as np

from ..graph.names import INIT_ATTR
from ..parallel.tensor_parallel import split_params

__all__ = []

_AFTER = ''  # the name whose seed the CPU generator is left at after a call


def seed_of(base, name):
    """The seed of parameter ``name`` drawn from ``base`` (31 bits)."""
    digest = hashlib.sha256(('%d:%s' % (base, name)).encode()).digest()
    return int.from_bytes(digest[:4], 'little') & 0x7fffffff


class Drawn(mx.init.Initializer):
    """``initializer`` drawn by this module's rule: one instance per init call,
    called as any initializer with an ``InitDesc`` and a host array, or given
    to Gluon as ``default_init``.

    Args:
        initializer: An ``mx.init.Initializer`` or any callable
            ``(InitDesc, NDArray)``.
        sharded: ``{unsplit name: ShardedParam}``, the tensor-parallel layout.
    """

    def __init__(self, initializer, sharded=None):
        super().__init__()
        self.initializer = initializer
        self.base = None
        self._whole_of = {p.name: whole for whole in (sharded or {}).values()
                          for p in whole.shards}
        self._split = (None, None)  # (unsplit name, its shards' values): the last drawn

    def __call__(self, desc, arr):
        attrs = dict(getattr(desc, 'attrs', None) or {})
        if attrs.get(INIT_ATTR) is self:  # Gluon's: the default initializer's own
            attrs[INIT_ATTR] = self.initializer
        value = self.value(str(desc), arr, attrs)
        if value is not arr:
            value.copyto(arr)

    def _init_weight(self, name, arr):  # an initializer that names us as '__init__'
        self(InitDesc(str(name), {INIT_ATTR: self.initializer}), arr)

    def value(self, name, arr, attrs):
        """The initial value of parameter ``name``: ``arr`` filled, or its slice of
        the unsplit parameter."""
        whole = self._whole_of.get(name)
        if whole is None:
            self._draw(name, arr, attrs)
            return arr
        if self._split[0] != whole.name:
            full = mx.nd.zeros(whole.shape, dtype=arr.dtype, ctx=mx.cpu())
            self._draw(whole.name, full, attrs)
            self._split = (whole.name, split_params({whole.name: full}, {whole.name: whole}))
        return self._split[1][name]

    def _draw(self, name, arr, attrs):
        if self.base is None:
            self.base = int(mx.nd.random.randint(0, 0x7fffffff, shape=(1,), ctx=mx.cpu(),
                                                 dtype='int64').asscalar())
        seed = seed_of(self.base, name)
        mx.random.seed(seed, ctx=mx.cpu())
        kept = np.random.get_state()
        np.random.seed(seed)
        try:
            self.initializer(InitDesc(name, attrs), arr)
        finally:
            np.random.set_state(kept)

    def close(self):
        """Leaves MXNet's CPU generator at the seed the base value gives it."""
        if self.base is not None:
            mx.random.seed(seed_of(self.base, _AFTER), ctx=mx.cpu())
        self._split = (None, None)
