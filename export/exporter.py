"""From a symbolic training checkpoint to verified export files.

:func:`export_checkpoint` reads the checkpoint named by a training run's
``summary.json`` (training one first if there is none), and writes to the
output folder

* ``<name>-symbol.json`` + ``<name>-0000.params``: the inference graph, with
  the ``ctx_group`` of every op and variable, and its parameters;
* ``<name>.onnx``: the same graph for ONNX runtimes;
* ``<name>-verification.json``: the :mod:`~export.verify` report.

Every file is first written to a temporary file beside its destination and
verified there; only when all checks pass are the files renamed into place,
so a failed export leaves nothing (old files stay as they were).
"""
from collections import OrderedDict
from contextlib import ExitStack
import dataclasses
import json
import os

import onnx

from mp_symbolic.checkpoint import atomic_path, load_checkpoint, save_params
from mp_symbolic.config import TrainConfig
from mp_symbolic.train import CHECKPOINT_NAME, train

from . import DEFAULT_CHECKPOINT_DIR, DEFAULT_OUT_DIR
from .errors import ExportError, VerificationError
from .inference import inference_graph, stage_layout
from .onnx_export import check_onnx_version, sha256_file, to_onnx
from .verify import failed_checks, format_report, verify_export

__all__ = ['DEFAULT_CHECKPOINT_DIR', 'DEFAULT_OUT_DIR', 'locate_checkpoint',
           'export_checkpoint', 'export_paths']

SUMMARY_NAME = 'summary.json'


def locate_checkpoint(checkpoint_dir, log=print, train_if_missing=False):
    """The training summary and checkpoint files in ``checkpoint_dir``.

    Args:
        train_if_missing: With no ``summary.json`` there, train the default
            configuration into ``checkpoint_dir`` first (saying so through
            ``log``) instead of raising.

    Returns:
        ``(summary dict, symbol path, params path)``.

    Raises:
        ExportError: no ``summary.json`` (and ``train_if_missing`` is off), or
            it is not JSON or names no files.
    """
    summary_path = os.path.join(checkpoint_dir, SUMMARY_NAME)
    if not os.path.exists(summary_path):
        if not train_if_missing:
            raise ExportError('expected a symbolic training run in %s (its %s), found none'
                              % (checkpoint_dir, SUMMARY_NAME))
        log('no trained checkpoint in %s (no %s): training one with the default '
            'settings first' % (checkpoint_dir, SUMMARY_NAME))
        train(dataclasses.replace(TrainConfig(), out=checkpoint_dir), log=log)
    try:
        with open(summary_path) as f:
            summary = json.load(f)
    except (OSError, ValueError) as err:
        raise ExportError('%s is not a readable training summary: %s'
                          % (summary_path, err)) from None
    files = summary.get('files') if isinstance(summary, dict) else None
    if not (isinstance(files, dict) and isinstance(files.get('symbol'), str)
            and isinstance(files.get('params'), str)):
        raise ExportError("%s: expected 'files' with 'symbol' and 'params' names, found %r"
                          % (summary_path, files))
    return (summary, os.path.join(checkpoint_dir, files['symbol']),
            os.path.join(checkpoint_dir, files['params']))


def export_paths(out_dir, name=CHECKPOINT_NAME):
    """``{'symbol', 'params', 'onnx', 'report'}`` -> path, for ``out_dir``/``name``."""
    prefix = os.path.join(out_dir, name)
    return OrderedDict([('symbol', prefix + '-symbol.json'), ('params', prefix + '-0000.params'),
                        ('onnx', prefix + '.onnx'), ('report', prefix + '-verification.json')])


def export_checkpoint(checkpoint_dir=DEFAULT_CHECKPOINT_DIR, out_dir=DEFAULT_OUT_DIR,
                      name=CHECKPOINT_NAME, log=print, train_if_missing=False):
    """Exports, verifies and writes the checkpoint in ``checkpoint_dir``.

    Args:
        checkpoint_dir: Folder of a symbolic training run (its summary.json).
        out_dir: Folder for the export files.
        name: File name prefix of the export files.
        log: Called with each line of output (the report included).
        train_if_missing: See :func:`locate_checkpoint`.

    Returns:
        ``(paths, report)``: the files written (see :func:`export_paths`) and
        the verification report.

    Raises:
        CheckpointError: a checkpoint file is missing or corrupt, or its
            params do not fit its symbol.
        ExportError: the summary is unreadable, the graph cannot be exported
            (no ``ctx_group``, an op ONNX cannot express, ``onnx>=1.18``).
        VerificationError: a check failed; nothing was written.
    """
    check_onnx_version()
    paths = export_paths(out_dir, name)
    taken = [path for path in paths.values() if os.path.isdir(path)]
    if taken:
        raise ExportError('expected to write files at %s, found a folder there'
                          % ', '.join(taken))
    summary, sym_path, params_path = locate_checkpoint(checkpoint_dir, log, train_if_missing)
    symbol, arg_params, aux_params = load_checkpoint(sym_path, params_path)
    inference = inference_graph(symbol)
    stages = stage_layout(inference)
    log('exporting %s (%s): %s' % (params_path, ', '.join(summary.get('devices', [])),
                                   '; '.join('%s: layers %s' % (g, s['layers'])
                                             for g, s in stages.items())))
    model = to_onnx(inference, arg_params, aux_params,
                    {'symbol': sym_path, 'params': params_path},
                    extra_metadata={'trained_devices': ','.join(summary.get('devices', []))})
    with ExitStack() as stack:
        # Entered in reverse so that they are renamed in order, the report last.
        staged = OrderedDict((key, stack.enter_context(atomic_path(paths[key])))
                             for key in reversed(paths))
        inference.save(staged['symbol'])
        save_params(staged['params'], arg_params, aux_params)
        onnx.save(model, staged['onnx'])
        report = verify_export(staged['onnx'], staged['symbol'], staged['params'],
                               {k: v.asnumpy() for k, v in arg_params.items()})
        report['source'] = OrderedDict([('symbol', sym_path), ('params', params_path),
                                        ('params_sha256', sha256_file(params_path)),
                                        ('trained_devices', summary.get('devices'))])
        report['files'] = dict(paths)
        for line in format_report(report):
            log(line)
        if not report['ok']:
            raise VerificationError('verification failed, nothing written: %s'
                                    % '; '.join(failed_checks(report)))
        with open(staged['report'], 'w') as f:
            json.dump(report, f, indent=2)
            f.write('\n')
    log('wrote %s' % ', '.join(paths.values()))
    return paths, report
