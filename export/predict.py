"""Command line: predictions from an exported model.

    python -m export.predict --model artifacts/export/current/regression.onnx --input x.csv
    python -m export.predict --model artifacts/export/current/regression-symbol.json \\
        --input x.npy --output y.npy --devices cpu:0,cpu:1,cpu:2

``--model`` is the ``.onnx`` file (run by onnxruntime) or the ``-symbol.json``
of the MXNet pair (params file found beside it), bound with ``group2ctx`` on
``--devices``: one device per stage keeps the model-parallel split, a single
device takes every stage. ``--input`` is ``.npy`` (``(samples, features)``,
or ``(samples,) + one sample's shape``, such as ``(N, 3, 64, 64)`` images) or
``.csv`` (``-``: CSV on stdin), one sample per row; CSV text holds at most
:data:`~export.MAX_CSV_BYTES` (64 MiB). A model of several inputs (BERT's
``data0``, ``data1``, ``data2``) takes a ``.npz`` (``numpy.savez``) of one
batch per input, named as the inputs (a model of one input takes one too,
named ``data``); its first output is predicted. Predictions, of the model's own rank,
go to stdout as CSV, or to ``--output`` (``.csv`` or ``.npy``; any other name
is refused rather than guessed); CSV takes predictions of one or two
dimensions, ``.npy`` any.

Every failure is one line on stderr starting ``error:``, and nothing is
written. Exit status: 2 for a bad flag, model or input; 1 if the predictions
are not all finite numbers (NaN or inf) or cannot be written (a full disk, a
closed pipe); 130 if interrupted (Ctrl-C), 143 on SIGTERM.
"""
import errno
import os
import sys

from mp_symbolic.tools.cliargs import USAGE_ERROR, OneLineArgumentParser, print_error
from mp_symbolic.tools.files import check_path
from mp_symbolic.tools.interrupts import (exit_on_signals, exit_status, ignore_signals,
                                    interrupt_on_signals, until_reader_gone)

from . import MAX_CSV_BYTES

__all__ = ['main', 'build_parser', 'FAILED', 'INTERRUPTED']

FAILED = 1  # the predictions are not finite, or could not be written
INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def build_parser():
    parser = OneLineArgumentParser(
        prog='python -m export.predict',
        description='Predict with an exported model: ONNX through onnxruntime, or the '
                    'MXNet symbol/params pair bound model-parallel with group2ctx.')
    parser.add_argument('--model', required=True, metavar='PATH',
                        help='<name>.onnx, or <name>-symbol.json with <name>-NNNN.params beside it')
    parser.add_argument('--input', required=True, metavar='PATH',
                        help='features, one sample per row: .npy (samples, features) or '
                             '(samples,) + the model\'s sample shape, .csv, or - for CSV on '
                             'stdin (CSV: at most %d MiB); for a model of several inputs, a '
                             '.npz of one batch per input, named as the inputs (data0, '
                             'data1, ...)' % (MAX_CSV_BYTES >> 20))
    parser.add_argument('--output', default=None, metavar='PATH',
                        help='write predictions to this file, CSV if it ends in .csv (one or '
                             'two dimensions), a numpy array of any shape if .npy (default: CSV '
                             'on stdout)')
    parser.add_argument('--devices', default=None, metavar='LIST',
                        help="MXNet pair only: devices for the stages, e.g. 'cpu:0,cpu:1,cpu:2' "
                             "(one per stage) or 'cpu:0' (all stages on one device); default: "
                             "one device per stage")
    return parser


def _print_predictions(text):
    """Writes ``text`` to stdout and flushes it, so that a full disk or a
    closed pipe is an ``OSError`` here rather than a traceback at exit."""
    if sys.stdout is None:  # started with stdout closed (>&-)
        raise OSError(errno.EBADF, 'stdout is closed')
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError:
        # Python flushes stdout once more at exit; with stdout pointed at
        # /dev/null that flush cannot fail a second time.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        raise


def _check_output(path, sources=()):
    """Raises unless predictions may be written to ``path``: a file name of a
    known format, in a writable folder, and none of ``sources`` (the input
    or the model, which writing would replace)."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.files import check_writable_dir
    from .tables import output_format
    output_format(path)
    if os.path.isdir(path):
        raise ValueError('--output: expected a file path, found a folder at %s' % path)
    for flag, source in sources:
        if os.path.exists(path) and os.path.exists(source) and os.path.samefile(path, source):
            raise ValueError('--output: expected a file other than the %s, found %s, the same '
                             'file as %s %s' % (flag.lstrip('-'), path, flag, source))
    check_writable_dir(os.path.dirname(path) or '.', '--output')


def _predict(args):
    # Imported after parsing so that --help and flag errors do not wait for onnxruntime.
    # pylint: disable=import-outside-toplevel
    from .errors import PredictionError
    from .runtimes import SYMBOL_SUFFIX, OnnxPredictor, load_predictor
    from .errors import InputError
    from .tables import (STDIN, check_csv_rank, check_predictions, format_csv, output_format,
                         read_features, read_inputs, write_predictions)
    if args.model.endswith(SYMBOL_SUFFIX):
        # The pair's runtime, imported while a signal still ends the process at
        # once (exit_on_signals); an .onnx model needs no MXNet (export.runtimes).
        import mxnet  # pylint: disable=unused-import
    interrupt_on_signals()  # from here Ctrl-C and SIGTERM raise, reported by main()
    try:
        for flag in ('--model', '--input', '--output'):  # a path too long to open: an excerpt
            if getattr(args, flag[2:]) not in (None, STDIN):
                check_path(getattr(args, flag[2:]), flag)
        if args.output is not None:
            _check_output(args.output, [('--input', args.input), ('--model', args.model)])
        csv_out = args.output is None or output_format(args.output) == 'csv'
        where = 'CSV on stdout' if args.output is None else 'CSV in %s' % args.output
        by_name = args.input.lower().endswith('.npz')  # one batch per input, by name
        predictor = load_predictor(args.model, args.devices, table=False)
        names = list(predictor.input_names)
        source = '<stdin>' if args.input == STDIN else args.input
        if not by_name and len(names) > 1:
            raise InputError('expected a .npz of one batch per input (%s) for a model of %d '
                             'inputs, found %s' % (', '.join(names), len(names), source))
        if not by_name and isinstance(predictor, OnnxPredictor):
            predictor.check_table()
        if csv_out and getattr(predictor, 'output_ndim', None):  # before reading the input
            check_csv_rank(predictor.output_ndim, where)
        if by_name:
            arrays = read_inputs(args.input, names)
            Y = predictor.run(*arrays)[0]
            X, source = arrays[0], '%s member %s' % (args.input, names[0])
        else:
            X = read_features(args.input, predictor.input_width, predictor.sample_shape)
            Y = predictor.predict(X)
        if csv_out:
            check_csv_rank(Y.ndim, where)
        check_predictions(Y, X, source)
    except PredictionError as err:
        print_error(err)
        return FAILED
    except (ValueError, OSError) as err:
        print_error(err)
        return USAGE_ERROR
    if getattr(predictor, 'note', None) and sys.stderr is not None:
        print(predictor.note, file=sys.stderr)
    try:
        if args.output is None:
            _print_predictions(format_csv(Y))
        else:
            write_predictions(args.output, Y)
    except OSError as err:
        print_error('%s: could not write the predictions: %s'
                    % ('stdout' if args.output is None else args.output, err.strerror or err))
        return FAILED
    return 0


def main(argv=None):
    """Runs the command; returns the exit status (see the module docstring)."""
    try:
        return _predict(build_parser().parse_args(argv))
    except KeyboardInterrupt as err:
        print_error('interrupted' if exit_status(err) == INTERRUPTED else 'terminated (SIGTERM)')
        return exit_status(err)


if __name__ == '__main__':
    exit_on_signals()  # until the predictor's libraries are loaded, a signal is one line
    STATUS = until_reader_gone(main)
    ignore_signals()  # done and written: a signal while MXNet shuts down would end it silently
    sys.exit(STATUS)
