"""GluonCV's detectors exported from a checkpoint split over two devices:
YOLOv3 and SSD end at their decoded boxes and scores, and
``export.suppress`` does MXNet's ``box_nms`` (and the slices after it) on
the runtime's outputs; CenterNet, which suppresses by a max pool inside its
graph, exports whole.

Random weights at 128x128, each network's heads scaled to a trained
network's range (scores that do not all saturate to one value). One export
per detector for the module.
"""
import mxnet as mx
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import mp_symbolic
from mp_symbolic import Pipeline

import export
from export.exporter import export_checkpoint
from export.suppression import box_nms, box_nms_params, read_spec, suppress
from export.verify import within_tolerance

from bench.networks import random_detector

pytest.importorskip('gluoncv.model_zoo')

SIZE = 128
TOLERANCE = 1e-4


# the test's kinds: bench.networks.random_detector's networks
NAMES = {'yolo3': 'yolo3_mobilenet1.0_voc', 'ssd': 'ssd_512_resnet18_v1_voc',
         'centernet': 'center_net_resnet18_v1b_voc'}


def _network(kind):
    """A GluonCV detector of random weights whose scores are spread."""
    return random_detector(NAMES[kind], SIZE, yolo_scale=1e6)


def _inputs(n, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 3, SIZE, SIZE)).astype(np.float32)


@pytest.fixture(scope='module', params=['yolo3', 'ssd', 'centernet'])
def detector(request, tmp_path_factory):
    """The detector split over cpu:0 and cpu:1, saved by
    mp_symbolic.save_checkpoint and exported; its one-device outputs."""
    kind = request.param
    net = _network(kind)
    x = _inputs(1)
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=x)
    mod = pipe.module(loss=None)
    mod.bind(data_shapes=[('data', x.shape)], for_training=False)
    values = {n: p.data().copy() for n, p in net.collect_params().items()}
    args = set(mod.symbol.list_arguments())
    mod.init_params(arg_params={n: v for n, v in values.items() if n in args},
                    aux_params={n: v for n, v in values.items() if n not in args})
    folder = str(tmp_path_factory.mktemp(kind))
    mp_symbolic.save_checkpoint(mod, folder, epoch=0, name=kind)
    out = str(tmp_path_factory.mktemp(kind + '-export'))
    lines = []
    paths, report = export_checkpoint(folder, out, log=lines.append, verify_batches=[1, 2])
    batch = _inputs(2, seed=1)
    expected = [o.asnumpy() for o in net(mx.nd.array(batch))]
    return {'kind': kind, 'paths': paths, 'report': report, 'lines': lines,
            'batch': batch, 'expected': expected}


def _session(path):
    return ort.InferenceSession(path, providers=['CPUExecutionProvider'])


def _metadata(path):
    return {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}


def _iou(a, b):
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union if union > 0 else 0.0


def _mxnet_tail(spec, outputs):
    """The spec's ops run by MXNet's own operators."""
    values = {}

    def value(ref):
        return mx.nd.array(outputs[ref[1]]) if ref[0] == 'input' else values[ref[1]]

    for i, node in enumerate(spec['nodes']):
        x = value(node['input'])
        attrs = node['attrs']
        if node['op'] == '_contrib_box_nms':
            values[i] = mx.nd.contrib.box_nms(x, **attrs)
        elif node['op'] == 'slice_axis':
            values[i] = mx.nd.slice_axis(x, **attrs)
        else:
            values[i] = x
    return [value(ref).asnumpy() for ref in spec['outputs']]


# -- box_nms in numpy, against MXNet's ---------------------------------------

def _boxes(rng, batch, num, classes, corner=True, tied=False):
    """Boxes on a coarse grid (many overlaps, within and across classes), ids
    in [-1, classes), scores distinct or from a few values (ties)."""
    ids = rng.integers(-1, classes, size=(batch, num, 1)).astype(np.float32)
    scores = (rng.choice([0.0, 0.1, 0.3, 0.5, 0.9], size=(batch, num, 1)) if tied
              else rng.random((batch, num, 1))).astype(np.float32)
    xy = rng.integers(-2, 8, size=(batch, num, 2)).astype(np.float32) * 0.5
    wh = rng.integers(0, 8, size=(batch, num, 2)).astype(np.float32) * 0.5
    coords = np.concatenate([xy, xy + wh] if corner else [xy, wh], -1)
    return np.concatenate([ids, scores, coords], -1)


def test_box_nms_equals_mxnet_box_nms_on_boxes_overlapping_within_and_across_classes():
    rng = np.random.default_rng(0)
    suppressed_within = kept_across = 0
    for trial in range(200):
        corner = trial % 3 != 0
        data = _boxes(rng, int(rng.integers(1, 4)), int(rng.integers(1, 40)), 3, corner,
                      tied=trial % 2 == 1)
        attrs = {'overlap_thresh': str(rng.choice([0.1, 0.3, 0.5, 1 / 3])),
                 'valid_thresh': str(rng.choice([0.0, 0.2, 0.01])),
                 'topk': str(rng.choice([-1, 5, 400])),
                 'id_index': str(rng.choice([-1, 0])),
                 'background_id': str(rng.choice([-1, 0])),
                 'force_suppress': str(bool(rng.integers(2))),
                 'in_format': 'corner' if corner else 'center',
                 'out_format': str(rng.choice(['corner', 'center']))}
        expected = mx.nd.contrib.box_nms(mx.nd.array(data), coord_start=2, score_index=1,
                                         **attrs).asnumpy()
        got = box_nms(data, **box_nms_params(attrs))
        assert got.dtype == expected.dtype and np.array_equal(got, expected), (trial, attrs)
        if corner and attrs['id_index'] == '0' and attrs['force_suppress'] == 'False':
            valid = (data[..., 1] > float(attrs['valid_thresh'])) & (data[..., 0] != -1)
            suppressed_within += int(valid.sum() - (got[..., 1] >= 0).sum())
            for rows in got:
                rows = rows[rows[:, 1] >= 0]
                kept_across += sum(rows[i, 0] != rows[j, 0] and
                                   _iou(rows[i, 2:], rows[j, 2:]) > 0.5
                                   for i in range(len(rows)) for j in range(i))
    assert suppressed_within > 0 and kept_across > 0  # both cases were there


def test_box_nms_orders_equal_scores_as_mxnet_among_thousands():
    rng = np.random.default_rng(1)
    data = _boxes(rng, 2, 3000, 20, tied=True)
    attrs = {'overlap_thresh': '0.45', 'valid_thresh': '0.01', 'topk': '400', 'id_index': '0',
             'force_suppress': 'False'}
    expected = mx.nd.contrib.box_nms(mx.nd.array(data), **attrs).asnumpy()
    assert np.array_equal(box_nms(data, **box_nms_params(attrs)), expected)


# -- the detectors -----------------------------------------------------------

@pytest.mark.slow
def test_detector_exports_from_a_two_device_checkpoint_and_verifies(detector):
    report = detector['report']
    assert report['ok']
    assert report['source']['trained_devices'] == ['cpu:0', 'cpu:1']
    outputs = _session(detector['paths']['onnx']).get_outputs()
    if detector['kind'] == 'centernet':   # no box_nms: the whole graph
        assert 'suppression' not in report and len(outputs) == 3
    else:   # one output: (batch, boxes, 6) decoded, before the suppression
        spec = read_spec(_metadata(detector['paths']['onnx'])['suppression'])
        assert report['suppression'] == spec
        assert [o.shape[-1] for o in outputs] == [6] and len(spec['outputs']) == 3
        assert [n['op'] for n in spec['nodes']][0] == '_contrib_box_nms'
        (check,) = [c for c in report['checks'] if c['name'] == 'suppression']
        assert check['ok'] and 'moved to overlap within and across classes' in check['detail']
        assert any(line.strip().startswith('[ok] suppression: export.suppress equals') for line in
                   detector['lines'])
        assert any(line.startswith('note: _contrib_box_nms left out') for line in
                   detector['lines'])


@pytest.mark.slow
def test_onnxruntime_after_suppress_equals_the_networks_outputs_on_one_device(detector):
    onnx_path = detector['paths']['onnx']
    decoded = _session(onnx_path).run(None, {'data': detector['batch']})
    got = decoded if detector['kind'] == 'centernet' else suppress(decoded, onnx_path)
    expected = detector['expected']
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected):
        assert within_tolerance(g, e, TOLERANCE)[0], np.abs(g - e).max()
    if detector['kind'] != 'centernet':
        ids, scores = expected[0][..., 0], expected[1][..., 0]
        assert (scores > 0).sum() > 10   # boxes were kept, of several classes
        assert len(np.unique(ids[scores > 0])) > 1


def test_suppress_equals_mxnet_on_decoded_boxes_moved_to_overlap_within_and_across_classes(
        detector):
    if detector['kind'] == 'centernet':
        pytest.skip('CenterNet has no box_nms')
    onnx_path = detector['paths']['onnx']
    spec = read_spec(onnx_path)
    (decoded,) = _session(onnx_path).run(None, {'data': detector['batch']})
    rng = np.random.default_rng(2)
    moved = decoded.copy()
    best = np.argsort(-moved[..., 1], axis=1)[:, :300]    # the boxes topk keeps
    for b in range(moved.shape[0]):
        rows = best[b]
        anchor = moved[b, rows[0], 2:6]
        # a third of them onto the best box, jittered: overlaps within and across classes
        near = rows[::3]
        moved[b, near, 2:6] = anchor + rng.normal(0, 2, size=(len(near), 4)).astype(np.float32)
        moved[b, near, 0] = rng.integers(0, 3, size=len(near)).astype(np.float32)
    expected = _mxnet_tail(spec, [moved])
    got = suppress([moved], spec)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and np.array_equal(g, e)
    ids, boxes = expected[0][..., 0], expected[2]
    kept = expected[1][..., 0] > 0

    def pairs(b, rows, row_ids, same):
        return [(i, j) for i in rows for j in rows if i < j and
                (row_ids[i] == row_ids[j]) == same and _iou(boxes_of[i], boxes_of[j]) > 0.45]

    across = within_before = 0
    for b in range(len(ids)):
        boxes_of, rows = boxes[b], np.flatnonzero(kept[b])
        assert not pairs(b, rows, ids[b], True)   # suppressed within a class
        across += len(pairs(b, rows, ids[b], False))   # kept across classes
        boxes_of, near = moved[b, :, 2:6], best[b][::3]
        within_before += len(pairs(b, near, moved[b, :, 0], True))
    assert across and within_before   # both cases were there


# -- CenterNet: why its saturated heatmap did not verify ---------------------

def test_mxnet_topk_orders_equal_values_otherwise_than_onnx_topk():
    """With random weights CenterNet's heatmap is exactly 1.0 at over a
    thousand positions, and its ``topk`` picks 40 of them: MXNet's order of
    equal values is its sort's, ONNX's TopK takes the lowest indices first;
    so equal scores came with other boxes."""
    values = np.ones((1, 81920), np.float32)
    mxnet_indices = mx.nd.topk(mx.nd.array(values), k=10, ret_typ='indices').asnumpy()
    node = onnx.helper.make_node('TopK', ['x', 'k'], ['v', 'i'], axis=-1)
    graph = onnx.helper.make_graph(
        [node], 'topk', [onnx.helper.make_tensor_value_info('x', onnx.TensorProto.FLOAT,
                                                            [1, 81920])],
        [onnx.helper.make_tensor_value_info('v', onnx.TensorProto.FLOAT, [1, 10]),
         onnx.helper.make_tensor_value_info('i', onnx.TensorProto.INT64, [1, 10])],
        [onnx.helper.make_tensor('k', onnx.TensorProto.INT64, [1], [10])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid('', 13)])
    model.ir_version = 7
    onnx_indices = ort.InferenceSession(model.SerializeToString(),
                                        providers=['CPUExecutionProvider']).run(
                                            None, {'x': values})[1]
    assert onnx_indices.tolist() == [list(range(10))]
    assert mxnet_indices.astype(np.int64).tolist() != onnx_indices.tolist()


@pytest.mark.slow
def test_suppress_refuses_an_export_without_a_suppression(detector):
    if detector['kind'] != 'centernet':
        pytest.skip('a detector with box_nms')
    with pytest.raises(ValueError, match='its outputs need no suppression'):
        suppress([np.zeros((1, 40))], detector['paths']['onnx'])
    assert export.suppress is suppress
