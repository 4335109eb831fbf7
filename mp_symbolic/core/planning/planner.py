"""The plan chosen for you: ``Pipeline(..., plan='auto', memory_per_device=...)``.

The candidates are every plan of the given devices the Pipeline can run:
stages ``K``, shards ``S`` per stage and replicas ``R`` (``K x S x R`` of the
devices, in order), the balance by parameter count and by measured time,
``chunks``, the schedule, ``mirror`` and, where ``Pipeline`` takes it,
``shard_optimizer``. Each is scored on memory
(:func:`~mp_symbolic.core.planning.estimate.estimate`'s largest device
against the budget) and on step time (each stage graph's measured passes,
the schedule's actions simulated over them on the capacity the devices
share, :class:`Timings`). The candidates that fit rank by predicted step
time (then memory), the others follow by memory; a budget none fits raises
:class:`PlanError`. docs/planning.md ("The plan chosen for you") describes
the model.
"""
from dataclasses import dataclass, field, replace
import inspect
import itertools
import os

import mxnet as mx
import numpy as np

from .. import schedule as schedules
from ..base.checks import excerpt
from ..base.timing import repeat
from .sizes import format_size, parse_size

__all__ = []

AUTO = 'auto'
# the rule of a plan whose balance by parameter count splits the blocks as
# its balance by measured time does (scored once)
SIZE_TIME = 'size=time'

class PlanError(ValueError):
    """A budget no candidate plan fits, or planner arguments that cannot work."""


@dataclass(frozen=True)
class Candidate:
    """One plan: the Pipeline arguments the planner chooses.

    Attributes:
        devices: ``'cpu:0,cpu:1'`` (stages x replicas), a stage's shards joined
            by ``+``.
        stages, replicas, chunks: ``K``, ``R`` and ``M``.
        schedule: A name of :data:`~mp_symbolic.core.schedule.NAMES`, with
            its default stages per device (``virtual``).
        mirror: Every stage recomputed in the backward pass.
        balance: Blocks (ops) per stage; ``None``: by parameter count.
        rule: How ``balance`` was made: ``'size'``, ``'time'``, or
            ``'size=time'`` (by parameter count, which splits the blocks as
            the measured times do: one plan under both rules).
        shard_optimizer: ZeRO-1 over the replicas (``None``: not an option of
            this Pipeline).
        shards: Devices per stage (``S``), one tensor-parallel shard each.
        tensor_parallel: ``'auto'`` where the Pipeline shards the layers
            itself (:mod:`~mp_symbolic.core.parallel.autotp`), else ``None``.
    """
    devices: str
    stages: int
    replicas: int
    chunks: int
    schedule: str
    mirror: bool = False
    balance: tuple = None
    rule: str = 'size'
    shard_optimizer: bool = None
    shards: int = 1
    tensor_parallel: str = None

    def pipeline_args(self):
        """``Pipeline``'s keyword arguments for this plan (with ``devices``)."""
        args = dict(devices=self.devices, balance=None if self.balance is None
                    else list(self.balance), chunks=self.chunks, replicas=self.replicas,
                    mirror=self.mirror, schedule=self.schedule,
                    virtual=self.virtual if self.schedule in schedules.VIRTUAL else None)
        if self.shard_optimizer is not None:
            args['shard_optimizer'] = self.shard_optimizer
        if self.tensor_parallel is not None:
            args['tensor_parallel'] = self.tensor_parallel
        return args

    @property
    def virtual(self):
        """Stages per device: its schedule's default (one for a schedule that
        takes none)."""
        return schedules.kind(self.schedule).virtual_default or 1

    def flags(self):
        """The ``train`` flags of this plan."""
        words = ['--devices %s' % self.devices]
        if self.balance is not None:
            words.append('--balance %s' % ','.join(map(str, self.balance)))
        words.append('--schedule %s' % self.schedule)
        if self.schedule in schedules.VIRTUAL:
            words.append('--virtual %d' % self.virtual)
        words.append('--chunks %d' % self.chunks)
        if self.replicas > 1:
            words.append('--replicas %d' % self.replicas)
        if self.mirror:
            words.append('--mirror')
        if self.shard_optimizer:
            words.append('--shard-optimizer')
        return ' '.join(words)

    def __str__(self):
        return self.flags()

    def label(self):
        """The plan as the ranked tables show it: its :meth:`flags`, then
        ``(rule size=time)`` where both balances split its blocks alike."""
        return self.flags() + (' (rule %s)' % self.rule if self.rule == SIZE_TIME else '')


@dataclass
class Scored:
    """A :class:`Candidate` with its predicted ``memory`` (``{device:
    bytes}``), ``seconds`` of a step, and whether it ``fits`` the budget
    (``True`` without one)."""
    candidate: Candidate
    memory: dict
    seconds: float
    fits: bool = True

    @property
    def largest(self):
        """The most bytes any device holds."""
        return max(self.memory.values())


@dataclass
class Ranking:
    """The scored candidates, best first, and why the first won.

    Attributes:
        ranked: :class:`Scored` s: those that fit by step time (then memory),
            then the others by memory.
        budget: Bytes per device, or ``None``.
        skipped: Candidates with recomputation or ZeRO left unscored, the same
            plan without them fitting.
        merged: Candidates balanced by time that split the blocks as the same
            plan balanced by size does, scored once as that plan (its rule
            ``'size=time'``).
        timings: The :class:`Timings` of the step times.
        failed: ``[(candidate, MXNet's last line)]`` of those MXNet could not
            bind or run (left out).
    """
    ranked: list
    budget: int = None
    skipped: int = 0
    merged: int = 0
    timings: object = field(default=None, repr=False)
    failed: list = field(default_factory=list)

    @property
    def best(self):
        """The chosen :class:`Scored`."""
        return self.ranked[0]

    @property
    def smallest(self):
        """The least memory (its largest device's) any candidate needs."""
        return min(s.largest for s in self.ranked)

    def why(self):
        """One sentence: why the first candidate won."""
        best, fitting = self.best, [s for s in self.ranked if s.fits]
        within = ('of the %d plans within %s per device' % (len(fitting), format_size(self.budget))
                  if self.budget is not None else 'of %d plans (no memory budget)' % len(fitting))
        words = ['the least predicted step time (%.2f ms) %s' % (best.seconds * 1e3, within)]
        if len(fitting) > 1:
            after = fitting[1]
            words.append('the next (%s) is predicted %.1f%% slower'
                         % (after.candidate.label(), 100 * (after.seconds / best.seconds - 1)))
        faster = [s for s in self.ranked if not s.fits and s.seconds < best.seconds]
        if faster:
            quickest = min(faster, key=lambda s: s.seconds)
            words.append('%d faster plan(s) need more memory (the fastest, %.2f ms, %s on a '
                         'device)' % (len(faster), quickest.seconds * 1e3,
                                      format_size(quickest.largest)))
        return '; '.join(words)

    def lines(self, limit=None):
        """The ranked table, one line per candidate, then why the first won."""
        shown = self.ranked if limit is None else self.ranked[:limit]
        width = max(len(s.candidate.label()) for s in shown)
        out = ['  rank  %s  memory (largest device)  step (predicted)  fits'
               % 'plan'.ljust(width)]
        for i, s in enumerate(shown, 1):
            out.append('  %-4d  %s  %-23s  %-16s  %s'
                       % (i, s.candidate.label().ljust(width), format_size(s.largest),
                          '%.2f ms' % (s.seconds * 1e3), 'yes' if s.fits else 'no'))
        if len(shown) < len(self.ranked):
            out.append('  ... %d more' % (len(self.ranked) - len(shown)))
        out.append('chosen: %s: %s' % (self.best.candidate.label(), self.why()))
        return out


def takes_shard_optimizer():
    """Whether ``Pipeline`` takes ``shard_optimizer`` (ZeRO-1 is then a
    dimension of the candidates)."""
    from ..pipeline import Pipeline  # pylint: disable=import-outside-toplevel
    return 'shard_optimizer' in inspect.signature(Pipeline.__init__).parameters


class Planner:
    """What the planner plans for, and the space it searches.

    ``Pipeline(..., plan='auto')`` is ``plan=Planner()``: a softmax head and SGD
    with momentum 0.9.

    Args:
        loss, output: The loss head, as :meth:`~mp_symbolic.Pipeline.module`
            takes them.
        label_name, label_shapes: The label's name and ``[(name, shape)]`` of
            the whole batch (default: as the loss head infers them).
        optimizer, optimizer_params: As ``init_optimizer`` takes them.
        chunks: The micro-batch counts to try (those dividing the batch by the
            replicas).
        schedules: The schedules to try.
        mirror: Whether recomputation is tried (where a plan does not fit
            without it).
        balances: ``'size'`` (by parameter count) and/or ``'time'`` (by each
            block's measured time; block lists only).
        stages, replicas: The counts to try (default: every count the devices
            allow).
        shards: The devices per stage to try (default: 1, the shards of the
            network's tensor-parallel layers, and under
            ``tensor_parallel='auto'`` each count autotp shards a layer over).
        shard_optimizer: Whether ZeRO-1 is tried, where the Pipeline takes it
            and there are replicas.
        repeats: Timed passes of each stage graph (the fastest counts).

    Raises:
        PlanError: a value that cannot be a space.
    """

    def __init__(self, loss='softmax', output=None, label_name=None, label_shapes=None,
                 optimizer='sgd', optimizer_params=None, chunks=(1, 2, 4, 8),
                 schedules=schedules.NAMES, mirror=True, balances=('size', 'time'),
                 stages=None, replicas=None, shard_optimizer=True, repeats=5, shards=None):
        self.loss, self.output = loss, output
        self.label_name, self.label_shapes = label_name, label_shapes
        self.optimizer = optimizer
        self.optimizer_params = dict({'momentum': 0.9} if optimizer == 'sgd' and
                                     optimizer_params is None else optimizer_params or {})
        self.chunks = tuple(chunks)
        self.schedules = tuple(schedules)
        for name in self.schedules:
            if name not in schedules_named():
                raise PlanError('schedules: expected names of %s, found %r'
                                % (', '.join(schedules_named()), name))
        self.mirror = bool(mirror)
        self.balances = tuple(balances)
        if not self.balances or set(self.balances) - {'size', 'time'}:
            raise PlanError("balances: expected 'size' and/or 'time', found %r"
                            % (self.balances,))
        self.stages = None if stages is None else tuple(stages)
        self.replicas = None if replicas is None else tuple(replicas)
        self.shards = None if shards is None else tuple(shards)
        if self.shards is not None and (not self.shards or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.shards)):
            raise PlanError('shards: expected positive integers (devices per stage), found %r'
                            % (self.shards,))
        self.shard_optimizer = bool(shard_optimizer)
        self.repeats = repeats

    def choose(self, blocks, devices, sample, memory_per_device=None, batch_axis=0,
               data_shapes=None, tensor_parallel=None):
        """The candidates of ``blocks`` on ``devices``, ranked.

        Args:
            blocks: The network, as ``Pipeline`` takes it (never changed).
            devices: One device each (``'cpu:0,cpu:1'`` or contexts); a plan uses
                the first ``K x S x R`` of them.
            sample: The batch, as ``Pipeline`` takes it: its batch size is the step's.
            memory_per_device: The budget: bytes, a size string
                (:func:`parse_size`), or ``None``.
            data_shapes: ``[(input name, shape)]`` of the batch (default: ``sample``'s).
            tensor_parallel: ``None``, or ``'auto'``: the candidates' shards include
                every count autotp shards a layer over.

        Returns:
            A :class:`Ranking`.

        Raises:
            PlanError: no candidate fits the budget (naming the smallest memory
                one needs) or none can be made; ``tensor_parallel`` other than
                ``None`` and ``'auto'``; a named loss without ``Planner(output=k)``
                for a network of several outputs.
            ValueError: a budget :func:`parse_size` refuses, devices that cannot
                be read.
        """
        # pylint: disable=import-outside-toplevel
        from ..placement.devices import parse_devices
        from .estimate import batched_binds
        if tensor_parallel is not None and not (isinstance(tensor_parallel, str) and
                                                tensor_parallel == AUTO):
            raise PlanError("tensor_parallel: expected None or 'auto' for the planner (it "
                            "chooses the shards), found %s" % excerpt(repr(tensor_parallel)))
        budget = None if memory_per_device is None else parse_size(memory_per_device)
        pool = _flat_devices(parse_devices(devices) if isinstance(devices, str) else devices)
        search = _Search(self, blocks, pool, sample, batch_axis, data_shapes, tensor_parallel)
        with batched_binds():
            ranking = search.run(budget)
        if not ranking.best.fits:
            raise PlanError('memory_per_device: expected a budget a plan fits, found %s (%d '
                            'bytes) below the smallest memory any of the %d candidate plans '
                            'needs on a device: %s (%d bytes, %s)'
                            % (format_size(budget), budget, len(ranking.ranked),
                               format_size(ranking.smallest), ranking.smallest,
                               min(ranking.ranked, key=lambda s: s.largest).candidate))
        return ranking


def schedules_named():
    """The schedules the planner can try."""
    return schedules.NAMES


def _flat_devices(devices):
    flat = []
    for device in devices:
        if isinstance(device, (tuple, list)):
            raise PlanError('devices: expected one device per entry for the planner (it '
                            'chooses stages, shards and replicas), found a stage of %d devices'
                            % len(device))
        flat.append(device)
    return flat


def _check_output(planner, pipe):
    """Refuses (:class:`PlanError`) a named loss without ``Planner(output=k)``
    in range, for a network of several outputs."""
    count = len(pipe.training_graph(None, chunks=1).heads)
    output, loss = planner.output, planner.loss
    named = not callable(loss) or isinstance(loss, str)
    if named and count > 1 and (not isinstance(output, int) or isinstance(output, bool)
                                or not 0 <= output < count):
        raise PlanError('output: expected plan=Planner(output=k), k the index of the output '
                        'the loss reads (the network has %d outputs, 0 to %d), found %s'
                        % (count, count - 1, excerpt(repr(output))))


def _spec(devices, shards=1):
    """The device spec of ``devices`` in order, ``shards`` to a stage (``+``)."""
    names = ['%s:%d' % (d.device_type, d.device_id) for d in devices]
    return ','.join('+'.join(names[i:i + shards]) for i in range(0, len(names), shards))


def _tree(block):
    """``block`` and every block under it, in order."""
    yield block
    for child in block._children.values():  # pylint: disable=protected-access
        yield from _tree(child)


def _declared_shards(blocks):
    """The shard counts (above 1) of the tensor-parallel layers in ``blocks``."""
    from ..parallel.tensor_parallel import ShardedBlock  # pylint: disable=import-outside-toplevel
    return {b.shards for top in blocks for b in _tree(top)
            if isinstance(b, ShardedBlock) and b.shards > 1}


def _structure_copy(network):
    """A copy of ``network`` (a block or a list of blocks) sharing nothing
    with it: its blocks and parameters' names and shapes, no values."""
    import copy  # pylint: disable=import-outside-toplevel
    tops = list(network) if isinstance(network, (list, tuple)) else [network]
    memo = {}
    for top in tops:
        for block in _tree(top):
            if getattr(block, '_cached_op', None) is not None:
                memo[id(block._cached_op)] = None  # pylint: disable=protected-access
            for param in block._reg_params.values():  # pylint: disable=protected-access
                for name in ('_data', '_grad', '_deferred_init', '_trainer'):
                    value = getattr(param, name, None)
                    if value:
                        memo[id(value)] = () if name == '_deferred_init' else None
    copied = copy.deepcopy(network, memo)
    for top in (list(copied) if isinstance(copied, (list, tuple)) else [copied]):
        for block in _tree(top):
            block._clear_cached_op()  # pylint: disable=protected-access
    return copied


class _Search:
    """One planning: the candidates, their estimates and their times."""

    def __init__(self, planner, blocks, pool, sample, batch_axis, data_shapes,
                 tensor_parallel=None):
        from ..pipeline import Pipeline, _as_blocks  # pylint: disable=import-outside-toplevel
        self.planner, self.pool, self.sample = planner, pool, sample
        self.tensor_parallel = tensor_parallel
        self.sharded = {}  # shards -> the network's copy autotp sharded (tensor_parallel='auto')
        self.batch_axis = batch_axis
        self.whole = isinstance(blocks, mx.gluon.HybridBlock) and \
            not isinstance(blocks, mx.gluon.nn.HybridSequential)
        self.network = blocks
        self.blocks = blocks if self.whole else _as_blocks(blocks)
        self.count = None if self.whole else len(self.blocks)
        one = Pipeline(self.network, pool[:1], sample=sample, batch_axis=batch_axis)
        _check_output(planner, one)
        if data_shapes is None:
            from ..placement.place import sample_inputs  # pylint: disable=import-outside-toplevel
            shapes, _ = sample_inputs(sample)
            if shapes is None:
                raise PlanError("sample: expected the batch (a shape or arrays) for "
                                "plan='auto', found None")
            data_shapes = list(zip(one.data_names(), shapes))
        self.data_shapes = [(n, tuple(s)) for n, s in data_shapes]
        self.batch = self.data_shapes[0][1][batch_axis]
        self.label_shapes = planner.label_shapes
        self.timings = Timings(self, one)
        self.zero = planner.shard_optimizer and takes_shard_optimizer()
        self.failed = []
        self.keys = {}  # id(Scored) -> (its stages' keys into Timings.stage, stages)
        self.balance = {}  # id(Scored) -> the blocks per stage its Pipeline made
        self.shard_counts = self._shard_counts()

    def pipeline(self, candidate):
        """``candidate``'s Pipeline (on the network's sharded copy under autotp)."""
        from ..pipeline import Pipeline  # pylint: disable=import-outside-toplevel
        args = candidate.pipeline_args()
        network = self.network
        if args.pop('tensor_parallel', None) is not None and candidate.shards > 1:
            network = self.sharded[candidate.shards]
        return Pipeline(network, sample=self.sample, batch_axis=self.batch_axis, **args)

    def _shard_counts(self):
        """The devices per stage to try, of the planner's ``shards``: 1, the
        network's tensor-parallel shards and, under ``tensor_parallel='auto'``, each
        count autotp shards a layer over (its copy kept in :attr:`sharded`)."""
        wanted = self.planner.shards
        counts = {1} | _declared_shards(self.blocks if not self.whole else [self.network])
        if self.tensor_parallel == AUTO:
            for shards in range(2, len(self.pool) + 1):
                if wanted is None or shards in wanted:
                    copied = self._autotp_copy(shards)
                    if copied is not None:
                        self.sharded[shards] = copied
                        counts.add(shards)
        return sorted(c for c in counts if c <= len(self.pool) and (wanted is None or c in wanted))

    def _autotp_copy(self, shards):
        """A :func:`_structure_copy` of the network with the layers autotp
        shards over ``shards`` devices swapped, or ``None`` where it shards none."""
        # pylint: disable=import-outside-toplevel
        from ..graph import build, nesting
        from ..graph.names import input_names
        from ..parallel import autotp
        from ..parallel.tensor_parallel import ShardedBlock
        from ..placement.place import sample_inputs
        from ..pipeline import _as_blocks
        copied = _structure_copy(self.network)
        blocks = [copied] if self.whole else _as_blocks(copied)
        before = {id(b) for top in blocks for b in _tree(top) if isinstance(b, ShardedBlock)}
        shapes, nested = sample_inputs(self.sample)
        names = tuple(input_names(1 if shapes is None else len(shapes)))
        names = names if nested is None else nesting.unflatten(nested, names)
        if shapes is not None:
            build.infer_shapes(blocks, shapes, names)
        stage = [tuple(self.pool[:shards])]
        blocks, _ = autotp.apply(blocks, AUTO, stage, names)
        if not any(isinstance(b, ShardedBlock) and id(b) not in before
                   for top in blocks for b in _tree(top)):
            return None
        return blocks[0] if self.whole else blocks

    def candidates(self):
        """Every plan without recomputation or ZeRO, the devices allow."""
        n = len(self.pool)
        planner = self.planner
        out, tp = [], self.tensor_parallel
        for s, k in itertools.product(self.shard_counts, planner.stages or range(1, n + 1)):
            for r in planner.replicas or range(1, n // (k * s) + 1):
                if k * s * r > n or (self.count is not None and k > self.count):
                    continue
                spec = _spec(self.pool[:k * s * r], s)
                balances = self.timings.balances(k) if k > 1 else [(None, 'size')]
                for name in planner.schedules:
                    kind = schedules.kind(name)
                    if not kind.fused and k == 1:
                        continue  # one stage: the stage runtime adds nothing to the fused graph
                    num_stages = k * (kind.virtual_default or 1)
                    if self.count is not None and num_stages > self.count:
                        continue
                    plans = balances if num_stages == k else self.timings.balances(num_stages)
                    for m in planner.chunks:
                        if self.batch % (m * r) or not kind.takes(k, m) or \
                                (not kind.fused and m == 1):
                            continue
                        for balance, rule in plans:
                            out.append(Candidate(spec, k, r, m, name, False, balance,
                                                 rule, False if self.zero else None, s, tp))
        return out

    def run(self, budget):
        scored, skipped, merged = [], 0, 0
        by_size = {}  # a plan balanced by size -> (the blocks per stage it made, its Scored s)
        for candidate in self.candidates():
            same = replace(candidate, balance=None, rule='size')
            if candidate.rule == 'time' and same in by_size and \
                    by_size[same][0] == candidate.balance:
                for found in by_size[same][1]:  # one plan under both rules: scored once
                    found.candidate = replace(found.candidate, rule=SIZE_TIME)
                merged += 1
                continue
            base = self.score(candidate, budget)
            if base is None:
                continue
            scored.append(base)
            if candidate.rule == 'size':
                by_size[candidate] = (self.balance.pop(id(base)), [base])
            relief = []
            if self.zero and candidate.replicas > 1:
                relief.append(replace(candidate, shard_optimizer=True))
            if self.planner.mirror:
                relief.append(replace(candidate, mirror=True))
                if self.zero and candidate.replicas > 1:
                    relief.append(replace(candidate, mirror=True, shard_optimizer=True))
            for other in relief:
                if base.fits:
                    skipped += 1
                    continue
                found = self.score(other, budget)
                if found is not None:
                    scored.append(found)
                    if candidate in by_size:
                        by_size[candidate][1].append(found)
        self.timings.retime()
        self.timings.fit_steps()
        for found in scored:
            found.seconds = self.timings.predict(found.candidate, *self.keys[id(found)])
        if not scored:
            raise PlanError('plan: expected at least one candidate plan of %d device(s), '
                            'found none the batch of %d divides' % (len(self.pool), self.batch))
        ranked = sorted(scored, key=lambda s: (not s.fits, s.seconds if s.fits else s.largest,
                                               s.largest))
        return Ranking(ranked, budget, skipped, merged, self.timings, self.failed)

    def score(self, candidate, budget):
        """The candidate scored, or ``None`` where MXNet cannot bind or run
        one of its graphs (counted in :attr:`failed`, with its first line)."""
        from .estimate import estimate  # pylint: disable=import-outside-toplevel
        planner = self.planner
        try:
            pipe = self.pipeline(candidate)
            keys = self.timings.stage_keys(
                pipe, self.batch // (candidate.chunks * candidate.replicas))
            seconds = self.timings.predict(candidate, keys, pipe.plan.num_stages)
            table = estimate(pipe, self.data_shapes, self.label_shapes, loss=planner.loss,
                             output=planner.output, label_name=planner.label_name,
                             optimizer=planner.optimizer,
                             optimizer_params=planner.optimizer_params)
        except (mx.base.MXNetError, RuntimeError, ValueError) as err:
            lines = [line for line in str(err).splitlines() if line.strip()]
            self.failed.append((candidate, lines[-1] if lines else type(err).__name__))
            return None
        memory = {d: row['total'] for d, row in table.items()}
        scored = Scored(candidate, memory, seconds,
                        budget is None or max(memory.values()) <= budget)
        self.keys[id(scored)] = (keys, pipe.plan.num_stages)
        self.balance[id(scored)] = tuple(pipe.balance)
        return scored


class Timings:
    """The times the simulation runs on, each measured once.

    Attributes:
        capacity: ``{k: how many times one device's work k busy devices
            do at once}`` (``k`` where they share nothing).
        update, add: Seconds per element of the optimizer's update, and of
            summing one replica's gradient into another.
        stage: ``{key: (forward, backward) seconds}`` of each stage graph.
        pipelined: ``{'graph' or 'staged': capacity}`` of two devices while one
            replica's stages run on them (:meth:`fit_steps`).
        steps: ``{'graph', 'chunk', 'chunks', 'replica', 'split', 'mirror',
            'staged', 'action'}``: the seconds beyond the simulated work
            (:meth:`calibrate`); ``'chunks'`` ``{micro-batches: seconds}`` of
            GPipe's one graph beyond one micro-batch's at each count probed
            (less where more micro-batches keep the device's thread busy while
            the step's Python runs), ``'chunk'`` each one's past the last,
            ``'mirror'`` each recomputed micro-batch's past the first in that
            graph beyond its stage graphs' recomputation.
    """

    def __init__(self, search, one):
        self.search = search
        self.stage = {}
        self._binds = {}
        self._micro = {}
        self._balances = {}
        self._block_times = {}
        self.params = sum(int(np.prod(p.shape)) for p in one.collect_params().values()
                          if p.grad_req != 'null')
        self.capacity = self._capacity(one)
        self.update, self.add = self._element_costs()
        self.steps = None
        self.pipelined = {}
        self.calibrate()

    # -- measured once ---------------------------------------------------------

    def _capacity(self, one):
        """``{k: k x t1 / tk}``: the whole network's step of one micro-batch
        on ``k`` devices at once against one, the median of rounds timed in turn
        (``k`` for GPUs); between 1 and ``min(k,`` :func:`_cores` ``)``."""
        pool = self.search.pool
        capacity = {1: 1.0}
        cpus = [d for d in pool if d.device_type == 'cpu']
        for k in range(2, len(pool) + 1):
            capacity[k] = float(k)
        if len(cpus) < 2:
            return capacity
        from ..engine.stages import variable_specs  # pylint: disable=import-outside-toplevel
        placed = self._training_graph(one)
        symbol = _stage_symbol(placed)
        shapes = dict(self._micro_inputs(one, self.search.batch))
        runs = [_StageRun(symbol, shapes, variable_specs(symbol, shapes, _float32(shapes))[1], d,
                          set(shapes))
                for d in cpus]
        steps = {1: runs[0].step}
        for k in range(2, len(cpus) + 1):
            steps[k] = lambda k=k: [r.step(wait=False) for r in runs[:k]]
        times = repeat(steps, 3 * max(3, self.search.planner.repeats), warmup=2)
        cores = _cores()
        for k in range(2, len(cpus) + 1):
            ratios = [k * alone / together for alone, together in zip(times[1], times[k])]
            capacity[k] = min(float(k), float(max(1, cores)),
                              max(1.0, float(np.median(ratios))))
        return capacity

    def _element_costs(self):
        """Seconds per element of the optimizer's update and of an add."""
        planner = self.search.planner
        size = int(min(max(self.params, 1 << 16), 1 << 22))
        ctx = self.search.pool[0]
        weight = mx.nd.ones((size,), ctx=ctx)
        grad = mx.nd.ones((size,), ctx=ctx) * 1e-3
        optimizer = mx.optimizer.create(planner.optimizer, learning_rate=0.0,
                                        **planner.optimizer_params)
        updater = mx.optimizer.get_updater(optimizer)
        repeats = max(3, planner.repeats)
        update = min(_timed(lambda: updater(0, grad, weight), repeats))
        other = mx.nd.zeros((size,), ctx=ctx)
        add = min(_timed(lambda: other.__iadd__(grad), repeats))
        return update / size, add / size

    # -- per plan ---------------------------------------------------------------

    def balances(self, num_stages):
        """The ``[(blocks per stage or None, rule)]`` of ``num_stages``
        stages: by parameter count (``None``), and by measured time (block
        lists), the latter a candidate of its own even where it splits the
        blocks as the former does, so that which plans are considered does
        not depend on the times measured (such a pair is scored once, its
        rule ``'size=time'``)."""
        key = num_stages
        if key not in self._balances:
            # pylint: disable=import-outside-toplevel
            from ..placement.balance import BalanceError, solve
            found = []
            if 'size' in self.search.planner.balances:
                found.append((None, 'size'))
            if 'time' in self.search.planner.balances and not self.search.whole:
                try:
                    found.append((tuple(solve(self._per_block(), num_stages)), 'time'))
                except BalanceError:
                    pass
            self._balances[key] = found
        return self._balances[key]

    def _per_block(self):
        if not self._block_times:
            # pylint: disable-next=import-outside-toplevel
            from ..placement.balance import forward_backward_times
            shape = self.search.data_shapes[0][1]
            self._block_times['all'] = forward_backward_times(
                self.search.blocks, shape, self.search.pool[0],
                repeats=self.search.planner.repeats)
        return self._block_times['all']

    def _training_graph(self, pipe):
        planner = self.search.planner
        return pipe.training_graph(planner.loss, label_name=_label(planner), chunks=1,
                                   output=planner.output)

    def _micro_inputs(self, pipe, size):
        """``[(name, shape)]`` of the inputs and labels of one micro-batch of ``size``."""
        axis = self.search.batch_axis
        shapes = [(n, s[:axis] + (size,) + s[axis + 1:]) for n, s in self.search.data_shapes]
        labels = self.search.label_shapes
        if labels:
            shapes += [(n, tuple(s)[:axis] + (size,) + tuple(s)[axis + 1:]) for n, s in labels]
        return shapes

    def stage_times(self, pipe, micro):
        """``[(forward, backward)]`` seconds of each stage of ``pipe`` on a
        micro-batch of ``micro``, each graph bound alone and measured once."""
        return [self.stage[key] if key else (0.0, 0.0) for key in self.stage_keys(pipe, micro)]

    def stage_keys(self, pipe, micro):
        """:meth:`stage_times`' keys into :attr:`stage` (``None`` for a
        stage with no graph), each graph measured if it was not yet."""
        # pylint: disable=import-outside-toplevel
        from ..graph.passes import cut
        from ..engine.stages import boundary_specs, variable_specs
        placed = self._training_graph(pipe)
        stages = cut(placed, pipe.plan.num_stages)
        given = dict(self._micro_inputs(pipe, micro))
        symbol = placed.to_symbol()
        shapes = {n: s for n, s in given.items() if n in symbol.list_arguments()}
        label = _label(self.search.planner)
        if label in symbol.list_arguments() and label not in shapes:
            shapes = _with_label(symbol, shapes, label)
        specs = variable_specs(symbol, shapes, _float32(shapes))
        boundary = boundary_specs(stages, specs)
        group2ctx = pipe.plan.group2ctxs[0]
        from ..graph.names import parse_group, stage_name  # pylint: disable=import-outside-toplevel
        keys = []
        for graph in stages:
            if graph.graph is None:
                keys.append(None)
                continue
            stage_symbol = _stage_symbol(graph.graph)
            received = {name: boundary[entry] for name, _, entry in graph.receives}
            bound, types = {}, {}
            for name in stage_symbol.list_arguments():
                if name in received:
                    bound[name], types[name] = received[name]
                elif name in shapes:
                    bound[name], types[name] = specs[0][name], specs[1][name]
            device = group2ctx[stage_name(graph.stage)]
            groups = {g: d for g, d in group2ctx.items() if parse_group(g)[0] == graph.stage}
            # a stage's shards on other devices are another binding of the same graph
            where = str(device) if all(d == device for d in groups.values()) else \
                '+'.join(str(groups[g]) for g in sorted(groups, key=parse_group))
            key = (stage_symbol.tojson(), tuple(sorted(bound.items())), where)
            if key not in self.stage:
                spec = (stage_symbol, bound, types, device,
                        {n for n in bound if n not in received}, groups)
                self.stage[key] = _StageRun(*spec).times(self.search.planner.repeats)
                self._binds[key] = spec
                self._micro[key] = micro
            keys.append(key)
        return keys

    def retime(self):
        """Every stage graph bound anew, all at once, and timed in turn
        (``timing.repeat``), each keeping the faster forward pass and the
        faster forward and backward passes of its two times, its backward
        the latter less the former (so that a forward slowed in one timing
        leaves no backward shorter than any step measured)."""
        runs = {key: _StageRun(*spec) for key, spec in self._binds.items()}
        repeats = self.search.planner.repeats
        forwards = repeat({key: run.forward for key, run in runs.items()}, repeats, passes=3)
        both = repeat({key: run.step for key, run in runs.items()}, repeats, passes=3)
        for key in runs:
            forward, backward = self.stage[key]
            fastest = min(forward, min(forwards[key]))
            step = min(forward + backward, min(both[key]))
            self.stage[key] = (fastest, max(0.0, step - fastest))
        self._bound_by_size()

    def _bound_by_size(self):
        """Each graph's times bounded by the same graph's at other
        micro-batch sizes: no longer than on more examples, nor more than in
        proportion to what it takes on fewer. As :meth:`retime`, the bound
        keeps the fastest forward pass and the fastest forward and backward
        passes, its backward the latter less the former: bounding the two
        apart could join one size's forward to another's backward, faster
        than any step of any size."""
        graphs = {}
        for key, micro in self._micro.items():
            graphs.setdefault((key[0], key[2]), []).append((micro, key))
        for sizes in graphs.values():
            sizes.sort()
            for i, (micro, key) in enumerate(sizes):
                bounds = [self.stage[key]]
                bounds += [self.stage[k] for _, k in sizes[i + 1:]]  # more examples
                bounds += [tuple(t * micro / m for t in self.stage[k]) for m, k in sizes[:i]]
                forward = min(b[0] for b in bounds)
                step = min(b[0] + b[1] for b in bounds)
                self.stage[key] = (forward, max(0.0, step - forward))

    def step(self, candidate, pipe):
        """The predicted seconds of one training step of ``candidate``."""
        micro = self.search.batch // (candidate.chunks * candidate.replicas)
        return self.predict(candidate, self.stage_keys(pipe, micro), pipe.plan.num_stages)

    def predict(self, candidate, keys, num_stages, overhead=True, capacity=None):
        """The predicted seconds of one step of ``candidate`` on stage times
        :attr:`stage` ``[keys]`` (the simulated work alone without ``overhead``),
        on devices sharing ``capacity`` (default :attr:`capacity`; ``{}``: nothing)."""
        times = [self.stage[key] if key else (0.0, 0.0) for key in keys]
        made = schedules.make(candidate.schedule, num_stages, candidate.chunks,
                              candidate.virtual)
        kinds = {}
        for s, (forward, backward) in enumerate(times):
            kinds[(s, 'F')], kinds[(s, 'B')] = forward, backward
        span = simulate(made, kinds, candidate.replicas,
                        self.shared(candidate) if capacity is None else capacity,
                        candidate.shards)
        r = candidate.replicas
        update = self.params * self.update
        if candidate.shard_optimizer:
            update = update / r + self.params * self.add
        reduce = 2 * r * self.params * self.add if r > 1 else 0.0
        return span + update + reduce + (self.overhead(candidate, made) if overhead else 0.0)

    def overhead(self, candidate, made):
        """The seconds a step takes beyond its simulated work (:attr:`steps`)."""
        if self.steps is None:
            return 0.0
        steps = self.steps
        extra = (candidate.replicas - 1) * steps['replica']
        if made.fused:
            mirror = (candidate.chunks - 1) * steps['mirror'] if candidate.mirror else 0.0
            return max(0.0, steps['graph'] + self.chunk_cost(candidate.chunks) +
                       (candidate.stages - 1) * steps['split'] + mirror + extra)
        actions = candidate.replicas * sum(len(a) for a in made)
        action = steps['action']
        # a schedule without a probe: the first probed (one stage per device, then several)
        per = action.get(candidate.schedule, next(iter(action.values()), 0.0))
        return steps['staged'] + per * actions + extra

    def chunk_cost(self, chunks):
        """The seconds GPipe's one graph of ``chunks`` micro-batches takes
        beyond its work and one micro-batch's cost: straight between the
        chunk counts probed (:attr:`steps` ``['chunks']``), beyond the last
        at ``steps['chunk']`` a micro-batch."""
        points = sorted(self.steps.get('chunks', {1: 0.0}).items())
        if chunks >= points[-1][0]:
            return points[-1][1] + (chunks - points[-1][0]) * self.steps['chunk']
        for (m0, c0), (m1, c1) in zip(points, points[1:]):
            if chunks <= m1:
                return c0 + (c1 - c0) * (chunks - m0) / (m1 - m0)
        return points[0][1]

    def shared(self, candidate):
        """The capacity ``candidate``'s devices share: :attr:`capacity`, with
        two devices' from :attr:`pipelined` for one replica of two stages."""
        runtime = 'graph' if schedules.kind(candidate.schedule).fused else 'staged'
        if candidate.stages < 2 or candidate.replicas * candidate.shards > 1 or \
                runtime not in self.pipelined:
            return self.capacity
        found = dict(self.capacity)
        found[2] = self.pipelined[runtime]
        return found

    def calibrate(self):
        """Measures the probes' steps (a few plans on the devices, each where
        the planner's space holds its kind, taken in turn) and sets :attr:`steps`
        and :attr:`pipelined` from them (:meth:`fit_steps`)."""
        search = self.search
        self.steps = None
        pool = search.pool
        planner = search.planner
        # the fused graph's probes, and the stage runtime's (one stage per device)
        fused = next(n for n in schedules.NAMES if schedules.kind(n).fused)
        staged = next(n for n in schedules.NAMES if not schedules.kind(n).fused and
                      schedules.kind(n).virtual_default is None)
        # and a schedule of several stages per device (the interleaved one)
        looped = next((n for n in schedules.NAMES if not schedules.kind(n).fused and
                       (schedules.kind(n).virtual_default or 1) > 1), None)
        probes = {'graph': Candidate(_spec(pool[:1]), 1, 1, 1, fused)}
        chunked = [m for m in (4, 2) if m in planner.chunks and search.batch % m == 0]
        if chunked and any(schedules.kind(name).fused for name in planner.schedules):
            probes['chunks'] = Candidate(_spec(pool[:1]), 1, 1, chunked[0], fused)
            if len(chunked) > 1:  # and fewer: what a micro-batch costs need not be straight
                probes['chunks-%d' % chunked[1]] = Candidate(_spec(pool[:1]), 1, 1,
                                                             chunked[1], fused)
        if len(pool) > 1 and search.batch % 2 == 0 and \
                any(r > 1 for r in planner.replicas or (2,)):
            probes['replica'] = Candidate(_spec(pool[:2]), 1, 2, 1, fused)
        blocks = search.count if search.count is not None else 4
        two = len(pool) > 1 and blocks >= 2 and any(k > 1 for k in planner.stages or (2,))
        if two and any(schedules.kind(name).fused for name in planner.schedules):
            probes['split'] = Candidate(_spec(pool[:2]), 2, 1, 1, fused)
            if chunked:
                probes['fused'] = Candidate(_spec(pool[:2]), 2, 1, chunked[0], fused)
            if chunked and planner.mirror:  # recomputation in the one graph
                probes['mirror'] = Candidate(_spec(pool[:2]), 2, 1, chunked[0], fused,
                                             mirror=True)
        if two and search.batch % 4 == 0 and staged in planner.schedules:
            probes['staged'] = Candidate(_spec(pool[:2]), 2, 1, 4, staged)
            if 2 in planner.chunks:  # and of fewer actions: the runtime's own cost a step
                probes['staged-2'] = Candidate(_spec(pool[:2]), 2, 1, 2, staged)
        virtual = schedules.kind(looped).virtual_default if looped else 0
        if two and looped and blocks >= 2 * virtual and search.batch % 4 == 0 and \
                looped in planner.schedules:
            probes['looped'] = Candidate(_spec(pool[:2]), 2, 1, 4, looped)
        steppers, self._probes = {}, {}
        for name, candidate in probes.items():
            try:
                pipe = search.pipeline(candidate)
                made = pipe.run_schedule()
                keys = self.stage_keys(pipe, search.batch // (candidate.chunks *
                                                              candidate.replicas))
                steppers[name] = _module_stepper(search, pipe, candidate)
            except (mx.base.MXNetError, RuntimeError, ValueError):
                if name == 'graph':
                    raise
                continue  # a plan the network cannot take (a graph of too few ops): no probe
            self._probes[name] = [candidate, keys, pipe.plan.num_stages,
                                  candidate.replicas * sum(len(a) for a in made), None]
        # the probes in turn, so that a burst of other work slows them alike
        for name, times in repeat(steppers, max(3, search.planner.repeats), warmup=2,
                                  passes=3).items():
            self._probes[name][-1] = min(times)
        self.fit_steps()

    def fit_steps(self):
        """:attr:`steps` and :attr:`pipelined` from the probes' measured
        steps less their simulated work on the current stage times (after
        :meth:`fit_capacity`); a schedule without a probe of its own takes the
        first probed one's cost per action."""
        self.fit_capacity()
        self.pipelined = {}
        probes = self._probes
        steps = {'graph': max(0.0, self._gap('graph')), 'chunk': 0.0, 'chunks': {1: 0.0},
                 'replica': 0.0, 'split': 0.0, 'mirror': 0.0, 'staged': 0.0, 'action': {}}
        self.steps = steps
        # a step's own cost as the one graph's, the rest at each chunk count probed (less
        # where more micro-batches keep the device's thread busy while the step's Python
        # runs), then per micro-batch past the last
        for name in [n for n in probes if n.startswith('chunks')]:
            steps['chunks'][probes[name][0].chunks] = self._gap(name) - steps['graph']
        points = sorted(steps['chunks'].items())
        (m0, c0), (m1, c1) = points[-2:] if len(points) > 1 else ((1, 0.0), (1, 0.0))
        steps['chunk'] = max(0.0, (c1 - c0) / (m1 - m0)) if m1 > m0 else 0.0
        if 'replica' in probes:
            steps['replica'] = max(0.0, self._gap('replica') - steps['graph'])
        if 'split' in probes:  # one micro-batch: the stages one after the other
            steps['split'] = max(0.0, self._gap('split') - steps['graph'])
        if 'fused' in probes:
            candidate = probes['fused'][0]
            self.pipelined['graph'] = self._fit_pipelined(
                'fused', steps['graph'] + self.chunk_cost(candidate.chunks) +
                steps['split'])
        if 'mirror' in probes:  # beyond its recomputed stage graphs, per micro-batch past one
            candidate = probes['mirror'][0]
            steps['mirror'] = max(0.0, self._gap('mirror') - steps['graph'] - steps['split'] -
                                  self.chunk_cost(candidate.chunks)) / (candidate.chunks - 1)
        if 'graph' in self.pipelined:
            self.pipelined['staged'] = self.pipelined['graph']
        steps['staged'] = steps['graph']
        if 'staged' in probes and 'staged-2' in probes:
            # two counts of actions: the runtime's own cost a step and an action's, each >= 0
            (a0, g0), (a1, g1) = sorted((probes[n][3], self._gap(n))
                                        for n in ('staged-2', 'staged'))
            per = max(0.0, (g1 - g0) / (a1 - a0)) if a1 > a0 else 0.0
            steps['staged'] = max(0.0, min(g0, g1) if per == 0.0 else g0 - per * a0)
            if steps['staged'] == 0.0 and per > 0.0:
                per = max(0.0, g1) / a1
            steps['action'][probes['staged'][0].schedule] = per
        for name in ('staged', 'looped'):
            candidate, _, _, actions, _ = probes.get(name, (None,) * 5)
            if candidate is not None and candidate.schedule not in steps['action']:
                # a step's own cost as the runtime's, the rest per action
                steps['action'][candidate.schedule] = max(
                    0.0, self._gap(name) - steps['staged']) / actions

    def _gap(self, name):
        """Probe ``name``'s measured step less its predicted step without
        the costs beyond its work (on the capacity its runtime shares)."""
        candidate, keys, num_stages, _, measured = self._probes[name]
        return measured - self.predict(candidate, keys, num_stages, overhead=False)

    def _fit_pipelined(self, name, beyond):
        """The capacity of two devices in ``[0.5, min(2, cores)]`` that makes
        probe ``name``'s simulated work plus ``beyond`` its measured step."""
        candidate, keys, num_stages, _, measured = self._probes[name]
        low, high = 0.5, min(2.0, float(max(1, _cores())))

        def work(capacity):
            shared = dict(self.capacity)
            shared[2] = capacity
            return self.predict(candidate, keys, num_stages, overhead=False,
                                capacity=shared) + beyond
        if work(high) >= measured:
            return high
        if work(low) <= measured:
            return low
        return self._bisect(work, measured, low, high)

    @staticmethod
    def _bisect(work, measured, low, high):
        """The capacity in ``[low, high]`` whose ``work`` is ``measured``
        (``work`` falls as the capacity grows)."""
        for _ in range(40):
            middle = (low + high) / 2
            if work(middle) > measured:
                low = middle
            else:
                high = middle
        return (low + high) / 2

    def fit_capacity(self):
        """:attr:`capacity` ``[2]`` of two stand-in CPU devices from the two
        replicas' probe: its measured step less the per-step cost, update and
        sum of gradients, against the work of devices sharing nothing; between 1
        and ``min(2, cores)``. Unchanged without that probe or on other devices."""
        if 'replica' not in self._probes or \
                any(d.device_type != 'cpu' for d in self.search.pool[:2]):
            return
        candidate, keys, num_stages, _, measured = self._probes['replica']
        graph, graph_keys, graph_stages, _, graph_measured = self._probes['graph']
        per_step = max(0.0, graph_measured - self.predict(graph, graph_keys, graph_stages,
                                                          overhead=False, capacity={}))
        # its work: a span the sharing stretches (both devices busy throughout),
        # then the update and the sum of gradients
        free = self.predict(candidate, keys, num_stages, overhead=False, capacity={})
        span = self.predict(candidate, keys, num_stages, overhead=False,
                            capacity={2: 1.0}) - free
        shared = measured - per_step - (free - span)
        found = 2.0 * span / shared if shared > 0 else 2.0
        self.capacity = dict(self.capacity)
        self.capacity[2] = min(2.0, float(max(1, _cores())), max(1.0, found))


def _module_stepper(search, pipe, candidate):
    """A training step (``forward_backward`` and ``update``) of ``pipe``'s
    Module on a batch of zeros, as a function."""
    planner = search.planner
    label = _label(planner)
    labels = search.label_shapes
    if not labels:
        symbol = pipe.training_symbol(planner.loss, label_name=label, output=planner.output)
        labels = [(label, _with_label(symbol, dict(search.data_shapes), label)[label])]
    mod = pipe.module(loss=planner.loss, output=planner.output, label_name=label)
    mod.bind(data_shapes=search.data_shapes, label_shapes=labels)
    mod.init_params(initializer=mx.init.Uniform(0.01))
    mod.init_optimizer(kvstore='local' if candidate.replicas > 1 else None,
                       optimizer=planner.optimizer,
                       optimizer_params=dict(planner.optimizer_params, learning_rate=0.0))
    device = search.pool[0]
    batch = mx.io.DataBatch([mx.nd.zeros(s, device) for _, s in search.data_shapes],
                            [mx.nd.zeros(s, device) for _, s in labels])

    def step():
        mod.forward_backward(batch)
        mod.update()
    return step


def _label(planner):
    from ..graph.names import LABEL_NAME  # pylint: disable=import-outside-toplevel
    return planner.label_name or LABEL_NAME


def _with_label(symbol, shapes, label):
    """``shapes`` with the loss head's ``label``, its shape as the head infers it."""
    arg_shapes, _, _ = symbol.infer_shape_partial(**shapes)
    found = dict(shapes)
    found[label] = tuple(dict(zip(symbol.list_arguments(), arg_shapes))[label])
    return found


def _float32(shapes):
    return {n: 'float32' for n in shapes}


def _stage_symbol(placed):
    from ..base.compat import lengths_outside_gradient  # pylint: disable=import-outside-toplevel
    return lengths_outside_gradient(placed).to_symbol()


def _cores():
    """The cores this process may run on (its affinity where the host
    tells it, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _timed(fn, repeats):
    return repeat(fn, repeats, warmup=1)


class _StageRun:
    """One graph bound alone on a device with random arrays, to time its
    forward and backward passes."""

    def __init__(self, symbol, shapes, types, device, inputs, group2ctx=None):
        # pylint: disable-next=import-outside-toplevel
        from ..base.compat import embedding_ids, split_bind
        no_gradient = set(embedding_ids(symbol, shapes)) | set(inputs)
        types = {n: t for n, t in types.items() if n in shapes}
        with split_bind(group2ctx, symbol):  # as the stage runtime binds it
            self.exe = symbol.simple_bind(device, grad_req={
                a: 'null' if a in no_gradient or not np.issubdtype(types.get(a, np.float32),
                                                                   np.floating)
                else 'write' for a in symbol.list_arguments()}, type_dict=types or None,
                group2ctx=group2ctx, **shapes)
        rng = np.random.default_rng(0)
        for array in self.exe.arg_arrays + self.exe.aux_arrays:
            array[:] = rng.normal(0.0, 0.1, array.shape) \
                if np.issubdtype(array.dtype, np.floating) else 1
        self.head_grads = [mx.nd.ones(o.shape, ctx=device, dtype=o.dtype)
                           for o in self.exe.outputs]

    def forward(self):
        self.exe.forward(is_train=True)

    def step(self, wait=True):
        self.exe.forward(is_train=True)
        self.exe.backward(out_grads=self.head_grads)
        if wait:
            mx.nd.waitall()

    def times(self, repeats):
        """``(forward, backward)``: the fastest of ``repeats`` passes (the
        least touched by other work on the host), the backward as the step
        less the forward."""
        forward = min(_timed(self.forward, repeats))
        both = min(_timed(self.step, repeats))
        return forward, max(0.0, both - forward)


def simulate(schedule, cost, replicas=1, capacity=None, shards=1):
    """Seconds from the first action's start to the last's end of
    ``schedule`` (a :class:`~mp_symbolic.core.schedule.Schedule`) run by
    ``replicas`` copies at once, each on devices of its own.

    Each device runs its actions in order, each once its device is free and
    the actions it needs (:func:`~mp_symbolic.core.schedule.timeline`'s rules)
    have ended. While ``k`` devices are busy, each action advances at
    ``capacity[k] / k`` of its speed against the ``capacity[shards] / shards``
    its ``cost`` (``{(stage, kind): seconds}`` alone) was measured at, never
    faster than alone; ``capacity`` ``None``: devices share nothing.

    Raises:
        ScheduleError: every device waiting.
    """
    lists = [list(actions) for _ in range(replicas) for actions in schedule]
    per = len(schedule)
    num = schedule.num_stages
    done = set()
    position = [0] * len(lists)
    running = {}  # device -> [action, work left]
    now = 0.0
    total = sum(len(a) for a in lists)

    def ready(d):
        if d in running or position[d] >= len(lists[d]):
            return None
        action = lists[d][position[d]]
        r = d // per
        s, i, kind = action
        needs = [(s - 1, i, 'F')] if kind == 'F' and s else []
        if kind == 'B':
            needs = [(s, i, 'F')] + ([(s + 1, i, 'B')] if s + 1 < num else [])
        return action if all((r,) + tuple(n) in done for n in needs) else None

    while len(done) < total:
        for d in range(len(lists)):
            action = ready(d)
            if action is not None:
                running[d] = [action, cost[(action.stage, action.kind)]]
                position[d] += 1
        if not running:
            raise schedules.ScheduleError('schedule: expected an order the devices can run, '
                                          'found every device waiting')
        k = len(running) * shards
        rate = capacity.get(k, k) / k / (capacity.get(shards, shards) / shards) \
            if capacity else 1.0
        rate = min(1.0, rate)
        step = min(left for _, left in running.values()) / rate
        now += step
        for d in list(running):
            running[d][1] -= step * rate
            if running[d][1] <= 1e-15:
                action = running.pop(d)[0]
                done.add((d // per,) + tuple(action))
    return now


# Pipeline's arguments the planner chooses, and their defaults.
CHOSEN = {'balance': None, 'chunks': 1, 'replicas': 1, 'mirror': False,
          'schedule': schedules.DEFAULT, 'virtual': None, 'nodes': None, 'tensor_parallel': None,
          'shard_optimizer': False}


def plan_arguments(plan, memory_per_device, blocks, devices, sample, batch_axis, given):
    """``(Ranking, {Pipeline argument: value})`` of ``Pipeline(..., plan=plan)``,
    ``plan`` ``'auto'`` or a :class:`Planner` and ``given`` the plan arguments
    (:data:`CHOSEN`'s) the Pipeline was given.

    Raises:
        PlanError: ``plan`` neither, a plan argument given too (but
            ``tensor_parallel='auto'``), no ``sample``, or a budget no candidate
            fits.
        ValueError: a budget :func:`parse_size` refuses.
    """
    if plan == AUTO:
        plan = Planner()
    if not isinstance(plan, Planner):
        raise PlanError("plan: expected 'auto' or a Planner, found %s" % excerpt(repr(plan)))
    for name, default in CHOSEN.items():
        value = given.get(name, default)
        if name == 'nodes' and value == 1:
            continue  # one node: this process
        if name == 'tensor_parallel' and value is not None:
            if not isinstance(value, str) or value != AUTO:
                raise PlanError("tensor_parallel: expected None or 'auto' under plan='auto' "
                                "(the planner chooses the shards), found %s"
                                % excerpt(repr(value)))
            continue
        if value is not default and value != default:
            raise PlanError("%s: expected the planner to choose it under plan='auto' (leave it "
                            "at %r), found %s" % (name, default, excerpt(repr(value))))
    if sample is None:
        raise PlanError("sample: expected the batch (a shape or arrays) for plan='auto', "
                        "found None")
    ranking = plan.choose(blocks, devices, sample, memory_per_device, batch_axis=batch_axis,
                          tensor_parallel=given.get('tensor_parallel'))
    return ranking, ranking.best.candidate.pipeline_args()
