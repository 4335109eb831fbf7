"""The stage runtime: a Pipeline's training graph cut into one sub-graph per
stage, each bound as executors of its own, run in the order a schedule gives
(docs/pipelining.md, "Schedules").

* :func:`~mp_symbolic.core.graph.passes.cut` cuts one micro-batch's labelled
  graph: an output one stage reads from another becomes an input of the
  reader's sub-graph and an output of the producer's, its gradient coming
  back through ``backward(out_grads=...)``.
* A stage keeps one executor per micro-batch in flight
  (:meth:`~mp_symbolic.core.schedule.Schedule.in_flight`), each bound with ``bind`` on
  the same weight, gradient and auxiliary arrays (``grad_req='add'``: the
  micro-batches' gradients sum). ``simple_bind(shared_exec=...)`` would share
  their memory pool, and two micro-batches in flight would overwrite each
  other's activations.
* Boundary tensors pass through a transport
  (:mod:`~mp_symbolic.core.transport.comm`); a runtime may bind only some of
  the stages (``local``), the others run by other processes.
* A parameter another stage reads crosses once per batch, not once per
  micro-batch (:func:`tied_sends`; docs/any-network.md, "Tied weights").
"""
import mxnet as mx

from ..graph.batchnorm import deferred_graph, update
from ..transport.comm import DONE, LOCAL, Link, open_transport
from ..base.compat import leaves_onednn_layouts, lengths_outside_gradient, onednn_active, split_bind
from ..graph.names import TIED_SUFFIX, is_tied, parse_group, stage_name
from ..schedule import Action, issue_order

__all__ = []


class _Slot:
    """One executor of a stage, with the arrays a micro-batch in flight owns."""

    def __init__(self, executor, out_grads):
        self.executor = executor
        self.out_grads = out_grads  # one per output; None where the output is a loss head
        self.pending = DONE  # the receive of the output gradients its backward waits for


def links(stages):
    """``[(link, variable)]``: every :class:`~mp_symbolic.core.transport.comm.Link`
    of ``stages`` and the variable it lands in, in stage order (the same on
    every process that cuts the same graph)."""
    found = []
    for graph in stages:
        for name, t, entry in graph.receives:
            found.append((Link(t, graph.stage, _send_index(stages[t], entry)), name))
    return found


def _send_index(graph, entry):
    return [e for e, _ in graph.sends].index(entry)


def tied_sends(stages):
    """``{(stage, tensor): parameter}``: the sends of ``stages`` (``tensor``
    the send's index) that are a stage's parameter read by a later stage
    through its identity ``<parameter>_tied``
    (:func:`~mp_symbolic.core.graph.passes.tie_parameters`)."""
    found = {}
    for graph in stages:
        for tensor, (_, output) in enumerate(graph.sends):
            out = graph.symbol[output]
            read = out.get_children()
            if not is_tied(out.name) or read is None or len(read.list_outputs()) != 1:
                continue
            name = read.list_outputs()[0]
            if name == out.name[:-len(TIED_SUFFIX)] and read.get_children() is None \
                    and name not in graph.inputs:
                found[(graph.stage, tensor)] = name
    return found


def variable_specs(symbol, input_shapes, input_types=None):
    """``({variable: shape}, {variable: dtype})`` of every argument and
    auxiliary state of ``symbol`` for inputs of ``input_shapes``."""
    arg_shapes, _, aux_shapes = symbol.infer_shape(**input_shapes)
    arg_types, _, aux_types = symbol.infer_type(**dict(input_types or {}))
    names = symbol.list_arguments() + symbol.list_auxiliary_states()
    return dict(zip(names, arg_shapes + aux_shapes)), dict(zip(names, arg_types + aux_types))


class StageRuntime:
    """The stages of one replica bound as executors, running a schedule (a
    :class:`~mp_symbolic.core.engine.runtime.Runtime`). Every boundary tensor,
    and every network output a stage of another process computes, goes
    through ``transport``.

    Args:
        stages: The :class:`~mp_symbolic.core.graph.passes.StageGraph` s, in order
            (all of them, also those another process runs).
        group2ctx: The replica's ``{ctx_group: device}`` (of the stages it binds).
        arg_dict, grad_dict, aux_dict: The replica's weight, gradient and
            auxiliary arrays by name (gradients ``None`` for fixed ones),
            which every executor of a stage binds.
        input_shapes: ``{data or label name: one micro-batch's shape}``.
        schedule: A :class:`~mp_symbolic.core.schedule.Schedule` over these stages.
        for_training: Whether the executors compute gradients.
        specs: :func:`variable_specs` of the graph the stages were cut from.
        boundary: Its :func:`boundary_specs`, where the caller made them already.
        local: The stages this runtime binds and runs (default: every stage).
        transport: The :class:`~mp_symbolic.core.transport.comm.Transport`
            (default: ``'local'``'s).
        axes: ``{data or label name: its batch axis}`` (default: 0).
        output_axes: The batch axis of each graph output, by index, where the
            micro-batches' outputs join (default: 0).
        batchnorm: ``'deferred'``: a training run updates each BatchNorm's
            running statistics once, with the whole batch's
            (:mod:`~mp_symbolic.core.graph.batchnorm`); otherwise each
            micro-batch's backward does.
        accumulate: The parameters whose gradients a training run adds to
            what their arrays hold (``grad_req='add'``); the others' are
            zeroed first.
        input_grads: The inputs whose gradient a training run returns in
            ``input_grads``.
        shared: Another runtime of these stages (another bucket's shapes),
            never run in the same batch: each executor shares the memory pool
            of its stage and slot there (``bind(shared_exec=...)``), except a
            stage over several devices whose ops leave oneDNN layouts
            (:func:`~mp_symbolic.core.base.compat.split_bind`).

    Attributes:
        outputs: After :meth:`run`, the network's outputs of the batch, in
            order, those of stages another process runs too.
        input_grads: After a training :meth:`run`, ``{input: its gradient}``
            over the batch, for each of ``input_grads`` a local stage reads.
    """

    def __init__(self, stages, group2ctx, arg_dict, grad_dict, aux_dict, input_shapes,
                 schedule, for_training, specs, boundary=None, local=None, transport=None,
                 axes=None, output_axes=None, batchnorm=None, accumulate=(), input_grads=(),
                 shared=None):
        self.stages, self.schedule = stages, schedule
        self.local = tuple(range(len(stages)) if local is None else local)
        self.transport = open_transport(LOCAL, None) if transport is None else transport
        self.order = [a for a in issue_order(schedule) if a.stage in self.local]
        self.for_training = for_training
        self.microbatches = schedule.microbatches
        self.input_shapes = dict(input_shapes)
        self.axes = dict(axes or {})
        self.output_axes = list(output_axes or ())
        self.grads = [g for n, g in grad_dict.items()
                      if g is not None and n in arg_dict and n not in accumulate]
        # each input whose gradient is asked for: the device of the first stage reading it
        self._input_grads = {}
        for name in input_grads if for_training else ():
            readers = [s for s in self.local if name in stages[s].inputs]
            if readers:
                self._input_grads[name] = (group2ctx[stage_name(readers[0])],
                                           specs[1].get(name, 'float32'))
        self.input_grads = {}
        self.links = links(stages)
        tied = tied_sends(stages)
        self._tied = {link: tied[(link.producer, link.tensor)] for link, _ in self.links
                      if (link.producer, link.tensor) in tied}
        self._receives = {s: [(link, name) for link, name in self.links
                              if link.consumer == s and link not in self._tied]
                          for s in self.local}
        self._sends = {s: [link for link, _ in self.links
                           if link.producer == s and link not in self._tied]
                       for s in self.local}
        # once per batch: the tied parameters this runtime's stages send, and
        # the ones they read, each into one array all a stage's executors bind
        self._tied_sends = [(link, param) for link, param in self._tied.items()
                            if link.producer in self.local]
        self._tied_receives = {s: [(link, name) for link, name in self.links
                                   if link.consumer == s and link in self._tied]
                               for s in self.local}
        self._arg_dict, self._grad_dict, self._aux_dict = arg_dict, grad_dict, aux_dict
        self._devices = {s: group2ctx[stage_name(s)] for s in range(len(stages))
                         if stage_name(s) in group2ctx}
        self._held, self._held_grads = {}, {}
        self._tied_sums = {}  # (producer, tensor) -> the readers' gradient sum lands here
        if for_training:
            for link, param in self._tied_sends:
                if (link.producer, link.tensor) not in self._tied_sums:
                    value = arg_dict[param]
                    self._tied_sums[(link.producer, link.tensor)] = (param, mx.nd.zeros(
                        value.shape, value.context, dtype=value.dtype))
        types = specs[1]
        self._boundary = boundary_specs(stages, specs) if boundary is None else boundary
        flight = schedule.in_flight()
        self._statistics = {}  # stage -> the BatchNorm statistics its graph outputs
        self._batch_statistics = {}  # stage -> {output: [its value per micro-batch]}
        self.slots = [[] for _ in stages]  # a stage another process runs has none here
        for s in self.local:
            graph = stages[s]
            groups = {g: d for g, d in group2ctx.items() if parse_group(g)[0] == s}
            # no gradient asked for a length MXNet may overwrite (compat.lengths_outside_gradient)
            placed = lengths_outside_gradient(graph.graph) if for_training else graph.graph
            if batchnorm == 'deferred' and for_training and self.microbatches > 1:
                placed, self._statistics[s] = deferred_graph(placed)
            symbol = graph.symbol if placed is graph.graph else placed.to_symbol()
            self.slots[s] = [self._bind(graph, symbol, groups, group2ctx, arg_dict, grad_dict,
                                        aux_dict, types, _slot_executor(shared, s, k))
                             for k in range(max(1, flight[s]))]
        # the network's outputs stages of other processes compute: their
        # process sends them, the batch's micro-batches joined, once computed
        device = group2ctx[stage_name(self.local[-1])]
        self._remote_heads = {}
        for graph in stages:
            if graph.stage not in self.local and graph.heads:
                self._remote_heads[graph.stage] = [
                    (k, self._joined_shape(k, shape), dtype, device)
                    for k, (shape, dtype) in sorted(head_specs(graph, specs,
                                                               self._boundary).items())]
        self.outputs = None
        self.output_keys = []

    @property
    def parameters(self):
        """``(arg_dict, grad_dict, aux_dict)`` its executors bind."""
        return self._arg_dict, self._grad_dict, self._aux_dict

    @property
    def executors(self):
        """One executor of each stage it binds (the first of its micro-batches in flight)."""
        return [self.slots[s][0].executor for s in self.local]

    @property
    def all_executors(self):
        """Every executor it binds: each stage's, one per micro-batch in flight."""
        return [slot.executor for slots in self.slots for slot in slots]

    def device_copies(self):
        """``(forward, backward)`` tensors copied between devices in one step
        of a micro-batch: the ``_CrossDeviceCopy`` nodes of its executors'
        graphs, and each boundary tensor carried from one device (or process)
        to another, its gradient back in training."""
        # pylint: disable=import-outside-toplevel
        from .runtime import graph_copies
        forward, backward = graph_copies(self.executors)
        for link, _ in self.links:
            ends = [self._devices.get(s) for s in (link.producer, link.consumer)]
            if (link.producer in self.local or link.consumer in self.local) and \
                    (None in ends or ends[0] != ends[1]):
                forward += 1
                backward += bool(self.for_training)
        return forward, backward

    def _joined_shape(self, k, shape):
        """Graph output ``k``'s micro-batch ``shape`` joined over the batch."""
        return self._joined(shape, self.output_axes[k] if k < len(self.output_axes) else 0)

    def _joined(self, shape, axis):
        """A micro-batch's ``shape`` with the batch's micro-batches joined on ``axis``."""
        return tuple(n * self.microbatches if a == axis else n for a, n in enumerate(shape))

    def _bind(self, graph, symbol, groups, group2ctx, arg_dict, grad_dict, aux_dict, types,
              shared_exec=None):
        """A slot of ``graph``: ``symbol`` (its graph, or one computing the
        same) bound on the stage's arrays, on ``shared_exec``'s memory pool
        where given."""
        device = groups[stage_name(graph.stage)]
        received = {name: entry for name, _, entry in graph.receives}
        args, grads, reqs = {}, {}, {}
        for name in symbol.list_arguments():
            if name in received and name in self._held:  # a tied parameter: one array
                args[name] = self._held[name]
                if self.for_training:
                    grads[name], reqs[name] = self._held_grads[name], 'add'
            elif name in received:
                shape, dtype = self._boundary[received[name]]
                args[name] = mx.nd.zeros(shape, device, dtype=dtype)
                if self.for_training:
                    grads[name], reqs[name] = mx.nd.zeros(shape, device, dtype), 'write'
                if any(n == name for _, n in self._tied_receives[graph.stage]):
                    self._held[name] = args[name]
                    if self.for_training:
                        self._held_grads[name] = grads[name]
                        reqs[name] = 'add'  # its micro-batches' gradients sum here
            elif name in self.input_shapes:
                args[name] = mx.nd.zeros(self.input_shapes[name], device,
                                         dtype=types.get(name, 'float32'))
                if name in self._input_grads:
                    grads[name], reqs[name] = mx.nd.zeros_like(args[name]), 'write'
            else:
                args[name] = arg_dict[name]
                if self.for_training and grad_dict.get(name) is not None:
                    grads[name], reqs[name] = grad_dict[name], 'add'
        aux = {name: aux_dict[name] for name in symbol.list_auxiliary_states()}
        if shared_exec is not None and len(set(groups.values())) > 1 and onednn_active() and \
                leaves_onednn_layouts(symbol):
            shared_exec = None  # a cross-device copy within: storage of its own (split_bind)
        with split_bind(groups, symbol):  # storage shared unless a layout op needs it off
            executor = symbol.bind(device, args, args_grad=grads or None,
                                   grad_req=reqs or 'null', aux_states=aux, group2ctx=group2ctx,
                                   shared_exec=shared_exec)
        out_grads = None
        if graph.sends and self.for_training:
            # a loss head ignores its gradient; an output read later gets its readers' sum
            out_grads = [mx.nd.zeros(o.shape, o.context, dtype=o.dtype)
                         for o in executor.outputs]
        return _Slot(executor, out_grads)

    def run(self, inputs, train, each=None):
        """One batch of this replica through every stage this runtime runs.

        Args:
            inputs: ``{data or label name: NDArray}`` of ``microbatches x``
                the micro-batch shape (a missing label's arrays keep what they
                hold; an input only other processes' stages read may be
                missing).
            train: Run the schedule's forwards and backwards (gradients summed
                into the gradient arrays, zeroed first unless ``accumulate``
                names them); otherwise forwards only, micro-batch by micro-batch.
            each: Called with each :class:`~mp_symbolic.core.schedule.Action`
                once it is issued to MXNet's engine (not waited for).
        """
        outputs = {}
        if train:
            zero(self.grads + list(self._held_grads.values()))
            self.input_grads = {
                name: mx.nd.zeros(self._joined(self.input_shapes[name], self.axes.get(name, 0)),
                                  device, dtype=dtype)
                for name, (device, dtype) in self._input_grads.items()}
            order = self.order
        else:
            order = [Action(s, i, 'F') for i in range(self.microbatches) for s in self.local]
        self.transport.begin()
        received = []
        for stage, heads in self._remote_heads.items():
            for k, shape, dtype, device in heads:
                outputs[k] = mx.nd.empty(shape, device, dtype=dtype)
            received.append(self.transport.recv_outputs(stage, [(k, outputs[k])
                                                                for k, _, _, _ in heads]))
        # a tied parameter is sent as the batch begins, its readers' gradient
        # sum received at the batch's end (micro-batch 0's tags: it has no other)
        self.transport.send_forward(0, [(link, self._arg_dict[param])
                                        for link, param in self._tied_sends])
        tied = DONE
        if train and self._tied_sums:
            tied = self.transport.recv_backward(
                0, [(link, self._tied_sums[(link.producer, link.tensor)][1])
                    for link, _ in self._tied_sends])
        free = [list(range(len(slots))) for slots in self.slots]
        held = {}  # (stage, micro-batch) -> the index of its slot
        forwarded = [0] * len(self.stages)
        backwarded = [0] * len(self.stages)
        last = self.local[-1]
        for s, i, kind in order:
            graph = self.stages[s]
            if kind == 'F':
                held[(s, i)] = free[s].pop(0)
                if not forwarded[s]:  # the tied parameters it reads, once per batch
                    self.transport.recv_forward(0, [(link, self._held[name]) for link, name
                                                    in self._tied_receives[s]]).wait()
                self._forward(graph, self.slots[s][held[(s, i)]], i, inputs, train, outputs)
                forwarded[s] += 1
                if graph.heads and forwarded[s] == self.microbatches:  # every micro-batch's
                    self.transport.send_outputs(s, [(k, outputs[k]) for k, _ in graph.heads])
                if not train and s == last:  # the micro-batch is through this runtime's stages
                    for t in self.local:
                        free[t].append(held.pop((t, i)))
            else:
                slot = held.pop((s, i))
                self._backward(graph, self.slots[s][slot], i)
                free[s].append(slot)
                backwarded[s] += 1
                if backwarded[s] == self.microbatches:  # its tied gradients, summed
                    self.transport.send_backward(0, [(link, self._held_grads[name]) for link, name
                                                     in self._tied_receives[s]])
            if each is not None:
                each(Action(s, i, kind))
        for pending in received:
            pending.wait()
        if train and self._tied_sums:
            tied.wait()
            for param, value in self._tied_sums.values():
                if self._grad_dict.get(param) is not None:
                    self._grad_dict[param] += value  # after its own micro-batches'
        if train:
            for s, statistics in self._statistics.items():
                update(statistics, self.slots[s][0].executor.aux_dict,
                       self._batch_statistics.pop(s))
        self.transport.finish()
        self.output_keys = sorted(outputs)  # the graph's outputs these are, by index
        self.outputs = [outputs[k] for k in self.output_keys]

    def _forward(self, graph, slot, i, inputs, train, outputs):
        executor = slot.executor
        pending = self.transport.recv_forward(i, [(link, executor.arg_dict[name])
                                                  for link, name in self._receives[graph.stage]])
        for name in graph.inputs:
            if name in inputs:
                axis = self.axes.get(name, 0)
                rows = self.input_shapes[name][axis]
                if axis:
                    part = mx.nd.slice_axis(inputs[name], axis=axis, begin=i * rows,
                                            end=(i + 1) * rows)
                else:
                    part = inputs[name][i * rows:(i + 1) * rows]
                part.copyto(executor.arg_dict[name])
        pending.wait()
        executor.forward(is_train=train)
        if train and graph.stage in self._statistics:
            kept = self._batch_statistics.setdefault(graph.stage, {})
            for pair in self._statistics[graph.stage]:
                for output in sum(pair.outputs, ()):
                    kept.setdefault(output, []).append(executor.outputs[output].copy())
        for k, output in graph.heads:
            value = executor.outputs[output]
            axis = self.output_axes[k] if k < len(self.output_axes) else 0
            rows = value.shape[axis]
            if k not in outputs:
                shape = list(value.shape)
                shape[axis] *= self.microbatches
                outputs[k] = mx.nd.empty(tuple(shape), value.context, dtype=value.dtype)
            if axis:
                outputs[k][(slice(None),) * axis + (slice(i * rows, (i + 1) * rows),)] = value
            else:
                value.copyto(outputs[k][i * rows:(i + 1) * rows])
        sent = [(link, executor.outputs[graph.sends[link.tensor][1]])
                for link in self._sends[graph.stage]]
        self.transport.send_forward(i, sent)
        slot.pending = DONE
        if train and sent:
            slot.pending = self.transport.recv_backward(
                i, [(link, slot.out_grads[graph.sends[link.tensor][1]])
                    for link, _ in sent])

    def _backward(self, graph, slot, i):
        executor = slot.executor
        slot.pending.wait()
        executor.backward(out_grads=slot.out_grads)
        self.transport.send_backward(i, [(link, executor.grad_dict[name])
                                         for link, name in self._receives[graph.stage]])
        for name in graph.inputs:
            if name in self._input_grads:  # micro-batch i's rows, summed over the stages reading it
                axis = self.axes.get(name, 0)
                rows = self.input_shapes[name][axis]
                where = (slice(None),) * axis + (slice(i * rows, (i + 1) * rows),)
                whole = self.input_grads[name]
                whole[where] = whole[where] + executor.grad_dict[name].as_in_context(
                    whole.context)


def zero(arrays):
    """Sets every array of ``arrays`` to 0: one ``reset_arrays`` op a device
    (as Gluon's ``zero_grad``), where assigning each array takes a Python
    indexing call and an op of its own."""
    by_device = {}
    for array in arrays:
        if array.stype == 'default':
            by_device.setdefault(array.context, []).append(array)
        else:  # a sparse gradient (reset_arrays takes dense arrays)
            mx.nd.zeros_like(array, out=array)
    for group in by_device.values():
        mx.nd.reset_arrays(*group, num_arrays=len(group))


def _slot_executor(runtime, stage, slot):
    """The executor of ``stage``'s slot ``slot`` in ``runtime``, or ``None``."""
    if runtime is None or stage >= len(runtime.slots) or slot >= len(runtime.slots[stage]):
        return None
    return runtime.slots[stage][slot].executor


def boundary_specs(stages, specs):
    """``{entry: (shape, dtype)}`` of every tensor a stage sends, inferred
    stage by stage from ``specs`` (:func:`variable_specs`)."""
    found = {}
    for graph in stages:
        if graph.symbol is None:
            continue
        outputs = _output_specs(graph, specs, found)
        for entry, output in graph.sends:
            found[entry] = outputs[output]
    return found


def head_specs(graph, specs, boundary):
    """``{k: (shape, dtype)}`` of one micro-batch of the network's outputs
    stage ``graph`` computes (``boundary``: :func:`boundary_specs`)."""
    outputs = _output_specs(graph, specs, boundary)
    return {k: outputs[output] for k, output in graph.heads}


def _output_specs(graph, specs, boundary):
    """``[(shape, dtype)]`` of each output of stage ``graph``."""
    shapes, types = specs
    received = {name: boundary[entry] for name, _, entry in graph.receives}
    names = graph.symbol.list_arguments()
    known = {n: received[n][0] if n in received else shapes[n] for n in names
             if n in received or n in shapes}
    _, out_shapes, _ = graph.symbol.infer_shape(**known)
    known_types = {n: received[n][1] if n in received else types[n] for n in names
                   if n in received or n in types}
    _, out_types, _ = graph.symbol.infer_type(**known_types)
    return [(tuple(shape), dtype) for shape, dtype in zip(out_shapes, out_types)]
