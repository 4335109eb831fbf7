"""From a training checkpoint to verified export files, committed as one unit.

:func:`export_checkpoint` reads either

* a training folder (``python -m mp_symbolic train --out DIR``): its committed
  checkpoint, every file verified against the commit record; or
* any MXNet checkpoint pair saved from a Pipeline module
  (``mod.save_checkpoint(PREFIX, N)``), as ``mx.model.load_checkpoint(PREFIX, N)``
  reads it;

and writes to the output folder, as one snapshot (:mod:`mp_symbolic.tools.store`,
``OUT/current/``):

* ``<name>-symbol.json`` + ``<name>-0000.params``: the inference graph (loss
  head replaced by its inference form), with the ``ctx_group`` of every op and
  variable, and its parameters;
* ``<name>.onnx``: the same graph for ONNX runtimes;
* ``<name>-verification.json``: the :mod:`~export.verify` report.

The files are verified in the staging folder; only when every check passes is
the snapshot committed, so a failed or interrupted export leaves the previous
one in place, whole. Export never trains.
"""
from collections import OrderedDict
import contextlib
import json
import os

import numpy as np

from mp_symbolic.core import kernels
from mp_symbolic.core.base.checks import excerpt as cut
from mp_symbolic.core.engine.module import with_input_shape
from mp_symbolic.core.graph.names import DATA_NAME, DTYPE_ATTR
from mp_symbolic.tools.checkpoint import load_checkpoint, read_checkpoint, save_params, save_symbol
from mp_symbolic.tools.store import Store, check_store_folder
from mp_symbolic.tools.files import sha256_file, shown_path

from . import DEFAULT_CHECKPOINT_DIR, DEFAULT_OUT_DIR
from .errors import ExportError, VerificationError
from .inference import (activation_bytes, batch_axes, batch_first, inference_graph,
                        input_dtypes, input_layouts, input_names, output_shapes,
                        sample_shapes, stage_layout, with_dynamic_axes, with_input_dtypes)

from .onnx_export import (PROTOBUF_LIMIT, check_onnx_version, dynamic_inputs,
                          external_data_name, save_onnx, to_onnx)
from .runtimes import check_symbol_file
from .suppression import (METADATA_KEY as SUPPRESSION_KEY, check_suppression, split_suppression,
                          suppression_note)
from .verify import (OneDeviceReference, check_batches, failed_checks, format_report,
                     verify_export)

__all__ = ['DEFAULT_CHECKPOINT_DIR', 'DEFAULT_OUT_DIR', 'locate_checkpoint',
           'export_checkpoint', 'export_names', 'read_sample', 'check_sample', 'cast_exactly',
           'unfinished_note', 'sequence_axes', 'SEQUENCE_DIM']


def locate_checkpoint(checkpoint, epoch=None):
    """The checkpoint files to export.

    Args:
        checkpoint: A training folder, or a prefix ``P`` of ``P-symbol.json``
            and ``P-%04d.params`` (then ``epoch`` is required).
        epoch: The epoch of a prefix checkpoint.

    Returns:
        ``(info, symbol path, params path)`` (the paths of the parts of a
        checkpoint committed by node processes, joined by commas, for the
        params path): ``info`` holds ``name``,
        ``devices`` (as trained), ``folder``, ``summary`` (the training
        folder's ``summary.json``, or ``None``) and ``checkpoint`` (the
        training folder's :class:`~mp_symbolic.tools.checkpoint.Checkpoint`,
        holding its snapshot against removal until closed, or ``None``).

    Raises:
        ExportError, CheckpointError: nothing there, or not what was expected.
    """
    if epoch is None:
        if not os.path.isdir(checkpoint):
            if os.path.isfile('%s-symbol.json' % checkpoint):
                raise ExportError('--epoch: expected the epoch of the checkpoint %s-NNNN.params '
                                  'to export, found none given' % checkpoint)
            raise ExportError('expected a training folder or a checkpoint prefix at %s, found '
                              'neither; train one first (make train-symbolic, or python -m '
                              'mp_symbolic train --out %s)' % (checkpoint, checkpoint))
        run = read_checkpoint(checkpoint)
        devices = run.summary.get('devices')
        if not (isinstance(devices, list) and all(isinstance(d, str) for d in devices)):
            run.close()
            raise ExportError('%s: expected the training devices as a list of strings, found %r'
                              % (os.path.join(run.folder, 'summary.json'),
                                 type(devices).__name__))
        name = run.meta.get('task')
        return ({'name': name if isinstance(name, str) else 'model', 'devices': devices,
                 'folder': os.path.realpath(checkpoint), 'summary': run.summary,
                 'checkpoint': run},
                run.symbol_path, run.params_path or ','.join(run.part_paths))
    if not isinstance(epoch, int) or epoch < 0 or epoch > 9999:
        raise ExportError('--epoch: expected an integer in [0, 9999], found %r' % (epoch,))
    sym_path, params_path = '%s-symbol.json' % checkpoint, '%s-%04d.params' % (checkpoint, epoch)
    return ({'name': os.path.basename(checkpoint) or 'model', 'devices': None,
             'folder': os.path.realpath(os.path.dirname(checkpoint) or '.'), 'summary': None,
             'checkpoint': None},
            sym_path, params_path)


def _params_sha256(run, params_path):
    """The sha256 of the params file, or of each part of a checkpoint
    committed by node processes (as its commit recorded them), joined by
    commas."""
    if run is None or not run.part_paths:
        return sha256_file(params_path)
    return ','.join(run.snapshot.files[os.path.basename(p)]['sha256'] for p in run.part_paths)


def read_sample(path):
    """``--sample FILE.npz`` -> ``{input name: array}``, in the file's order
    (read by :func:`export.tables.read_npz`, within its bounds).

    Raises:
        ExportError: not a readable ``.npz`` of numeric arrays within those
            bounds.
    """
    # pylint: disable=import-outside-toplevel
    from .errors import InputError
    from .tables import read_npz
    if not str(path).endswith('.npz'):
        raise ExportError('--sample: expected a .npz file (numpy.savez: one array per input '
                          'name, batch first), found %s' % shown_path(path))
    try:
        return read_npz(path)
    except InputError as err:
        raise ExportError('--sample: %s' % err) from None


def check_sample(sample, symbol, arg_params=None, log=None):
    """``sample`` as ``{input name: array}`` in the graph's input order, each
    array of a dtype the graph takes.

    An array of a dtype the graph does not take (float64 or int64 where its
    weights make it float32) is cast to the input's dtype (recorded on the
    input, else float32) where no value changes beyond rounding to it: a
    float to a float it stays finite in, whole numbers to an integer type
    they fit in or to a float that holds them exactly; ``log`` is told.

    Each array is laid out as the layout the graph records on its input
    says (``'TN'``: the batch on axis 1; :func:`export.inference.batch_axes`),
    batch first without one; it is returned batch first.

    Raises:
        ExportError: its names are not the graph's inputs, an array has no
            batch axis or no rows, the batches differ in length, or an array
            would change in the cast (a fraction for an integer input, a value
            out of the input's range).
    """
    inputs = input_names(symbol)
    if sorted(sample) != sorted(inputs):
        raise ExportError('--sample: expected one array per input (%s), found %s'
                          % (', '.join(inputs), cut(', '.join(sorted(sample))) or 'none'))
    axes, layouts = batch_axes(symbol), input_layouts(symbol)
    for name in inputs:
        if axes[name] and np.ndim(sample[name]) <= axes[name]:
            raise ExportError('--sample: expected %s laid out %s (the batch on axis %d), found '
                              'shape %s' % (name, layouts[name], axes[name],
                                            np.shape(sample[name])))
    arrays = OrderedDict((name, batch_first(np.asarray(sample[name]), axes[name]))
                         for name in inputs)
    for name, X in arrays.items():
        if X.ndim < 1 or not len(X) or X.dtype.kind not in 'fiu' or \
                not np.all(np.isfinite(X)):
            raise ExportError('--sample: expected %s as a batch of finite numbers (batch first), '
                              'found %s of shape %s' % (name, X.dtype, X.shape))
    if len({len(X) for X in arrays.values()}) > 1:
        raise ExportError('--sample: expected the same batch size for every input, found %s'
                          % ', '.join('%s %d%s' % (k, len(v), ' (N of %s)' % layouts[k]
                                                   if k in layouts else '')
                                      for k, v in arrays.items()))
    wanted = _taken_dtypes(symbol, arg_params or {}, {k: v.dtype for k, v in arrays.items()})
    for name, dtype in wanted.items():
        was = arrays[name].dtype
        arrays[name] = cast_exactly(arrays[name], dtype, '--sample: %s' % name)
        if log is not None:
            log('--sample: %s cast from %s to %s, the dtype of the checkpoint\'s input'
                % (name, was, dtype))
    return arrays


# Input dtypes the export's two runtimes both take (MXNet's and onnxruntime's).
_SAMPLE_DTYPES = tuple(np.dtype(d) for d in (np.float32, np.float64, np.int32, np.int64))


def _taken_dtypes(symbol, arg_params, given):
    """``{input name: dtype}`` of the inputs whose ``given`` dtype is not the
    one the graph takes: an input whose dtype the graph records
    (``__dtype__``, as ``mx.sym.var(name, dtype=...)`` and an export with an
    integer sample record it) takes that one; any other takes its given
    dtype if it is one both runtimes take (:data:`_SAMPLE_DTYPES`) and
    MXNet's type inference accepts it with the weights (token ids of int64
    into an ``Embedding``), else float32.

    Raises:
        ExportError: the graph takes none of these.
    """
    from mxnet.base import MXNetError  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.base.compat import error_line  # pylint: disable=import-outside-toplevel
    known = {k: v.dtype for k, v in arg_params.items() if k in symbol.list_arguments()}
    attrs = symbol.attr_dict()
    own = input_dtypes(symbol)  # recorded, else float32
    recorded = {name for name in given if DTYPE_ATTR in attrs.get(name, {})}

    def fails(dtypes):
        try:
            symbol.infer_type_partial(**dict(known, **dtypes))
            return None
        except (MXNetError, KeyError, TypeError) as err:
            return err

    chosen = {name: own[name] if name in recorded or np.dtype(dtype) not in _SAMPLE_DTYPES
              else np.dtype(dtype) for name, dtype in given.items()}
    if fails(chosen) is not None:  # a given dtype the weights refuse (float64 into float32)
        chosen = {name: own[name] for name in given}
    err = fails(chosen)
    if err is not None:
        raise ExportError('--sample: expected arrays of dtypes the graph takes, found %s: %s'
                          % (', '.join('%s %s' % kv for kv in given.items()), error_line(err)))
    return {name: dtype for name, dtype in chosen.items() if dtype != given[name]}


def cast_exactly(X, dtype, what):
    """``X`` as ``dtype``, refused where a value would change beyond rounding
    to a float: a float to a float it stays finite in; whole numbers to an
    integer dtype whose range holds them, or to a float whose mantissa holds
    them (to 2**24 for float32).

    Raises:
        ExportError: ``what``: a value that does not survive the cast (the
            first one, and where it is).
    """
    X, dtype = np.asarray(X), np.dtype(dtype)

    def refuse(expected, bad):
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ExportError('%s: expected %s for %s %s input, found %s at index %s (of %s)'
                          % (what, expected, 'an' if dtype.kind == 'i' else 'a', dtype,
                             X[index].item(), index, X.dtype))

    if dtype.kind == 'f':
        if X.dtype.kind == 'f':
            with np.errstate(over='ignore'):
                Y = X.astype(dtype)
            if not np.all(np.isfinite(Y)):
                refuse('values within its range (|x| <= %.4g)' % np.finfo(dtype).max,
                       ~np.isfinite(Y))
            return Y
        exact = 2 ** (np.finfo(dtype).nmant + 1)  # every integer up to it is a float of dtype
        wide = X.astype(np.float64)
        if np.any(np.abs(wide) > exact):
            refuse('whole numbers of at most %d in magnitude (held exactly)' % exact,
                   np.abs(wide) > exact)
        return X.astype(dtype)
    info = np.iinfo(dtype)
    if X.dtype.kind == 'f':
        if np.any(X != np.round(X)):
            refuse('whole numbers', X != np.round(X))
        # float(info.max) + 1 is a power of two, exact as a float: 2**31, 2**63, 2**64
        out = (X < info.min) | (X >= float(info.max) + 1)
    elif np.can_cast(X.dtype, dtype):
        out = None
    else:  # compared as Python integers: int64 against uint64 bounds stays exact
        low, high = int(X.min()), int(X.max())
        out = (X == X.min()) if low < info.min else (X == X.max()) if high > info.max else None
    if out is not None and np.any(out):
        refuse('values in [%d, %d]' % (info.min, info.max), out)
    return X.astype(dtype)


def _inputs(inference, arg_params, input_shape, sample, log=None):
    """``(shapes, dtypes, sample)`` of the graph's inputs: from the sample,
    or from ``input_shape`` and what the graph records (dtypes ``None``)."""
    if sample is None:
        return sample_shapes(inference, arg_params, input_shape), None, None
    if input_shape is not None:
        raise ExportError('--input-shape: expected it or --sample, found both')
    sample = check_sample(sample, inference, arg_params, log)
    shapes = sample_shapes(inference, arg_params,
                           OrderedDict((k, v.shape[1:]) for k, v in sample.items()))
    return shapes, {k: v.dtype for k, v in sample.items()}, sample


SEQUENCE_DIM = 'seq'  # the name of a recurrent network's sequence axis in the ONNX model


def sequence_axes(symbol, arg_params, aux_params, shapes):
    """``{input name: {axis: 'seq'}}`` (axes counted batch first, as
    ``dynamic_axes`` counts them) of the ``T`` of each layout the graph
    records on an input (``'TN'``: the tokens' sequence), where the graph
    takes another size of it with the other inputs as they are (not a
    state's ``'TNC'`` whose first axis is its layers): of the first such
    input's size, since axes of one name vary together."""
    found, size = OrderedDict(), None
    for name, layout in input_layouts(symbol).items():
        per_sample = layout.replace('N', '')
        index = per_sample.find('T')
        if index < 0 or index >= len(shapes[name]) or \
                size is not None and shapes[name][index] != size:
            continue
        other = OrderedDict(shapes)
        other[name] = tuple(shapes[name][:index]) + (shapes[name][index] + 1,) + \
            tuple(shapes[name][index + 1:])
        try:
            output_shapes(symbol, arg_params, aux_params, other)
        except ExportError:
            continue
        found[name], size = {index + 1: SEQUENCE_DIM}, shapes[name][index]
    return found


def _laid_out(sym_path):
    """The inputs of the symbol file whose batch is not first (their recorded
    layouts); none where the file does not load (the loading says why)."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    try:
        return input_layouts(kernels.load_symbol(sym_path))
    except (mx.base.MXNetError, ValueError, UnicodeDecodeError, OSError, kernels.KernelError):
        return {}


def unfinished_note(checkpoint):
    """A line saying that a training folder's checkpoint is of a run that did
    not finish, or ``None``.

    The store records it (``MANIFEST.json`` and ``summary.json``):
    ``complete`` is false for a checkpoint committed between epochs (``epoch``
    of ``config.num_epochs``) and for the last epoch of a run that did not
    improve on its initial parameters (``improved: false``, with
    ``score_name``, ``score_before``, ``score_after``). Checkpoints that
    record no ``complete`` (``save_checkpoint`` writes ``true``) have none.
    """
    if checkpoint is None or checkpoint.meta.get('complete', True) is not False:
        return None
    summary = checkpoint.summary
    config = summary.get('config') if isinstance(summary.get('config'), dict) else {}
    total = config.get('num_epochs')
    of = (' of %d' % total) if type(total) is int else ''
    if summary.get('improved') is False:
        scores = [summary.get(k) for k in ('score_name', 'score_before', 'score_after')]
        detail = ('epoch %d%s, marked not improved' % (checkpoint.epoch, of)) + (
            ': %s %.4g before, %.4g after' % tuple(scores)
            if isinstance(scores[0], str) and all(type(v) in (int, float) for v in scores[1:])
            else '')
    else:
        detail = 'epoch %d%s' % (checkpoint.epoch, of)
    return ('note: the checkpoint is of an unfinished run (%s); exporting it as it is'
            % detail)


@contextlib.contextmanager
def _naming(path, what):
    """Re-raises an ``OSError`` of the block naming ``path``: onnx and Python's
    file objects report a file-size limit as ``[Errno 27] File too large``
    and a full disk as ``[Errno 28]``, without the file."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        named = OSError('%s: cannot write %s (%s; a full disk or a file size limit?)'
                        % (path, what, err.strerror or err))
        named.errno = err.errno
        raise named from None


def export_names(name):
    """``{'symbol', 'params', 'onnx', 'report'}`` -> file name."""
    return OrderedDict([('symbol', name + '-symbol.json'), ('params', name + '-0000.params'),
                        ('onnx', name + '.onnx'), ('report', name + '-verification.json')])


def export_checkpoint(checkpoint=DEFAULT_CHECKPOINT_DIR, out_dir=DEFAULT_OUT_DIR, name=None,
                      log=print, epoch=None, input_shape=None, dynamic_axes=None,
                      sample=None, verify_batches=None, tolerance=None,
                      external_data_threshold=PROTOBUF_LIMIT):
    """Exports, verifies and commits the checkpoint.

    Args:
        checkpoint, epoch: See :func:`locate_checkpoint`.
        out_dir: Folder for the export (a store: ``out_dir/current/``).
        name: File name prefix (default: the task's name, or the prefix's).
        log: Called with each line of output (the report included; a
            note for a training folder whose run did not finish,
            :func:`unfinished_note`).
        input_shape: Shape of one input sample, or ``{input name: shape}``,
            where the checkpoint does not record it.
        dynamic_axes: ``{input axis: name}`` besides the batch whose size
            may vary in the ONNX file (``{1: 'seq'}`` for a language model's
            sequence length), of the first input, or ``{input name: {axis:
            name}}`` (``{'data0': {1: 'seq'}, 'data1': {1: 'seq'}}`` for
            BERT; axes of one name vary together, see
            :func:`export.onnx_export.dynamic_inputs`); parity is then
            checked at several sizes. Without them, the ``T`` axes of the
            layouts the graph records (:func:`sequence_axes`).
        sample: ``{input name: array}``, batch first (``--sample``): the
            shapes and dtypes of the inputs, and the data verification runs
            on (see :func:`read_sample`).
        verify_batches: The batch sizes to verify at, each within the
            memory budget (:func:`export.verify.check_batches`); ``None``:
            the rule of :func:`export.verify.verification_batches`.
        tolerance: See :data:`export.verify.TOLERANCE` (its value, if ``None``).
        external_data_threshold: The ONNX model is written with its weights'
            values in ``<name>.onnx.data`` beside ``<name>.onnx`` (ONNX's
            external-data format) when as one file it would take more than
            this many bytes; by default protobuf's limit, 2 GiB - 1
            (:func:`export.onnx_export.save_onnx`).

    Returns:
        ``(paths, report)``: the committed files (see :func:`export_names`;
        and ``'onnx_data'``, the data file, where the weights went there)
        and the verification report.

    Raises:
        CheckpointError: a checkpoint file is missing or corrupt, or its
            params do not fit its symbol.
        ExportError: the graph cannot be exported (no ``ctx_group``, an op
            ONNX cannot express, ``onnx>=1.18``), ``out_dir`` is the
            checkpoint's own folder, a sample a cast would change
            (:func:`check_sample`), or a verification batch past the
            memory budget.
        WrongFolder: ``out_dir`` is empty, a training folder, a folder of
            other files (neither empty nor a store), or inside a training
            folder, an export folder or a snapshot.
        FolderInUse: another process writes to ``out_dir``.
        VerificationError: a check failed; nothing was committed.
    """
    check_onnx_version()
    if not out_dir.strip():
        raise ExportError('--out: expected a folder path, found an empty string')
    # info['checkpoint'] holds a training folder's snapshot against removal while this
    # call runs (its writer may be committing): released with `info`, or below.
    info, sym_path, params_path = locate_checkpoint(checkpoint, epoch)
    if os.path.realpath(out_dir) in (info['folder'], os.path.realpath(checkpoint)):
        raise ExportError('--out: expected a folder other than the checkpoint\'s own (%s), '
                          'found the same' % out_dir)
    # Never onto or inside a training folder or a snapshot: the store would replace it.
    check_store_folder(out_dir, 'export', '--out')
    name = name or info['name']
    if os.path.isfile(sym_path):
        check_symbol_file(sym_path)  # says what a file that is no symbol is, quoting nothing
    if sample is not None:
        hints = {k: np.shape(v)[1:] for k, v in sample.items()}
    else:
        hints = (input_shape if isinstance(input_shape, dict) or input_shape is None
                 else {DATA_NAME: tuple(input_shape)})
    if hints:  # an input laid out with its batch elsewhere gives no hint (read batch first)
        laid_out = _laid_out(sym_path)
        hints = {k: v for k, v in hints.items() if k not in laid_out}
    if info['checkpoint'] is not None:  # a pair or one part per node, one array at a time
        symbol, arg_params, aux_params = info['checkpoint'].load(input_shapes=hints)
    else:
        symbol, arg_params, aux_params = load_checkpoint(sym_path, params_path, hints)
    params_sha256 = _params_sha256(info['checkpoint'], params_path)
    inference, suppression = split_suppression(inference_graph(symbol))
    if suppression is not None:  # the export, and what it is checked against, end before it
        symbol = inference
    stages = stage_layout(inference)
    shapes, dtypes, sample = _inputs(inference, arg_params, input_shape, sample, log)
    for input_name, one in shapes.items():  # recorded, so that load_model knows them too
        inference = with_input_shape(inference, input_name, one, input_layouts(inference))
    if dtypes:
        inference = with_input_dtypes(inference, dtypes)
    if not dynamic_axes:  # a recurrent network's sequence, where its layouts say where
        dynamic_axes = sequence_axes(inference, arg_params, aux_params, shapes)
        for input_name, axes in dynamic_axes.items():
            log('dynamic: %s axis %d (T of its layout %s) as %s'
                % (input_name, next(iter(axes)), input_layouts(inference)[input_name],
                   SEQUENCE_DIM))
    dynamic_axes = dynamic_inputs(dynamic_axes, shapes)  # {input: {axis: name}}, checked
    if dynamic_axes:  # recorded too, so that load_model takes other sizes of them
        inference = with_dynamic_axes(inference, dynamic_axes)
    shape = next(iter(shapes.values())) if len(shapes) == 1 else shapes
    trained_on = ', '.join(info['devices']) if info['devices'] else 'devices not recorded'
    described = (str(shape) if len(shapes) == 1 else
                 ', '.join('%s %s' % (k, v) for k, v in shapes.items()))
    log('exporting %s (%s): input%s %s, %s' % (params_path, trained_on,
                                                's' if len(shapes) > 1 else '', described,
                                                '; '.join('%s: %d ops' % (g, len(s['ops']))
                                                          for g, s in stages.items())))
    note = unfinished_note(info['checkpoint'])
    if note:
        log(note)
    extra = {'trained_devices': ','.join(info['devices'] or [])}
    if suppression is not None:
        extra[SUPPRESSION_KEY] = json.dumps(suppression, sort_keys=True)
        log(suppression_note(suppression, export_names(name)['onnx']))
    if info['summary'] is not None:  # what the run reported (a task's vocabulary, ...)
        extra['training_summary'] = json.dumps(info['summary'], sort_keys=True)
    # the weights' values are read from the checkpoint's arrays as the file is written
    model, weights = to_onnx(inference, arg_params, aux_params,
                             {'symbol': sym_path, 'params': info['checkpoint'].files
                              if info['checkpoint'] is not None else params_path}, shapes,
                             extra_metadata=extra, dynamic_axes=dynamic_axes, dtypes=dtypes,
                             fill=False)
    reference = OneDeviceReference(symbol, arg_params, aux_params, shapes, dtypes)
    per_sample = activation_bytes(inference, arg_params, aux_params, shapes, dtypes)
    if verify_batches and per_sample > 0:  # before anything is written
        check_batches(verify_batches, per_sample)
    names = export_names(name)
    report = {}

    def write(folder):
        # Each copy of the weights is let go once written, before verification loads its
        # own: the ONNX model, then the checkpoint's arrays (the reference holds them until
        # its outputs are computed).
        nonlocal model, weights, arg_params, aux_params
        paths = {key: os.path.join(folder, file) for key, file in names.items()}
        save_symbol(paths['symbol'], inference)  # read back: MXNet ignores write errors
        with _naming(paths['onnx'], 'the ONNX model'):
            data_path = save_onnx(model, paths['onnx'], external_data_threshold, weights)
        model = weights = None
        if data_path is not None:
            names['onnx_data'] = os.path.basename(data_path)
            log('%s: the weights\' values in %s beside it (ONNX external data: the model '
                'would take more than %d bytes as one file)'
                % (names['onnx'], names['onnx_data'], external_data_threshold))
        save_params(paths['params'], arg_params, aux_params)
        arg_params = aux_params = None
        report.update(verify_export(paths['onnx'], paths['symbol'], paths['params'], reference,
                                    batch_sizes=verify_batches, tolerance=tolerance,
                                    sample=sample, bytes_per_sample=per_sample))
        report['source'] = OrderedDict([('symbol', sym_path), ('params', params_path),
                                        ('params_sha256', params_sha256),
                                        ('trained_devices', info['devices']),
                                        ('input_shape', list(shape) if len(shapes) == 1
                                         else {k: list(v) for k, v in shapes.items()})])
        report['files'] = dict(names)
        if suppression is not None:
            report['suppression'] = suppression
            report['checks'].append(check_suppression(paths['onnx'], suppression, shapes, dtypes))
            report['ok'] = report['ok'] and report['checks'][-1]['ok']
        for line in format_report(report):
            log(line)
        if not report['ok']:
            raise VerificationError('verification failed, nothing written: %s'
                                    % '; '.join(failed_checks(report)))
        with _naming(paths['report'], 'the verification report'), open(paths['report'], 'w') as f:
            json.dump(report, f, indent=2)
            f.write('\n')

    store = Store(out_dir, kind='export')
    with store.locked():
        meta = {'kind': 'export', 'name': name, 'files': names,
                'source_params_sha256': params_sha256}
        snapshot = store.commit(write, meta)  # meta['files'] names the data file, if written
    if snapshot.held_note():
        log(snapshot.held_note())
    if info['checkpoint'] is not None:
        info['checkpoint'].close()
    paths = OrderedDict((key, snapshot.path(file)) for key, file in names.items())
    log('wrote %s' % ', '.join(os.path.join(out_dir, 'current', f) for f in names.values()))
    return paths, report
