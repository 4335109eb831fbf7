"""Command line: ``python -m export [--checkpoint DIR | --checkpoint PREFIX --epoch N] [--out DIR]``
``[--input-shape SHAPE | --input-shape NAME=SHAPE ... | --sample FILE.npz]``
``[--verify-batches B1,B2] [--tolerance T] [--dynamic [INPUT:]AXIS=NAME ...]``.

Exports a training checkpoint to an MXNet file pair and ONNX, verifies both
against the checkpoint bound on one device, and commits them under
``--out``/current/. A checkpoint or flag that cannot be exported prints one
line to stderr and exits with status 2; a failed verification or an
unwritable folder exits with status 1; Ctrl-C exits 130, SIGTERM 143, each
with one line. Nothing is written
on error; export never trains.
"""
import re
import sys

from mp_symbolic.tools.cliargs import OneLineArgumentParser, print_error
from mp_symbolic.tools.blas import at_start
from mp_symbolic.tools.interrupts import exit_on_signals, ignore_signals, until_reader_gone
from mp_symbolic.tools.startup import mxnet_without_sklearn

from . import (DEFAULT_CHECKPOINT_DIR, DEFAULT_OUT_DIR, MAX_SAMPLE_ARRAYS, MAX_SAMPLE_BYTES,
               MEMORY_BUDGET, SENSITIVITY_FACTOR, SENSITIVITY_LIMIT, TOLERANCE)
from .errors import excerpt, one_line

__all__ = ['main', 'build_parser']

# A file name prefix on any system: no path separators, no shell or glob
# characters, nothing a command line could take for a flag (a leading '-').
_NAME_RE = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]*')


def build_parser():
    parser = OneLineArgumentParser(
        prog='python -m export',
        description='Export a model-parallel training checkpoint to an MXNet symbol/params '
                    'pair (ctx_group kept) and ONNX, verify both, and commit them as one unit.')
    parser.add_argument('--checkpoint', default=DEFAULT_CHECKPOINT_DIR, metavar='DIR|PREFIX',
                        help='a training folder (python -m mp_symbolic train --out DIR), or the '
                             'prefix of a checkpoint pair saved by mod.save_checkpoint(PREFIX, N)'
                             ' (with --epoch N) (default: %(default)s)')
    parser.add_argument('--epoch', type=int, default=None, metavar='N',
                        help='epoch of a PREFIX checkpoint (PREFIX-NNNN.params)')
    parser.add_argument('--input-shape', action='append', default=None,
                        metavar='D0,D1,...|NAME=D0,D1,...',
                        help='shape of one input sample, e.g. 1,8,8, where the checkpoint does '
                             'not record it (Pipeline modules record it); for several inputs '
                             'NAME=D0,D1 once per input, e.g. data0=16 data1=16 (repeatable)')
    parser.add_argument('--sample', default=None, metavar='FILE.npz',
                        help='one array per input name (data, or data0, data1, ...), batch '
                             'first: the input shapes and dtypes (an array of another dtype '
                             'than the checkpoint takes is cast where no value changes), and '
                             'the data verification runs on; at most %d arrays and %d MiB '
                             'decompressed' % (MAX_SAMPLE_ARRAYS, MAX_SAMPLE_BYTES >> 20))
    parser.add_argument('--verify-batches', default=None, metavar='B1,B2,...',
                        help='batch sizes to verify at, e.g. 1,7, each at most the largest '
                             'whose activations fit %d MiB (default: 1, 7 and the largest up '
                             'to 1000 that fits)' % (MEMORY_BUDGET >> 20))
    parser.add_argument('--tolerance', type=float, default=None, metavar='T',
                        help='largest allowed difference from the checkpoint, as a fraction of '
                             'each output\'s largest |value|, T alone (default: %g, or %g '
                             'times the checkpoint\'s own float32 sensitivity where larger, '
                             'up to %g; see docs/export.md)'
                             % (TOLERANCE, SENSITIVITY_FACTOR, SENSITIVITY_LIMIT * TOLERANCE))
    parser.add_argument('--dynamic', action='append', default=[], metavar='[INPUT:]AXIS=NAME',
                        help='an input axis besides the batch whose size may vary in the ONNX '
                             'file, e.g. 1=seq for a language model\'s sequence length; of the '
                             'first input, or of INPUT: data0:1=seq data1:1=seq for BERT\'s '
                             'token ids and types, axes of one NAME varying together '
                             '(repeatable)')
    parser.add_argument('--out', default=DEFAULT_OUT_DIR, metavar='DIR',
                        help='output folder; files go to DIR/current/ (default: %(default)s)')
    parser.add_argument('--name', default=None,
                        help='file name prefix of the exported files (default: the task\'s name,'
                             ' or the checkpoint prefix\'s)')
    return parser


def _dynamic(items):
    """``['1=seq']`` -> ``{1: 'seq'}`` (the first input's axes), and
    ``['data0:1=seq', 'data1:1=seq']`` -> ``{'data0': {1: 'seq'}, 'data1':
    {1: 'seq'}}``; both kinds may be mixed in one dict."""
    axes = {}
    for item in items:
        head, sep, name = item.partition('=')
        input_name, colon, axis = head.rpartition(':')
        if colon and (not sep or not input_name.isidentifier() or not axis.strip().isdigit()
                      or not name.isidentifier()):
            raise ValueError('--dynamic: expected INPUT:AXIS=NAME such as data0:1=seq, found %s'
                             % excerpt(ascii(item)[1:-1]))
        if not sep or not axis.strip().isdigit() or not name.isidentifier():
            raise ValueError('--dynamic: expected AXIS=NAME such as 1=seq, found %s'
                             % excerpt(ascii(item)[1:-1]))
        into = axes.setdefault(input_name, {}) if colon else axes
        if into.get(int(axis), name) != name:
            raise ValueError('--dynamic: expected one name for axis %d%s, found %s and %s'
                             % (int(axis), ' of %s' % input_name if colon else '',
                                into[int(axis)], name))
        into[int(axis)] = name
    return axes or None


def main(argv=None):
    args = build_parser().parse_args(argv)
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.checkpoint import check_writable_dir
    from mp_symbolic.tools.files import check_path
    from .errors import VerificationError
    from .exporter import export_checkpoint, read_sample
    from .inference import parse_input_shapes
    from .verify import parse_batches
    from mp_symbolic.tools.interrupts import exit_status, interrupt_on_signals
    interrupt_on_signals()  # from here Ctrl-C and SIGTERM raise, reported below
    try:
        if args.name is not None and (not _NAME_RE.fullmatch(args.name)
                                      or len(args.name) > 100):
            raise ValueError('--name: expected a file name prefix such as regression (up to 100 '
                             'letters, digits, ., _ or -, starting with a letter or digit), '
                             'found %s' % excerpt(ascii(args.name)[1:-1]))
        if not args.checkpoint.strip():
            raise ValueError('--checkpoint: expected a training folder or a checkpoint prefix, '
                             'found an empty string')
        # every path before any work: one too long to open, an --out that cannot be a folder
        check_path(args.checkpoint, '--checkpoint')
        if args.sample is not None:
            check_path(args.sample, '--sample')
        check_writable_dir(args.out, '--out')
        shape = parse_input_shapes(args.input_shape) if args.input_shape else None
        batches = parse_batches(args.verify_batches) if args.verify_batches else None
        if args.tolerance is not None and not 0 < args.tolerance < 1:
            raise ValueError('--tolerance: expected a fraction of the output\'s scale in (0, 1) '
                             'such as 1e-4, found %r' % args.tolerance)
        sample = read_sample(args.sample) if args.sample is not None else None
        export_checkpoint(args.checkpoint, args.out, args.name, epoch=args.epoch,
                          input_shape=shape, dynamic_axes=_dynamic(args.dynamic),
                          sample=sample, verify_batches=batches, tolerance=args.tolerance)
    except (VerificationError, OSError, ValueError) as err:
        print_error(one_line(err))
        # a file that failed its checks or could not be written: 1; a bad input: 2
        return 1 if isinstance(err, (VerificationError, OSError)) else 2
    except KeyboardInterrupt as err:
        print_error('%s; the previous export in %s is kept'
                    % ('interrupted' if exit_status(err) == 130 else 'terminated (SIGTERM)',
                       args.out))
        return exit_status(err)
    return 0


if __name__ == '__main__':
    exit_on_signals()  # until main() loads MXNet and onnx, a signal is one line
    at_start()  # OpenBLAS at the CPU's kernel, chosen before MXNet loads
    mxnet_without_sklearn()  # MXNet loads as where scikit-learn is absent
    STATUS = until_reader_gone(main)
    ignore_signals()  # done and written: a signal while MXNet shuts down would end it silently
    sys.exit(STATUS)
