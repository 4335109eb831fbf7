"""Checks an exported model before it is committed, and the report they make.

The report (a JSON-ready dict) holds

* ``checks``: ONNX checker (``full_check=True``), strict shape inference,
  the declared opset, weights kept out of the graph inputs, metadata present,
  onnxruntime loading without a word on stderr, and MXNet placing every
  argument of the re-bound pair on its stage's device;
* ``parity``: the largest absolute difference between each runtime's output
  and the trained model (the training checkpoint's parameters through
  :func:`mp_symbolic.metrics.forward_numpy`, float64) at batch sizes
  :data:`BATCH_SIZES`; each must be at most :data:`TOLERANCE`;
* ``learned_map``: the trained map and its distance from the true one.
"""
from collections import OrderedDict
from contextlib import contextmanager
import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort

from mp_symbolic.data import TRUE_B, TRUE_W
from mp_symbolic.metrics import end_to_end_map, forward_numpy, map_error
from mp_symbolic.placement import format_device

from .onnx_export import BATCH_DIM, ONNX_IR_VERSION, ONNX_OPSET
from .runtimes import MXNetPredictor, OnnxPredictor

__all__ = ['BATCH_SIZES', 'TOLERANCE', 'REQUIRED_METADATA', 'captured_stderr',
           'verify_export', 'format_report', 'failed_checks']

BATCH_SIZES = (1, 7, 1000)
TOLERANCE = 1e-5
REQUIRED_METADATA = ('producer', 'producer_version', 'mxnet_version', 'input_names',
                     'input_shapes', 'output_names', 'output_shapes', 'stages',
                     'source_params_sha256')
_SEED = 20240601


@contextmanager
def captured_stderr():
    """Collects what is written to file descriptor 2 inside the block.

    onnxruntime logs from C++ straight to the process's stderr, past
    ``sys.stderr``; this catches it. Yields a list that holds the non-empty
    lines once the block has ended.
    """
    lines = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(line for line in sink.read().decode('utf-8', 'replace').splitlines()
                         if line.strip())


def _check(name, ok, detail):
    return OrderedDict([('name', name), ('ok', bool(ok)), ('detail', detail)])


def _onnx_checks(model, onnx_path, out_width):
    checks = []
    try:
        onnx.checker.check_model(onnx_path, full_check=True)
        checks.append(_check('onnx checker (full_check)', True, 'valid'))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        checks.append(_check('onnx checker (full_check)', False, str(err).splitlines()[0]))
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        output = inferred.graph.output[0]
        dims = [d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim]
        checks.append(_check('shape inference (strict)', dims == [BATCH_DIM, out_width],
                             '%s: %s' % (output.name, dims)))
    except onnx.shape_inference.InferenceError as err:
        checks.append(_check('shape inference (strict)', False, str(err).splitlines()[0]))
    opsets = [(o.domain, o.version) for o in model.opset_import]
    checks.append(_check('opset declared', opsets == [('', ONNX_OPSET)]
                         and model.ir_version == ONNX_IR_VERSION,
                         'opset %s, IR version %d' % (opsets, model.ir_version)))
    weights = {init.name for init in model.graph.initializer}
    inputs = [value.name for value in model.graph.input]
    checks.append(_check('weights not graph inputs', not weights & set(inputs),
                         'inputs %s; %d initializers' % (inputs, len(weights))))
    props = {p.key for p in model.metadata_props}
    missing = [key for key in REQUIRED_METADATA if key not in props]
    checks.append(_check('metadata_props', not missing,
                         'missing %s' % ', '.join(missing) if missing
                         else '%d entries' % len(props)))
    return checks


def _placement_check(predictor):
    placement = predictor.placement()
    wrong = []
    for name, ctx in placement.items():
        group = predictor.symbol.get_internals()[name].attr('ctx_group')
        if ctx != predictor.group2ctx[group]:
            wrong.append('%s on %s, %s is on %s' % (name, ctx, group, predictor.group2ctx[group]))
    return _check('%s: arrays on their stage devices' % _describe(predictor), not wrong,
                  '; '.join(wrong) or '%d arguments placed by ctx_group' % len(placement))


def _describe(predictor):
    if isinstance(predictor, OnnxPredictor):
        return 'onnxruntime %s' % ort.__version__
    return 'mxnet ' + ', '.join('%s->%s' % (g, format_device(c))
                                for g, c in predictor.group2ctx.items())


def verify_export(onnx_path, sym_path, params_path, reference_params):
    """Runs every check on freshly written export files.

    Args:
        onnx_path: The ``.onnx`` file.
        sym_path, params_path: The MXNet pair.
        reference_params: The trained parameters (name -> numpy array) the
            outputs must match.

    Returns:
        The report; ``report['ok']`` is whether every check passed.

    Raises:
        ModelFileError, CheckpointError, ExportError: a file cannot be
            loaded at all.
    """
    model = onnx.load(onnx_path)
    with captured_stderr() as ort_log:
        onnx_runtime = OnnxPredictor(onnx_path)
    checks = _onnx_checks(model, onnx_path, onnx_runtime.output_width)
    checks.append(_check('onnxruntime loads without warnings', not ort_log,
                         ort_log[0] if ort_log else 'nothing logged at default severity'))
    runtimes = [onnx_runtime]
    # one device per stage (the model-parallel split), then every stage on cpu(0)
    for spec in (None, 'cpu:0'):
        mxnet_runtime = MXNetPredictor.from_files(sym_path, params_path, devices=spec)
        checks.append(_placement_check(mxnet_runtime))
        runtimes.append(mxnet_runtime)

    rng = np.random.default_rng(_SEED)
    parity = []
    for batch_size in BATCH_SIZES:
        X = rng.normal(0.0, 1.0, (batch_size, onnx_runtime.input_width)).astype(np.float32)
        expected = forward_numpy(reference_params, X)
        for runtime in runtimes:
            diff = float(np.max(np.abs(runtime.predict(X) - expected)))
            parity.append(OrderedDict([('runtime', _describe(runtime)),
                                       ('batch_size', batch_size),
                                       ('max_abs_diff', diff), ('ok', diff <= TOLERANCE)]))
    W, b = end_to_end_map(reference_params)
    learned = OrderedDict([('learned_w', W.ravel().tolist()), ('learned_b', b.tolist()),
                           ('true_w', np.round(TRUE_W.astype(float), 6).tolist()),
                           ('true_b', [TRUE_B]),
                           ('max_abs_error', map_error(reference_params))])
    ok = all(c['ok'] for c in checks) and all(p['ok'] for p in parity)
    return OrderedDict([('ok', ok), ('tolerance', TOLERANCE), ('checks', checks),
                        ('parity', parity), ('learned_map', learned)])


def format_report(report):
    """The report as lines of text."""
    lines = ['verification: %s' % ('PASSED' if report['ok'] else 'FAILED')]
    for check in report['checks']:
        lines.append('  [%s] %s: %s' % ('ok' if check['ok'] else 'FAIL', check['name'],
                                        check['detail']))
    lines.append('  parity with the trained model (max |difference|, tolerance %g):'
                 % report['tolerance'])
    for row in report['parity']:
        lines.append('    [%s] %-52s batch %4d: %.2e' % ('ok' if row['ok'] else 'FAIL',
                                                         row['runtime'], row['batch_size'],
                                                         row['max_abs_diff']))
    learned = report['learned_map']
    lines.append('  learned map: w = %s, b = %s (true: w = %s, b = %s); max |error| %.2e'
                 % (np.array2string(np.array(learned['learned_w']), precision=5),
                    np.array2string(np.array(learned['learned_b']), precision=5),
                    learned['true_w'], learned['true_b'], learned['max_abs_error']))
    return lines


def failed_checks(report):
    """Names of the checks and parity rows that failed."""
    names = [c['name'] for c in report['checks'] if not c['ok']]
    names += ['parity %s batch %d (%.2e)' % (p['runtime'], p['batch_size'], p['max_abs_diff'])
              for p in report['parity'] if not p['ok']]
    return names
