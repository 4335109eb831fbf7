"""Tensor-parallel layers (after Megatron-LM's ``tensor_parallel/layers.py``):
one layer's weight split over the devices of a stage, each shard's ops and
weight in a group of their own, the shards meeting through
:mod:`~mp_symbolic.core.transport.comm`. Shard ``i`` of ``<prefix>weight`` is
the parameter ``<prefix>shard<i>_weight``; :func:`gather_params` and
:func:`split_params` convert to and from the unsplit layer's names and
shapes, which users and checkpoints see. docs/tensor-parallel.md describes
the layers."""
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import mxnet as mx
from mxnet import gluon
import numpy as np

from ..placement.balance import even_split
from ..base.checks import is_int, positive_int
from ..transport.comm import copy_to_shards, gather_from_shards, parts_behind, reduce_from_shards
from ..base.compat import ids_outside_gradient
from ..graph.names import SHARD_ATTR, layer_call, shard_mark

__all__ = ['ColumnParallelDense', 'PerShard', 'RowParallelDense', 'ShardedBlock',
           'VocabParallelEmbedding']


class _Trace:
    """One trace of a network: the layer calls counted so far, whether the layers
    build unsplit, and the unsplit variables made (one per name)."""
    __slots__ = ('calls', 'unsplit', 'variables')

    def __init__(self, unsplit_layers):
        self.calls, self.unsplit, self.variables = 0, unsplit_layers, {}


@contextmanager
def mark_shards(blocks, unsplit_layers=False):
    """Context in which the tensor-parallel layers of ``blocks`` (a block or a
    list) tag each shard's ops and weights with ``__tp_shard__='i/N/<layer
    call>'`` instead of a ``ctx_group``, each call apart; with
    ``unsplit_layers``, each layer builds unsplit, marked ``'0/1/<layer
    call>'``, the calls numbered as in the split trace."""
    trace = _Trace(unsplit_layers)
    layers = [layer for block in (blocks if isinstance(blocks, (list, tuple)) else [blocks])
              for layer in sharded_blocks(block)]
    saved = [layer._trace for layer in layers]
    for layer in layers:
        layer._trace = trace
    try:
        yield
    finally:
        for layer, before in zip(layers, saved):
            layer._trace = before


def _next_call(trace, name):
    """The mark's layer of this call of layer ``name``, or ``None`` outside a
    trace."""
    if trace is None:
        return None
    call, trace.calls = trace.calls, trace.calls + 1
    return layer_call(name, call)


def device_index(shard, shards, width):
    """The stage device that runs ``shard`` of ``shards`` in a stage of ``width``
    devices (``shard``, or 0 for a stage of one); raises ValueError for
    several devices but not ``shards``."""
    if width == 1:
        return 0
    if width != shards:
        raise ValueError('expected a stage of 1 or %d devices for a layer of %d shards, found '
                         '%d devices' % (shards, shards, width))
    return shard


@dataclass
class ShardedParam:
    """One unsplit parameter (its ``name``, ``shape`` and the ``axis`` it is
    split along) and the Gluon parameters of its ``shards``, in order."""
    name: str
    shape: tuple
    axis: int
    shards: list

    @property
    def names(self):
        return [p.name for p in self.shards]


class ShardedBlock(gluon.HybridBlock):
    """The base of a tensor-parallel layer: its parameters split into ``shards``
    parts, each part's computation on its own device of the stage.

    A subclass registers each parameter by its unsplit shape with
    :meth:`add_param` in ``__init__``, and writes, as functions of ``F``
    (``mx.sym`` or ``mx.nd``):

    * :meth:`shard_forward` ``(F, i, *x, **params)``: shard ``i``'s part;
    * :meth:`combine` ``(F, parts, *x)``: the output from the parts, on shard
      0's device, through :mod:`~mp_symbolic.core.transport.comm`;
    * :meth:`unsplit_forward` ``(F, *x, **params)``: the same layer from the
      whole parameters (what checkpoints hold and export writes);
    * optionally :meth:`prepare` ``(F, *x)``: the inputs as every shard reads
      them (a tuple for several).

    docs/tensor-parallel.md shows a layer written this way.

    Args:
        shards: Parts the parameters are split into.
        prefix, params: As any Gluon block.

    Raises:
        ValueError: ``shards`` is not a positive integer.
    """

    def __init__(self, shards, prefix=None, params=None):
        super().__init__(prefix=prefix, params=params)
        positive_int('shards', shards)
        self.shards = shards
        self.sharded = OrderedDict()   # unsplit name -> ShardedParam
        self.shard_params = [OrderedDict() for _ in range(shards)]  # per shard: key -> Parameter

    def _dense_sizes(self, units, in_units, activation, use_bias, flatten, split):
        """Checks and keeps a dense layer's arguments; returns the shard sizes of
        ``split`` (``'units'`` or ``'in_units'``). Raises ValueError for a size
        not a positive integer or more shards than rows."""
        positive_int('units', units)
        positive_int('in_units', in_units)
        size = units if split == 'units' else in_units
        if self.shards > size:
            raise ValueError('shards: expected at most %s (%d) shards, found %d'
                             % (split, size, self.shards))
        self._units, self._in_units, self._flatten = units, in_units, flatten
        self._use_bias, self._act = use_bias, activation
        return even_split(size, self.shards)

    def add_param(self, key, shape, axis, sizes=None, **kwargs):
        """Registers parameter ``key`` of the unsplit ``shape``, split along ``axis``
        in ``sizes`` (one per shard), or whole on shard 0 (``axis=None``);
        ``kwargs`` go to ``ParameterDict.get``. Raises ValueError unless ``sizes``
        are positive and sum to ``shape[axis]``."""
        if axis is not None and (sizes is None or len(sizes) != self.shards or
                                 any(not is_int(v) or v < 1 for v in sizes) or
                                 sum(sizes) != shape[axis]):
            raise ValueError('%s: expected sizes of the %d shards summing to axis %d of %s (%d), '
                             'found %r' % (key, self.shards, axis, tuple(shape), shape[axis],
                                           sizes))
        if axis is None:
            param = self.params.get(key, shape=shape, **kwargs)
            self.shard_params[0][key] = param
            return
        parts = []
        for i in range(self.shards):
            part = list(shape)
            part[axis] = sizes[i]
            name = key if self.shards == 1 else 'shard%d_%s' % (i, key)
            param = self.params.get(name, shape=tuple(part), **kwargs)
            self.shard_params[i][key] = param
            parts.append(param)
        full = self.params.prefix + key
        self.sharded[full] = ShardedParam(full, tuple(shape), axis, parts)

    def device_indices(self, width):
        """Stage device of each shard, in a stage of ``width`` devices."""
        return [device_index(i, self.shards, width) for i in range(self.shards)]

    # -- the graph, the same code for Symbols and NDArrays --------------------

    def prepare(self, F, x, *more):
        """The inputs as every shard reads them (in shard 0's group): one
        input, or a tuple of several."""
        return (x,) + more if more else x

    def shard_forward(self, F, i, x, **params):
        """Shard ``i``'s part of the output, from its ``params`` (by the keys given
        to :meth:`add_param`)."""
        raise NotImplementedError('%s: expected a shard_forward(F, i, x, **params) method'
                                  % type(self).__name__)

    def combine(self, F, parts, x):
        """The layer's output from the shards' ``parts`` (on shard 0's device)."""
        raise NotImplementedError('%s: expected a combine(F, parts, x) method'
                                  % type(self).__name__)

    def unsplit_forward(self, F, x, **params):
        """The layer's output from its whole parameters, as one device computes it."""
        raise NotImplementedError('%s: expected an unsplit_forward(F, x, **params) method'
                                  % type(self).__name__)

    _trace = None  # the trace under way (mark_shards), while one is

    def forward(self, x, *more):  # pylint: disable=arguments-differ
        """The layer's output for the inputs ``x, *more``: Symbols (each shard's ops
        in its group) or NDArrays (each shard on its device, combined on shard
        0's)."""
        inputs = (x,) + more
        if isinstance(x, mx.sym.Symbol):
            return self._symbolic(inputs)
        return self._imperative(inputs)

    def _prepared(self, F, inputs):
        x = self.prepare(F, *inputs)
        return tuple(x) if len(inputs) > 1 else (x,)

    def _symbolic(self, inputs):
        F = mx.sym
        trace = self._trace
        call = _next_call(trace, self.name)
        with self.name_scope():
            if trace is not None and trace.unsplit:
                with mx.AttrScope(**{SHARD_ATTR: shard_mark(0, 1, call)}):
                    variables = {}
                    for key, param in self.shard_params[0].items():
                        name = self.params.prefix + key
                        full = self.sharded.get(name)
                        if name not in trace.variables:
                            trace.variables[name] = mx.sym.var(
                                name, shape=param.shape if full is None else full.shape,
                                dtype=param.dtype)
                        variables[key] = trace.variables[name]
                    return self.unsplit_forward(F, *inputs, **variables)
            if call is None or self.shards == 1:
                scopes = [nullcontext] * self.shards
            else:
                scopes = [lambda i=i: mx.AttrScope(**{SHARD_ATTR: shard_mark(i, self.shards, call)})
                          for i in range(self.shards)]
            with scopes[0]():
                xs = self._prepared(F, inputs)
            parts = []
            for i in range(self.shards):
                with scopes[i]():
                    params = {k: p.var() for k, p in self.shard_params[i].items()}
                    parts.append(self.shard_forward(F, i, *xs, **params))
            with scopes[0]():
                return self.combine(F, parts, *xs)

    def shard_devices(self, x):
        """The device of each shard for the NDArray ``x``: those of the replica whose
        shard 0 sits on ``x``'s device, else the first replica's; a shard without
        parameters on ``x``'s device."""
        first = next(iter(self.shard_params[0].values()), None)
        ctxs = first.list_ctx() if first is not None else []
        replica = ctxs.index(x.context) if x.context in ctxs else 0
        return [next(iter(p.values())).list_ctx()[replica] if p else x.context
                for p in self.shard_params]

    def _imperative(self, inputs):
        F = mx.nd
        devices = self.shard_devices(inputs[0])
        xs = self._prepared(F, inputs)
        parts = []
        for i, device in enumerate(devices):
            params = {k: p.data(device) for k, p in self.shard_params[i].items()}
            moved = [v.as_in_context(device) if isinstance(v, mx.nd.NDArray) else v for v in xs]
            parts.append(_moved(self.shard_forward(F, i, *moved, **params), devices[0]))
        return self.combine(F, parts, *xs)


def _moved(out, device):
    """``out`` (an NDArray, or a list or tuple of them) on ``device``."""
    if isinstance(out, (list, tuple)):
        return type(out)(_moved(o, device) for o in out)
    return out.as_in_context(device) if isinstance(out, mx.nd.NDArray) else out


class ColumnParallelDense(ShardedBlock):
    """``gluon.nn.Dense`` whose weight is split by output units over ``shards``:
    shard ``i`` computes its rows of the output (and the activation) from the
    whole input, joined on shard 0's device.

    Args:
        units: Output size.
        in_units: Input size (required: each shard's shape is known up front).
        shards: Parts the layer is split into; ``units`` need not divide.
        activation, use_bias, flatten, dtype, weight_initializer,
            bias_initializer, prefix, params: As ``gluon.nn.Dense``.

    Raises:
        ValueError: ``units``, ``in_units`` or ``shards`` not a positive
            integer, or more shards than units.
    """

    def __init__(self, units, in_units, shards, activation=None, use_bias=True, flatten=True,
                 dtype='float32', weight_initializer=None, bias_initializer='zeros',
                 prefix=None, params=None):
        super().__init__(shards, prefix=prefix, params=params)
        self.sizes = self._dense_sizes(units, in_units, activation, use_bias, flatten, 'units')
        with self.name_scope():
            self.add_param('weight', (units, in_units), 0, self.sizes,
                           init=weight_initializer, dtype=dtype, allow_deferred_init=True)
            if use_bias:
                self.add_param('bias', (units,), 0, self.sizes, init=bias_initializer,
                               dtype=dtype, allow_deferred_init=True)

    def _dense(self, F, x, weight, bias, num_hidden, name):
        y = F.FullyConnected(x, weight, bias, no_bias=bias is None, num_hidden=num_hidden,
                             flatten=self._flatten, name=name)
        if self._act is not None:
            y = F.Activation(y, act_type=self._act, name=name + '_' + self._act)
        return y

    def prepare(self, F, x):
        return copy_to_shards(F, x) if self.shards > 1 else x

    def shard_forward(self, F, i, x, weight, bias=None):
        return self._dense(F, x, weight, bias, self.sizes[i],
                           'fwd' if self.shards == 1 else 'shard%d_fwd' % i)

    def combine(self, F, parts, x):
        return gather_from_shards(F, parts, self._flatten)

    def unsplit_forward(self, F, x, weight, bias=None):
        return self._dense(F, x, weight, bias, self._units, 'fwd')

    def __repr__(self):
        return '%s(%d -> %d, %d shards%s)' % (
            type(self).__name__, self._in_units, self._units, self.shards,
            ', ' + self._act if self._act else '')


class PerShard(ShardedBlock):
    """A parameter-free function of each shard's part of the inputs, on that
    shard's device. After a :class:`ColumnParallelDense` of as many shards it
    reads that layer's shard outputs, and a following :class:`RowParallelDense`
    reads its own: nothing crosses devices. Otherwise each input's last axis is
    cut into ``shards`` parts and the results joined on shard 0's device.
    ``fn`` must act on each part alone for the result not to depend on the
    shard count.

    Args:
        fn: ``fn(F, x, ...) -> y`` on a part of each input; its last axis may
            change size.
        units: Size of the input's last axis.
        shards: Parts, as the layers around it.
        flatten: Whether the row layer after it flattens its input.
        prefix, params: As any Gluon block.

    Raises:
        ValueError: ``units`` or ``shards`` not a positive integer, or ``fn``
            not callable.
    """

    def __init__(self, fn, units, shards, flatten=False, prefix=None, params=None):
        super().__init__(shards, prefix=prefix, params=params)
        positive_int('units', units)
        if not callable(fn):
            raise ValueError('fn: expected a function fn(F, x) -> y, found %r' % (fn,))
        self._fn, self._units, self._flatten = fn, units, flatten
        self.sizes = even_split(units, shards)
        self._starts = np.cumsum([0] + self.sizes).tolist()

    def _part(self, F, i, x, j):
        parts = parts_behind(x, self.shards, False)
        if parts is not None:
            return parts[i]
        if self.shards == 1:
            return x
        return F.slice_axis(x, axis=-1, begin=self._starts[i], end=self._starts[i + 1],
                            name='shard%d_slice%d' % (i, j) if j else 'shard%d_slice' % i)

    def shard_forward(self, F, i, *x):  # pylint: disable=arguments-differ
        return self._fn(F, *(self._part(F, i, v, j) for j, v in enumerate(x)))

    def combine(self, F, parts, *x):
        return gather_from_shards(F, parts, self._flatten)

    def unsplit_forward(self, F, *x):  # pylint: disable=arguments-differ
        return self._fn(F, *x)

    def __repr__(self):
        return '%s(%s, %d shards)' % (type(self).__name__, getattr(self._fn, '__name__', 'fn'),
                                      self.shards)


class RowParallelDense(ShardedBlock):
    """``gluon.nn.Dense`` whose weight is split by input units over ``shards``:
    shard ``i`` multiplies its columns with its slice of the input (or a
    preceding :class:`ColumnParallelDense`'s shard ``i`` output); the parts are
    summed on shard 0's device, which adds the bias and the activation.

    Args:
        units: Output size.
        in_units: Input size (required).
        shards: Parts the layer is split into; ``in_units`` need not divide.
        activation, use_bias, flatten, dtype, weight_initializer,
            bias_initializer, prefix, params: As ``gluon.nn.Dense``.

    Raises:
        ValueError: ``units``, ``in_units`` or ``shards`` not a positive
            integer, or more shards than input units.
    """

    def __init__(self, units, in_units, shards, activation=None, use_bias=True, flatten=True,
                 dtype='float32', weight_initializer=None, bias_initializer='zeros',
                 prefix=None, params=None):
        super().__init__(shards, prefix=prefix, params=params)
        self.sizes = self._dense_sizes(units, in_units, activation, use_bias, flatten,
                                       'in_units')
        self._starts = np.cumsum([0] + self.sizes).tolist()
        with self.name_scope():
            self.add_param('weight', (units, in_units), 1, self.sizes,
                           init=weight_initializer, dtype=dtype, allow_deferred_init=True)
            if use_bias:
                self.add_param('bias', (units,), None, init=bias_initializer, dtype=dtype,
                               allow_deferred_init=True)

    def prepare(self, F, x):
        return copy_to_shards(F, x) if self.shards > 1 else x

    def shard_forward(self, F, i, x, weight, bias=None):
        if self.shards > 1:
            parts = parts_behind(x, self.shards, self._flatten)
            if parts is not None:
                x = parts[i]
            else:
                if self._flatten:
                    x = F.flatten(x, name='shard%d_flatten' % i)
                x = F.slice_axis(x, axis=-1, begin=self._starts[i], end=self._starts[i + 1],
                                 name='shard%d_slice' % i)
        return F.FullyConnected(x, weight, bias, no_bias=bias is None, num_hidden=self._units,
                                flatten=self._flatten,
                                name='fwd' if self.shards == 1 else 'shard%d_fwd' % i)

    def combine(self, F, parts, x):
        y = reduce_from_shards(F, parts)
        if self._act is not None:
            y = F.Activation(y, act_type=self._act, name=self._act)
        return y

    def unsplit_forward(self, F, x, weight, bias=None):
        y = F.FullyConnected(x, weight, bias, no_bias=bias is None, num_hidden=self._units,
                             flatten=self._flatten, name='fwd')
        if self._act is not None:
            y = F.Activation(y, act_type=self._act, name=self._act)
        return y

    def __repr__(self):
        return '%s(%d -> %d, %d shards%s)' % (
            type(self).__name__, self._in_units, self._units, self.shards,
            ', ' + self._act if self._act else '')


class VocabParallelEmbedding(ShardedBlock):
    """``gluon.nn.Embedding`` whose table is split by rows: shard ``i`` looks up
    the ids in its rows, zero elsewhere, and the shards are summed on shard 0's
    device.

    Args:
        input_dim: Vocabulary size.
        output_dim: Embedding size.
        shards: Parts the table is split into; ``input_dim`` need not divide.
        dtype, weight_initializer, prefix, params: As ``gluon.nn.Embedding``.

    Raises:
        ValueError: ``input_dim``, ``output_dim`` or ``shards`` not a positive
            integer, or more shards than rows.
    """

    def __init__(self, input_dim, output_dim, shards, dtype='float32', weight_initializer=None,
                 prefix=None, params=None):
        super().__init__(shards, prefix=prefix, params=params)
        positive_int('input_dim', input_dim)
        positive_int('output_dim', output_dim)
        if shards > input_dim:
            raise ValueError('shards: expected at most input_dim (%d) shards, found %d'
                             % (input_dim, shards))
        self._input_dim, self._output_dim, self._dtype = input_dim, output_dim, dtype
        self.sizes = even_split(input_dim, shards)
        self._starts = np.cumsum([0] + self.sizes).tolist()
        with self.name_scope():
            self.add_param('weight', (input_dim, output_dim), 0, self.sizes,
                           init=weight_initializer, dtype=dtype, allow_deferred_init=True)

    def prepare(self, F, x):
        # each shard's ids are computed from x (an Embedding's ids have no gradient)
        return ids_outside_gradient(F, x) if self.shards > 1 else x

    def shard_forward(self, F, i, x, weight):
        if self.shards == 1:
            return F.Embedding(x, weight, input_dim=self._input_dim, output_dim=self._output_dim,
                               dtype=self._dtype, name='fwd')
        local = x - self._starts[i]
        valid = (local >= 0) * (local < self.sizes[i])   # 1 where shard i holds the row
        rows = F.Embedding(local * valid, weight, input_dim=self.sizes[i],
                           output_dim=self._output_dim, dtype=self._dtype,
                           name='shard%d_fwd' % i)
        return F.broadcast_mul(rows, F.expand_dims(valid, axis=-1), name='shard%d_mask' % i)

    def combine(self, F, parts, x):
        return reduce_from_shards(F, parts)

    def unsplit_forward(self, F, x, weight):
        return F.Embedding(x, weight, input_dim=self._input_dim, output_dim=self._output_dim,
                           dtype=self._dtype, name='fwd')

    def __repr__(self):
        return '%s(%d -> %d, %d shards)' % (type(self).__name__, self._input_dim,
                                           self._output_dim, self.shards)


# -- the unsplit layer's parameters where users see them ----------------------

def sharded_blocks(block):
    """Every tensor-parallel layer in ``block`` (itself or its children)."""
    found = []
    block.apply(lambda b: found.append(b) if isinstance(b, ShardedBlock) else None)
    return found


def layout(blocks):
    """``{unsplit name: ShardedParam}`` of every parameter of ``blocks`` split
    over several shards."""
    found = OrderedDict()
    for block in blocks:
        for layer in sharded_blocks(block):
            found.update((n, s) for n, s in layer.sharded.items() if len(s.shards) > 1)
    return found


def _as_numpy(value):
    return value.asnumpy() if isinstance(value, mx.nd.NDArray) else np.asarray(value)


def gather_params(values, sharded):
    """``values`` (name -> array) with each split parameter's shards replaced by
    the unsplit parameter, on ``cpu()``; other names pass unchanged."""
    out = OrderedDict()
    shard_names = {n: s for s in sharded.values() for n in s.names}
    for name, value in values.items():
        if name not in shard_names:
            out[name] = value
            continue
        param = shard_names[name]
        if param.name in out or not all(n in values for n in param.names):
            continue
        parts = [_as_numpy(values[n]) for n in param.names]
        out[param.name] = mx.nd.array(np.concatenate(parts, axis=param.axis),
                                      dtype=parts[0].dtype)
    return out


def gather_made(made, sharded):
    """:func:`gather_params` over functions of no arguments returning numpy
    arrays: each split parameter's shards replaced by one function joining
    them, in :func:`gather_params`'s order."""
    out = OrderedDict()
    shard_names = {n: s for s in sharded.values() for n in s.names}

    def joined(param):
        return lambda: np.concatenate([made[n]() for n in param.names], axis=param.axis)

    for name, make in made.items():
        param = shard_names.get(name)
        if param is None:
            out[name] = make
        elif param.name not in out and all(n in made for n in param.names):
            out[param.name] = joined(param)
    return out


def split_params(values, sharded):
    """``values`` with each unsplit parameter replaced by its shards, other names
    unchanged; raises ValueError for an unsplit value of another shape."""
    out = OrderedDict()
    for name, value in values.items():
        param = sharded.get(name)
        if param is None:
            out[name] = value
            continue
        array = _as_numpy(value)
        if tuple(array.shape) != tuple(param.shape):
            raise ValueError('%s: expected shape %s (the unsplit layer), found %s'
                             % (name, param.shape, tuple(array.shape)))
        start = 0
        for shard in param.shards:
            size = shard.shape[param.axis]
            index = [slice(None)] * array.ndim
            index[param.axis] = slice(start, start + size)
            out[shard.name] = mx.nd.array(array[tuple(index)], dtype=array.dtype)
            start += size
    return out
