"""``python -m bench.commit``: what one checkpoint commit of a 2-node job
costs each node: its wall time, the bytes it writes, its resident memory.

An MLP of ``--layers`` dense layers of ``--width`` (float32, no bias), split
into 2 stages on ``cpu:0,cpu:1`` over 2 node processes on this machine
(``Pipeline(..., nodes=2)``), one Adam step through ``pipe.module()``, then
``mp_symbolic.save_checkpoint`` called by both nodes ``--repeats`` times into
one folder. Per node and commit: the wall time of the call (every node waits
for the commit to end), the bytes the process passed to ``write(2)``
(``wchar`` of ``/proc/self/io``: files, and the control messages' sockets),
and its peak resident memory during the call (``VmHWM`` after
``/proc/self/clear_refs`` reset it) beside its resident memory before; the
median over the repeats. The committed snapshot's files are listed with
their sizes.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ['main']


def _status(field):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1]) * 1024
    return 0


def _wchar():
    with open('/proc/self/io') as f:
        return int(next(l for l in f if l.startswith('wchar:')).split()[1])


def _node(args):
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    import numpy as np
    import mp_symbolic
    from mp_symbolic import Pipeline
    net = mx.gluon.nn.HybridSequential()
    with net.name_scope():
        for _ in range(args.layers):
            net.add(mx.gluon.nn.Dense(args.width, use_bias=False, flatten=False))
    shape = (8, args.width)
    pipe = Pipeline(list(net), 'cpu:0,cpu:1', sample=shape, schedule='1f1b', nodes=2)
    mod = pipe.module(loss='l2', label_name='label')
    mod.bind([('data', shape)], [('label', shape)])
    mx.random.seed(0)
    mod.init_params(initializer=mx.init.Xavier())
    mod.init_optimizer(kvstore=None, optimizer='adam', optimizer_params={'learning_rate': 1e-3})
    rng = np.random.default_rng(0)
    mod.forward_backward(mx.io.DataBatch([mx.nd.array(rng.standard_normal(shape))],
                                         [mx.nd.array(rng.standard_normal(shape))]))
    mod.update()
    mx.nd.waitall()
    rows = []
    for epoch in range(1, args.repeats + 1):
        before = _status('VmRSS')
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')  # resets VmHWM to the current resident size
        written = _wchar()
        start = time.perf_counter()
        mp_symbolic.save_checkpoint(mod, args.folder, epoch=epoch)
        rows.append({'seconds': time.perf_counter() - start, 'wchar': _wchar() - written,
                     'rss_before': before, 'peak': _status('VmHWM')})
    print(json.dumps({'node': int(os.environ['RANK']),
                      'params_bytes': sum(v.size * 4 for v in mod.get_params()[0].values()),
                      'rows': rows}), flush=True)


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.commit', description=__doc__)
    parser.add_argument('--layers', type=int, default=4)
    parser.add_argument('--width', type=int, default=8)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--node', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--folder', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.node:
        return _node(args)
    port = _free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, 'run')
        procs = [subprocess.Popen(
            [sys.executable, '-m', 'bench.commit', '--node', '--folder', out, '--layers',
             str(args.layers), '--width', str(args.width), '--repeats', str(args.repeats)],
            env=dict(os.environ, MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(k),
                     WORLD_SIZE='2', MXNET_SUBGRAPH_VERBOSE='0'),
            stdout=subprocess.PIPE, text=True) for k in range(2)]
        found = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
        if any(p.returncode for p in procs):
            sys.exit('error: a node failed (statuses %s)' % [p.returncode for p in procs])
        snap = os.path.realpath(os.path.join(out, 'current'))
        files = {name: os.path.getsize(os.path.join(snap, name))
                 for name in sorted(os.listdir(snap))}
    mib = 1 << 20

    def size(n):
        return '%d B' % n if n < mib else '%.1f MiB' % (n / mib)

    print('MLP of %d layers of width %d over 2 nodes, Adam; %d commits (median):'
          % (args.layers, args.width, args.repeats))
    print('  node  params     commit     written (wchar)  rss before  peak in commit')
    for node in found:
        rows = node['rows']
        print('  %-4d  %-9s  %-9s  %-15s  %-10s  %s' % (
            node['node'], size(node['params_bytes']),
            '%.3f s' % statistics.median(r['seconds'] for r in rows),
            size(statistics.median(r['wchar'] for r in rows)),
            '%.0f MiB' % (statistics.median(r['rss_before'] for r in rows) / mib),
            '%.0f MiB' % (statistics.median(r['peak'] for r in rows) / mib)))
    print('  committed: %s' % ', '.join('%s %s' % (k, size(v)) for k, v in files.items()))
    return 0


if __name__ == '__main__':
    sys.exit(main())
