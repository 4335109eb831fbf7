"""Every MXNet 1.9.1 behaviour this library works around, each named where it
is worked around. ``tests/test_mxnet_traps.py`` pins each behaviour; the
longer accounts are in docs/batchnorm-chunks.md and docs/pipelining.md. Two
stay where they act: the Module's host copy (``engine/device_module.py``) and
the ``Trainer``'s ``dist_*`` kvstore (``optim/trainer.py``)."""
from contextlib import contextmanager
import functools
import linecache
import os
import sys

import mxnet as mx

from .checks import excerpt
from ..graph.ir import as_placed, make_node
from ..graph.names import CHUNK_INFIX
from .scoped import captured_stderr, environ, hold_entries

__all__ = []


# MXNet's graph executor, at each bind of a graph split over several devices.
SUBGRAPH_BACKEND = {'MXNET_SUBGRAPH_BACKEND': 'NONE'}
UNSHARED_MEMORY = {'NNVM_EXEC_MATCH_RANGE': '0', 'NNVM_AUTO_SEARCH_MATCH_RANGE': '0'}
# MXNet's memory planner, at each bind: plan with every match range 1, 2, 4, ...
# up to NNVM_EXEC_MATCH_RANGE (16) and keep the plan of fewest bytes, not the
# one of 16 alone (see split_bind_environ).
SEARCHED_MEMORY = {'NNVM_AUTO_SEARCH_MATCH_RANGE': '1'}
# Set around binds and kvstores while operators may run: each gets its entry
# now, empty (MXNet's dmlc::GetEnv reads "" as unset) or MXNet's default.
hold_entries(**dict.fromkeys(list(SUBGRAPH_BACKEND) + list(UNSHARED_MEMORY), ''),
             MXNET_UPDATE_ON_KVSTORE='1')
# The ops whose oneDNN kernels write an array in a blocked layout of their
# own (or keep one they are given, after a convolution): a graph with none of
# them leaves no stale layout for a cross-device copy to find, and keeps
# MXNet's storage sharing (see split_bind_environ).
ONEDNN_LAYOUT_OPS = frozenset({'Convolution', 'Deconvolution', 'Pooling', 'BatchNorm', 'LRN',
                               'RNN'})

# The op whose oneDNN backward writes its weight's gradient through the
# gradient array's storage before MXNet has allocated it (see
# unallocated_weight_gradients).
UNALLOCATED_GRADIENT_OP = 'Deconvolution'

# The op that ends a bulked segment of the executor's schedule on one device.
SEGMENT_BOUNDARY_OP = '_copyto'
SEGMENT_BOUNDARY_PREFIX = 'chunk_boundary'
# MXNet's switch for mirroring every op of a graph (read when the graph is bound).
DO_MIRROR = 'MXNET_BACKWARD_DO_MIRROR'
# Ops MXNet 1.9.1 cannot recompute in the backward pass: their recomputed copy's output
# is asked for with req kNullOp (nothing reads it), and their forward checks kWriteTo
# ("req[embedding::kOut] == kWriteTo"). Mirroring leaves them out (their outputs are kept).
UNMIRRORED_OPS = frozenset({'Embedding', '_contrib_SparseEmbedding'})


def segment_boundaries(heads, group, first_index, tag=''):
    """Micro-batch outputs ``heads`` (graph entries, in the join's order), each
    but the last through a ``_copyto`` in the join's ``group``, so that MXNet
    bulks every stage's ops of every micro-batch (it ends a bulked segment
    only at a copy, and bulks none over two devices). None under
    ``MXNET_BACKWARD_DO_MIRROR=1``, where the copy's recomputed dtype cannot be
    inferred.

    Returns:
        ``(nodes, heads)``: the copy nodes to append, from index
        ``first_index``, named ``chunk_boundary<tag><m>``; the entries for the
        join to read.
    """
    if os.environ.get(DO_MIRROR, '0') not in ('', '0'):
        return [], list(heads)
    nodes, out = [], []
    for m, head in enumerate(heads):
        if m == len(heads) - 1:
            out.append(head)
            continue
        nodes.append(make_node(first_index + len(nodes),
                               '%s%s%d' % (SEGMENT_BOUNDARY_PREFIX, tag, m),
                               SEGMENT_BOUNDARY_OP, [head], group))
        out.append((first_index + len(nodes) - 1, 0, 0))
    return nodes, out


@contextmanager
def split_bind(group2ctx, symbol=None, training=True, fixed=()):
    """Context around a bind of a graph split over several devices, in the
    environment :func:`split_bind_environ` gives; MXNet's log line for
    ``MXNET_SUBGRAPH_BACKEND=NONE`` is dropped from stderr.

    Args:
        group2ctx: ``{group: mx.Context}`` of the bind (or any mapping whose
            values are its devices); ``None`` or empty for one device.
        symbol: The graph being bound (Symbol or ``PlacedGraph``); ``None``:
            as if it had an op of :data:`ONEDNN_LAYOUT_OPS`.
        training, fixed: Whether the bind computes gradients; the arguments
            that get none.

    Raises:
        ValueError: a training bind without shared storage of a graph with
            :func:`unallocated_weight_gradients`.
    """
    env = split_bind_environ(group2ctx.values() if group2ctx else (), symbol)
    if training and symbol is not None and \
            env.get('NNVM_EXEC_MATCH_RANGE') == UNSHARED_MEMORY['NNVM_EXEC_MATCH_RANGE']:
        refuse_unallocated_weight_gradients(symbol, fixed)
    if not env:
        yield
        return
    with environ(**env):
        with captured_stderr() as lines:
            yield
    for line in lines:
        if 'MXNET_SUBGRAPH_BACKEND=NONE is detected' not in line:
            print(line, file=sys.stderr)


def max_tensor_size():
    """The most elements MXNet takes in one tensor in this build (``2^31 - 1``
    without ``USE_INT64_TENSOR_SIZE``, as in the PyPI wheels)."""
    return (1 << 63) - 1 if mx.runtime.Features().is_enabled('INT64_TENSOR_SIZE') \
        else (1 << 31) - 1


def onednn_active():
    """Whether MXNet runs CPU operators through oneDNN in this process
    (``MXNET_MKLDNN_ENABLED`` and the build)."""
    if os.environ.get('MXNET_MKLDNN_ENABLED', '1').lower() in ('0', 'false'):
        return False
    return mx.runtime.Features().is_enabled('MKLDNN')


def leaves_onednn_layouts(symbol):
    """Whether ``symbol`` (Symbol, ``PlacedGraph``, or ``None`` for a graph not
    known) has an op of :data:`ONEDNN_LAYOUT_OPS`."""
    if symbol is None:
        return True
    return any(node.op in ONEDNN_LAYOUT_OPS for node in as_placed(symbol).ops)


def unallocated_weight_gradients(symbol, fixed=()):
    """``[(op name, weight name, readers)]`` of the ops of ``symbol`` whose
    weight gradient MXNet 1.9.1's oneDNN ``_backward_Deconvolution`` writes
    through a null pointer when intermediate arrays do not share storage: a
    weight (not in ``fixed``) read by several ops, or computed by an op
    (``readers`` 0) (docs/batchnorm-chunks.md)."""
    graph = as_placed(symbol)
    readers = graph.reader_counts()
    found = []
    for node in graph.ops:
        if node.op != UNALLOCATED_GRADIENT_OP or len(node.inputs) < 2:
            continue
        weight = graph.source(node.inputs[1])
        if weight.is_variable:
            if weight.name in fixed or readers[weight.index] == 1:
                continue
            found.append((node.name, weight.name, readers[weight.index]))
        else:
            found.append((node.name, weight.name, 0))
    return found


def refuse_unallocated_weight_gradients(symbol, fixed=()):
    """Raises ValueError in one line naming the first op of
    :func:`unallocated_weight_gradients`, its weight and readers, and how many
    such ops there are."""
    found = unallocated_weight_gradients(symbol, fixed)
    if not found:
        return
    name, weight, count = next((f for f in found if CHUNK_INFIX not in f[0]), found[0])
    read = 'computed by an op' if count == 0 else 'read by %d ops' % count
    raise ValueError(
        '%s (%s): expected its weight read by it alone to train a graph split over CPU devices '
        'with oneDNN, found %s %s (%d such ops in the graph): MXNet 1.9.1\'s oneDNN %s '
        'backward writes such a weight\'s gradient, an intermediate array whose storage is not '
        'allocated yet, through a null pointer, and the process dies; train with chunks=1, '
        "schedule='1f1b', or MXNET_MKLDNN_ENABLED=0"
        % (name, UNALLOCATED_GRADIENT_OP, weight, read, len(found), UNALLOCATED_GRADIENT_OP))


def split_bind_environ(devices, symbol=None):
    """The environment (``{name: value}``) a bind of a graph split over
    ``devices`` needs (``symbol`` ``None``: as if it had an op of
    :data:`ONEDNN_LAYOUT_OPS`):

    - ``MXNET_SUBGRAPH_BACKEND=NONE``: the oneDNN subgraph backend fuses ops
      across ``ctx_group`` s.
    - On CPU with oneDNN, for a graph with an op of :data:`ONEDNN_LAYOUT_OPS`,
      :data:`UNSHARED_MEMORY`: ``CopyFromTo`` writes through the stale layout a
      shared storage chunk keeps (docs/batchnorm-chunks.md).
    - Otherwise, and on one device, :data:`SEARCHED_MEMORY`, unless the
      caller's environment has ``NNVM_EXEC_MATCH_RANGE=0``.
    """
    devices = set(devices or ())
    searched = SEARCHED_MEMORY \
        if (os.environ.get('NNVM_EXEC_MATCH_RANGE') or '16').strip().lstrip('0') else {}
    if len(devices) < 2:
        return dict(searched)
    env = dict(SUBGRAPH_BACKEND)
    if any(d.device_type == 'cpu' for d in devices) and onednn_active() \
            and leaves_onednn_layouts(symbol):
        env.update(UNSHARED_MEMORY)
    else:
        env.update(searched)
    return env


def write_into(array, value):
    """Writes ``value`` (a NumPy array of ``array``'s shape) into the NDArray
    ``array`` in place, through a copy where oneDNN keeps ``array`` in a
    blocked layout that refuses ``array[:] = value``."""
    try:
        array[:] = value
        return
    except mx.base.MXNetError:  # oneDNN's own layout: SetTBlob's check refused it
        pass
    mx.nd.array(value, ctx=array.context, dtype=array.dtype).copyto(array)
    array.wait_to_read()


def initialized(param):
    """Whether a Gluon ``Parameter`` has values (``list_ctx()`` raises until it
    has)."""
    try:
        param.list_ctx()
        return True
    except RuntimeError:
        return False


def reset_variables(block):
    """Forgets the Symbol variables Gluon cached for ``block``'s parameters (with
    the ``ctx_group`` of their first trace)."""
    for param in block.collect_params().values():
        param._var = None  # pylint: disable=protected-access


@contextmanager
def fresh_variables(blocks):
    """Context in which ``blocks`` (a block or a list) trace with fresh parameter
    variables, forgotten again afterwards."""
    blocks = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks]
    for block in blocks:
        reset_variables(block)
    try:
        yield
    finally:
        for block in blocks:
            reset_variables(block)


def gradient_only_kvstore():
    """Context around ``Module.init_optimizer`` in which the kvstore sums
    gradients only (``MXNET_UPDATE_ON_KVSTORE=0``): each parameter is updated on
    its own stage's device."""
    return environ(MXNET_UPDATE_ON_KVSTORE='0')


def profiler_cpu_limit():
    """The first ``cpu(i)`` MXNet 1.9.1's profiler cannot record (one row per
    core, then two): an op past it aborts the process."""
    return (os.cpu_count() or 1) + 2


def unprofilable(devices):
    """The ``cpu(i)`` of ``devices`` (contexts or strings) past
    :func:`profiler_cpu_limit`, as ``'cpu:i'``."""
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


def error_line(err):
    """The informative line of an error: the last of MXNet's messages (which
    start with a stack trace), the first of others."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    line = lines[-1] if lines[0].startswith(('Traceback', 'Stack trace')) else lines[0]
    return line[len('MXNetError: '):] if line.startswith('MXNetError: ') else line


class NotSymbolSafe(ValueError):
    """A block whose ``hybrid_forward`` fails when Gluon runs it on Symbols."""


def _failing_block(traceback):
    """The innermost Gluon block whose ``hybrid_forward`` was running on Symbols
    where ``traceback`` ends, and ``(file, line)`` of that call, or
    ``(None, None)``."""
    block = where = None
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_code.co_name == 'hybrid_forward' and frame.f_locals.get('F') is mx.sym and \
                isinstance(frame.f_locals.get('self'), mx.gluon.Block):
            block, where = frame.f_locals['self'], (frame.f_code.co_filename, traceback.tb_lineno)
        traceback = traceback.tb_next
    return block, where


def symbol_safe(fn):
    """``fn``, with an error raised in a block's ``hybrid_forward`` traced on
    Symbols made a :class:`NotSymbolSafe` line naming the block, its class,
    the error and the call."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (mx.base.MXNetError, AttributeError, TypeError, AssertionError) as err:
            block, where = _failing_block(err.__traceback__)
            if block is None:
                raise
            path, line = where
            call = excerpt(linecache.getline(path, line).strip() or '?')
            raise NotSymbolSafe('blocks: expected every hybrid_forward to run on Symbols (the '
                                'split traces the network), found %s (%s) failing: %s: %s; at '
                                '`%s` (%s, line %d)'
                                % (block.name, type(block).__name__, type(err).__name__,
                                   error_line(err), call,
                                   os.path.basename(path), line)) from None
    return wrapper


@contextmanager
def read_on(params, device):
    """Context in which each ``(param, source)`` of ``params`` reads, on
    ``device``, a recorded copy of its value on ``source`` (a ``(param, source,
    target)`` reads it on ``target``); autograd sums every use's gradient into
    that copy. Gluon's private lists that name the copy are restored afterwards."""
    # pylint: disable=protected-access
    saved = [(p[0], p[0]._data, p[0]._ctx_list, p[0]._ctx_map) for p in params]
    try:
        for param, source, *target in params:
            where = target[0] if target else device
            copy = param.data(source).as_in_context(where)
            param._data, param._ctx_list = [copy], [where]
            ctx_map = [[], []]  # Gluon's lookup: [device type & 1][device id] -> index
            ctx_map[where.device_typeid & 1] = [None] * where.device_id + [0]
            param._ctx_map = ctx_map
        yield
    finally:
        for param, data, ctx_list, ctx_map in saved:
            param._data, param._ctx_list, param._ctx_map = data, ctx_list, ctx_map


# -- gradients MXNet cannot compute or place: Embedding's ids, variables read by several groups,
# -- fused updates over several devices

# The ops whose backward refuses a gradient for their first input (the ids).
EMBEDDING_OPS = frozenset({'Embedding', '_contrib_SparseEmbedding'})


def embedding_ids(symbol, names):
    """The inputs among ``names`` (variables of ``symbol``) an Embedding reads its
    ids from, directly or through other ops: a training bind needs
    ``grad_req='null'`` for each (MXNet's Embedding backward refuses them)."""
    graph = as_placed(symbol)
    ids = graph.upstream(n.inputs[0] for n in graph.ops if n.op in EMBEDDING_OPS and n.inputs)
    wanted = set(names)
    return {n.name for n in ids if n.is_variable and n.name in wanted}


# The ops whose second input, when given, is a length per row (softmax(data, length,
# use_length=True): GluonNLP's attention masks its scores so).
LENGTH_OPS = frozenset({'softmax'})


def lengths_outside_gradient(placed):
    """``placed`` with the length each op of :data:`LENGTH_OPS` reads passed
    through ``BlockGrad`` (``placed`` itself where none reads one); outputs and
    values unchanged. MXNet's ``softmax(use_length=True)`` backward may zero
    the length in place when its gradient is asked for, as the stage runtime
    does (docs/any-network.md)."""
    nodes, moved = [], {}
    for node in placed.nodes:
        inputs = [(moved[e.node], e.output, e.version) for e in node.inputs]
        if node.op in LENGTH_OPS and len(inputs) > 1:
            nodes.append(make_node(len(nodes), '%s_length' % node.name, 'BlockGrad',
                                   [inputs[1]], node.group))
            inputs[1] = (len(nodes) - 1, 0, 0)
        moved[node.index] = len(nodes)
        nodes.append(node.but(index=len(nodes), inputs=inputs))
    if len(nodes) == len(placed.nodes):
        return placed
    return placed.but(nodes, [(moved[h.node], h.output, h.version) for h in placed.heads])


def ids_outside_gradient(F, x, name='indices'):
    """``x`` (Symbol or NDArray) with no gradient flowing back through it, for
    ids that ops turn into an Embedding's input."""
    return F.BlockGrad(x, name=name) if F is mx.sym else x.detach()


def read_in_own_group(F, x, name='input'):
    """``x`` read through an ``identity`` op of the group in force when it is a
    variable, so that ops of several groups can read it; anything else as it
    is."""
    if F is mx.sym and isinstance(x, mx.sym.Symbol) and x.get_children() is None:
        return F.identity(x, name=name)
    return x


def kvstore_may_update(params):
    """Whether a kvstore may run the optimizer for ``params``: only when all live
    on the same devices (MXNet's kvstore keeps the state where it reduces)."""
    params = list(params)
    return all(p.list_ctx() == params[0].list_ctx() for p in params)


def updates_by_device(indices, grads, weights):
    """``[(indices, grads, weights)]``, one per device in order of first
    appearance: one ``Updater`` call's arrays split by device, since MXNet
    fuses updates by dtype only, across devices."""
    by_device = {}
    for i, g, w in zip(indices, grads, weights):
        by_device.setdefault(w.context, []).append((i, g, w))
    return [tuple(list(part) for part in zip(*items)) for items in by_device.values()]
