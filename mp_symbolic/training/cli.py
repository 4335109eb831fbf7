"""Command line: ``python -m mp_symbolic train|compare|launch|sample|pair|blas ...``.

Parses flags into a :class:`~mp_symbolic.training.config.TrainConfig` and calls
:func:`~mp_symbolic.training.loop.train` or :func:`~mp_symbolic.training.compare.compare`
(``launch`` lives in :mod:`~mp_symbolic.tools.launch`, ``pair`` in
:func:`~mp_symbolic.tools.checkpoint.write_pair`, ``sample`` in
:mod:`~mp_symbolic.training.sample`, ``blas`` in :mod:`~mp_symbolic.tools.blas`). User errors (a bad flag
value, a device plan that cannot be made, an output folder that cannot be
written or is in use, a checkpoint that cannot be resumed) print one line to
stderr naming the flag and exit with status 2 before any work; training that
diverges or does not learn, or a file that cannot be written, exits 1;
Ctrl-C exits 130 (SIGTERM 143) keeping the last committed checkpoint; ``compare`` exits 3
when the variants disagree.
"""
import argparse
import ast
import os
import sys

from ..core.base.checks import excerpt
from ..tools.cliargs import USAGE_ERROR, OneLineArgumentParser, print_error
from ..tools.files import shown_path
from .config import APIS, BATCHNORM_MODES, KVSTORES, OPTIMIZERS, SCHEDULES, VARIANTS, \
    TrainConfig
from ..tools.interrupts import Terminated, exit_status, ignore_signals, interrupt_on_signals
from ..tools.launch import add_launch_parser, check_dist_environment
from . import plan as planning, sample

__all__ = []

_DEFAULTS = TrainConfig()


def _int_list(example):
    def parse(text):
        try:
            return tuple(int(w) for w in text.split(','))
        except ValueError:
            raise argparse.ArgumentTypeError(
                'expected comma-separated integers such as %s, found %r' % (example, text)) from None
    return parse


def _balance(text):
    return 'time' if text == 'time' else _int_list('2,1')(text)


def _size(text):
    from ..core.planning.sizes import parse_size  # pylint: disable=import-outside-toplevel
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).partition(': ')[2]) from None


def _task_arg(text):
    """``'KEY=VALUE'`` -> ``(key, value)``; the value is a Python literal
    (``4``, ``0.5``, ``2,4,1``, ``'x'``) or else the text itself."""
    key, sep, value = text.partition('=')
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError('expected KEY=VALUE with KEY a Python name, found %s'
                                         % excerpt(repr(text)))
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return key, value


def add_train_flags(parser, defaults=True):
    """The flags of one training run; shared by every command that trains."""
    parser.add_argument('--task', default=_DEFAULTS.task, metavar='TASK',
                        help='regression: the seed question\'s 2-2-2-1 linear network on '
                             'synthetic data; digits: a CNN on scikit-learn\'s 8x8 digits; '
                             'zoo: a model-zoo network on them; lm: a character-level GPT on '
                             'the Python standard library; '
                             'FILE.py or a module name: your own task, a file defining '
                             'task(**kwargs) -> mp_symbolic.Task (default: %(default)s)')
    parser.add_argument('--task-arg', type=_task_arg, action='append', default=[],
                        dest='task_arg', metavar='KEY=VALUE',
                        help='keyword argument of task(), repeatable; VALUE is a Python '
                             'literal (4, 0.5, 2,4,1) or text')
    parser.add_argument('--devices', default=None, metavar='LIST',
                        help="one device per stage, e.g. 'cpu:0,cpu:1,cpu:2', 'gpu:0,gpu:1,gpu:2' "
                             "or a mix; 'cpu:0+cpu:1,cpu:2': a first stage of two devices for "
                             "tensor-parallel layers; with --replicas R, R x stages devices listed "
                             "replica by replica (default: three GPUs if MXNet sees them, else "
                             "cpu:0,cpu:1,cpu:2)")
    parser.add_argument('--balance', type=_balance, default=None, metavar='N0,N1,...|time',
                        help='blocks per stage, or time to balance by measured forward + '
                             'backward time (default: balanced by parameter count)')
    parser.add_argument('--epochs', type=int, default=None, dest='num_epochs',
                        help="passes over the data (default: the task's; 5 regression, 10 "
                             'digits)')
    parser.add_argument('--batch-size', type=int, default=None,
                        help='examples per step, across replicas and workers '
                             "(default: the task's; 100 regression, 64 digits)")
    parser.add_argument('--lr', type=float, default=None,
                        help="learning rate (default: the task's; 0.02 regression, 0.1 digits)")
    parser.add_argument('--optimizer', choices=OPTIMIZERS, default=None,
                        help="optimizer (default: the task's; sgd for both bundled tasks)")
    parser.add_argument('--momentum', type=float, default=None,
                        help="SGD momentum (default: the task's; 0 regression, 0.9 digits)")
    parser.add_argument('--widths', type=_int_list('2,2,2,1'), default=None,
                        metavar='W0,W1,...',
                        help='regression: layer widths, input first; 2 inputs, 1 output, any '
                             'number of layers between (default: 2,2,2,1, three layers); the '
                             'same as --task-arg widths=W0,W1,...')
    parser.add_argument('--num-examples', type=int, default=None,
                        help='regression: synthetic examples (default: 10000); the same as '
                             '--task-arg num_examples=N')
    parser.add_argument('--seed', type=int, default=_DEFAULTS.seed,
                        help='seed of data, batch order and initial parameters '
                             '(default: %(default)s)')
    parser.add_argument('--no-progress', dest='progress', action='store_false',
                        help='no progress bar')


def build_parser(defaults=True, prog='python -m mp_symbolic'):
    """The parser; with ``defaults=False`` flags not given are left out of
    the result (to tell what a user set from a default)."""
    parser = OneLineArgumentParser(
        prog=prog,
        description='Model-parallel training in MXNet 1.x: your own task (a file defining '
                    'task() -> mp_symbolic.Task), the seed question\'s regression or a CNN on '
                    '8x8 digits, split over devices by mp_symbolic.Pipeline.')
    commands = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
    train = commands.add_parser(
        'train', help='train one variant and write its checkpoint',
        description='Train the network model-parallel, print placement and results, '
                    'and write a checkpoint (symbol JSON + params) under --out.')
    train.add_argument('--variant', choices=VARIANTS, default=_DEFAULTS.variant,
                       help='symbolic: ctx_group graph bound with group2ctx; '
                            'imperative: Gluon + autograd (default: %(default)s)')
    train.add_argument('--api', choices=APIS, default=_DEFAULTS.api,
                       help='symbolic variant: train through mx.mod.Module or the '
                            'Symbol executor API (default: %(default)s)')
    add_train_flags(train, defaults)
    train.add_argument('--chunks', type=int, default=1,
                       help='symbolic variant: micro-batches per batch, pipelined by MXNet\'s '
                            'engine (GPipe); must divide the batch size (default: 1)')
    train.add_argument('--schedule', choices=SCHEDULES, default=_DEFAULTS.schedule,
                       help='symbolic variant, Module API: the micro-batches\' order, gpipe '
                            '(one graph, fill and drain), 1f1b (one forward, one backward; '
                            'activation memory flat in --chunks) or interleaved (1f1b over '
                            '--virtual stages per device; --chunks a multiple of the devices) '
                            '(default: %(default)s)')
    train.add_argument('--batchnorm', choices=BATCHNORM_MODES, default=_DEFAULTS.batchnorm,
                       help='symbolic variant, Module API: BatchNorm\'s running statistics with '
                            '--chunks, updated by each micro-batch in turn (micro-batch) or once '
                            'per batch with the whole batch\'s (deferred) (default: %(default)s)')
    train.add_argument('--virtual', type=int, default=None, metavar='V',
                       help='--schedule interleaved: stages per device, the network cut into '
                            'V x devices stages placed round-robin (default: 2)')
    train.add_argument('--mirror', action='store_true',
                       help='symbolic variant: recompute every stage\'s activations in the '
                            'backward pass instead of keeping them (MXNet\'s mirroring)')
    train.add_argument('--no-mirror', dest='mirror', action='store_false',
                       help='keep the activations (the default; with --resume, turns off the '
                            'checkpoint\'s --mirror)')
    train.add_argument('--shard-optimizer', action='store_true',
                       help='Module API: each replica (and dist_sync worker) holds and updates '
                            'the optimizer state of its share of each stage\'s parameters, then '
                            'sends the updated values to the others (ZeRO stage 1)')
    train.add_argument('--no-shard-optimizer', dest='shard_optimizer', action='store_false',
                       help='every replica holds the whole optimizer state (the default; with '
                            '--resume, turns off the checkpoint\'s --shard-optimizer)')
    train.add_argument('--replicas', type=int, default=1,
                       help='data-parallel copies of the pipeline (default: 1)')
    train.add_argument('--plan', choices=('auto',), default=None,
                       help='symbolic variant, Module API: auto chooses the stages and their '
                            'balance, --replicas, --chunks, --schedule, --virtual and --mirror '
                            'over --devices from the memory estimate and the schedule '
                            'simulated over stage times measured on them (docs/planning.md)')
    train.add_argument('--memory-per-device', type=_size, default=None, metavar='SIZE',
                       help='--plan auto: the memory each device may hold, 2GiB, 512MB, 1.5G '
                            '(default: no limit, the fastest plan)')
    train.add_argument('--kvstore', choices=KVSTORES, default=None,
                       help='sums gradients across replicas or processes (default: local with '
                            'several replicas, else none)')
    train.add_argument('--nodes', type=int, default=1, metavar='N',
                       help='node processes the stages are divided over, in order (each '
                            'binds and holds only its stages); run one process per node with '
                            'torchrun or python -m mp_symbolic launch --nodes N, which give '
                            'each its rank (default: 1, every stage in this process)')
    train.add_argument('--node-timeout', type=float, default=None, metavar='S',
                       help='--nodes: seconds a node waits on another (a tensor, a '
                            'checkpoint) before the job ends: a stopped or wedged node '
                            '(default: 300)')
    train.add_argument('--no-memory', dest='memory', action='store_false',
                       help='skip the memory-per-device table (symbolic variant; measured in '
                            'two child processes before training)')
    train.add_argument('--checkpoint-every', type=int, default=1, metavar='N',
                       help='commit a checkpoint (weights and optimizer state) every N epochs '
                            'and at the end (default: %(default)s)')
    train.add_argument('--resume', default=None, metavar='DIR',
                       help='continue the last committed checkpoint in DIR up to --epochs (the '
                            'run\'s data, widths, optimizer and seed come from the checkpoint, '
                            'and so does its plan: --devices, --balance, --schedule, --chunks, '
                            '--virtual, --replicas, --mirror, --api, unless given); output goes '
                            'to DIR unless --out is given')
    train.add_argument('--out', default=None, metavar='DIR',
                       help='output folder (default: artifacts/<variant> for the regression, '
                            'artifacts/<task>[-imperative] for other tasks)')
    train.add_argument('--profile', action='store_true',
                       help='write an MXNet profiler trace (Chrome trace format) to '
                            '<out>/profile.json')
    compare = commands.add_parser(
        'compare', help='train every variant side by side and compare them',
        description='Train the symbolic graph model-parallel (Module API), its imperative '
                    'twin on the same devices, and the symbolic graph on one device, from '
                    'the same start and batch order; print one table and write results '
                    'JSON, a loss plot and the device-coloured graph under --out. Exits 3 '
                    'if the variants do not agree within the stated tolerance.')
    add_train_flags(compare, defaults)
    compare.add_argument('--out', default='artifacts/compare', metavar='DIR',
                         help='output folder (default: %(default)s)')
    compare.add_argument('--agree-steps', type=int, default=None, metavar='N',
                         help='judge agreement on the losses of the first N steps only, for a '
                              'chaotic network whose runs drift apart later (default: every '
                              "step's loss and every final parameter)")
    add_launch_parser(commands, {'train': _check_worker, 'compare': _check_worker})
    pair = commands.add_parser(
        'pair', help="write a checkpoint of node processes as MXNet's own pair",
        description="Write the committed checkpoint of a training folder trained over node "
                    "processes (one part per node) as MXNet's own pair, which "
                    "mx.model.load_checkpoint reads, into a new training folder (symbol, "
                    "params, optimizer states, summary), reading and writing one array at a "
                    "time.")
    pair.add_argument('--checkpoint', required=True, metavar='DIR',
                      help='a training folder (its committed checkpoint, DIR/current)')
    pair.add_argument('--out', required=True, metavar='DIR',
                      help='the training folder to write (new, empty, or one of a pair)')
    sample.add_sample_flags(commands.add_parser(
        'sample', help='continue a prompt with a trained character-level model',
        description=sample.DESCRIPTION))
    plan = commands.add_parser(
        'plan', help='the memory per device of a training run, estimated before allocation',
        description=planning.DESCRIPTION, usage='%(prog)s [train\'s flags]')
    plan.add_argument('rest', nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    blas = commands.add_parser(
        'blas', help="the OpenBLAS kernel chosen for this CPU, and its check's verdict",
        description="Print the CPU's features, the OpenBLAS kernel (OPENBLAS_CORETYPE) the "
                    "commands set for it before MXNet loads, the verdict of its check (MXNet's "
                    "dot and batch_dot against float64 products, run once and cached), and "
                    "OpenBLAS's own choice. MP_SYMBOLIC_BLAS=default, or OPENBLAS_CORETYPE or "
                    "OPENBLAS_L2_SIZE already set, leaves the kernel to OpenBLAS.")
    blas.add_argument('--recheck', action='store_true',
                      help='run the check again rather than read its cached verdict')
    if not defaults:
        for subparser in commands.choices.values():
            for action in subparser._actions:  # pylint: disable=protected-access
                action.default = argparse.SUPPRESS
    return parser


def _task_args(values):
    """``--task-arg`` pairs, and the regression's ``--widths`` / ``--num-examples``
    (shorthands for two of them), as one ``task_args`` tuple."""
    pairs = list(values.pop('task_arg', None) or [])
    for name in ('widths', 'num_examples'):
        if values.get(name) is not None:
            pairs.append((name, values[name]))
        values.pop(name, None)
    seen = {}
    for key, value in pairs:
        if key in seen and seen[key] != value:
            raise ValueError('task_args: expected each KEY once, found %s=%r and %s=%r'
                             % (key, seen[key], key, value))
        seen[key] = value
    return tuple(seen.items())


def _check_worker(argv):
    """Checks a launched worker's ``train ...`` / ``compare ...`` arguments as
    its process will read them (flags and config values; a task file must
    exist), so that a bad one is refused before any process starts.

    Raises:
        ValueError: a config value that cannot work; argparse exits 2 with
            one line for a flag it cannot parse.
    """
    args = build_parser(prog='worker command: python -m mp_symbolic').parse_args(list(argv))
    try:
        cfg = config_from_args(args, list(argv))
    except ValueError as err:
        raise ValueError('worker command: %s' % _flag_message(err)) from None
    if (cfg.task.endswith('.py') or os.sep in cfg.task) and not os.path.isfile(cfg.task):
        raise ValueError('worker command: --task %s: expected a task file, found no file %s'
                         % (shown_path(cfg.task), shown_path(cfg.task)))


def _restarted(args):
    """``{'resume': OUT}`` for a run torchrun restarted after a failure
    (``TORCHELASTIC_RESTART_COUNT`` above 0) whose ``--out`` holds a
    committed checkpoint and that resumes nothing else: it continues where
    the job left off. Else ``{}``."""
    # pylint: disable=import-outside-toplevel
    from ..tools.store import Store
    restarts = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')
    out = getattr(args, 'out', None)
    if not (restarts.isdigit() and int(restarts) > 0) or out is None or \
            getattr(args, 'resume', None) is not None:
        return {}
    try:
        committed = Store(out).has_snapshot()
    except (OSError, ValueError):
        return {}
    if committed:
        print('torchrun restart %s: resuming from the last checkpoint committed in %s'
              % (restarts, out), flush=True)
        return {'resume': out}
    return {}


def config_from_args(args, argv=None, **overrides):
    """The :class:`TrainConfig` for parsed ``args`` (fields it has).

    With ``--resume``, the run's identity comes from the checkpoint and only
    the flags given in ``argv`` override it.
    """
    names = TrainConfig.__dataclass_fields__
    raw = vars(args).copy()
    task_args = _task_args(raw)
    values = {k: v for k, v in raw.items() if k in names}
    values['task_args'] = task_args
    values.update(overrides)
    from ..tools.files import check_path  # pylint: disable=import-outside-toplevel
    for name in ('out', 'resume'):  # a path the system refuses: before any work
        if isinstance(values.get(name), str) and values[name].strip():
            check_path(values[name], name)
    if values.get('resume') is None:
        return TrainConfig(**values)
    if not values['resume'].strip():
        raise ValueError('resume: expected a training folder, found an empty string')
    # pylint: disable=import-outside-toplevel
    from ..tools.checkpoint import read_checkpoint
    from .config import resume_config
    given = vars(build_parser(defaults=False).parse_args(argv))
    given_args = _task_args(given)
    given = {k: v for k, v in given.items() if k in names}
    if given_args:
        given['task_args'] = given_args
    given.update(overrides)
    saved = read_checkpoint(values['resume']).summary.get('config')
    return resume_config(saved, given)


# Config field -> the flag that sets it, for error messages.
_FLAG_OF = {'num_epochs': '--epochs', 'batch_size': '--batch-size', 'lr': '--lr',
            'optimizer': '--optimizer', 'momentum': '--momentum', 'widths': '--widths',
            'num_examples': '--num-examples', 'seed': '--seed', 'variant': '--variant',
            'api': '--api', 'out': '--out', 'devices': '--devices', 'profile': '--profile',
            'task': '--task', 'task_args': '--task-arg', 'chunks': '--chunks', 'schedule': '--schedule', 'virtual': '--virtual',
            'batchnorm': '--batchnorm',
            'replicas': '--replicas',
            'kvstore': '--kvstore', 'balance': '--balance',
            'checkpoint_every': '--checkpoint-every', 'resume': '--resume', 'mirror': '--mirror',
            'shard_optimizer': '--shard-optimizer',
            'nodes': '--nodes', 'node_timeout': '--node-timeout',
            'agree_steps': '--agree-steps', 'memory_per_device': '--memory-per-device',
            'micro-batches': '--chunks'}  # the schedules' word for them (core/schedule.py)

EXIT_USAGE = 2       # a flag value or device plan that cannot work; nothing was done
EXIT_FAILED = 1      # training diverged, or a file could not be written
EXIT_DISAGREE = 3    # compare: the variants did not agree within the tolerance


def _flag_message(err, task=None, virtual=1):
    """``'num_epochs: expected ...'`` -> ``'--epochs: expected ...'``; a device
    plan that cannot be made names ``--devices``, or ``--virtual`` for more
    stages than blocks where the run's schedule puts ``virtual`` (more than
    one) on each device."""
    # pylint: disable=import-outside-toplevel
    from ..core.base.checks import DeviceSpecError  # these without MXNet: the launcher's checks
    from .tasks import TaskLoadError
    if isinstance(err, TaskLoadError):
        if err.arg is not None:
            return '%s: %s' % (_FLAG_OF.get(err.arg, '--task-arg %s' % err.arg), err)
        return '--task %s: %s' % (shown_path(err.spec), err)
    if task is not None:
        from ..core.task import TaskError
        if isinstance(err, TaskError):
            return '--task %s: %s' % (shown_path(task), err)
    field, sep, rest = str(err).partition(': ')
    if sep and field in _FLAG_OF:
        return '%s: %s' % (_FLAG_OF[field], rest)
    if isinstance(err, DeviceSpecError):
        # more stages than blocks: with stages per device, the number asked for is --virtual's
        if virtual > 1:
            from ..core.placement.balance import TooManyStages
            if isinstance(err, TooManyStages):
                return '--virtual: %s' % err
        return '--devices: %s' % err
    return str(err)


def _plan_parser():
    """The parser ``plan`` reads train's flags with: its refusals name
    ``python -m mp_symbolic plan``, not ``train``."""
    parser = build_parser()
    commands = next(a for a in parser._actions  # pylint: disable=protected-access
                    if isinstance(a, argparse._SubParsersAction))  # pylint: disable=W0212
    commands.choices['train'].prog = '%s plan' % parser.prog
    return parser


def _stages_per_device(cfg):
    """The stages per device of ``cfg``'s schedule, as its record counts them
    (:func:`~mp_symbolic.core.schedule.check_spec`); 1 without a config."""
    if cfg is None:
        return 1
    from ..core.schedule import check_spec  # pylint: disable=import-outside-toplevel
    return check_spec(cfg.schedule, cfg.virtual)


def _make_folder(path):
    """Creates the output folder now, so that a path the system refuses (under
    /proc, a name too long) is an error before any work, naming the flag."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ValueError('out: expected a folder this user can create, found %s refused: %s'
                         % (path, err.strerror or err)) from None


def _pair(args):
    """``python -m mp_symbolic pair``: exit status 0, 2 (refused) or 1
    (a file could not be written)."""
    # pylint: disable=import-outside-toplevel
    from ..tools.checkpoint import read_checkpoint, write_pair
    from ..tools.files import check_path
    from ..tools.store import check_store_folder
    try:
        for name in ('checkpoint', 'out'):
            check_path(getattr(args, name), '--' + name)
        check_store_folder(args.out, 'training', '--out')
        if os.path.realpath(args.out) == os.path.realpath(args.checkpoint):
            raise ValueError('--out: expected a folder other than --checkpoint, found the same')
        with read_checkpoint(args.checkpoint) as checkpoint:
            write_pair(checkpoint, args.out)
    except ValueError as err:
        print('error: %s' % ' '.join(str(err).split()), file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:
        print('error: %s' % ' '.join(str(err).split()), file=sys.stderr)
        return EXIT_FAILED
    return 0


def _printable_streams():
    # A path the terminal's encoding cannot show is printed escaped, not a crash
    # after the work is done.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, 'reconfigure'):
            stream.reconfigure(errors='backslashreplace')


def main(argv=None):
    _printable_streams()
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ['plan'] and not {'-h', '--help'} & set(given[1:2]):
        given = ['plan', '--'] + given[1:]  # every flag after it is train's
    args = build_parser().parse_args(given)
    if args.command == 'launch':
        return args.run(args)
    if args.command == 'sample':
        return sample.run(args)
    if args.command == 'pair':
        return _pair(args)
    if args.command == 'plan':  # train's flags, read by train's parser
        return planning.run(args.rest, _plan_parser().parse_args, config_from_args,
                            lambda line: print('error: %s' % line, file=sys.stderr), EXIT_USAGE,
                            lambda err, cfg: _flag_message(err, getattr(cfg, 'task', None),
                                                           _stages_per_device(cfg)))
    if args.command == 'blas':
        from ..tools.blas import report  # pylint: disable=import-outside-toplevel
        try:
            return report(recheck=args.recheck)
        except ValueError as err:
            print_error(err)
            return USAGE_ERROR
    # Imported after parsing so that --help and flag errors do not wait for MXNet.
    # pylint: disable=import-outside-toplevel
    from ..tools.checkpoint import check_writable_dir
    from ..tools.store import check_store_folder
    from ..core.transport.nodes import NodeFailure, claim_line as node_line
    from .loop import TrainingDidNotLearn, TrainingDiverged, build_pipeline, load, train
    spec = cfg = None
    try:
        cfg = config_from_args(args, argv, **_restarted(args))
        check_dist_environment(cfg.kvstore)  # dist_sync: only in a process launch started
        spec = cfg.task
        task, cfg = load(cfg)
        if getattr(args, 'plan', None) or getattr(args, 'memory_per_device', None):
            cfg, ranking = planning.auto(cfg, task, args, given)
            print('plan auto: %s: %s' % (ranking.best.candidate, ranking.why()), flush=True)
        if args.command == 'compare':
            from .compare import check_comparable
            check_comparable(task)
        built = build_pipeline(cfg, task)  # the whole plan, before any work
        cfg.check_profiler_devices(built[0].plan.all_devices)
        check_writable_dir(cfg.out_dir, 'out')
        # Not an export folder, not inside a training or export folder or a snapshot.
        check_store_folder(cfg.out_dir, 'training' if args.command == 'train' else None, 'out')
        _make_folder(cfg.out_dir)
    except ValueError as err:
        print('error: %s' % _flag_message(err, spec, _stages_per_device(cfg)), file=sys.stderr)
        return EXIT_USAGE
    except NodeFailure as err:  # another node did not join
        print('error: %s' % err, file=sys.stderr)
        return EXIT_FAILED
    interrupt_on_signals()  # from here Ctrl-C and SIGTERM raise, reported below
    try:
        if args.command == 'compare':
            from .compare import compare
            return 0 if compare(cfg, task=task).agree else EXIT_DISAGREE
        train(cfg, built=built, task=task)
        if os.environ.get('DMLC_ROLE') != 'worker':
            # done and written: from here a signal must neither raise a traceback
            # while the process exits nor kill it silently
            ignore_signals()
    except ValueError as err:  # a folder in use, a checkpoint that cannot be resumed
        print('error: %s' % _flag_message(err, spec, _stages_per_device(cfg)), file=sys.stderr)
        return EXIT_USAGE
    except (OSError, TrainingDiverged, TrainingDidNotLearn, NodeFailure) as err:
        if isinstance(err, NodeFailure) and not node_line():
            return EXIT_FAILED  # the parent watch prints the node's line and ends it
        print('error: %s' % err, file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as err:
        print('error: %s; the last committed checkpoint in %s is kept'
              % ('terminated (SIGTERM)' if isinstance(err, Terminated) else 'interrupted',
                 cfg.out_dir), file=sys.stderr)
        return exit_status(err)
    return 0
