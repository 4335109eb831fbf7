"""``python -m bench.zero``: the optimizer state sharded across replicas
(``Pipeline(..., shard_optimizer=True)``) beside the unsharded run, in one
process.

The model: ``--layers`` Dense layers of ``--width`` units (ReLU between),
cut into 2 stages, R replicas of the pipeline on ``cpu:0`` .. ``cpu:2R-1``,
trained with Adam (fp32) through ``pipe.module()`` on a batch of
``--batch`` random examples, the gradients summed by the ``local`` kvstore.
For each R of ``--replicas``:

* **bytes**: each device's optimizer state after one step, measured
  (:func:`mp_symbolic.tools.memory.memory_table`: the updater's arrays)
  without and with sharding, and estimated before allocation
  (:func:`mp_symbolic.estimate_memory`), beside the formula: Adam keeps 8
  bytes a parameter, so a stage of P parameters holds 8P bytes on every
  replica unsharded and 8P/R sharded;
* **values**: the parameters and optimizer state after ``--steps`` Adam
  steps of both runs from the same initial values and batches: how many
  arrays are equal bit for bit, and the largest difference;
* **step time**: ``--rounds`` rounds, each timing one step of the unsharded
  run and one of the sharded run (:func:`mp_symbolic.core.base.timing.repeat`:
  round-robin, each reading after ``mx.nd.waitall()``), the order of the
  two alternated between rounds; the medians and their ratio (sharded over
  unsharded: below 1 is faster).

The devices ``cpu(i)`` share the host's cores: the step times are what the
sharded update costs in compute and copies on them, not what it saves on a
device whose memory bounds the model.

``--launch ROUNDS`` adds the command line over processes: ``train`` of the
regression task with :data:`WIDTHS` (Adam, ``--epochs`` 2), once sharded
and once not in each round (the order alternated between rounds), under
``python -m mp_symbolic launch --workers 2 --servers 1`` (``dist_sync``,
``cpu:0,cpu:1`` each) and under ``launch --nodes 2`` (``--replicas 2`` on
``cpu:0`` .. ``cpu:3``): the median of the wall time each run's
``training:`` line prints (the epochs, without start-up and checkpoints),
their ratio, and whether every run of a layout printed the same
``parameters sha256``.
"""
import re
import subprocess
import statistics
import sys
import tempfile

import mxnet as mx
import numpy as np
from mxnet import gluon

from mp_symbolic import Pipeline, estimate_memory
from mp_symbolic.core.base import timing
from mp_symbolic.tools.cliargs import OneLineArgumentParser
from mp_symbolic.tools.memory import format_bytes, memory_table
from mp_symbolic.tools.text import columns

__all__ = ['main']

ADAM_BYTES = 8  # fp32 Adam: mean and variance, 4 bytes each, per parameter
WIDTHS = '2,256,256,256,256,256,256,1'
LAYOUTS = (('2 dist_sync workers', ['--workers', '2', '--servers', '1'],
            ['--devices', 'cpu:0,cpu:1']),
           ('2 nodes, 2 replicas', ['--nodes', '2'],
            ['--devices', 'cpu:0,cpu:1,cpu:2,cpu:3', '--replicas', '2']))


def _launched(how, flags, out):
    """``(seconds of training, {parameters digests})`` of one launched run."""
    job = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'launch'] + how + [
        '--', 'train', '--widths', WIDTHS, '--optimizer', 'adam', '--epochs', '2',
        '--no-progress', '--no-memory', '--out', out] + flags, capture_output=True, text=True,
        timeout=1200, check=False)
    if job.returncode != 0:
        raise RuntimeError('launch: expected exit status 0, found %d: %s'
                           % (job.returncode, (job.stderr or job.stdout).strip()[-300:]))
    walls = [float(w) for w in re.findall(r'training: ([0-9.]+) s wall', job.stdout)]
    return max(walls), set(re.findall(r'parameters sha256: ([0-9a-f]{64})', job.stdout))


def launch_rows(rounds, folder):
    """Median training seconds of each layout, unsharded and sharded, in alternated rounds."""
    rows = []
    for name, how, flags in LAYOUTS:
        times, digests = {False: [], True: []}, set()
        for r in range(rounds):
            for shard in ((False, True) if r % 2 == 0 else (True, False)):
                seconds, found = _launched(how, flags + (['--shard-optimizer'] if shard else []),
                                           '%s/%s-%d-%d' % (folder, how[0][2:], r, shard))
                times[shard].append(seconds)
                digests |= found
        plain, sharded = (statistics.median(times[s]) for s in (False, True))
        rows.append([name, '%.2f' % plain, '%.2f' % sharded, '%.3f' % (sharded / plain),
                     'yes' if len(digests) == 1 else 'no (%d)' % len(digests)])
    return rows


def _blocks(layers, width):
    return [gluon.nn.Dense(width, activation='relu' if i < layers - 1 else None,
                           prefix='zero%d_' % i) for i in range(layers)]


def _module(args, replicas, shard):
    devices = ','.join('cpu:%d' % i for i in range(2 * replicas))
    pipe = Pipeline(_blocks(args.layers, args.width), devices, sample=(args.batch, args.width),
                    replicas=replicas, shard_optimizer=shard)
    mod = pipe.module('l2')
    mod.bind([('data', (args.batch, args.width))], [('softmax_label', (args.batch, args.width))])
    mx.random.seed(0)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(kvstore='local', optimizer='adam',
                       optimizer_params={'learning_rate': 1e-3})
    return pipe, mod


def _batches(args, count):
    rng = np.random.default_rng(0)
    return [mx.io.DataBatch([mx.nd.array(rng.standard_normal((args.batch, args.width)))],
                            [mx.nd.array(rng.standard_normal((args.batch, args.width)))])
            for _ in range(count)]


def _step(mod, batch):
    mod.forward_backward(batch)
    mod.update()


def _stage_params(pipe, mod):
    """``{device of replica 0's stage s: parameters of stage s}``."""
    group, counts = mod._exec_group, {}  # pylint: disable=protected-access
    for name, arrays in zip(group.param_names, group.param_arrays):
        device = str(arrays[0].context)
        counts[device] = counts.get(device, 0) + arrays[0].size
    return [counts[str(d)] for d in pipe.plan.replica_devices[0]]


def bytes_rows(args, replicas, plain, sharded, pipe):
    """The optimizer bytes per device, measured and estimated, beside the formula."""
    before = {r.device: r.optimizer for r in memory_table(plain)}
    after = {r.device: r.optimizer for r in memory_table(sharded)}
    estimated = {r.device: r.optimizer for r in estimate_memory(
        pipe, data_shapes=[('data', (args.batch, args.width))],
        label_shapes=[('softmax_label', (args.batch, args.width))], optimizer='adam')}
    params = _stage_params(pipe, sharded)
    rows = []
    for k, devices in enumerate(pipe.plan.replica_devices):
        for s, device in enumerate(devices):
            device = str(device)
            formula = ADAM_BYTES * params[s] / replicas
            rows.append(['R=%d' % replicas, device, 'stage %d, replica %d' % (s, k),
                         str(params[s]), str(before[device]), str(after[device]),
                         str(estimated.get(device, 0)), '%.0f' % formula,
                         '%.4f' % (after[device] / formula)])
    return rows


def _arrays(mod):
    arg_params, _ = mod.get_params()
    values = [(n, v.asnumpy()) for n, v in sorted(arg_params.items())]
    states = mod.optimizer_states()
    for name, entry in sorted(states['params'].items()):
        for i, item in enumerate(entry['state']['items']):
            values.append(('%s state %d' % (name, i), states['arrays'][item['a']]))
    return values


def equality_row(args, replicas, plain, sharded):
    """Arrays equal bit for bit after ``args.steps`` steps, and the largest difference."""
    for batch in _batches(args, args.steps):
        _step(plain, batch)
        _step(sharded, batch)
    mx.nd.waitall()
    ours, theirs = _arrays(sharded), _arrays(plain)
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    equal = sum(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(ours, theirs))
    largest = max(float(np.max(np.abs(a - b))) for (_, a), (_, b) in zip(ours, theirs))
    return ['R=%d' % replicas, str(args.steps), '%d of %d' % (equal, len(ours)),
            '%.3g' % largest]


def time_row(args, replicas, plain, sharded):
    """Median seconds a step, unsharded and sharded, in alternated rounds."""
    batch = _batches(args, 1)[0]
    runs = {'unsharded': lambda: _step(plain, batch), 'sharded': lambda: _step(sharded, batch)}
    times = {name: [] for name in runs}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(list(runs)))
        got = timing.repeat({name: runs[name] for name in order}, 1, warmup=1 if r == 0 else 0)
        for name, seconds in got.items():
            times[name] += seconds
    plain_s, sharded_s = (statistics.median(times[n]) for n in ('unsharded', 'sharded'))
    return ['R=%d' % replicas, '%.2f' % (plain_s * 1e3), '%.2f' % (sharded_s * 1e3),
            '%.3f' % (sharded_s / plain_s)]


def parse(argv):
    parser = OneLineArgumentParser(prog='python -m bench.zero', description=__doc__.split('\n')[0])
    parser.add_argument('--layers', type=int, default=16)
    parser.add_argument('--width', type=int, default=256)
    parser.add_argument('--batch', type=int, default=32)
    parser.add_argument('--replicas', default='2,4', help='replica counts (default: 2,4)')
    parser.add_argument('--steps', type=int, default=100)
    parser.add_argument('--rounds', type=int, default=30)
    parser.add_argument('--launch', type=int, default=0, metavar='ROUNDS',
                        help='rounds of the launched runs (default: 0, none)')
    args = parser.parse_args(argv)
    args.replicas = [int(r) for r in args.replicas.split(',')]
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    print('bench.zero: %d Dense layers of %d units in 2 stages, Adam (fp32), batch %d'
          % (args.layers, args.width, args.batch))
    sizes, values, times = [], [], []
    for replicas in args.replicas:
        pipe, sharded = _module(args, replicas, True)
        _, plain = _module(args, replicas, False)
        batch = _batches(args, 1)[0]
        _step(plain, batch)
        _step(sharded, batch)
        mx.nd.waitall()
        sizes += bytes_rows(args, replicas, plain, sharded, pipe)
        times.append(time_row(args, replicas, plain, sharded))
        _, sharded = _module(args, replicas, True)  # both from the same start again
        _, plain = _module(args, replicas, False)
        values.append(equality_row(args, replicas, plain, sharded))
    print('optimizer state per device after one step (bytes; formula: 8 x stage parameters / R):')
    for line in columns([['R', 'device', 'holds', 'stage params', 'unsharded', 'sharded',
                          'estimated', 'formula', 'sharded/formula']] + sizes):
        print('  ' + line)
    for replicas in args.replicas:
        rows = [r for r in sizes if r[0] == 'R=%d' % replicas]
        print('  R=%d, every device: %s unsharded, %s sharded (%.4f of it)'
              % (replicas, format_bytes(sum(int(r[4]) for r in rows)),
                 format_bytes(sum(int(r[5]) for r in rows)),
                 sum(int(r[5]) for r in rows) / sum(int(r[4]) for r in rows)))
    print('parameters and optimizer state after the steps, sharded against unsharded:')
    for line in columns([['R', 'steps', 'arrays equal bit for bit', 'largest difference']] +
                        values):
        print('  ' + line)
    print('step time, median of %d alternated rounds (ms):' % args.rounds)
    for line in columns([['R', 'unsharded', 'sharded', 'sharded/unsharded']] + times):
        print('  ' + line)
    if args.launch:
        with tempfile.TemporaryDirectory(prefix='bench-zero-') as folder:
            rows = launch_rows(args.launch, folder)
        print('train --widths %s over processes, training seconds, median of %d alternated '
              'rounds:' % (WIDTHS, args.launch))
        for line in columns([['layout', 'unsharded', 'sharded', 'sharded/unsharded',
                              'one parameters digest']] + rows):
            print('  ' + line)
    return 0


if __name__ == '__main__':
    sys.exit(main())
