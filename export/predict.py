"""Command line: predictions from an exported model.

    python -m export.predict --model artifacts/export/regression.onnx --input x.csv
    python -m export.predict --model artifacts/export/regression-symbol.json \\
        --input x.npy --output y.npy --devices cpu:0,cpu:1,cpu:2

``--model`` is the ``.onnx`` file (run by onnxruntime) or the ``-symbol.json``
of the MXNet pair (params file found beside it), bound with ``group2ctx`` on
``--devices``: one device per stage keeps the model-parallel split, a single
device takes every stage. ``--input`` is ``.npy`` or CSV (``-``: CSV on
stdin). Predictions go to stdout as CSV, or to ``--output`` (``.csv`` or
``.npy``).

A bad model, input or output path prints one line to stderr and exits with
status 2 (status 1 if the output cannot be written); nothing is written.
"""
import argparse
import os
import sys

from .errors import one_line

__all__ = ['main', 'build_parser']


def build_parser():
    parser = argparse.ArgumentParser(
        prog='python -m export.predict',
        description='Predict with an exported model: ONNX through onnxruntime, or the '
                    'MXNet symbol/params pair bound model-parallel with group2ctx.')
    parser.add_argument('--model', required=True, metavar='PATH',
                        help='<name>.onnx, or <name>-symbol.json with <name>-NNNN.params beside it')
    parser.add_argument('--input', required=True, metavar='PATH',
                        help='features, one sample per row: .npy, .csv, or - for CSV on stdin')
    parser.add_argument('--output', default=None, metavar='PATH',
                        help='write predictions to this .csv or .npy file (default: CSV on stdout)')
    parser.add_argument('--devices', default=None, metavar='LIST',
                        help="MXNet pair only: devices for the stages, e.g. 'cpu:0,cpu:1,cpu:2' "
                             "(one per stage) or 'cpu:0' (all stages on one device); default: "
                             "one device per stage")
    return parser


def _error(err):
    print('error: %s' % one_line(err), file=sys.stderr)


def main(argv=None):
    """Runs the command; returns the exit status."""
    args = build_parser().parse_args(argv)
    # Imported after parsing so that --help and flag errors do not wait for MXNet.
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.checkpoint import check_writable_dir
    from .runtimes import load_predictor
    from .tables import format_csv, output_format, read_features, write_predictions
    try:
        if args.output is not None:
            output_format(args.output)
            if os.path.isdir(args.output):
                raise ValueError('--output: expected a file path, found a folder at %s'
                                 % args.output)
            check_writable_dir(os.path.dirname(args.output) or '.', '--output')
        predictor = load_predictor(args.model, args.devices)
        X = read_features(args.input, predictor.input_width)
        Y = predictor.predict(X)
    except (ValueError, OSError) as err:
        _error(err)
        return 2
    if getattr(predictor, 'note', None):
        print(predictor.note, file=sys.stderr)
    if args.output is None:
        sys.stdout.write(format_csv(Y))
        return 0
    try:
        write_predictions(args.output, Y)
    except OSError as err:
        _error(err)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
