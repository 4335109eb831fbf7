"""The stage runtime: a Pipeline's training graph cut into one sub-graph per
stage, each bound as executors of its own, run in the order a schedule gives.

GPipe in one graph (:func:`~mp_symbolic.core.graphcut.replicate_chunks`)
leaves the order to MXNet's engine, and the executor joins every
micro-batch before the loss, so no device starts a backward before every
forward is done and every micro-batch's activations stay alive. Here each
stage is an executor of its own (after Megatron-LM's and
torch.distributed.pipelining's stage runtimes), so a schedule
(:mod:`~mp_symbolic.core.schedule`) decides when each stage runs which
micro-batch forward or backward:

* the labelled graph (one micro-batch, every node tagged with its stage) is
  cut along its stages (:func:`cut`): an output one stage reads from
  another becomes an input variable of the reader's sub-graph and an output
  of the producer's; its gradient comes back through
  ``backward(out_grads=...)``;
* a stage keeps one executor per micro-batch it holds in flight
  (:func:`~mp_symbolic.core.schedule.in_flight`: ``K - s`` under 1F1B),
  all bound with ``bind`` on the same weight, gradient and auxiliary arrays
  (``grad_req='add'``: the micro-batches' gradients sum, as in the one
  graph, where the loss heads back-propagate each sample unaveraged and the
  optimizer rescales by ``1 / batch``). Not ``simple_bind(shared_exec=...)``:
  that shares the executors' internal memory pool, and two micro-batches in
  flight then overwrite each other's activations (wrong gradients, no error);
* activations and their gradients pass between stages as NDArray copies,
  pushed to MXNet's engine like any op, so the devices still overlap;
  within a stage, ``group2ctx`` puts tensor-parallel shards on their devices.
"""
from collections import OrderedDict
from dataclasses import dataclass
import json

import mxnet as mx

from .compat import split_bind
from .graphcut import CutError, load
from .names import GROUP_ATTR, STAGE_PREFIX, stage_name
from .schedule import Action, in_flight, issue_order

__all__ = []


def stage_of_group(group):
    """``'stage2'`` or ``'stage2_shard1'`` -> ``2``."""
    return int(group[len(STAGE_PREFIX):].split('_', 1)[0])


@dataclass(frozen=True)
class StageGraph:
    """One stage's part of the training graph.

    Attributes:
        stage: Its index.
        symbol: The sub-graph; its outputs are ``heads`` then ``sends``.
        heads: ``[(k, output)]``: the whole graph's output ``k`` is this
            sub-graph's output ``output``.
        sends: Outputs read by later stages: ``[(entry, output)]``, ``entry``
            the ``(node, index)`` of the whole graph.
        receives: ``[(variable, producer stage, entry)]``: inputs that are
            another stage's outputs.
        inputs: The data and label variables this stage reads.
    """
    stage: int
    symbol: object
    heads: tuple
    sends: tuple
    receives: tuple
    inputs: tuple


def cut(symbol, num_stages, input_names):
    """``symbol`` (every node tagged with its stage's ``ctx_group``) as one
    :class:`StageGraph` per stage.

    Args:
        input_names: The data and label variables: each stage that reads
            one gets it as an input of its own.

    Raises:
        CutError: a stage reads an output of a later stage, or a parameter is
            read by two stages (the Pipeline reads a tied weight through an
            identity op in its owner's stage, so neither happens on its graphs).
    """
    graph = json.loads(symbol.tojson())
    nodes = graph['nodes']
    stage_of = {i: stage_of_group(n['attrs'][GROUP_ATTR])
                for i, n in enumerate(nodes) if n['op'] != 'null'}
    readers, param_readers = {}, {}
    for i, node in enumerate(nodes):
        if node['op'] == 'null':
            continue
        for src, k, _ in node['inputs']:
            if nodes[src]['op'] == 'null':
                if nodes[src]['name'] not in input_names:
                    param_readers.setdefault(nodes[src]['name'], set()).add(stage_of[i])
            elif stage_of[src] > stage_of[i]:
                raise CutError('schedule: expected every stage to read earlier stages only, '
                               'found %s (stage %d) reading %s (stage %d)'
                               % (node['name'], stage_of[i], nodes[src]['name'], stage_of[src]))
            elif stage_of[src] < stage_of[i]:
                readers.setdefault((src, k), set()).add(stage_of[i])
    for name, stages in param_readers.items():
        if len(stages) > 1:
            raise CutError('schedule: expected each parameter read by one stage, found %s read '
                           'by stages %s' % (name, sorted(stages)))
    for src, _, _ in graph['heads']:
        if src not in stage_of:
            raise CutError('schedule: expected the graph\'s outputs computed by a stage, found '
                           'variable %s' % nodes[src]['name'])
    return [_stage_graph(graph, s, stage_of, readers, input_names) for s in range(num_stages)]


def _stage_graph(graph, s, stage_of, readers, input_names):
    nodes = graph['nodes']
    out, index, received = [], {}, OrderedDict()
    inputs = []
    for i, node in enumerate(nodes):
        if stage_of.get(i) != s:
            continue
        entries = []
        for src, k, v in node['inputs']:
            if nodes[src]['op'] == 'null':
                if src not in index:
                    var = json.loads(json.dumps(nodes[src]))
                    if var['name'] in input_names:  # the data or label, read here
                        var.setdefault('attrs', {})[GROUP_ATTR] = stage_name(s)
                        inputs.append(var['name'])
                    index[src] = len(out)
                    out.append(var)
                entries.append([index[src], k, v])
            elif stage_of[src] == s:
                entries.append([index[src], k, v])
            else:
                if (src, k) not in received:
                    name = '%s_output%d_to_stage%d' % (nodes[src]['name'], k, s)
                    received[(src, k)] = (len(out), name)
                    out.append({'op': 'null', 'name': name, 'inputs': [],
                                'attrs': {GROUP_ATTR: stage_name(s)}})
                entries.append([received[(src, k)][0], 0, 0])
        copy = json.loads(json.dumps(node))
        copy['inputs'] = entries
        index[i] = len(out)
        out.append(copy)
    heads, own = [], []
    for k, (src, idx, v) in enumerate(graph['heads']):
        if stage_of[src] == s:
            own.append((k, len(heads)))
            heads.append([index[src], idx, v])
    sends = []
    for (src, idx) in sorted(e for e in readers if stage_of[e[0]] == s):
        sends.append(((src, idx), len(heads)))
        heads.append([index[src], idx, 0])
    receives = tuple((name, stage_of[src], (src, k)) for (src, k), (_, name) in received.items())
    symbol = load({'nodes': out, 'heads': heads, 'attrs': graph.get('attrs', {})}) \
        if heads else None
    return StageGraph(s, symbol, tuple(own), tuple(sends), receives, tuple(inputs))


class _Slot:
    """One executor of a stage, with the arrays a micro-batch in flight owns."""

    def __init__(self, executor, out_grads):
        self.executor = executor
        self.out_grads = out_grads  # one per output; None where the output is a loss head


class StageRuntime:
    """The stages of one replica bound as executors, running a schedule.

    Args:
        stages: The :class:`StageGraph` s, in order.
        group2ctx: The replica's ``{ctx_group: device}``.
        arg_dict, grad_dict, aux_dict: The replica's weight, gradient and
            auxiliary arrays by name (gradients ``None`` for fixed ones):
            every executor of a stage binds these same arrays.
        input_shapes: ``{data or label name: one micro-batch's shape}``.
        schedule: A :class:`~mp_symbolic.core.schedule.Schedule` over these stages.
        for_training: Whether the executors compute gradients.
    """

    def __init__(self, stages, group2ctx, arg_dict, grad_dict, aux_dict, input_shapes,
                 schedule, for_training):
        self.stages, self.schedule = stages, schedule
        self.order = issue_order(schedule)
        self.for_training = for_training
        self.microbatches = schedule.microbatches
        self.input_shapes = dict(input_shapes)
        self.grads = [g for n, g in grad_dict.items() if g is not None and n in arg_dict]
        flight = in_flight(schedule)
        self.slots = []
        for graph in stages:
            groups = {g: d for g, d in group2ctx.items() if stage_of_group(g) == graph.stage}
            self.slots.append([self._bind(graph, groups, group2ctx, arg_dict, grad_dict, aux_dict)
                               for _ in range(max(1, flight[graph.stage]))])
        self.outputs = None

    def _bind(self, graph, groups, group2ctx, arg_dict, grad_dict, aux_dict):
        device = groups[stage_name(graph.stage)]
        received = {name: (t, entry) for name, t, entry in graph.receives}
        args, grads, reqs = {}, {}, {}
        for name in graph.symbol.list_arguments():
            if name in received:
                t, entry = received[name]
                sent = self.slots[t][0].executor.outputs[dict(self.stages[t].sends)[entry]]
                args[name] = mx.nd.zeros(sent.shape, device, dtype=sent.dtype)
                if self.for_training:
                    grads[name], reqs[name] = mx.nd.zeros(sent.shape, device, sent.dtype), 'write'
            elif name in self.input_shapes:
                args[name] = mx.nd.zeros(self.input_shapes[name], device)
            else:
                args[name] = arg_dict[name]
                if self.for_training and grad_dict.get(name) is not None:
                    grads[name], reqs[name] = grad_dict[name], 'add'
        aux = {name: aux_dict[name] for name in graph.symbol.list_auxiliary_states()}
        with split_bind(groups, graph.symbol):  # storage shared unless a layout op needs it off
            executor = graph.symbol.bind(device, args, args_grad=grads or None,
                                         grad_req=reqs or 'null', aux_states=aux,
                                         group2ctx=group2ctx)
        out_grads = None
        if graph.sends and self.for_training:
            # a loss head ignores its gradient; an output read later gets its readers' sum
            out_grads = [mx.nd.zeros(o.shape, o.context, dtype=o.dtype)
                         for o in executor.outputs]
        return _Slot(executor, out_grads)

    def run(self, inputs, train, each=None):
        """One batch of this replica through every stage.

        Args:
            inputs: ``{data or label name: NDArray}`` of ``microbatches x``
                the micro-batch shape (a label may be missing: its arrays keep
                what they hold).
            train: Run the schedule's forwards and backwards (gradients summed
                into the gradient arrays, zeroed first); otherwise forwards
                only, micro-batch by micro-batch.
            each: Called with each :class:`~mp_symbolic.core.schedule.Action`
                once it is issued (to MXNet's engine: nothing waits for it
                unless ``each`` does, as a benchmark timing the actions one
                by one does).
        """
        outputs = {}
        if train:
            for grad in self.grads:
                grad[:] = 0
            order = self.order
        else:
            order = [Action(g.stage, i, 'F') for i in range(self.microbatches)
                     for g in self.stages]
        free = [list(range(len(slots))) for slots in self.slots]
        held = {}
        for s, i, kind in order:
            graph = self.stages[s]
            if kind == 'F':
                slot = held[(s, i)] = free[s].pop(0)
                self._forward(graph, self.slots[s][slot], held, i, inputs, train, outputs)
                if not train and s == len(self.stages) - 1:
                    for t in range(len(self.stages)):
                        free[t].append(held.pop((t, i)))
            else:
                slot = held.pop((s, i))
                self._backward(graph, self.slots[s][slot], held, i)
                free[s].append(slot)
            if each is not None:
                each(Action(s, i, kind))
        self.outputs = [outputs[k] for k in sorted(outputs)]

    def _forward(self, graph, slot, held, i, inputs, train, outputs):
        executor = slot.executor
        for name in graph.inputs:
            if name in inputs:
                rows = self.input_shapes[name][0]
                inputs[name][i * rows:(i + 1) * rows].copyto(executor.arg_dict[name])
        for name, t, entry in graph.receives:
            producer = self.slots[t][held[(t, i)]].executor
            producer.outputs[dict(self.stages[t].sends)[entry]].copyto(executor.arg_dict[name])
        executor.forward(is_train=train)
        for k, output in graph.heads:
            value = executor.outputs[output]
            if k not in outputs:
                outputs[k] = mx.nd.empty((value.shape[0] * self.microbatches,) + value.shape[1:],
                                         value.context, dtype=value.dtype)
            value.copyto(outputs[k][i * value.shape[0]:(i + 1) * value.shape[0]])

    def _backward(self, graph, slot, held, i):
        executor = slot.executor
        executor.backward(out_grads=slot.out_grads)
        for name, t, entry in graph.receives:
            producer = self.slots[t][held[(t, i)]]
            target = producer.out_grads[dict(self.stages[t].sends)[entry]]
            grad = executor.grad_dict[name]
            if self._read_later(graph.stage, t, entry):
                target += grad.as_in_context(target.context)
            else:
                grad.copyto(target)

    def _read_later(self, stage, producer, entry):
        """Whether a stage after ``stage`` also reads ``entry``: its gradient
        then reached the producer first (a micro-batch's backwards run from the
        last stage down), and this one adds to it."""
        return any(t == producer and e == entry for g in self.stages[stage + 1:]
                   for _, t, e in g.receives)
