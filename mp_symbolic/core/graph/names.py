"""The placed graph's vocabulary: every name and attribute the library writes
into a Symbol and reads back (standard library only).

* ``ctx_group`` of a stage and of a shard: :func:`stage_name`,
  :func:`shard_group`, in :data:`GROUP_ATTR`;
* a parameter read on another stage goes through one :data:`IDENTITY_OP`
  node named :func:`tied_name` ``(parameter)``;
* :data:`TRACE_ATTRS`, the marks of a trace, are read into the typed graph
  or dropped, never written back; :data:`MXNET_ATTRS` are the only ones of
  the library's a bound graph carries; :data:`ATTRS` is every one;
* micro-batch ``m > 0``'s copy of an op is :func:`chunk_name` ``(op, m)``;
* inputs are named as ``HybridBlock.export`` names them, the label as
  ``mx.io.NDArrayIter`` does.
"""
__all__ = []

GROUP_ATTR = '__ctx_group__'          # MXNet's node attribute behind mx.AttrScope(ctx_group=...)
GROUP_KEY = 'ctx_group'               # the same attribute as Symbol.attr and mx.AttrScope name it
MIRROR_ATTR = '__force_mirroring__'   # MXNet's: recompute this op's output in backward
SHAPE_ATTR = '__shape__'              # MXNet's: a variable's shape (0: not known)
DTYPE_ATTR = '__dtype__'              # MXNet's: a variable's dtype, as MXNet's type code
LAYOUT_ATTR = '__layout__'            # MXNet's: an output's axes; the executor group joins it at N
INIT_ATTR = '__init__'                # Gluon's: a variable's initializer, as JSON
SHARD_ATTR = '__tp_shard__'           # ours: on a shard's ops and weights, 'i/N/layer#call'
BLOCK_ATTR = '__mp_block__'           # ours, while a block list is traced: the op's block index
GATHER_ATTR = '__tp_gather__'         # ours, while traced: a column layer's join, '<shards>:<flat>'
DYNAMIC_ATTR = '__dynamic_axes__'     # ours, in an exported pair: an input's axes of any size
STAGE_PREFIX = 'stage'
IDENTITY_OP = '_copy'                 # what mx.sym.identity makes; ONNX maps it to Identity
TIED_SUFFIX = '_tied'
CHUNK_SPLIT = 'chunk'                 # the split of the input into micro-batches
CHUNK_JOIN = 'join'                   # the concat of the micro-batches' outputs
CHUNK_INFIX = '_chunk'
DATA_NAME = 'data'                    # mx.io.NDArrayIter's and HybridBlock.export's input name
LABEL_NAME = 'softmax_label'          # mx.io.NDArrayIter's default label name

# The marks of a trace: read into the typed graph's nodes or dropped there
# (ir.PlacedGraph.from_json), never written back, so no graph MXNet binds,
# no checkpoint and no export carries them.
TRACE_ATTRS = (SHARD_ATTR, BLOCK_ATTR, GATHER_ATTR)
# What the library writes into a graph that MXNet reads: all a bound graph
# carries of the library's (Gluon's variables carry their own, GLUON_ATTRS).
MXNET_ATTRS = (GROUP_ATTR, MIRROR_ATTR, SHAPE_ATTR, DTYPE_ATTR, LAYOUT_ATTR)
# What Gluon writes on a parameter's variable (Parameter.var) and MXNet reads.
GLUON_ATTRS = (SHAPE_ATTR, DTYPE_ATTR, INIT_ATTR, '__lr_mult__', '__wd_mult__',
               '__storage_type__')
# Every attribute the library writes into a graph or a file's graph.
ATTRS = MXNET_ATTRS + TRACE_ATTRS + (DYNAMIC_ATTR,)


def stage_name(stage):
    """The ``ctx_group`` name of pipeline stage ``stage`` (``'stage0'``, ...)."""
    return '%s%d' % (STAGE_PREFIX, stage)


def shard_group(stage, index):
    """The ``ctx_group`` of the ``index``-th device of stage ``stage``:
    ``'stage0'`` for the first, ``'stage0_shard1'``, ... for the others."""
    return stage_name(stage) if index == 0 else '%s_shard%d' % (stage_name(stage), index)


def parse_group(group):
    """``'stage2'`` -> ``(2, 0)``, ``'stage2_shard1'`` -> ``(2, 1)`` (the
    inverse of :func:`shard_group`); ``None`` for any other name."""
    if not isinstance(group, str) or not group.startswith(STAGE_PREFIX):
        return None
    stage, _, shard = group[len(STAGE_PREFIX):].partition('_shard')
    if not stage.isdigit() or stage != str(int(stage)) or \
            (shard and (not shard.isdigit() or shard == '0' or shard != str(int(shard)))):
        return None
    return int(stage), int(shard or 0)


def tied_name(variable):
    """The identity through which other stages read ``variable``."""
    return variable + TIED_SUFFIX


def is_tied(name):
    """Whether ``name`` is such an identity (see :func:`tied_name`)."""
    return name.endswith(TIED_SUFFIX)


def shard_mark(index, shards, layer):
    """The :data:`SHARD_ATTR` value of shard ``index`` of ``shards`` of ``layer``."""
    return '%d/%d/%s' % (index, shards, layer)


def layer_call(layer, call):
    """The layer part of a shard mark: ``layer`` at the ``call``-th
    tensor-parallel layer call of a trace (``'dense0#3'``)."""
    return '%s#%d' % (layer, call)


def parse_shard_mark(mark):
    """``'1/2/dense0'`` -> ``(1, 2, 'dense0')`` (the inverse of :func:`shard_mark`)."""
    index, shards, layer = mark.split('/', 2)
    return int(index), int(shards), layer


def chunk_name(name, chunk):
    """The name of op ``name``'s copy for micro-batch ``chunk`` (``name`` itself for 0)."""
    return name if chunk == 0 else '%s%s%d' % (name, CHUNK_INFIX, chunk)


def input_names(count):
    """The names of a network's ``count`` inputs, as ``HybridBlock.export``
    gives them: ``['data']``, or ``['data0', 'data1', ...]``."""
    if count == 1:
        return [DATA_NAME]
    return ['%s%d' % (DATA_NAME, i) for i in range(count)]


PREDICTION_PREFIX = 'mp_prediction'    # a network output, while its loss head is built


def prediction_name(index):
    """The variable that stands for the network's output ``index`` while its
    loss head is built."""
    return '%s%d' % (PREDICTION_PREFIX, index)


OTHER_OUTPUT_PREFIX = 'output'         # the BlockGrad of an output the loss does not read


def other_output_name(index):
    """The ``BlockGrad`` through which a training graph keeps the network's
    output ``index`` that its loss does not read (``'output1'``)."""
    return '%s%d' % (OTHER_OUTPUT_PREFIX, index)


def other_output_index(name):
    """``'output1'`` -> 1 (the inverse of :func:`other_output_name`); ``None``
    for another name."""
    rest = name[len(OTHER_OUTPUT_PREFIX):] if name.startswith(OTHER_OUTPUT_PREFIX) else ''
    return int(rest) if rest.isdigit() else None
