"""Command line: ``python -m export [--checkpoint DIR] [--out DIR] [--name NAME]``.

Exports the symbolic training checkpoint to an MXNet file pair and ONNX,
verifies both and prints the report. A checkpoint that cannot be exported
prints one line to stderr and exits with status 2; a failed verification or
an unwritable folder exits with status 1. Nothing is written on error.
"""
import re
import sys

from mp_symbolic.cliargs import OneLineArgumentParser

from . import DEFAULT_CHECKPOINT_DIR, DEFAULT_OUT_DIR
from .errors import excerpt, one_line

__all__ = ['main', 'build_parser']


def build_parser():
    parser = OneLineArgumentParser(
        prog='python -m export',
        description='Export the model-parallel training checkpoint to an MXNet '
                    'symbol/params pair (ctx_group kept) and ONNX, and verify both.')
    parser.add_argument('--checkpoint', default=None, metavar='DIR',
                        help='folder of a symbolic training run, read through its '
                             'summary.json (default: %s, trained first if it has none)'
                             % DEFAULT_CHECKPOINT_DIR)
    parser.add_argument('--out', default=DEFAULT_OUT_DIR, metavar='DIR',
                        help='output folder (default: %(default)s)')
    parser.add_argument('--name', default='regression',
                        help='file name prefix of the exported files (default: %(default)s)')
    return parser


# A file name prefix on any system: no path separators, no shell or glob
# characters, nothing a command line could take for a flag (a leading '-').
_NAME_RE = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]*')


def main(argv=None):
    args = build_parser().parse_args(argv)
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.checkpoint import check_writable_dir
    from .errors import VerificationError
    from .exporter import export_checkpoint
    try:
        if not _NAME_RE.fullmatch(args.name) or len(args.name) > 100:
            raise ValueError('--name: expected a file name prefix such as regression (up to 100 '
                             'letters, digits, ., _ or -, starting with a letter or digit), '
                             'found %s' % excerpt(ascii(args.name)[1:-1]))
        check_writable_dir(args.out, '--out')
        export_checkpoint(args.checkpoint or DEFAULT_CHECKPOINT_DIR, args.out, args.name,
                          train_if_missing=args.checkpoint is None)
    except (VerificationError, OSError, ValueError) as err:
        print('error: %s' % one_line(err), file=sys.stderr)
        # a file that failed its checks or could not be written: 1; a bad input: 2
        return 1 if isinstance(err, (VerificationError, OSError)) else 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
