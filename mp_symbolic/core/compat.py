"""Every MXNet 1.9.1 behaviour this library works around, in one place.

Each workaround says what MXNet does, why it matters for a graph split over
devices, and what is done instead; ``tests/test_mxnet_traps.py`` pins each
behaviour, so that when MXNet changes (or the user runs on GPUs) a failing
test says which workaround can go. Two stay where they act. The Module's
host copy of every parameter on ``cpu(0)`` is left out by a class of its
own (``mp_symbolic/core/device_module.py``; its trap is pinned with the
others). The ``Trainer``
sets a ``dist_*`` kvstore up at construction rather than at the first step,
because two-worker jobs otherwise ended with garbage weights in about one
run of four (``mp_symbolic/core/trainer.py``), too rare to pin.
"""
from contextlib import contextmanager
import functools
import linecache
import os
import sys

import mxnet as mx

from .checks import excerpt
from .ir import as_placed, make_node
from .names import CHUNK_INFIX
from .scoped import captured_stderr, environ

__all__ = []


# MXNet's graph executor, at each bind of a graph split over several devices.
SUBGRAPH_BACKEND = {'MXNET_SUBGRAPH_BACKEND': 'NONE'}
UNSHARED_MEMORY = {'NNVM_EXEC_MATCH_RANGE': '0', 'NNVM_AUTO_SEARCH_MATCH_RANGE': '0'}
# MXNet's memory planner, at each bind: plan with every match range 1, 2, 4, ...
# up to NNVM_EXEC_MATCH_RANGE (16) and keep the plan of fewest bytes, not the
# one of 16 alone (see split_bind_environ).
SEARCHED_MEMORY = {'NNVM_AUTO_SEARCH_MATCH_RANGE': '1'}
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


def segment_boundaries(heads, group, first_index, tag=''):
    """Micro-batch outputs ``heads`` (one per chunk, in the join's order),
    each but the last through a copy on its own device, so
    that MXNet bulks every stage's ops of every micro-batch (for a graph of
    several stages; on one stage there is nothing to separate).

    **What MXNet does.** The graph executor runs a training graph in bulked
    segments (``MXNET_EXEC_BULK_EXEC_TRAIN``): runs of consecutive nodes in
    its topological order, each pushed to the engine as one operation
    (``GraphExecutor::BulkOpSegs``, ``src/executor/graph_executor.cc``). A
    segment ends only at a node that is not an ordinary operator (a
    cross-device copy) or after ``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_*``
    nodes; a segment whose ops sit on two devices is not bulked at all
    (``CreateCachedSegOpr`` gives up) and each of its ops is pushed alone.

    **Why it matters.** The order visits one micro-batch after another: the
    last stage's ops of chunk ``m`` are followed by the first stage's ops of
    chunk ``m + 1``, with no copy between them (and in the backward pass the
    first stage's ops of one chunk by the last stage's of the next). Those
    segments span two devices, so most ops of every chunk but one ran
    unbulked: on the digits CNN over three devices with four chunks, 45
    engine operations per step on the first device instead of 12, each with
    its own scheduling cost.

    **What is done instead.** Each chunk's output but the last passes
    through ``_copyto``, MXNet's copy operator, in the last stage's group:
    the executor runs it as a copy on that device (it is registered with
    the copy's execution type, and its gradient is the same copy), so it
    ends the segment in the forward pass and, as its gradient, in the
    backward pass. The last chunk keeps no copy: the join infers the
    copies' dtype from it (``_copyto`` infers no dtype of its own), and
    nothing follows it. The values are the outputs themselves.

    Under MXNet's graph-wide mirroring (``MXNET_BACKWARD_DO_MIRROR=1`` in the
    environment when the graph is built and bound) the backward pass
    recomputes the copies too, and the recomputed copy has no dtype to infer
    from: the bind fails (``InferType pass cannot decide dtypes``). There the
    copies are left out, and the chunks run unbulked.

    Args:
        heads: The graph entries (``(node, output, version)``) of the
            micro-batch outputs, in the join's order.
        group: The ``ctx_group`` of the join (the last stage's).
        first_index: The index the first appended node will have.
        tag: Put in the copies' names after the prefix (one per output of a
            network with several).

    Returns:
        ``(nodes, heads)``: the copy nodes to append to the graph
        (:class:`~mp_symbolic.core.ir.Node` s named ``chunk_boundary<m>``),
        and the entries for the join to read.
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
    """Around a bind of a graph split over several devices: the environment
    :func:`split_bind_environ` gives (MXNet's oneDNN subgraph backend off; on
    CPU with oneDNN, for a graph with an op of :data:`ONEDNN_LAYOUT_OPS` or
    when ``symbol`` is not given, no storage shared between intermediate
    arrays, so no cross-device copy writes through another array's oneDNN
    layout; for any other graph, the memory planner's plan of fewest bytes).
    A training bind without shared storage is first checked for the weight
    gradients MXNet would write through a null pointer
    (:func:`unallocated_weight_gradients`), and refused if it has any.

    A graph on one device keeps oneDNN's fusion and shared storage, with the
    plan of fewest bytes too. MXNet logs a line for
    ``MXNET_SUBGRAPH_BACKEND=NONE`` at every bind; that line is dropped,
    anything else it writes passes through.

    Args:
        group2ctx: ``{group: mx.Context}`` of the bind (or any mapping whose
            values are its devices); ``None`` or empty for one device.
        symbol: The graph being bound (an ``mx.sym.Symbol`` or its
            :class:`~mp_symbolic.core.ir.PlacedGraph`), read for its ops; ``None``
            binds as if it had an op of :data:`ONEDNN_LAYOUT_OPS`.
        training: Whether the bind computes gradients (``False`` for an
            inference bind, ``grad_req='null'``).
        fixed: Names of the arguments that get no gradient.

    Raises:
        ValueError: a training bind of ``symbol`` without shared storage
            where a :data:`UNALLOCATED_GRADIENT_OP`'s weight is read by other
            ops too (one line naming the op, the weight and the cause).
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
    """The most elements MXNet takes in one tensor in this build.

    **What MXNet does.** Built without ``USE_INT64_TENSOR_SIZE`` (the wheels
    on PyPI), its shape inference raises a bare ``Exception`` (``Size of
    tensor you are trying to allocate is larger than 2^31 elements``) for a
    tensor of more than ``2^31 - 1``. **What is done instead.** The build is
    asked, so that a size is refused before MXNet sees it."""
    return (1 << 63) - 1 if mx.runtime.Features().is_enabled('INT64_TENSOR_SIZE') \
        else (1 << 31) - 1


def onednn_active():
    """Whether MXNet runs CPU operators through oneDNN (MKLDNN) in this process.

    MXNet reads ``MXNET_MKLDNN_ENABLED`` once, at its first operator; this
    reads the variable as MXNet would and asks the build.
    """
    if os.environ.get('MXNET_MKLDNN_ENABLED', '1').lower() in ('0', 'false'):
        return False
    return mx.runtime.Features().is_enabled('MKLDNN')


def leaves_onednn_layouts(symbol):
    """Whether ``symbol`` (an ``mx.sym.Symbol`` or a
    :class:`~mp_symbolic.core.ir.PlacedGraph`, or ``None`` for a graph not
    known) has an op of :data:`ONEDNN_LAYOUT_OPS`: the graphs whose split
    binds need storage of their own on CPU (``split_bind_environ``)."""
    if symbol is None:
        return True
    return any(node.op in ONEDNN_LAYOUT_OPS for node in as_placed(symbol).ops)


def unallocated_weight_gradients(symbol, fixed=()):
    """The ops of ``symbol`` whose weight gradient MXNet 1.9.1, with oneDNN,
    writes through a null pointer when every intermediate array has storage
    of its own.

    **What MXNet does.** The graph executor gives every intermediate array a
    slice of a pool array made with ``delay_alloc``
    (``GraphExecutor::InitDataEntryMemory``,
    ``src/executor/graph_executor.cc``); its storage is allocated when an op
    first writes it. oneDNN's ``_backward_Deconvolution``
    (``MKLDNNDeconvBwd::Execute``,
    ``src/operator/nn/mkldnn/mkldnn_deconvolution.cc``) first swaps the
    logical order of the weight gradient's input and output channels
    (``IOSwapWeightsTensors``, ``mkldnn_deconvolution-inl.h``), and that swap
    (``NDArray::UpdateMKLDNNMemDesc``, ``src/ndarray/ndarray.cc``) wraps the
    array's data pointer without allocating it. If nothing wrote the
    gradient's storage before, the pointer is null; the gradient is then
    created with that layout (``CreateMKLDNNData`` returns the null-handle
    memory it finds), and oneDNN's kernel writes the gradient to address 0:
    a segmentation fault, no error. A weight read by this op alone has its
    gradient in the caller's gradient array, which is allocated; a weight
    read by several ops (the copies of the op per micro-batch, or a tied
    weight) has one gradient per reader, intermediate arrays summed into it.

    **Why it matters.** Without storage sharing (``NNVM_EXEC_MATCH_RANGE=0``,
    :func:`split_bind_environ`), every such gradient has storage no op wrote
    before, and the first backward pass kills the process: GluonCV's
    CenterNet (three ``Conv2DTranspose``) split over two devices with
    ``chunks=2``. With sharing, it depends on the memory plan (on one
    device, two such ops sharing a weight larger than the activations die
    too: ``tests/test_mxnet_traps.py``).

    Args:
        symbol: An ``mx.sym.Symbol`` or a :class:`~mp_symbolic.core.ir.PlacedGraph`.
        fixed: Names of the arguments that get no gradient.

    Returns:
        ``[(op name, weight name, readers)]`` of the
        :data:`UNALLOCATED_GRADIENT_OP` nodes whose weight is read by other
        ops too (``readers`` the number of ops reading it; for a weight
        computed by an op, ``weight name`` names that op and ``readers`` is
        0), in the graph's order.
    """
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
    """Refuses, in one line, a graph with a weight gradient of
    :func:`unallocated_weight_gradients`, for a training bind without
    storage sharing.

    Raises:
        ValueError: naming the first such op (the network's own op, before
            its micro-batches' copies), its weight, how many ops read it,
            and how many such ops the graph has.
    """
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
       graph (see docs/batchnorm-chunks.md for the figures). Only a graph
       with an op of :data:`ONEDNN_LAYOUT_OPS` pays it: the blocked layouts
       come from oneDNN's convolutions and the ops that keep their layout
       (BatchNorm, pooling, relu after them); dense layers, LayerNorm,
       softmax, ``batch_dot`` and elementwise ops on plain arrays write plain
       layouts, which a copy or the next op reads at the array's own dims.
       ``tests/test_mxnet_traps.py`` pins both halves: the CNN graphs fail
       or compute wrong gradients with shared storage, and the language
       model's split graphs compute what one device does with it.

    And one choice of memory for the graphs that share storage: **the
    planner's plan of fewest bytes.** The planner matches a free chunk to an
    entry within a factor of 16 of its size, in one greedy pass; with
    ``NNVM_AUTO_SEARCH_MATCH_RANGE=1`` (read at every bind) it makes the plan
    for every factor 1, 2, 4, 8, 16 and keeps the smallest. On the language
    model (``--task lm``, two stages) the split's activations and workspace
    went from 25.8 to 24.7 MiB, one device's from 22.3 to 21.1 MiB, so a
    graph on one device is bound with the search too. What a split costs
    over one device, a workspace per device, the copies at the boundary and
    each device's own working arrays, is itemised in docs/pipelining.md.
    The search needs a
    factor of at least 1: with ``NNVM_EXEC_MATCH_RANGE=0`` (storage not
    shared, here or in the caller's environment) the planner makes no plan
    at all and the bind fails (``Cannot find attribute storage_id in the
    graph``), so there the search is off, also when the caller turned it on.

    Args:
        devices: The ``mx.Context`` s of the plan (``group2ctx.values()``).
        symbol: The graph being bound (``None``: as if it had an op of
            :data:`ONEDNN_LAYOUT_OPS`).

    Returns:
        ``{name: value}``; for a graph on one device, the search alone.
    """
    devices = set(devices or ())
    searched = SEARCHED_MEMORY \
        if os.environ.get('NNVM_EXEC_MATCH_RANGE', '16').strip().lstrip('0') else {}
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
    ``array`` in place, whatever layout oneDNN keeps it in.

    **What MXNet does.** Bound for inference (``is_train=False``), oneDNN's
    ``Deconvolution`` reorders its weight array itself into oneDNN's blocked
    layout after its first forward pass, so that later passes need no
    reorder (``MKLDNNDeconvFwd::ControlWeightsFormat``,
    ``src/operator/nn/mkldnn/mkldnn_deconvolution.cc``); a convolution does
    the same unless MXNet's oneDNN subgraph backend fused it (it is, on one
    device). ``array[:] = value`` then fails (``Check failed:
    !IsMKLDNNData(): We can't generate TBlob for MKLDNN data``,
    ``NDArray::SetTBlob``, ``src/ndarray/ndarray.cc``). **What is done
    instead.** An array in the default layout takes ``value`` straight into
    its memory (``array[:] = value``); one in oneDNN's layout, refused so,
    takes a copy (``CopyFromTo``), which reorders the value into the array's
    layout; reading it back (``asnumpy``) gives ``value``. The call returns
    once the copy is done, its temporary array let go: writing a model array
    by array holds at most one temporary at a time.
    """
    try:
        array[:] = value
        return
    except mx.base.MXNetError:  # oneDNN's own layout: SetTBlob's check refused it
        pass
    mx.nd.array(value, ctx=array.context, dtype=array.dtype).copyto(array)
    array.wait_to_read()


def initialized(param):
    """Whether a Gluon ``Parameter`` has values (on some device).

    **What MXNet does.** ``Parameter`` has no public test: ``list_ctx()``
    raises ``RuntimeError`` until ``initialize`` was called (one whose
    initialisation is deferred until its shape is known lists the devices it
    will be made on). **What is done instead.** That ``RuntimeError`` is
    read as "not initialised"."""
    try:
        param.list_ctx()
        return True
    except RuntimeError:
        return False


def reset_variables(block):
    """Forgets the Symbol variables Gluon cached for ``block``'s parameters.

    Gluon makes a parameter's variable once, with the ``mx.AttrScope``
    attributes in force then (``Parameter.var()`` caches it in ``_var``), and
    reuses it in every later trace: a second build of the graph (another
    plan, another stage, the unsplit form) would keep the first build's
    ``ctx_group``. Every trace the library makes is wrapped in this reset
    (:func:`fresh_variables`).
    """
    for param in block.collect_params().values():
        param._var = None  # pylint: disable=protected-access


@contextmanager
def fresh_variables(blocks):
    """Within: ``blocks`` (a block or a list of them) trace with fresh
    parameter variables, made in the scopes in force then; afterwards,
    whatever happens, the variables are forgotten again
    (:func:`reset_variables`), so that no later trace reuses them."""
    blocks = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks]
    for block in blocks:
        reset_variables(block)
    try:
        yield
    finally:
        for block in blocks:
            reset_variables(block)


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


def error_line(err):
    """The informative line of an error. MXNet's messages start with a C++
    stack trace (or a Python one) and end with the check that failed; others
    say it on their first line."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    line = lines[-1] if lines[0].startswith(('Traceback', 'Stack trace')) else lines[0]
    return line[len('MXNetError: '):] if line.startswith('MXNetError: ') else line


class NotSymbolSafe(ValueError):
    """A block whose ``hybrid_forward`` fails when Gluon runs it on Symbols."""


def _failing_block(traceback):
    """The innermost Gluon block whose ``hybrid_forward`` was running on
    Symbols (``F`` is ``mx.sym``) where ``traceback`` ends, and the line of
    its ``hybrid_forward`` running then (``(file, line number)``), or
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
    """``fn``, with an error raised inside a block's ``hybrid_forward`` while
    Gluon traces it as a Symbol made one line naming the block and the call.

    A ``hybrid_forward`` may call what only NDArrays take (GluonCV's GroupNorm
    calls ``x.reshape(0, 0, g, -1)``; GluonNLP's ``StandardRNN`` with dropout
    calls ``nd.Dropout`` on whatever it is given; others read ``x.shape`` or
    call ``asnumpy``): it runs imperatively, but MXNet's symbol creator fails
    deep in its C++ argument parser (``Invalid Parameter format for
    keep_highest expect boolean but value='-1'``), an ``nd`` op asserts
    (``Argument data must have NDArray type, but got <Symbol ...>``) or
    Python raises an ``AttributeError``, naming an operator's arguments and
    not the block. A split needs the Symbol, so such a block cannot be split
    (the imperative twin of a list of blocks still runs it); the error says
    which block and which line of its ``hybrid_forward``.

    Raises:
        NotSymbolSafe: (a ``ValueError``) such an error, with the block's
            name and class, the error's informative line and the call.
    """
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
    """Within: each ``(param, source)`` of ``params`` reads, on ``device``, a
    copy of its value on ``source``, made by ``as_in_context`` (autograd
    records it, so the gradient of every use is summed into that copy); a
    ``(param, source, target)`` reads it on ``target`` instead.

    **What Gluon does.** ``Parameter.data(ctx)`` returns the copy that lives on
    ``ctx`` and refuses any other device; a block's ``forward`` reads its
    parameters on the device of its input. **Why it matters.** A tied weight
    lives on its owner's stage, and another stage's blocks read it on their
    own device. **What is done instead.** For the duration of the stage's
    forward pass the parameter's private lists (``_data``, ``_ctx_list``,
    ``_ctx_map``) name the recorded copy on the reading device; they are put
    back afterwards, whatever happens (the imperative twin's tied weights,
    :mod:`~mp_symbolic.core.twin`; ``tests/test_graphcut.py`` checks their
    gradients sum every use).
    """
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
    """The inputs among ``names`` (variables of ``symbol``, an
    ``mx.sym.Symbol`` or a :class:`~mp_symbolic.core.ir.PlacedGraph`) that
    an Embedding op reads its ids from, directly or through other ops: in a
    bind for training each needs ``grad_req='null'``.

    **What MXNet does.** ``Embedding``'s backward computes no gradient for
    its ids: when one is asked for (``grad_req='write'`` on a variable its ids
    come from, through any ops), the backward pass fails at run time with
    "Embedding layer doesn't support calculate data gradient". **Why it
    matters.** ``balance='time'`` binds each block (each op) alone, its input
    a fresh variable; a language model's first block reads token ids.
    **What is done instead.** Those inputs are bound without a gradient, as
    ``Module`` binds its data (:func:`mp_symbolic.core.balance.time_forward_backward`).
    """
    graph = as_placed(symbol)
    ids = graph.upstream(n.inputs[0] for n in graph.ops if n.op in EMBEDDING_OPS and n.inputs)
    wanted = set(names)
    return {n.name for n in ids if n.is_variable and n.name in wanted}


# The ops whose second input, when given, is a length per row (softmax(data, length,
# use_length=True): GluonNLP's attention masks its scores so).
LENGTH_OPS = frozenset({'softmax'})


def lengths_outside_gradient(placed):
    """``placed`` (a :class:`~mp_symbolic.core.ir.PlacedGraph`) with the
    length each op of :data:`LENGTH_OPS` reads passed through ``BlockGrad``,
    so that no bind asks that op for the length's gradient; ``placed``
    itself when no op reads one. The outputs, arguments and values are the same.

    **What MXNet does.** ``softmax``'s backward with ``use_length=True``
    computes a gradient for the length too (zeros: a length has none) when
    one is asked for, and may write it in place of the length itself
    (``SoftmaxGradOpInplaceOption`` pairs input 2, the length, with output
    1, its gradient, ``src/operator/nn/softmax-inl.h``).
    ``SoftmaxGradCompute`` zeroes that output first, then reads the lengths
    from the same storage: every row's length is 0 and the gradient of the
    scores is zero. The memory planner shares that storage where the length
    is an op's output, not a variable (seen at the backward that runs last
    of the length's readers: the first attention layer after the lengths
    are made). **Why it matters.** The stage runtime asks for the gradient
    of every tensor a stage receives, and GluonNLP's BERT sends its lengths
    (cast to int32 by the first stage) to the attention layers of the next:
    the first of them got no gradient through its queries and keys, nor did
    the layers before it through that attention, and the weights drifted
    from the GPipe graph's. In one graph the lengths come from the data,
    whose gradient no one asks for. **What is done instead.** The length
    goes through ``BlockGrad``: the backward is asked for no gradient of it
    (the received tensor's gradient is zero, as it was).
    """
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
    """``x`` (Symbol or NDArray) with no gradient flowing back through it,
    for the ids that ops turn into an Embedding's input.

    Ids computed by ops (``x - start``, a mask) make MXNet ask the
    Embedding's backward for their gradient whenever ``x`` has one, which it
    refuses (see :func:`embedding_ids`); ``BlockGrad`` (``detach`` on
    NDArrays) stops the gradient before them. Ids have no gradient to give.
    """
    return F.BlockGrad(x, name=name) if F is mx.sym else x.detach()


def read_in_own_group(F, x, name='input'):
    """``x`` read through an ``identity`` op of the group in force when it is
    a variable (a Symbol without children), so that ops of several groups can
    read it: the Symbol-level form of :func:`~mp_symbolic.core.passes.tie_parameters`. Ops, NDArrays
    and other values pass as they are."""
    if F is mx.sym and isinstance(x, mx.sym.Symbol) and x.get_children() is None:
        return F.identity(x, name=name)
    return x


def kvstore_may_update(params):
    """Whether a kvstore may run the optimizer for ``params`` (Gluon
    ``Parameter`` s): only when every one lives on the same devices (data
    parallelism), else each copy is updated where it lives.

    **What MXNet does.** A kvstore that runs the optimizer
    (``update_on_kvstore``) keeps each key's merge buffer, and the optimizer
    state beside it, where its reduction puts them: the ``'device'`` kvstore
    on CPU puts every key's on ``cpu_pinned(0)``, whichever devices the key's
    arrays are on (on GPUs, on the devices of the first key it reduces:
    ``InitBuffersAndComm``, ``src/kvstore/comm.h``). **Why it matters.** A
    pipeline's optimizer state would gather on one device instead of each
    stage's. **What is done instead.** With parameters on different devices
    the kvstore only sums gradients (``Trainer``'s default), as
    :func:`gradient_only_kvstore` makes ``Module`` do.
    """
    params = list(params)
    return all(p.list_ctx() == params[0].list_ctx() for p in params)


def updates_by_device(indices, grads, weights):
    """``[(indices, grads, weights)]``, one per device in order of first
    appearance: the arrays of one call of an ``mx.optimizer.Updater``, split
    so that each call updates one device's arrays.

    **What MXNet does.** The Updater fuses up to
    ``MXNET_OPTIMIZER_AGGREGATION_SIZE`` (4) parameters into one
    ``multi_*_update`` op, grouping them by dtype only. **Why it matters.**
    Handed the parameters of several devices at once (``Module.update`` does
    so), one op runs on one device over another device's weights. **What is
    done instead.** One call per device (``PerDeviceUpdater``, ``Trainer``),
    which keeps the fusion within a device.
    """
    by_device = {}
    for i, g, w in zip(indices, grads, weights):
        by_device.setdefault(w.context, []).append((i, g, w))
    return [tuple(list(part) for part in zip(*items)) for items in by_device.values()]
