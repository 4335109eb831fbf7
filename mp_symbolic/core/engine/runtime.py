"""The runtime interface (:class:`Runtime`): a Pipeline's training graph
bound on its devices, running one batch at a time. Every symbolic step runs
on one: :class:`~mp_symbolic.core.engine.stages.StageRuntime` (every
schedule, and over node processes) or :class:`FusedRuntime` (GPipe in one
process), chosen by :func:`fused`.
"""
from collections import OrderedDict
import os
from typing import Dict, List, Optional, Protocol, Tuple, runtime_checkable

import mxnet as mx
import numpy as np

from ..graph.batchnorm import update
from ..base.compat import split_bind
from ..graph.ir import PlacedGraph
from ..graph.names import GROUP_ATTR
from ..optim.updater import Contiguous
from .. import schedule as schedules

__all__ = []


@runtime_checkable
class Runtime(Protocol):
    """A graph bound on its devices (bound when made), one batch at a time.

    Attributes:
        outputs: After :meth:`run`, the graph's outputs of the batch, in order.
        input_grads: After a training :meth:`run`, ``{input: its gradient
            over the batch}`` for the inputs whose gradient was asked for.
        parameters: ``(arg_dict, grad_dict, aux_dict)``: the weights,
            their gradients (``None`` for a fixed one) and the auxiliary
            states the runtime binds, by name, each on its device (the
            fused graph's hold its inputs too, their gradients ``None``).
        executors: The MXNet executors it runs (one per stage it binds, or
            the one fused graph's).
        all_executors: Every executor it binds (each stage's, one per
            micro-batch in flight; or the fused graph's).
        output_keys: After :meth:`run`, the index in the graph's outputs of
            each of ``outputs``.
    """

    outputs: Optional[List[mx.nd.NDArray]]
    output_keys: List[int]
    input_grads: Dict[str, mx.nd.NDArray]

    @property
    def parameters(self) -> Tuple[dict, dict, dict]:
        ...

    @property
    def executors(self) -> List[mx.executor.Executor]:
        ...

    @property
    def all_executors(self) -> List[mx.executor.Executor]:
        ...

    def device_copies(self) -> Tuple[int, int]:
        """``(forward, backward)`` tensors copied between devices in one
        step of a micro-batch: in its executors' graphs, and by its transport."""

    def run(self, inputs, train, each=None) -> None:
        """One batch: ``inputs`` (``{input or label name: array}``) through
        the graph, with ``train`` its backward too (the batch's gradients in
        the gradient arrays); ``each`` is called with each action as it is
        issued, where the runtime issues them one by one."""


class FusedRuntime:
    """GPipe's fused mode (a :class:`Runtime`): one ``executor`` of the graph
    of every micro-batch (:func:`~mp_symbolic.core.graph.passes.replicate_chunks`),
    its order MXNet's engine's. :meth:`run` returns the gradients of
    ``input_grads``. With ``batchnorm='deferred'``, ``statistics`` are those
    the graph outputs after its ``own_outputs``
    (:func:`~mp_symbolic.core.graph.batchnorm.deferred_graph`): a training run
    updates the running statistics with the whole batch's, and ``outputs``
    leaves them out."""

    def __init__(self, executor, input_grads=(), statistics=(), own_outputs=None):
        self.executor = executor
        self._input_grads = tuple(input_grads)
        self._statistics, self._own = statistics, own_outputs
        self.outputs = None
        self.output_keys = []
        self.input_grads = {}

    @property
    def parameters(self):
        exe = self.executor
        return exe.arg_dict, exe.grad_dict, exe.aux_dict

    @property
    def executors(self):
        return [self.executor]

    @property
    def all_executors(self):
        return [self.executor]

    def device_copies(self):
        """See :class:`Runtime`: the bound graph's copies (:func:`graph_copies`)."""
        return graph_copies(self.executors)

    def run(self, inputs, train, each=None):
        """See :class:`Runtime`; ``inputs`` NDArrays on any device or numpy
        arrays. ``each`` is never called (the schedule is one issue)."""
        exe = self.executor
        for name, value in inputs.items():
            if isinstance(value, mx.nd.NDArray):
                value.copyto(exe.arg_dict[name])  # MXNet's [:] = costs a millisecond in Python
            else:
                exe.arg_dict[name][:] = value
        exe.forward(is_train=train)
        if train:
            exe.backward()
            if self._statistics:
                update(self._statistics, exe.aux_dict, exe.outputs)
            self.input_grads = {n: exe.grad_dict[n] for n in self._input_grads}
        self.outputs = exe.outputs[:self._own] if self._own else exe.outputs
        self.output_keys = list(range(len(self.outputs)))


def bind_fused(symbol, device, group2ctx, parameters, shapes, types, groups, grad_req, train,
               devices, input_grads=(), statistics=(), own_outputs=None, fixed=(), shared=None,
               graph=None):
    """A :class:`FusedRuntime` of ``symbol`` (the graph of every micro-batch,
    each variable tagged with its ``ctx_group``) on ``device`` and the
    replica's ``group2ctx``, bound on its ``parameters`` (a
    :class:`ReplicaArrays`' three dicts), its inputs on arrays of its own.

    Args:
        shapes, types: ``{input or label name: shape}`` of the replica's
            batch, and ``{name: dtype}`` of every variable.
        groups: ``{input or label name: its ctx_group}`` (``device`` where none).
        grad_req: ``{argument: request}`` (:func:`grad_requests`), all
            ``'null'`` unless ``train``; ``fixed`` arguments get no gradient.
        devices: Every device of the plan, for
            :func:`~mp_symbolic.core.base.compat.split_bind`.
        input_grads, statistics, own_outputs: As :class:`FusedRuntime` takes them.
        shared: A :class:`FusedRuntime` whose memory pool this one shares
            (never run at once), or ``None``.
        graph: ``symbol``'s :class:`~mp_symbolic.core.graph.ir.PlacedGraph`
            (``None``: read from ``symbol``).
    """
    arg_dict, grad_dict, aux_dict = parameters
    args, grads, reqs = {}, {}, {}
    for name in symbol.list_arguments():
        request = grad_req.get(name, 'null') if train else 'null'
        if name in shapes:
            args[name] = mx.nd.zeros(shapes[name], group2ctx.get(groups.get(name), device),
                                     dtype=types.get(name, 'float32'))
            if request != 'null':
                grads[name] = mx.nd.zeros_like(args[name])
        else:
            args[name] = arg_dict[name]
            if request != 'null' and grad_dict.get(name) is not None:
                grads[name] = grad_dict[name]
        if name in grads:
            reqs[name] = request
    aux = {name: aux_dict[name] for name in symbol.list_auxiliary_states()}
    with split_bind(devices, symbol if graph is None else graph, bool(reqs), fixed):
        executor = symbol.bind(device, args, args_grad=grads or None, grad_req=reqs or 'null',
                               aux_states=aux, group2ctx=group2ctx,
                               shared_exec=None if shared is None else shared.executor)
    return FusedRuntime(executor, input_grads if train else (), statistics if train else (),
                        own_outputs)


def graph_copies(executors):
    """``(forward, backward)``: the ``_CrossDeviceCopy`` nodes MXNet
    inserted in ``executors``' graphs at a ``group2ctx`` bind, read from
    ``debug_str()`` (a backward copy's name holds ``_backward``)."""
    names = [line.split('Name=', 1)[1] for exe in executors
             for line in exe.debug_str().splitlines()
             if line.startswith('Op:_CrossDeviceCopy,')]
    backward = sum('_backward' in n for n in names)
    return len(names) - backward, backward


#: Ops whose oneDNN kernels may lay a weight out anew in place (in its
#: array's whole storage), which a view of a larger array cannot take.
RELAYOUT_OPS = frozenset(['Convolution', 'Deconvolution'])
#: ``FullyConnected`` lays a 2-D weight out anew at inference where both its
#: sides reach this and are multiples of 64 (oneDNN's BRGEMM kernel).
RELAYOUT_FC_SIDE = 1024


def _relaid(graph, laid_out_anew):
    """The names of ``graph``'s variables some reader of which
    ``laid_out_anew(op, name)`` (the reading node, the variable's name) says
    may lay them out anew."""
    nodes, relaid = graph.nodes, set()
    for index, readers in graph.variable_readers().items():
        if any(laid_out_anew(nodes[reader], nodes[index].name) for reader in readers):
            relaid.add(nodes[index].name)
    return relaid


def _special(op):
    """A quantized or subgraph op: its oneDNN kernels may lay any input out anew."""
    return op.op.startswith(('_contrib_quantized', '_sg_')) or 'subgraphs' in op.extra


def plain_names(symbol, names):
    """The parameters of ``names`` that no op of ``symbol`` (a Symbol, or a
    :class:`~mp_symbolic.core.graph.ir.PlacedGraph` holding every op reading
    them) can lay out anew in place: no :data:`RELAYOUT_OPS` op, no
    ``FullyConnected`` of any size (the layout it takes at inference depends
    on the CPU), no quantized or subgraph op reads them. Their arrays stay
    in MXNet's default layout, which a library's op may write
    (``fused_adam_update``: MXNet refuses it an output in oneDNN's layout)."""
    graph = symbol if isinstance(symbol, PlacedGraph) else PlacedGraph.from_symbol(symbol)
    relaid = _relaid(graph, lambda op, name: op.op in RELAYOUT_OPS or
                     op.op == 'FullyConnected' or _special(op))
    return [n for n in names if n not in relaid]


def contiguous_parameters():
    """Whether the Module holds each device's trained parameters as views of
    one array (:func:`parameter_arrays`, updated by one ``adam_update`` a run
    of them): where ``MP_SYMBOLIC_CONTIGUOUS=1`` is set, off by default
    (docs/compare-and-benchmarks.md says why)."""
    return os.environ.get('MP_SYMBOLIC_CONTIGUOUS', '0') == '1'


def contiguous_names(symbol, names, shapes, types):
    """The parameters of ``names`` that can be views of one array: float32,
    of rank 1 or more, and read by no op that may lay its input out anew in
    place (:data:`RELAYOUT_OPS`, a large ``FullyConnected`` weight, a quantized
    or subgraph op). ``symbol``: a Symbol, or a
    :class:`~mp_symbolic.core.graph.ir.PlacedGraph` holding every op that
    reads them."""
    graph = symbol if isinstance(symbol, PlacedGraph) else PlacedGraph.from_symbol(symbol)

    def large_dense(op, name):
        shape = shapes.get(name, ())
        return op.op == 'FullyConnected' and len(shape) == 2 and \
            min(shape) >= RELAYOUT_FC_SIDE and not shape[0] % 64 and not shape[1] % 64

    unsafe = _relaid(graph, lambda op, name: op.op in RELAYOUT_OPS or _special(op) or
                     large_dense(op, name))
    return [n for n in names if n not in unsafe and len(shapes[n]) >= 1
            and np.dtype(types[n]) == np.float32]


def parameter_arrays(symbol, shapes, types, group2ctx, inputs, fixed=(), contiguous=None,
                     graph=None):
    """``(arg_dict, grad_dict, aux_dict)`` of new zero arrays for every
    argument of ``symbol`` but ``inputs``, and every auxiliary state, each on
    its ``ctx_group``'s device; ``fixed`` arguments' gradients are ``None``.
    Given a list ``contiguous``, each device's trained parameters that can be
    (:func:`contiguous_names`, read from ``graph``, the typed graph of every
    op reading them, where given) are views of one array and their gradients
    of another, a :class:`~mp_symbolic.core.optim.updater.Contiguous` appended
    to it."""
    attrs = symbol.attr_dict()

    def device_of(name):
        return group2ctx[attrs[name][GROUP_ATTR]]

    def zeros(name):
        return mx.nd.zeros(shapes[name], device_of(name), dtype=types[name])
    params = [n for n in symbol.list_arguments() if n not in inputs]
    arg_dict, grad_dict = {}, {}
    if contiguous is not None:
        by_device = OrderedDict()
        for name in contiguous_names(symbol if graph is None else graph,
                                     [n for n in params if n not in fixed], shapes, types):
            by_device.setdefault(device_of(name), []).append(name)
        for device, names in by_device.items():
            flat = Contiguous(names, [shapes[n] for n in names], device, 'float32')
            arg_dict.update(zip(names, flat.weights))
            grad_dict.update(zip(names, flat.grads))
            contiguous.append(flat)
    arg_dict = {n: arg_dict[n] if n in arg_dict else zeros(n) for n in params}
    grad_dict = {n: None if n in fixed else grad_dict[n] if n in grad_dict else
                 mx.nd.zeros_like(a) for n, a in arg_dict.items()}
    aux_dict = {n: zeros(n) for n in symbol.list_auxiliary_states()}
    return arg_dict, grad_dict, aux_dict


class ReplicaArrays:  # pylint: disable=too-few-public-methods
    """One replica's ``arg_dict``, ``grad_dict`` (``None`` where no
    gradient is asked for) and ``aux_dict``, as an executor holds them."""

    def __init__(self, arg_dict, grad_dict, aux_dict):
        self.arg_dict, self.grad_dict, self.aux_dict = arg_dict, grad_dict, aux_dict


class ArrayGroup:
    """The weights, gradients and auxiliary states a Module's runtimes bind,
    one set per replica, in the place and with the attributes of MXNet's
    executor group (``_exec_group``: ``param_arrays``, ``grad_arrays``,
    ``aux_arrays``, ``param_names``, ``aux_names``, ``grad_req``,
    ``batch_size``, ``execs``, ``get_params``, ``set_params``); it binds no
    executor.

    Args:
        symbol: The graph of the parameters, variables tagged with ``ctx_group``.
        group2ctxs: One ``{ctx_group: device}`` per replica.
        param_names: The arguments of ``symbol`` that are parameters, in order.
        specs: ``({name: shape}, {name: dtype})`` of every parameter and
            auxiliary state (:func:`~mp_symbolic.core.engine.stages.variable_specs`).
        grad_req: ``{parameter: request}`` (:func:`grad_requests`); a ``'null'``
            one, or any without ``for_training``, has no gradient array.
        batch_size, for_training, inputs_need_grad: As the Module was bound
            (``batch_size`` over every replica).
        shared: An :class:`ArrayGroup` whose arrays of the same names this one
            holds, or ``None``.
        graph: The typed graph of every op reading the parameters (``symbol``'s
            by default: read from its JSON).

    Attributes:
        execs: One :class:`ReplicaArrays` per replica.
        contiguous: The :class:`~mp_symbolic.core.optim.updater.Contiguous`
            arrays the trained parameters and gradients are views of.
        plain: Every replica's weight arrays that no op lays out anew
            (:func:`plain_names`), for the updater's fused Adam.
    """

    def __init__(self, symbol, group2ctxs, param_names, specs, grad_req, batch_size,
                 for_training, inputs_need_grad=False, shared=None, graph=None):
        self.param_names = list(param_names)
        self.aux_names = symbol.list_auxiliary_states()
        self.grad_req = dict(grad_req)
        self.batch_size = batch_size
        self.for_training, self.inputs_need_grad = for_training, inputs_need_grad
        fixed = [n for n in self.param_names
                 if not for_training or self.grad_req.get(n, 'null') == 'null']
        inputs = [n for n in symbol.list_arguments() if n not in self.param_names]
        self.execs, self.contiguous = [], []
        for k, group2ctx in enumerate(group2ctxs):
            made = []
            arrays = parameter_arrays(symbol, specs[0], specs[1], group2ctx, inputs, fixed,
                                      made if contiguous_parameters() else None, graph)
            if shared is not None:
                for mine, kept in zip(arrays, (shared.execs[k].arg_dict, shared.execs[k].grad_dict,
                                               shared.execs[k].aux_dict)):
                    mine.update({n: kept[n] for n in mine if n in kept and (
                        kept[n] is None) == (mine[n] is None)})
                made += shared.contiguous
            # those whose views are the arrays bound (of another group's, where it shares them)
            self.contiguous += [c for c in made if all(
                arrays[0].get(n) is w and arrays[1].get(n) is g
                for n, w, g in zip(c.names, c.weights, c.grads))]
            self.execs.append(ReplicaArrays(*arrays))
        self.param_arrays = [[e.arg_dict[n] for e in self.execs] for n in self.param_names]
        self.plain = [e.arg_dict[n] for n in plain_names(symbol if graph is None else graph,
                                                         self.param_names) for e in self.execs]
        self.grad_arrays = [[e.grad_dict[n] for e in self.execs] for n in self.param_names] \
            if for_training else None
        self.aux_arrays = [[e.aux_dict[n] for e in self.execs] for n in self.aux_names]

    def get_params(self, arg_params, aux_params):
        """Writes each value into ``arg_params`` and ``aux_params`` (host
        arrays by name), the replicas averaged, as MXNet's executor group does."""
        for names, blocks, target in ((self.param_names, self.param_arrays, arg_params),
                                      (self.aux_names, self.aux_arrays, aux_params)):
            for name, block in zip(names, blocks):
                value = sum(w.copyto(mx.cpu()) for w in block) / len(block)
                value.astype(target[name].dtype).copyto(target[name])

    def set_params(self, arg_params, aux_params, allow_extra=False):
        """Copies ``arg_params`` and ``aux_params`` (NDArrays by name) into
        every replica's arrays.

        Raises:
            ValueError: a name this group does not hold, unless ``allow_extra``.
        """
        for values, kind in ((arg_params, 'arg_dict'), (aux_params or {}, 'aux_dict')):
            for name, value in values.items():
                if name not in getattr(self.execs[0], kind):
                    if not allow_extra:
                        raise ValueError('set_params: expected names of the %s, found %r'
                                         % ('parameters' if kind == 'arg_dict' else
                                            'auxiliary states', name))
                    continue
                for arrays in self.execs:
                    target = getattr(arrays, kind)[name]
                    value.astype(target.dtype).copyto(target)


def grad_requests(arg_names, param_names, data_names, grad_req, fixed=(), for_training=True,
                  inputs_need_grad=False):
    """``{argument: 'write', 'add' or 'null'}`` from Module's ``grad_req``
    (one for all, a list in argument order, or a dict over ``'write'``), as
    MXNet's executor group reads it: ``'null'`` for ``fixed`` parameters, for
    inputs unless ``inputs_need_grad``, and for all without ``for_training``.

    Raises:
        ValueError: ``grad_req`` of another type, or a list of another length.
    """
    if not for_training:
        grad_req = 'null'
    if isinstance(grad_req, (list, tuple)):
        if len(grad_req) != len(arg_names):
            raise ValueError('grad_req: expected one per argument (%d), found %d'
                             % (len(arg_names), len(grad_req)))
        return dict(zip(arg_names, grad_req))
    if not isinstance(grad_req, (str, dict)):
        raise ValueError('grad_req: expected a str, list, tuple or dict, found %s'
                         % type(grad_req).__name__)
    one = grad_req if isinstance(grad_req, str) else 'write'
    out = {}
    for name in arg_names:
        if name in param_names:
            out[name] = 'null' if name in fixed else one
        elif name in data_names:
            out[name] = one if inputs_need_grad else 'null'
        else:
            out[name] = 'null'
    if isinstance(grad_req, dict):
        out.update(grad_req)
    return out


def fused(pipe):
    """Whether the steps of ``pipe`` run on :class:`FusedRuntime` rather than
    on the stage runtime: its schedule's ``fused``, in one process. The one
    place the runtime is chosen."""
    return pipe.nodes is None and schedules.kind(pipe.schedule).fused


def bind(pipe, loss, label_name, shapes, plain=None):
    """The runtime a one-replica
    :class:`~mp_symbolic.core.engine.module.PipelineModule` of ``pipe`` (the
    :class:`~mp_symbolic.Pipeline`) binds for training on a batch of
    ``shapes`` (``{input or label name: shape}``, the batch on its
    ``batch_axis``); ``loss`` and ``label_name`` as
    :meth:`~mp_symbolic.Pipeline.training_symbol` takes them. Parameters of
    Gluon's ``grad_req='null'`` have no gradient array. Given a list
    ``plain``, the weight arrays no op lays out anew are appended to it
    (:attr:`ArrayGroup.plain`).

    Raises:
        ValueError: a batch the micro-batches do not divide, or an array
            without the Pipeline's batch axis.
    """
    from .module import PipelineModule  # pylint: disable=import-outside-toplevel
    module = PipelineModule(pipe, loss, label_name=label_name)
    data = [(n, tuple(shapes[n])) for n in pipe.data_names() if n in shapes]
    module.bind(data, [(n, tuple(s)) for n, s in shapes.items() if n == label_name])
    if plain is not None:
        plain.extend(module._exec_group.plain)  # pylint: disable=protected-access
    return module.runtimes[0]
