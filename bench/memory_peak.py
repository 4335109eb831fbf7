"""``python -m bench.memory_peak``: one process's peak resident memory
(``VmHWM``) against the bytes of its arrays.

The model is an MLP of ``--layers`` Dense layers, ``--width`` wide (the last
to one output, L2 loss): at the defaults 13 layers of 4096, 805 MB of
float32 parameters. It is trained with SGD and momentum, so the arrays a
step needs are its parameters, their gradients and one momentum each: three
times the parameters' bytes. Each configuration runs in a child process of
its own, which reports its ``VmHWM`` (``/proc/self/status``) as it ends:

* ``cli``: ``python -m mp_symbolic train --task bench.memory_peak`` (this
  module is the task file: :func:`task`), a checkpoint committed at the end,
  the memory table's child processes included unless ``--no-memory``;
* ``python``: ``Pipeline(blocks, devices).module('l2')``, MXNet's ``fit``
  with ``initializer=Xavier()``, then ``mp_symbolic.save_checkpoint``;

each on 1 device (``cpu:0``) and on 2 (``cpu:0,cpu:1``). MXNet's own
baseline is the ``VmHWM`` of a process that imported MXNet and ran one
tiny operator. The table gives, per configuration, the array bytes, the
baseline, the peak, and the peak over arrays plus baseline.

``--trace`` also prints where the memory goes: for a ``cli`` run, the
resident memory before and after each step of the run (:data:`PHASES`) and
the peak within it (``VmHWM`` reset before each through
``/proc/self/clear_refs``); for a ``python`` run, ``VmRSS`` and ``VmHWM``
after each batch, ``fit`` and ``save_checkpoint``.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

__all__ = ['main', 'param_bytes', 'reset_peak', 'status', 'task', 'traced', 'wchar']

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = 'memory_peak'


def status(field='VmHWM'):
    """``field`` of ``/proc/self/status`` (``VmHWM``, ``VmRSS``, ...) in bytes."""
    with open('/proc/self/status') as lines:
        for line in lines:
            if line.startswith(field + ':'):
                return int(line.split()[1]) * 1024
    raise RuntimeError('/proc/self/status: expected a %s line, found none' % field)


def _blocks(width, layers):
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    widths = [width] * layers + [1]
    return [mx.gluon.nn.Dense(widths[i + 1], in_units=widths[i], prefix='layer%d_' % i,
                              weight_initializer=mx.init.Xavier())
            for i in range(layers)]


def _data(width, examples, seed=0):
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(seed)
    X = rng.normal(0.0, 1.0, (examples, width)).astype(np.float32)
    y = (X[:, :1] + 1.0).astype(np.float32)
    return X, y


def param_bytes(width, layers):
    """Bytes of the MLP's float32 parameters."""
    widths = [width] * layers + [1]
    return 4 * sum(widths[i] * widths[i + 1] + widths[i + 1] for i in range(layers))


def task(width=4096, layers=13, examples=256, seed=0):
    """The MLP as a task file (``--task bench.memory_peak``): ``layers``
    Dense layers of ``width``, random inputs, L2 loss, SGD with momentum."""
    import mp_symbolic  # pylint: disable=import-outside-toplevel
    return mp_symbolic.Task(name=NAME, blocks=lambda: _blocks(width, layers),
                            train=_data(width, examples, seed), loss='l2', batch_size=64,
                            num_epochs=1, optimizer='sgd', lr=1e-5, momentum=0.9,
                            description='an MLP of %d Dense layers of %d' % (layers, width))


# -- the children ------------------------------------------------------------

def reset_peak():
    """Sets ``VmHWM`` to the present ``VmRSS`` (Linux 4.0 and later)."""
    with open('/proc/self/clear_refs', 'w') as out:
        out.write('5')


# the calls of a command-line run whose memory --trace reports: (module, object, attribute)
PHASES = (('mp_symbolic.training.loop', None, 'initial_values'),
          ('mp_symbolic.training.loop', None, 'make_stepper'),
          ('mp_symbolic.training.loop', None, 'plan_memory'),
          ('mp_symbolic.training.loop', None, 'fit'),
          ('mp_symbolic.training.loop', None, 'params_digest'),
          ('mp_symbolic.training.symbolic', 'ModuleStepper', 'params'),
          ('mp_symbolic.training.symbolic', 'ModuleStepper', 'predict'),
          ('mp_symbolic.training.symbolic', 'ModuleStepper', 'arg_aux'),
          ('mp_symbolic.training.symbolic', 'ModuleStepper', 'optimizer_states'),
          ('mp_symbolic.training.loop', None, 'module_arrays'),
          ('mp_symbolic.training.loop', None, 'commit_checkpoint'),
          ('mp_symbolic.tools.checkpoint', None, 'save_params'),
          ('mp_symbolic.tools.checkpoint', None, '_save_states'))


def wchar():
    """Bytes this process has passed to ``write(2)`` (``/proc/self/io``)."""
    with open('/proc/self/io') as lines:
        return int(next(l for l in lines if l.startswith('wchar:')).split()[1])


def traced(calls, record=None):
    """Wraps each of ``calls`` (``(module, class or None, attribute)``, see
    PHASES) to measure the resident memory before and after it and its own
    peak (``VmHWM`` reset as it starts); without ``record`` it prints them,
    else it appends ``{'phase', 'rss_before', 'peak', 'rss_after', 'seconds',
    'written'}`` (``written``: :func:`wchar`'s bytes) to ``record``.

    Returns:
        A function of no arguments: the run's peak so far.
    """
    import importlib  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel
    peak = [status()]

    def wrap(name, function):
        def call(*args, **kwargs):
            before, written, start = status('VmRSS'), wchar(), time.perf_counter()
            peak[0] = max(peak[0], status())
            reset_peak()
            try:
                return function(*args, **kwargs)
            finally:
                during = status()
                peak[0] = max(peak[0], during)
                if record is None:
                    sys.stdout.write('[%s: rss before %.2f GB, peak within %.2f GB, after '
                                     '%.2f GB]\n' % (name, before / 1e9, during / 1e9,
                                                      status('VmRSS') / 1e9))
                else:
                    record.append({'phase': name, 'rss_before': before, 'peak': during,
                                   'rss_after': status('VmRSS'),
                                   'seconds': time.perf_counter() - start,
                                   'written': wchar() - written})
        return call
    for module, owner, attribute in calls:
        target = importlib.import_module(module)
        if owner is not None:
            target = getattr(target, owner)
        setattr(target, attribute, wrap(attribute, getattr(target, attribute)))
    return lambda: max(peak[0], status())


def _baseline():
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    (mx.nd.ones((2, 2)) + 1).asnumpy()
    return {}


def _cli(args, out):
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    argv = ['train', '--task', 'bench.memory_peak', '--task-arg', 'width=%d' % args.width,
            '--task-arg', 'layers=%d' % args.layers, '--devices', args.devices,
            '--out', out] + (['--no-memory'] if args.no_memory else [])
    peak = traced(PHASES) if args.trace else status
    code = cli.main(argv)
    if code:
        raise SystemExit(code)
    return {'peak': peak()}


def _python(args, out):
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    import mp_symbolic
    from mp_symbolic import Pipeline
    X, y = _data(args.width, 256)
    pipe = Pipeline(_blocks(args.width, args.layers), args.devices, sample=(64, args.width))
    mod = pipe.module(loss='l2')
    mx.random.seed(0)
    trace = []

    def point(what):
        if args.trace:
            trace.append((what, status('VmRSS'), status()))
    mod.fit(mx.io.NDArrayIter(X, y, batch_size=64), num_epoch=1, optimizer='sgd',
            optimizer_params={'learning_rate': 1e-5, 'momentum': 0.9},
            initializer=mx.init.Xavier(),
            batch_end_callback=lambda param: point('batch %d' % param.nbatch))
    point('fit')
    mp_symbolic.save_checkpoint(mod, out, 1, name=NAME)
    point('save_checkpoint')
    return {'trace': trace}


def _child(args):
    with tempfile.TemporaryDirectory(prefix='memory_peak') as folder:
        out = os.path.join(folder, 'out')
        extra = {'baseline': _baseline, 'cli': lambda: _cli(args, out),
                 'python': lambda: _python(args, out)}[args.child]()
    sys.stdout.write(json.dumps(dict(extra, hwm=max(status(), extra.pop('peak', 0)))) + '\n')


def _run(args, child, devices=None, **extra):
    argv = [sys.executable, '-m', 'bench.memory_peak', '--child', child,
            '--width', str(args.width), '--layers', str(args.layers)]
    if devices:
        argv += ['--devices', devices]
    if args.no_memory:
        argv.append('--no-memory')
    if extra.get('trace'):
        argv.append('--trace')
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                          check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise RuntimeError('%s on %s: exit %d\n%s' % (child, devices, proc.returncode,
                                                       proc.stdout))
    for line in lines[:-1]:
        if extra.get('trace'):
            print('    ' + line)
    return json.loads(lines[-1])


def build_parser():
    parser = argparse.ArgumentParser(
        prog='python -m bench.memory_peak',
        description="One process's peak resident memory against its arrays' bytes.")
    parser.add_argument('--width', type=int, default=4096)
    parser.add_argument('--layers', type=int, default=13)
    parser.add_argument('--routes', default='cli,python')
    parser.add_argument('--plans', default='cpu:0;cpu:0,cpu:1')
    parser.add_argument('--no-memory', action='store_true',
                        help="cli: skip the memory table's child processes")
    parser.add_argument('--trace', action='store_true',
                        help='print VmRSS and VmHWM at each line of each run')
    parser.add_argument('--child', choices=('baseline', 'cli', 'python'), help=argparse.SUPPRESS)
    parser.add_argument('--devices', help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.child:
        _child(args)
        return 0
    from mp_symbolic.tools.text import columns  # pylint: disable=import-outside-toplevel
    params = param_bytes(args.width, args.layers)
    arrays = 3 * params  # parameters, gradients, momentum
    baseline = _run(args, 'baseline')['hwm']
    print('MLP of %d Dense layers of %d: parameters %.3f GB; arrays (parameters, gradients, '
          'momentum) %.3f GB; MXNet baseline (import, one op) %.3f GB'
          % (args.layers, args.width, params / 1e9, arrays / 1e9, baseline / 1e9))
    rows = [('route', 'devices', 'arrays GB', 'baseline GB', 'VmHWM GB',
             'VmHWM / (arrays + baseline)')]
    for route in args.routes.split(','):
        for devices in args.plans.split(';'):
            result = _run(args, route, devices, trace=args.trace)
            for what, rss, hwm in result.get('trace', []):
                print('    [rss %5.2f GB, hwm %5.2f GB] %s' % (rss / 1e9, hwm / 1e9, what))
            rows.append((route + (' --no-memory' if route == 'cli' and args.no_memory else ''),
                         devices, '%.3f' % (arrays / 1e9), '%.3f' % (baseline / 1e9),
                         '%.3f' % (result['hwm'] / 1e9),
                         '%.2f' % (result['hwm'] / (arrays + baseline))))
            print('  '.join(rows[-1]), flush=True)
    print()
    for line in columns(rows):
        print(line)
    return 0


if __name__ == '__main__':
    sys.exit(main())
