"""A detector's box suppression, left out of the exported graph and done by
:func:`suppress` on the runtime's outputs.

MXNet's ``_contrib_box_nms`` (GluonCV's YOLOv3 and SSD) suppresses, by
default, within each class only (``force_suppress=False`` with an
``id_index``), keeps the ``topk`` best boxes above ``valid_thresh``, sorts the
kept ones by score in front and fills the other rows with -1. ONNX's
``NonMaxSuppression`` returns selected indices per class of a
``(batch, classes, boxes)`` score tensor, orders boxes of equal score by its
own rule and computes its IoU in another order of operations; rebuilding
MXNet's layout from it takes a sort, a scatter and a second sort, and its
result would equal MXNet's only where no two scores tie and no IoU lies
within rounding of the threshold. So the export cuts the graph at the
suppression: the ONNX file (and the MXNet pair) end at the decoded boxes and
scores, which verification compares with the checkpoint like any output,
and :func:`suppress` runs the rest of the graph in numpy, operation for
operation as MXNet 1.9.1's CPU kernels do (``box_nms``, the ``slice_axis``
that cut its rows and columns, ``BlockGrad``/``identity``).

:func:`split_suppression` makes the cut; the ``spec`` it returns is what the
export records in the ONNX file's ``metadata_props`` (key
:data:`METADATA_KEY`), so that ``suppress(session.run(None, feed),
'model.onnx')`` gives the network's own outputs; :func:`check_suppression`
is the export's check of :func:`suppress` against MXNet's own ops.

Reference: MXNet 1.9.1 ``src/operator/contrib/bounding_box-inl.h``
(``BoxNMSForward``, ``FilterScores``, ``nms_assign``, ``corner_to_center``,
``center_to_corner``) and ``bounding_box-common.h`` (``Intersect``,
``nms_impl``).
"""
import json

import numpy as np

__all__ = ['suppress', 'split_suppression', 'box_nms', 'METADATA_KEY']

METADATA_KEY = 'suppression'
SUPPRESSION_OPS = ('_contrib_box_nms', '_contrib_nms', 'box_nms')
# What may follow a suppression in the part of the graph suppress() runs.
TAIL_OPS = SUPPRESSION_OPS + ('slice_axis', 'BlockGrad', 'identity', '_copy')
FORMAT = 'mxnet-box-suppression/1'

_BOX_NMS_DEFAULTS = {'overlap_thresh': 0.5, 'valid_thresh': 0.0, 'topk': -1, 'coord_start': 2,
                     'score_index': 1, 'id_index': -1, 'background_id': -1,
                     'force_suppress': False, 'in_format': 'corner', 'out_format': 'corner'}


def _flag(value):
    return str(value) in ('True', 'true', '1')


def box_nms_params(attrs):
    """MXNet's ``box_nms`` attributes (strings, as a symbol's JSON holds
    them) as typed values, MXNet's defaults where absent."""
    params = dict(_BOX_NMS_DEFAULTS)
    for key, value in (attrs or {}).items():
        if key not in params:
            continue
        default = _BOX_NMS_DEFAULTS[key]
        if isinstance(default, bool):
            params[key] = _flag(value)
        elif isinstance(default, int):
            params[key] = int(value)
        elif isinstance(default, float):
            params[key] = float(value)
        else:
            params[key] = str(value)
    return params


def _intersect(a1, a2, b1, b2, corner):
    """MXNet's ``Intersect`` along one axis (float32, in its order)."""
    if corner:
        left = np.where(a1 > b1, a1, b1)
        right = np.where(a2 < b2, a2, b2)
    else:
        aw, bw = a2 / np.float32(2), b2 / np.float32(2)
        al, ar, bl, br = a1 - aw, a1 + aw, b1 - bw, b1 + bw
        left = np.where(bl > al, bl, al)
        right = np.where(br < ar, br, ar)
    w = right - left
    return np.where(w > 0, w, np.zeros_like(w))


def _area(box, corner):
    width, height = (box[2] - box[0], box[3] - box[1]) if corner else (box[2], box[3])
    return np.float32(0) if width < 0 or height < 0 else width * height


def box_nms(data, overlap_thresh=0.5, valid_thresh=0.0, topk=-1, coord_start=2, score_index=1,
            id_index=-1, background_id=-1, force_suppress=False, in_format='corner',
            out_format='corner'):
    """MXNet 1.9.1's ``contrib.box_nms`` on the CPU, in numpy.

    Per batch (every axis but the last two): the boxes whose score is above
    ``valid_thresh`` (and, with an ``id_index``, whose class is not
    ``background_id``, -1 by default) are sorted by score,
    descending, boxes of equal score in their input order; the first
    ``topk`` of them are suppressed greedily (a box is dropped when its IoU
    with a better box kept before it is above ``overlap_thresh``; only
    within its class unless ``force_suppress`` or ``id_index`` is -1); the
    kept rows come first, in that order, and every other row is -1.

    Args:
        data: ``(..., boxes, width)`` float array, as MXNet's.
        Others: MXNet's attributes of the same names.

    Returns:
        An array of ``data``'s shape and dtype.
    """
    data = np.asarray(data)
    shape = data.shape
    if data.ndim < 2:
        raise ValueError('box_nms: expected boxes of shape (..., boxes, width), found shape %s'
                         % (shape,))
    dtype = data.dtype
    boxes = data.reshape((-1,) + shape[-2:])
    num = shape[-2]
    k = num if topk < 0 else min(num, topk)
    if k < 1:
        return data.copy()
    corner = in_format == 'corner'
    thresh = np.float32(overlap_thresh)
    out = np.full_like(boxes, -1)
    for b, rows in enumerate(boxes):
        scores = rows[:, score_index]
        valid = scores > np.float32(valid_thresh)
        if id_index >= 0:  # MXNet drops the class background_id, -1 by default
            valid &= rows[:, id_index] != background_id
        index = np.flatnonzero(valid)
        index = index[np.argsort(-scores[index], kind='stable')][:k]
        coords = rows[:, coord_start:coord_start + 4]
        ids = (np.trunc(rows[:, id_index]).astype(np.int64) if id_index >= 0 and not
               force_suppress else None)
        areas = {int(i): _area(coords[i], corner) for i in index}
        kept = np.ones(len(index), dtype=bool)
        with np.errstate(invalid='ignore', divide='ignore'):
            for r in range(len(index)):
                if not kept[r]:
                    continue
                ref = index[r]
                later = np.arange(r + 1, len(index))
                later = later[kept[later]]
                if ids is not None:
                    later = later[ids[index[later]] == ids[ref]]
                if not len(later):
                    continue
                pos = index[later]
                a, c = coords[ref], coords[pos]
                inter = _intersect(a[0], a[2], c[:, 0], c[:, 2], corner)
                inter = inter * _intersect(a[1], a[3], c[:, 1], c[:, 3], corner)
                union = np.array([areas[int(p)] for p in pos], dtype=dtype)
                iou = inter / (areas[int(ref)] + union - inter)
                kept[later[iou > thresh]] = False
        chosen = index[kept]
        out[b, :len(chosen)] = rows[chosen]
    if in_format != out_format:
        c = out[..., coord_start:coord_start + 4]
        todo = c[..., 0] >= 0  # MXNet converts no row whose first coordinate is below 0
        x0, x1, x2, x3 = (c[..., i].copy() for i in range(4))
        two = np.asarray(2, dtype)
        if out_format == 'center':
            new = ((x0 + x2) / two, (x1 + x3) / two, x2 - x0, x3 - x1)
        else:
            new = (x0 - x2 / two, x1 - x3 / two, x0 + x2 / two, x1 + x3 / two)
        for i, value in enumerate(new):
            c[..., i] = np.where(todo, value, c[..., i])
    return out.reshape(shape)


def _slice_axis(data, attrs):
    axis = int(attrs.get('axis'))
    begin = int(attrs.get('begin', 0))
    end = attrs.get('end', 'None')
    end = None if end in (None, 'None') else int(end)
    index = [slice(None)] * data.ndim
    index[axis] = slice(begin, end)
    return data[tuple(index)]


def _run(op, attrs, value):
    if op in SUPPRESSION_OPS:
        return box_nms(value, **box_nms_params(attrs))
    if op == 'slice_axis':
        return _slice_axis(value, attrs)
    return value  # BlockGrad, identity, _copy


def suppression_note(spec, onnx_name):
    """The line the export prints for a graph cut before its suppression."""
    ops = sorted(set(n['op'] for n in spec['nodes'] if n['op'] in SUPPRESSION_OPS))
    return ('note: %s left out: the export ends at %s; export.suppress(outputs, %r) gives '
            'the network\'s %d outputs from a runtime\'s'
            % (', '.join(ops), ', '.join(spec['inputs']), onnx_name, len(spec['outputs'])))


def read_spec(spec):
    """``spec`` as a dict: given one, a JSON string, or the path of an ONNX
    file whose ``metadata_props`` hold it (under :data:`METADATA_KEY`)."""
    if isinstance(spec, dict):
        return spec
    text = spec
    if isinstance(spec, str) and spec.endswith('.onnx'):
        import onnx
        model = onnx.load(spec, load_external_data=False)
        props = {p.key: p.value for p in model.metadata_props}
        if METADATA_KEY not in props:
            raise ValueError('%s: expected an export of a detector (metadata_props %r), found '
                             'none: its outputs need no suppression' % (spec, METADATA_KEY))
        text = props[METADATA_KEY]
    spec = json.loads(text)
    if spec.get('format') != FORMAT:
        raise ValueError('expected a suppression of format %r, found %r'
                         % (FORMAT, spec.get('format')))
    return spec


def suppress(outputs, spec):
    """The network's outputs from the exported graph's: the suppression
    the export left out, run on a runtime's outputs.

    Args:
        outputs: The exported graph's outputs, in order (onnxruntime's
            ``session.run(None, feed)``, ``LoadedModel.predict``'s tuple or
            array).
        spec: The ``.onnx`` file's path, or the spec
            :func:`split_suppression` returned (a dict or its JSON).

    Returns:
        A list of numpy arrays: the outputs the checkpoint's graph gives
        (YOLOv3 and SSD: ids, scores and boxes, each ``(batch, post_nms,
        .)``), as MXNet's CPU ops compute them from these inputs.

    Raises:
        ValueError: ``spec`` holds no suppression, or ``outputs`` are not as
            many as the graph's.
    """
    spec = read_spec(spec)
    if isinstance(outputs, np.ndarray) or not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    outputs = [np.asarray(o) for o in outputs]
    if len(outputs) != len(spec['inputs']):
        raise ValueError('suppress: expected the %d outputs of the exported graph (%s), found %d'
                         % (len(spec['inputs']), ', '.join(spec['inputs']), len(outputs)))
    values = {}

    def value(ref):
        kind, index = ref[0], ref[1]
        return outputs[index] if kind == 'input' else values[index]

    for i, node in enumerate(spec['nodes']):
        values[i] = _run(node['op'], node.get('attrs', {}), value(node['input']))
    return [value(ref) for ref in spec['outputs']]


def split_suppression(symbol):
    """``symbol`` cut before its box suppression.

    Args:
        symbol: An inference symbol.

    Returns:
        ``(body, spec)``: ``body`` the symbol whose outputs are what the
        suppression and the ops after it read (the decoded boxes and
        scores), ``spec`` what :func:`suppress` runs on them to give
        ``symbol``'s outputs; ``(symbol, None)`` for a graph without one.

    Raises:
        ExportError: an op after a suppression that :func:`suppress` does not
            run, or an output that reads one only in part.
    """
    import mxnet as mx
    from mp_symbolic.core.graph.ir import PlacedGraph
    from .converters import refusal

    graph = PlacedGraph.from_symbol(symbol)
    nodes = graph.nodes
    if not any(n.op in SUPPRESSION_OPS for n in nodes):
        return symbol, None
    tail = set()
    for node in nodes:  # nodes are in topological order
        if node.op in SUPPRESSION_OPS or any(e.node in tail for e in node.inputs):
            tail.add(node.index)
    for i in sorted(tail):
        node = nodes[i]
        if node.op not in TAIL_OPS:
            raise refusal(node.op, node, 'expected only %s after a box suppression (the '
                          'export ends the graph before it), found %s'
                          % (', '.join(TAIL_OPS[len(SUPPRESSION_OPS):]), node.op))
        if len(node.inputs) != 1:
            raise refusal(node.op, node, 'expected one input after a box suppression, '
                          'found %d' % len(node.inputs))
    internals = symbol.get_internals()
    names = internals.list_outputs()
    inputs, body = [], []   # body entries the tail or an output reads, in graph order

    def body_ref(entry):
        key = (entry[0], entry[1])
        if key not in inputs:
            inputs.append(key)
        return ['input', inputs.index(key)]

    spec_nodes, position = [], {}
    for i in sorted(tail):
        node = nodes[i]
        entry = node.inputs[0]
        ref = ['node', position[entry[0]]] if entry[0] in tail else body_ref(entry)
        position[i] = len(spec_nodes)
        spec_nodes.append({'op': node.op, 'name': node.name, 'input': ref,
                           'attrs': {k: v for k, v in node.attrs.items()
                                     if not k.startswith('__')}})
    outputs = []
    for head in graph.heads:
        if head[0] in tail:
            if head[1] != 0:
                raise refusal(nodes[head[0]].op, nodes[head[0]],
                              'expected only the first output of a box suppression as an output')
            outputs.append(['node', position[head[0]]])
        else:
            outputs.append(body_ref(head))
    order = sorted(range(len(inputs)), key=lambda k: inputs[k])  # graph order
    remap = {old: new for new, old in enumerate(order)}
    for ref in [n['input'] for n in spec_nodes] + outputs:
        if ref[0] == 'input':
            ref[1] = remap[ref[1]]
    inputs = [inputs[k] for k in order]
    for node_id, index in inputs:
        node = nodes[node_id]
        candidates = [n for n in ('%s_output%d' % (node.name, index),)
                      + (('%s_output' % node.name,) if index == 0 else ()) if n in names]
        if node.is_variable or not candidates:
            raise refusal(node.op, node, 'expected a box suppression to read an op\'s output')
        body.append(internals[candidates[0]])
    spec = {'format': FORMAT, 'inputs': [s.list_outputs()[0] for s in body],
            'nodes': spec_nodes, 'outputs': outputs}
    return (body[0] if len(body) == 1 else mx.sym.Group(body)), spec


def _mxnet_tail(spec, outputs):
    """The spec's ops run by MXNet's own operators (the reference of
    :func:`suppress`)."""
    import mxnet as mx
    values = {}

    def value(ref):
        return mx.nd.array(outputs[ref[1]], dtype=outputs[ref[1]].dtype) \
            if ref[0] == 'input' else values[ref[1]]

    for i, node in enumerate(spec['nodes']):
        x = value(node['input'])
        if node['op'] in SUPPRESSION_OPS:
            values[i] = mx.nd.contrib.box_nms(x, **node['attrs'])
        elif node['op'] == 'slice_axis':
            values[i] = mx.nd.slice_axis(x, **node['attrs'])
        else:
            values[i] = x
    return [value(ref).asnumpy() for ref in spec['outputs']]


def overlapping(spec, outputs, seed=0):
    """``outputs`` with each suppression's boxes moved to overlap: per
    batch, the best-scoring ``topk`` boxes but the best one onto the best
    box (made a box of positive extent), jittered by 1% of the boxes'
    extent, scored from 0.99 to 0.5 of the best's way above
    ``valid_thresh``, their classes alternately another than the best's
    and the best's, so that boxes overlap within and across classes."""
    rng = np.random.default_rng(seed)
    moved = [np.array(o, copy=True) for o in outputs]
    for node in spec['nodes']:
        if node['op'] not in SUPPRESSION_OPS or node['input'][0] != 'input':
            continue
        p = box_nms_params(node['attrs'])
        data = moved[node['input'][1]]
        rows = data.reshape((-1,) + data.shape[-2:])
        coords = slice(p['coord_start'], p['coord_start'] + 4)
        scale = max(float(np.abs(rows[..., coords]).max()), 1.0)
        k = rows.shape[1] if p['topk'] < 0 else min(rows.shape[1], p['topk'])
        for batch in rows:
            best = np.argsort(-batch[:, p['score_index']], kind='stable')[:k]
            box = batch[best[0], coords].astype(np.float64)
            if p['in_format'] == 'corner':
                low, high = np.minimum(box[:2], box[2:]), np.maximum(box[:2], box[2:])
                box = np.concatenate([low, np.maximum(high, low + 0.1 * scale)])
            else:
                box[2:] = np.maximum(np.abs(box[2:]), 0.1 * scale)
            near = best[1:]
            batch[best[0], coords] = box
            batch[near, coords] = box + rng.normal(0, 0.01 * scale, size=(len(near), 4))
            top = batch[best[0], p['score_index']]
            if top > p['valid_thresh']:  # each above the threshold, below the best
                low = max(p['valid_thresh'], 0.0)
                batch[near, p['score_index']] = low + (top - low) * np.linspace(
                    0.99, 0.5, len(near))
            if p['id_index'] >= 0:
                own = np.trunc(batch[best[0], p['id_index']])  # as MXNet reads a class
                batch[near, p['id_index']] = np.where(np.arange(len(near)) % 2 == 0,
                                                      own + 1 if own >= 0 else 0, own)
    return moved


def check_suppression(onnx_path, spec, shapes, dtypes=None, batch_size=2, seed=0):
    """Whether :func:`suppress` equals MXNet's own ops on what onnxruntime
    outputs, as it is and moved to overlap (:func:`overlapping`).

    Args:
        onnx_path: The exported ONNX file.
        spec: Its suppression (:func:`split_suppression`).
        shapes: ``{input name: per-sample shape}``; ``dtypes`` their
            numpy dtypes (float32 where not given).

    Returns:
        A verification check: ``{'name', 'ok', 'detail'}``.
    """
    from collections import OrderedDict
    import onnxruntime as ort
    rng = np.random.default_rng(seed)
    feed = {}
    for name, shape in shapes.items():
        dtype = np.dtype((dtypes or {}).get(name, np.float32))
        size = (batch_size,) + tuple(shape)
        feed[name] = (rng.normal(size=size).astype(dtype) if dtype.kind == 'f'
                      else np.zeros(size, dtype))
    session = ort.InferenceSession(onnx_path, providers=['CPUExecutionProvider'])
    outputs = session.run(None, feed)
    del session
    differ = []
    for what, given in (('as it is', outputs), ('moved to overlap', overlapping(spec, outputs))):
        ours, theirs = suppress(given, spec), _mxnet_tail(spec, given)
        if not all(a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
                   for a, b in zip(ours, theirs)):
            differ.append(what)
    kept = int(sum((o[..., 0] >= 0).sum() for o in suppress(outputs, spec)[:1]))
    detail = ('export.suppress %s MXNet\'s %s on onnxruntime\'s outputs at batch %d, as they '
              'are and moved to overlap within and across classes%s'
              % ('differs from' if differ else 'equals', ', '.join(
                  sorted(set(n['op'] for n in spec['nodes']))), batch_size,
                 ' (%s)' % ', '.join(differ) if differ else ' (%d rows kept)' % kept))
    return OrderedDict([('name', 'suppression'), ('ok', not differ), ('detail', detail)])
