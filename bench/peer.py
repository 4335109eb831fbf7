"""``python -m bench.peer``: the language model's training step against PyTorch's
on the same GPT, in one process and across two, in the same rounds.

The GPT of ``--task lm`` (:mod:`mp_symbolic.training.tasks.gpt` as it is:
2 blocks, 4 heads, context 64, the corpus' 166 characters) at each width of
``--widths``, batch ``--batch`` of random token ids, Adam at 3e-3 (the
task's), beside the same model in PyTorch (:mod:`bench.torch_gpt`) holding
the project's initial values (``mx.init.Normal(0.02)`` after
``mx.random.seed(0)``, copied by name):

* **one process**: the project's ``pipe.module()`` on ``cpu:0`` against
  PyTorch with the attention written out (``explicit``) and with
  ``scaled_dot_product_attention`` (``SDPA``);
* **2 processes, 1F1B**: the project's ``Pipeline(..., nodes=2,
  schedule='1f1b')`` (its stage runtime over torch.distributed's gloo) against
  torch.distributed.pipelining's ``PipelineStage`` + ``Schedule1F1B`` over
  gloo, the blocks cut where the project's plan cuts them, at each
  micro-batch count of ``--chunks``; PyTorch's last stage keeps a copy of the
  tied embedding, its gradient summed over both processes before the update.

Before any timing, the first step's loss of every PyTorch model must equal
the project's on the same batch (relative 1e-5), the one-process models'
probabilities the project's to 1e-7 each (float32 rounding; the loss alone
misses a change of the attention's weights, whose scores start near zero),
and the second step's loss, after one Adam update, the project's (relative
1e-5; it tells a tied embedding whose gradient lacks one of its uses): the
proof that both time the same function and the same update. Every process runs one thread
(``OMP_NUM_THREADS=1``, ``OMP_WAIT_POLICY=PASSIVE``, ``MKL_NUM_THREADS=1``,
``torch.set_num_threads(1)``; MXNet's one engine worker) and starts once;
each round times ``--steps`` steps of every row, the project's and
PyTorch's one after the other, the side that goes first alternating by
round, so load on the machine falls on both alike. A row's ratio is the
project's step over PyTorch's, per round and their median (below 1: the
project is faster). ``/proc/loadavg`` is read before and after each
width's rounds. Beside the wall time, each side's CPU time a step (every
thread of its processes, summed: the project's engine worker and its Python
thread) and its ratio, per round and their median, with the project's Python
threads' share apart (the engine's worker computes the ops; Python issues
them and the update): on a loaded machine the wall time counts the time a
process waited for a core, its CPU time does not.

``--project-env NAME=VALUE,...`` adds a row: the project's one-process step
in a process of its own with those variables in its environment (an engine,
bulking, any of MXNet's settings read at its start), its first two losses
checked as the others', against PyTorch's explicit attention in the same
rounds.

MFU (:func:`bench.lm.model_flops_per_token`, :func:`bench.lm.utilisation`):
the model's training FLOPs per token times tokens/s a process, over the
GEMM peak of one thread: a 1024^3 float32 product by MXNet's
``FullyConnected`` (oneDNN), MXNet's ``dot`` (OpenBLAS at the kernel
:mod:`mp_symbolic.tools.blas` chose) and ``torch.mm``, timed in the same
rounds; against the fastest of the three (the machine's peak) and against
the faster of MXNet's two.

``--profile``: the top operators of one step of each side at each width,
from MXNet's profiler (aggregate statistics, in a process of its own with
MXNet's bulking of ops off, so each op has its own row) and from
``torch.profiler`` (self CPU time): ms and calls a step, and the share of all
operators' time.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from .nodes import _ask, _free_port

__all__ = ['main', 'run', 'serve', 'same_loss']

LM = dict(vocab_size=166, block_size=64, num_heads=4)
OPTIMIZER = ('adam', 3e-3)     # the task's (mp_symbolic/training/tasks/lm.py)
SEED = 0
GEMM = 1024                    # the peak's square product
LOSS_RTOL = 1e-5               # float32 rounding of two orders of the same sums
SOFTMAX_ATOL = 1e-7            # the same, on each probability (about 1/166 each)
FIRST_SOFTMAX = 'first step softmax'   # the project's first output, beside its initial values
THREADS = {'OMP_NUM_THREADS': '1', 'OMP_WAIT_POLICY': 'PASSIVE', 'MKL_NUM_THREADS': '1'}
SERVE = '--serve'
ROLES = ('project', 'torch', 'project-node', 'torch-node', 'project-profile')


def same_loss(project, peer, rtol=LOSS_RTOL):
    """True where ``peer``'s first-step loss is ``project``'s to ``rtol``."""
    return abs(project - peer) <= rtol * abs(project)


def _batch(args, size):
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(SEED)
    shape = (size, LM['block_size'])
    return rng.integers(0, LM['vocab_size'], shape), rng.integers(0, LM['vocab_size'], shape)


def _loadavg():
    try:
        with open('/proc/loadavg') as f:
            return ' '.join(f.read().split()[:3])
    except OSError:
        return '%.2f %.2f %.2f' % os.getloadavg()


# --- the project's processes ----------------------------------------------------------------

def _project(args, nodes=None, chunks=1):
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    from mp_symbolic import Pipeline
    from mp_symbolic.training.tasks import gpt, lm
    cfg = gpt.GPTConfig(num_layers=args.layers, num_hiddens=args.width, **LM)
    shape = (args.batch, cfg.block_size)
    devices = 'cpu:0' if nodes is None else 'cpu:0,cpu:1'
    options = {} if nodes is None else dict(chunks=chunks, schedule='1f1b', nodes=nodes)
    pipe = Pipeline(gpt.build_blocks(cfg), devices, sample=shape, **options)
    # the language model's head ('softmax' in a tree without lm.LOSS, a --project-env row's)
    mod = pipe.module(loss=getattr(lm, 'LOSS', 'softmax'))
    mod.bind([('data', shape)], [('softmax_label', shape)])
    mx.random.seed(SEED)
    mod.init_params(initializer=gpt.INIT)
    mod.init_optimizer(kvstore=None, optimizer=OPTIMIZER[0],
                       optimizer_params={'learning_rate': OPTIMIZER[1]})
    data, label = _batch(args, args.batch)
    batch = mx.io.DataBatch([mx.nd.array(data)], [mx.nd.array(label)])
    return mod, batch, label


def _project_info():
    # pylint: disable=import-outside-toplevel
    import ctypes
    import bench
    import mxnet as mx
    kernel = os.environ.get('OPENBLAS_CORETYPE') or (
        bench.CHOICE.coretype if bench.CHOICE is not None else None)
    try:
        corename = mx.base._LIB.openblas_get_corename  # pylint: disable=protected-access
        corename.restype = ctypes.c_char_p
        runs = corename().decode('ascii', 'replace').strip()
    except AttributeError:   # an MXNet built on another BLAS
        runs = 'not OpenBLAS'
    return {'mxnet': mx.__version__,
            'OPENBLAS_CORETYPE': '%s (runs %s)' % (kernel or 'unset', runs),
            'engine workers': os.environ.get('MXNET_CPU_WORKER_NTHREADS', '1'),
            **{k: os.environ.get(k) for k in THREADS}}


def _gemm_mxnet():
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    import numpy as np
    rng = np.random.RandomState(1)
    x, w = (mx.nd.array(rng.uniform(-1, 1, (GEMM, GEMM))) for _ in range(2))
    return {'MXNet FullyConnected (oneDNN)': lambda: mx.nd.FullyConnected(
        x, w, no_bias=True, num_hidden=GEMM),
            'MXNet dot (OpenBLAS)': lambda: mx.nd.dot(x, w)}


def _time_gemm(products, count, wait):
    out = {}
    for name, product in products.items():
        wait()
        start = time.perf_counter()
        for _ in range(count):
            product()
        wait()
        out[name] = count * 2.0 * GEMM ** 3 / (time.perf_counter() - start)
    return out


def _top_mxnet(step, steps, top):
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    step(2)   # warm-up
    mx.profiler.set_config(profile_symbolic=True, profile_imperative=True, profile_memory=False,
                           profile_api=False, aggregate_stats=True,
                           filename=os.path.join(tempfile.mkdtemp(prefix='mp-bench-peer-'),
                                                 'profile.json'), continuous_dump=False)
    mx.profiler.set_state('run')
    step(steps)
    mx.nd.waitall()
    mx.profiler.set_state('stop')
    ops = json.loads(mx.profiler.dumps(format='json'))['Time'].get('operator', {})
    return _top({name: row['Total'] / steps for name, row in ops.items()},
                {name: row['Count'] / steps for name, row in ops.items()}, top)


def _top(ms, counts, top):
    """``[(op, ms per step, calls per step, % of the ops' total)]``, the ``top`` slowest."""
    total = sum(ms.values()) or 1.0
    rows = sorted(ms.items(), key=lambda item: -item[1])[:top]
    return {'total_ms': total,
            'ops': [(name, t, counts[name], 100.0 * t / total) for name, t in rows]}


def _serve_project(args, role):
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    import numpy as np
    from mp_symbolic.core.base import timing
    nodes = 2 if role == 'project-node' else None
    mod, batch, label = _project(args, nodes, args.chunks if nodes else 1)

    def step(count):
        for _ in range(count):
            mod.forward_backward(batch)
            mod.update()

    for line in sys.stdin:
        command = line.split()
        if command[0] == 'info':
            answer = _project_info()
            if nodes is None:
                from mp_symbolic import Pipeline
                from mp_symbolic.training.tasks import gpt
                cfg = gpt.GPTConfig(num_layers=args.layers, num_hiddens=args.width, **LM)
                answer['balance'] = list(Pipeline(gpt.build_blocks(cfg), 'cpu:0,cpu:1',
                                                  sample=(1, cfg.block_size)).plan.balance)
        elif command[0] == 'init':   # the initial values and the first step's output
            arg, aux = mod.get_params()
            values = {k: v.asnumpy() for k, v in {**arg, **aux}.items()}
            mod.forward_backward(batch)
            probs = mod.get_outputs()[0].asnumpy()
            mod.update()
            np.savez(command[1], **values, **{FIRST_SOFTMAX: probs})
            mod.forward_backward(batch)
            after = mod.get_outputs()[0].asnumpy()
            mod.update()
            answer = {key: float(-np.log(np.take_along_axis(
                p, label[..., None].astype(np.int64), -1).astype(np.float64)).mean())
                      for key, p in (('loss', probs), ('second_loss', after))}
        elif command[0] == 'time':
            cpu, thread = time.process_time(), time.thread_time()
            answer = {'seconds': timing.seconds(lambda: step(int(command[1]))),
                      'cpu': time.process_time() - cpu, 'thread': time.thread_time() - thread}
        elif command[0] == 'gemm':
            answer = _time_gemm(_gemm_mxnet(), int(command[1]), mx.nd.waitall)
        elif command[0] == 'profile':
            answer = _top_mxnet(step, int(command[1]), int(command[2]))
        else:
            break
        print(json.dumps(answer), flush=True)


# --- PyTorch's processes --------------------------------------------------------------------

def _torch():
    from mp_symbolic.core.transport.nodes import torch  # pylint: disable=import-outside-toplevel
    module = torch()
    module.set_num_threads(1)
    try:
        module.set_num_interop_threads(1)
    except RuntimeError:
        pass  # set already (it can be set once, before any parallel work)
    return module


def _torch_info(torch):
    return {'torch': torch.__version__, 'threads': torch.get_num_threads(),
            'interop threads': torch.get_num_interop_threads(),
            **{k: os.environ.get(k) for k in THREADS}}


def _torch_model(torch, args, values, attention):
    from . import torch_gpt  # pylint: disable=import-outside-toplevel
    torch.manual_seed(SEED)
    model = torch_gpt.GPT(LM['vocab_size'], LM['block_size'], args.layers, LM['num_heads'],
                          args.width, attention)
    torch_gpt.load(model, values)
    return model, torch.optim.Adam(model.parameters(), lr=OPTIMIZER[1])


def _top_torch(torch, step, steps, top):
    step(2)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        step(steps)
    ms = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()
          if e.self_cpu_time_total > 0}
    counts = {e.key: e.count / steps for e in prof.key_averages()}
    return _top(ms, counts, top)


def _serve_torch(args):
    # pylint: disable=import-outside-toplevel
    import numpy as np
    torch = _torch()
    from torch.nn import functional as F
    from mp_symbolic.core.base.scoped import discarded_stderr
    data, label = (torch.from_numpy(a) for a in _batch(args, args.batch))
    models = {}
    V = LM['vocab_size']

    def step(name, count, losses=None):
        model, optimizer = models[name]
        for _ in range(count):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(data).reshape(-1, V), label.reshape(-1))
            loss.backward()
            optimizer.step()
            if losses is not None:
                losses.append(loss.item())

    a = torch.randn(GEMM, GEMM)
    b = torch.randn(GEMM, GEMM)
    for line in sys.stdin:
        command = line.split()
        if command[0] == 'info':
            answer = _torch_info(torch)
        elif command[0] == 'init':
            values = dict(np.load(command[1]))
            answer = {}
            for name in ('explicit', 'sdpa'):
                models[name] = _torch_model(torch, args, values, name)
                with torch.no_grad():
                    probs = torch.softmax(models[name][0](data), dim=-1).numpy()
                losses = []
                step(name, 2, losses)
                answer[name] = {'loss': losses[0], 'second_loss': losses[1],
                                 'softmax_diff': float(np.abs(probs - values[FIRST_SOFTMAX]).max())}
        elif command[0] == 'time':
            start, cpu = time.perf_counter(), time.process_time()
            step(command[1], int(command[2]))
            answer = {'seconds': time.perf_counter() - start, 'cpu': time.process_time() - cpu}
        elif command[0] == 'gemm':
            answer = _time_gemm({'torch.mm': lambda: torch.mm(a, b)}, int(command[1]),
                                lambda: None)
        elif command[0] == 'profile':
            with discarded_stderr():   # the profiler's lines on fd 2
                answer = _top_torch(torch, lambda n: step(command[1], n), int(command[2]),
                                    int(command[3]))
        else:
            break
        print(json.dumps(answer), flush=True)


def _serve_torch_node(args):
    # pylint: disable=import-outside-toplevel
    import numpy as np
    torch = _torch()
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn import functional as F
    from . import torch_gpt
    rank = int(os.environ['RANK'])
    dist.init_process_group('gloo', rank=rank, world_size=2)
    data, label = (torch.from_numpy(a) for a in _batch(args, args.batch))
    V = LM['vocab_size']
    parts = {}

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))

    def build(values, balance):
        torch.manual_seed(SEED)
        module = torch_gpt.stages(LM['vocab_size'], LM['block_size'], args.layers,
                                  LM['num_heads'], args.width, balance)[rank]
        torch_gpt.load(module, values)
        parts['module'] = module
        parts['optimizer'] = torch.optim.Adam(module.parameters(), lr=OPTIMIZER[1])
        parts['schedule'] = Schedule1F1B(PipelineStage(module, rank, 2, torch.device('cpu')),
                                         args.chunks, loss_fn=loss_fn)

    def step(count, losses=None):
        module, optimizer, schedule = parts['module'], parts['optimizer'], parts['schedule']
        for _ in range(count):
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(data)
            else:
                out = []
                schedule.step(target=label, losses=out)
                if losses is not None:
                    losses.append(float(sum(loss.item() for loss in out) / len(out)))
            torch_gpt.sum_tied_grad(module)
            optimizer.step()

    for line in sys.stdin:
        command = line.split()
        if command[0] == 'info':
            answer = _torch_info(torch)
        elif command[0] == 'init':
            build(dict(np.load(command[1])), [int(b) for b in command[2].split(',')])
            losses = []
            step(2, losses)
            answer = {'loss': losses[0] if losses else None,
                      'second_loss': losses[1] if losses else None}
        elif command[0] == 'time':
            start, cpu = time.perf_counter(), time.process_time()
            step(int(command[1]))
            answer = {'seconds': time.perf_counter() - start, 'cpu': time.process_time() - cpu}
        else:
            break
        print(json.dumps(answer), flush=True)
    dist.destroy_process_group()


def serve(args):
    """One process of the benchmark (``args.serve``, one of :data:`ROLES`),
    answering commands on stdin with one JSON line each on stdout: ``info``
    (versions and thread settings), ``init PATH`` (the project: its initial
    values and first output written to PATH; PyTorch: read from PATH, with
    ``BALANCE`` after it for a stage), then the first two steps and their
    losses,
    ``time [MODEL] S`` (wall and CPU seconds of S steps), ``gemm N`` (FLOP/s of N 1024^3
    products), ``profile [MODEL] S TOP`` (the TOP slowest operators over S
    steps); anything else ends it.

    Raises:
        ValueError: torch is missing (``NodeError``), or the initial values
            do not fit the model.
    """
    if args.serve in ('project', 'project-node', 'project-profile'):
        _serve_project(args, args.serve)
    elif args.serve == 'torch':
        _serve_torch(args)
    else:
        _serve_torch_node(args)


# --- the rounds -----------------------------------------------------------------------------

class _Side:
    """One row's side: its processes and the command that times S steps."""

    def __init__(self, procs, command):
        self.procs, self.command = procs, command

    def seconds(self, steps):
        """``(seconds, CPU seconds, Python's)`` of ``steps`` steps: the
        slowest process's wall time, the CPU time of every thread of every
        process of the side, summed, and of their Python threads (all of it
        where the process answers for one thread)."""
        answers = _ask(self.procs, self.command % steps)
        return (max(a['seconds'] for a in answers), sum(a['cpu'] for a in answers),
                sum(a.get('thread', a['cpu']) for a in answers))


def _start(args, role, width, extra=(), env=None):
    argv = [sys.executable, '-m', 'bench.peer', SERVE, role, '--width', str(width),
            '--layers', str(args.layers), '--batch', str(args.batch)] + list(extra)
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, **THREADS, **(env or {})))


def _close(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _width(args, width, folder, log):
    """Starts every process of one width at once, checks the losses, times the rounds."""
    values = os.path.join(folder, 'initial-%d.npz' % width)
    procs = []
    try:
        project = _start(args, 'project', width)
        peer = _start(args, 'torch', width)
        procs += [project, peer]
        variants = [(' '.join('%s=%s' % kv for kv in env.items()),
                     _start(args, 'project', width, env=env)) for env in args.project_env]
        procs += [proc for _, proc in variants]
        pairs = {}
        for chunks in args.chunks:
            extra = ['--chunks', str(chunks)]
            pairs[chunks] = tuple(
                [_start(args, role, width, extra,
                        dict(MASTER_ADDR='127.0.0.1', MASTER_PORT=port, RANK=str(k),
                             WORLD_SIZE='2')) for k in range(2)]
                for role, port in (('project-node', str(_free_port())),
                                   ('torch-node', str(_free_port()))))
            procs += pairs[chunks][0] + pairs[chunks][1]
        info = {'project': _ask([project], 'info')[0], 'pytorch': _ask([peer], 'info')[0]}
        balance = info['project'].pop('balance')
        ours = _ask([project], 'init ' + values)[0]
        loss, after_update = ours['loss'], ours['second_loss']
        first = _ask([peer], 'init ' + values)[0]
        names = {'explicit': 'PyTorch, explicit attention', 'sdpa': 'PyTorch, SDPA'}
        losses = {names[k]: v['loss'] for k, v in first.items()}
        seconds = {names[k]: v['second_loss'] for k, v in first.items()}
        softmax = {names[k]: v['softmax_diff'] for k, v in first.items()}
        rows = {'one process, explicit attention': (_Side([project], 'time %d'),
                                                    _Side([peer], 'time explicit %d')),
                'one process, SDPA': (_Side([project], 'time %d'),
                                      _Side([peer], 'time sdpa %d'))}
        for k, (text, proc) in enumerate(variants):   # the project under other settings
            answer = _ask([proc], 'init ' + os.path.join(folder, 'variant-%d-%d.npz' % (width, k)))
            losses['the project, ' + text] = answer[0]['loss']
            seconds['the project, ' + text] = answer[0]['second_loss']
            rows['one process, explicit attention, ' + text] = (
                _Side([proc], 'time %d'), _Side([peer], 'time explicit %d'))
        for chunks, (ours, theirs) in pairs.items():
            _ask(ours, 'time 1')   # the first step: bound, connected
            first = _ask(theirs, 'init %s %s' % (values, ','.join(map(str, balance))))
            losses['PyTorch pipelining, %d micro-batches' % chunks] = first[1]['loss']
            seconds['PyTorch pipelining, %d micro-batches' % chunks] = first[1]['second_loss']
            rows['2 processes 1F1B, %d micro-batches' % chunks] = (
                _Side(ours, 'time %d'), _Side(theirs, 'time %d'))
        for name, value in losses.items():
            if not same_loss(loss, value):
                raise RuntimeError('%s: expected the first step\'s loss %.6f of the project\'s '
                                   'GPT on the same batch, found %.6f: not the same model'
                                   % (name, loss, value))
        for name, value in seconds.items():
            if not same_loss(after_update, value):
                raise RuntimeError('%s: expected the second step\'s loss %.6f of the project\'s '
                                   'GPT after one Adam update, found %.6f: not the same model '
                                   'or not the same update' % (name, after_update, value))
        for name, value in softmax.items():
            if not value <= SOFTMAX_ATOL:
                raise RuntimeError('%s: expected the first step\'s probabilities of the '
                                   'project\'s GPT to %g, found %.1e apart: not the same model'
                                   % (name, SOFTMAX_ATOL, value))
        log('width %d: first step\'s loss %.6f, the project; %s (equal to %g relative)'
            % (width, loss, ', '.join('%.6f %s' % (v, k) for k, v in losses.items()),
               LOSS_RTOL))
        log('width %d: second step\'s loss, after one Adam update: %.6f, the project; %s'
            % (width, after_update, ', '.join('%.6f %s' % (v, k) for k, v in seconds.items())))
        log('width %d: first step\'s probabilities, largest difference from the project\'s: '
            '%s (at most %g)' % (width, ', '.join('%.1e %s' % (v, k) for k, v in softmax.items()),
                                 SOFTMAX_ATOL))
        for side in rows.values():   # warm-up
            for half in side:
                half.seconds(1)
        load = [_loadavg()]
        times = {name: [] for name in rows}
        cpu = {name: [] for name in rows}
        python = {name: [] for name in rows}
        gemm = []
        for r in range(args.rounds):
            for name, (ours, theirs) in rows.items():
                pair = (ours, theirs) if r % 2 == 0 else (theirs, ours)
                first, second = ([t / args.steps for t in half.seconds(args.steps)]
                                 for half in pair)
                mine, other = (first, second) if r % 2 == 0 else (second, first)
                times[name].append((mine[0], other[0]))
                cpu[name].append((mine[1], other[1]))
                python[name].append((mine[2], other[2]))
            peak = _ask([project], 'gemm %d' % args.gemm)[0]
            peak.update(_ask([peer], 'gemm %d' % args.gemm)[0])
            gemm.append(peak)
        load.append(_loadavg())
        profile = None
        if args.profile:
            profile = _profile(args, width, peer)
        return {'info': info, 'loss': loss, 'losses': losses, 'softmax_diff': softmax,
                'second_loss': after_update, 'second_losses': seconds,
                'balance': balance,
                'times': times, 'cpu': cpu, 'python': python, 'gemm': gemm, 'load': load,
                'profile': profile}
    finally:
        _close(procs)


def _profile(args, width, peer):
    """The top operators of each side's one-process step (the project's in a
    process of its own, MXNet's bulking off)."""
    project = _start(args, 'project-profile', width, env={'MXNET_EXEC_BULK_EXEC_TRAIN': '0'})
    try:
        ours = _ask([project], 'profile %d %d' % (args.profile_steps, args.top))[0]
    finally:
        _close([project])
    out = {'project': ours}
    for name in ('explicit', 'sdpa'):
        out['PyTorch ' + name] = _ask([peer], 'profile %s %d %d' % (name, args.profile_steps,
                                                                    args.top))[0]
    return out


def _report(args, width, result, log):
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.text import columns
    from mp_symbolic.training.tasks import gpt
    from .lm import model_flops_per_token, utilisation
    times = result['times']
    log('width %d, batch %d of 64 characters, %d blocks, Adam; median of %d alternated rounds '
        'of %d steps (load %s before, %s after):'
        % (width, args.batch, args.layers, args.rounds, args.steps, *result['load']))
    table = [('step', 'project', 'PyTorch', 'project/PyTorch', 'each round')]
    medians = {}
    for name, pairs in times.items():
        ratios = [ours / theirs for ours, theirs in pairs]
        medians[name] = (statistics.median(o for o, _ in pairs),
                         statistics.median(t for _, t in pairs), statistics.median(ratios))
        table.append((name, '%.1f ms' % (medians[name][0] * 1e3),
                      '%.1f ms' % (medians[name][1] * 1e3), '%.2f' % medians[name][2],
                      ' '.join('%.2f' % r for r in ratios)))
    for line in columns(table):
        log('  ' + line)
    log('  CPU time a step (every thread of the row\'s processes, summed; the load delays a '
        'step but adds little to its CPU time; the project\'s Python threads apart):')
    table = [('step', 'project', "project's Python", 'PyTorch', 'project/PyTorch',
              'each round')]
    cpu_medians = {}
    for name, pairs in result['cpu'].items():
        ratios = [ours / theirs for ours, theirs in pairs]
        cpu_medians[name] = (statistics.median(o for o, _ in pairs),
                             statistics.median(t for _, t in pairs), statistics.median(ratios),
                             statistics.median(o for o, _ in result['python'][name]))
        table.append((name, '%.1f ms' % (cpu_medians[name][0] * 1e3),
                      '%.1f ms' % (cpu_medians[name][3] * 1e3),
                      '%.1f ms' % (cpu_medians[name][1] * 1e3), '%.2f' % cpu_medians[name][2],
                      ' '.join('%.2f' % r for r in ratios)))
    for line in columns(table):
        log('  ' + line)
    peaks = {name: statistics.median(g[name] for g in result['gemm'])
             for name in result['gemm'][0]}
    peak = max(peaks.values())
    cfg = gpt.GPTConfig(num_layers=args.layers, num_hiddens=width, **LM)
    flops = model_flops_per_token(cfg)
    log('  GEMM peak of one thread (1024^3 float32, median of the rounds): %s'
        % ', '.join('%s %.1f GFLOP/s' % (k, v / 1e9) for k, v in peaks.items()))
    rates = {}
    for name, (ours, theirs, _) in medians.items():
        cores = 2 if name.startswith('2 processes') else 1
        rates['project, ' + name] = (args.batch / ours / cores, None)
        rates['PyTorch, ' + name] = (args.batch / theirs / cores, None)
    ours = max(v for k, v in peaks.items() if k.startswith('MXNet'))
    util = utilisation(rates, cfg, peak)
    util_mxnet = utilisation(rates, cfg, ours)
    table = [('MFU (%d training FLOPs per token)' % flops, 'tokens/s a process',
              'MFU, peak %.1f GFLOP/s' % (peak / 1e9), 'MFU, MXNet\'s %.1f' % (ours / 1e9))]
    for name, row in util.items():
        table.append((name, '%.0f' % row['tokens_per_sec'], '%.3f' % row['mfu'],
                      '%.3f' % util_mxnet[name]['mfu']))
    for line in columns(table):
        log('  ' + line)
    if result['profile']:
        for side, prof in result['profile'].items():
            log('  top operators of one step, %s (%s, %.1f ms of ops a step):'
                % (side, "MXNet's profiler, bulking off" if side == 'project'
                   else 'torch.profiler, self CPU time', prof['total_ms']))
            table = [('op', 'ms a step', 'calls a step', '%')]
            for name, ms, calls, share in prof['ops']:
                table.append((name, '%.2f' % ms, '%g' % calls, '%.1f' % share))
            for line in columns(table):
                log('    ' + line)
    return {'medians': {k: dict(zip(('project_s', 'pytorch_s', 'ratio'), v))
                        for k, v in medians.items()},
            'cpu_medians': {k: dict(zip(('project_s', 'pytorch_s', 'ratio', 'project_python_s'),
                                        v))
                            for k, v in cpu_medians.items()},
            'gemm_peaks': peaks, 'flops_per_token': flops, 'utilisation': util,
            'utilisation_mxnet_gemm': util_mxnet}


def run(args, log=print):
    """Every width's rounds and tables; returns the figures.

    Raises:
        RuntimeError: a process ended before answering, or a PyTorch model's
            first-step loss differs from the project's.
    """
    log('threads: %s in every process; torch.set_num_threads(1); load %s'
        % (' '.join('%s=%s' % kv for kv in THREADS.items()), _loadavg()))
    out = {}
    with tempfile.TemporaryDirectory(prefix='mp-bench-peer-') as folder:
        for width in args.widths:
            result = _width(args, width, folder, log)
            if width == args.widths[0]:
                log('processes: the project %s; PyTorch %s'
                    % (', '.join('%s %s' % kv for kv in result['info']['project'].items()),
                       ', '.join('%s %s' % kv for kv in result['info']['pytorch'].items())))
                log('2 processes: both cut after block %d of %d (the project\'s plan: %s '
                    'blocks a stage)' % (result['balance'][0], sum(result['balance']),
                                        result['balance']))
            result.update(_report(args, width, result, log))
            out[width] = result
    return out


def _ints(text):
    try:
        values = [int(v) for v in text.split(',')]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError('expected positive integers separated by commas, '
                                         'found %r' % text)
    return values


def _environment(text):
    pairs = [item.partition('=') for item in text.split(',')]
    if not all(re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', name) and sep for name, sep, _ in pairs):
        raise argparse.ArgumentTypeError('expected NAME=VALUE pairs separated by commas, '
                                         'found %r' % text)
    return {name: value for name, _, value in pairs}


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.peer',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument(SERVE, choices=ROLES, default=None, help=argparse.SUPPRESS)
    parser.add_argument('--width', type=int, help=argparse.SUPPRESS)
    parser.add_argument('--widths', type=_ints, default=[64, 256],
                        help='model widths, multiples of 4 (default: 64,256)')
    parser.add_argument('--chunks', type=_ints, default=[4, 8],
                        help='micro-batch counts of the 2-process rows (default: 4,8)')
    parser.add_argument('--batch', type=int, default=16, help='sequences a step (default: 16)')
    parser.add_argument('--layers', type=int, default=2, help='transformer blocks (default: 2)')
    parser.add_argument('--steps', type=int, default=5, help='steps a round (default: 5)')
    parser.add_argument('--rounds', type=int, default=7, help='rounds (default: 7)')
    parser.add_argument('--gemm', type=int, default=3,
                        help='1024^3 products a round for the peak (default: 3)')
    parser.add_argument('--profile', action='store_true',
                        help="the top operators of each side's one-process step")
    parser.add_argument('--profile-steps', type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument('--top', type=int, default=12, help='operators --profile lists')
    parser.add_argument('--project-env', type=_environment, action='append', default=[],
                        metavar='NAME=VALUE[,NAME=VALUE...]',
                        help="a row more: the project's one-process step with these variables "
                             "in its environment (MXNet's settings, e.g. "
                             "MXNET_ENGINE_TYPE=NaiveEngine), against PyTorch's explicit "
                             "attention in the same rounds; repeatable")
    parser.add_argument('--quick', action='store_true',
                        help='a smoke run: width 32, 2 micro-batches, 2 rounds of 1 step')
    parser.add_argument('--out', default=os.path.join('artifacts', 'bench', 'peer.json'),
                        help='where the figures go as JSON (default: %(default)s)')
    args = parser.parse_args(argv)
    if args.serve:
        args.widths = [args.width]
        args.chunks = args.chunks[0]
        try:
            serve(args)
        except ValueError as err:   # torch missing (NodeError), initial values that do not fit
            print('error: %s' % err, file=sys.stderr)
            return 1
        return 0
    if args.quick:
        args.widths, args.chunks, args.rounds, args.steps, args.gemm = [32], [2], 2, 1, 1
        args.profile_steps, args.top = 1, 5
    bad = [w for w in args.widths if w % LM['num_heads']]
    if bad or args.batch < 1 or args.layers < 1 or args.steps < 1 or args.rounds < 1:
        parser.error('--widths, --batch, --layers, --steps, --rounds: expected multiples of %d '
                     'and positive integers, found %s, %d, %d, %d, %d'
                     % (LM['num_heads'], args.widths, args.batch, args.layers, args.steps,
                        args.rounds))
    bad = [c for c in args.chunks if args.batch % c]
    if bad:
        parser.error('--chunks: expected divisors of --batch (%d), found %s'
                     % (args.batch, ', '.join(map(str, bad))))
    try:
        result = run(args)
    except RuntimeError as err:
        print('error: %s' % err, file=sys.stderr)
        return 1
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump({str(k): {key: v[key] for key in ('loss', 'losses', 'softmax_diff', 'second_loss',
                                                    'second_losses', 'balance',
                                                    'times', 'cpu', 'python', 'cpu_medians', 'gemm',
                                                    'load', 'profile', 'medians', 'gemm_peaks',
                                                    'flops_per_token', 'utilisation',
                                                    'utilisation_mxnet_gemm', 'info')}
                   for k, v in result.items()}, f, indent=2, sort_keys=True)
    print('figures: %s' % args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
