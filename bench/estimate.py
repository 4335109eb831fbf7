"""``python -m bench.estimate [--only MODEL,...] [--json FILE]``: the memory
estimate (:func:`mp_symbolic.estimate_memory`, nothing allocated) against
the measured table, cell by cell.

Each cell is a model, a device plan, a schedule, micro-batches, replicas,
shards or mirroring (and, for the GluonCV models, a ``loss`` head other
than ``'softmax'``). Its measured table is one training step (SGD with
momentum 0.9) of ``pipe.module(loss)`` bound, initialised and stepped in a
process of its own with MXNet's storage profiler on
(:func:`mp_symbolic.tools.memory.device_memory` with the storage totals: the
table ``train --memory`` prints), less the parameters and gradients the
source Gluon block made for itself at ``initialize`` (the Module binds its
own); its estimate is made in this process
before anything of the cell is allocated. Per device it prints the measured
and estimated totals and the error, and the largest error of a row
(``other``: activations and workspace; the arrays' rows are exact or not).

``--nodes``: the cells of :data:`NODE_CELLS`, each a plan over 2 node
processes: its tables estimated node by node in this process
(``estimate_memory(..., nodes=2)``), then measured by the node processes of
a job on 127.0.0.1, each its own step (:func:`measure_nodes`); a row per
node and device.

Models: the bundled tasks (``regression``, ``digits``: a CNN with BatchNorm,
``lm``: the GPT), GluonCV's ``resnet18_v1b`` and ``cifar_resnet20_v1``
(BatchNorm), GluonNLP's BERT (two layers of 64 units, sequence 32) and
its AWD LSTM language model (three layers, hidden 200).
"""
import argparse
import json
import os
import sys
import traceback

import numpy as np

__all__ = ['CELLS', 'NODE_CELLS', 'build', 'measure', 'measure_nodes', 'estimate', 'run',
           'run_nodes', 'main']

MOMENTUM = {'momentum': 0.9}


def _cell(model, devices='cpu:0,cpu:1', schedule='gpipe', chunks=1, **extra):
    return dict(model=model, devices=devices, schedule=schedule, chunks=chunks, **extra)


CELLS = []
for _model in ('regression', 'digits', 'lm', 'resnet18_v1b', 'cifar_resnet20_v1', 'bert',
               'awd_lstm'):
    CELLS += [_cell(_model), _cell(_model, chunks=4), _cell(_model, schedule='1f1b', chunks=4)]
CELLS += [
    _cell('lm', devices='cpu:0'), _cell('digits', devices='cpu:0'),
    _cell('bert', devices='cpu:0'), _cell('resnet18_v1b', devices='cpu:0'),
    _cell('lm', chunks=8), _cell('lm', schedule='1f1b', chunks=8),
    _cell('lm', chunks=2), _cell('lm', schedule='1f1b', chunks=2),
    _cell('lm', devices='cpu:0,cpu:1,cpu:2'), _cell('lm', devices='cpu:0,cpu:1,cpu:2',
                                                    schedule='1f1b', chunks=4),
    _cell('lm', schedule='interleaved', chunks=4), _cell('digits', schedule='interleaved',
                                                         chunks=4),
    _cell('bert', schedule='interleaved', chunks=4),
    _cell('lm', devices='cpu:0,cpu:1,cpu:2,cpu:3', replicas=2),
    _cell('digits', devices='cpu:0,cpu:1,cpu:2,cpu:3', replicas=2, chunks=2),
    _cell('resnet18_v1b', devices='cpu:0,cpu:1,cpu:2,cpu:3', replicas=2),
    _cell('lm', devices='cpu:0,cpu:1,cpu:2,cpu:3', replicas=2, schedule='1f1b', chunks=2),
    _cell('lm', mirror=True), _cell('lm', mirror=True, chunks=4),
    _cell('resnet18_v1b', mirror=True), _cell('bert', mirror=True),
    _cell('lm', mirror=True, schedule='1f1b', chunks=4),
    _cell('lm', devices='cpu:0+cpu:1,cpu:2', tensor_parallel='auto'),
    _cell('lm', devices='cpu:0+cpu:1,cpu:2', tensor_parallel='auto', chunks=4),
    _cell('bert', devices='cpu:0+cpu:1,cpu:2+cpu:3', tensor_parallel='auto'),
    _cell('lm', optimizer='adam'), _cell('bert', optimizer='adam', schedule='1f1b', chunks=4),
]

# over 2 node processes: each node's table its own row
NODE_CELLS = [
    _cell('lm', schedule='1f1b', chunks=4, nodes=2), _cell('lm', nodes=2),
    _cell('digits', schedule='1f1b', chunks=4, nodes=2),
    _cell('cifar_resnet20_v1', schedule='1f1b', chunks=4, nodes=2),
    _cell('resnet18_v1b', nodes=2),
]


def build(cell):
    """``(pipe, loss, output, data_shapes, label_shapes)`` of ``cell``."""
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    from mp_symbolic import Pipeline
    plan = dict(chunks=cell['chunks'], schedule=cell['schedule'], nodes=cell.get('nodes'),
                replicas=cell.get('replicas', 1), mirror=cell.get('mirror', False),
                tensor_parallel=cell.get('tensor_parallel'), balance=cell.get('balance'),
                virtual=cell.get('virtual'), shard_optimizer=bool(cell.get('shard_optimizer')))
    model = cell['model']
    mx.random.seed(0)
    if model in ('regression', 'digits', 'lm'):
        from mp_symbolic.training.tasks import load_task
        task, _ = load_task(model)
        batch = task.batch_size
        pipe = Pipeline(task.make_blocks(), cell['devices'],
                        sample=(batch,) + tuple(task.sample_shapes[0]), **plan)
        return (pipe, task.graph_loss, None, task.data_shapes(batch, pipe.data_names()),
                [(task.label, (batch,) + tuple(task.label_shape))])
    if model in ('resnet18_v1b', 'cifar_resnet20_v1'):
        from gluoncv import model_zoo
        net = model_zoo.get_model(model, pretrained=False, classes=10)
        net.initialize(mx.init.Xavier())
        shape = (16, 3, 32, 32)
        pipe = Pipeline(net, cell['devices'], sample=shape, **plan)
        return (pipe, cell.get('loss', 'softmax'), None, [('data', shape)],
                [('softmax_label', (16,))])
    if model == 'bert':
        from gluonnlp.model import bert
        encoder = bert.BERTEncoder(num_layers=2, units=64, hidden_size=128, max_length=32,
                                   num_heads=4, prefix='encoder_')
        net = bert.BERTModel(encoder, vocab_size=100, token_type_vocab_size=2, units=64,
                             embed_size=64, use_pooler=True, use_decoder=False,
                             use_classifier=True, prefix='bert_')
        net.initialize(mx.init.Normal(0.02))
        batch, length = 16, 32
        rng = np.random.default_rng(0)
        xs = (rng.integers(0, 100, (batch, length)).astype(np.float32),
              rng.integers(0, 2, (batch, length)).astype(np.float32),
              rng.integers(1, length + 1, (batch,)).astype(np.float32))
        net(*[mx.nd.array(x) for x in xs])
        pipe = Pipeline(net, cell['devices'], sample=xs, **plan)
        return (pipe, 'softmax', 2, list(zip(pipe.input_names, [x.shape for x in xs])),
                [('softmax_label', (batch,))])
    if model == 'awd_lstm':
        import gluonnlp
        hidden, embed, vocab, steps, batch = 200, 100, 200, 16, 8
        net = gluonnlp.model.AWDRNN('lstm', vocab_size=vocab, embed_size=embed,
                                    hidden_size=hidden, num_layers=3, tie_weights=True,
                                    dropout=0, weight_drop=0, drop_h=0, drop_i=0, drop_e=0,
                                    prefix='awd_')
        net.initialize(mx.init.Xavier())
        rng = np.random.default_rng(0)
        x = rng.integers(0, vocab, (steps, batch)).astype(np.float32)
        states = [[np.zeros((1, batch, size), np.float32) for _ in range(2)]
                  for size in (hidden, hidden, embed)]
        pipe = Pipeline(net, cell['devices'], sample=(x, states), batch_axis=1, **plan)
        shapes = [x.shape] + [s.shape for pair in states for s in pair]
        return (pipe, 'softmax', 0, list(zip(pipe.input_names, shapes)),
                [('softmax_label', (steps, batch))])
    raise ValueError('model: expected one of the bench\'s models, found %r' % model)


def _optimizer(cell):
    name = cell.get('optimizer', 'sgd')
    return name, (MOMENTUM if name == 'sgd' else {})


def estimate(cell):
    """The estimated ``{device: {category: bytes}}`` of ``cell``, in this
    process; over ``nodes`` (more than one), a list of them, node by node
    (the plan made in this process, no rendezvous)."""
    from mp_symbolic import estimate_memory  # pylint: disable=import-outside-toplevel
    nodes = cell.get('nodes')
    pipe, loss, output, data_shapes, label_shapes = build(dict(cell, nodes=None))
    optimizer, params = _optimizer(cell)
    table = estimate_memory(pipe, data_shapes=data_shapes, label_shapes=label_shapes,
                            loss=loss, output=output, optimizer=optimizer,
                            optimizer_params=params, nodes=nodes)
    if nodes is None or nodes == 1:
        return table.as_dict()
    return [t.as_dict() for t in table]


def _measure_here(cell):
    """One step of ``cell``'s Module under the storage profiler, in this
    (fresh) process: :func:`~mp_symbolic.tools.memory.device_memory` with
    the storage totals, less the batch's arrays and the Gluon blocks' own
    (:func:`_blocks_free`)."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.memory import device_memory, profiled_step, start_storage_profile
    path = start_storage_profile('mp-estimate-')
    pipe, loss, output, data_shapes, label_shapes = build(cell)
    mod = pipe.module(loss=loss, output=output, label_name=label_shapes[0][0])
    mod.bind(data_shapes=data_shapes, label_shapes=label_shapes)
    mod.init_params(initializer=lambda desc, arr: arr.__setitem__(slice(None), 0.01))
    optimizer, params = _optimizer(cell)
    # replicas sum their gradients through a local kvstore (the one Module.fit makes)
    mod.init_optimizer(kvstore='local' if cell.get('replicas', 1) > 1 else None,
                       optimizer=optimizer,
                       optimizer_params=dict(params, learning_rate=0.01))
    storage = profiled_step(mod, data_shapes, label_shapes, path)
    return device_memory(mod, _blocks_free(storage, pipe))


def _blocks_free(storage, pipe):
    """``storage`` less the arrays of ``pipe``'s Gluon blocks themselves (the
    parameters and gradients their ``initialize`` made, before the Pipeline:
    the Module binds arrays of its own), which are not the training step's:
    every parameter a block of their trees holds, those of the layers a
    tensor-parallel swap took out of it among them."""
    out = dict(storage)
    seen = set()
    # pylint: disable=protected-access
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    params, stack, visited = [], list(pipe.blocks), set()
    while stack:
        block = stack.pop()
        if id(block) in visited:
            continue
        visited.add(id(block))
        params += list(block.collect_params().values()) + list(block._reg_params.values())
        # a swapped-out layer stays an attribute of its parent
        stack += list(block._children.values()) + [
            v for v in vars(block).values() if isinstance(v, mx.gluon.Block)]
    for param in params:
        arrays = list(param._data or ()) + list(param._grad or ())
        for arr in arrays:
            if id(arr) not in seen:
                seen.add(id(arr))
                out[str(arr.context)] = out.get(str(arr.context), 0) - \
                    arr.size * np.dtype(arr.dtype).itemsize
    return out


def _forked(cell):
    """:func:`_measure_here` in a process forked from this one (which has
    imported MXNet and allocated nothing); ``{'error': line}`` if it failed."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read_end)
            with os.fdopen(write_end, 'w') as out:
                try:
                    out.write(json.dumps(_measure_here(cell)))
                except Exception as err:  # pylint: disable=broad-except
                    traceback.print_exc()
                    out.write(json.dumps({'error': str(err).strip().splitlines()[0]}))
            status = 0
        finally:
            os._exit(status)  # pylint: disable=protected-access
    os.close(write_end)
    with os.fdopen(read_end) as result:
        text = result.read()
    os.waitpid(pid, 0)
    return json.loads(text) if text else {'error': 'the measurement process died'}


def measure(cells, timeout=3600):
    """The measured tables of ``cells``, each in a fresh process (one child
    imports MXNet and forks one process per cell)."""
    import subprocess  # pylint: disable=import-outside-toplevel
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0')
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [root, env.get('PYTHONPATH')]))
    proc = subprocess.run([sys.executable, '-m', 'bench.estimate', '--child'],
                          input=json.dumps(cells), capture_output=True, text=True, env=env,
                          timeout=timeout)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ['(no stderr)']
        raise RuntimeError('measurement: expected exit status 0, found %d: %s'
                           % (proc.returncode, lines[-1]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_nodes(cell, timeout=900):
    """The measured tables of ``cell`` over its ``nodes`` node processes, node
    by node: each node a fresh process on a rendezvous at 127.0.0.1 measuring
    its own Module's step (:func:`_measure_here`)."""
    import socket  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0', MASTER_ADDR='127.0.0.1',
               MASTER_PORT=str(port), WORLD_SIZE=str(cell['nodes']))
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [root, env.get('PYTHONPATH')]))
    # each node's output to a file of its own: a node blocked on a full pipe
    # would hold up the others at their next collective
    files = [(tempfile.TemporaryFile('w+'), tempfile.TemporaryFile('w+'))
             for _ in range(cell['nodes'])]
    procs = []
    try:
        for k, (out, err) in enumerate(files):
            procs.append(subprocess.Popen(
                [sys.executable, '-m', 'bench.estimate', '--node-child', json.dumps(cell)],
                stdout=out, stderr=err, text=True, env=dict(env, RANK=str(k))))
        tables = []
        for k, (proc, (out, err)) in enumerate(zip(procs, files)):
            proc.wait(timeout=timeout)
            out.seek(0)
            err.seek(0)
            if proc.returncode != 0:
                lines = err.read().strip().splitlines() or ['(no stderr)']
                raise RuntimeError('node %d: expected exit status 0, found %d: %s'
                                   % (k, proc.returncode, lines[-1]))
            tables.append(json.loads(out.read().strip().splitlines()[-1]))
        return tables
    finally:  # a node failed or timed out: the others do not wait at the rendezvous
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for out, err in files:
            out.close()
            err.close()


def run_nodes(cells, log=print):
    """:func:`run` of cells over node processes: each node's table a row."""
    rows = []
    for cell in cells:
        for k, (est, got) in enumerate(zip(estimate(cell), measure_nodes(cell))):
            rows.append({'cell': dict(cell, node=k), 'measured': got, 'estimated': est})
    report(rows, log)
    return rows


def label(cell):
    """The cell in a few words: model, devices, schedule, chunks, and what else it sets."""
    parts = [cell['model'], cell['devices'], cell['schedule'], 'M=%d' % cell['chunks']]
    if cell.get('nodes'):
        parts.append('node %d of %d' % (cell.get('node', 0), cell['nodes']))
    if cell.get('replicas', 1) > 1:
        parts.append('R=%d' % cell['replicas'])
    if cell.get('mirror'):
        parts.append('mirror')
    if cell.get('tensor_parallel'):
        parts.append('shards')
    if cell.get('shard_optimizer'):
        parts.append('zero')
    if cell.get('optimizer', 'sgd') != 'sgd':
        parts.append(cell['optimizer'])
    if cell.get('loss'):
        parts.append(cell['loss'])
    return ' '.join(parts)


def as_profiled(estimated, measured=None):
    """``estimated`` as the measured table names its rows: its pinned host
    memory on the row MXNet's storage profiler counts it in on a CPU-only
    machine, ``cpu(<cores>)``, where the model runs on that device too (the
    measured table then has no ``cpu_pinned(0)`` row of its own:
    :func:`mp_symbolic.tools.memory.host_rows`)."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.planning.estimate import PINNED
    from mp_symbolic.core.base.compat import profiler_cpu_limit
    shared = 'cpu(%d)' % (profiler_cpu_limit() - 2)
    if PINNED not in estimated or (measured is not None and shared not in measured):
        return estimated
    out = {d: dict(row) for d, row in estimated.items() if d != PINNED}
    row = out.setdefault(shared, dict.fromkeys(estimated[PINNED], 0))
    for key, value in estimated[PINNED].items():
        row[key] += value
    return out


def errors(measured, estimated):
    """Per device: ``(measured total, estimated total, error)``, the error
    as ``estimate / measured - 1``; and the largest ``|error|`` of a row's
    bytes over the devices (``other``: of the device's total)."""
    devices = {}
    worst = {}
    estimated = as_profiled(estimated, measured)
    for device, row in measured.items():
        est = estimated.get(device, {})
        total = row['total']
        devices[device] = (total, est.get('total', 0), est.get('total', 0) / total - 1)
        for category in ('params', 'grads', 'optimizer', 'aux', 'inputs', 'other'):
            diff = abs(est.get(category, 0) - row[category]) / total
            worst[category] = max(worst.get(category, 0), diff)
    return devices, worst


def run(cells, log=print):
    """Estimate then measure every cell; logs the table of errors
    (:func:`report`); returns one dict per cell (``cell``, ``measured``,
    ``estimated``)."""
    estimated = []
    for cell in cells:
        try:
            estimated.append(estimate(cell))
        except Exception as err:  # pylint: disable=broad-except
            estimated.append({'error': str(err).strip().splitlines()[0]})
    measured = measure(cells)
    rows = [{'cell': cell, 'measured': got, 'estimated': est}
            for cell, est, got in zip(cells, estimated, measured)]
    report(rows, log)
    return rows


def report(rows, log=print):
    """Logs the table of errors of ``rows`` (:func:`run`'s), then the summary:
    the device totals within 5 %, the arrays' rows equal to the byte, and
    per model the cells within 5 % on every device."""
    lines = [['cell', 'device', 'measured', 'estimate', 'error', 'other: error of total']]
    every, every_device, exact, arrays, models = [], [], 0, 0, {}
    for row in rows:
        cell, est, got = row['cell'], row['estimated'], row['measured']
        if 'error' in est or 'error' in got:
            lines.append([label(cell), '-', '-', '-', 'failed: %s' % (est.get('error') or
                                                                     got.get('error')), ''])
            continue
        devices, worst = errors(got, est)
        profiled = as_profiled(est, got)
        for device, (total, guess, err) in devices.items():
            every.append(err)
            every_device.append((device, err))
            lines.append([label(cell), device, _mib(total), _mib(guess), '%+.1f%%' % (100 * err),
                          '%.1f%%' % (100 * worst['other'])])
            for category in ('params', 'grads', 'optimizer', 'aux', 'inputs', 'module_copy'):
                arrays += 1
                exact += profiled[device][category] == got[device][category]
        errs = [err for _, _, err in devices.values()]
        models.setdefault(cell['model'], []).append((all(abs(e) <= 0.05 for e in errs),
                                                     min(errs), max(errs)))
    from mp_symbolic.tools.text import columns  # pylint: disable=import-outside-toplevel
    log('memory per device: the estimate (nothing allocated) against one measured training '
        'step (MiB; error = estimate / measured - 1)')
    for line in columns(lines):
        log('  ' + line)
    if every:
        log('%d cells, %d device totals: error from %+.1f%% to %+.1f%%, mean |error| %.2f%%; '
            '%d within +-5%%, %d more than 5%% under'
            % (len(rows), len(every), 100 * min(every), 100 * max(every),
               100 * sum(abs(e) for e in every) / len(every),
               sum(1 for e in every if abs(e) <= 0.05), sum(1 for e in every if e < -0.05)))
        log('arrays\' rows (params, grads, optimizer, aux, inputs, module_copy) equal to the '
            'byte: %d of %d' % (exact, arrays))
        first = [e for d, e in every_device if d == 'cpu(0)']
        rest = [e for d, e in every_device if d != 'cpu(0)']
        if first:
            log('cpu(0), where MXNet keeps every cpu(i)\'s temporary space: %d of %d totals '
                'within +-5%%, from %+.1f%% to %+.1f%%'
                % (sum(1 for e in first if abs(e) <= 0.05), len(first), 100 * min(first),
                   100 * max(first)))
        if rest:
            log('the other devices: %d of %d totals within +-0.5%%, %d within +-5%%'
                % (sum(1 for e in rest if abs(e) <= 0.005), len(rest),
                   sum(1 for e in rest if abs(e) <= 0.05)))
        summary = [['model', 'cells', 'within +-5% on every device', 'device errors']]
        for model, cells in models.items():
            summary.append([model, str(len(cells)), str(sum(ok for ok, _, _ in cells)),
                            '%+.1f%% .. %+.1f%%' % (100 * min(lo for _, lo, _ in cells),
                                                     100 * max(hi for _, _, hi in cells))])
        for line in columns(summary):
            log('  ' + line)


def _mib(n):
    return '%.2f' % (n / 2 ** 20)


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.estimate', description=__doc__)
    parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--node-child', default=None, help=argparse.SUPPRESS)
    parser.add_argument('--nodes', action='store_true',
                        help='the cells over 2 node processes (NODE_CELLS), each node\'s '
                             'table measured in its own process')
    parser.add_argument('--only', default=None, metavar='MODEL,...',
                        help='the cells of these models only')
    parser.add_argument('--json', default=None, metavar='FILE',
                        help='also write every cell\'s tables to FILE')
    parser.add_argument('--report', default=None, metavar='FILE',
                        help='print the table of errors of a run --json wrote, measuring nothing')
    args = parser.parse_args(argv)
    if args.child:
        cells = json.loads(sys.stdin.read())
        import mxnet  # pylint: disable=import-outside-toplevel,unused-import
        print(json.dumps([_forked(cell) for cell in cells]))
        return 0
    if args.node_child:
        print(json.dumps(_measure_here(json.loads(args.node_child))))
        return 0
    if args.report:
        with open(args.report) as given:
            report(json.load(given))
        return 0
    cells = NODE_CELLS if args.nodes else CELLS
    if args.only:
        wanted = set(args.only.split(','))
        cells = [c for c in cells if c['model'] in wanted]
    rows = (run_nodes if args.nodes else run)(cells)
    if args.json:
        with open(args.json, 'w') as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
