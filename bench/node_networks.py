"""``python -m bench.node_networks [--only NAME,...] [--route python,cli]``:
GluonCV and GluonNLP networks (random weights, nothing downloaded) over 2 node
processes against one process of the same plan, one row each.

Each network is cut into stages over the devices of its plan (2 nodes: each
holds half of them), trained under ``'1f1b'`` with micro-batches (``chunks``)
by Adam for :data:`STEPS` steps on batches of :data:`~bench.networks.BATCH`
(each the network's sample and label), from random initial values, two ways:

- **python**: every process runs ``mx.random.seed(0)``, then
  ``Pipeline(..., nodes=2)``'s ``pipe.module(...).fit(data,
  initializer=mx.init.Xavier(), optimizer='adam')`` (``nodes=None`` in the
  one process); each writes what it holds: ``get_params()`` (parameters,
  auxiliary states) and ``get_outputs()`` (the last batch's outputs, which
  every node reads);
- **cli**: ``python -m mp_symbolic launch --nodes 2 -- train --task
  bench.node_task --task-arg network=NAME ...`` against ``python -m
  mp_symbolic train`` with the same flags; the checkpoints (one part per node
  against one process's) are read with :func:`mp_symbolic.read_checkpoint`,
  and the outputs are those of each checkpoint's parameters on the sample,
  forward on one device. ``train`` ends in exit status 1 where the training
  loss did not fall (BatchNorm's running statistics after three steps can
  give a higher loss than the initial ones); it keeps that last epoch's
  checkpoint, compared as any other, and the cell says ``(both: did not
  improve)`` where both layouts so ended.

Each cell is the largest ``|difference|`` from one process, over every
parameter, every auxiliary state (BatchNorm's running statistics) and every
output, as ``params / aux / outputs``; a network whose nodes fail is a row
naming the failure (its last line). The networks are built by
:mod:`bench.networks` (its builders and sizes), plus ResNet-152 v1d, VGG-16
with BatchNorm, SimplePose and a small BERT sharded by
``tensor_parallel='auto'``; the values the builders give are not used: the
Python route draws every parameter by Xavier from the seed and its name,
the command line by the blocks' own initialisers after ``--seed``.
``--quick``: the small sizes of :mod:`bench.networks` (for a test).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench import networks

__all__ = ['PLANS', 'spec_of', 'fitted', 'merge', 'differences', 'run_python', 'run_cli',
           'main']

STEPS = 3
LR = 1e-3
SEED = 0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWO = 'cpu:0,cpu:1'
FOUR = 'cpu:0,cpu:1,cpu:2,cpu:3'
BERT_SHAPE = (networks.BATCH, 8)
# train's refusal of a run whose loss did not fall; it keeps the last epoch's checkpoint
DID_NOT_IMPROVE = 'training did not improve the model'


def _pose(quick):
    net = networks._gluoncv('simple_pose_resnet18_v1b',  # pylint: disable=protected-access
                            pretrained_base=False)
    height, width = (32, 24) if quick else (64, 48)
    sample = np.random.default_rng(0).normal(
        size=(networks.BATCH, 3, height, width)).astype(np.float32)
    return {'net': net, 'sample': sample, 'loss': 'l2', 'output': None, 'label': None,
            'input': '%dx%d, heatmaps L2' % (height, width)}


def _bert(quick):  # pylint: disable=unused-argument
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    from gluonnlp.model import bert
    mx.random.seed(0)
    encoder = bert.BERTEncoder(num_layers=2, units=16, hidden_size=32, max_length=16,
                               num_heads=2, prefix='encoder_')
    net = bert.BERTModel(encoder, vocab_size=50, token_type_vocab_size=2, units=16,
                         embed_size=16, use_pooler=True, use_decoder=False, use_classifier=True,
                         prefix='bert_')
    net.initialize(mx.init.Normal(0.02))
    batch, length = BERT_SHAPE
    rng = np.random.default_rng(0)
    sample = (rng.integers(0, 50, (batch, length)).astype(np.float32),
              rng.integers(0, 2, (batch, length)).astype(np.float32),
              rng.integers(1, length + 1, (batch,)).astype(np.float32))
    net(*[mx.nd.array(x) for x in sample])  # its parameters' shapes, for the sharding
    labels = rng.integers(0, 2, batch).astype(np.float32)
    return {'net': net, 'sample': sample, 'loss': 'softmax', 'output': 2, 'label': labels,
            'input': '%d tokens, 2 layers of 16 units' % length}


# name -> (make(quick) -> spec as bench.networks' builders give it, devices, chunks, Pipeline's
# other arguments)
PLANS = {
    'resnet152_v1d': (networks._classifier('resnet152_v1d', 64),  # pylint: disable=protected-access
                      FOUR, 4, {}),
    'simple_pose_resnet18_v1b': (_pose, TWO, 2, {}),
    'vgg16_bn': (networks._classifier('vgg16_bn', 32), TWO, 2, {}),  # pylint: disable=protected-access
    'densenet121': (networks.NETWORKS['densenet121'], TWO, 2, {}),
    'inceptionv3': (networks.NETWORKS['inceptionv3'], TWO, 2, {}),
    'yolo3_mobilenet1.0_voc': (networks.NETWORKS['yolo3_mobilenet1.0_voc'], TWO, 2, {}),
    'bert': (_bert, 'cpu:0+cpu:1,cpu:2+cpu:3', 2, {'tensor_parallel': 'auto'}),
    'awd_lstm_lm_1150': (networks.NETWORKS['awd_lstm_lm_1150'], TWO, 2, {}),
}


def spec_of(name, quick=False):
    """``(spec, devices, chunks, Pipeline's other arguments)`` of network
    ``name``: the spec as :mod:`bench.networks` makes it (its parameters
    named as in a fresh process), with ``'label'`` filled in (L2 towards
    random targets the shape of the loss's output)."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    make, devices, chunks, extra = PLANS[name]
    with mx.name.NameManager():  # Gluon's names as in a fresh process, whatever was built before
        spec = make(quick)
    if spec['label'] is None:
        outputs = networks._one_device(spec['net'], spec['sample'])  # pylint: disable=protected-access
        target = outputs[spec['output'] or 0]
        spec['label'] = np.random.default_rng(2).normal(size=target.shape).astype(np.float32)
    return spec, devices, chunks, dict(extra)


def _data(spec, pipe):
    """An ``mx.io.DataIter`` of :data:`STEPS` batches, each the spec's sample
    and label, the batch on the spec's axis."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    leaves = networks._flat(spec['sample'])  # pylint: disable=protected-access
    axis = spec.get('batch_axis', 0)
    layout = 'TNC' if axis == 1 else 'NCHW'

    class Repeat(mx.io.DataIter):
        """The same batch :data:`STEPS` times."""

        def __init__(self):
            super().__init__(batch_size=leaves[0].shape[axis])
            self.provide_data = [mx.io.DataDesc(n, a.shape, layout=layout)
                                 for n, a in zip(pipe.input_names, leaves)]
            self.provide_label = [mx.io.DataDesc('softmax_label', spec['label'].shape,
                                                 layout=layout)]
            self.count = 0

        def reset(self):
            self.count = 0

        def next(self):
            if self.count == STEPS:
                raise StopIteration
            self.count += 1
            return mx.io.DataBatch([mx.nd.array(a) for a in leaves],
                                   [mx.nd.array(spec['label'])], pad=0)

    return Repeat()


def fitted(name, nodes=None, quick=False):
    """The Python route in this process (node ``RANK`` of ``nodes``, or one
    process): ``{'param:NAME'|'aux:NAME'|'output:K': numpy}``, what it holds
    after ``fit(initializer=mx.init.Xavier())`` with Adam."""
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    from mp_symbolic import Pipeline
    spec, devices, chunks, extra = spec_of(name, quick)
    if 'batch_axis' in spec:
        extra['batch_axis'] = spec['batch_axis']
    mx.random.seed(SEED)
    pipe = Pipeline(spec['net'], devices, sample=spec['sample'], chunks=chunks,
                    schedule='1f1b', nodes=nodes, **extra)
    mod = pipe.module(loss=spec['loss'], output=spec['output'])
    mod.fit(_data(spec, pipe), num_epoch=1, optimizer='adam',
            optimizer_params={'learning_rate': spec.get('lr', LR)},
            initializer=mx.init.Xavier(), eval_metric=mx.metric.Loss())
    arg, aux = mod.get_params()
    held = {'param:' + k: v.asnumpy() for k, v in arg.items()}
    held.update({'aux:' + k: v.asnumpy() for k, v in aux.items()})
    held.update({'output:%d' % k: o.asnumpy() for k, o in enumerate(mod.get_outputs())})
    return held


# -- the parent: processes and their differences -------------------------------

def _env(**more):
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]),
        MXNET_SUBGRAPH_VERBOSE='0', **more)


def _last_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1].strip()[:200] if lines else '(no output)'


def _wait(procs, timeout, what, kept=None):
    """Waits for ``procs``; raises RuntimeError naming the first that
    failed (its last line) or the timeout. Every process is gone after.
    With ``kept``, a process that exits 1 with that text in its output is
    no failure. Returns whether any so exited."""
    try:
        ended = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        raise RuntimeError('%s: timed out after %.0f s' % (what, timeout)) from None
    finally:
        for p in procs:
            p.kill()
            p.wait()
    found = False
    for k, (p, (out, err)) in enumerate(zip(procs, ended)):
        if p.returncode == 1 and kept is not None and kept in (out or '') + (err or ''):
            found = True
        elif p.returncode:
            who = what if len(procs) == 1 else '%s, node %d' % (what, k)
            raise RuntimeError('%s: exit %d: %s' % (who, p.returncode, _last_line(err)))
    return found


def differences(ours, theirs):
    """``{'params'|'aux'|'outputs': largest |difference|}`` of two
    ``{'param:NAME'|...}`` dicts; a name missing from one is a ValueError."""
    if sorted(ours) != sorted(theirs):
        missing = sorted(set(theirs) ^ set(ours))
        raise ValueError('expected the same arrays, found %d and %d (%s ...)'
                         % (len(ours), len(theirs), ', '.join(missing[:3])))
    found = {'params': 0.0, 'aux': 0.0, 'outputs': 0.0}
    for key, value in theirs.items():
        kind = {'param': 'params', 'aux': 'aux', 'output': 'outputs'}[key.split(':')[0]]
        a, b = np.asarray(ours[key], np.float64), np.asarray(value, np.float64)
        if a.shape != b.shape:
            raise ValueError('%s: expected shape %s, found %s' % (key, b.shape, a.shape))
        if a.size:
            found[kind] = max(found[kind], float(np.abs(a - b).max()))
    return found


def merge(parts):
    """One dict of what the nodes hold, each name once: an array two nodes
    hold (the outputs, which every node reads) must be equal on both, else
    ValueError."""
    merged = {}
    for part in parts:
        for key, value in part.items():
            if key in merged and not np.array_equal(merged[key], value):
                raise ValueError('%s: expected every node that holds it to hold the same, found '
                                 'values %.1e apart' % (key, np.abs(merged[key] - value).max()))
            merged[key] = value
    return merged


def run_python(name, quick=False, timeout=600):
    """The Python route: the differences of 2 node processes from one."""
    from mp_symbolic.tools.launch import free_port  # pylint: disable=import-outside-toplevel
    with tempfile.TemporaryDirectory(prefix='node-networks-') as tmp:
        cmd = [sys.executable, '-m', 'bench.node_networks', '--fit', name] \
            + (['--quick'] if quick else [])
        one = subprocess.Popen(cmd + ['--held', os.path.join(tmp, 'one.npz')], cwd=ROOT,
                               env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        _wait([one], timeout, 'one process')
        port = free_port()  # picked as the nodes start
        nodes = [subprocess.Popen(cmd + ['--held', os.path.join(tmp, 'node%d.npz' % k),
                                         '--nodes', '2'], cwd=ROOT,
                                  env=_env(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port),
                                           RANK=str(k), WORLD_SIZE='2'),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for k in range(2)]
        _wait(nodes, timeout, '2 nodes')
        reference = dict(np.load(os.path.join(tmp, 'one.npz')))
        merged = merge([dict(np.load(os.path.join(tmp, 'node%d.npz' % k))) for k in range(2)])
    return differences(merged, reference)


def cli_flags(name, out):
    """``train``'s flags for network ``name`` (the same for the nodes and for
    one process)."""
    _, devices, chunks, _ = PLANS[name]
    return ['train', '--task', 'bench.node_task', '--task-arg', 'network=%s' % name,
            '--devices', devices, '--schedule', '1f1b', '--chunks', str(chunks),
            '--seed', str(SEED), '--no-progress', '--no-memory', '--out', out]


def _checkpoint_values(folder):
    """``{'param:NAME'|'aux:NAME'}`` of the checkpoint in ``folder``."""
    import mp_symbolic  # pylint: disable=import-outside-toplevel
    with mp_symbolic.read_checkpoint(folder) as checkpoint:
        return {key.replace('arg:', 'param:', 1): value
                for key, value in checkpoint.arrays(list(checkpoint.index()))}


def run_cli(name, timeout=600):
    """The command-line route: ``(differences of launch --nodes 2 -- train
    from train in one process, whether both ended in train's "did not
    improve" refusal)``. That refusal keeps the last epoch's checkpoint
    (marked incomplete), which is compared as any other; one layout
    refusing and not the other is a RuntimeError."""
    with tempfile.TemporaryDirectory(prefix='node-networks-cli-') as tmp:
        runs, refused = {}, {}
        for layout, prefix in (('one', []), ('nodes', ['launch', '--nodes', '2', '--'])):
            out = os.path.join(tmp, layout)
            cmd = [sys.executable, '-m', 'mp_symbolic'] + prefix + cli_flags(name, out)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            refused[layout] = _wait([proc], timeout,
                                    'one process' if layout == 'one' else '2 nodes',
                                    kept=DID_NOT_IMPROVE)
            runs[layout] = _checkpoint_values(out)
        if refused['one'] != refused['nodes']:
            raise RuntimeError('expected both layouts to end alike, found %s'
                               % ' and '.join('%s %s' % (l, 'did not improve' if r else 'exit 0')
                                              for l, r in sorted(refused.items())))
    # the outputs of each checkpoint's values on the sample, on one device
    from bench import node_task  # pylint: disable=import-outside-toplevel
    layouts = sorted(runs)
    for layout, outputs in zip(layouts, node_task.outputs_of(
            name, [{k.split(':', 1)[1]: v for k, v in runs[l].items()} for l in layouts])):
        runs[layout].update({'output:%d' % k: o for k, o in enumerate(outputs)})
    return differences(runs['nodes'], runs['one']), refused['one']


def _cell(route, name, quick, timeout):
    start = time.time()
    refused = False
    try:
        if route == 'python':
            found = run_python(name, quick, timeout)
        else:
            found, refused = run_cli(name, timeout)
    except (RuntimeError, ValueError) as err:
        return 'failed: %s' % str(err).splitlines()[0], time.time() - start
    return '%.1e / %.1e / %.1e%s' % (found['params'], found['aux'], found['outputs'],
                                     ' (both: did not improve)' if refused else ''), \
        time.time() - start


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.node_networks',
                                     description=__doc__.split('\n\n', maxsplit=1)[0])
    parser.add_argument('--only', default=None, metavar='NAME,...',
                        help='these networks only (default: all of %s)' % ', '.join(PLANS))
    parser.add_argument('--route', default='python,cli', metavar='python,cli',
                        help='the routes to run (default: both)')
    parser.add_argument('--quick', action='store_true',
                        help='small sizes (the Python route only)')
    parser.add_argument('--timeout', type=float, default=900, metavar='S',
                        help='time limit of each run (default: 900 s)')
    parser.add_argument('--fit', default=None, help=argparse.SUPPRESS)
    parser.add_argument('--held', default=None, help=argparse.SUPPRESS)
    parser.add_argument('--nodes', type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fit is not None:
        np.savez(args.held, **fitted(args.fit, args.nodes, args.quick))
        return 0
    names = list(PLANS) if args.only is None else [n for n in args.only.split(',') if n]
    unknown = [n for n in names if n not in PLANS]
    routes = [r for r in args.route.split(',') if r]
    if unknown:
        print('error: --only: expected names among %s, found %s'
              % (', '.join(PLANS), ', '.join(unknown)), file=sys.stderr)
        return 2
    if not routes or any(r not in ('python', 'cli') for r in routes):
        print('error: --route: expected python, cli or both, found %r' % args.route,
              file=sys.stderr)
        return 2
    print('2 nodes against one process: 1F1B, Adam (lr %g), %d steps of batch %d, '
          'mx.random.seed(%d); largest |difference| params / aux / outputs'
          % (LR, STEPS, networks.BATCH, SEED), flush=True)
    head = ['network', 'input', 'devices', 'chunks'] + \
        ['%s (%s)' % (r, 'fit(initializer=Xavier())' if r == 'python' else 'launch -- train')
         for r in routes] + ['time']
    print('| ' + ' | '.join(head) + ' |')
    print('|' + '---|' * len(head), flush=True)
    for name in names:
        _, devices, chunks, _ = PLANS[name]
        cells, seconds = [], 0.0
        for route in routes:
            cell, took = _cell(route, name, args.quick, args.timeout)
            cells.append(cell)
            seconds += took
        spec_input = spec_of(name, args.quick)[0]['input']
        print('| ' + ' | '.join([name, spec_input, devices, str(chunks)] + cells
                                + ['%.0f s' % seconds]) + ' |', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
