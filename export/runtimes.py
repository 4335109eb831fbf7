"""The exported model in its two deployment runtimes, behind one interface.

* :class:`MXNetPredictor` binds the ``-symbol.json`` / ``.params`` pair with
  ``simple_bind(group2ctx=...)``: MXNet places every op and every argument
  array by the ``ctx_group`` attribute kept in the file, on devices chosen at
  load time through :func:`mp_symbolic.placement.make_plan`.
* :class:`OnnxPredictor` runs the ``.onnx`` file in onnxruntime.

Both take a float32 ``(samples, features)`` array and return
``(samples, outputs)``; :func:`load_predictor` picks one by file name.
"""
import glob
import os
import re

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from mp_symbolic.checkpoint import load_checkpoint
from mp_symbolic.pipeline import DATA_NAME
from mp_symbolic.placement import DeviceSpecError, make_plan, split_bind

from .errors import InputError, ModelFileError, one_line
from .inference import features, inference_graph, sample_shape, stage_layout

__all__ = ['MXNetPredictor', 'OnnxPredictor', 'load_predictor', 'params_beside',
           'SYMBOL_SUFFIX', 'ONNX_SUFFIX']

SYMBOL_SUFFIX = '-symbol.json'
ONNX_SUFFIX = '.onnx'
_EPOCH_RE = re.compile(r'-(\d{4})\.params$')
# What onnxruntime raises for a file it cannot load (none derive from a common
# base other than Exception).
_ORT_LOAD_ERRORS = (ort_state.InvalidProtobuf, ort_state.InvalidGraph, ort_state.Fail,
                    ort_state.NoSuchFile, ort_state.InvalidArgument,
                    ort_state.NotImplemented, ort_state.RuntimeException)


def _check_batch(X, shape):
    """``(samples, features)`` or ``(samples,) + shape`` -> ``(samples,) + shape`` float32."""
    X = np.asarray(X)
    width = features(shape)
    if X.ndim == 2 and X.shape[1] == width:
        X = X.reshape((len(X),) + tuple(shape))
    elif X.shape[1:] != tuple(shape):
        raise InputError('expected an array of shape (samples, %d)%s, found shape %s'
                         % (width, '' if len(shape) == 1 else ' or (samples,) + %s'
                            % (tuple(shape),), X.shape))
    return np.ascontiguousarray(X, dtype=np.float32)


def params_beside(sym_path):
    """The params file of the pair ``sym_path`` belongs to.

    ``<prefix>-symbol.json`` pairs with ``<prefix>-NNNN.params``; if several
    epochs are there, the highest one.

    Raises:
        ModelFileError: ``sym_path`` does not end in ``-symbol.json``, or no
            params file is beside it.
    """
    if not sym_path.endswith(SYMBOL_SUFFIX):
        raise ModelFileError('expected a symbol file ending in %s, found %s'
                             % (SYMBOL_SUFFIX, sym_path))
    prefix = sym_path[:-len(SYMBOL_SUFFIX)]
    found = sorted(p for p in glob.glob(glob.escape(prefix) + '-*.params')
                   if _EPOCH_RE.search(p) and p[:-len('-0000.params')] == prefix)
    if not found:
        raise ModelFileError('expected a params file %s-NNNN.params beside %s, found none'
                             % (prefix, sym_path))
    if len(found) > 1:  # which one belongs to the symbol is not for a guess to decide
        raise ModelFileError('expected one params file beside %s, found %d (%s); export the '
                             'checkpoint with python -m export and use its files'
                             % (sym_path, len(found), ', '.join(os.path.basename(p)
                                                                for p in found)))
    return found[0]


class MXNetPredictor:
    """An inference symbol bound model-parallel by its ``ctx_group`` attributes.

    Args:
        symbol: The exported inference symbol (a training symbol works too:
            its loss head is dropped).
        arg_params: Parameter name -> NDArray.
        aux_params: Auxiliary state name -> NDArray (none for this network).
        devices: A ``--devices`` string or list of contexts. One device per
            ``ctx_group`` keeps the model-parallel split; fewer devices take
            contiguous groups each (one device: every group on it). ``None``:
            one device per group, GPUs if MXNet sees enough, else CPUs.

    Attributes:
        group2ctx: ``{'stage0': ctx, ...}`` as passed to ``simple_bind``.
        note: A line saying which default devices were chosen, or ``None``.

    Raises:
        ExportError: the symbol lacks ``ctx_group`` attributes or has no
            ``data`` input.
        DeviceSpecError: ``devices`` cannot be mapped onto the groups.
    """

    def __init__(self, symbol, arg_params, aux_params=None, devices=None, shape=None):
        self.symbol = inference_graph(symbol)
        self.stages = stage_layout(self.symbol)
        self.arg_params = {k: v for k, v in arg_params.items()
                           if k in self.symbol.list_arguments()}
        self.aux_params = dict(aux_params or {})
        try:
            plan, self.note = make_plan(len(self.stages), devices)
        except DeviceSpecError as err:
            raise DeviceSpecError('%s (the model has %d stages: %s)'
                                  % (err, len(self.stages), ', '.join(self.stages))) from None
        # Groups play the part of layers here: make_plan gives contiguous groups
        # to each device, so fewer devices than groups merge neighbouring stages.
        self.group2ctx = {group: plan.device_of_layer(i) for i, group in enumerate(self.stages)}
        self.sample_shape = sample_shape(self.symbol, self.arg_params, shape)
        self.input_width = features(self.sample_shape)
        self._exec = None

    @classmethod
    def from_files(cls, sym_path, params_path=None, devices=None, shape=None):
        """Loads a pair; ``params_path`` defaults to :func:`params_beside`.

        Raises:
            ModelFileError: no params file beside ``sym_path``.
            CheckpointError: a file is missing or corrupt, or the arrays do
                not fit the symbol.
            ExportError, DeviceSpecError: see the class.
        """
        if params_path is None:
            if not os.path.isfile(sym_path):
                raise ModelFileError('expected an MXNet symbol file at %s, found none' % sym_path)
            params_path = params_beside(sym_path)
        symbol, arg_params, aux_params = load_checkpoint(sym_path, params_path)
        return cls(symbol, arg_params, aux_params, devices, shape)

    def bind(self, batch_size):
        """The executor for ``batch_size`` samples (the last one is reused)."""
        if self._exec is None or self._exec.arg_dict[DATA_NAME].shape[0] != batch_size:
            data_ctx = self.group2ctx[self.symbol.get_internals()[DATA_NAME].attr('ctx_group')]
            with split_bind(self.group2ctx):
                self._exec = self.symbol.simple_bind(
                    ctx=data_ctx, group2ctx=self.group2ctx, grad_req='null',
                    **{DATA_NAME: (batch_size,) + tuple(self.sample_shape)})
            for name, value in self.arg_params.items():
                value.copyto(self._exec.arg_dict[name])
            for name, value in self.aux_params.items():
                value.copyto(self._exec.aux_dict[name])
        return self._exec

    def placement(self):
        """``{argument name: context}`` of the current executor, as MXNet reports it."""
        if self._exec is None:
            self.bind(1)
        return {name: array.context for name, array in self._exec.arg_dict.items()}

    def predict(self, X):
        """``(samples, features)`` -> ``(samples, outputs)`` float32 numpy array.

        Raises:
            InputError: ``X`` is not ``(samples, input_width)``.
        """
        X = _check_batch(X, self.sample_shape)
        executor = self.bind(len(X))
        executor.forward(is_train=False, **{DATA_NAME: X})
        return executor.outputs[0].asnumpy()


class OnnxPredictor:
    """An ``.onnx`` file in an onnxruntime CPU session.

    Raises:
        ModelFileError: the file is missing, not a model onnxruntime can
            load, or not one 2-D input with a fixed feature count.
    """

    def __init__(self, path):
        if not os.path.isfile(path):
            raise ModelFileError('expected an ONNX model file at %s, found none' % path)
        try:
            self.session = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
        except _ORT_LOAD_ERRORS as err:
            raise ModelFileError('%s is not a loadable ONNX model: %s'
                                 % (path, one_line(err))) from None
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or len(inputs[0].shape) < 2 or not all(
                isinstance(d, int) for d in inputs[0].shape[1:]):
            raise ModelFileError('%s: expected one input of shape (batch, ...) with fixed '
                                 'per-sample dimensions, found %s'
                                 % (path, ', '.join('%s%s' % (i.name, i.shape) for i in inputs)))
        self.input_name = inputs[0].name
        self.sample_shape = tuple(inputs[0].shape[1:])
        self.input_width = features(self.sample_shape)
        self.output_width = features([d for d in outputs[0].shape[1:] if isinstance(d, int)])

    def predict(self, X):
        """``(samples, features)`` -> ``(samples, outputs)`` float32 numpy array.

        Raises:
            InputError: ``X`` is not ``(samples, input_width)``.
        """
        X = _check_batch(X, self.sample_shape)
        return self.session.run(None, {self.input_name: X})[0]


def load_predictor(path, devices=None):
    """The predictor for an exported file, chosen by its name.

    Args:
        path: ``<name>.onnx``, or ``<name>-symbol.json`` with its params file
            beside it.
        devices: MXNet pair only; see :class:`MXNetPredictor`.

    Raises:
        ModelFileError: the name is neither kind, or the file is missing or
            corrupt.
        CheckpointError: the pair's arrays do not fit its symbol.
        DeviceSpecError: ``devices`` given for an ONNX model, or unusable.
    """
    if path.endswith(ONNX_SUFFIX):
        if devices is not None:
            raise DeviceSpecError('expected --devices only with an MXNet pair (%s), '
                                  'found an ONNX model %s' % (SYMBOL_SUFFIX, path))
        return OnnxPredictor(path)
    if path.endswith(SYMBOL_SUFFIX):
        return MXNetPredictor.from_files(path, devices=devices)
    raise ModelFileError('expected a model file ending in %s or %s, found %s'
                         % (ONNX_SUFFIX, SYMBOL_SUFFIX, path))

