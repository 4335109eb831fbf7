"""``load_model``: an exported MXNet pair, bound for inference on a device plan.

``python -m export`` writes ``<name>-symbol.json`` and ``<name>-0000.params``
with the ``ctx_group`` of every op and variable kept. :func:`load_model`
finds the pair (an export folder, its ``current/`` snapshot, a symbol file or
a checkpoint prefix), binds it with :class:`~export.runtimes.MXNetPredictor`
(one device per stage, fewer devices taking neighbouring stages, or one
device), and returns a :class:`LoadedModel` that predicts on numpy arrays or
NDArrays of any batch size and hands out a Gluon ``SymbolBlock``.

Binding a split graph by hand (``sym.simple_bind(group2ctx=...)``) trips over
MXNet 1.9.1's oneDNN subgraph backend, which fuses convolution, BatchNorm and
activation across the stage boundary ("The size of NDArray doesn't match the
requested MKLDNN memory desc" on the digits CNN); the predictor binds inside
:func:`mp_symbolic.core.placement.devices.split_bind`, which turns that backend off for
split binds only.
"""
import glob
import os

import mxnet as mx
from mxnet import gluon
import numpy as np

from mp_symbolic.tools.files import what_is
from mp_symbolic.tools.store import check_committed_file

from .errors import InputError, ModelFileError
from .inference import bindable
from .runtimes import SYMBOL_SUFFIX, MXNetPredictor, params_beside

__all__ = ['load_model', 'LoadedModel']

_CURRENT = 'current'  # the committed snapshot of an export folder (mp_symbolic.tools.store)


def _symbol_in_folder(folder):
    found = sorted(glob.glob(os.path.join(glob.escape(folder), '*' + SYMBOL_SUFFIX)))
    if len(found) != 1:
        raise ModelFileError('expected one <name>%s in the export folder %s, found %s'
                             % (SYMBOL_SUFFIX, folder, ', '.join(os.path.basename(p)
                                                                 for p in found) or 'none'))
    return found[0]


def locate_pair(path, epoch=None):
    """The symbol and params files ``path`` names.

    Args:
        path: An export folder (``python -m export --out``), its ``current``
            snapshot or any folder holding one ``<name>-symbol.json``; a
            ``<name>-symbol.json`` file; or a prefix ``P`` of
            ``P-symbol.json``.
        epoch: The params file ``<prefix>-%04d.params`` to read; ``None``: the
            only params file beside the symbol.

    Returns:
        ``(symbol path, params path)``.

    Raises:
        ModelFileError: nothing of the kind there, several candidates, or no
            params file for ``epoch``.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        current = os.path.join(path, _CURRENT)
        sym_path = _symbol_in_folder(current if os.path.isdir(current) else path)
    elif path.endswith(SYMBOL_SUFFIX):
        sym_path = path
    elif os.path.isfile(path + SYMBOL_SUFFIX):
        sym_path = path + SYMBOL_SUFFIX
    else:
        raise ModelFileError('expected an export folder, a <name>%s file or the prefix of one, '
                             'found nothing of the kind at %s' % (SYMBOL_SUFFIX, path))
    if not os.path.isfile(sym_path):
        raise ModelFileError('expected an MXNet symbol file at %s, found %s'
                             % (sym_path, what_is(sym_path, 'none')))
    if epoch is None:
        return sym_path, params_beside(sym_path)
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch <= 9999:
        raise ModelFileError('epoch: expected an integer in [0, 9999], found %r' % (epoch,))
    params_path = '%s-%04d.params' % (sym_path[:-len(SYMBOL_SUFFIX)], epoch)
    if not os.path.isfile(params_path):
        raise ModelFileError('expected the params file %s for epoch %d, found none'
                             % (params_path, epoch))
    return sym_path, params_path


def load_model(path, devices=None, epoch=None):
    """Loads an exported symbol/params pair for inference.

    Args:
        path: See :func:`locate_pair` (``'my_export'``,
            ``'my_export/current/my_model'``, ...).
        devices: ``'cpu:0,cpu:1'``, a list of ``mx.Context`` or one
            ``mx.Context``. One device per stage keeps the model-parallel
            split (stage ``s`` on the ``s``-th device); fewer devices take
            neighbouring stages each; one device takes all. ``None``: one
            device per stage, GPUs if MXNet sees enough of them, else
            ``cpu(0)``, ``cpu(1)``, ...
        epoch: See :func:`locate_pair`.

    Returns:
        A :class:`LoadedModel`.

    Raises:
        ModelFileError: no pair at ``path``, or a file that is not what it
            claims to be.
        CheckpointError: the params do not fit the symbol.
        StoreError: a file of a committed export no longer matches its
            commit record.
        ExportError: the symbol has no ``ctx_group`` attributes or no
            ``data`` input.
        DeviceSpecError: ``devices`` cannot be mapped onto the stages.
    """
    sym_path, params_path = locate_pair(path, epoch)
    check_committed_file(sym_path)  # a file of OUT/current/ must match its commit
    return LoadedModel(MXNetPredictor.from_files(sym_path, params_path, devices=devices))


class LoadedModel:
    """An exported pair bound on its devices (use :func:`load_model`).

    Attributes:
        symbol: The inference symbol, ``ctx_group`` on every node.
        arg_params, aux_params: Name -> NDArray, on ``cpu()``.
        group2ctx: ``{'stage0': ctx, ...}``: where each stage runs.
        sample_shape: One input sample's shape (batch left out); of the
            first input where there are several.
        input_names: The inputs, in order: ``['data']``, or ``['data0',
            'data1', ...]``.
        sample_shapes: ``{input name: one sample's shape}``, as traced.
        dynamic_axes: ``{input name: {axis: name}}``: the input axes
            (``python -m export --dynamic``) :meth:`predict` takes at any
            size, the same size on every axis of one name.
        path, params_path: The files loaded.
    """

    def __init__(self, predictor):
        self._predictor = predictor
        self.symbol = predictor.symbol
        self.arg_params, self.aux_params = predictor.arg_params, predictor.aux_params
        self.group2ctx = dict(predictor.group2ctx)
        self.sample_shape = tuple(predictor.sample_shape)
        self.input_names = list(predictor.input_names)
        self.sample_shapes = dict(predictor.sample_shapes)
        self.dynamic_axes = {name: dict(axes) for name, axes in predictor.dynamic_axes.items()}
        self.path = predictor.path
        self.params_path = predictor.params_path

    def predict(self, *inputs):
        """The model's outputs for a batch of any size.

        Args:
            *inputs: One numpy array or NDArray per input, in input order,
                each ``(samples,) + its sample shape`` (or, for one input,
                ``(samples, features)``), of any size along its
                :attr:`dynamic_axes`.

        Returns:
            float32 numpy array ``(samples, ...)``, the output of the last
            stage; a tuple of them, in the graph's order, for a model of
            several outputs.

        Raises:
            InputError: not one batch per input, or one that is not a batch
                of samples of that shape.
            ModelFileError: MXNet fails to run the graph.
        """
        arrays = []
        for X, name in zip(inputs, self.input_names):
            X = X.asnumpy() if isinstance(X, mx.nd.NDArray) else np.asarray(X)
            if X.ndim < 1 or len(X) == 0 or (X.ndim < 2 and len(self.sample_shapes[name])):
                raise InputError('expected a batch of shape (samples,) + %s%s, found shape %s'
                                 % (self.sample_shapes[name],
                                    ' for %s' % name if len(self.input_names) > 1 else '',
                                    X.shape))
            arrays.append(X)
        if len(inputs) != len(self.input_names):
            raise InputError('expected %d input arrays (%s), found %d'
                             % (len(self.input_names), ', '.join(self.input_names), len(inputs)))
        outputs = self._predictor.run(*arrays)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def placement(self):
        """``{argument name: context}`` as MXNet reports it for the bound graph."""
        return self._predictor.placement()

    def symbol_block(self, ctx=None):
        """The model as a Gluon ``SymbolBlock`` on one device.

        Gluon runs a block on one device (its ``CachedOp`` has no
        ``group2ctx``); the ``ctx_group`` attributes stay in the graph and
        are ignored. Use :meth:`predict` for the split model.

        Args:
            ctx: The device; ``None``: the first stage's.

        Returns:
            A ``gluon.SymbolBlock`` taking the inputs (``data``, or
            ``data0``, ``data1``, ...) of shape ``(samples,) + sample_shape``,
            its parameters loaded.
        """
        ctx = ctx or self.group2ctx[next(iter(self.group2ctx))]
        block = gluon.SymbolBlock(bindable(self.symbol), [mx.sym.var(name, dtype='float32')
                                                          for name in self.input_names])
        arrays = dict(self.arg_params)
        arrays.update(self.aux_params)
        block.collect_params().load_dict(arrays, ctx=ctx)
        return block

    def __repr__(self):
        return 'LoadedModel(%s, %s)' % (self.path, ', '.join(
            '%s -> %s' % (group, ctx) for group, ctx in self.group2ctx.items()))
