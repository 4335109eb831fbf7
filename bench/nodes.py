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
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

__all__ = ['main', 'serve']

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
    import mxnet as mx
    from mp_symbolic.core import timing
    from mp_symbolic.tools.memory import device_memory
    from mp_symbolic.tools.trace import load_trace, storage_bytes
    nodes = 2 if args.serve == 'node' else None
    trace = os.path.join(tempfile.mkdtemp(prefix='mp-bench-nodes-'), 'memory.json')
    mx.profiler.set_config(profile_symbolic=False, profile_imperative=False, profile_api=False,
                           profile_memory=True, aggregate_stats=False, filename=trace)
    mx.profiler.set_state('run')
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
            mx.nd.waitall()
            mx.profiler.set_state('stop')
            mx.profiler.dump()
            table = device_memory(mod, storage_bytes(load_trace(trace)))
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
    parser.add_argument('--out', default=os.path.join('artifacts', 'bench', 'nodes.json'),
                        help='where the figures go as JSON (default: %(default)s)')
    args = parser.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    if args.quick:
        args.steps, args.repeats, args.layers, args.width, args.chunks = 2, 2, 2, 32, 2
    result = run(args)
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=2, sort_keys=True)
    print('figures: %s' % args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
