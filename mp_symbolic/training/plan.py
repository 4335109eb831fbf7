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
device and the largest. Nothing is bound, run or written.
"""
import sys

__all__ = []

DESCRIPTION = ('Print the memory per device of a training run, estimated from shapes and '
               'MXNet\'s own memory planning before anything is allocated: the rows of the '
               'table train measures after one step. Takes train\'s flags (--task, --devices, '
               '--chunks, --schedule, --virtual, --replicas, --mirror, --balance, '
               '--batch-size, --optimizer, ...); binds, runs and writes nothing.')


def run(rest, parse, config_from_args, error, usage_error):
    """The ``plan`` command on ``rest`` (train's flags).

    Args:
        rest: The arguments after ``plan``.
        parse: ``argv -> namespace`` of the command line's parser.
        config_from_args: ``(namespace, argv) -> TrainConfig``.
        error: Prints a refusal's one line.
        usage_error: The exit status of a refusal.

    Returns:
        0, or ``usage_error`` after one line on stderr.
    """
    rest = list(rest[1:]) if rest[:1] == ['--'] else list(rest)
    args = parse(['train'] + rest)
    if args.variant != 'symbolic' or args.api != 'module':
        error('plan: expected the symbolic variant and the module API (the table is the '
              'Module\'s), found --variant %s --api %s' % (args.variant, args.api))
        return usage_error
    if args.nodes != 1 or args.resume is not None:
        error('plan: expected a plan of this process (no --nodes, no --resume), found %s'
              % ('--nodes %d' % args.nodes if args.nodes != 1 else '--resume'))
        return usage_error
    # pylint: disable=import-outside-toplevel
    from .loop import build_pipeline, load
    from ..tools.memory import format_bytes, format_memory
    from ..tools.planning import estimate_memory
    try:
        cfg = config_from_args(args, ['train'] + rest)
        task, cfg = load(cfg)
        pipe, _ = build_pipeline(cfg, task)
        data_shapes = task.data_shapes(cfg.batch_size, pipe.data_names())
        label_shapes = [(task.label, (cfg.batch_size,) + tuple(task.label_shape))]
        table = estimate_memory(pipe, data_shapes=data_shapes, label_shapes=label_shapes,
                                loss=task.graph_loss, optimizer=cfg.optimizer,
                                optimizer_params=cfg.optimizer_params())
    except ValueError as err:
        error(str(err).strip().splitlines()[0])
        return usage_error
    plan = ' '.join(['%s: %d stage(s) on %s' % (task.name, pipe.plan.num_stages,
                                                 pipe.plan.spec),
                     '--schedule %s --chunks %d' % (cfg.schedule, cfg.chunks)] +
                    (['--replicas %d' % cfg.replicas] if cfg.replicas > 1 else []) +
                    (['--mirror'] if cfg.mirror else []) +
                    (['--shard-optimizer'] if cfg.shard_optimizer else []) +
                    ['--batch-size %d --optimizer %s' % (cfg.batch_size, cfg.optimizer)])
    print(plan)
    print('memory per device, estimated before allocation (other: activations and workspace, '
          'from MXNet\'s memory plan of the training graph):')
    for line in format_memory(table.as_dict()):
        print('    ' + line)
    largest = max(table, key=lambda row: row.total)
    print('total %s on %d device(s); the most on %s: %s'
          % (format_bytes(table.total), len(table), largest.device,
             format_bytes(largest.total)))
    sys.stdout.flush()
    return 0
