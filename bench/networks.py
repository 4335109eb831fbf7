"""``python -m bench.networks [--only NAME,...] [--quick]``: real GluonCV and
GluonNLP networks (random weights, nothing downloaded) on every route, one
row each.

Each network, batch 4 split over ``cpu:0,cpu:1`` with chunks 2:

- **split**: the inference Module's outputs against the network on one
  device (largest ``|difference|`` over every output);
- **1F1B = GPipe**: three SGD steps (momentum 0.9) under ``'1f1b'`` (the
  stage runtime) and under ``'gpipe'`` (the one graph), the largest
  ``|difference|`` of the parameters and of the running statistics;
- **deferred**: ``Pipeline(..., batchnorm='deferred')``'s running
  statistics after one step against one device's on the whole batch, over
  every BatchNorm and over the first;
- **export**: ``python -m export`` on the GPipe run's parameters, saved by
  :func:`mp_symbolic.save_checkpoint` (``verification: PASSED`` or
  ``FAILED``, or its ``error:`` line);
- **predict**: ``export.load_model(...).predict`` (then
  ``export.suppress`` for a graph exported before its box suppression)
  against the network on one device with the same parameters.

FCN is trained through the command line (``python -m mp_symbolic train
--task bench.fcn_task``) under both schedules, and its training folder is
exported. YOLOv3's prediction layers' weights are drawn with deviation
``MP_YOLO_SCALE`` (default 1e6, which spreads its scores). Each network runs in a child process of its own with a time limit
(``--timeout``): a crash or a timeout is a row. ``--quick``: one small
network's sizes (and a shorter time limit), for a test.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

__all__ = ['NETWORKS', 'random_detector', 'run_row', 'child_row', 'main']

DEVICES = 'cpu:0,cpu:1'
BATCH = 4
CHUNKS = 2
STEPS = 3
LR = 0.01
YOLO_SCALE = float(os.environ.get('MP_YOLO_SCALE', '1e6'))
ROW_PREFIX = 'ROW '
COLUMNS = ('network', 'input', 'split = one device', '1F1B = GPipe params',
           '1F1B = GPipe statistics', 'deferred = whole batch', 'export', 'predict', 'time')


def _set(param, value):
    param.set_data(value.astype(param.dtype))


def _gluoncv(name, **kwargs):
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    from gluoncv import model_zoo
    mx.random.seed(0)
    net = model_zoo.get_model(name, pretrained=False, **kwargs)
    net.initialize(mx.init.Xavier(), force_reinit=True)
    return net


def _images(size, seed=0):
    return np.random.default_rng(seed).normal(size=(BATCH, 3, size, size)).astype(np.float32)


def _classifier(name, size, **kwargs):
    def make(quick):
        side = 32 if quick else size
        net = _gluoncv(name, classes=10, **kwargs)
        labels = np.random.default_rng(1).integers(0, 10, BATCH).astype(np.float32)
        return {'net': net, 'sample': _images(side), 'loss': 'softmax', 'output': None,
                'label': labels, 'input': '%dx%d' % (side, side)}
    return make


DETECTORS = ('yolo3_mobilenet1.0_voc', 'ssd_512_resnet18_v1_voc', 'center_net_resnet18_v1b_voc')


def random_detector(name, size=128, yolo_scale=1e6):
    """The GluonCV detector ``name`` (``'yolo3_mobilenet1.0_voc'``,
    ``'ssd_512_resnet18_v1_voc'`` or ``'center_net_resnet18_v1b_voc'``) of
    random weights (``mx.random.seed(0)``), run once on ``size`` x ``size``
    zeros, its heads scaled so that its scores spread rather than all
    saturate to one value: YOLOv3's prediction weights drawn with deviation
    ``yolo_scale``, SSD's BatchNorm as initialised and its predictors'
    weights times 0.01, CenterNet's heatmap logits near GluonCV's bias of
    -2.19. Raises ValueError for any other ``name``."""
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    if name == 'yolo3_mobilenet1.0_voc':
        net = _gluoncv(name, pretrained_base=False)
        net(mx.nd.zeros((1, 3, size, size)))
        # the prediction layers start at zero, and the features Xavier's weights give
        # them are near 1e-7: weights that spread the logits over about (-2, 2)
        for output in net.yolo_outputs:
            weight = output.prediction.weight
            _set(weight, mx.nd.random.normal(0, yolo_scale, weight.shape))
    elif name == 'ssd_512_resnet18_v1_voc':
        mx.random.seed(0)
        from gluoncv import model_zoo
        net = model_zoo.get_model(name, pretrained=False, pretrained_base=False)
        net.initialize()
        net(mx.nd.zeros((1, 3, size, size)))
        for param_name, param in net.collect_params().items():  # BatchNorm as initialised
            if param_name.endswith(('_gamma', '_running_var', '_moving_var')):
                _set(param, mx.nd.ones(param.shape))
            elif param_name.endswith(('_beta', '_running_mean', '_moving_mean')):
                _set(param, mx.nd.zeros(param.shape))
        for predictor in list(net.class_predictors) + list(net.box_predictors):
            for param in predictor.collect_params().values():
                _set(param, param.data() * 0.01)
    elif name == 'center_net_resnet18_v1b_voc':
        net = _gluoncv(name, pretrained_base=False)
        net(mx.nd.zeros((1, 3, size, size)))
        last = net.heads[0][-1]  # the heatmap's logits near GluonCV's bias of -2.19
        _set(last.weight, last.weight.data() * 0.01)
        _set(last.bias, mx.nd.full(last.bias.shape, -2.19))
    else:
        raise ValueError('expected a detector of %s, found %r' % (', '.join(DETECTORS), name))
    return net


def _detector(kind):
    """:func:`random_detector` at 128x128, YOLOv3's prediction weights drawn
    with deviation :data:`YOLO_SCALE`."""
    def make(quick):  # pylint: disable=unused-argument
        size = 128
        net = random_detector(kind, size, YOLO_SCALE)
        # the loss: L2 on the scores (output 1), towards random targets
        return {'net': net, 'sample': _images(size), 'loss': 'l2', 'output': 1,
                'label': None, 'input': '%dx%d' % (size, size), 'lr': 1e-3}
    return make


def _awd(quick):
    # pylint: disable=import-outside-toplevel
    import gluonnlp
    import mxnet as mx
    # awd_lstm_lm_1150's sizes (embed 400, hidden 1150, three layers, tied), no dropout
    hidden, embed = (24, 16) if quick else (1150, 400)
    vocab, steps = 200, 8
    net = gluonnlp.model.AWDRNN('lstm', vocab_size=vocab, embed_size=embed, hidden_size=hidden,
                                num_layers=3, tie_weights=True, dropout=0, weight_drop=0,
                                drop_h=0, drop_i=0, drop_e=0, prefix='awd_')
    mx.random.seed(0)
    net.initialize(mx.init.Xavier())
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (steps, BATCH)).astype(np.float32)
    states = [[(0.1 * rng.normal(size=(1, BATCH, size))).astype(np.float32) for _ in range(2)]
              for size in (hidden, hidden, embed)]
    labels = rng.integers(0, vocab, (steps, BATCH)).astype(np.float32)
    return {'net': net, 'sample': (x, states), 'loss': 'softmax', 'output': 0, 'label': labels,
            'batch_axis': 1, 'input': 'TN %dx%d, states [h, c] x 3' % (steps, BATCH)}


def _elmo(quick):  # pylint: disable=unused-argument
    # pylint: disable=import-outside-toplevel
    import gluonnlp
    import mxnet as mx
    net, _ = gluonnlp.model.get_model('elmo_2x1024_128_2048cnn_1xhighway', dataset_name=None,
                                      pretrained=False)
    mx.random.seed(0)
    net.initialize(mx.init.Xavier())
    rng = np.random.default_rng(0)
    steps = 6
    x = rng.integers(1, 262, (BATCH, steps, 50)).astype(np.float32)
    states = net.begin_state(mx.nd.zeros, batch_size=BATCH)
    states = [[[(0.1 * rng.normal(size=s.shape)).astype(np.float32) for s in pair]
               for pair in layer] for layer in states] if isinstance(states[0], (list, tuple)) \
        else [(0.1 * rng.normal(size=s.shape)).astype(np.float32) for s in states]
    return {'net': net, 'sample': (x, states), 'loss': 'l2', 'output': 0, 'label': None,
            'input': 'NTC %dx%dx50 chars' % (BATCH, steps)}


def _fcn(quick):
    from bench import fcn_task  # pylint: disable=import-outside-toplevel
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    size = 32 if quick else 64
    net = fcn_task.build_network(size)
    mx.random.seed(0)
    net.initialize(mx.init.Xavier())
    x, y = fcn_task.images(BATCH, size)
    return {'net': net, 'sample': x, 'loss': 'softmax', 'output': None, 'label': y,
            'input': '%dx%d, trained by the command line' % (size, size), 'cli': size}


# name -> make(quick) -> spec
NETWORKS = {
    'mobilenetv2_0.25': _classifier('mobilenetv2_0.25', 64),
    'mobilenetv2_1.0': _classifier('mobilenetv2_1.0', 64),
    'mobilenetv3_small': _classifier('mobilenetv3_small', 64),
    'resnet18_v1b': _classifier('resnet18_v1b', 64),
    'resnet50_v1b': _classifier('resnet50_v1b', 64),
    'densenet121': _classifier('densenet121', 224),
    'inceptionv3': _classifier('inceptionv3', 299),
    'squeezenet1.1': _classifier('squeezenet1.1', 224),
    'yolo3_mobilenet1.0_voc': _detector('yolo3_mobilenet1.0_voc'),
    'ssd_512_resnet18_v1_voc': _detector('ssd_512_resnet18_v1_voc'),
    'center_net_resnet18_v1b_voc': _detector('center_net_resnet18_v1b_voc'),
    'fcn_resnet50_voc': _fcn,
    'awd_lstm_lm_1150': _awd,
    'elmo_2x1024_128_2048cnn_1xhighway': _elmo,
}


# -- one row, in the child ----------------------------------------------------

def _flat(nested):
    if isinstance(nested, (list, tuple)):
        return [a for part in nested for a in _flat(part)]
    return [nested]


def _nd(nested):
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    if isinstance(nested, (list, tuple)):
        return [_nd(part) for part in nested]
    return mx.nd.array(nested)


def _one_device(net, sample):
    out = net(*_nd(sample)) if isinstance(sample, tuple) else net(_nd(sample))
    return [o.asnumpy() for o in _flat(out)]


def _max_diff(ours, theirs):
    if len(ours) != len(theirs):
        raise ValueError('expected %d outputs, found %d' % (len(theirs), len(ours)))
    diffs = []
    for a, b in zip(ours, theirs):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            raise ValueError('expected an output of shape %s, found %s' % (b.shape, a.shape))
        diffs.append(float(np.abs(a.astype(np.float64) - b).max()) if a.size else 0.0)
    return max(diffs)


def _pipeline(spec, schedule='gpipe', chunks=CHUNKS, devices=DEVICES, **kwargs):
    from mp_symbolic import Pipeline  # pylint: disable=import-outside-toplevel
    sample = spec['sample']
    if 'batch_axis' in spec:
        kwargs['batch_axis'] = spec['batch_axis']
    return Pipeline(spec['net'], devices, sample=sample, chunks=chunks, schedule=schedule,
                    **kwargs)


def _split_values(mod, values):
    args = set(mod.symbol.list_arguments())
    return ({n: v for n, v in values.items() if n in args},
            {n: v for n, v in values.items() if n not in args})


def _inference(spec, pipe, values):
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    leaves = _flat(spec['sample'])
    mod = pipe.module(loss=None)
    mod.bind(list(zip(pipe.input_names, [a.shape for a in leaves])), for_training=False)
    arg, aux = _split_values(mod, values)
    mod.init_params(arg_params=arg, aux_params=aux)
    mod.forward(mx.io.DataBatch([mx.nd.array(a) for a in leaves]), is_train=False)
    return mod


def _training_module(spec, values, pipe):
    """``(module, batch)``: ``pipe``'s Module of the spec's loss, bound and
    holding ``values``, and its batch (L2 towards random targets the shape
    of the output where the spec gives no label)."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    leaves = _flat(spec['sample'])
    output = spec['output']
    if output is not None and output < 0:
        output += len(spec['expected'])
    mod = pipe.module(loss=spec['loss'], output=output)
    label = spec['label']
    if label is None:
        target = spec['expected'][output or 0]
        label = np.random.default_rng(2).normal(size=target.shape).astype(np.float32)
    mod.bind(list(zip(pipe.input_names, [a.shape for a in leaves])),
             [('softmax_label', label.shape)])
    arg, aux = _split_values(mod, values)
    mod.init_params(arg_params=arg, aux_params=aux)
    return mod, mx.io.DataBatch([mx.nd.array(a) for a in leaves], [mx.nd.array(label)])


def _train(spec, values, schedule, chunks):
    """Parameters and running statistics after :data:`STEPS` SGD steps."""
    mod, batch = _training_module(spec, values, _pipeline(spec, schedule, chunks))
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': spec.get('lr', LR),
                                                         'momentum': 0.9})
    for _ in range(STEPS):
        mod.forward_backward(batch)
        mod.update()
    arg, aux = mod.get_params()
    return {k: v.asnumpy() for k, v in arg.items()}, {k: v.asnumpy() for k, v in aux.items()}


def _diff_dicts(ours, theirs):
    if sorted(ours) != sorted(theirs):
        raise ValueError('expected the same names, found %d and %d' % (len(ours), len(theirs)))
    return max([float(np.abs(ours[k] - theirs[k]).max()) for k in theirs] or [0.0])


def _schedules(spec, values):
    """``(params diff, statistics diff, note, gpipe's trained values)``."""
    note = ''
    chunks = CHUNKS
    try:
        gpipe = _train(spec, values, 'gpipe', chunks)
    except Exception as err:  # pylint: disable=broad-except
        text = str(err).strip().splitlines()[0]
        if 'chunks' not in text:
            raise
        note = 'gpipe chunks=2 refused (%s): compared at chunks 1' % text[:120]
        chunks = 1
        gpipe = _train(spec, values, 'gpipe', chunks)
    one_f = _train(spec, values, '1f1b', chunks)
    trained = dict(gpipe[0], **gpipe[1])
    return _diff_dicts(one_f[0], gpipe[0]), _diff_dicts(one_f[1], gpipe[1]), note, trained


def _deferred(spec, values):
    """Largest |difference| of the running statistics after one step under
    ``batchnorm='deferred'`` from one device's on the whole batch: over
    every BatchNorm, and over the first (whose input does not depend on how
    earlier BatchNorms normalised the micro-batches)."""
    stats = []
    for devices, chunks, kwargs in ((DEVICES, CHUNKS, {'batchnorm': 'deferred'}),
                                    ('cpu:0', 1, {})):
        pipe = _pipeline(spec, 'gpipe', chunks, devices, **kwargs)
        mod, batch = _training_module(spec, values, pipe)
        mod.forward_backward(batch)
        stats.append({k: v.asnumpy() for k, v in mod.get_params()[1].items()})
        first = mod.symbol.list_auxiliary_states()[:2]
    return _diff_dicts(stats[0], stats[1]), _diff_dicts(*[{k: d[k] for k in first}
                                                          for d in stats])


def _export(folder, out, sample_file=None):
    """``(cell, ok)``: the export's verification line, or its error line."""
    cmd = [sys.executable, '-m', 'export', '--checkpoint', folder, '--out', out,
           '--verify-batches', '1,%d' % BATCH]
    if sample_file:
        cmd += ['--sample', sample_file]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = (proc.stdout + proc.stderr).splitlines()
    verdict = [l for l in lines if l.startswith('verification:')]
    errors = [l for l in lines if l.startswith('error:')]
    notes = [l for l in lines if l.startswith('note:') and 'left out' in l]
    if proc.returncode == 0 and verdict and 'PASSED' in verdict[0]:
        return 'PASSED' + (' (suppression left out)' if notes else ''), True
    reason = (errors or verdict or lines[-1:] or ['exit %d' % proc.returncode])[0]
    return 'FAILED (exit %d): %s' % (proc.returncode, reason[:160]), False


def _predict(out, spec, expected):
    """Largest |difference| of ``load_model(out).predict`` (suppressed where the
    export left the suppression out) from ``expected``."""
    import export  # pylint: disable=import-outside-toplevel
    model = export.load_model(out)
    axis = spec.get('batch_axis', 0)
    # predict takes and returns every array batch first
    got = model.predict(*[np.moveaxis(a, axis, 0) for a in _flat(spec['sample'])])
    got = [np.moveaxis(g, 0, axis) for g in (list(got) if isinstance(got, tuple) else [got])]
    onnx = [os.path.join(out, 'current', f) for f in os.listdir(os.path.join(out, 'current'))
            if f.endswith('.onnx')]
    if onnx and len(got) != len(expected):
        from export.suppression import read_spec  # pylint: disable=import-outside-toplevel
        try:
            read_spec(onnx[0])
        except Exception:  # pylint: disable=broad-except
            pass
        else:
            got = list(export.suppress(got, onnx[0]))
    return _max_diff(got, expected)


def _with_values(net, values, sample):
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    for name, param in net.collect_params().items():
        if name in values:
            param.set_data(mx.nd.array(values[name]))
    return _one_device(net, sample)


def _fcn_cli(spec, tmp):
    """FCN through ``python -m mp_symbolic train`` under both schedules:
    ``(params diff, statistics diff, command, folder of the GPipe run)``."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    runs = {}
    command = None
    for schedule in ('gpipe', '1f1b'):
        folder = os.path.join(tmp, 'fcn-' + schedule)
        cmd = [sys.executable, '-m', 'mp_symbolic', 'train', '--task', 'bench.fcn_task',
               '--task-arg', 'size=%d' % spec['cli'], '--devices', DEVICES,
               '--chunks', str(CHUNKS), '--schedule', schedule, '--batch-size', str(BATCH),
               '--no-memory', '--no-progress', '--out', folder]
        command = command or ' '.join(['python'] + cmd[1:-1] + ['artifacts/fcn'])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            lines = proc.stderr.strip().splitlines() or ['(no stderr)']
            raise RuntimeError('train --schedule %s: exit %d: %s'
                               % (schedule, proc.returncode, lines[-1]))
        current = os.path.join(folder, 'current')
        params = [f for f in os.listdir(current) if f.endswith('.params')]
        loaded = mx.nd.load(os.path.join(current, params[0]))
        runs[schedule] = ({k[4:]: v.asnumpy() for k, v in loaded.items() if k.startswith('arg:')},
                          {k[4:]: v.asnumpy() for k, v in loaded.items() if k.startswith('aux:')})
    return (_diff_dicts(runs['1f1b'][0], runs['gpipe'][0]),
            _diff_dicts(runs['1f1b'][1], runs['gpipe'][1]), command,
            os.path.join(tmp, 'fcn-gpipe'), dict(runs['gpipe'][0], **runs['gpipe'][1]))


def stats_of(values, net):
    """Whether ``net`` has running statistics (auxiliary states) among ``values``."""
    return any(p.grad_req == 'null' and n in values for n, p in net.collect_params().items())


def _first_line(err):
    lines = [l.strip() for l in str(err).strip().splitlines() if l.strip()]
    if lines and lines[0].startswith('Traceback'):   # MXNet's: the check is last
        lines = lines[-1:]
    return '%s: %s' % (type(err).__name__, (lines or [''])[0][:160])


def child_row(name, quick=False):
    """One network's row (a dict of :data:`COLUMNS` and ``'notes'``), in this process."""
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    import mp_symbolic
    start = time.time()
    spec = NETWORKS[name](quick)
    row = {'network': name, 'input': spec['input'], 'notes': []}
    net, sample = spec['net'], spec['sample']
    expected = _one_device(net, sample)
    spec['expected'] = expected
    values = {n: p.data().copy() for n, p in net.collect_params().items()}

    pipe = _pipeline(spec)
    mod = _inference(spec, pipe, values)
    row['split = one device'] = '%.1e' % _max_diff([o.asnumpy() for o in mod.get_outputs()],
                                                   expected)
    with tempfile.TemporaryDirectory(prefix='networks-') as tmp:
        if 'cli' in spec:
            params, stats, command, folder, trained = _fcn_cli(spec, tmp)
            row['command'] = command
            trained_out = _with_values(net, trained, sample)
            expected_trained = [mx.nd.softmax(mx.nd.array(trained_out[0]), axis=1).asnumpy()]
            row['1F1B = GPipe params'], row['1F1B = GPipe statistics'] = \
                '%.1e' % params, '%.1e' % stats
        else:
            try:
                params, stats, note, trained = _schedules(spec, {k: v.asnumpy()
                                                                 for k, v in values.items()})
                row['1F1B = GPipe params'] = '%.1e' % params
                row['1F1B = GPipe statistics'] = '%.1e' % stats if stats_of(trained, net) \
                    else 'none (no BatchNorm)'
            except Exception as err:  # pylint: disable=broad-except
                row['1F1B = GPipe params'] = 'error: %s' % _first_line(err)
                row['1F1B = GPipe statistics'] = ''
                note = 'the export below is of the initial parameters (training failed)'
                trained = {k: v.asnumpy() for k, v in values.items()}
            if note:
                row['notes'].append(note)
            if not all(np.isfinite(v).all() for v in trained.values()):
                row['notes'].append('SGD gave non-finite parameters under gpipe (%d of %d '
                                    'arrays): the export below is of the initial parameters'
                                    % (sum(not np.isfinite(v).all() for v in trained.values()),
                                       len(trained)))
                trained = {k: v.asnumpy() for k, v in values.items()}
            folder = os.path.join(tmp, 'checkpoint')
            trained_nd = {k: mx.nd.array(v) for k, v in trained.items()}
            mod = _inference(spec, _pipeline(spec), trained_nd)
            mp_symbolic.save_checkpoint(mod, folder, epoch=0, name='net')
            try:
                expected_trained = _with_values(net, trained, sample)
            except Exception as err:  # pylint: disable=broad-except
                row['notes'].append('the Gluon network on one device failed with its trained '
                                    'parameters (%s): predict compared with the graph on cpu:0'
                                    % _first_line(err))
                alone = _inference(spec, _pipeline(spec, chunks=1, devices='cpu:0'), trained_nd)
                expected_trained = [o.asnumpy() for o in alone.get_outputs()]
        try:
            deferred = _deferred(spec, values)
            row['deferred = whole batch'] = 'none (no BatchNorm)' \
                if not stats_of(values, net) else 'all %.1e, first %.1e' % deferred
        except Exception as err:  # pylint: disable=broad-except
            row['deferred = whole batch'] = 'error: %s' % _first_line(err)
        sample_file = None
        if isinstance(sample, tuple):
            sample_file = os.path.join(tmp, 'sample.npz')
            np.savez(sample_file, **dict(zip(pipe.input_names, _flat(sample))))
        out = os.path.join(tmp, 'export')
        row['export'], ok = _export(folder, out, sample_file)
        if ok:
            try:
                row['predict'] = '%.1e' % _predict(out, spec, expected_trained)
            except Exception as err:  # pylint: disable=broad-except
                row['predict'] = 'error: %s' % _first_line(err)
        else:
            row['predict'] = 'not run (no export)'
    row['time'] = '%.0f s' % (time.time() - start)
    return row


# -- the table, in the parent -------------------------------------------------

def run_row(name, quick=False, timeout=1800):
    """Runs :func:`child_row` in a child process; a crash or a timeout is a row."""
    cmd = [sys.executable, '-m', 'bench.networks', '--row', name] + (['--quick'] if quick else [])
    start = time.time()
    empty = {c: '' for c in COLUMNS}
    empty.update(network=name, notes=[])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=root)
    except subprocess.TimeoutExpired:
        empty['time'] = '%.0f s' % (time.time() - start)
        empty['split = one device'] = 'timed out after %d s' % timeout
        return empty
    for line in proc.stdout.splitlines():
        if line.startswith(ROW_PREFIX):
            return json.loads(line[len(ROW_PREFIX):])
    lines = proc.stderr.strip().splitlines() or ['(no stderr)']
    empty['split = one device'] = 'crashed (exit %d): %s' % (proc.returncode, lines[-1][:160])
    empty['time'] = '%.0f s' % (time.time() - start)
    return empty


def _markdown(row):
    return '| ' + ' | '.join(str(row.get(c, '')) for c in COLUMNS) + ' |'


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.networks', description=__doc__.split(
        '\n\n', maxsplit=1)[0])
    parser.add_argument('--only', default=None, metavar='NAME,...',
                        help='these networks only (default: all of %s)' % ', '.join(NETWORKS))
    parser.add_argument('--quick', action='store_true',
                        help='small sizes (a test that the script works)')
    parser.add_argument('--timeout', type=float, default=None, metavar='S',
                        help='time limit per row (default: 1800 s, 600 with --quick)')
    parser.add_argument('--row', default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row is not None:
        try:
            row = child_row(args.row, args.quick)
        except Exception:  # pylint: disable=broad-except
            traceback.print_exc()
            return 1
        print(ROW_PREFIX + json.dumps(row), flush=True)
        return 0
    names = list(NETWORKS) if args.only is None else [n for n in args.only.split(',') if n]
    unknown = [n for n in names if n not in NETWORKS]
    if unknown:
        print('error: --only: expected names among %s, found %s'
              % (', '.join(NETWORKS), ', '.join(unknown)), file=sys.stderr)
        return 2
    timeout = args.timeout or (600 if args.quick else 1800)
    print('batch %d, chunks %d over %s, SGD %d steps; largest |difference|' % (
        BATCH, CHUNKS, DEVICES, STEPS), flush=True)
    print(_markdown({c: c for c in COLUMNS}), flush=True)
    print('|' + '---|' * len(COLUMNS), flush=True)
    notes = []
    for name in names:
        row = run_row(name, args.quick, timeout)
        print(_markdown(row), flush=True)
        notes += ['%s: %s' % (name, n) for n in row.get('notes', [])]
        if row.get('command'):
            notes.append('%s: %s' % (name, row['command']))
    for note in notes:
        print('- ' + note, flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
