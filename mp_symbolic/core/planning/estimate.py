"""Memory per device before anything is allocated: the table of
:func:`mp_symbolic.tools.memory.memory_table`, estimated from shapes and
MXNet 1.9.1's own memory planning (docs/planning.md).

The arrays' rows come from their shapes on their ``ctx_group``'s device.
``other``: each training graph is bound in a child process on arrays never
allocated, the graph MXNet plans is read from its log, ``MXPlanMemory`` is
replayed on it (:func:`plan_storage`), and what the plan does not hold is
added (:func:`activations`, :func:`temp_space`). Nothing of the model is
allocated but the head gradients MXNet makes at bind.
"""
import json
import os
import re
import subprocess
import sys

import mxnet as mx
from mxnet.ndarray.ndarray import NDArray, _new_alloc_handle
import numpy as np

from .. import kernels
from ..base.checks import is_int, positive_int
from ..base.compat import split_bind_environ
from ..graph.heads import labels_of
from ..graph.names import GROUP_ATTR

__all__ = []

# Optimizer states per trained parameter, each of the parameter's size
# (MXNet 1.9.1's create_state): SGD keeps one with momentum, none without.
STATES = {'sgd': lambda p: 1 if p.get('momentum', 0) else 0, 'nag': lambda p: 1,
          'adam': lambda p: 2, 'adamw': lambda p: 2, 'lamb': lambda p: 2,
          'rmsprop': lambda p: 3 if p.get('centered') else 1, 'adagrad': lambda p: 1,
          'adadelta': lambda p: 2, 'ftrl': lambda p: 2, 'signum': lambda p: 1,
          'ftml': lambda p: 3, 'lbsgd': lambda p: 1 if p.get('momentum', 0) else 0,
          'dcasgd': lambda p: 2 if p.get('momentum', 0) else 1, 'nadam': lambda p: 2,
          'adamax': lambda p: 2, 'sgld': lambda p: 0, 'test': lambda p: 1}

_UNARY = ((0, 0),)
_BINARY = ((0, 0), (1, 0))
# op -> (FInplaceOption pairs (input, output), FInplaceIdentity per pair,
# FIgnoreInputs), as src/operator registers them in MXNet 1.9.1 (CPU, oneDNN).
# An op not listed has none of the three.
INPLACE = {}


def _register(ops, pairs, identity=None, ignore=()):
    for op in ops.split():
        INPLACE[op] = (tuple(pairs), tuple(identity or (False,) * len(pairs)), tuple(ignore))


_register('Activation _backward_Activation LeakyReLU _backward_LeakyReLU Dropout '
          '_backward_Dropout SoftmaxOutput _backward_SoftmaxOutput softmax log_softmax '
          'LinearRegressionOutput LogisticRegressionOutput MAERegressionOutput '
          'LayerNorm add_n ElementWiseSum relu sigmoid tanh exp log negative reciprocal '
          'square sqrt rsqrt abs sign erf gelu softsign _plus_scalar _minus_scalar '
          '_rminus_scalar _mul_scalar _div_scalar _rdiv_scalar _power_scalar '
          '_backward_mul_scalar _backward_div_scalar _maximum_scalar _minimum_scalar '
          '_equal_scalar _not_equal_scalar _greater_scalar _lesser_scalar clip '
          'make_loss MakeLoss', _UNARY)
_register('_backward_linear_reg_out _backward_logistic_reg_out _backward_mae_reg_out '
          'elemwise_add elemwise_sub elemwise_mul elemwise_div _grad_add _add _plus _sub '
          '_minus _mul _div _Plus _Minus _Mul _Div _mod broadcast_add broadcast_sub '
          'broadcast_mul broadcast_div broadcast_plus broadcast_minus broadcast_greater '
          'broadcast_lesser broadcast_equal broadcast_maximum broadcast_minimum '
          'broadcast_power _backward_reciprocal _backward_square _backward_sqrt '
          '_backward_rsqrt _backward_sigmoid _backward_tanh _backward_relu _backward_exp '
          '_backward_log _backward_erf _backward_softsign _backward_rdiv_scalar', _BINARY)
_register('_backward_FullyConnected', ((1, 0),))
_register('_backward_add _backward_sub', ((0, 0), (0, 1)))
_register('_backward_mul', ((0, 1),))
_register('_backward_softmax _backward_log_softmax', ((0, 0), (1, 0)))
_register('_copy identity _backward_copy _backward_reshape Reshape reshape Flatten flatten '
          'expand_dims BlockGrad stop_gradient Cast cast _backward_cast', _UNARY, (True,))
_register('_identity_with_attr_like_rhs reshape_like', _UNARY, (True,), ignore=(1,))
_register('zeros_like ones_like _contrib_arange_like', (), ignore=(0,))
_register('_backward_Pooling', ((1, 0),))  # oneDNN pooling with a workspace output

# Ops that leave an output nothing reads unwritten (MXNet asks kNullOp of it):
# oneDNN's convolution and dense backward passes, a first layer's data
# gradient; oneDNN's dense layer, a recomputed copy of a mirrored graph's
# last layer whose output nothing reads (it writes into its temporary
# memory). Other ops' outputs are allocated when the op runs, read or not
# (the executor takes each output's data for an op without oneDNN's kernels).
UNWRITTEN = frozenset(('_backward_Convolution', '_backward_Deconvolution',
                       '_backward_FullyConnected', 'FullyConnected'))

_CONTROL = ' control deps'  # a key no attribute has: the node's control dependencies, by name
_LOG_NODE = re.compile(r'node (\d+) (\S+)\s*$')
_LOG_ENTRY = re.compile(r'(input|output) (\d+): \[([^\]]*)\]')


class PlannedGraph:
    """A training graph as MXNet's executor plans it (:func:`planned_graph`).

    Attributes:
        nodes: ``[{'op': name or None (a variable), 'name', 'attrs', 'inputs':
            [entry], 'outputs': [entry], 'device': str(ctx)}]``, in MXNet's order.
        shapes: ``{entry: shape}``.
        external, added: The entries MXNet writes into arrays it was given (the
            arguments' gradients), and those it adds to them (``grad_req='add'``).
        outputs: The forward outputs' entries, in order.
        env: The bind's ``NNVM_EXEC_MATCH_RANGE`` and ``NNVM_AUTO_SEARCH_MATCH_RANGE``.
        total_mib: MXNet's own total of its plan in whole MiB (``debug_str``).
    """

    def __init__(self, nodes, shapes, external, outputs, env, total_mib=None):
        self.nodes, self.shapes = nodes, shapes
        self.external, self.outputs, self.env = external, outputs, env
        self.total_mib = total_mib
        self.added = set()


def _lazy(shape, ctx, dtype):
    """An NDArray of ``shape`` whose storage is never allocated unless written."""
    return NDArray(_new_alloc_handle(tuple(shape), ctx, True, np.dtype(dtype)))


BIND_TIMEOUT = 600  # seconds for the child's bind of one graph (it allocates nothing)
# The children's program up to the function they run: MXNet loaded as the
# commands load it, without scikit-learn (tools/startup.py); they only bind.
_CHILD = ('from mp_symbolic.tools.startup import mxnet_without_sklearn; mxnet_without_sklearn(); '
          'from mp_symbolic.core.planning.estimate import ')


def _array_spec(array):
    return [list(array.shape), [array.context.device_type, array.context.device_id],
            np.dtype(array.dtype).name]


def _logged_bind(symbol, context, args, grads, aux, group2ctx, env):
    """The planner's log and ``debug_str()`` of ``symbol`` bound on arrays never
    allocated, in a child process: MXNet reads ``MXNET_MEM_PLAN_VERBOSE_LOGGING``
    once per process, at its first bind.

    Raises:
        RuntimeError: the child failed (its last line).
    """
    def ctx(c):
        return [c.device_type, c.device_id]
    request = {'symbol': symbol.tojson(), 'context': ctx(context),
               'args': {n: _array_spec(a) for n, a in args.items()},
               'grads': {n: _array_spec(a) for n, a in grads.items()},
               'aux': {n: _array_spec(a) for n, a in aux.items()},
               'group2ctx': {g: ctx(c) for g, c in group2ctx.items()}}
    if _SERVER:
        return _SERVER[-1].bind(request, env)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env = dict(os.environ, MXNET_MEM_PLAN_VERBOSE_LOGGING='1', **env)
    child_env['PYTHONPATH'] = os.pathsep.join(
        [root] + [p for p in [os.environ.get('PYTHONPATH')] if p])
    try:
        done = subprocess.run([sys.executable, '-c', _CHILD + '_bind_in_child; _bind_in_child()'],
                              input=json.dumps(request), capture_output=True, text=True,
                              env=child_env, check=False, timeout=BIND_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise RuntimeError('planned graph: expected the child that binds the graph to end '
                           'within %d s, found it still running: stopped' % BIND_TIMEOUT) from None
    if done.returncode != 0:
        raise RuntimeError('planned graph: the child that binds the graph failed: %s'
                           % (done.stderr.strip().splitlines() or ['exit %d' % done.returncode])[-1])
    return [line for line in done.stderr.splitlines() if line.strip()], done.stdout


def _bind_in_child():
    """:func:`_logged_bind`'s child: the request on stdin, ``debug_str()`` on
    stdout, the planner's log on stderr."""
    executor = _bound(json.load(sys.stdin))
    sys.stdout.write(executor.debug_str())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # pylint: disable=protected-access  # nothing to finalise: skip the collection


_SERVER = []  # the child of the innermost :func:`batched_binds`, while it is open


class batched_binds:  # pylint: disable=invalid-name
    """A context in which every :func:`planned_graph` of this thread binds in one
    child process kept for the context, rather than one child per graph (the
    planner's candidates). Each graph is bound as :func:`_logged_bind` binds
    it, its environment set for its bind only.

    Raises:
        RuntimeError: (at a bind) the child failed or died (its last line).
    """

    def __init__(self):
        self._child = None
        self._folder = None

    def __enter__(self):
        import tempfile  # pylint: disable=import-outside-toplevel
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        child_env = dict(os.environ, MXNET_MEM_PLAN_VERBOSE_LOGGING='1')
        child_env['PYTHONPATH'] = os.pathsep.join(
            [root] + [p for p in [os.environ.get('PYTHONPATH')] if p])
        self._folder = tempfile.mkdtemp(prefix='mp-estimate-')
        self._child = subprocess.Popen(
            [sys.executable, '-c', _CHILD + '_serve_binds; _serve_binds()'],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(os.path.join(self._folder, 'stderr'), 'w'), text=True, env=child_env)
        _SERVER.append(self)
        return self

    def __exit__(self, *exc):
        import shutil  # pylint: disable=import-outside-toplevel
        _SERVER.remove(self)
        try:
            self._child.stdin.close()
            self._child.wait(timeout=BIND_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired):
            self._child.kill()
            self._child.wait()
        self._child.stdout.close()
        shutil.rmtree(self._folder, ignore_errors=True)
        return False

    def bind(self, request, env):
        """``(log lines, debug_str)`` of ``request`` bound in the child
        under ``env`` (:func:`_logged_bind`'s)."""
        log = os.path.join(self._folder, 'log')
        text = os.path.join(self._folder, 'debug')
        line = json.dumps(dict(request, env=dict(env), log=log, debug=text))
        try:
            self._child.stdin.write(line + '\n')
            self._child.stdin.flush()
            answer = self._child.stdout.readline().strip()
        except OSError:
            answer = ''
        if answer != 'ok':
            with open(os.path.join(self._folder, 'stderr')) as err:
                lines = err.read().strip().splitlines()
            raise RuntimeError('planned graph: the child that binds the graphs failed: %s'
                               % (answer[len('error: '):] if answer.startswith('error: ')
                                  else (lines or ['it ended'])[-1]))
        with open(log) as lines, open(text) as debug:
            return [line for line in lines.read().splitlines() if line.strip()], debug.read()


def _serve_binds():
    """:class:`batched_binds`' child: one request a line on stdin, its log and
    ``debug_str()`` into the request's files, then ``ok`` or ``error: <line>``
    on stdout."""
    import gc  # pylint: disable=import-outside-toplevel
    saved = os.dup(2)
    for line in sys.stdin:
        request = json.loads(line)
        env = request.pop('env')
        before = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            with open(request['log'], 'w') as log:
                sys.stderr.flush()
                os.dup2(log.fileno(), 2)
                try:
                    executor = _bound(request)
                    sys.stderr.flush()
                finally:
                    os.dup2(saved, 2)
            with open(request['debug'], 'w') as debug:
                debug.write(executor.debug_str())
            del executor
            gc.collect()
            answer = 'ok'
        except Exception as err:  # pylint: disable=broad-except
            answer = 'error: %s' % (str(err).strip().splitlines() or [type(err).__name__])[0]
        for key, value in before.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
        sys.stdout.write(answer + '\n')
        sys.stdout.flush()
    os._exit(0)  # pylint: disable=protected-access


def _bound(request):
    """The executor of a request of :func:`_logged_bind`, its arrays never allocated."""
    def ctx(spec):
        return mx.Context(*spec)

    def arrays(specs):
        return {n: _lazy(shape, ctx(c), dtype) for n, (shape, c, dtype) in specs.items()}
    symbol = kernels.load_symbol_json(request['symbol'])
    args, grads, aux = (arrays(request[k]) for k in ('args', 'grads', 'aux'))
    group2ctx = {g: ctx(c) for g, c in request['group2ctx'].items()}
    return symbol.bind(ctx(request['context']), args, args_grad=grads or None,
                       grad_req={n: 'write' if n in grads else 'null' for n in args},
                       aux_states=aux, group2ctx=group2ctx or None)


def _parse_log(lines):
    """MXNET_MEM_PLAN_VERBOSE_LOGGING's lines -> ``[(op or None, inputs, outputs)]``, shapes."""
    nodes, shapes = [], {}
    for line in lines:
        match = _LOG_NODE.search(line)
        if match:
            nodes.append([None if match.group(2) == 'var' else match.group(2), [], []])
            continue
        match = _LOG_ENTRY.search(line)
        if match and nodes:
            entry = int(match.group(2))
            dims = match.group(3).strip()
            shapes[entry] = tuple(int(d) for d in dims.split(',')) if dims else ()
            nodes[-1][1 if match.group(1) == 'input' else 2].append(entry)
    return nodes, shapes


def _parse_debug(text):
    """``Executor.debug_str()`` -> its outputs ``[(name, index)]`` and its nodes
    ``[(op or None, name, attrs)]`` in the same order as the planner's log,
    and the planner's total in MiB (``storage_allocated_bytes >> 20``)."""
    outputs, nodes = [], []
    current, total = None, None
    section = None
    for line in text.splitlines():
        if line.startswith('\toutput['):
            name, index = re.match(r'\toutput\[\d+\]=(.*)\((\d+)\)$', line).groups()
            outputs.append((name, int(index)))
        elif line.startswith('Variable:'):
            nodes.append((None, line[len('Variable:'):], {}))
            current = None
        elif line.startswith('Op:') or line.startswith('SubgraphOp:'):
            op, name = re.match(r'(?:Subgraph)?Op:([^,]*), Name=(.*)$', line).groups()
            current = (op, name, {})
            nodes.append(current)
            section = None
        elif line in ('Inputs:', 'Attrs:', 'Control deps:'):
            section = line
        elif current is not None and section == 'Attrs:' and line.startswith('\t'):
            key, _, value = line[1:].partition('=')
            current[2][key] = value
        elif current is not None and section == 'Control deps:' and line.startswith('\tcdep['):
            current[2].setdefault(_CONTROL, []).append(line.split('=', 1)[1])
        elif line.startswith('Total ') and line.endswith(' MB allocated'):
            total = int(line.split()[1])
    return outputs, nodes, total


def planned_graph(symbol, shapes, group2ctx=None, context=mx.cpu(0), dtypes=None,
                  grad_names=None, env=None, added=()):
    """``symbol``'s training graph as MXNet's executor plans it, nothing allocated.

    Args:
        symbol: The training graph, loss heads included.
        shapes: ``{input name: shape}`` of its inputs and labels.
        group2ctx, context: ``{ctx_group: mx.Context}`` (default none), and the
            bind's default context.
        dtypes: ``{name: dtype}`` of inputs not float32.
        grad_names: The arguments with a gradient; default: those not in ``shapes``.
        env: The environment of the bind; default: a split bind's
            (:func:`~mp_symbolic.core.base.compat.split_bind_environ`).
        added: The arguments whose gradient is added to its array.

    Returns:
        A :class:`PlannedGraph`.

    Raises:
        ValueError: the shapes do not fit the graph (MXNet's message, one line).
    """
    group2ctx = dict(group2ctx or {})
    try:
        arg_shapes, _, aux_shapes = symbol.infer_shape(**shapes)
        arg_types, _, aux_types = symbol.infer_type(**{n: np.dtype((dtypes or {}).get(
            n, 'float32')).name for n in shapes})
    except mx.base.MXNetError as err:
        raise ValueError('shapes: expected shapes the graph takes, found %s: %s'
                         % (shapes, str(err).strip().splitlines()[0])) from None
    if arg_shapes is None:
        raise ValueError('shapes: expected every input of the graph, found %s'
                         % sorted(shapes))
    attrs = symbol.attr_dict()

    def device(name):
        return group2ctx.get(attrs.get(name, {}).get(GROUP_ATTR), context)

    names = symbol.list_arguments()
    if grad_names is None:
        grad_names = [n for n in names if n not in shapes]
    grad_names = set(grad_names)
    args = {n: _lazy(s, device(n), t) for n, s, t in zip(names, arg_shapes, arg_types)}
    grads = {n: _lazy(s, device(n), t) for n, s, t in zip(names, arg_shapes, arg_types)
             if n in grad_names}
    aux = {n: _lazy(s, device(n), t) for n, s, t in
           zip(symbol.list_auxiliary_states(), aux_shapes, aux_types)}
    if env is None:
        env = split_bind_environ(group2ctx.values(), symbol)
    lines, text = _logged_bind(symbol, context, args, grads, aux, group2ctx, dict(env))
    logged, entry_shapes = _parse_log(lines)
    outputs, printed, total_mib = _parse_debug(text)
    if len(logged) != len(printed) or any(a[0] != b[0] for a, b in zip(logged, printed)):
        raise RuntimeError('planned graph: expected the executor\'s log and its debug_str '
                           'to list the same nodes, found %d and %d' % (len(logged), len(printed)))
    nodes = []
    entry = 0
    for (op, inputs, outs), (_, name, node_attrs) in zip(logged, printed):
        if op is None:
            outs = [entry]
        entry += len(outs)
        nodes.append({'op': op, 'name': name, 'attrs': node_attrs, 'inputs': inputs,
                      'outputs': outs})
    _place(nodes, attrs, group2ctx, context, {n: str(a.context) for n, a in
                                              list(args.items()) + list(aux.items())})
    by_name = {}
    for node in nodes:
        by_name.setdefault(node['name'], []).append(node)
    # outputs by name, in order: where several nodes share a name (MXNet names
    # every gradient sum 'sum_grad'), the first not taken that nothing reads
    # (the depth-first order visits each output's own nodes in output order)
    consumed = {e for node in nodes for e in node['inputs']}
    located = []
    for name, index in outputs:
        candidates = [n['outputs'][index] for n in by_name.get(name, [])
                      if len(n['outputs']) > index]
        free = [e for e in candidates if e not in consumed and e not in located]
        located.append((free or candidates)[0])
    num_forward = len(symbol.list_outputs())
    match = {'NNVM_EXEC_MATCH_RANGE': env.get('NNVM_EXEC_MATCH_RANGE', '16'),
             'NNVM_AUTO_SEARCH_MATCH_RANGE': env.get('NNVM_AUTO_SEARCH_MATCH_RANGE', '0')}
    graph = PlannedGraph(nodes, entry_shapes, set(located[num_forward:]), located[:num_forward],
                         match, total_mib)
    order = [n for n in names if n in grads]  # the gradients' outputs follow the forward's
    graph.added = {e for n, e in zip(order, located[num_forward:]) if n in set(added)}
    return graph


def _place(nodes, attrs, group2ctx, context, arrays):
    """Each node's device as ``AssignContext`` and nnvm's ``PlaceDevice`` give it:
    a variable its array's, a node of a ``ctx_group`` its group's, a backward
    node its forward node's, another its first placed input's, else a
    reader's, else ``context``."""
    producer = {}
    for k, node in enumerate(nodes):
        for e in node['outputs']:
            producer[e] = k
    consumers = {}
    for k, node in enumerate(nodes):
        for e in node['inputs']:
            consumers.setdefault(producer.get(e), []).append(k)
    device = [None] * len(nodes)
    last_named = {}
    for k, node in enumerate(nodes):
        group = node['attrs'].get(GROUP_ATTR)
        forward = [last_named.get(n) for n in node['attrs'].get(_CONTROL, ())]
        last_named[node['name']] = k
        if node['op'] is None:
            device[k] = arrays.get(node['name'])
            if device[k] is None and group in group2ctx:
                device[k] = str(group2ctx[group])
        elif node['op'] == '_CrossDeviceCopy':
            continue
        elif group in group2ctx:
            device[k] = str(group2ctx[group])
        elif node['op'].startswith('_backward') and forward and forward[0] is not None:
            device[k] = device[forward[0]]  # a backward node runs where its forward node did
        else:  # the copies came after placement: an input is read where it was made
            for e in node['inputs']:
                source = producer.get(e)
                while source is not None and nodes[source]['op'] == '_CrossDeviceCopy':
                    source = producer.get(nodes[source]['inputs'][0])
                if source is not None and device[source] is not None:
                    device[k] = device[source]
                    break
    for k in range(len(nodes) - 1, -1, -1):
        if device[k] is None:
            for c in consumers.get(k, []):
                if device[c] is not None:
                    device[k] = device[c]
                    break
    for k, node in enumerate(nodes):
        node['device'] = device[k] or str(context)


def _nbytes(shape, itemsize=4):
    return int(np.prod(shape, dtype=np.int64)) * itemsize if shape is not None else 0


def _allocate(graph, match_range):
    """One pass of ``MXAllocMemory``: ``(storage id per entry, [(device, bytes)]
    per storage id, total)``; a chunk never written has 0 bytes, but counts in
    the total as in MXNet's."""
    nodes, shapes = graph.nodes, graph.shapes
    ref = {}
    for node in nodes:
        if node['op'] is None:
            continue
        ignore = INPLACE.get(node['op'], ((), (), ()))[2]
        for i, e in enumerate(node['inputs']):
            if i not in ignore:
                ref[e] = ref.get(e, 0) + 1
    for e in graph.outputs:
        ref[e] = ref.get(e, 0) + 1
    storage = {e: -2 for e in graph.external}  # kExternalStorageID
    chunks = []  # [device, max_bytes, released_by]
    free = []  # [(bytes, order, id)]: a multimap by size
    counts = {}
    untouched = set()
    order = [0]

    def request(device, size):
        if size == 0:
            return -1
        if match_range:
            lo, hi = size // match_range, size * match_range
            candidates = sorted(free)
            above = [c for c in candidates if size <= c[0] <= hi]
            below = [c for c in candidates if lo <= c[0] < size]
            for c in above + below[::-1]:
                if chunks[c[2]][0] != device:
                    continue
                free.remove(c)
                chunks[c[2]][1] = max(size, chunks[c[2]][1])
                return c[2]
        chunks.append([device, size])
        return len(chunks) - 1

    def release(sid):
        order[0] += 1
        free.append((chunks[sid][1], order[0], sid))

    for node in nodes:
        if node['op'] is None:
            continue
        pairs, identity, ignore = INPLACE.get(node['op'], ((), (), ()))
        taken = set()
        for (i, o), same in zip(pairs, identity):
            if i >= len(node['inputs']) or o >= len(node['outputs']):
                continue
            e_in, e_out = node['inputs'][i], node['outputs'][o]
            sid_in = storage.get(e_in, -1)
            size_in, size_out = _nbytes(shapes.get(e_in)), _nbytes(shapes.get(e_out))
            if i not in taken and storage.get(e_out, -1) == -1 and sid_in >= 0 and \
                    ((counts.get(sid_in) == 1 and len(ignore) != len(node['inputs'])) or
                     (same and size_in == size_out)) and \
                    ref.get(e_out, 0) > 0 and size_in == size_out:
                taken.add(i)
                storage[e_out] = sid_in
                counts[sid_in] += ref.get(e_out, 0)
        outs = [e for e in node['outputs'] if storage.get(e, -1) == -1]
        # largest first; equal sizes by entry, last first (a multimap walked backwards)
        for e in sorted(outs, key=lambda e: (_nbytes(shapes.get(e)), e), reverse=True):
            sid = request(node['device'], _nbytes(shapes.get(e)))
            if sid >= 0:
                counts[sid] = ref.get(e, 0)
            storage[e] = sid
        for i, e in enumerate(node['inputs']):
            if i in ignore:
                continue
            sid = storage.get(e, -1)
            if sid < 0:
                continue
            counts[sid] -= 1
            if counts[sid] == 0:
                release(sid)
        for e in node['outputs']:
            sid = storage.get(e, -1)
            if sid >= 0 and counts.get(sid) == 0:
                release(sid)
                if node['op'] in UNWRITTEN:
                    untouched.add(e)
    # a chunk only such entries hold is never written, so its delayed
    # storage is never allocated
    written = {sid for e, sid in storage.items() if sid >= 0 and e not in untouched}
    return (storage, [chunk if sid in written else [chunk[0], 0]
                      for sid, chunk in enumerate(chunks)], sum(size for _, size in chunks))


def planner_total(graph):
    """The bytes MXNet's planner reports for ``graph``
    (``storage_allocated_bytes``)."""
    return _best_plan(graph)[0]


def _best_plan(graph):
    """``(total, storage, chunks)`` of the plan MXPlanMemory keeps."""
    top = int(graph.env.get('NNVM_EXEC_MATCH_RANGE') or 16)
    low = 1 if str(graph.env.get('NNVM_AUTO_SEARCH_MATCH_RANGE', '0')).strip() not in \
        ('', '0') and top else top
    best = None
    match = low
    while True:
        storage, chunks, total = _allocate(graph, match)
        if best is None or total < best[0]:
            best = (total, storage, chunks)
        if top == 0:
            break
        match *= 2
        if match > top:
            break
    return best


def plan_storage(graph):
    """MXNet's memory plan of ``graph`` (a :class:`PlannedGraph`), replayed, at
    each match range up to ``NNVM_EXEC_MATCH_RANGE`` under
    ``NNVM_AUTO_SEARCH_MATCH_RANGE``, the fewest bytes kept.

    Returns:
        ``{device: bytes}``: the executor's pool, each chunk in whole float32
        words; a chunk no op writes counts 0.
    """
    _, _, chunks = _best_plan(graph)
    # each chunk on the device of its first entry (they agree: the planner matches by device)
    pool = {}
    for device, size in chunks:
        pool[device] = pool.get(device, 0) + (size + 3) // 4 * 4
    return pool


def head_gradients(graph):
    """``{device: bytes}`` of the head gradients MXNet allocates at bind: one per
    forward output whose gradient a backward node reads, on its device."""
    device = {}
    for node in graph.nodes:
        for e in node['outputs']:
            device[e] = node['device']
    held = {}
    for node in graph.nodes:
        match = re.fullmatch(r'_head_grad_(\d+)', node['name'] or '')
        if node['op'] is None and match and int(match.group(1)) < len(graph.outputs):
            e = graph.outputs[int(match.group(1))]
            held[device[e]] = held.get(device[e], 0) + _nbytes(graph.shapes.get(e))
    return held


def _broadcast_backward(node, shapes):
    """``BinaryBroadcastBackwardUseNone`` on CPU: 8 bytes per element of the
    output gradient, where an input was broadcast."""
    ograd = shapes.get(node['inputs'][0])
    if all(shapes.get(e) == ograd for e in node['outputs']):
        return 0
    return 8 * _nbytes(ograd, 1)


# op -> the temporary space (bytes) it asks of MXNet's resource manager
# (``get_space``), from its inputs' and outputs' shapes (src/operator, CPU):
# the largest request each makes. An op not listed asks for none, or a few bytes.
WORKSPACE = {
    '_backward_broadcast_add': _broadcast_backward,
    '_backward_broadcast_sub': _broadcast_backward,
    # 2 x its data (the normalised data and the output gradient's product) and
    # its mean (layer_norm-inl.h, LayerNormGradComputeGeneral)
    '_backward_LayerNorm': lambda node, shapes: 2 * _nbytes(shapes.get(node['inputs'][1])) +
                           _nbytes(shapes.get(node['inputs'][3])),
}

# The ops MXNet runs through oneDNN on CPU whose arrays it reorders into
# oneDNN's temporary memory (TmpMemMgr, src/operator/nn/mkldnn): each
# reorder takes the array's bytes and kMKLDNNAlign (64) more.
ONEDNN = frozenset('FullyConnected _backward_FullyConnected Convolution _backward_Convolution '
                   'Deconvolution _backward_Deconvolution BatchNorm _backward_BatchNorm '
                   'LRN _backward_LRN'.split())
ONEDNN_ALIGN = 64
# The rows and columns of oneDNN's blocked weight layouts on AVX-512 (``AB16b16a``)
ONEDNN_BLOCK = 16


def _plain_dense(node, shapes):
    """A dense layer on a matrix (its data of two axes): oneDNN reads and
    writes it in place, with no reorder."""
    if node['op'] not in ('FullyConnected', '_backward_FullyConnected'):
        return False
    data = shapes.get(node['inputs'][0 if node['op'] == 'FullyConnected' else 1])
    return data is not None and len(data) <= 2


def _dense_reorders(node, shapes, in_place, added, external):
    """A dense layer's take of oneDNN's temporary memory (``TmpMemMgr::Alloc``,
    each its bytes and the alignment): none forward; backward, the data's
    gradient written in place (``in_place``), the weight's and bias's added to
    their arrays (``added``), and the weight's where it is a plan entry
    (not ``external``) that oneDNN writes in its blocked layout (both
    dimensions at least :data:`ONEDNN_BLOCK`) and copies out."""
    if node['op'] != '_backward_FullyConnected' or not node['outputs']:
        return 0

    def blocked(e):
        return min(shapes.get(e) or (0,)) >= ONEDNN_BLOCK
    temporary = [e for k, e in enumerate(node['outputs'])
                 if (k == 0 and e in in_place) or (k > 0 and e in added) or
                 (k == 1 and e not in external and blocked(e))]
    return sum(_nbytes(shapes.get(e)) + ONEDNN_ALIGN for e in temporary if e in shapes)


# oneDNN's element-wise backward passes: written in place of their output's
# gradient, into oneDNN's temporary memory, then copied there
ONEDNN_ELEMENTWISE = frozenset(('_backward_Activation', '_backward_LeakyReLU'))


def _in_place(graph):
    """The entries :func:`_best_plan` writes into one of their node's inputs'
    storage."""
    storage = _best_plan(graph)[1]
    found = set()
    for node in graph.nodes:
        if node['op'] is not None:
            inputs = {storage.get(e, -1) for e in node['inputs']}
            found.update(e for e in node['outputs'] if storage.get(e, -1) >= 0 and
                         storage[e] in inputs)
    return found


def _weight_reorders(node, shapes):
    """A convolution's weight reordered into oneDNN's layout: its bytes and the
    alignment."""
    if node['op'] in ('Convolution', 'Deconvolution'):
        return _nbytes(shapes.get(node['inputs'][1])) + ONEDNN_ALIGN
    return 0


def _data_reorder(node, shapes, blocked):
    """A convolution's data reordered into oneDNN's blocked layout, forward
    and backward: where the data is in the default layout (not ``blocked``)
    and has channels enough for oneDNN to block them (at least
    :data:`ONEDNN_BLOCK`; fewer, a first layer's, are read as they are):
    its bytes and the alignment."""
    if node['op'] not in ('Convolution', '_backward_Convolution'):
        return 0
    k = 0 if node['op'] == 'Convolution' else 1
    data = node['inputs'][k] if len(node['inputs']) > k else None
    shape = shapes.get(data)
    if data in blocked or shape is None or len(shape) < 3 or shape[1] < ONEDNN_BLOCK:
        return 0
    return _nbytes(shape) + ONEDNN_ALIGN


def _convolution_backward(node, shapes, added, read):
    """A convolution's backward take of oneDNN's temporary memory: the larger of
    its largest array and (where the data's gradient is ``read``) its weight,
    then its weight's gradient, once more where ``added``, and the bias's
    gradient where ``added``; each its bytes and the alignment."""
    outputs = node['outputs']
    weight = _nbytes(shapes.get(node['inputs'][2])) + ONEDNN_ALIGN
    arrays = max(_nbytes(shapes.get(e)) + ONEDNN_ALIGN
                 for e in node['inputs'] + outputs if e in shapes)
    first = max(arrays, weight if outputs[0] in read else 0)
    gradients = weight * (2 if outputs[1] in added else 1)
    bias = sum(_nbytes(shapes.get(e)) + ONEDNN_ALIGN for e in outputs[2:3]
               if e in added and e in shapes)
    return first + gradients + bias


# The oneDNN ops that start their use of oneDNN's temporary memory with a
# request of the resource (``TmpMemMgr::Init``: twice the most any window of
# the thread has taken so far; a window is what was taken since the last
# request, so an op that takes without asking adds onto the window of the
# last op that asked)
ONEDNN_REQUESTS = frozenset(
    'FullyConnected _backward_FullyConnected Convolution _backward_Convolution Deconvolution '
    '_backward_Deconvolution BatchNorm _backward_BatchNorm _backward_Pooling '
    '_backward_Activation _backward_LeakyReLU LRN _backward_LRN add_n ElementWiseSum '
    'elemwise_add _copy _backward_copy Concat concat _backward_Concat RNN _backward_RNN'.split())
# oneDNN's softmax backward passes: they take without asking, their output
# written in place of their output's gradient (``CreateMKLDNNMem`` with
# ``kWriteInplace``)
ONEDNN_SOFTMAX = frozenset(('_backward_softmax', '_backward_log_softmax'))


def _onednn_softmax(node, shapes):
    """Whether oneDNN runs ``node``, a backward pass of :data:`ONEDNN_SOFTMAX`
    (``SupportMKLDNNSoftmax``: on the last axis of 1 to 4, float32, no
    temperature, no lengths, no dtype)."""
    attrs = node['attrs']
    data = shapes.get(node['outputs'][0]) if node['outputs'] else None
    if data is None or not 1 <= len(data) <= 4:
        return False
    axis = int(attrs.get('axis', '-1'))
    return axis in (-1, len(data) - 1) and \
        attrs.get('temperature', 'None') == 'None' and \
        attrs.get('use_length', 'False') in ('False', 'false', '0') and \
        attrs.get('dtype', 'None') == 'None'


def _onednn_taken(node, graph, read, in_place, blocked):
    """The bytes of oneDNN's temporary memory ``node`` takes (0 without oneDNN):
    :func:`_dense_reorders`, :func:`_convolution_backward`, an element-wise
    or softmax backward pass's gradient written in place, or for another op of
    :data:`ONEDNN` its largest array or its weight's reorder; a convolution's
    :func:`_data_reorder` (its data not among the ``blocked`` entries) more."""
    return _data_reorder(node, graph.shapes, blocked) + _onednn_own(node, graph, read, in_place)


def _onednn_own(node, graph, read, in_place):
    """:func:`_onednn_taken` but a convolution's data reorder."""
    op, shapes = node['op'], graph.shapes
    if op in ('FullyConnected', '_backward_FullyConnected'):
        return _dense_reorders(node, shapes, in_place, graph.added, graph.external)
    if op in ONEDNN_ELEMENTWISE or (op in ONEDNN_SOFTMAX and _onednn_softmax(node, shapes)):
        return max([0] + [_nbytes(shapes.get(e)) + ONEDNN_ALIGN
                          for e in node['outputs'][:1] if e in in_place])
    if op in ('_backward_Convolution', '_backward_Deconvolution') and \
            len(node['inputs']) > 2 and len(node['outputs']) > 1:
        return _convolution_backward(node, shapes, graph.added, read)
    if op in ONEDNN:
        return max([_weight_reorders(node, shapes)] +
                   [_nbytes(shapes.get(e)) + ONEDNN_ALIGN
                    for e in node['inputs'] + node['outputs'] if e in shapes])
    return 0


def workspace(graph, once=False):
    """``{device: (bytes, bytes)}`` of the temporary space ``graph``'s executor
    asks for, one resource per device: the largest ``get_space`` of its ops
    (:data:`WORKSPACE`), and apart the largest window of oneDNN's temporary
    memory (``TmpMemMgr``): the sum of what the ops of a device take
    (:func:`_onednn_taken`) from one op of :data:`ONEDNN_REQUESTS` to the
    next, which asks for twice the largest window so far.

    Args:
        once: The graph runs once in the step (GPipe's one graph): a window
            counts only where a later op of its device asks for the space;
            otherwise the graph runs again, and its last window of a device
            goes on into its first (the ops before its first request).
    """
    largest = {}
    read = {e for node in graph.nodes for e in node['inputs']} | set(graph.outputs)
    in_place = _in_place(graph)
    blocked = blocked_entries(graph)
    window = {}  # device -> what its thread took since its last request
    leading = {}  # device -> what it took before its first request
    for node in graph.nodes:
        if node['op'] is None:
            continue
        device = node['device']
        rule = WORKSPACE.get(node['op'])
        space, reorder = largest.get(device, (0, 0))
        if rule is not None:
            space = max(space, rule(node, graph.shapes))
        if node['op'] in ONEDNN_REQUESTS:
            if not once and device not in leading:
                leading[device] = window.get(device, 0)  # joined to the last window below
            else:
                reorder = max(reorder, window.get(device, 0))
            window[device] = 0
        window[device] = window.get(device, 0) + _onednn_taken(node, graph, read, in_place,
                                                                 blocked)
        if rule is not None or reorder:
            largest[device] = (space, reorder)
    if not once:
        for device, size in window.items():
            size += leading.get(device, 0)
            if size:
                space, reorder = largest.get(device, (0, 0))
                largest[device] = (space, max(reorder, size))
    return largest


def temp_space(requests, copies=None):
    """``{device: bytes}`` the resources of ``requests`` (one :func:`workspace` per
    executor) hold. On CPU they are the ``MXNET_CPU_TEMP_COPY`` copies MXNet
    keeps on ``cpu(0)`` for every ``cpu(i)``, handed out round robin: the
    largest requests, one per copy, each its ``get_space`` and twice its
    device's largest oneDNN take. Elsewhere, the requests' ``get_space`` summed."""
    import os  # pylint: disable=import-outside-toplevel
    copies = int(os.environ.get('MXNET_CPU_TEMP_COPY', '4')) if copies is None else copies
    reorder = {}
    for one in requests:
        for device, (_, size) in one.items():
            reorder[device] = max(reorder.get(device, 0), size)
    sizes = sorted((space + 2 * reorder[device] for one in requests
                    for device, (space, _) in one.items() if device.startswith('cpu')),
                   reverse=True)
    held = {}
    if sizes and copies > 0:
        held['cpu(0)'] = sum(sizes[:copies])
    for one in requests:
        for device, (space, _) in one.items():
            if not device.startswith('cpu'):
                held[device] = held.get(device, 0) + space
    return held


_RNN_GATES = {'lstm': 4, 'gru': 3, 'rnn_relu': 1, 'rnn_tanh': 1}
# oneDNN's packed RNN weights: their rows (gates x state size) in blocks of this many
RNN_PACKED_ROWS = 128


def _rnn_buffer(node, shapes):
    """The fused RNN op's own buffer (``MKLDNNRnnMemMgr``), allocated on its device
    at its first forward pass: per fused group of layers its weights and
    biases, its weights once more in the inference primitive's packed layout
    (rows padded to :data:`RNN_PACKED_ROWS`), the outputs between groups and
    alignment. 0 where oneDNN does not run it (a projection, data not of 3
    axes, ``MXNET_USE_MKLDNN_RNN=0``)."""
    import os  # pylint: disable=import-outside-toplevel
    attrs = node['attrs']
    data = shapes.get(node['inputs'][0])
    if attrs.get('projection_size', 'None') != 'None' or data is None or len(data) != 3 or \
            os.environ.get('MXNET_USE_MKLDNN_RNN', '1') == '0':
        return 0
    gates = _RNN_GATES[attrs.get('mode', 'lstm')]
    biases = gates + 1 if attrs.get('mode') == 'gru' else gates
    size, layers = int(attrs['state_size']), int(attrs.get('num_layers', '1'))
    steps, batch, width = data
    if attrs.get('bidirectional', 'False') in ('True', 'true', '1'):
        groups = [(1, 2, width)] + [(1, 2, 2 * size)] * (layers - 1)
    elif width == size:
        groups = [(layers, 1, width)]
    else:
        groups = [(1, 1, width)] + ([(layers - 1, 1, size)] if layers > 1 else [])
    elements = 0
    for depth, directions, inputs in groups:
        rows = -(-gates * size // RNN_PACKED_ROWS) * RNN_PACKED_ROWS
        elements += depth * directions * ((inputs + size) * (gates * size + rows) +
                                          biases * size) + 1 + ONEDNN_ALIGN * 5
    elements += steps * batch * size * groups[-1][1] * (len(groups) - 1)
    return 4 * elements


# op -> the bytes of storage of its own its state allocates on its device,
# outside the plan and the temporary space, from its inputs' shapes and its
# attributes (one per node of the graph)
OP_STORAGE = {'RNN': _rnn_buffer}


def op_storage(graph):
    """``{device: bytes}`` the stateful ops of ``graph`` allocate for
    themselves on their devices (:data:`OP_STORAGE`)."""
    held = {}
    for node in graph.nodes:
        rule = OP_STORAGE.get(node['op'])
        if rule is not None:
            size = rule(node, graph.shapes)
            if size:
                held[node['device']] = held.get(node['device'], 0) + size
    return held


# The ops that read an array in oneDNN's layout as it is (``TIsMKLDNN``, in
# MXNet 1.9.1's registry): any other op the executor runs on its inputs'
# copies in the default layout.
ONEDNN_READERS = frozenset(
    'Convolution _backward_Convolution Deconvolution _backward_Deconvolution FullyConnected '
    '_backward_FullyConnected BatchNorm _backward_BatchNorm Pooling _backward_Pooling '
    'Activation _backward_Activation LeakyReLU _backward_LeakyReLU LRN _backward_LRN softmax '
    '_backward_softmax log_softmax _backward_log_softmax SoftmaxOutput Concat concat '
    '_backward_Concat elemwise_add _backward_add ElementWiseSum add_n _copy _backward_copy '
    'Flatten flatten Reshape reshape expand_dims transpose slice RNN _backward_RNN '
    '_CrossDeviceCopy'.split())
# The ops whose oneDNN kernels write their output in a blocked layout of
# their own, and those that write it in the layout of their data when that
# is oneDNN's
ONEDNN_BLOCKED = frozenset('Convolution _backward_Convolution Deconvolution '
                           '_backward_Deconvolution'.split())
ONEDNN_KEEPS = frozenset(
    'BatchNorm _backward_BatchNorm Pooling _backward_Pooling Activation _backward_Activation '
    'LeakyReLU _backward_LeakyReLU LRN _backward_LRN elemwise_add _backward_add '
    'ElementWiseSum add_n _copy _backward_copy'.split())


def blocked_entries(graph):
    """The entries of ``graph`` in oneDNN's blocked layout: those an op of
    :data:`ONEDNN_BLOCKED` wrote or one of :data:`ONEDNN_KEEPS` passed on."""
    blocked = set()
    for node in graph.nodes:
        if node['op'] in ONEDNN_BLOCKED:
            blocked.update(node['outputs'][:1])
        elif node['op'] in ONEDNN_KEEPS and any(e in blocked for e in node['inputs']):
            blocked.update(node['outputs'][:1] if node['op'].startswith('_backward')
                           else node['outputs'])
    return blocked


def fallback_buffers(graph):
    """``{device: bytes}`` of the default-layout copies the executor keeps
    (``StorageFallbackOpExecutor``) for ops that do not read oneDNN's layout
    (not :data:`ONEDNN_READERS`): one per input in oneDNN's blocked layout
    (:func:`blocked_entries`), ignored inputs included."""
    blocked, held = blocked_entries(graph), {}
    for node in graph.nodes:
        if node['op'] is not None and node['op'] not in ONEDNN_READERS:
            size = sum(_nbytes(graph.shapes.get(e)) for e in node['inputs'] if e in blocked)
            if size:
                held[node['device']] = held.get(node['device'], 0) + size
    return held


def activations(graph):
    """``{device: bytes}`` the executor of ``graph`` holds beyond its arrays: the
    planned pool, head gradients, :func:`fallback_buffers` and
    :func:`op_storage` (its temporary space is :func:`workspace`'s)."""
    total = dict(plan_storage(graph))
    for part in (head_gradients(graph), fallback_buffers(graph), op_storage(graph)):
        for device, size in part.items():
            total[device] = total.get(device, 0) + size
    return total


# -- a Pipeline's table ---------------------------------------------------------

CATEGORIES = ('params', 'grads', 'optimizer', 'aux', 'inputs', 'module_copy', 'other')


def _resized(shape, axis, size):
    return tuple(size if a == axis else n for a, n in enumerate(shape))


def _row(table, device):
    return table.setdefault(str(device), dict.fromkeys(CATEGORIES, 0))


def _add_arrays(table, symbol, shapes, types, group2ctx, context, inputs, trained, states,
                with_inputs=True, held=None, only=None):
    """The arrays' rows of one executor bound on ``symbol`` at ``shapes``, each on
    its group's device; optimizer states only of ``held`` where given (the
    replica's share under ``shard_optimizer``); only the arrays named in
    ``only`` where given (a node's stages)."""
    attrs = symbol.attr_dict()

    def device(name):
        return group2ctx.get(attrs.get(name, {}).get(GROUP_ATTR), context)

    for name in symbol.list_arguments():
        if only is not None and name not in only:
            continue
        size = _nbytes(shapes[name], np.dtype(types.get(name, 'float32')).itemsize)
        row = _row(table, device(name))
        if name in inputs:
            row['inputs'] += size if with_inputs else 0
        else:
            row['params'] += size
            if name in trained:
                row['grads'] += size
                if held is None or name in held:
                    row['optimizer'] += states * size
    for name in symbol.list_auxiliary_states():
        if only is not None and name not in only:
            continue
        _row(table, device(name))['aux'] += \
            _nbytes(shapes[name], np.dtype(types.get(name, 'float32')).itemsize)


def replica_shares(pipe, symbol, shapes, types, inputs, trained, worker=(0, 1), only=None):
    """``[set of parameter names]`` per replica: the optimizer state each holds
    under ``shard_optimizer``, dealt as the Module deals it
    (:func:`mp_symbolic.core.optim.zero.owners`) over the replicas of every
    ``dist_sync`` worker, ``worker`` being ``(rank, workers)``, of the
    parameters named in ``only`` where given (a node's); ``None`` per
    replica without sharding."""
    from ..optim.zero import owners  # pylint: disable=import-outside-toplevel
    rank, workers = worker
    if not pipe.shard_optimizer or pipe.replicas * workers == 1:
        return [None] * pipe.replicas
    attrs = symbol.attr_dict()
    group2ctx, context = pipe.plan.group2ctxs[0], pipe.plan.stage_devices[0][0][0]
    params = [(n, str(group2ctx.get(attrs.get(n, {}).get(GROUP_ATTR), context)),
               _nbytes(shapes[n], np.dtype(types.get(n, 'float32')).itemsize))
              for n in symbol.list_arguments() if n not in inputs and n in trained and
              (only is None or n in only)]
    owned = owners(params, pipe.replicas * workers)
    return [{n for n, k in owned.items() if k == rank * pipe.replicas + r}
            for r in range(pipe.replicas)]


def optimizer_shares(pipe, symbol, shapes, fixed=(), worker=(0, 1)):
    """:func:`replica_shares` of ``symbol`` bound at ``shapes`` (``[(input name,
    shape)]``, labels optional), ``fixed`` parameters untrained."""
    inputs = {n for n, _ in shapes} | labels_of(symbol)
    found, types = _specs(symbol, dict(shapes))
    trained = {n for n in symbol.list_arguments() if n not in inputs and n not in set(fixed)}
    return replica_shares(pipe, symbol, found, types, inputs, trained, worker)


class UntypedError(ValueError):
    """Arrays of a graph whose types MXNet cannot infer from its inputs'
    (``names``); the message is one line."""

    def __init__(self, names):
        super().__init__('types: expected every array of the graph typed from its inputs, '
                         'found %s untyped (give its shape)' % ', '.join(names[:3]))
        self.names = tuple(names)


def _specs(symbol, shapes):
    """``({name: shape}, {name: dtype})`` of every argument and auxiliary state
    for inputs of ``shapes`` (labels optional), float32 each.

    Raises:
        UntypedError: an array whose type does not follow from the inputs'.
        ValueError: an array whose shape does not follow from ``shapes``.
    """
    arg_shapes, _, aux_shapes = symbol.infer_shape_partial(**shapes)
    arg_types, _, aux_types = symbol.infer_type_partial(**{n: 'float32' for n in shapes})
    names = symbol.list_arguments() + symbol.list_auxiliary_states()
    untyped = [n for n, t in zip(names, arg_types + aux_types) if t is None]
    if untyped:
        raise UntypedError(untyped)
    found = dict(zip(names, [tuple(s) for s in arg_shapes + aux_shapes]))
    missing = [n for n, s in found.items() if not s or 0 in s]
    if missing:
        raise ValueError('shapes: expected shapes that fix every array of the graph, found '
                         '%s unknown (give its shape)' % ', '.join(missing[:3]))
    return found, dict(zip(names, arg_types + aux_types))


def node_stages(pipe, nodes=None, node=None):
    """The stages node ``node`` of ``nodes`` node processes runs of ``pipe``'s
    plan, each replica's devices dealt over the nodes as a Pipeline over
    nodes deals them; ``None`` for one process.

    Args:
        pipe: A :class:`~mp_symbolic.Pipeline`. Over node processes, its own
            nodes (``nodes`` their count or ``None``; ``node`` by default
            this process's rank); in one process, the plan of ``nodes``.
        nodes: The node processes (``None`` or 1: one process).
        node: The node, from 0.

    Raises:
        ValueError: ``nodes`` not a positive integer (a ``bool`` is not one)
            or other than the Pipeline's own, more nodes than devices per
            replica, or a ``node`` not an integer among them (one line).
    """
    # pylint: disable=import-outside-toplevel
    from ..transport.nodes import node_of_devices
    if nodes is not None:  # True is not one process, nor 2.0 two
        nodes = positive_int('nodes', nodes)
    if pipe.nodes is not None:
        if nodes not in (None, pipe.nodes.count):
            raise ValueError('nodes: expected the Pipeline\'s own %d nodes or none, found %r'
                             % (pipe.nodes.count, nodes))
        nodes, node = pipe.nodes.count, pipe.nodes.rank if node is None else node
        node_of_stage = pipe.plan.node_of_stage
    elif nodes is None or nodes == 1:
        if node is not None and not (is_int(node) and node == 0):
            raise ValueError('node: expected a node with nodes (their count), found node=%r '
                             'without nodes' % (node,))
        return None
    else:
        of_device = node_of_devices(pipe.devices_per_replica, nodes)
        node_of_stage = tuple(of_device[d] for d in pipe.run_schedule().device_of_stage)
    if not is_int(node) or not 0 <= node < nodes:
        raise ValueError('node: expected a node of the %d (0 to %d), found %r'
                         % (nodes, nodes - 1, node))
    return tuple(s for s, n in enumerate(node_of_stage) if n == node)


def estimate(pipe, data_shapes, label_shapes=None, loss='softmax', output=None,
             label_name=None, optimizer='sgd', optimizer_params=None, workers=1, rank=0,
             nodes=None, node=None):
    """Bytes per device and category of one training step of ``pipe``'s Module,
    nothing bound; over node processes, of one node's.

    Args:
        pipe: A :class:`~mp_symbolic.Pipeline`: its plan.
        data_shapes: ``[(name, shape)]`` of the whole batch, as ``Module.bind``
            takes them (over ``dist_sync`` workers, this worker's share).
        label_shapes: ``[(name, shape)]``; default: as the loss head infers it.
        loss, output, label_name: As :meth:`~mp_symbolic.Pipeline.module` takes
            them.
        optimizer, optimizer_params: As ``init_optimizer`` takes them
            (:data:`STATES`).
        workers, rank: The ``dist_sync`` workers and this worker's rank, over
            which ``shard_optimizer`` deals the state.
        nodes, node: Over node processes, the table of node ``node``: the
            arrays, executors and buffers of its stages alone, as
            :func:`node_stages` deals them (a Pipeline over nodes: its own,
            this process's node by default).

    Returns:
        ``{device: {category: bytes}}`` of :data:`CATEGORIES` and ``total``,
        sorted by device, as :func:`mp_symbolic.tools.memory.device_memory`
        gives a measured step's.

    Raises:
        ValueError: an optimizer :data:`STATES` does not know, a batch the
            micro-batches and replicas do not divide, shapes the graph does
            not take, a loss head whose label's type does not follow from the
            data without ``label_shapes``, a rank not among the workers, or
            nodes and a node :func:`node_stages` refuses.
    """
    # pylint: disable=import-outside-toplevel
    from ..engine.module import fixed_param_names
    from ..engine.runtime import fused
    from ..graph.names import LABEL_NAME
    local = node_stages(pipe, nodes, node)
    name = str(optimizer).lower()
    if name not in STATES:
        raise ValueError('optimizer: expected one of %s, found %r'
                         % (', '.join(sorted(STATES)), optimizer))
    states = STATES[name](dict(optimizer_params or {}))
    if not (isinstance(workers, int) and isinstance(rank, int) and 0 <= rank < workers):
        raise ValueError('workers, rank: expected a count of dist_sync workers and a rank '
                         'below it, found workers=%r, rank=%r' % (workers, rank))
    label_name = label_name or LABEL_NAME
    data_shapes = [(n, tuple(s)) for n, s in data_shapes]
    label_shapes = [(n, tuple(s)) for n, s in (label_shapes or ())]
    axis = pipe.batch_axis
    batch = data_shapes[0][1][axis]
    per = pipe.chunks * pipe.replicas
    if batch % per:
        raise ValueError('batch size: expected a multiple of chunks x replicas (%d), found %d'
                         % (per, batch))
    held = None
    try:
        if fused(pipe) and local is None:  # over nodes every schedule runs on the stage runtime
            symbol = pipe.training_symbol(loss, label_name=label_name, output=output)
            table = _one_graph(pipe, symbol, data_shapes, label_shapes, states,
                               set(fixed_param_names(pipe, symbol)), (rank, workers))
        else:
            placed = pipe.training_graph(loss, label_name=label_name, chunks=1, output=output)
            symbol = placed.to_symbol()
            table, held = _staged(pipe, placed, symbol, data_shapes, label_shapes, states,
                                  set(fixed_param_names(pipe, symbol)), (rank, workers), local)
        if pipe.replicas > 1:
            _kvstore(table, symbol, data_shapes, pipe, set(fixed_param_names(pipe, symbol)),
                     held)
    except UntypedError as err:
        if label_name not in err.names or label_shapes:
            raise
        head = loss if isinstance(loss, str) else getattr(loss, '__name__', type(loss).__name__)
        raise ValueError('label_shapes: expected them with a loss head whose label\'s type '
                         'MXNet cannot infer from the data, found none for loss %r; pass '
                         'label_shapes=[(%r, shape)] (the label then float32)'
                         % (head, label_name)) from None
    for row in table.values():
        row['total'] = sum(row[c] for c in CATEGORIES)
    return dict(sorted(table.items(), key=lambda kv: _device_key(kv[0])))


# where MXNet's local kvstore keeps its buffers on a CPU-only machine
PINNED = 'cpu_pinned(0)'


def _kvstore(table, symbol, data_shapes, pipe, fixed, held=None):
    """The ``'local'`` kvstore's buffers that sum the replicas' gradients
    (``CommCPU::Reduce``): per trained parameter (of ``held`` where given) the
    sum and one copy per replica past the first, in :data:`PINNED` memory."""
    inputs = {n for n, _ in data_shapes} | labels_of(symbol)
    batch = data_shapes[0][1][pipe.batch_axis]
    shapes, types = _specs(symbol, _replica_shapes(pipe, data_shapes, batch // pipe.replicas))
    trained = [n for n in symbol.list_arguments() if n not in inputs and n not in fixed and
               (held is None or n in held)]
    size = sum(_nbytes(shapes[n], np.dtype(types[n]).itemsize) for n in trained)
    _row(table, PINNED)['other'] += pipe.replicas * size


def _device_key(name):
    kind, _, index = name.partition('(')
    index = index.rstrip(')')
    return kind != 'cpu', kind, int(index) if index.isdigit() else -1


def _replica_shapes(pipe, shapes, size):
    axis = pipe.batch_axis
    return {n: _resized(s, axis, size) if len(s) > axis else s for n, s in shapes}


def _one_graph(pipe, symbol, data_shapes, label_shapes, states, fixed, worker=(0, 1)):
    """GPipe's one graph of every micro-batch, one executor per replica."""
    plan = pipe.plan
    batch = data_shapes[0][1][pipe.batch_axis]
    shapes = _replica_shapes(pipe, data_shapes + label_shapes, batch // pipe.replicas)
    specs, types = _specs(symbol, shapes)
    inputs = set(shapes) | labels_of(symbol)
    trained = {n for n in symbol.list_arguments() if n not in inputs and n not in fixed}
    table, requests = {}, []
    shares = replica_shares(pipe, symbol, specs, types, inputs, trained, worker)
    for r, group2ctx in enumerate(plan.group2ctxs):
        context = plan.stage_devices[r][0][0]
        _add_arrays(table, symbol, specs, types, group2ctx, context, inputs, trained, states,
                    held=shares[r])
        bound = {n: specs[n] for n in inputs}
        graph = planned_graph(symbol, bound, group2ctx, context, grad_names=trained)
        for device, size in activations(graph).items():
            _row(table, device)['other'] += size
        requests.append(workspace(graph, once=True))
    for device, size in temp_space(requests).items():
        _row(table, device)['other'] += size
    return table


def _staged(pipe, placed, symbol, data_shapes, label_shapes, states, fixed, worker=(0, 1),
            local=None):
    """``(table, held)``: the stage runtime's table, the arrays its stage
    executors share, then per stage its executors of one micro-batch, as many
    as it keeps in flight; of the ``local`` stages where given (a node's:
    ``held`` the names of their arrays, else ``None``), the outputs other
    nodes' stages compute received on its last stage's device."""
    # pylint: disable=import-outside-toplevel
    from ..base.compat import lengths_outside_gradient
    from ..graph.names import parse_group, stage_name
    from ..graph.passes import cut
    from ..engine.stages import boundary_specs, head_specs
    plan = pipe.plan
    batch = data_shapes[0][1][pipe.batch_axis]
    labels = labels_of(symbol) | {n for n, _ in label_shapes}
    input_names = [n for n, _ in data_shapes]
    given = dict(data_shapes + label_shapes)
    stages = cut(placed, plan.num_stages)
    micro = batch // (pipe.chunks * pipe.replicas)
    micro_shapes = _replica_shapes(pipe, list(given.items()), micro)
    specs = _specs(symbol, micro_shapes)
    boundary = boundary_specs(stages, specs)
    inputs = set(input_names) | labels
    trained = {n for n in symbol.list_arguments() if n not in inputs and n not in fixed}
    flight = pipe.run_schedule().in_flight()
    table, requests, held = {}, [], None
    if local is not None:
        held = set()
        for graph in stages:
            if graph.stage in local:
                held.update(graph.symbol.list_arguments() + graph.symbol.list_auxiliary_states())
    shares = replica_shares(pipe, symbol, specs[0], specs[1], inputs, trained, worker, held)
    for r, group2ctx in enumerate(plan.group2ctxs):
        context = plan.stage_devices[r][0][0]
        # the arrays the stage executors share (their inputs are each executor's own)
        _add_arrays(table, symbol, specs[0], specs[1], group2ctx, context, inputs, trained,
                    states, with_inputs=False, held=shares[r], only=held)
        for graph in stages:
            s = graph.stage
            if local is not None and s not in local:
                continue
            groups = {g: d for g, d in group2ctx.items() if parse_group(g)[0] == s}
            device = groups[stage_name(s)]
            stage_symbol = lengths_outside_gradient(graph.graph).to_symbol()
            received = {name: boundary[entry] for name, _, entry in graph.receives}
            bound, owned, read = {}, 0, 0
            for name in stage_symbol.list_arguments():
                if name in received:
                    shape, dtype = received[name]
                    bound[name] = shape
                    owned += 2 * _nbytes(shape, np.dtype(dtype).itemsize)  # it and its gradient
                elif name in inputs:
                    bound[name] = specs[0][name]
                    read += _nbytes(specs[0][name], np.dtype(specs[1][name]).itemsize)
            grads = [n for n in stage_symbol.list_arguments() if n in trained or n in received]
            planned = planned_graph(stage_symbol, bound, group2ctx, device, grad_names=grads,
                                    env=split_bind_environ(groups.values(), stage_symbol),
                                    added=[n for n in grads if n not in received])
            if graph.sends:  # a gradient array per output
                owned += sum(_nbytes(planned.shapes[e]) for e in planned.outputs)
            copies = max(1, flight[s])
            for where, size in activations(planned).items():
                _row(table, where)['other'] += copies * size
            _row(table, device)['other'] += copies * owned
            _row(table, device)['inputs'] += copies * read
            requests += [workspace(planned, once=pipe.chunks == 1)] * copies
        # the batch's outputs, joined from its micro-batches on the last stage's device
        # (over nodes, the node's own stage's; those of other nodes' on its last stage's)
        last = group2ctx[stage_name(plan.num_stages - 1 if local is None else local[-1])]
        for graph in stages:
            where = last if local is None or graph.stage not in local else \
                group2ctx[stage_name(graph.stage)]
            for shape, dtype in head_specs(graph, specs, boundary).values():
                _row(table, where)['other'] += pipe.chunks * _nbytes(
                    shape, np.dtype(dtype).itemsize)
    for device, size in temp_space(requests).items():
        _row(table, device)['other'] += size
    return table, held
