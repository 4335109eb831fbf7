"""One training run, end to end: task -> Pipeline -> stepper -> epochs -> checkpoint.

:func:`train` reads as its steps; each step is a function here or a module of
its own (:mod:`~mp_symbolic.training.symbolic`, :mod:`~mp_symbolic.training.imperative`,
:mod:`~mp_symbolic.training.tasks`). Tests call these functions for one tiny epoch.
"""
from collections import OrderedDict
import contextlib
from contextlib import contextmanager
import ctypes
import hashlib
from dataclasses import dataclass, field, replace
import os

import mxnet as mx
import numpy as np
from tqdm import tqdm

from .config import DEFAULT_STAGES, RESUME_IDENTITY, plan_changes, resume_config
from ..core.base import timing
from ..core.base.compat import error_line
from ..tools.checkpoint import SUMMARY_NAME, CheckpointError, commit_checkpoint, \
    module_arrays, read_checkpoint
from ..tools.files import write_text
from ..tools import trace
from .imperative import ImperativeStepper
from ..core.engine.module import fixed_param_names, with_input_shape
from ..core.engine.runtime import fused
from ..core.optim.optstate import OptimizerStateError, check_states, gather_states, split_states
from ..core.transport.comm import control
from ..core.transport.nodes import from_environment
from ..core.pipeline import Pipeline
from ..core.schedule import DEFAULT, VIRTUAL
from ..core.placement.devices import format_device, make_plan
from ..tools.store import Store
from ..tools.launch import announce_rank, hold_kvstore
from .symbolic import ExecutorStepper, ModuleStepper
from .tasks import load_task
from ..core.task import TaskError, num_examples
from ..tools.text import columns

__all__ = []

# Losses are read in blocks of this many steps, one block behind the newest
# step, so a non-finite loss stops training within its epoch without a
# synchronisation per step.
CHECK_EVERY = 10


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the run stopped there."""


class TrainingDidNotLearn(RuntimeError):
    """Training ended no better than it started."""


def build_pipeline(cfg, task):
    """The task's blocks on ``cfg``'s device plan; over nodes, once every
    node has made the same plan and been given the same run
    (:meth:`~mp_symbolic.training.config.TrainConfig.node_facts`).

    Returns:
        ``(pipe, note)``: note says which default devices were chosen, or ``None``.

    Raises:
        NodeError: over nodes, a node's plan or run differs from node 0's
            (the line names the flag and both values).
        NodeFailure: over nodes, another node did not join or answer.
    """
    blocks = task.make_blocks()
    # a whole network (one HybridBlock) is cut by shapes it infers from a batch
    whole = isinstance(blocks, mx.gluon.HybridBlock) and \
        not isinstance(blocks, mx.gluon.nn.HybridSequential)
    devices = cfg.devices
    note = None
    if devices is None:
        stages = DEFAULT_STAGES if whole else min(DEFAULT_STAGES, len(blocks))
        plan, note = make_plan(stages, None, replicas=cfg.replicas)
        devices = plan.all_devices
    shapes = [(cfg.batch_size,) + tuple(s) for s in task.sample_shapes]
    sample = shapes[0] if len(shapes) == 1 else tuple(shapes)  # one batch shape per input
    try:
        pipe = Pipeline(blocks, devices, balance=cfg.balance, sample=sample, chunks=cfg.chunks,
                        replicas=cfg.replicas, mirror=cfg.mirror, schedule=cfg.schedule,
                        virtual=cfg.virtual, nodes=cfg.nodes, node_timeout=cfg.node_timeout,
                        batchnorm=cfg.batchnorm, shard_optimizer=cfg.shard_optimizer)
    except ValueError as err:
        field, _, rest = str(err).partition(': ')
        if field != 'sample':
            raise
        shown = ', '.join(str(tuple(s)) for s in task.sample_shapes)
        raise TaskError('train: expected examples the blocks can take, found examples of '
                        'shape %s: %s' % (shown, rest)) from None
    # the nodes agree on the plan; now on the run, before any step
    control(pipe.nodes, 'compare their plans', pipe.plan.node_of_stage).agree(cfg.node_facts())
    _check_labels(pipe, task, cfg.batch_size)
    return pipe, note


def _check_labels(pipe, task, batch_size):
    """Fits the task's loss head to the network's output
    (:meth:`~mp_symbolic.core.task.Task.fit_head`: ``'softmax'`` on the class
    axis its labels leave); raises TaskError unless the labels fit it (a
    bucketed DataIter read once for that, one that never ends refused)."""
    if task.bucketed:
        task.batch_labels()
    shapes = dict(task.data_shapes(batch_size, pipe.data_names()))
    output_shape = None
    if task.head is not None and task.head.classes:  # the class axis reads the output's shape
        try:
            _, (output_shape, *_), _ = pipe.symbol().infer_shape(**shapes)
        except mx.base.MXNetError:
            pass  # a network that cannot take them: refused below
    symbol = task.fit_head(output_shape, lambda loss: pipe.training_symbol(
        loss, label_name=task.label, chunks=1))
    if task.label in symbol.list_arguments():
        shapes[task.label] = (batch_size,) + tuple(task.label_shape)
    try:
        _, out_shapes, _ = symbol.infer_shape(**shapes)
    except mx.base.MXNetError as err:
        raise TaskError('train: expected labels that fit the network\'s output and the loss '
                        '%r, found labels of shape %s per example: %s'
                        % (task.loss, tuple(task.label_shape), error_line(err))) from None
    head = task.head
    if head is not None and head.classes and head.axis is not None:
        _check_classes(task, out_shapes[0], head.axis)


def _check_classes(task, out_shape, axis):
    """Raises TaskError unless every label is a class index of the softmax
    output ``out_shape`` (``(batch, ..., classes)`` for ``axis`` -1,
    ``(batch, classes, ...)`` for 1).

    MXNet's SoftmaxOutput takes any label it can broadcast and casts it to an
    integer: a label outside the classes trains on without a word.
    """
    out_shape = tuple(out_shape)
    classes = out_shape[axis]
    expected = out_shape[1:-1] if axis == -1 else out_shape[2:]
    if tuple(task.label_shape) != tuple(expected):
        raise TaskError('train: expected labels of shape %s per example (class indices) for '
                        'the loss \'softmax\', found %s' % (tuple(expected),
                                                           tuple(task.label_shape)))
    ignore = task.head.ignore_label
    for name, y in _all_labels(task):
        bad = (y < 0) | (y >= classes) | (y != np.floor(y))
        if ignore is not None:  # SoftmaxOutput(use_ignore=True): that label is skipped
            bad &= y != ignore
        if bad.any():
            raise TaskError('%s: expected class indices 0..%d (the network has %d outputs), '
                            'found %d labels that are not, the first %g'
                            % (name, classes - 1, classes, int(bad.sum()), y[bad][0]))


def _all_labels(task):
    """``[(name, labels)]`` of ``train`` and ``val``: numpy arrays (a
    bucketed DataIter's flattened, :meth:`~mp_symbolic.core.task.Task.batch_labels`)."""
    if task.bucketed:
        return task.batch_labels()
    data = task.data()
    return [('train', data.y), ('val', data.y_val)]


def bucketed_batches(data, epoch):
    """Yields one epoch of the bucketed DataIter ``data``'s batches, as it
    makes them: ``data.set_epoch(epoch)`` first where it has that method
    (so that an epoch's order depends on the epoch alone, as a resumed run
    needs), then ``data.reset()``."""
    if callable(getattr(data, 'set_epoch', None)):
        data.set_epoch(epoch)
    data.reset()
    for batch in data:
        yield batch, None


def initial_values(pipe, seed):
    """Initial parameters from the blocks' own initialisers, as numpy arrays.

    Drawn on ``cpu(0)`` after ``mx.random.seed(seed)``, every parameter in
    the blocks' order, so that every variant, device plan and node starts
    from the same values for the same seed. A tensor-parallel parameter is
    drawn whole, in the unsplit layer's shape and turn, and then split, so
    any shard count starts from the values of the unsplit network.

    One parameter is drawn at a time: its value (and its gradient) in the
    block's Gluon parameter is read into numpy, or dropped, and let go
    before the next is drawn; every Gluon parameter is left without a value
    (its shape, dtype, initialiser and ``grad_req`` kept). Over nodes, only
    the parameters this node's stages hold or read are kept (:func:`held_names`):
    a node holds its share of the model, never the whole.

    Returns:
        ``(arg_params, aux_params)``: name -> numpy array.
    """
    mx.random.seed(seed)
    params = pipe.collect_params()
    keep = held_names(pipe)
    whole_of = {p.name: whole for whole in pipe.sharded.values() for p in whole.shards}
    aux_names = set(pipe.symbol().list_auxiliary_states())
    arg, aux = OrderedDict(), OrderedDict()
    values = OrderedDict()
    for name, param in params.items():
        whole = whole_of.get(name)
        if whole is None:
            param.initialize(ctx=mx.cpu(0), force_reinit=True)
            if keep is None or name in keep:
                values[name] = param.data().asnumpy()
            param._data = param._grad = None  # pylint: disable=protected-access
            mx.nd.waitall()  # freed by MXNet's engine before the next is drawn
        elif whole.name not in values:
            full = mx.gluon.Parameter(whole.name, shape=whole.shape, dtype=param.dtype,
                                      init=param.init)
            full.initialize(ctx=mx.cpu(0))
            values[whole.name] = None  # drawn: its shards are taken below
            for shard, value in pipe.split_params({whole.name: full.data()}).items():
                if keep is None or shard in keep:
                    values[shard] = value.asnumpy()
            del full
    for name in params:
        if values.get(name) is not None:
            (aux if name in aux_names else arg)[name] = values[name]
    mx.nd.waitall()
    release_host_memory()  # the pages the draws' own arrays left in the heap
    return arg, aux


def release_host_memory():
    """Hands the free pages of the C heap back to the system (glibc's
    ``malloc_trim``): host arrays let go (numpy copies of the model, each
    under glibc's mmap threshold of up to 32 MiB) leave their pages in the
    heap's middle, where the arrays MXNet makes next need not reuse them, so
    the process would hold both. Nothing where the C library has no
    ``malloc_trim``."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def held_names(pipe):
    """The parameters and auxiliary states this process needs: ``None``
    (every one) in one process; over nodes, those its stages own or read."""
    if pipe.nodes is None:
        return None
    local = set(pipe.local_stages)
    owner, tied = pipe.placement.owner, pipe.tied
    return {name for name in pipe.collect_params()
            if owner[name] in local or local & set(tied.get(name, (None, ()))[1])}


def make_stepper(cfg, pipe, task, init, label_shape, kvstore=None):
    """The stepper for ``cfg.variant`` / ``cfg.api``."""
    if cfg.variant == 'imperative':
        return ImperativeStepper(pipe, task, cfg, init)
    if cfg.api == 'executor':
        return ExecutorStepper(pipe, task, cfg, init, label_shape)
    return ModuleStepper(pipe, task, cfg, init, label_shape, kvstore=kvstore)


@dataclass
class TrainResult:
    """What :func:`fit` and :func:`train` measured."""
    step_losses: list           # the task's batch loss of every step, in order
    epoch_losses: list          # mean batch loss of each epoch
    params: dict                # name -> numpy array, after training (a HostArrays,
                                # each copied when asked; over nodes a NodeArrays:
                                # each read from its node when asked)
    wall_time: float            # seconds, training loop only (no checkpoints), after waitall()
    samples_per_sec: float
    aux: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    placement: list = field(default_factory=list)  # [(name, device, grad device)]
    files: dict = field(default_factory=dict)

    def __getattr__(self, name):  # final_mse, map_error, held_out_accuracy, ...
        metrics = self.__dict__.get('metrics', {})
        if name in metrics:
            return metrics[name]
        raise AttributeError(name)


def read_losses(losses):
    """The values of batch losses (NDArrays)."""
    return mx.nd.stack(*losses).asnumpy().ravel()


def _read_block(stepper, losses, start, stop, epoch):
    """Values of ``losses[start:stop]``; raises at the first non-finite one."""
    values = np.asarray(getattr(stepper, 'read_losses', read_losses)(losses[start:stop]))
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        raise TrainingDiverged('training diverged: batch loss %s at epoch %d, step %d (lower '
                               '--lr?)' % (values[bad[0]], epoch + 1, start + bad[0] + 1))
    return values.tolist()


def fit(stepper, X, y, cfg, log=print, metric='batch loss', start_epoch=0, on_epoch=None):
    """Runs epochs ``start_epoch .. cfg.num_epochs - 1`` of ``stepper`` on ``(X, y)``.

    Args:
        X, y: The training arrays; or ``X`` a bucketed DataIter and ``y``
            ``None``: each epoch its batches as it makes them
            (:func:`bucketed_batches`).
        log: Called with each line of per-epoch output.
        metric: What the batch loss is, for those lines.
        on_epoch: Called as ``on_epoch(epoch, epoch_loss)`` after each epoch
            (``epoch`` counts from 1), e.g. to write a checkpoint.

    Raises:
        TrainingDiverged: a batch loss became NaN or infinite; raised within
            the epoch it happened in.
    """
    step_losses, epoch_losses = [], []
    bucketed = y is None  # X a bucketed DataIter: its batches as it makes them
    steps = None if bucketed else num_examples(X) // cfg.batch_size
    examples = 0  # trained on, padding included
    outside = 0.0  # seconds in on_epoch (checkpoints), not training
    # disable=None: no bar when stderr is not a terminal
    bar = tqdm(total=None if bucketed else (cfg.num_epochs - start_epoch) * steps,
               unit='batch', leave=False,
               disable=None if cfg.progress else True, desc='train')

    def epochs():
        nonlocal outside, step_losses, examples
        for epoch in range(start_epoch, cfg.num_epochs):
            losses, values = [], []
            batches = bucketed_batches(X, epoch) if bucketed else stepper.batches(X, y, epoch)
            for X_batch, y_batch in batches:
                losses.append(stepper.step(X_batch, y_batch))
                examples += X_batch.data[0].shape[0] if bucketed else cfg.batch_size
                bar.update()
                if len(losses) % CHECK_EVERY == 0 and len(losses) > CHECK_EVERY:
                    values += _read_block(stepper, losses, len(values),
                                          len(losses) - CHECK_EVERY,
                                          epoch)
            values += _read_block(stepper, losses, len(values), len(losses), epoch)
            step_losses += values
            epoch_losses.append(float(np.mean(values)))
            bar.set_postfix(loss='%.3g' % epoch_losses[-1])
            with tqdm.external_write_mode():  # clears the bar while the line is written
                log('epoch %d/%d  mean %s %.4e' % (epoch + 1, cfg.num_epochs, metric,
                                                  epoch_losses[-1]))
            if on_epoch is not None:
                outside += timing.seconds(lambda: on_epoch(epoch + 1, epoch_losses[-1]))

    try:
        wall = timing.seconds(epochs) - outside
    finally:
        bar.close()
    samples = examples
    lazy = _lazy(stepper)
    return TrainResult(step_losses=step_losses, epoch_losses=epoch_losses,
                       params=stepper.params(**lazy), aux=stepper.aux(**lazy), wall_time=wall,
                       samples_per_sec=samples / wall if wall > 0 else float('nan'),
                       placement=stepper.placement())


def _lazy(stepper):
    """The arguments under which ``stepper.params`` and ``stepper.aux``
    read each array when asked for, not copy the model at once
    (:class:`~mp_symbolic.training.symbolic.HostArrays`; over nodes
    :class:`~mp_symbolic.training.symbolic.NodeArrays`)."""
    del stepper  # every stepper's
    return {'lazy': True}


def placement_table(placement):
    """Lines of a table: each array -> its device (and its gradient's)."""
    return columns([('array', 'device', 'grad device')] +
                   [(n, d, g if g is not None else '-') for n, d, g in placement])


@contextmanager
def profiling(cfg, out_dir):
    """MXNet's profiler around the block when ``cfg.profile``; yields the file
    paths, dumped only if the block succeeds (a failed run writes no trace)."""
    if not cfg.profile:
        yield {}
        return
    files = {'profile': os.path.join(out_dir, 'profile.json'),
             'profile_stats': os.path.join(out_dir, 'profile-stats.txt')}
    os.makedirs(out_dir, exist_ok=True)
    # Ops, executors and C API calls; memory counters say nothing about placement.
    mx.profiler.set_config(profile_symbolic=True, profile_imperative=True, profile_api=True,
                           profile_memory=False, aggregate_stats=True,
                           filename=files['profile'], continuous_dump=False)
    mx.profiler.set_state('run')
    try:
        yield files
    except BaseException:
        mx.nd.waitall()
        mx.profiler.set_state('stop')
        trace.discard()  # else MXNet dumps what it recorded when the process ends
        raise
    mx.nd.waitall()
    mx.profiler.set_state('stop')
    trace.dump(files['profile'])
    write_text(files['profile_stats'], mx.profiler.dumps(reset=True))


def _title(cfg, task, pipe):
    name = cfg.variant + ('' if cfg.variant == 'imperative' else ' (%s API)' % cfg.api)
    extra = ''
    if cfg.chunks > 1:
        extra += ', %d micro-batches per batch' % cfg.chunks
    if cfg.schedule != DEFAULT:
        extra += ', schedule %s' % cfg.schedule
        if cfg.schedule in VIRTUAL:
            extra += ' (%d stages per device)' % pipe.virtual
    if pipe.batchnorm != 'micro-batch' and cfg.chunks > 1:
        extra += ', BatchNorm statistics %s' % pipe.batchnorm
    if pipe.nodes is not None:
        extra += ', over %d nodes (this is node %d)' % (pipe.nodes.count, pipe.nodes.rank)
    if cfg.mirror:
        extra += ', activations recomputed in backward (mirror)'
    if cfg.replicas > 1:
        extra += ', %d replicas (kvstore %s)' % (cfg.replicas, cfg.kvstore)
    if cfg.shard_optimizer:
        extra += ', optimizer state sharded across replicas'
    parts = '%d ops' % len(pipe.cut.op_names) if pipe.whole else '%d blocks' % len(pipe.blocks)
    return '%s: %s model-parallel training, %s in %d stage(s)%s:' % (
        task.name, name, parts, pipe.plan.num_stages, extra)


def params_digest(params):
    """sha256 of every parameter's float32 bytes, by name: equal digests, equal weights.

    ``params`` is a mapping (over nodes, the stepper's
    :class:`~mp_symbolic.training.symbolic.NodeArrays`): each value is read
    once, in the order of the sorted names, and let go before the next.
    """
    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(params[name], dtype=np.float32))  # its buffer, no copy
    return digest.hexdigest()


def _summary(cfg, task, pipe, result, complete):
    summary = {
        'config': cfg.to_dict(), 'task': task.name, 'description': task.description,
        'stages': pipe.stage_names,
        'devices': [format_device(d) for d in pipe.plan.all_devices],
        'balance': list(pipe.balance), 'stage_of_layer': list(pipe.plan.stage_of_layer),
        'epoch_losses': result['epoch_losses'], 'mxnet_version': mx.__version__,
        'complete': complete,
    }
    summary.update(result.get('metrics', {}))
    for key in ('wall_time_s', 'samples_per_sec'):
        if key in result:
            summary[key] = result[key]
    return summary


class _Checkpointer:
    """Commits the stepper's state to the run's store as one unit."""

    def __init__(self, store, cfg, task, pipe, stepper, epoch_losses, log):
        self.store, self.cfg, self.task, self.pipe, self.stepper = store, cfg, task, pipe, stepper
        # over nodes, every node writes its stages' part (node 0 holds the store)
        self.group = None if pipe.nodes is None else \
            control(pipe.nodes, node_of_stage=pipe.plan.node_of_stage)
        self.log = log
        self.epoch_losses = list(epoch_losses)
        # a checkpoint holds the model, not its shards
        self.symbol = with_input_shape(
            pipe.training_graph(task.graph_loss, label_name=task.label, chunks=1, unsplit=True),
            dict(zip(pipe.data_names(), task.sample_shapes)), None)
        self.last = None

    def commit(self, epoch, result=None, complete=False):
        module = getattr(self.stepper, 'module', None)
        if self.store is None and self.group is None:  # a dist_sync worker but worker 0
            if module is not None and module.optimizer_initialized and \
                    module.states_over_workers():
                module.optimizer_states()  # gathered by every worker together
            return None
        if module is not None:  # each array made when written (tensor-parallel layers unsplit)
            arg, aux, states = module_arrays(module)
        else:  # each array made when written, tensor-parallel layers by their unsplit names
            arg, aux = self.stepper.lazy_params()
            states = gather_states(self.stepper.optimizer_states(lazy=True), self.pipe.sharded)
        summary = _summary(self.cfg, self.task, self.pipe,
                           dict(result or {}, epoch_losses=self.epoch_losses), complete)
        self.last = commit_checkpoint(self.store, self.task.name, epoch, self.symbol, arg, aux,
                                      states, summary, complete, group=self.group)
        if self.last is None:  # a node but node 0: node 0 committed every node's part
            return None
        note = self.last.snapshot.held_note()
        if note:  # older snapshots a reader holds stay beside it: say so
            self.log(note)
        return self.last

    def on_epoch(self, epoch, loss):
        self.epoch_losses.append(loss)
        if epoch % self.cfg.checkpoint_every == 0 and epoch < self.cfg.num_epochs:
            self.commit(epoch)


# A resume reads and places at most this many bytes of parameters (and their
# optimizer state) at a time, or one parameter where one is larger.
RESUME_BYTES = 16 << 20


def _resume(cfg, stepper):
    """Loads the checkpoint of ``cfg.resume`` into ``stepper``; returns
    ``(start epoch, epoch losses so far, what cfg changes of its plan)``
    (see :func:`~mp_symbolic.training.config.plan_changes`).

    The stepper takes the arrays it holds (over nodes, its stages') a few
    at a time (:func:`_read_groups`): each group's parameters and their
    optimizer state are read, placed on the devices and let go before the
    next group is read, so a resume holds at most one group on the host.

    Raises:
        CheckpointError, OptimizerStateError: the checkpoint cannot be used.
    """
    # Held while read: a run still writing cfg.resume keeps committing meanwhile.
    with read_checkpoint(cfg.resume) as checkpoint:
        saved = checkpoint.summary.get('config', {})
        resume_config(saved, {k: getattr(cfg, k) for k in RESUME_IDENTITY})  # same run, or raise
        if checkpoint.epoch >= cfg.num_epochs:
            raise ValueError('num_epochs: expected more than the %d epochs of the checkpoint in '
                             '%s to resume, found %d'
                             % (checkpoint.epoch, cfg.resume, cfg.num_epochs))
        checkpoint.load(names=())  # the symbol and every stored shape checked, no array read
        sharded = stepper.pipe.sharded
        shapes = stepper.param_shapes()
        for group in _read_groups(checkpoint, _held_names(stepper), RESUME_BYTES):
            arg, aux = OrderedDict(), OrderedDict()
            for key, value in checkpoint.arrays(group):
                (arg if key.startswith('arg:') else aux)[key[4:]] = value
            arg = stepper.pipe.split_params(arg)  # onto this plan's shards
            stepper.set_params(arg, aux, allow_missing=True)  # the others kept
            states = split_states(checkpoint.load_states(
                [k[4:] for k in group if k.startswith('arg:')]), sharded)
            try:  # the states of another model (a file swapped, its manifest fixed): one line
                check_states(states, shapes)
            except OptimizerStateError as err:
                raise OptimizerStateError('%s: %s' % (checkpoint.states_path or checkpoint.folder,
                                                      err)) from None
            stepper.set_optimizer_states(states)
            del arg, aux, states  # let go before the next group is read
            release_host_memory()
        devices = checkpoint.summary.get('devices')
        changes = plan_changes(saved, cfg, devices if isinstance(devices, list) else None)
        return checkpoint.epoch, list(checkpoint.summary.get('epoch_losses', [])), changes


def _read_groups(checkpoint, names, limit):
    """The checkpoint's array keys (``'arg:<name>'``, ``'aux:<name>'``) of
    ``names`` (``None``: every one), in the checkpoint's order, in groups of
    at most ``limit`` bytes (one array alone where it is larger; ``None``:
    one group).

    Raises:
        CheckpointError: ``names`` names an array the checkpoint does not hold.
    """
    index = checkpoint.index()
    keys = [k for k in index if names is None or k[4:] in names]
    missing = sorted(set(names or ()) - {k[4:] for k in keys})
    if missing:
        raise CheckpointError('%s: expected arrays for %s, found none'
                              % (checkpoint.folder, ', '.join(missing[:5])))
    groups, size = [[]], 0
    for key in keys:
        shape, dtype, _ = index[key]
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if limit is not None and groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return [g for g in groups if g] or [[]]


def _held_names(stepper):
    """The names, as a checkpoint stores them (tensor-parallel layers
    unsplit), of the parameters and auxiliary states ``stepper`` holds."""
    unsplit = {shard: p.name for p in stepper.pipe.sharded.values() for shard in p.names}
    return {unsplit.get(n, n) for n in stepper.held_names()}


def _share_line(module):
    """What a Module with its optimizer state sharded holds of it, in one line."""
    found = module.optimizer_owners()
    kvstore = module.kvstore
    rank = kvstore.rank if 'dist' in kvstore.type else 0
    workers = kvstore.num_workers if 'dist' in kvstore.type else 1
    held = OrderedDict()
    for state in module.updater.states.values():
        for array in _arrays_of(state):
            device = str(array.context)
            held[device] = held.get(device, 0) + array.size * np.dtype(array.dtype).itemsize
    mine = sum(1 for worker, _ in found.values() if worker == rank)
    return ('optimizer state sharded over %d replica(s) x %d worker(s): this process holds the '
            'state of %d of its %d trained parameters, %d bytes (%s)'
            % (len(module.executors), workers, mine, len(found), sum(held.values()),
               ', '.join('%s %d' % kv for kv in sorted(held.items()))))


def _arrays_of(state):
    if state is None:
        return []
    if isinstance(state, mx.nd.NDArray):
        return [state]
    return [a for s in state for a in _arrays_of(s)]


def plan_memory(cfg, pipe, task, label_shape, log=print, stepper=None):
    """Bytes per device of the split plan beside the same model on one device,
    measured after one step (:mod:`~mp_symbolic.tools.memory`); logged as two tables.
    On the stage runtime (:func:`~mp_symbolic.core.engine.runtime.fused`
    false: a schedule other than GPipe's one graph, or over nodes), the arrays of this process's stages on their devices
    (``stepper``'s Module: :func:`~mp_symbolic.tools.memory.memory_table`),
    in one table.

    Returns:
        ``{'split': {device: {category: bytes}}, 'one_device': {...}}`` (on
        the stage runtime ``{'stages': ...}``, over nodes ``{'node': ...}``),
        or ``None`` (said in a line) where it cannot be measured.
    """
    if cfg.variant != 'symbolic':
        return None
    nodes = None if pipe is None else pipe.nodes
    if pipe is None or not fused(pipe):
        from ..tools.memory import memory_table  # pylint: disable=import-outside-toplevel
        module = getattr(stepper, 'module', None)
        if module is None and nodes is not None:
            log('memory per device: not measured per node here (python -m bench.nodes '
                'measures each node\'s beside one process)')
            return None
        if module is None:
            log('memory per device: not measured (the table binds the one GPipe graph; under '
                '--schedule %s, python -m bench.schedules measures each stage\'s)'
                % cfg.schedule)
            return None
        table = memory_table(module)
        if nodes is not None:
            log('memory per device of node %d\'s stages, its arrays (optimizer state once made; '
                'activations: python -m bench.nodes):' % nodes.rank)
        else:
            log('memory per device of the stages, their arrays (optimizer state once made; '
                'activations: python -m bench.schedules):')
        for line in table.lines():
            log('    ' + line)
        return {'node' if nodes is not None else 'stages': table.as_dict()}
    # pylint: disable=import-outside-toplevel
    from ..core.planning.estimate import optimizer_shares
    from ..tools.memory import format_memory, measure_memories
    # over dist_sync workers, this worker's share of the batch and of the sharded state
    rank, workers = getattr(stepper, 'shard', (0, 1))
    local = cfg.batch_size // (workers * cfg.replicas)
    symbol = pipe.training_symbol(task.graph_loss, label_name=task.label)
    data_shapes = task.data_shapes(local, pipe.data_names())
    fixed = fixed_param_names(pipe, symbol)
    try:
        # the split plan is replica 0's: with the state sharded, its share
        held = optimizer_shares(pipe, symbol, data_shapes, fixed, (rank, workers))[0]
        common = dict(symbol=symbol, data_shapes=data_shapes,
                      label_shapes=[(task.label, (local,) + tuple(label_shape))],
                      context=str(pipe.plan.first_device), optimizer=cfg.optimizer,
                      optimizer_params=cfg.optimizer_params(), fixed_param_names=fixed)
        split, one_device = measure_memories([
            dict(common, group2ctx=pipe.plan.group2ctx, held=held),
            dict(common, group2ctx=None)])
        measured = {'split': split, 'one_device': one_device}
    except (ValueError, RuntimeError) as err:
        log('memory per device: not measured (%s)' % err)
        return None
    result = {k: v['devices'] for k, v in measured.items()}
    log('memory per device, after one step (other: activations and workspace, from MXNet\'s '
        'storage profiler):')
    this = '  this plan' if held is None else \
        '  this plan, replica 0 (its share of the sharded optimizer state)' if workers == 1 \
        else '  this plan, worker %d\'s replica 0 (its share of the sharded optimizer state)' \
        % rank
    for title, key in ((this, 'split'), ('  the same model on %s alone'
                                         % pipe.plan.first_device, 'one_device')):
        for line in format_memory(result[key], title):
            log(line if line.startswith('  ') else '    ' + line)
    return result


def node_rank(cfg):
    """This process's node (0 without nodes)."""
    return 0 if cfg.nodes == 1 else from_environment(cfg.nodes, cfg.node_timeout).rank


def load(cfg):
    """``cfg``'s task, and ``cfg`` with the task's defaults filled in.

    Raises:
        TaskLoadError: the task cannot be loaded (see
            :func:`~mp_symbolic.training.tasks.load_task`).
    """
    task, arguments = load_task(cfg.task, cfg.task_args, cfg.seed)
    return task, replace(cfg, task_args=arguments).with_task(task)


def train(cfg, log=print, built=None, task=None):
    """Trains ``cfg.task`` with ``cfg.variant``, prints the report, commits a
    checkpoint every ``cfg.checkpoint_every`` epochs and at the end, and
    returns the :class:`TrainResult`.

    Args:
        built: What :func:`build_pipeline` returned for ``cfg``, when the
            caller already built it (the command line does, to check the plan
            before any work; ``balance='time'`` then measures once).
        task: ``cfg``'s :class:`~mp_symbolic.Task` when the caller has
            loaded it (``cfg`` then has its defaults, see :func:`load`).

    The output folder is locked for the whole run (one writer per folder);
    each checkpoint is committed as one unit (:mod:`~mp_symbolic.tools.store`).

    Raises:
        DeviceSpecError: ``cfg.devices`` cannot make a device plan.
        FolderInUse: another process writes to the output folder.
        WrongFolder: the output folder holds an export or other files
            (neither empty nor a store), or lies inside a training or export
            folder.
        CheckpointError: ``cfg.resume`` holds no usable checkpoint.
        NodeError: over nodes, a node's plan or run differs from node 0's
            (see :func:`build_pipeline`), or it resumes from another epoch.
        TrainingDiverged: the loss became NaN or infinite (the last
            committed checkpoint is kept).
        TrainingDidNotLearn: the trained network is no better than the
            initial one (its last epoch is committed all the same, its
            summary ``complete: false`` and ``improved: false``, with the
            score before and after).
    """
    if task is None:
        task, cfg = load(cfg)
    kvstore = mx.kv.create(cfg.kvstore) if (cfg.kvstore or '').startswith('dist') else None
    if kvstore is not None:
        hold_kvstore(kvstore)  # a failed worker must not wait in its destructor's barrier
        announce_rank(kvstore)  # the launcher's prefix: [worker i, rank r]
    # one worker (one node) holds the store and commits the checkpoints
    writer = (kvstore is None or kvstore.rank == 0) and node_rank(cfg) == 0
    if kvstore is not None:
        log('worker %d of %d (kvstore %s); %s' % (
            kvstore.rank, kvstore.num_workers, cfg.kvstore,
            'this worker writes the checkpoints' if writer else 'worker 0 writes the checkpoints'))
    store = Store(cfg.out_dir, kind='training') if writer else None
    with store.locked() if writer else contextlib.nullcontext():
        # a bucketed DataIter's batches are read as they are trained
        X, y = (task.train, None) if task.bucketed else task.data()[:2]
        pipe, note = built if built is not None else build_pipeline(cfg, task)
        for line in ([note] if note else []) + [_title(cfg, task, pipe)] + \
                ['  ' + l for l in pipe.describe()]:
            log(line)
        init = initial_values(pipe, cfg.seed)  # over nodes, this node's share
        stepper = make_stepper(cfg, pipe, task, init, task.label_shape, kvstore)
        # over nodes, each parameter read from its node when the report asks for it
        predict = stepper.predict_batch if task.bucketed else stepper.predict
        before = task.report(init[0] if pipe.nodes is None else stepper.params(), predict)
        del init  # the stepper holds the values now
        release_host_memory()
        start_epoch, epoch_losses = 0, []
        if cfg.resume is not None:
            start_epoch, epoch_losses, changes = _resume(cfg, stepper)
            log('resumed from %s after epoch %d' % (cfg.resume, start_epoch))
            if changes:
                log("resume: plan changed from the checkpoint's: %s" % '; '.join(changes))
        # each node read its own --resume (or none)
        control(pipe.nodes, 'compare their plans', pipe.plan.node_of_stage).agree(
            {'--resume epoch': start_epoch})
        log('placement (as MXNet reports it):')
        for line in placement_table(stepper.placement()):
            log('  ' + line)
        memory = plan_memory(cfg, pipe, task, task.label_shape, log, stepper) if cfg.memory \
            else None

        checkpointer = _Checkpointer(store, cfg, task, pipe, stepper, epoch_losses, log)
        with profiling(cfg, cfg.out_dir) as profile_files:
            result = fit(stepper, X, y, cfg, log, task.loss_label, start_epoch,
                         checkpointer.on_epoch)
        result.epoch_losses = checkpointer.epoch_losses
        report = task.report(result.params, predict)
        result.metrics = report.metrics
        for line in report.lines:
            log(line)
        log('training: %.2f s wall, %.0f samples/s' % (result.wall_time,
                                                      result.samples_per_sec))
        module = getattr(stepper, 'module', None)
        if module is not None and module.optimizer_owners() is not None:
            log(_share_line(module))
        improved = bool(report.score < before.score)
        result.params = None  # read again after the commit, which holds the model meanwhile
        # a run that did not improve keeps its last epoch all the same, marked
        # complete: false (a run to look at, not a result)
        checkpoint = checkpointer.commit(cfg.num_epochs, dict(
            metrics=dict(result.metrics, improved=improved, score_name=report.score_name,
                         score_before=float(before.score), score_after=float(report.score),
                         **({'memory_per_device': memory} if memory else {})),
            wall_time_s=result.wall_time, samples_per_sec=result.samples_per_sec),
            complete=improved)
        if not improved:
            raise TrainingDidNotLearn(
                'training did not improve the model (%s: %.4g before, %.4g after %d epochs); '
                '%s (a larger --lr or more --epochs?)'
                % (report.score_name, before.score, report.score, cfg.num_epochs,
                   'its last epoch is kept in %s, marked incomplete'
                   % os.path.join(cfg.out_dir, 'current') if checkpoint is not None or
                   pipe.nodes is not None else 'no checkpoint is written by this worker'))
    result.params = stepper.params(**_lazy(stepper))
    log('parameters sha256: %s' % params_digest(result.params))
    if checkpoint is None:
        return result
    result.files = {'symbol': checkpoint.symbol_path, 'params': checkpoint.params_path,
                    'states': checkpoint.states_path,
                    'summary': os.path.join(checkpoint.folder, SUMMARY_NAME)}
    if checkpoint.part_paths:  # committed by node processes: one part per node
        result.files['parts'] = list(checkpoint.part_paths)
    result.files.update(profile_files)
    if profile_files:
        log('profile: %s (open in chrome://tracing or ui.perfetto.dev), %s'
            % (profile_files['profile'], profile_files['profile_stats']))
    log('checkpoint: %s (epoch %d; %s)' % (
        os.path.join(cfg.out_dir, 'current'), cfg.num_epochs,
        ', '.join(os.path.basename(p) for p in [checkpoint.symbol_path] + (
            checkpoint.part_paths or [checkpoint.params_path, checkpoint.states_path]))))
    return result
