"""``python -m mp_symbolic plan [train's flags]``: the memory table per device
of a training run, estimated before anything is allocated.

It takes ``train``'s flags (``--task``, ``--devices``, ``--chunks``,
``--schedule``, ``--virtual``, ``--replicas``, ``--mirror``,
``--shard-optimizer``, ``--balance``,
``--batch-size``, ``--optimizer``, ...), builds the run's Pipeline as
``train`` does, and prints :func:`mp_symbolic.estimate_memory`'s table in
the rows and units of the table ``train`` measures after one step
(``params``, ``grads``, ``optimizer``, ``aux``, ``inputs``, ``module_copy``,
``other``: activations and workspace, ``total``), then the total of every
device and the largest. With ``--nodes N``, the plan is made in this process
(no rendezvous) and each node's table is printed, its stages' alone. Nothing
is bound, run or written.
"""
from dataclasses import replace
import re
import sys

__all__ = []

# The flags --plan auto chooses: given too, they are refused.
CHOSEN_FLAGS = {'chunks': '--chunks', 'schedule': '--schedule', 'virtual': '--virtual',
                'replicas': '--replicas', 'mirror': '--mirror', 'balance': '--balance',
                'shard_optimizer': '--shard-optimizer'}

DESCRIPTION = ('Print the memory per device of a training run, estimated from shapes and '
               'MXNet\'s own memory planning before anything is allocated: the rows of the '
               'table train measures after one step. Takes train\'s flags (--task, --devices, '
               '--chunks, --schedule, --virtual, --replicas, --mirror, --balance, '
               '--batch-size, --optimizer, ...); binds, runs and writes nothing.')


def run(rest, parse, config_from_args, error, usage_error, flag_message=None):
    """The ``plan`` command on ``rest`` (train's flags).

    Args:
        rest: The arguments after ``plan``.
        parse: ``argv -> namespace`` of the command line's parser.
        config_from_args: ``(namespace, argv) -> TrainConfig``.
        error: Prints a refusal's one line.
        usage_error: The exit status of a refusal.
        flag_message: ``(error, TrainConfig or None) -> str``: a refusal's
            message naming the flag that sets its field, as ``train`` names
            it; ``None``: only ``--memory-per-device`` is named.

    Returns:
        0, or ``usage_error`` after one line on stderr.
    """
    rest = list(rest[1:]) if rest[:1] == ['--'] else list(rest)
    args = parse(['train'] + rest)
    if args.variant != 'symbolic' or args.api != 'module':
        error('plan: expected the symbolic variant and the module API (the table is the '
              'Module\'s), found --variant %s --api %s' % (args.variant, args.api))
        return usage_error
    if args.resume is not None:
        error('plan: expected a new run\'s plan (no --resume), found --resume')
        return usage_error
    # pylint: disable=import-outside-toplevel
    from .loop import build_pipeline, load
    from ..tools.memory import format_bytes, format_memory
    from ..tools.planning import estimate_memory
    from ..core.planning.estimate import node_stages
    ranking, cfg = None, None
    try:
        cfg = config_from_args(args, ['train'] + rest)
        task, cfg = load(cfg)
        if args.plan is not None or args.memory_per_device is not None:
            cfg, ranking = auto(cfg, task, args, ['train'] + rest)
        nodes = cfg.nodes
        pipe, _ = build_pipeline(replace(cfg, nodes=1), task)  # the nodes' plan, made here
        data_shapes = task.data_shapes(cfg.batch_size, pipe.data_names())
        label_shapes = [(task.label, (cfg.batch_size,) + tuple(task.label_shape))]
        tables = estimate_memory(pipe, data_shapes=data_shapes, label_shapes=label_shapes,
                                 loss=task.graph_loss, optimizer=cfg.optimizer,
                                 optimizer_params=cfg.optimizer_params(),
                                 nodes=nodes if nodes > 1 else None)
        tables = tables if nodes > 1 else (tables,)
    except ValueError as err:
        error(_flag_line(err) if flag_message is None else
              str(flag_message(err, cfg)).strip().splitlines()[0])
        return usage_error
    if ranking is not None:
        print('plans of %s on %s, ranked (memory: the estimate\'s largest device; step: the '
              'schedule simulated over stage times measured on the devices):'
              % (task.name, ', '.join(sorted({c for s in ranking.ranked
                                              for c in re.split('[,+]', s.candidate.devices)},
                                             key=lambda d: (len(d), d)))))
        for line in ranking.lines():
            print(line)
    plan = ' '.join(['%s: %d stage(s) on %s' % (task.name, pipe.plan.num_stages,
                                                 pipe.plan.spec),
                     '--schedule %s --chunks %d' % (cfg.schedule, cfg.chunks)] +
                    (['--replicas %d' % cfg.replicas] if cfg.replicas > 1 else []) +
                    (['--nodes %d' % nodes] if nodes > 1 else []) +
                    (['--mirror'] if cfg.mirror else []) +
                    (['--shard-optimizer'] if cfg.shard_optimizer else []) +
                    ['--batch-size %d --optimizer %s' % (cfg.batch_size, cfg.optimizer)])
    print(plan)
    print('memory per device, estimated before allocation (other: activations and workspace, '
          'from MXNet\'s memory plan of the training graph):')
    for node, table in enumerate(tables):
        if nodes > 1:
            stages = node_stages(pipe, nodes, node)
            print('  node %d (stage%s %s):' % (node, 's' if len(stages) > 1 else '',
                                               ', '.join(str(s) for s in stages)))
        for line in format_memory(table.as_dict()):
            print('    ' + line)
    if nodes > 1:
        largest = max(((n, row) for n, table in enumerate(tables) for row in table),
                      key=lambda pair: pair[1].total)
        print('total %s on %d node(s); the most on node %d\'s %s: %s'
              % (format_bytes(sum(t.total for t in tables)), nodes, largest[0],
                 largest[1].device, format_bytes(largest[1].total)))
    else:
        table = tables[0]
        largest = max(table, key=lambda row: row.total)
        print('total %s on %d device(s); the most on %s: %s'
              % (format_bytes(table.total), len(table), largest.device,
                 format_bytes(largest.total)))
    sys.stdout.flush()
    return 0


def auto(cfg, task, args, argv):
    """``(cfg, ranking)``: ``cfg`` with the plan ``--plan auto`` chooses for
    ``task`` over its devices (``--devices``, or the default stand-ins), and
    the :class:`~mp_symbolic.core.planning.planner.Ranking` it chose from.

    Args:
        args: The parsed flags (``plan``, ``memory_per_device``).
        argv: The command line (``['train', ...]``), to tell the flags given.

    Raises:
        ValueError: ``--memory-per-device`` without ``--plan auto``, a flag
            the planner chooses given too, another variant or API than the
            Module's, nodes or a resume, or a budget no plan fits
            (:class:`~mp_symbolic.core.planning.planner.PlanError`), each one line.
    """
    # pylint: disable=import-outside-toplevel
    from .cli import build_parser
    if args.plan is None:
        raise ValueError('memory_per_device: expected it with --plan auto, found it alone')
    given = vars(build_parser(defaults=False).parse_args(argv))
    for name, flag in CHOSEN_FLAGS.items():
        if name in given:
            raise ValueError('%s: expected the planner to choose it under --plan auto, found '
                             'it given' % flag)
    if cfg.variant != 'symbolic' or cfg.api != 'module':
        raise ValueError('plan: expected the symbolic variant and the module API under --plan '
                         'auto, found --variant %s --api %s' % (cfg.variant, cfg.api))
    if cfg.nodes != 1 or cfg.resume is not None:
        raise ValueError('plan: expected a plan of this process under --plan auto (no --nodes, '
                         'no --resume), found %s'
                         % ('--nodes %d' % cfg.nodes if cfg.nodes != 1 else '--resume'))
    from ..core.placement.devices import make_plan
    from ..core.planning.planner import Planner
    from .config import DEFAULT_STAGES
    devices = cfg.devices
    if devices is None:
        devices = make_plan(DEFAULT_STAGES, None)[0].all_devices
    batch = cfg.batch_size
    shapes = [(batch,) + tuple(s) for s in task.sample_shapes]
    sample = shapes[0] if len(shapes) == 1 else tuple(shapes)
    params = {k: v for k, v in cfg.optimizer_params().items() if k != 'learning_rate'}
    planner = Planner(loss=task.graph_loss, label_name=task.label,
                      label_shapes=[(task.label, (batch,) + tuple(task.label_shape))],
                      optimizer=cfg.optimizer, optimizer_params=params)
    ranking = planner.choose(task.make_blocks(), devices, sample, args.memory_per_device)
    chosen = ranking.best.candidate
    cfg = replace(cfg, devices=chosen.devices, balance=chosen.balance, chunks=chosen.chunks,
                  schedule=chosen.schedule, replicas=chosen.replicas, mirror=chosen.mirror,
                  virtual=chosen.pipeline_args()['virtual'],
                  shard_optimizer=bool(chosen.shard_optimizer))
    return cfg, ranking


def _flag_line(err):
    """The refusal's one line, its field named as the flag sets it."""
    line = str(err).strip().splitlines()[0]
    field, sep, rest = line.partition(': ')
    return '--memory-per-device: %s' % rest if sep and field == 'memory_per_device' else line
