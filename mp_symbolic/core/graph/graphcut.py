"""The graph cut: any traced network split into contiguous pipeline stages.

Pure functions over a traced graph (a
:class:`~mp_symbolic.core.graph.ir.PlacedGraph`, or its JSON): what each op
costs (:func:`param_costs`, :func:`op_times`), the activation bytes a cut
makes cross each boundary (:func:`cut_bytes`, :func:`crossing_bytes`),
:class:`Cut`, and :func:`run_graph`, which runs a labelled graph op by op
on NDArrays (the imperative twin of a cut network).
"""
import ast
import ctypes

import mxnet as mx
from mxnet.ndarray._internal import _imperative_invoke
import numpy as np

from ..placement.balance import CutError, balance_kind, check_balance, solve, time_forward_backward
from ..base.checks import tied_owners
from ..base.compat import error_line
from .ir import PlacedGraph, as_placed, load, make_node, op_order, variable_readers
from .names import DATA_NAME
from .passes import MAX_CHUNKED_OPS, label, replicate_chunks, unique_names  # noqa: F401

__all__ = ['Cut', 'CutError', 'op_order', 'variable_readers', 'param_costs', 'op_times',
           'entry_shapes', 'entry_bytes', 'cut_bytes', 'crossing_bytes', 'label',
           'replicate_chunks', 'unique_names', 'run_graph', 'load']


def param_costs(graph, shapes, data_names):
    """Elements of the parameters each op is the first to read, one per op in
    :func:`op_order` (``shapes``: ``{variable name: shape}``; ``data_names``:
    the inputs, not parameters)."""
    graph = as_placed(graph)
    order = graph.op_order()
    position = {n: k for k, n in enumerate(order)}
    costs = [0.0] * len(order)
    for var, ops in graph.variable_readers().items():
        name = graph.nodes[var].name
        if name in data_names:
            continue
        costs[position[ops[0]]] += float(np.prod(shapes[name]))
    return costs


def op_times(symbol, input_shapes, ctx, repeats=5, seed=0):
    """Median seconds of one forward and backward pass of each op bound alone on
    ``ctx`` on random inputs, one per op in :func:`op_order`."""
    graph = as_placed(symbol)
    shapes, dtypes = entry_shapes(symbol, input_shapes), entry_dtypes(symbol, input_shapes)
    rng = np.random.default_rng(seed)
    times = []
    for i in graph.op_order():
        node = graph.nodes[i]
        count = len(node.inputs)
        nodes = [make_node(k, 'in%d' % k, 'null') for k in range(count)]
        nodes.append(make_node(count, 'op', node.op, [(k, 0, 0) for k in range(count)], attrs={
            a: v for a, v in node.attrs.items() if not a.startswith('__')}))
        sym = PlacedGraph(tuple(nodes), (), graph.attrs).but(heads=[(count, 0, 0)]).to_symbol()
        in_shapes = {'in%d' % k: shapes[(graph.source(e).name, e.output)]
                     for k, e in enumerate(node.inputs)}
        in_dtypes = {'in%d' % k: dtypes[(graph.source(e).name, e.output)]
                     for k, e in enumerate(node.inputs)}
        times.append(time_forward_backward(sym, in_shapes, ctx, rng, repeats, in_dtypes))
    return times


def _by_entry(internals, values):
    """``{(node name, output index): value}`` over ``internals``' outputs."""
    out, count = {}, {}
    for k, value in enumerate(values):
        name = internals[k].name
        idx = count.get(name, 0)
        count[name] = idx + 1
        out[(name, idx)] = value
    return out


def entry_shapes(symbol, input_shapes, with_dtype=False):
    """``{(node name, output index): shape}`` of every visible node output, from
    shape inference on ``input_shapes`` (inputs float32); with ``with_dtype``,
    ``(shape, bytes per element)``."""
    internals = symbol.get_internals()
    _, out_shapes, _ = internals.infer_shape(**input_shapes)
    shapes = [tuple(s) for s in out_shapes]
    if not with_dtype:
        return _by_entry(internals, shapes)
    sizes = [np.dtype(t).itemsize for t in entry_dtypes(symbol, input_shapes).values()]
    return _by_entry(internals, list(zip(shapes, sizes)))


def entry_dtypes(symbol, input_shapes):
    """``{(node name, output index): numpy dtype}`` of every visible node output,
    the inputs of ``input_shapes`` float32."""
    internals = symbol.get_internals()
    _, out_types, _ = internals.infer_type(**{k: np.float32 for k in input_shapes})
    return _by_entry(internals, [np.dtype(t) for t in out_types])


def entry_bytes(symbol, input_shapes):
    """``{(node name, output index): bytes}`` of every visible node output."""
    return {key: int(np.prod(shape)) * itemsize
            for key, (shape, itemsize) in entry_shapes(symbol, input_shapes, True).items()}


def _crossings(graph, nbytes):
    """``(first, last, bytes)`` per distinct entry an op reads: the positions in
    :func:`op_order` of its producer (-1: a variable) and of its last reader."""
    order = graph.op_order()
    position = {n: k for k, n in enumerate(order)}
    nodes = graph.nodes
    spans = {}
    for i in order:
        for src, idx, _ in nodes[i].inputs:
            if nodes[src].is_variable and (nodes[src].name, idx) not in nbytes:
                continue
            key = (src, idx)
            first = position.get(src, -1)
            spans[key] = (first, max(spans.get(key, (first, -1))[1], position[i]))
    return [(first, last, nbytes.get((nodes[src].name, idx), 0))
            for (src, idx), (first, last) in sorted(spans.items())]


def cut_bytes(graph, nbytes):
    """Bytes crossing a cut after each op position: ``out[p]`` for a cut between
    positions ``p`` and ``p + 1`` of :func:`op_order`, counting the entries of
    ``nbytes`` (``{(node name, output index): bytes}``)."""
    graph = as_placed(graph)
    n = len(graph.op_order())
    delta = np.zeros(n + 1, dtype=np.float64)
    for first, last, size in _crossings(graph, nbytes):
        # crosses every cut after p for first <= p < last
        lo = max(first, 0)
        if last > lo:
            delta[lo] += size
            delta[last] -= size
    return np.cumsum(delta)[:n]


def crossing_bytes(graph, stage_of_op, nbytes):
    """Bytes crossing each boundary of a cut whose ``stage_of_op`` (in
    :func:`op_order`) is contiguous; ``nbytes`` as for :func:`cut_bytes`."""
    per_cut = cut_bytes(graph, nbytes)
    bounds = [p for p in range(len(stage_of_op) - 1) if stage_of_op[p] != stage_of_op[p + 1]]
    return [int(per_cut[p]) for p in bounds]


class Cut:
    """A network's graph cut into stages: what :class:`~mp_symbolic.Pipeline`
    builds for one ``HybridBlock``.

    Args:
        symbol: The traced network (several outputs grouped), or its
            :class:`~mp_symbolic.core.graph.ir.PlacedGraph`.
        num_stages: Stages to make.
        balance: ``None`` (parameter count), ``'time'`` (measured on
            ``input_shape``) or a list of ops per stage.
        input_shape: A batch's shape (``{input name: shape}`` for several
            inputs), or ``None`` (then no bytes are counted).
        param_shapes: ``{name: shape}`` of every parameter and auxiliary state.
        owners: ``{parameter name: stage}`` chosen by the user.
        data_name: The input variable, or the names of several.
        slack: See :func:`mp_symbolic.core.placement.balance.solve`.
        ctx: Device to time ops on for ``balance='time'`` (default ``cpu(0)``).
        stage_of_op: The stage of each op in :func:`op_order` where the split
            is fixed already; ``balance`` is then not read and parameter
            shapes need not be known.
        batch_axis: The axis of the batch in the inputs.
        virtual: The stages per device of ``num_stages`` (the schedule's),
            named where the graph has fewer ops than stages.

    Attributes:
        placed: The unlabelled graph, op names made unique.
        graph: The same as MXNet's JSON.
        op_names: Op names in :func:`op_order`.
        stage_of_op: Stage of each op.
        owner: ``{variable name: stage}`` of every variable.
        readers: ``{variable name: stages that read it}``.
        boundary_bytes: Activation bytes crossing each boundary per sample
            (``None`` without ``input_shape``).
        activation_bytes: ``{(node name, output index): bytes}`` of the input
            and every op output for one batch (``None`` without ``input_shape``).
        costs: The cost of each op that was balanced.

    Raises:
        BalanceError: more stages than ops, or a bad ``balance`` (``CutError``:
            bad ``owners``, an auxiliary state read by two stages).
    """

    def __init__(self, symbol, num_stages, balance=None, input_shape=None, param_shapes=None,
                 owners=None, data_name=DATA_NAME, slack=0.1, ctx=None, stage_of_op=None,
                 batch_axis=0, virtual=1):
        self.data_names = (data_name,) if isinstance(data_name, str) else tuple(data_name)
        self.data_name = self.data_names[0]
        if not isinstance(symbol, PlacedGraph):
            symbol = PlacedGraph.from_symbol(symbol, self.data_names)
        self.placed = unique_names(symbol)
        order = self.placed.op_order()
        self.op_names = [self.placed.nodes[i].name for i in order]
        params = {n.name for n in self.placed.variables} - set(self.data_names)
        if input_shape is not None and not isinstance(input_shape, dict):
            input_shape = {self.data_name: input_shape}
        shapes = dict(param_shapes or {})
        missing = sorted(p for p in params if not _known(shapes.get(p)))
        if missing and stage_of_op is None:
            raise CutError('expected every parameter shape to be known, found %s with shape %s '
                           '(pass sample=, a batch or its shape)'
                           % (missing[0], shapes.get(missing[0])))
        cross = None
        self.boundary_bytes = self.activation_bytes = None
        batch = None
        if input_shape is not None:
            input_shape = {n: tuple(s) for n, s in input_shape.items()}
            first = input_shape[self.data_name]
            batch = max(int(first[batch_axis]) if len(first) > batch_axis else 1, 1)
            traced = self.placed.to_symbol()
            nbytes = entry_bytes(traced, input_shape)
            self.activation_bytes = {k: v for k, v in nbytes.items() if k[0] not in params}
            cross = cut_bytes(self.placed, self.activation_bytes) / batch
        kind = None if stage_of_op is not None else \
            balance_kind(balance, input_shape is not None, 'ops', CutError)
        if kind == 'size':
            self.costs = param_costs(self.placed, shapes, set(self.data_names))
        elif kind == 'time':  # only with input_shape
            self.costs = op_times(traced, input_shape, ctx or mx.cpu(0))
        else:
            self.costs = None
        if stage_of_op is not None:
            self.stage_of_op = tuple(stage_of_op)
        else:
            if self.costs is None:
                sizes = check_balance(balance, len(order), num_stages, unit='ops')
            else:
                sizes = solve(self.costs, num_stages, cross, slack, unit='ops', virtual=virtual)
            self.stage_of_op = tuple(s for s, count in enumerate(sizes) for _ in range(count))
        stage = dict(zip(order, self.stage_of_op))
        self.readers, self.owner = {}, {}
        for var, ops in self.placed.variable_readers().items():
            name = self.placed.nodes[var].name
            self.readers[name] = sorted({stage[i] for i in ops})
            self.owner[name] = 0 if name in self.data_names else stage[ops[0]]
        self.owner.update(tied_owners(owners, params, num_stages, 'the network', CutError))
        if input_shape is not None:
            self.boundary_bytes = [b // batch for b in
                                   crossing_bytes(self.placed, self.stage_of_op,
                                                  self.activation_bytes)]
        self.labelled([])  # an auxiliary state read by two stages fails here

    @property
    def graph(self):
        """:attr:`placed` as MXNet's JSON."""
        return self.placed.to_json()

    @property
    def sizes(self):
        """Ops per stage."""
        return tuple(self.stage_of_op.count(s) for s in range(max(self.stage_of_op) + 1))

    def labelled(self, mirror=()):
        """The graph, every node in its stage's group (:func:`label`)."""
        return label(self.placed, self.stage_of_op, set(self.data_names), self.owner, mirror)

    def ops_of_stage(self, stage):
        return [n for n, s in zip(self.op_names, self.stage_of_op) if s == stage]


def _known(shape):
    return shape is not None and len(shape) > 0 and all(d > 0 for d in shape)


def run_graph(graph, inputs, device_of_group):
    """Runs a labelled graph op by op on NDArrays, each op on its group's device
    (its inputs moved there through ``as_in_context``, which autograd records).
    A source op whose ``shape`` has a 0 gets the shape inference gives on the
    real inputs.

    Args:
        graph: A :class:`~mp_symbolic.core.graph.ir.PlacedGraph`, or its JSON.
        inputs: ``{variable name: NDArray}`` for every variable of the graph.
        device_of_group: ``{'stage0': ctx, ...}``.

    Returns:
        The graph's outputs: one NDArray, or a list for several.

    Raises:
        CutError: an op MXNet does not know, or cannot run on these inputs.
    """
    run = GraphRun(graph, inputs, device_of_group)
    run.run([n.index for n in run.graph.ops])
    return run.outputs()


class GraphRun:
    """A labelled graph run op by op (:func:`run_graph`, of the same arguments), a
    part at a time; raises CutError where shape inference fails for a source
    op of unknown shape."""

    def __init__(self, graph, inputs, device_of_group):
        if not isinstance(graph, PlacedGraph):
            graph = PlacedGraph.from_json(graph)
        self.graph, self.device_of_group = graph, device_of_group
        self.inferred = _source_shapes(graph, inputs)
        self.values = {}
        for node in graph.variables:
            self.values[(node.index, 0)] = inputs[node.name]

    def run(self, indices):
        """Runs the op nodes ``indices``, and first every op they read that has not
        run yet, in the graph's order; raises as :func:`run_graph`."""
        nodes = self.graph.nodes
        todo, stack = set(), [i for i in indices if (i, 0) not in self.values]
        while stack:
            i = stack.pop()
            if i in todo or (i, 0) in self.values:
                continue
            todo.add(i)
            stack.extend(e.node for e in nodes[i].inputs)
        for i in sorted(todo):
            self._invoke(nodes[i])

    def _invoke(self, node):
        device = self.device_of_group[node.group]
        args = [self.values[(src, idx)].as_in_context(device) for src, idx, _ in node.inputs]
        kwargs = {k: v for k, v in node.attrs.items() if not k.startswith('__')}
        if node.name in self.inferred:
            kwargs['shape'] = str(self.inferred[node.name])
        if not args and 'ctx' not in kwargs and 'ctx' in _op_arguments(node.op):
            kwargs['ctx'] = str(device)  # a source op (_zeros, _arange, ...) makes its array here
        for k, value in enumerate(_invoke(node, args, kwargs)):
            self.values[(node.index, k)] = value

    def outputs(self):
        """The graph's outputs: one NDArray, or a list for several."""
        heads = self.graph.heads
        self.run([h.node for h in heads])
        outputs = [self.values[(h.node, h.output)] for h in heads]
        return outputs[0] if len(outputs) == 1 else outputs


def _has_unknown_shape(node):
    """Whether ``node`` is a source op whose ``shape`` has a 0 dimension."""
    shape = node.attrs.get('shape')
    if node.is_variable or node.inputs or not shape:
        return False
    try:
        dims = ast.literal_eval(shape)
    except (ValueError, SyntaxError):
        return False
    return isinstance(dims, (tuple, list)) and 0 in dims


def _source_shapes(graph, inputs):
    """``{node name: shape}`` of the source ops of unknown shape, inferred from
    the real inputs' shapes."""
    names = [n.name for n in graph.nodes if _has_unknown_shape(n)]
    if not names:
        return {}
    symbol = graph.to_symbol()
    known = set(symbol.list_arguments())
    try:
        shapes = entry_shapes(symbol, {k: v.shape for k, v in inputs.items() if k in known})
    except mx.base.MXNetError as err:
        raise CutError('shape of %s: expected MXNet to infer it from the inputs, found: %s'
                       % (names[0], error_line(err))) from None
    return {name: shapes[(name, 0)] for name in names}


_OP_HANDLES = {}     # op name -> MXNet's handle of the operator
_OP_ARGUMENTS = {}   # op name -> names of its attributes


def _op_handle(op):
    """MXNet's handle of operator ``op``; raises CutError where MXNet has none."""
    handle = _OP_HANDLES.get(op)
    if handle is None:
        handle = ctypes.c_void_p()
        try:
            mx.base.check_call(mx.base._LIB.NNGetOpHandle(  # pylint: disable=protected-access
                mx.base.c_str(op), ctypes.byref(handle)))
        except mx.base.MXNetError:
            handle = None
        if not handle or not handle.value:
            raise CutError('expected an operator MXNet runs imperatively, found %r' % op)
        _OP_HANDLES[op] = handle
    return handle


def _op_arguments(op):
    """The names of ``op``'s attributes, as MXNet documents them."""
    if op not in _OP_ARGUMENTS:
        name, desc, num_args = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_uint()
        arg_names, arg_types, arg_descs = (ctypes.POINTER(ctypes.c_char_p)() for _ in range(3))
        key_var_num_args, ret_type = ctypes.c_char_p(), ctypes.c_char_p()
        mx.base.check_call(mx.base._LIB.MXSymbolGetAtomicSymbolInfo(  # pylint: disable=protected-access
            _op_handle(op), ctypes.byref(name), ctypes.byref(desc), ctypes.byref(num_args),
            ctypes.byref(arg_names), ctypes.byref(arg_types), ctypes.byref(arg_descs),
            ctypes.byref(key_var_num_args), ctypes.byref(ret_type)))
        _OP_ARGUMENTS[op] = {mx.base.py_str(arg_names[i]) for i in range(num_args.value)}
    return _OP_ARGUMENTS[op]


def _invoke(node, args, kwargs):
    """``node``'s op on ``args`` with the graph's string attributes, as ``mx.nd``
    runs it; its visible outputs as a list."""
    handle = _op_handle(node.op)
    try:
        return _imperative_invoke(handle.value, args, list(kwargs), list(kwargs.values()),
                                  None, False, True)
    except mx.base.MXNetError as err:
        raise CutError('%s (%s): expected an operator MXNet runs imperatively on these inputs, '
                       'found: %s' % (node.name, node.op,
                                      error_line(err))) from None
