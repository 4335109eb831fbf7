"""The inference symbol as an ONNX model, around the traps of MXNet 1.9's exporter.

``mx.onnx.export_model`` (MXNet 1.9.1) has no converter for the loss heads,
turns any unbound variable not named ``<last node>_label`` into a graph
input, lists every weight as a graph input as well as an initializer
(onnxruntime then warns and cannot fold them), declares whatever opset the
installed ``onnx`` supports, and breaks with ``onnx>=1.18``. So here:

* the loss heads are already gone (:func:`export.inference.inference_graph`)
  and every argument but the inputs (``data``, or ``data0``, ``data1``, ...)
  gets an array, so the inputs are the graph inputs, in order, each of its
  own dtype; every output of the symbol is a graph output, in the symbol's
  order (MXNet's converter lists them in the order it converts their nodes),
  of any shape;
* the graph is built by the exporter's own converter at a pinned opset
  (:data:`ONNX_OPSET`, the newest MXNet 1.9.1 has translations for), and the
  model declares that opset and :data:`ONNX_IR_VERSION` explicitly; the
  converter's own graph check runs at that opset too, and ops it lacks or
  refuses are named with their block (:mod:`export.converters`, which also
  adds 1-D convolution and pooling, and GroupNorm);
* initializers are removed from the graph inputs;
* the batch dimension is the named dynamic dimension :data:`BATCH_DIM`, on
  each input's batch axis (the ``N`` of the layout the graph records on it,
  ``(seq, batch)`` for a ``'TN'`` input; else axis 0) and each output's
  (where its size follows the batch), and so is any other input axis given in ``dynamic_axes`` (a language model's
  sequence length), of any input; axes of one name (BERT's token ids and
  token types along the sequence) change together, and the output axes that
  follow them (found by MXNet's shape inference at two sizes) take the name;
* ``metadata_props`` records where the model came from.

The weights' values are written into the finished model alone (see
:mod:`export.converters`), and :func:`save_onnx` writes it one weight at a
time, so no second copy of them is made on the way to the file. A model too
large for one protobuf message (:data:`PROTOBUF_LIMIT`, 2 GiB) is written in
ONNX's external-data format: the weights' values in ``<name>.onnx.data``
beside ``<name>.onnx``.
"""
from collections import OrderedDict
import importlib.metadata
import json
import os
import re

import mxnet as mx
from mxnet.onnx.mx2onnx._export_onnx import MXNetGraph
import numpy as np
import onnx
from onnx import helper

from mp_symbolic.tools.files import sha256_file

from . import converters
from .errors import ExportError
from .inference import batch_axes, input_names, output_batch_axes, output_shapes, stage_layout

__all__ = ['ONNX_OPSET', 'ONNX_IR_VERSION', 'BATCH_DIM', 'PRODUCER_NAME',
           'check_onnx_version', 'to_onnx', 'producer_version', 'dynamic_inputs',
           'dynamic_groups', 'save_onnx', 'without_weight_values', 'onnx_file_bytes',
           'external_data_name', 'PROTOBUF_LIMIT', 'EXTERNAL_DATA_SUFFIX',
           'EXTERNAL_DATA_ALIGNMENT']

ONNX_OPSET = 13
assert converters.OPSET == ONNX_OPSET, 'the converters are registered at the declared opset'
# IR version 7 is the oldest that carries opset 13, so the widest range of
# runtimes can load the file.
ONNX_IR_VERSION = 7
BATCH_DIM = 'batch'
PRODUCER_NAME = 'mxnet-model-parallel'
# The most bytes one protobuf message, so one .onnx file, may take (2 GiB - 1):
# a larger model is written with its weights' values in a file beside it.
PROTOBUF_LIMIT = (1 << 31) - 1
EXTERNAL_DATA_SUFFIX = '.data'
# Each weight's offset in that file is a multiple of this (the allocation
# granularity on every platform: onnxruntime may map an aligned weight).
EXTERNAL_DATA_ALIGNMENT = 1 << 16
_ONNX_BREAKS_AT = (1, 18)


def producer_version():
    """This project's installed version (``'unknown'`` when run uninstalled)."""
    try:
        return importlib.metadata.version(PRODUCER_NAME)
    except importlib.metadata.PackageNotFoundError:
        return 'unknown'


def check_onnx_version():
    """Raises ExportError unless the installed ``onnx`` works with MXNet 1.9.1.

    Raises:
        ExportError: ``onnx>=1.18``, or an ``onnx`` too old for opset 13.
    """
    release = tuple(int(part) for part in onnx.__version__.split('.')[:2])
    if release >= _ONNX_BREAKS_AT:
        raise ExportError("expected onnx<%d.%d (MXNet %s's exporter breaks with newer "
                          "releases; pyproject.toml pins onnx==1.14.1), found onnx %s"
                          % (_ONNX_BREAKS_AT + (mx.__version__, onnx.__version__)))
    if onnx.defs.onnx_opset_version() < ONNX_OPSET:
        raise ExportError('expected an onnx release that supports opset %d, found onnx %s '
                          '(opset %d)' % (ONNX_OPSET, onnx.__version__,
                                          onnx.defs.onnx_opset_version()))


def _set_shape(value_info, dims):
    shape = value_info.type.tensor_type.shape
    del shape.dim[:]
    for dim in dims:
        if isinstance(dim, str):
            shape.dim.add().dim_param = dim
        else:
            shape.dim.add().dim_value = dim


def dynamic_inputs(dynamic_axes, shapes):
    """The dynamic axes of each input, checked against the traced shapes.

    Args:
        dynamic_axes: ``{axis: name}`` of the first input (axis 1 is the
            first after the batch), ``{input name: {axis: name}}``, or both
            in one dict (``{1: 'seq', 'data1': {1: 'seq'}}``); ``None``.
        shapes: ``{input name: per-sample shape}`` as traced, in input order.

    Returns:
        ``OrderedDict`` ``{input name: {axis: name}}`` in input order, of
        the inputs with a dynamic axis (empty for ``None``). Axes of one
        name vary together.

    Raises:
        ExportError: an unknown input, an axis out of range, a name that
            is not an identifier or is :data:`BATCH_DIM`, one axis given
            two names, or axes of one name traced at different sizes.
    """
    inputs = list(shapes)
    given = []  # (input, axis, name)
    for key, value in (dynamic_axes or {}).items():
        if isinstance(key, str):
            if key not in shapes:
                raise ExportError('--dynamic: expected an input name among %s, found %r'
                                  % (', '.join(inputs), key))
            if not isinstance(value, dict):
                raise ExportError('--dynamic %s: expected {axis: name}, found %r' % (key, value))
            given.extend((key, axis, name) for axis, name in value.items())
        else:
            given.append((inputs[0], key, value))
    spec = OrderedDict()
    for input_name, axis, name in given:
        shape = shapes[input_name]
        field = '--dynamic' if len(inputs) == 1 else '--dynamic %s' % input_name
        if not shape:
            raise ExportError('%s: expected an input with axes besides the batch, found one '
                              'number per sample' % field)
        if not isinstance(axis, int) or isinstance(axis, bool) or not 1 <= axis <= len(shape):
            raise ExportError('%s: expected an input axis from 1 to %d (axis 0 is the batch), '
                              'found %r' % (field, len(shape), axis))
        if not isinstance(name, str) or not name.isidentifier() or name == BATCH_DIM:
            raise ExportError('%s: expected a distinct name other than %r for axis %d, '
                              'found %r' % (field, BATCH_DIM, axis, name))
        axes = spec.setdefault(input_name, {})
        if axes.get(axis, name) != name:
            raise ExportError('%s: expected one name for axis %d, found %r and %r'
                              % (field, axis, axes[axis], name))
        axes[axis] = name
    spec = OrderedDict((n, dict(sorted(spec[n].items()))) for n in inputs if n in spec)
    for name, axes in dynamic_groups(spec).items():
        sizes = {shapes[i][a - 1] for i, a in axes}
        if len(sizes) > 1:
            raise ExportError('--dynamic: expected the axes named %s to be traced at one size, '
                              'found %s' % (name, ', '.join(
                                  '%s axis %d of %d' % (i, a, shapes[i][a - 1]) for i, a in axes)))
    return spec


def dynamic_groups(spec):
    """``{name: [(input name, axis), ...]}`` of a :func:`dynamic_inputs` spec."""
    groups = OrderedDict()
    for input_name, axes in spec.items():
        for axis, name in axes.items():
            groups.setdefault(name, []).append((input_name, axis))
    return groups


def _dynamic_dims(symbol, arg_params, aux_params, shapes, out_shapes, spec):
    """``({input name: dims}, [dims of each output])`` per sample, each axis
    of ``spec`` (:func:`dynamic_inputs`) named, and the output axes whose
    size follows that name's axes, all changed together."""
    in_dims = OrderedDict((n, list(s)) for n, s in shapes.items())
    out_dims = [list(s) for s in out_shapes]
    for name, axes in dynamic_groups(spec).items():
        size = shapes[axes[0][0]][axes[0][1] - 1]
        other = OrderedDict((n, list(s)) for n, s in shapes.items())
        for input_name, axis in axes:
            other[input_name][axis - 1] = size - 1 if size > 1 else 2
        try:
            changed = output_shapes(symbol, arg_params, aux_params, other)
        except ExportError as err:
            if len(axes) > 1:
                which = 'the axes named %s (%s)' % (name, ', '.join('%s axis %d' % a
                                                                  for a in axes))
            else:
                which = 'input axis %d%s' % (axes[0][1], '' if len(shapes) == 1
                                             else ' of %s' % axes[0][0])
            raise ExportError('--dynamic: expected %s to take other sizes than %d, found %s '
                              'cannot: %s' % (which, size, 'it' if len(axes) == 1 else 'they',
                                              err)) from None
        for input_name, axis in axes:
            in_dims[input_name][axis - 1] = name
        for dims, before, after in zip(out_dims, out_shapes, changed):
            for i, (a, b) in enumerate(zip(before, after)):
                if a != b:
                    dims[i] = name
    return OrderedDict((n, tuple(d)) for n, d in in_dims.items()), [tuple(d) for d in out_dims]


def _output_names(symbol):
    """The ONNX names MXNet's converter gives the symbol's outputs
    (``softmax0_output`` -> ``softmax0``; ``split0_output1`` -> ``split01``;
    an RNN's ``rnn0_state_output`` -> ``rnn01``, ``rnn0_statecell_output`` ->
    ``rnn02``)."""
    names = []
    for name in symbol.list_outputs():
        if name.endswith('_state_output'):
            names.append(name[:-len('_state_output')] + '1')
        elif name.endswith('_statecell_output'):
            names.append(name[:-len('_statecell_output')] + '2')
        elif name.endswith('_output'):
            names.append(name[:-len('_output')])
        elif re.search(r'_output[0-9]$', name):
            names.append(name[:-len('_output0')] + name[-1])
        else:
            names.append(name)
    return names


def to_onnx(symbol, arg_params, aux_params, source_files, shape, extra_metadata=None,
            dynamic_axes=None, dtypes=None, fill=True):
    """Converts an inference symbol and its arrays to an ONNX ``ModelProto``.

    Args:
        symbol: The inference symbol, ``ctx_group`` on every node.
        arg_params: Parameter name -> NDArray; every argument but ``data``.
        aux_params: Auxiliary state name -> NDArray.
        source_files: ``{'symbol': path, 'params': path or [paths]}`` of the training
            checkpoint; their names and sha256 go into the metadata.
        shape: Shape of one input sample (batch dimension left out), or
            ``{input name: shape}`` (``data0``, ``data1``, ...).
        extra_metadata: More ``metadata_props`` entries (string values).
        dynamic_axes: ``{axis: name}`` of input axes besides the batch whose
            size may vary (axis 1 is the first after the batch), e.g.
            ``{1: 'seq'}``, of the first input; or ``{input name: {axis:
            name}}`` (see :func:`dynamic_inputs`): axes of one name vary
            together. ``shape`` gives their size when the graph is traced.
        dtypes: ``{input name: numpy dtype}``; float32 where not given.
        fill: Whether the weights' values go into the model. ``False``:
            the initializers of the parameters are left without them, and
            ``(model, weights)`` is returned, ``weights`` reading each one
            from ``arg_params`` and ``aux_params`` when :func:`save_onnx`
            writes it (no second copy of the weights is made).

    Returns:
        The model (``(model, weights)`` without ``fill``); nothing is written.

    Raises:
        ExportError: ``onnx`` is unsuitable, an op has no converter or its
            converter refuses it (one line naming the op and its block), an
            input other than the graph's inputs would be left in the graph,
            or ``dynamic_axes`` does not fit the inputs
            (:func:`dynamic_inputs`) or the graph cannot take other sizes
            of an axis.
    """
    check_onnx_version()
    inputs = input_names(symbol)
    shapes = OrderedDict(shape) if isinstance(shape, dict) else OrderedDict([(inputs[0], shape)])
    shapes = OrderedDict((name, tuple(shapes[name])) for name in inputs)
    dtypes = {name: np.dtype((dtypes or {}).get(name, np.float32)) for name in inputs}
    out_shapes = output_shapes(symbol, arg_params, aux_params, shapes)
    params = dict(arg_params)
    params.update(aux_params)
    arrays = {name: value.shape for name, value in params.items()}
    spec = dynamic_inputs(dynamic_axes, shapes)
    in_dims = {name: tuple(s) for name, s in shapes.items()}
    out_dims = list(out_shapes)
    if spec:
        in_dims, out_dims = _dynamic_dims(symbol, arg_params, aux_params, shapes, out_shapes,
                                          spec)
    converters.check_translations(symbol, arrays, shapes, ONNX_OPSET)
    # each input's and output's batch where the graph lays it out (axis 0 unless recorded)
    axes = batch_axes(symbol)
    out_axes = output_batch_axes(symbol, arg_params, aux_params, shapes) \
        if any(axes.values()) else [0] * len(out_dims)

    def batched(dims, axis, batch):
        return tuple(dims[:axis]) + (batch,) + tuple(dims[axis:])

    # MXNet's converter takes the input shapes and types in list_inputs() order.
    order = [n for n in symbol.list_inputs() if n not in params]
    try:
        with converters.conversion_context(ONNX_OPSET, ONNX_IR_VERSION) as conversion:
            graph = MXNetGraph().create_onnx_graph_proto(
                symbol, params, in_shapes=[batched(shapes[n], axes[n], 1) for n in order],
                in_types=[onnx.helper.np_dtype_to_tensor_dtype(dtypes[n]) for n in order],
                opset_version=ONNX_OPSET, dynamic=True,
                dynamic_input_shapes=[batched(in_dims[n], axes[n], BATCH_DIM) for n in order])
    except onnx.checker.ValidationError as err:
        raise ExportError('MXNet converted this graph to ONNX that is not valid at opset %d: %s'
                          % (ONNX_OPSET, ' '.join(str(err).split()))) from None
    # MXNet's softmax converter leaves an initializer no node reads; onnxruntime
    # warns about it at load.
    used = {name for node in graph.node for name in node.input}
    unused = [init for init in graph.initializer if init.name not in used]
    for init in unused:
        graph.initializer.remove(init)
    weights = {init.name for init in graph.initializer}
    kept = {value.name: value for value in graph.input
            if value.name not in weights and value.name in used}
    if sorted(kept) != sorted(inputs):
        raise ExportError('expected %s as the graph inputs, found %s'
                          % (', '.join(inputs), ', '.join(sorted(kept)) or 'none'))
    del graph.input[:]
    graph.input.extend(kept[name] for name in inputs)
    named = {value.name: value for value in graph.output}
    outputs = _output_names(symbol)
    if sorted(named) != sorted(outputs):
        raise ExportError('expected the graph outputs %s, found %s'
                          % (', '.join(outputs), ', '.join(sorted(named))))
    ordered = [named[name] for name in outputs]
    del graph.output[:]
    graph.output.extend(ordered)
    for value, dims, axis in zip(graph.output, out_dims, out_axes):
        _set_shape(value, batched(dims, axis, BATCH_DIM))

    stages = stage_layout(symbol)
    params = source_files['params']  # one file, or the parts of a checkpoint of nodes
    params = [params] if isinstance(params, str) else list(params)
    metadata = OrderedDict([
        ('producer', PRODUCER_NAME),
        ('producer_version', producer_version()),
        ('mxnet_version', mx.__version__),
        ('onnx_version', onnx.__version__),
        ('opset', str(ONNX_OPSET)),
        ('input_names', json.dumps([v.name for v in graph.input])),
        ('input_shapes', json.dumps({v.name: [BATCH_DIM] + list(in_dims[v.name])
                                     for v in graph.input})),
        ('input_dtypes', json.dumps({name: dtypes[name].name for name in inputs})),
        ('output_names', json.dumps([v.name for v in graph.output])),
        ('output_shapes', json.dumps({v.name: [BATCH_DIM] + list(dims)
                                      for v, dims in zip(graph.output, out_dims)})),
        # the per-sample shape the graph was traced at (the sizes of dynamic axes)
        ('sample_shape', json.dumps(list(shapes[inputs[0]]))),
        ('sample_shapes', json.dumps({name: list(s) for name, s in shapes.items()})),
        # {input: {axis: name}}: the axes of one name vary together
        ('dynamic_axes', json.dumps({name: {str(a): d for a, d in axes.items()}
                                     for name, axes in spec.items()})),
        ('stages', json.dumps({group: {'layers': info['layers'], 'variables': info['variables']}
                               for group, info in stages.items()})),
        ('source_symbol', os.path.basename(source_files['symbol'])),
        ('source_symbol_sha256', sha256_file(source_files['symbol'])),
        ('source_params', ','.join(os.path.basename(p) for p in params)),
        ('source_params_sha256', ','.join(sha256_file(p) for p in params)),
    ])
    metadata.update(extra_metadata or {})
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', ONNX_OPSET)],
                              ir_version=ONNX_IR_VERSION, producer_name=PRODUCER_NAME,
                              producer_version=producer_version(),
                              doc_string='Inference graph of %s exported from MXNet %s; '
                                         'metadata_props says where it came from.'
                                         % (metadata['source_params'], mx.__version__))
    helper.set_model_props(model, metadata)
    del graph  # make_model copied it; the weights' values go into the model's copy alone
    if not fill:
        return model, conversion.weights
    if conversion.weights is not None:
        converters.fill_weights(model.graph.initializer, conversion.weights)
    return model


def _copy_fields(source, target, skip):
    """``target`` with every field of ``source`` but ``skip`` copied in."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        repeated = getattr(field, 'is_repeated', None)  # protobuf 7 has no .label
        if repeated if repeated is not None else field.label == field.LABEL_REPEATED:
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)
    return target


def _varint(number):
    out = bytearray()
    while True:
        byte, number = number & 0x7f, number >> 7
        out.append(byte | (0x80 if number else 0))
        if not number:
            return bytes(out)


# Protocol buffer keys (field number << 3 | 2, length-delimited) of
# ModelProto.graph, GraphProto.initializer and TensorProto.raw_data.
_GRAPH_KEY = _varint(7 << 3 | 2)
_INITIALIZER_KEY = _varint(5 << 3 | 2)
_RAW_DATA_KEY = _varint(9 << 3 | 2)  # TensorProto.raw_data


def external_data_name(onnx_name):
    """The name of the weights' file beside ``<name>.onnx`` when they are
    kept outside it: ``<name>.onnx.data``."""
    return onnx_name + EXTERNAL_DATA_SUFFIX


def _tensor_bytes(tensor):
    return int(np.prod(tensor.dims, dtype=np.int64)) * np.dtype(
        onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize


def _goes_outside(tensor, deferred=()):
    """Whether an initializer's values go to the data file: the weights,
    more than :data:`_KEPT_VALUES` values held as raw data (or still to be
    written: ``deferred``); the small ones that shape inference reads
    (shapes, axes, bounds) stay in the model."""
    return (tensor.HasField('raw_data') or tensor.name in deferred) and \
        int(np.prod(tensor.dims, dtype=np.int64)) > _KEPT_VALUES


def _raw_values(tensor, weights):
    """The little-endian bytes of an initializer's values: its own, or
    read from ``weights`` for one left without them."""
    if weights is not None and tensor.name in weights.deferred:
        value = weights[tensor.name]
        return np.ascontiguousarray(value, dtype=value.dtype.newbyteorder('<')).data
    return tensor.raw_data


def _filled(tensor, weights):
    """``tensor`` with its values, where ``weights`` holds them back."""
    if weights is None or tensor.name not in weights.deferred:
        return tensor
    full = onnx.TensorProto()
    full.CopyFrom(tensor)
    full.raw_data = bytes(_raw_values(tensor, weights))
    return full


def _filled_size(tensor, weights):
    """``_filled(tensor, weights).ByteSize()``, without reading the values."""
    if weights is None or tensor.name not in weights.deferred:
        return tensor.ByteSize()
    size = _tensor_bytes(tensor)
    return tensor.ByteSize() + len(_RAW_DATA_KEY) + len(_varint(size)) + size


def _outside(tensor, location, offset):
    """``tensor`` without its values, pointing at ``length`` bytes at
    ``offset`` of ``location`` (ONNX's external-data fields)."""
    light = _copy_fields(tensor, onnx.TensorProto(), 'raw_data')
    light.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (('location', location), ('offset', str(offset)),
                       ('length', str(_tensor_bytes(tensor)))):
        entry = light.external_data.add()
        entry.key, entry.value = key, value
    return light


def onnx_file_bytes(model, weights=None):
    """The size of ``model`` written as one file (what :func:`save_onnx`
    writes without external data), computed without serializing it whole;
    ``weights``: as :func:`save_onnx` takes them."""
    head = _copy_fields(model.graph, onnx.GraphProto(), 'initializer').ByteSize()
    sizes = [_filled_size(tensor, weights) for tensor in model.graph.initializer]
    length = head + sum(len(_INITIALIZER_KEY) + len(_varint(n)) + n for n in sizes)
    return (_copy_fields(model, onnx.ModelProto(), 'graph').ByteSize()
            + len(_GRAPH_KEY) + len(_varint(length)) + length)


def save_onnx(model, path, external_data_threshold=PROTOBUF_LIMIT, weights=None):
    """Writes ``model`` to ``path`` as ``onnx.save`` does, one initializer
    at a time: ``onnx.save`` serializes the whole model into one buffer
    and copies it into a bytes object (twice the weights more at the peak,
    880 MB for BERT-base). The file holds the same message (``onnx.load`` reads it
    equal to ``model``), the graph and its initializers written last.

    A model that would take more than ``external_data_threshold`` bytes as
    one file (by default :data:`PROTOBUF_LIMIT`, the most one protobuf
    message may take: no runtime parses a larger one) is written in ONNX's
    external-data format instead: the values of every initializer of more
    than 65,536 values go, one after another, each at an offset aligned to
    :data:`EXTERNAL_DATA_ALIGNMENT`, into one file beside it,
    ``<name>.onnx.data`` (:func:`external_data_name`), and the model
    records each one's ``location`` (that file's name), ``offset`` and
    ``length``; ``onnx.load(path)`` then reads back ``model`` with those
    values (and ``data_location`` ``DEFAULT``), onnxruntime reads the data
    file beside the model. ``model`` itself is not changed.

    ``weights`` (from :func:`to_onnx` without ``fill``) gives the values of
    the initializers left without them, each read when its turn comes.

    Returns:
        The path of the data file written, or ``None``.

    Raises:
        OSError: a file cannot be written (as ``onnx.save`` raises it).
        ExportError: written with its weights outside, the model still
            exceeds :data:`PROTOBUF_LIMIT` (its small initializers and
            graph alone); the data file is left for the caller's staging
            folder to remove.
    """
    graph = model.graph
    data_path = None
    tensors = list(graph.initializer)
    deferred = weights.deferred if weights is not None else ()
    outside = set()  # the indices of the tensors whose values went to the data file
    if onnx_file_bytes(model, weights) > external_data_threshold:
        data_path = external_data_name(str(path))
        location = os.path.basename(data_path)
        offset = 0
        with open(data_path, 'wb') as data:
            for index, tensor in enumerate(tensors):
                if not _goes_outside(tensor, deferred):
                    continue
                offset = -(-offset // EXTERNAL_DATA_ALIGNMENT) * EXTERNAL_DATA_ALIGNMENT
                data.seek(offset)
                values = _raw_values(tensor, weights)
                data.write(values)
                tensors[index] = _outside(tensor, location, offset)
                outside.add(index)
                offset += values.nbytes if isinstance(values, memoryview) else len(values)
                del values
            data.truncate(offset)
    head = _copy_fields(graph, onnx.GraphProto(), 'initializer').SerializeToString()
    # the values still to write of each tensor: none for those now pointing at the data file
    sources = [None if index in outside else weights for index in range(len(tensors))]
    sizes = [_filled_size(tensor, source) for tensor, source in zip(tensors, sources)]
    length = len(head) + sum(len(_INITIALIZER_KEY) + len(_varint(n)) + n for n in sizes)
    top = _copy_fields(model, onnx.ModelProto(), 'graph').SerializeToString()
    if data_path is not None and len(top) + len(_GRAPH_KEY) + len(_varint(length)) + length \
            > PROTOBUF_LIMIT:
        raise ExportError('%s: expected the model without its weights\' values within %d bytes '
                         '(protobuf\'s limit), found %d bytes'
                         % (path, PROTOBUF_LIMIT, len(top) + length))
    with open(path, 'wb') as f:
        f.write(top)
        f.write(_GRAPH_KEY + _varint(length))
        f.write(head)
        for tensor, size, source in zip(tensors, sizes, sources):
            f.write(_INITIALIZER_KEY + _varint(size))
            f.write(_filled(tensor, source).SerializeToString())
    return data_path


# Initializers of at most this many values keep them in without_weight_values:
# shape inference reads the values of shape, axes and index inputs, all small.
_KEPT_VALUES = 1 << 16


def without_weight_values(model):
    """A copy of ``model`` whose large initializers (more than 65,536
    values, the weights) have their name, type and shape but no values:
    what shape inference reads of them. It reads the values of small ones
    (a ``Reshape``'s target shape, a ``Slice``'s bounds), which are kept.

    ``onnx.shape_inference.infer_shapes`` serializes its model, parses it
    in C++, serializes the result and parses that again: four copies of the
    weights at once (1.5 GB more for BERT-base), none of which it reads.
    """
    light = _copy_fields(model, onnx.ModelProto(), 'graph')
    _copy_fields(model.graph, light.graph, 'initializer')
    for tensor in model.graph.initializer:
        if int(np.prod(tensor.dims, dtype=np.int64)) <= _KEPT_VALUES:
            light.graph.initializer.add().CopyFrom(tensor)
        else:
            light.graph.initializer.add(name=tensor.name, data_type=tensor.data_type,
                                        dims=tensor.dims, doc_string=tensor.doc_string)
    return light
