"""Command line: ``python -m mp_symbolic train|compare ...``.

Parses flags into a :class:`~mp_symbolic.config.TrainConfig` and calls
:func:`~mp_symbolic.train.train` or :func:`~mp_symbolic.compare.compare`.
User errors (a bad flag value, a device plan that cannot be made, an output
folder that cannot be written) print one line to stderr naming the flag and
exit with status 2 before any work; training that diverges or a file that
cannot be written exits 1; ``compare`` exits 3 when the variants disagree.
"""
import argparse
import sys

from .config import APIS, OPTIMIZERS, VARIANTS, TrainConfig
from .launch import add_launch_parser

__all__ = ['main', 'build_parser']

_DEFAULTS = TrainConfig()


def _widths(text):
    try:
        return tuple(int(w) for w in text.split(','))
    except ValueError:
        raise argparse.ArgumentTypeError(
            "expected comma-separated integers such as 2,2,2,1, found %r" % text) from None


def add_train_flags(parser):
    """The flags of one training run; shared by every command that trains."""
    parser.add_argument('--devices', default=None, metavar='LIST',
                        help="one device per stage, e.g. 'cpu:0,cpu:1,cpu:2', 'gpu:0,gpu:1,gpu:2' "
                             "or a mix; fewer devices than layers makes contiguous stages "
                             "(default: three GPUs if MXNet sees them, else cpu:0,cpu:1,cpu:2)")
    parser.add_argument('--epochs', type=int, default=_DEFAULTS.num_epochs, dest='num_epochs',
                        help='passes over the data (default: %(default)s)')
    parser.add_argument('--batch-size', type=int, default=_DEFAULTS.batch_size,
                        help='examples per step (default: %(default)s)')
    parser.add_argument('--lr', type=float, default=_DEFAULTS.lr,
                        help='learning rate (default: %(default)s)')
    parser.add_argument('--optimizer', choices=OPTIMIZERS, default=_DEFAULTS.optimizer,
                        help='optimizer (default: %(default)s)')
    parser.add_argument('--momentum', type=float, default=_DEFAULTS.momentum,
                        help='SGD momentum (default: %(default)s)')
    parser.add_argument('--widths', type=_widths, default=_DEFAULTS.widths, metavar='W0,W1,...',
                        help='layer widths, input first (default: 2,2,2,1)')
    parser.add_argument('--num-examples', type=int, default=_DEFAULTS.num_examples,
                        help='synthetic examples (default: %(default)s)')
    parser.add_argument('--seed', type=int, default=_DEFAULTS.seed,
                        help='seed of data, batch order and initial parameters '
                             '(default: %(default)s)')
    parser.add_argument('--no-progress', dest='progress', action='store_false',
                        help='no progress bar')


def build_parser():
    parser = argparse.ArgumentParser(
        prog='python -m mp_symbolic',
        description='Model-parallel training of a three-layer linear regression in MXNet 1.x.')
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
    add_train_flags(train)
    train.add_argument('--out', default=None, metavar='DIR',
                       help='output folder (default: artifacts/<variant>)')
    train.add_argument('--profile', action='store_true',
                       help='write an MXNet profiler trace (Chrome trace format) to '
                            '<out>/profile.json')
    compare = commands.add_parser(
        'compare', help='train every variant side by side and compare them',
        description='Train the symbolic graph model-parallel (Module API), its imperative '
                    'twin on the same devices, and the symbolic graph on one device, from '
                    'the same start and batch order; print one table and write results '
                    'JSON, a loss plot and the device-coloured graph under --out. Exits 1 '
                    'if the variants do not agree within the stated tolerance.')
    add_train_flags(compare)
    compare.add_argument('--out', default='artifacts/compare', metavar='DIR',
                         help='output folder (default: %(default)s)')
    add_launch_parser(commands)
    return parser


def config_from_args(args, **overrides):
    """The :class:`TrainConfig` for parsed ``args`` (fields it has)."""
    names = TrainConfig.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return TrainConfig(**values)


# Config field -> the flag that sets it, for error messages.
_FLAG_OF = {'num_epochs': '--epochs', 'batch_size': '--batch-size', 'lr': '--lr',
            'optimizer': '--optimizer', 'momentum': '--momentum', 'widths': '--widths',
            'num_examples': '--num-examples', 'seed': '--seed', 'variant': '--variant',
            'api': '--api', 'out': '--out', 'devices': '--devices', 'profile': '--profile'}

EXIT_USAGE = 2       # a flag value or device plan that cannot work; nothing was done
EXIT_FAILED = 1      # training diverged, or a file could not be written
EXIT_DISAGREE = 3    # compare: the variants did not agree within the tolerance


def _flag_message(err):
    """``'num_epochs: expected ...'`` -> ``'--epochs: expected ...'``."""
    field, sep, rest = str(err).partition(': ')
    if sep and field in _FLAG_OF:
        return '%s: %s' % (_FLAG_OF[field], rest)
    return str(err)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == 'launch':
        return args.run(args)
    # Imported after parsing so that --help and flag errors do not wait for MXNet.
    # pylint: disable=import-outside-toplevel
    from .checkpoint import check_writable_dir
    from .placement import make_plan
    from .train import TrainingDiverged, train
    try:
        cfg = config_from_args(args)
        plan, _ = make_plan(cfg.num_layers, cfg.devices)  # validate before any work
        cfg.check_profiler_devices(plan.devices)
        check_writable_dir(cfg.out_dir, 'out')
    except ValueError as err:
        print('error: %s' % _flag_message(err), file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == 'compare':
            from .compare import compare
            return 0 if compare(cfg).agree else EXIT_DISAGREE
        train(cfg)
    except (OSError, TrainingDiverged) as err:
        print('error: %s' % err, file=sys.stderr)
        return EXIT_FAILED
    return 0
