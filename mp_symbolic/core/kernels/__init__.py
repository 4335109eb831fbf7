"""Operators of the project's own, in C++ against MXNet 1.9.1's library API,
built on first use and loaded into the process (``mx.library.load``).

``fused_layer_norm(x, gamma, beta, eps)`` (``fused_layer_norm.cc``):
LayerNorm over the last axis of a float32 array, forward and backward each
one pass over a row's values, on CPU. MXNet's own ``LayerNorm`` reduces its
backward through a generic kernel on CPU, and the norm written as matrix
products (``gpt.LayerNorm``'s other form) takes five products a norm; this
op takes 0.28 to 0.38 of the products' time (docs/lm.md).

The library is compiled with the C++ compiler on the path (``$CXX``, else
``g++``) against the ``lib_api.h`` that the ``mxnet`` wheel installs and
``third_party/lib_api.cc`` (apache/mxnet's ``src/lib_api.cc`` at tag 1.9.1),
into the project's cache folder (``$XDG_CACHE_HOME/mp_symbolic``, else
``~/.cache/mp_symbolic``) under a name of the sources' digest, once. Later
processes load what is built.

``MP_SYMBOLIC_FUSED_NORM`` chooses where the language model uses it:
unset (or ``auto``), wherever MXNet is a CPU build and the library builds
and loads, with the norm of matrix products otherwise (and a
``RuntimeWarning`` saying why, once a process); ``0``, never; ``1``,
always, and a one-line error where it cannot be built. A graph holding the
op is read back (checkpoints, the memory estimate's children, export) by
:func:`load_symbol` and :func:`load_symbol_json`, which load the library
first; the export writes MXNet's ``LayerNorm`` in its place
(:func:`with_mxnet_ops`).

``fused_adam_update`` (``fused_adam.cc``): MXNet's ``adam_update`` over all
of one device's float32 parameters in one call, bit for bit (each number
read from its string as MXNet reads it, each element in the same float
arithmetic), with the loops made vector operations. The optimizer's update
(``optim.updater.adam_step``) runs it wherever the library loads, one
``adam_update`` a parameter otherwise: the weights and moments are the same
either way (``MP_SYMBOLIC_FUSED_ADAM=0``: one ``adam_update`` a parameter
anyway). Standard library and MXNet only.

``small_batch_dot(a, b, transpose_a, transpose_b)`` (``small_batch_dot.cc``):
MXNet's ``batch_dot`` for small matrices (attention's: MXNet 1.9.1 calls
BLAS once a batch item, which at those sizes costs more than the product),
each item one product in registers, the loop compiled for AVX-512, AVX2 and
the baseline and chosen as the library loads (:func:`small_batch_dot_kernel`).
Equal to ``batch_dot`` to float32 rounding, not bit for bit.
``MP_SYMBOLIC_SMALL_BATCH_DOT`` chooses where the language model's attention
runs it (:func:`use_small_batch_dot`): unset (or ``0``), never: MXNet's
library API keeps a custom op's outputs for its backward, so the scores
``(N, h, T, T)`` stay alive to the backward pass (5 to 9 % more of the
model's memory, for a step 2 to 4 % faster); ``auto``, wherever the
library loads and its loop is AVX-512's (its AVX2 loop measured level with
``batch_dot``, its baseline loop slower), ``batch_dot`` otherwise (nothing
said: only the speed and float32 rounding differ); ``1``, always, and a
one-line error where it cannot be built. The export writes ``batch_dot``
in its place (:func:`with_mxnet_ops`).

``causal_attention(q, k, v, head_dim, scale)`` (``causal_attention.cc``):
the language model's causal multi-head attention in one op, queries, keys
and values ``(N, T, C)`` to ``(N, T, C)``, each head read in place through
the rows' stride, the scale, the mask and the softmax folded in, the
backward recomputing each head's probabilities (the library API keeps an
op's outputs for its backward: this one's is the result alone). Its loops
and ``small_batch_dot``'s are ``small_kernels.cc``'s. Equal to
:func:`attention_of_mxnet_ops` to float32 rounding.
``MP_SYMBOLIC_FUSED_ATTENTION`` chooses where the language model uses it
(:func:`use_fused_attention`): unset (or ``auto``), wherever MXNet is a CPU
build and the library loads, unless ``MP_SYMBOLIC_SMALL_BATCH_DOT`` asks for
its products between MXNet's other ops; ``0``, never; ``1``, always, and a
one-line error where it cannot be built. The export writes
:func:`attention_of_mxnet_ops`'s nodes in its place (:func:`with_mxnet_ops`).
"""
import hashlib
import os
import shutil
import subprocess
import warnings

import mxnet as mx

from ..base.checks import FUSED_ATTENTION as ATTENTION_ENV, FUSED_NORM as ENV, \
    SMALL_BATCH_DOT as SMALL_ENV, cache_dir
from ..base.checks import fused_adam_switch, fused_attention_switch, fused_norm_switch, \
    small_batch_dot_switch

__all__ = []

HERE = os.path.dirname(os.path.abspath(__file__))
FUSED_LAYER_NORM = 'fused_layer_norm'
FUSED_ADAM = 'fused_adam_update'
SMALL_BATCH_DOT = 'small_batch_dot'
CAUSAL_ATTENTION = 'causal_attention'
SOURCES = tuple(os.path.join(HERE, name) for name in (
    'fused_layer_norm.cc', 'fused_adam.cc', 'small_kernels.cc', 'small_batch_dot.cc',
    'causal_attention.cc', os.path.join('third_party', 'lib_api.cc')))
# the sources' own, in the digest
HEADERS = tuple(os.path.join(HERE, name) for name in ('float32_only.h', 'small_kernels.h'))
LIBRARY = 'libmp_symbolic_ops'
# -fno-math-errno: sqrt without errno's branch, so that loops holding it are
# vector operations (IEEE sqrt: the same results)
FLAGS = ('-shared', '-fPIC', '-std=c++11', '-O3', '-fno-math-errno')
_KEY = 'library'
_LOADED = {}
_SAID = []  # the note that the op is not available, given once a process


class KernelError(RuntimeError):
    """The project's operators were asked for where they cannot be built or
    loaded; the message says why, in one line."""


def library():
    """``(True, path)`` once the project's operators (``fused_layer_norm``,
    ``fused_adam_update``, ``small_batch_dot``, ``causal_attention``) are
    operators of this process (``mx.sym.fused_layer_norm``,
    ``mx.nd.fused_layer_norm``, ...), else ``(False, why)``: no compiler, no
    header, the build or the load failing, in one line. Built once a cache,
    loaded once a process."""
    if _KEY not in _LOADED:
        _LOADED[_KEY] = _build_and_load()
    return _LOADED[_KEY]


def fused_layer_norm():
    """:func:`library`: ``(True, path)`` where ``fused_layer_norm`` is an
    operator of this process, else ``(False, why)``."""
    return library()


def _choice(switch):
    """``switch()``'s value (:mod:`mp_symbolic.core.base.checks`), a bad one
    a :class:`KernelError` of its one line."""
    try:
        return switch()
    except ValueError as err:
        raise KernelError(str(err)) from None


def small_batch_dot_kernel():
    """The loop ``small_batch_dot`` runs on this CPU (``'avx512'``,
    ``'avx2'`` or ``'baseline'``), or ``None`` where the library does not
    load (:func:`library`)."""
    loaded, path = library()
    if not loaded:
        return None
    if 'kernel' not in _LOADED:  # chosen once, as the library loaded
        import ctypes  # pylint: disable=import-outside-toplevel
        name = ctypes.CDLL(path).small_batch_dot_kernel
        name.restype = ctypes.c_char_p
        _LOADED['kernel'] = name().decode('ascii')
    return _LOADED['kernel']


def use_small_batch_dot():
    """Whether the language model's attention runs ``small_batch_dot`` here
    (``MP_SYMBOLIC_SMALL_BATCH_DOT``: unset or ``0``, never; ``auto``, where
    the library loads and its loop is AVX-512's; ``1``, always,
    :class:`KernelError` where it cannot be built)."""
    choice = _choice(small_batch_dot_switch)
    if choice == '0':
        return False
    loaded, why = library()
    if choice == '1':
        if not loaded:
            raise KernelError('%s=1: the %s op is not available: %s'
                              % (SMALL_ENV, SMALL_BATCH_DOT, why))
        return True
    return loaded and small_batch_dot_kernel() == 'avx512'


def use_fused_attention():
    """Whether the language model's attention is the ``causal_attention`` op
    here (``MP_SYMBOLIC_FUSED_ATTENTION``: unset or ``auto``, wherever MXNet
    is a CPU build and the library loads, unless ``MP_SYMBOLIC_SMALL_BATCH_DOT``
    asks for MXNet's softmax between ``small_batch_dot`` products; ``0``,
    never; ``1``, always, :class:`KernelError` where it cannot be built or
    where ``MP_SYMBOLIC_SMALL_BATCH_DOT=1`` asks for the other)."""
    choice, products = _choice(fused_attention_switch), _choice(small_batch_dot_switch)
    if choice == '0':
        return False
    if choice == '1' and products == '1':
        raise KernelError('%s=1 and %s=1: the attention is one op or MXNet\'s softmax between '
                          'two small_batch_dot products, not both; unset one'
                          % (ATTENTION_ENV, SMALL_ENV))
    if choice == 'auto' and (products != '0' or mx.runtime.Features().is_enabled('CUDA')):
        return False  # the products asked for; or a GPU build (the op runs on CPU only)
    loaded, why = library()
    if choice == '1' and not loaded:
        raise KernelError('%s=1: the %s op is not available: %s'
                          % (ATTENTION_ENV, CAUSAL_ATTENTION, why))
    return loaded


def use_fused_norm():
    """Whether the language model's norm is the fused op here
    (``MP_SYMBOLIC_FUSED_NORM``: unset or ``auto``, ``0`` or ``1``)."""
    choice = _choice(fused_norm_switch)
    if choice == '0':
        return False
    if choice == 'auto' and mx.runtime.Features().is_enabled('CUDA'):
        return False  # the op runs on CPU only; a GPU build keeps the products
    loaded, why = fused_layer_norm()
    if not loaded and choice == '1':
        raise KernelError('%s=1: the fused LayerNorm op is not available: %s' % (ENV, why))
    if not loaded and not _SAID:  # once a process: the norm runs, at a third of its speed
        _SAID.append(why)
        warnings.warn('the fused LayerNorm op is not available (%s): the norm runs as matrix '
                      'products, about 3 times slower; %s=0 chooses them without this note'
                      % (why, ENV), RuntimeWarning, stacklevel=2)
    return loaded


def use_fused_adam():
    """Whether Adam's update runs as ``fused_adam_update`` here
    (``MP_SYMBOLIC_FUSED_ADAM``: unset or ``auto``, wherever the library
    loads; ``0``, never): the same results either way."""
    choice = _choice(fused_adam_switch)
    return choice == 'auto' and library()[0]


# the project's operators a graph may hold (fused_adam_update is an update, in no graph)
IN_GRAPHS = (FUSED_LAYER_NORM, SMALL_BATCH_DOT, CAUSAL_ATTENTION)


def _held(text):
    """The project's operators graph JSON ``text`` holds: each node's
    ``"op"`` read from the parsed graph, not matched in the text (which is
    parsed only where one of their names is in it)."""
    if not any(name in text for name in IN_GRAPHS):
        return []
    import json  # pylint: disable=import-outside-toplevel
    try:
        nodes = json.loads(text).get('nodes', [])
    except (ValueError, AttributeError):
        return []  # not a graph: mx.sym.load_json says so
    ops = {node.get('op') for node in nodes if isinstance(node, dict)}
    return [name for name in IN_GRAPHS if name in ops]


def _ensure_for(text, where):
    held = _held(text)
    if held:
        loaded, why = library()
        if not loaded:
            raise KernelError('%s holds the %s op, which cannot be loaded here: %s'
                              % (where, ' and '.join(held), why))


def load_symbol_json(text, where='the graph'):
    """``mx.sym.load_json(text)``, with the project's operators loaded first
    where the graph holds them (:class:`KernelError` where they cannot be)."""
    _ensure_for(text, where)
    return mx.sym.load_json(text)


def load_symbol(path):
    """``mx.sym.load(path)`` (the file read once), with the project's operators
    loaded first where the graph holds them."""
    with open(path, encoding='utf-8') as f:
        return load_symbol_json(f.read(), path)


def as_inputs(F, *arrays):
    """``arrays`` as inputs of one of the project's operators, each through
    an ``identity``: MXNet hands a library's op no write request, so its
    gradients always overwrite; through an identity each input's gradient
    reaches its array by the identity's backward, which adds where
    ``grad_req='add'`` (micro-batches) and runs in place (no copy) where it
    writes."""
    return [F.identity(a) for a in arrays]


def attention_of_mxnet_ops(F, q, k, v, head_dim, product='batch_dot', scale=None):
    """``causal_attention(q, k, v, head_dim, scale)`` in MXNet's ops (``F``:
    ``mx.sym`` or ``mx.nd``): queries, keys and values ``(N, T, h D)`` ->
    ``(N, T, h D)``, the heads transposed to ``(N, h, T, D)``, the scores by
    ``product`` (``batch_dot``, or ``small_batch_dot`` where the library
    loads), the mask added, ``softmax``, and the product with the values. The
    language model's attention where the op is not chosen, and the export's
    form of the op."""
    scale = head_dim ** -0.5 if scale is None else scale

    def heads(x):  # (N, T, h D) -> (N, T, h, D) -> (N, h, T, D); 0 copies a dimension
        return F.transpose(F.reshape(x, shape=(0, 0, -1, head_dim)), axes=(0, 2, 1, 3))

    steps = F.contrib.arange_like(F.BlockGrad(q), axis=1)                # (T,)
    # the scale on the queries (N, T, h D), a quarter of the scores' size at D = T / 4
    q, k, v = (heads(part) for part in (q * scale, k, v))
    multiply = getattr(F, product)
    scores = multiply(q, k, transpose_b=True)                            # (N, h, T, T)
    future = F.broadcast_greater(F.reshape(steps, shape=(1, -1)),        # (T, T): key after query
                                 F.reshape(steps, shape=(-1, 1)))
    # the mask spread over the scores' N h rows outside the gradient, by one
    # product of a column of ones with the (T T) mask (one pass, where a
    # zeros_like and a broadcast_add take two), then added elementwise: the
    # backward pass passes the scores' gradient through, where
    # broadcast_add's backward runs MXNet's slow reduction
    fixed = F.BlockGrad(scores)
    batch, each_head = (F.ones_like(F.contrib.arange_like(fixed, axis=axis)) for axis in (0, 1))
    rows = F.reshape(F.dot(F.reshape(batch, shape=(-1, 1)), F.reshape(each_head, shape=(1, -1))),
                     shape=(-1, 1))                                          # (N h, 1) ones
    mask = F.BlockGrad(F.reshape_like(
        F.dot(rows, F.reshape(future * -1e9, shape=(1, -1))), scores))      # (N, h, T, T)
    attention = F.softmax(scores + mask, axis=-1)
    out = multiply(attention, v)                                         # (N, h, T, D)
    return F.reshape(F.transpose(out, axes=(0, 2, 1, 3)), shape=(0, 0, -1))  # (N, T, h D)


def _attention_nodes(node):
    """The nodes of ``causal_attention`` node ``node`` in MXNet's ops
    (:func:`attention_of_mxnet_ops`), named from its name: a
    :class:`~mp_symbolic.core.graph.ir.PlacedGraph` whose variables are
    named ``<name>_q``, ``_k`` and ``_v``."""
    from ..graph.ir import PlacedGraph  # pylint: disable=import-outside-toplevel
    scale = node.attrs.get('scale')
    inputs = [mx.sym.var('%s_%s' % (node.name, part)) for part in 'qkv']
    with mx.name.Prefix(node.name + '_'):
        symbol = attention_of_mxnet_ops(
            mx.sym, *inputs, head_dim=int(node.attrs['head_dim']),
            scale=None if scale in (None, '', 'None') else float(scale))
    return PlacedGraph.from_symbol(symbol)


def with_mxnet_ops(graph):
    """The :class:`~mp_symbolic.core.graph.ir.PlacedGraph` ``graph`` with each
    ``fused_layer_norm`` node made MXNet's ``LayerNorm`` over the last axis,
    each ``small_batch_dot`` node MXNet's ``batch_dot`` (the same
    attributes) and each ``causal_attention`` node the ops of
    :func:`attention_of_mxnet_ops`, named from it: the same names, inputs,
    groups and other attributes (for a runtime without the project's
    library: symbol/params files and ONNX); ``graph`` itself where it holds
    none. The results agree to float32 rounding."""
    if not any(node.op in IN_GRAPHS for node in graph.nodes):
        return graph

    def mxnets(node):
        if node.op == FUSED_LAYER_NORM:
            return node.but(op='LayerNorm', attrs=dict(
                node.attrs, eps=node.attrs.get('eps', '1e-05'), axis='-1'))
        if node.op == SMALL_BATCH_DOT:
            return node.but(op='batch_dot')
        return node
    nodes, at = [], {}  # at: old index -> the new entry of its output 0 (node, output)

    def entry(e):
        new, output = at[e.node]
        return (new, output + e.output, e.version)
    for node in graph.nodes:
        if node.op != CAUSAL_ATTENTION:
            at[node.index] = (len(nodes), 0)
            nodes.append(mxnets(node).but(index=len(nodes),
                                          inputs=[entry(e) for e in node.inputs]))
            continue
        inner = _attention_nodes(node)
        inner_at = {}
        for part in inner.nodes:
            if part.is_variable:  # one of the op's inputs: q, k or v
                inner_at[part.index] = entry(node.inputs['qkv'.index(part.name[-1])])
                continue
            inner_at[part.index] = (len(nodes), 0, 0)
            nodes.append(part.but(index=len(nodes), group=node.group, layer=node.layer,
                                  block=node.block, inputs=[
                                      (inner_at[e.node][0], inner_at[e.node][1] + e.output,
                                       e.version) for e in part.inputs]))
        head = inner.heads[0]
        at[node.index] = (inner_at[head.node][0], inner_at[head.node][1] + head.output)
    return graph.but(nodes=nodes, heads=[entry(h) for h in graph.heads])


def _build_and_load():
    compiler = os.environ.get('CXX') or shutil.which('g++')
    if not compiler:
        return False, 'no C++ compiler (g++, or $CXX) on the path'
    include = os.path.join(os.path.dirname(mx.__file__), 'include')
    header = os.path.join(include, 'mxnet', 'lib_api.h')
    if not os.path.isfile(header):
        return False, 'the mxnet wheel has no include/mxnet/lib_api.h'
    digest = hashlib.sha256(' '.join((compiler,) + FLAGS).encode('utf-8'))
    for path in SOURCES + HEADERS + (header,):
        with open(path, 'rb') as f:
            digest.update(f.read())
    directory = cache_dir()
    path = os.path.join(directory, '%s-%s.so' % (LIBRARY, digest.hexdigest()[:16]))
    if not os.path.isfile(path):
        building = '%s.%d' % (path, os.getpid())
        try:
            os.makedirs(directory, exist_ok=True)
            result = subprocess.run([compiler, *FLAGS, *SOURCES,
                                     '-I', include, '-o', building],
                                    capture_output=True, text=True, check=False)
        except OSError as err:
            return False, 'building in %s failed: %s' % (directory, err.strerror or err)
        if result.returncode:
            if os.path.exists(building):  # a compiler that failed part-way
                os.remove(building)
            lines = (result.stderr or result.stdout).strip().splitlines() or ['no output']
            return False, 'building %s failed: %s' % (os.path.basename(path), lines[0])
        os.replace(building, path)  # whole, or not there: another process may be building it
    try:
        mx.library.load(path, verbose=False)
    except mx.base.MXNetError as err:
        lines = str(err).strip().splitlines() or ['no message']
        return False, 'loading %s failed: %s' % (os.path.basename(path), lines[0])
    return True, path
