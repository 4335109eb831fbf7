"""Where every part of a network runs: :func:`place` makes one frozen
:class:`Placement` from the network, the devices and the options: the
devices and replicas, the parameter shapes from a sample, the stages, each
parameter's owning stage, and each tensor-parallel shard's device."""
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import mxnet as mx
import numpy as np

from . import balance as balancing
from ..graph import build as graph, graphcut, nesting, passes
from ..parallel import tensor_parallel
from ..base.checks import excerpt, is_int, positive_int, tied_owners
from ..base.compat import fresh_variables, max_tensor_size
from .devices import DeviceSpecError, DevicePlan, check_devices, resolve_devices, split_replicas
from .balance import CutError
from ..graph.ir import PlacedGraph
from ..graph.names import BLOCK_ATTR, input_names, is_tied, stage_name

__all__ = []


def check_parameter_names(blocks, whole=False):
    """Raises ValueError where two parameters of ``blocks`` share a name (which
    Gluon's ``collect_params`` refuses or merges), naming both blocks by their
    place and class."""
    seen = {}

    def walk(block, path):
        for param in block.params.values():
            first = seen.setdefault(param.name, (param, path, block))
            if first[0] is not param:
                raise ValueError(
                    'blocks: expected each parameter name once, found %s in %s (%s) and in %s '
                    '(%s): two parameters of one name (children given the same prefix=, or '
                    'prefix= outside their parent\'s name_scope()?)'
                    % (param.name, first[1], type(first[2]).__name__, path,
                       type(block).__name__))
        for key, child in block._children.items():  # pylint: disable=protected-access
            walk(child, '%s.%s' % (path, key))

    for i, block in enumerate(blocks):
        walk(block, type(block).__name__ if whole else 'blocks[%d]' % i)


def parameters(blocks):
    """``{name: Parameter}`` of every parameter of ``blocks``, each once, in block order."""
    params = OrderedDict()
    for block in blocks:
        for name, param in block.collect_params().items():
            params.setdefault(name, param)
    return params


@dataclass(frozen=True, eq=False)
class Placement:
    """A network placed on devices: what runs where, fixed once made.

    Attributes:
        blocks: The blocks, in order (one ``HybridBlock`` for a whole network).
        whole: Whether one whole network was cut (by ``cut``).
        cut: The :class:`~mp_symbolic.core.graph.graphcut.Cut`, or ``None`` for
            a block list.
        plan: The :class:`~mp_symbolic.core.placement.devices.DevicePlan`.
        owner: ``{parameter name: stage it lives on}``.
        shard_of: ``{parameter name: index of its device in its stage}`` for
            tensor-parallel shards; others are on the stage's first.
        sharded: The tensor-parallel layout (:func:`tensor_parallel.layout`).
        chunks, replicas: Micro-batches per batch, copies of the pipeline.
        mirror: Stages whose ops are recomputed in the backward pass.
        sample_shapes: One batch shape per input, or ``None``.
        input_names: The inputs' names, as ``HybridBlock.export`` gives them.
        stages: What each stage runs: its blocks, or its op names.
        readers: ``{parameter name: [stages that read it]}``.
        inputs: The positional inputs as nested names
            (``('data0', ['data1', 'data2'])`` for ``(x, [h, c])``); ``None``:
            ``input_names``.
        outputs: A whole network's output nesting, or ``None``.
        batch_axis: The axis of the batch in every input and output.
    """
    blocks: tuple
    whole: bool
    cut: object
    plan: DevicePlan
    owner: dict
    shard_of: dict
    sharded: object
    chunks: int
    replicas: int
    mirror: tuple
    sample_shapes: tuple
    input_names: tuple
    stages: list = None
    readers: dict = None
    inputs: tuple = None
    outputs: object = None
    batch_axis: int = 0

    def micro_batch(self, batch):
        """Examples per micro-batch of a batch of ``batch`` (``None``: a scalar);
        raises ValueError unless it is a multiple of ``chunks x replicas``."""
        parts = self.chunks * self.replicas
        if not batch or batch % parts:
            raise ValueError('batch size: expected a multiple of chunks x replicas (%d x %d = '
                             '%d), found %s' % (self.chunks, self.replicas, parts,
                                                'a scalar' if batch is None else batch))
        return batch // parts

    def micro_batch_of(self, sizes):
        """Examples per micro-batch of inputs of ``sizes`` along the batch axis
        (``{input name: size}``, in order); with one part nothing is split and the
        first input's size is the micro-batch.

        Raises:
            ValueError: the sizes differ or are not a multiple of ``chunks x
                replicas``, or the first input is a scalar.
        """
        names, values = list(sizes), list(sizes.values())
        parts = self.chunks * self.replicas
        if len(values) == 1 or parts == 1:
            return self.micro_batch(values[0])
        if len(set(values)) == 1 and values[0] and not values[0] % parts:
            return values[0] // parts
        hint = ''
        if len(set(values)) > 1:
            hint = ' (give Pipeline(..., batch_axis=) the axis of the batch where it is not ' \
                   'axis %d: 1 for GluonNLP\'s TNC inputs)' % self.batch_axis
        raise ValueError('batch size: expected a multiple of chunks x replicas (%d x %d = %d), '
                         'the same for every input along axis %d (batch_axis), found %s%s'
                         % (self.chunks, self.replicas, parts, self.batch_axis, ', '.join(
                             '%s %s' % (n, 'a scalar' if v is None else v)
                             for n, v in zip(names, values)), hint))

    @property
    def positional_inputs(self):
        """The positional inputs as nested names (:attr:`inputs`, or one
        name per input)."""
        return tuple(self.input_names) if self.inputs is None else self.inputs

    def input_variables(self):
        """A Symbol variable per input, nested as the network takes them."""
        return symbol_variables(self.positional_inputs)

    @property
    def sample_shape(self):
        """The first input's batch shape, or ``None``."""
        return None if self.sample_shapes is None else self.sample_shapes[0]

    def collect_params(self):
        """The blocks' parameters (as a Gluon block's ``collect_params``)."""
        return parameters(self.blocks)

    # -- the one labelled graph ---------------------------------------------

    @property
    def traced(self):
        """The :class:`~mp_symbolic.core.graph.graphcut.Cut` every graph is labelled
        from: a whole network's, or the block list traced at its block boundaries
        (again once a parameter's shape, dtype or attributes changed)."""
        # A branch on the form: a cut network's stages are positions
        # in the op order of the trace its cut was solved on, so that trace is
        # the one; a block list's split points are its block boundaries, which
        # every trace finds again.
        if self.cut is not None:
            return self.cut
        key = tuple((p.name, p.shape, p.dtype, p.lr_mult, p.wd_mult, p.grad_req, id(p.init),
                     getattr(p, '_stype', None)) for p in self.collect_params().values())
        if self._trace[0] != key:
            self._trace[:] = [key, trace_blocks(self.blocks, self.positional_inputs,
                                                self.plan.stage_of_layer, self.owner)]
        return self._trace[1]

    @cached_property
    def _trace(self):
        """``[parameters' state, the block list's trace]`` of the last trace."""
        return [None, None]

    def labelled(self, mirror=()):
        """The traced graph labelled by stage, each shard in its group."""
        return labelled(self.traced, self.plan, mirror)

    @cached_property
    def run_graph(self):
        """The labelled graph a cut network's imperative twin runs, made once."""
        return self.labelled()

    @cached_property
    def run_ops(self):
        """The op nodes of each stage of :attr:`run_graph`, by index."""
        return self.run_graph.op_indices_by_stage(self.plan.num_stages)

    def unsplit_labelled(self):
        """The network traced with its tensor-parallel layers unsplit (as
        checkpoints hold it), each node in the stage its split form has."""
        stage_of, stage_of_call = {}, {}
        for node in self.labelled().nodes:
            if node.layer is None:
                stage_of[node.name] = node.stage
            elif not node.is_variable:  # a call's weights follow its first op (shard_groups)
                stage_of_call.setdefault(node.layer[2], node.stage)
        with fresh_variables(self), tensor_parallel.mark_shards(self.blocks, unsplit_layers=True):
            unsplit = passes.unique_names(PlacedGraph.from_symbol(
                graph.chain(self.blocks, self.input_variables()), self.input_names))
        for node in unsplit.ops:  # a layer of one shard is unmarked in the split trace:
            if node.layer is not None and node.name in stage_of:  # its call where its first op is
                stage_of_call.setdefault(node.layer[2], stage_of[node.name])
        return passes.tie_parameters(unsplit.but([
            n.but(group=stage_name(stage_of.get(n.name, 0) if n.layer is None else
                                   stage_of_call.get(n.layer[2], stage_of.get(n.name, 0))))
            for n in unsplit.nodes]), CutError)

    # -- what runs where ----------------------------------------------------

    def device_of(self, name, replica=0):
        """Device of parameter ``name`` in replica ``replica``: its stage's, or
        its shard's."""
        stage = self.owner[name]
        return self.plan.stage_devices[replica][stage][self.shard_of.get(name, 0)]

    def devices_of(self, name):
        """The devices of parameter ``name``'s copies, one per replica."""
        return [self.device_of(name, r) for r in range(self.plan.num_replicas)]

    @cached_property
    def tied(self):
        """``{parameter name: (owning stage, [stages that read it])}`` of every
        parameter read by more than one stage."""
        return {n: (self.owner[n], sorted(r)) for n, r in self.readers.items()
                if len(set(r) | {self.owner[n]}) > 1}

    @cached_property
    def borrowed(self):
        """``{stage: [(parameter, owning stage, shard index)]}``: the tied
        parameters each stage reads from another stage."""
        params = self.collect_params()
        return {s: [(params[n], owner, self.shard_of.get(n, 0))
                    for n, (owner, readers) in self.tied.items() if owner != s and s in readers]
                for s in range(self.plan.num_stages)}

    # -- the plan in words --------------------------------------------------

    def describe(self):
        """The plan, one line per stage: its devices, blocks and parameter count; for
        a whole network, its ops and parameters and the activation bytes per
        sample that cross to the next stage."""
        # A branch on the form: the stages are printed in the units
        # their split points were named in, blocks (a block list, which may
        # never be traced) or ops (a cut network), and each keeps its lines.
        lines = self._describe_blocks() if self.cut is None else self._describe_cut()
        return lines + ['tied: %s lives on %s, read by %s' % (
            name, stage_name(owner), ', '.join(stage_name(r) for r in readers))
                        for name, (owner, readers) in sorted(self.tied.items())]

    def _describe_blocks(self):
        lines = []
        for s, blocks in enumerate(self.stages):
            names = ', '.join(b.name for b in blocks)
            # each parameter once, on the stage it lives on (a tied one on its owner's)
            params = {n: p for b in blocks for n, p in b.collect_params().items()
                      if self.owner.get(n, s) == s}
            shapes = [p.shape for p in params.values()]
            if all(shape and all(d > 0 for d in shape) for shape in shapes):
                count = '%d parameters' % sum(int(np.prod(shape)) for shape in shapes)
            else:
                count = 'parameter count not known yet'
            lines.append('%s -> %s: %s (%s)' % (stage_name(s), self.plan.stage_label(s), names,
                                                count))
        return lines

    def _describe_cut(self):
        params = self.collect_params()
        lines = []
        for s in range(self.plan.num_stages):
            ops = self.stages[s]
            names = [n for n in params if self.owner.get(n) == s]
            count = sum(int(np.prod(params[n].shape)) for n in names)
            lines.append('%s -> %s: %d ops, %d parameter values'
                         % (stage_name(s), self.plan.stage_label(s), len(ops), count))
            lines.append('  ops: ' + ', '.join(ops))
            lines.append('  parameters: ' + (', '.join(names) or 'none'))
            if s + 1 < self.plan.num_stages:
                crossing = 'not known (no sample)' if self.cut.boundary_bytes is None else \
                    '%d bytes per sample' % self.cut.boundary_bytes[s]
                lines.append('  %s -> %s: %s' % (stage_name(s), stage_name(s + 1), crossing))
        return lines


def sample_shapes(sample):
    """``sample`` as one batch shape per input: a batch (numpy or NDArray) or its
    shape, or a tuple or list of them, one per positional input (itself a list
    for an input that is one); ``None`` stays ``None``. Raises ValueError for
    anything else."""
    shapes, _ = sample_inputs(sample)
    return shapes


def sample_inputs(sample):
    """``(shapes, nesting)``: :func:`sample_shapes` and the nesting of the
    positional inputs, or ``(None, None)``.

    Raises:
        ValueError: see :func:`sample_shapes`; a size below 1, more elements in
            one input than MXNet takes, or lists nested too deep or holding
            themselves (the sample shown by kind and shape only).
    """
    if sample is None:
        return None, None
    if hasattr(sample, 'shape') or nesting.is_shape(sample):
        sample = (sample,)
    nesting.check(sample, 'sample')
    if isinstance(sample, (tuple, list)) and sample:
        leaves, nested = nesting.flatten(tuple(sample))
        if leaves and all(hasattr(leaf, 'shape') or nesting.is_shape(leaf) for leaf in leaves):
            shapes = tuple(tuple(int(d) for d in leaf.shape) if hasattr(leaf, 'shape') else
                           tuple(int(d) for d in leaf) for leaf in leaves)
            _check_sizes(shapes)
            return shapes, nested
    raise ValueError('sample: expected a batch or its shape, or a tuple of them (one per input '
                     'of the network, a list of them for an input that is a list), found %s'
                     % nesting.describe_value(sample))


def _check_sizes(shapes):
    """Raises ValueError where a sample's shape has a size below 1 or more
    elements than MXNet takes in one tensor."""
    names = input_names(len(shapes))
    limit = max_tensor_size()
    for name, shape in zip(names, shapes):
        where = '' if len(shapes) == 1 else ' for %s' % name
        if any(d < 1 for d in shape):
            raise ValueError('sample: expected sizes of at least 1 in every axis (a batch of '
                             'at least one row), found shape %s%s'
                             % (excerpt(str(shape)), where))
        if int(np.prod(shape, dtype=object)) > limit:
            raise ValueError('sample: expected at most %d elements per input (the most MXNet '
                             'takes in one tensor in this build), found shape %s%s, %d elements'
                             % (limit, excerpt(str(shape)), where,
                                int(np.prod(shape, dtype=object))))


def symbol_variables(inputs):
    """A Symbol variable per name of ``inputs`` (nested names), nested alike."""
    return nesting.map_names(mx.sym.var, inputs)


def replica_devices(devices, replicas, nodes=None):
    """``(devices of each replica, node of each device of a replica)``: ``devices``
    (see :class:`~mp_symbolic.Pipeline`) checked and split into ``replicas``.

    Raises:
        DeviceSpecError: devices that cannot work (``None``, unknown, twice on
            a node, not a multiple of ``replicas``).
    """
    if devices is None:
        raise DeviceSpecError("devices: expected a device list such as 'cpu:0,cpu:1' or a "
                              'list of mx.Context, found None')
    if nodes is None:
        split = split_replicas(resolve_devices(devices), replicas)
        return split, (0,) * len(split[0])
    return _node_devices(devices, replicas, nodes)


def place(blocks, whole, devices, device_of_stage, balance=None, sample=None, chunks=1,
          replicas=1, mirror=False, tied=None, batch_axis=0, sample_checked=False, virtual=1):
    """The :class:`Placement` of ``blocks`` on ``devices`` (see
    :class:`~mp_symbolic.Pipeline` for the arguments).

    Args:
        blocks: The blocks (checked ``HybridBlock`` s); one, for ``whole``.
        whole: Whether the one block is cut through its traced graph.
        devices: The pair :func:`replica_devices` returns (over nodes, each
            replica's devices divided over the nodes in order).
        device_of_stage: The device of a replica each stage runs on, as its
            schedule lays them (:func:`~mp_symbolic.core.schedule.round_robin`).
        virtual: The stages per device of the schedule
            (:func:`~mp_symbolic.core.schedule.check_spec`'s count), named where
            the blocks or the graph's ops are fewer than the stages.
        sample: A batch or its shape, or a tuple of them
            (:func:`sample_shapes`); ``None``: no sample, one input.
        batch_axis: The axis of the batch in every input and output.
        sample_checked: ``sample`` has been traced through these blocks
            already: shapes are inferred again only if one is unknown.

    Raises:
        ValueError: (``DeviceSpecError``, ``BalanceError``) balance, chunks,
            mirror, tied or batch_axis values that cannot work.
    """
    split, node_of_device = devices
    # the only plan with a device twice: checked once above, then repeated
    replica_devices = tuple(tuple(devs[d] for d in device_of_stage) for devs in split)
    node_of_stage = tuple(node_of_device[d] for d in device_of_stage)
    num_stages = len(replica_devices[0])
    positive_int('chunks', chunks)
    if not is_int(batch_axis) or batch_axis < 0:
        raise ValueError('batch_axis: expected a non-negative integer (the axis of the batch in '
                         'every input and output: 1 for GluonNLP\'s TNC), found %r'
                         % (batch_axis,))
    batch_axis = int(batch_axis)
    mirror = tuple(range(num_stages)) if mirror is True else tuple(mirror or ())
    if any(not isinstance(st, int) or not 0 <= st < num_stages for st in mirror):
        raise ValueError('mirror: expected True or stage indices below %d, found %r'
                         % (num_stages, mirror))
    shapes, nested = sample_inputs(sample)
    names = tuple(input_names(1 if shapes is None else len(shapes)))
    inputs = names if nested is None else nesting.unflatten(nested, names)
    if shapes is not None and not (sample_checked and all(
            param.shape and all(param.shape) for param in parameters(blocks).values())):
        graph.infer_shapes(blocks, shapes, inputs)
    cut, outputs = None, None
    if whole:
        cut, outputs = _cut(blocks[0], num_stages, balance, shapes, inputs, tied, batch_axis,
                            virtual)
        plan = DevicePlan(replica_devices[0], cut.stage_of_op, replica_devices,
                          node_of_stage=node_of_stage)
        owner = {n: s for n, s in cut.owner.items() if n not in names}
        for name in parameters(blocks):
            owner.setdefault(name, 0)  # a parameter the forward pass does not use
    else:
        sizes = _balance(blocks, num_stages, balance, shapes, replica_devices[0][0], virtual)
        plan = DevicePlan(replica_devices[0], balancing.stage_of_block(sizes), replica_devices,
                          node_of_stage=node_of_stage)
        owner = {}
        for block, stage in zip(blocks, plan.stage_of_layer):
            for name in block.collect_params():
                owner.setdefault(name, stage)
        owner.update(tied_owners(tied, owner, num_stages, 'the blocks'))
    # a whole network's shards and readers come from its labelled graph, made once here
    placed = None
    if cut is not None:
        try:
            placed = labelled(cut, plan)
        except ValueError as err:  # a stage of another device count than a layer's shards
            raise DeviceSpecError(str(err)) from None
    owner, shard_of = _shards(blocks, placed, plan, owner)
    stages, readers = _layout(blocks, cut, placed, plan, shard_of, names)
    return Placement(tuple(blocks), whole, cut, plan, owner, shard_of,
                     tensor_parallel.layout(blocks), chunks, replicas, mirror, shapes, names,
                     stages, readers, inputs=inputs, outputs=outputs, batch_axis=batch_axis)


def labelled(traced, plan, mirror=()):
    """``traced`` (a :class:`~mp_symbolic.core.graph.graphcut.Cut`) labelled by
    stage, each shard in its group: the placed graph every build starts from.
    Raises ValueError for a stage of several devices but not as many as a
    layer's shards."""
    graph = traced.labelled(mirror)
    if all(n.layer is None for n in graph.nodes):
        return graph
    return passes.tie_parameters(passes.shard_groups(
        graph, [plan.width(s) for s in range(plan.num_stages)]), CutError)


def _node_devices(devices, replicas, nodes):
    """``(replica devices, node of each device of a replica)`` for a plan over
    ``nodes``: each replica's devices divided evenly, in order."""
    # pylint: disable=import-outside-toplevel
    from ..transport.nodes import node_of_devices
    listed = resolve_devices(devices, unique=False)
    replica_devices = split_replicas(listed, replicas)
    node_of_device = node_of_devices(len(replica_devices[0]), nodes.count)
    for node in range(nodes.count):
        mine = [d for devs in replica_devices for d, n in zip(devs, node_of_device) if n == node]
        try:
            check_devices(mine, None if node == nodes.rank else float('inf'))
        except DeviceSpecError as err:
            raise DeviceSpecError('node %d: %s' % (node, err)) from None
    return replica_devices, node_of_device


def trace_blocks(blocks, names, stage_of_layer, owner):
    """A block list traced into one graph: the
    :class:`~mp_symbolic.core.graph.graphcut.Cut` whose every op sits in its
    block's stage, every parameter in its ``owner``. Raises what a block's
    ``hybrid_forward`` raises on Symbols."""
    with fresh_variables(blocks), tensor_parallel.mark_shards(blocks):
        x = symbol_variables(names)
        for i, block in enumerate(blocks):
            with mx.AttrScope(**{BLOCK_ATTR: str(i)}):
                x = block(*x)
            x = list(x) if isinstance(x, (list, tuple)) else [x]
    x, _ = nesting.flatten(x)
    names = nesting.flat_names(names)
    traced = PlacedGraph.from_symbol(x[0] if len(x) == 1 else mx.sym.Group(x), names)
    stage_of_op, stage = [], 0
    for node in traced.ops:
        # an op no block call made (none in Gluon's tracing): its predecessor's stage
        stage = stage if node.block is None else stage_of_layer[node.block]
        stage_of_op.append(stage)
    variables = {n.name for n in traced.variables} - set(names)
    return graphcut.Cut(traced, len(set(stage_of_layer)), data_name=names,
                        owners={n: s for n, s in owner.items() if n in variables},
                        stage_of_op=stage_of_op)


def _layout(blocks, cut, graph, plan, shard_of, input_names):
    """``(stages, readers)``: what each stage runs (its blocks, or its ops), and
    ``{parameter name: [stages that read it]}``."""
    # A branch on the form: a block list's stages are its blocks
    # (Pipeline.stages, describe and the twin run them), and its readers come
    # from the blocks without a trace (its blocks need not run on Symbols).
    if cut is None:
        stages = [[b for b, st in zip(blocks, plan.stage_of_layer) if st == s]
                  for s in range(plan.num_stages)]
        readers = {}
        for block, stage in zip(blocks, plan.stage_of_layer):
            for name in block.collect_params():
                readers.setdefault(name, [])
                if stage not in readers[name]:
                    readers[name].append(stage)
        return stages, readers
    if not shard_of:
        return ([cut.ops_of_stage(s) for s in range(plan.num_stages)],
                {n: list(r) for n, r in cut.readers.items() if n not in input_names})
    stages, readers = [[] for _ in range(plan.num_stages)], {}
    for node in graph.ops:
        if not is_tied(node.name):
            stages[node.stage].append(node.name)
        for entry in node.inputs:
            source = graph.source(entry)
            if is_tied(source.name):  # a weight another stage holds, read through its identity
                source = graph.source(source.inputs[0])
            if source.is_variable and source.role != 'input':
                readers.setdefault(source.name, [])
                if node.stage not in readers[source.name]:
                    readers[source.name].append(node.stage)
    return stages, readers


def _balance(blocks, num_stages, balance, shapes, device, virtual=1):
    """Blocks per stage of a block list."""
    balancing.check_stage_count(num_stages, len(blocks), 'blocks', True, virtual)
    kind = balancing.balance_kind(balance, shapes is not None)
    if kind == 'size':
        return balancing.balance_by_size(blocks, num_stages)
    if kind == 'time':
        if len(shapes) > 1:
            raise balancing.BalanceError("balance='time': expected blocks of one input to time, "
                                         'found a sample of %d inputs (give balance= as blocks '
                                         'per stage)' % len(shapes))
        # timed on the first stage's device: the kind of device the stages run on
        return balancing.balance_by_time(blocks, shapes[0], device, partitions=num_stages)
    return balancing.check_balance(balance, len(blocks), num_stages)


def _cut(net, num_stages, balance, shapes, inputs, tied, batch_axis=0, virtual=1):
    """``(cut, outputs)``: the cut of one whole network into ``num_stages``
    stages, and the nesting of its output."""
    with fresh_variables(net), tensor_parallel.mark_shards(net):
        out = net(*symbol_variables(inputs))
        leaves, outputs = nesting.flatten(out)
        symbol = mx.sym.Group(leaves) if isinstance(out, (list, tuple)) else out
    names = tuple(nesting.flat_names(inputs))
    params = {name: param.shape for name, param in net.collect_params().items()}
    if shapes is None and any(
            shape is None or not all(shape) for shape in params.values()):
        raise ValueError('sample: expected a batch or its shape to split a whole network '
                         'whose parameter shapes are not known yet, found none')
    if shapes is not None:
        _check_inputs_given(symbol, names, params)
    try:
        return graphcut.Cut(symbol, num_stages, balance,
                            None if shapes is None else dict(zip(names, shapes)), params, tied,
                            names, batch_axis=batch_axis, virtual=virtual), outputs
    except balancing.TooManyStages:
        raise
    except balancing.BalanceError as err:  # CutError too
        raise balancing.BalanceError(str(err)) from None


def _check_inputs_given(symbol, names, params):
    """Raises ValueError where the traced network reads a variable that is
    neither an input of the sample nor a parameter (an input the sample left
    out)."""
    free = [n for n in symbol.list_arguments() + symbol.list_auxiliary_states()
            if n not in params and n not in names]
    if free:
        raise ValueError('sample: expected every input the network reads in it (%s), found %s '
                         'read but not given (an input left out of the sample, or a list of '
                         'states too short?)' % (', '.join(names), ', '.join(free)))


def _shards(blocks, graph, plan, owner):
    """``(owner, shard_of)``: each tensor-parallel shard's device index in its
    stage, its weight's owner moved to its layer's stage (``graph``: a whole
    network's labelled graph, ``None`` for a block list). Raises
    DeviceSpecError for a stage of several devices but not as many as a
    layer's shards."""
    widths = [plan.width(s) for s in range(plan.num_stages)]
    owner, shard_of = dict(owner), {}
    # A branch on the form: a cut network has no blocks per stage,
    # so its shards are read from the labelled graph; a block list's come
    # from its layers without a trace (its blocks need not run on Symbols),
    # a tied shard staying with the owner tied= chose, and a refusal naming
    # the layer.
    if graph is not None:
        for node in graph.variables:
            if node.layer is not None and node.name in owner:
                # a shard's weight goes where shard_groups put its layer
                owner[node.name], shard_of[node.name] = node.stage, node.shard
        return owner, shard_of
    for block, stage in zip(blocks, plan.stage_of_layer):
        for layer in tensor_parallel.sharded_blocks(block):
            try:
                indices = layer.device_indices(widths[stage])
            except ValueError as err:
                raise DeviceSpecError('%s in %s: %s' % (layer.name, stage_name(stage), err)) \
                    from None
            for index, params in zip(indices, layer.shard_params):
                for param in params.values():
                    # a tied parameter sits where its owning stage puts it
                    if owner[param.name] == stage or param.name not in shard_of:
                        shard_of[param.name] = index
    return owner, shard_of