"""``python -m bench.nodes``: the language model on 2 node processes against
the same plan on 2 devices of one process, side by side in one run.

The GPT of ``--task lm`` (``gpt.build_blocks``, the corpus' vocabulary, width
``--width``, ``--layers`` blocks, context 64) split into 2 stages on
``cpu:0,cpu:1`` under 1F1B with ``--chunks`` micro-batches of
``--micro-batch`` sequences, trained with Adam through ``pipe.module()``:

* **one process**: both stages in one process, the boundary tensors copied
  between the devices by MXNet's engine;
* **2 nodes**: ``Pipeline(..., nodes=2)`` in two processes on this machine
  (127.0.0.1), each stage in its own, the boundary tensors through
  torch.distributed's gloo ``isend``/``irecv``.

The three processes start once and stay; each round times ``--steps``
steps of the one process, then of the two nodes (each waits for MXNet
before reading the clock), so load on the machine falls on both alike; the
ratio is the median round's. Per node it gives the bytes sent to the other
node per step and the time spent waiting for what came from it (the node
transport's own clock around each receive). Before the rounds, each process
measures its memory per device after one step under MXNet's storage
profiler (:func:`mp_symbolic.tools.memory.device_memory`): parameters,
gradients, optimizer state, the rest (activations, workspace, the stages'
buffers), and the parameter bytes of each node as a fraction of the whole.

Both layouts run on the same two cores: the figure is what the process
boundary costs, not what a second host would add (its network).

``--memory`` measures each node's peak resident memory beside one
process's instead, for a model whose parameters and optimizer state are
large: the MLP of ``python -m bench.memory_peak`` (``--mlp-layers`` Dense
layers of ``--mlp-width``, SGD with momentum; at the defaults 13 of 4096,
805 MB of parameters and 805 MB of momentum), trained for one epoch on
``cpu:0,cpu:1`` by the command line (``train --task bench.memory_peak``,
its checkpoint committed at the end), then resumed for a second epoch from
that checkpoint: once in one process, once over 2 node processes (one stage
each). Each process runs in a child of its own, which reports its
``VmHWM`` (``/proc/self/status``) as it ends and, for each step of the run
(:data:`MEMORY_PHASES`), the peak within it (``VmHWM`` reset as it starts
through ``/proc/self/clear_refs``), its wall time and the bytes it passed to
``write(2)`` (``wchar`` of ``/proc/self/io``). The runs follow one another,
never two at once.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

__all__ = ['main', 'measure', 'memory', 'serve']

LM = dict(vocab_size=166, block_size=64, num_heads=4)
SERVE = '--serve'


def _build(args, nodes):
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    import numpy as np
    from mp_symbolic import Pipeline
    from mp_symbolic.training.tasks import gpt
    cfg = gpt.GPTConfig(num_layers=args.layers, num_hiddens=args.width, **LM)
    shape = (args.chunks * args.micro_batch, cfg.block_size)
    pipe = Pipeline(gpt.build_blocks(cfg), 'cpu:0,cpu:1', sample=shape, chunks=args.chunks,
                    schedule='1f1b', nodes=nodes)
    mod = pipe.module(loss='softmax')
    mod.bind([('data', shape)], [('softmax_label', shape)])
    mx.random.seed(0)
    mod.init_params(initializer=mx.init.Xavier())
    mod.init_optimizer(kvstore=None, optimizer='adam', optimizer_params={'learning_rate': 1e-3})
    rng = np.random.default_rng(0)
    batch = mx.io.DataBatch([mx.nd.array(rng.integers(0, cfg.vocab_size, shape))],
                            [mx.nd.array(rng.integers(0, cfg.vocab_size, shape))])
    return mod, batch


def serve(args):
    """One process of the benchmark, answering commands on stdin with JSON
    lines on stdout: ``memory`` (one step under the storage profiler, then
    the table), ``time S`` (S steps' seconds and the transport's counts),
    ``quit``."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.base import timing
    from mp_symbolic.tools.memory import counted_storage, device_memory, start_storage_profile
    nodes = 2 if args.serve == 'node' else None
    trace = start_storage_profile('mp-bench-nodes-')
    mod, batch = _build(args, nodes)
    transports = [r.transport for r in mod._runtimes]  # pylint: disable=protected-access

    def step(count):
        for _ in range(count):
            mod.forward_backward(batch)
            mod.update()

    for line in sys.stdin:
        command = line.split()
        if command[0] == 'memory':
            step(1)
            table = device_memory(mod, counted_storage(trace))
            answer = {'memory': table}
        elif command[0] == 'time':
            before = [dict(getattr(t, 'stats', {})) for t in transports]
            seconds = timing.seconds(lambda: step(int(command[1])))
            after = [getattr(t, 'stats', {}) for t in transports]
            answer = {'seconds': seconds, 'stats': {k: sum(a[k] - b[k] for a, b in
                                                           zip(after, before))
                                                    for k in (after[0] if after[0] else {})}}
        else:
            break
        print(json.dumps(answer), flush=True)


def _start(args, role, env=None):
    argv = [sys.executable, '-m', 'bench.nodes', SERVE, role, '--chunks', str(args.chunks),
            '--micro-batch', str(args.micro_batch), '--layers', str(args.layers),
            '--width', str(args.width)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})))


def _ask(procs, command):
    for proc in procs:
        proc.stdin.write(command + '\n')
        proc.stdin.flush()
    answers = []
    for proc in procs:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError('a benchmark process ended before answering %r' % command)
        answers.append(json.loads(line))
    return answers


def _free_port():
    import socket  # pylint: disable=import-outside-toplevel
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def run(args, log=print):
    """The side-by-side table; returns its figures as a dict."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.memory import format_bytes
    from mp_symbolic.tools.text import columns
    port = str(_free_port())
    one = _start(args, 'one')
    nodes = [_start(args, 'node', dict(MASTER_ADDR='127.0.0.1', MASTER_PORT=port, RANK=str(k),
                                       WORLD_SIZE='2')) for k in range(2)]
    try:
        memory_one = _ask([one], 'memory')[0]['memory']
        memory_nodes = [a['memory'] for a in _ask(nodes, 'memory')]
        _ask([one], 'time 1')  # warm-up
        _ask(nodes, 'time 1')
        rounds = []
        for _ in range(args.repeats):
            alone = _ask([one], 'time %d' % args.steps)[0]['seconds'] / args.steps
            answers = _ask(nodes, 'time %d' % args.steps)
            rounds.append((alone, max(a['seconds'] for a in answers) / args.steps,
                           [a['stats'] for a in answers]))
    finally:
        for proc in [one] + nodes:  # their stdin ends: each leaves its loop
            proc.stdin.close()
            proc.wait(timeout=60)
    ratios = [n / o for o, n, _ in rounds]
    median = statistics.median(ratios)
    alone, split, stats = sorted(rounds, key=lambda r: r[1] / r[0])[len(rounds) // 2]
    log('the language model (%d blocks, width %d) over 2 stages, 1F1B, %d micro-batches of %d '
        'sequences of 64, Adam; median of %d rounds of %d steps:'
        % (args.layers, args.width, args.chunks, args.micro_batch, args.repeats, args.steps))
    rows = [('layout', 'step', 'vs one process', 'sent per step', 'waiting on receives')]
    rows.append(('one process, cpu(0) and cpu(1)', '%.1f ms' % (alone * 1e3), '1.00', '-', '-'))
    for k, s in enumerate(stats):
        rows.append(('2 nodes: node %d' % k, '%.1f ms' % (split * 1e3) if k == 0 else '',
                     '%.2f' % median if k == 0 else '',
                     '%s in %d messages' % (format_bytes(s['sent_bytes'] / args.steps),
                                            s['sent'] // args.steps),
                     '%.1f ms (%.0f %%)' % (s['receive_wait_s'] / args.steps * 1e3,
                                            100 * s['receive_wait_s'] / args.steps / split)))
    for line in columns(rows):
        log('  ' + line)
    log('  ratio of each round: %s' % ', '.join('%.2f' % r for r in ratios))
    whole = sum(row['params'] for row in memory_one.values())
    log('memory after one step (other: activations, workspace and the stages\' buffers, from '
        'MXNet\'s storage profiler):')
    rows = [('process', 'device', 'params', 'grads', 'optimizer', 'other', 'total',
             'params / whole')]
    for name, table in [('one process', memory_one)] + [('node %d' % k, t) for k, t in
                                                        enumerate(memory_nodes)]:
        params = sum(row['params'] for row in table.values())
        for device, row in table.items():
            rows.append((name, device) + tuple(format_bytes(row[k]) for k in
                                               ('params', 'grads', 'optimizer', 'other',
                                                'total')) + ('',))
        rows.append((name, 'all', format_bytes(params), format_bytes(
            sum(r['grads'] for r in table.values())), format_bytes(
                sum(r['optimizer'] for r in table.values())), format_bytes(
                    sum(r['other'] for r in table.values())), format_bytes(
                        sum(r['total'] for r in table.values())), '%.3f' % (params / whole)))
    for line in columns(rows):
        log('  ' + line)
    return {'step_ratio': median, 'ratios': ratios, 'one_process_step_s': alone,
            'nodes_step_s': split, 'node_stats': stats, 'memory_one_process': memory_one,
            'memory_nodes': memory_nodes,
            'params_fraction': [sum(r['params'] for r in t.values()) / whole
                                for t in memory_nodes]}


# the steps of a command-line run whose peak --memory reports: (name, (module, class, attribute))
MEMORY_PHASES = (
    ('draw', ('mp_symbolic.training.loop', None, 'initial_values')),
    ('bind', ('mp_symbolic.training.loop', None, 'make_stepper')),
    ('resume', ('mp_symbolic.training.loop', None, '_resume')),
    ('training', ('mp_symbolic.training.loop', None, 'fit')),
    ('report', ('mp_symbolic.core.task', 'Task', 'report')),
    ('commit', ('mp_symbolic.training.loop', '_Checkpointer', 'commit')),
    ('digest', ('mp_symbolic.training.loop', None, 'params_digest')))


def _memory_child(args):
    """One run of the command line (``args.memory_child``: its arguments
    as JSON), traced; prints ``{'hwm', 'phases'}`` as its last line."""
    # pylint: disable=import-outside-toplevel
    from bench.memory_peak import status, traced
    from mp_symbolic.training import cli
    record = []
    peak = traced([call for _, call in MEMORY_PHASES], record)
    code = cli.main(json.loads(args.memory_child))
    if code:
        raise SystemExit(code)
    names = {call[2]: name for name, call in MEMORY_PHASES}
    for row in record:
        row['phase'] = names[row['phase']]
    print(json.dumps({'hwm': max(peak(), status()), 'phases': record}), flush=True)


def _memory_run(argv, nodes=None):
    """Runs ``train`` with ``argv`` in one child process, or in ``nodes``
    node processes; returns each process's answer."""
    env = dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0')
    child = [sys.executable, '-m', 'bench.nodes', '--memory-child']
    if nodes is None:
        procs = [subprocess.Popen(child + [json.dumps(argv)], stdout=subprocess.PIPE, text=True,
                                  env=env)]
    else:
        port = str(_free_port())
        procs = [subprocess.Popen(
            child + [json.dumps(argv + ['--nodes', str(nodes)])], stdout=subprocess.PIPE,
            text=True, env=dict(env, MASTER_ADDR='127.0.0.1', MASTER_PORT=port, RANK=str(k),
                                WORLD_SIZE=str(nodes))) for k in range(nodes)]
    outs = [p.communicate()[0] for p in procs]
    found = []
    for k, (proc, out) in enumerate(zip(procs, outs)):
        lines = out.strip().splitlines()
        if proc.returncode or not lines:
            raise RuntimeError('train %s%s: exit %d\n%s' % (
                ' '.join(argv), '' if nodes is None else ' (node %d)' % k, proc.returncode,
                '\n'.join(lines[-20:])))
        found.append(json.loads(lines[-1]))
    return found


def _phase_peaks(answer):
    """``{phase: (peak within it, seconds, bytes written)}``, the largest of
    its calls' peaks and the sum of their times and bytes."""
    peaks = {}
    for row in answer['phases']:
        peak, seconds, written = peaks.get(row['phase'], (0, 0.0, 0))
        peaks[row['phase']] = (max(peak, row['peak']), seconds + row['seconds'],
                               written + row['written'])
    return peaks


def _start_rss(answer):
    """The resident memory of a run as it starts drawing the initial values."""
    return next(row['rss_before'] for row in answer['phases'] if row['phase'] == 'draw')


def measure(width, layers, folder):
    """Runs the MLP of ``layers`` Dense layers of ``width`` (``train --task
    bench.memory_peak`` on ``cpu:0,cpu:1``) for one epoch and resumes it for
    a second, in one process, then over 2 node processes; the checkpoints go
    under ``folder`` (each let go once resumed).

    Returns:
        ``{'one process' | '2 nodes': {'train': [answer], 'resume': [answer],
        'files': {name: bytes}}}``: one answer per process (``{'hwm',
        'phases'}``, see :func:`_memory_child`), the files of the first run's
        checkpoint.
    """
    runs = {}
    for layout, nodes in (('one process', None), ('2 nodes', 2)):
        out = os.path.join(folder, layout.replace(' ', '-'))
        base = ['train', '--task', 'bench.memory_peak', '--task-arg', 'width=%d' % width,
                '--task-arg', 'layers=%d' % layers, '--devices', 'cpu:0,cpu:1', '--no-memory',
                '--no-progress']
        trained = _memory_run(base + ['--out', out], nodes)
        snap = os.path.realpath(os.path.join(out, 'current'))
        files = {name: os.path.getsize(os.path.join(snap, name))
                 for name in sorted(os.listdir(snap))}
        resumed = _memory_run(base + ['--resume', out, '--epochs', '2',
                                      '--out', out + '-resumed'], nodes)
        runs[layout] = {'train': trained, 'resume': resumed, 'files': files}
        for done in (out, out + '-resumed'):  # room for the next layout's
            shutil.rmtree(done)
    return runs


def memory(args, log=print):
    """Each node's peak resident memory beside one process's (``--memory``);
    returns the figures as a dict."""
    # pylint: disable=import-outside-toplevel
    from bench.memory_peak import param_bytes
    from mp_symbolic.tools.text import columns
    params = param_bytes(args.mlp_width, args.mlp_layers)
    with tempfile.TemporaryDirectory(prefix='mp-bench-nodes-') as folder:
        runs = measure(args.mlp_width, args.mlp_layers, folder)
    gb = 1e9
    log('peak resident memory (VmHWM) of each process: an MLP of %d Dense layers of %d on '
        'cpu:0,cpu:1, parameters %.3f GB, SGD with momentum %.3f GB (with the gradients %.3f '
        'GB of arrays); `train --task bench.memory_peak` for one epoch, then --resume for a '
        'second:' % (args.mlp_layers, args.mlp_width, params / gb, 2 * params / gb,
                     3 * params / gb))
    one = runs['one process']
    processes = [('one process', one['train'][0], one['resume'][0])] + [
        ('node %d' % k, t, r) for k, (t, r) in enumerate(zip(runs['2 nodes']['train'],
                                                             runs['2 nodes']['resume']))]
    whole = max(one['train'][0]['hwm'], one['resume'][0]['hwm'])
    rows = [('phase',) + tuple(name for name, _, _ in processes)]
    for run, key in (('train', 1), ('resume', 2)):
        peaks = [_phase_peaks(p[key]) for p in processes]
        for phase, _ in MEMORY_PHASES:
            if phase in peaks[0]:
                rows.append(('%s: %s' % (run, phase),) + tuple(
                    '%.2f GB' % (p[phase][0] / gb) if phase in p else '-' for p in peaks))
    start = [_start_rss(t) for _, t, _ in processes]  # MXNet, torch, the plan: no array yet
    rows.append(('resident as the draw starts',) + tuple('%.2f GB' % (r / gb) for r in start))
    rows.append(('VmHWM (train, resume)',) + tuple(
        '%.2f GB' % (max(t['hwm'], r['hwm']) / gb) for _, t, r in processes))
    rows.append(('VmHWM / one process\'s',) + tuple(
        '%.2f' % (max(t['hwm'], r['hwm']) / whole) for _, t, r in processes))
    rows.append(('above the start / one process\'s',) + tuple(
        '%.2f' % ((max(t['hwm'], r['hwm']) - s0) / (whole - start[0]))
        for (_, t, r), s0 in zip(processes, start)))
    for line in columns(rows):
        log('  ' + line)
    commits = [_phase_peaks(t)['commit'] for _, t, _ in processes]
    log('the checkpoint commit at the end of training: %s' % '; '.join(
        '%s %.2f s, %.3f GB written' % (name, c[1], c[2] / gb)
        for (name, _, _), c in zip(processes, commits)))
    for layout in runs:
        log('  %s committed: %s' % (layout, ', '.join(
            '%s %.3f GB' % (k, v / gb) if v >= 1e6 else '%s %d B' % (k, v)
            for k, v in runs[layout]['files'].items())))
    return {'params_bytes': params, 'one_process_hwm': whole, 'start_rss': start,
            'processes': {name: {'train': t, 'resume': r} for name, t, r in processes},
            'node_fraction': [max(t['hwm'], r['hwm']) / whole for _, t, r in processes[1:]],
            'files': {k: v['files'] for k, v in runs.items()}}


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.nodes', description=__doc__.split(
        '\n\n')[0])
    parser.add_argument(SERVE, choices=('one', 'node'), default=None, help=argparse.SUPPRESS)
    parser.add_argument('--chunks', type=int, default=4, help='micro-batches (default: 4)')
    parser.add_argument('--micro-batch', type=int, default=16,
                        help='sequences per micro-batch (default: 16)')
    parser.add_argument('--layers', type=int, default=4, help='transformer blocks (default: 4)')
    parser.add_argument('--width', type=int, default=128, help='num_hiddens (default: 128)')
    parser.add_argument('--steps', type=int, default=10, help='steps per round (default: 10)')
    parser.add_argument('--repeats', type=int, default=5, help='rounds (default: 5)')
    parser.add_argument('--quick', action='store_true',
                        help='a smoke run: 2 rounds of 2 steps of a smaller model')
    parser.add_argument('--out', default=None,
                        help='where the figures go as JSON (default: artifacts/bench/nodes.json, '
                             'with --memory nodes-memory.json)')
    parser.add_argument('--memory', action='store_true',
                        help="each node's peak resident memory beside one process's, for the "
                             "MLP of python -m bench.memory_peak (train, commit, report, resume)")
    parser.add_argument('--mlp-width', type=int, default=4096,
                        help='--memory: width of the MLP (default: 4096)')
    parser.add_argument('--mlp-layers', type=int, default=13,
                        help='--memory: Dense layers of the MLP (default: 13: 805 MB)')
    parser.add_argument('--memory-child', default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    if args.memory_child:
        _memory_child(args)
        return 0
    if args.quick:
        args.steps, args.repeats, args.layers, args.width, args.chunks = 2, 2, 2, 32, 2
        args.mlp_width, args.mlp_layers = 512, 4
    if args.out is None:
        args.out = os.path.join('artifacts', 'bench',
                                'nodes-memory.json' if args.memory else 'nodes.json')
    result = memory(args) if args.memory else run(args)
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=2, sort_keys=True)
    print('figures: %s' % args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
