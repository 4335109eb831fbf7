"""Memory per device of a model-parallel ``mx.mod.Module``: what sits where.

Per device, in bytes:

* ``params``, ``grads``, ``aux``: the executor's ``arg_dict`` (parameters
  only), ``grad_dict`` and ``aux_dict`` arrays, by their ``.context``;
* ``optimizer``: the updater's states (``mod._updater.states``: an NDArray, a
  tuple/list of them, or None per parameter), by their ``.context``;
* ``inputs``: the executor's data and label arrays;
* ``module_copy``: the host copy of every parameter that MXNet's Module
  keeps (``mod._arg_params`` / ``_aux_params``, made at bind on the default
  context: host memory, on ``cpu(0)`` here). A Pipeline's Module keeps none
  unless made with ``host_copy=True``
  (:class:`~mp_symbolic.core.engine.device_module.DeviceModule`); nor does a bare
  executor;
* ``other``: the executor's activations and workspace, which no array
  exposes: the device's total from MXNet's storage profiler minus the six
  above. The executor allocates it lazily, so it is measured after one full
  step (forward, backward, update).

The first six are exact. ``other`` needs the storage profiler, and MXNet
1.9.1's profiler serves one trace per process (``set_config`` after
``dump()`` raises ``Check failed: auto_remove_ == false``; after
``dump(finished=False)`` the file is left unclosed and later dumps write
fragments without the header and device rows), so
:func:`measure_memory` runs the model in a fresh Python process
(``python -m mp_symbolic.tools.memory``), leaving the caller's profiler untouched;
:func:`measure_memories` measures several, each in a process forked from one
child that has imported MXNet and allocated nothing (the same bytes).
On GPUs the child also reports ``mx.context.gpu_memory_info``.

:func:`memory_table` (``mp_symbolic.memory_table``) is the table of a Module
in the caller's process, as a value: a :class:`MemoryTable` of one
:class:`MemoryRow` per device, printed by ``str()``.
"""
from dataclasses import dataclass, fields
import json
import os
import subprocess
import sys
import tempfile
import traceback

if __name__ == '__main__':  # the child: MXNet loads as the commands load it
    from .startup import mxnet_without_sklearn
    mxnet_without_sklearn()
# pylint: disable=wrong-import-position
import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

from .text import columns
from ..core import kernels
from ..core.base.compat import profiler_cpu_limit, unprofilable
from .trace import dump, load_trace, storage_bytes
from ..core.optim.updater import PerDeviceUpdater
from ..core.base.compat import split_bind
from ..core.engine.device_module import DeviceModule

__all__ = []

# Array categories, in table order; 'other' and 'total' follow when measured.
CATEGORIES = ('params', 'grads', 'optimizer', 'aux', 'inputs', 'module_copy')


def _nbytes(arr):
    return int(arr.size) * np.dtype(arr.dtype).itemsize


def _add(table, arr, category):
    if arr is None:
        return
    row = table.setdefault(str(arr.context), dict.fromkeys(CATEGORIES, 0))
    row[category] += _nbytes(arr)


def _states(state):
    """The NDArrays in one optimizer state (NDArray, nested tuple/list, or None)."""
    if state is None:
        return []
    if isinstance(state, (tuple, list)):
        return [a for s in state for a in _states(s)]
    return [state]


def device_memory(model, storage=None, input_names=None, updater=None):
    """Bytes per device and category of a bound ``mx.mod.Module`` or executor.

    Args:
        model: A Module after ``bind`` and ``init_params`` (and ``init_optimizer``
            plus one ``update`` for the optimizer states, which are made
            lazily), or an ``mx.executor.Executor``. A Module on the stage
            runtime holds its parameters' arrays and no executor of its own:
            its inputs are the arrays of its ``input_arrays()``.
        storage: ``{device: bytes}`` the device holds in all
            (:func:`mp_symbolic.tools.trace.storage_bytes`, devices as ``'cpu/0'``
            or ``'cpu(0)'``); adds ``other`` and ``total`` to each row. The
            profiler's row of pinned memory, ``cpu(<cores>)``, is a row
            ``'cpu_pinned(0)'`` where the model does not run on that device
            (:func:`host_rows`).
        input_names: Arguments that are inputs, not parameters. Default: the
            Module's data and label names; for an executor, the arguments
            without a gradient.
        updater: The optimizer updater; default: the Module's ``_updater``.

    Returns:
        ``{device: {category: bytes}}``, devices as ``str(ctx)`` (``'cpu(0)'``),
        sorted by device.

    Raises:
        ValueError: ``model`` is neither a bound Module nor an executor, or
            ``storage`` holds less on a device than its arrays take.
    """
    if isinstance(model, mx.executor.Executor):
        execs, copies = [model], ()
        if input_names is None:
            input_names = [n for n, g in model.grad_dict.items() if g is None]
            input_names += [n for n in model.arg_dict if n not in model.grad_dict]
    elif getattr(model, 'binded', False):
        execs = model._exec_group.execs
        copies = model.host_params if isinstance(model, DeviceModule) else \
            (model._arg_params, model._aux_params)
        if input_names is None:
            input_names = list(model.data_names) + list(model.label_names)
        if updater is None:
            updater = getattr(model, '_updater', None)
    else:
        raise ValueError('expected a bound mx.mod.Module or an mx.executor.Executor, found %s'
                         % type(model).__name__)
    table = {}
    inputs = set(input_names)
    for ex in execs:
        for name, arr in ex.arg_dict.items():
            _add(table, arr, 'inputs' if name in inputs else 'params')
        for arr in ex.grad_dict.values():
            _add(table, arr, 'grads')
        for arr in ex.aux_dict.values():
            _add(table, arr, 'aux')
    for arr in getattr(model, 'input_arrays', lambda: ())():  # a stage runtime's
        _add(table, arr, 'inputs')
    for state in (getattr(updater, 'states', None) or {}).values():
        for arr in _states(state):
            _add(table, arr, 'optimizer')
    for params in copies:
        for arr in (params or {}).values():
            _add(table, arr, 'module_copy')
    if storage is not None:
        storage = host_rows({_ctx_name(d): b for d, b in storage.items()},
                            set(table) | _bound_devices(model))
        for device in set(storage) - set(table):
            table[device] = dict.fromkeys(CATEGORIES, 0)
        for device, row in table.items():
            known = sum(row.values())
            total = storage.get(device, 0)
            if total < known:
                raise ValueError('%s: expected the storage total to cover its arrays (%d bytes), '
                                 'found %d bytes' % (device, known, total))
            row['other'], row['total'] = total - known, total
    return dict(sorted(table.items(), key=lambda kv: _device_key(kv[0])))


# MXNet's storage profiler counts pinned and shared host memory in the two
# rows after the cores, which is where it counts cpu(cores) and cpu(cores + 1)
# too (mp_symbolic.tools.trace): named so when the model runs on neither.
HOST_ROWS = (('cpu_pinned(0)', 0), ('cpu_shared(0)', 1))


def host_rows(storage, devices):
    """``storage`` (``{'cpu(i)': bytes}``, read from the profiler without GPU
    rows) with the rows of ``cpu(cores)`` and ``cpu(cores + 1)`` named
    ``'cpu_pinned(0)'`` and ``'cpu_shared(0)'`` where ``devices`` (those the
    model runs on, as ``'cpu(i)'``) do not hold them: the local and dist
    kvstores' buffers, in pinned memory. Such a row left at 0 bytes is
    dropped. With GPU rows, or a model on those devices, ``storage`` as given.
    """
    if any(d.startswith('gpu') for d in storage):
        return storage
    cores = profiler_cpu_limit() - 2
    out = dict(storage)
    for name, offset in HOST_ROWS:
        row = 'cpu(%d)' % (cores + offset)
        if row in out and row not in devices:
            held = out.pop(row)
            if held:
                out[name] = held
    return out


def _bound_devices(model):
    """The devices a Module is bound on (its contexts and its groups'), as ``'cpu(i)'``."""
    groups = getattr(model, '_group2ctxs', None) or {}
    devices = {str(c) for c in getattr(model, '_context', None) or ()}
    for group in groups if isinstance(groups, (list, tuple)) else [groups]:
        for ctx in (group or {}).values():
            devices.update(str(c) for c in (ctx if isinstance(ctx, (list, tuple)) else [ctx]))
    return devices


def _ctx_name(device):
    """``'cpu/0'`` (profiler) or ``'cpu(0)'`` -> ``'cpu(0)'``."""
    if '/' in device:
        kind, index = device.split('/', 1)
        return '%s(%s)' % (kind, index)
    return device


def _context(name):
    """``'cpu(1)'`` -> ``mx.cpu(1)``."""
    kind, _, index = name.partition('(')
    return mx.Context(kind, int(index.rstrip(')')))


def _device_key(name):
    """``'cpu(10)'`` -> ``('cpu', 10)``, so cpu(2) sorts before cpu(10)."""
    kind, _, index = name.partition('(')
    index = index.rstrip(')')
    return kind, int(index) if index.isdigit() else -1


def measure_memory(symbol, data_shapes, label_shapes, group2ctx=None, context='cpu(0)',
                   optimizer='sgd', optimizer_params=None, env=None, timeout=300,
                   fixed_param_names=None, host_copy=False, held=None):
    """Binds ``symbol`` in a fresh process, runs one step, returns :func:`device_memory`.

    Args:
        symbol: The training symbol (``mx.sym.Symbol`` or its JSON).
        data_shapes, label_shapes: ``[(name, shape)]`` as ``Module.bind`` takes them.
        group2ctx: ``{ctx_group: 'cpu(1)' or mx.Context}``; None binds every op
            on ``context`` (the one-device plan).
        context: The Module's context (inputs and the Module's parameter copy).
        optimizer, optimizer_params: As ``Module.init_optimizer`` takes them
            (``momentum`` makes SGD keep one state per parameter).
        env: Extra environment variables of the child, e.g.
            ``{'MXNET_BACKWARD_DO_MIRROR': '1'}`` (read when it binds).
        fixed_param_names: Parameters bound without a gradient and never
            updated, as ``mx.mod.Module`` takes them (a Pipeline's constants
            and frozen layers: they hold no gradient and no optimizer state).
        host_copy: Bind a Module that keeps MXNet's host copy of every
            parameter (``module_copy``), as ``mx.mod.Module`` does; by
            default, as a Pipeline's Module, none.
        held: The parameters whose optimizer state the step makes (a
            replica's share under ``shard_optimizer``:
            :func:`mp_symbolic.core.planning.estimate.optimizer_shares`); ``None``:
            every trained one.

    Returns:
        ``{'devices': {device: {category: bytes}}, 'gpu_memory_info':
        {device: [free, total]}}`` (the last only on GPUs).

    Raises:
        ValueError: a ``cpu(i)`` past the rows of MXNet's profiler (cores + 2),
            where it would abort the child.
        RuntimeError: the child process failed; the message ends with its last
            line of stderr.
    """
    return measure_memories([dict(symbol=symbol, data_shapes=data_shapes,
                                  label_shapes=label_shapes, group2ctx=group2ctx,
                                  context=context, optimizer=optimizer,
                                  optimizer_params=optimizer_params,
                                  fixed_param_names=fixed_param_names,
                                  host_copy=host_copy, held=held)], env, timeout)[0]


def measure_memories(requests, env=None, timeout=300):
    """:func:`measure_memory` of several models, each in a fresh process.

    One child imports MXNet once and forks a process of its own for each
    measurement, before any array or profiler exists in it: each measurement
    starts from what a fresh process holds (the same bytes as one started for
    it alone) without paying MXNet's start (2-4 s) each time.

    Args:
        requests: ``[dict]`` of :func:`measure_memory`'s arguments ``symbol``,
            ``data_shapes``, ``label_shapes`` and, optionally, ``group2ctx``,
            ``context``, ``optimizer``, ``optimizer_params``,
            ``fixed_param_names``, ``host_copy``, ``held``.
        env: Extra environment variables of the child, for every request.
        timeout: Seconds per request.

    Returns:
        One :func:`measure_memory` result per request, in order.

    Raises:
        ValueError: a ``cpu(i)`` past the rows of MXNet's profiler (cores + 2),
            where it would abort the child.
        RuntimeError: the child process failed; the message ends with its last
            line of stderr.
    """
    limit = profiler_cpu_limit()
    specs = []
    for request in requests:
        group2ctx, context = request.get('group2ctx'), request.get('context', 'cpu(0)')
        over = unprofilable([context] + list((group2ctx or {}).values()))
        if over:
            raise ValueError('expected cpu(i) devices with i below %d on this %d-core machine '
                             "(MXNet's profiler aborts past them), found %s"
                             % (limit, limit - 2, ', '.join(over)))
        symbol = request['symbol']
        specs.append({'symbol': symbol if isinstance(symbol, str) else symbol.tojson(),
                      'data_shapes': [[n, list(s)] for n, s in request['data_shapes']],
                      'label_shapes': [[n, list(s)] for n, s in request['label_shapes']],
                      'group2ctx': {g: str(c) for g, c in (group2ctx or {}).items()} or None,
                      'context': str(context), 'optimizer': request.get('optimizer', 'sgd'),
                      'optimizer_params': request.get('optimizer_params') or {},
                      'fixed_param_names': list(request.get('fixed_param_names') or ()),
                      'host_copy': bool(request.get('host_copy', False)),
                      'held': None if request.get('held') is None else
                              sorted(request['held'])})
    # The child imports this very package, wherever the caller imported it from.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env = dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0')
    child_env.update(env or {})
    child_env['PYTHONPATH'] = os.pathsep.join(filter(None, [root, child_env.get('PYTHONPATH')]))
    proc = subprocess.run([sys.executable, '-m', 'mp_symbolic.tools.memory'],
                          input=json.dumps(specs), capture_output=True, text=True,
                          env=child_env, timeout=timeout * max(1, len(specs)))
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ['(no stderr)']
        raise RuntimeError('memory measurement: expected exit status 0, found %d: %s'
                           % (proc.returncode, lines[-1]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare_memory(symbol, data_shapes, label_shapes, group2ctx, context='cpu(0)', env=None,
                   timeout=300, **kwargs):
    """:func:`measure_memory` on the split plan and on ``context`` alone
    (:func:`measure_memories`: one child).

    Returns:
        ``{'split': ..., 'one_device': ...}``, each as :func:`measure_memory` returns.

    Raises:
        ValueError, RuntimeError: as :func:`measure_memories` raises them.
    """
    common = dict(kwargs, symbol=symbol, data_shapes=data_shapes, label_shapes=label_shapes,
                  context=context)
    split, one_device = measure_memories([dict(common, group2ctx=group2ctx),
                                          dict(common, group2ctx=None)], env, timeout)
    return {'split': split, 'one_device': one_device}


def format_bytes(n):
    """``1536`` -> ``'1.5 KiB'``; bytes below 1 KiB as ``'512 B'``."""
    for unit, size in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
        if abs(n) >= size:
            return '%.1f %s' % (n / size, unit)
    return '%d B' % n


def format_memory(devices, title=None):
    """Lines of a table: one row per device, one column per category, a total row."""
    cats = list(CATEGORIES) + [c for c in ('other', 'total')
                               if all(c in row for row in devices.values())]
    rows = [['device'] + cats]
    for device, row in devices.items():
        rows.append([device] + [format_bytes(row[c]) for c in cats])
    rows.append(['all'] + [format_bytes(sum(r[c] for r in devices.values())) for c in cats])
    return ([title] if title else []) + columns(rows)


@dataclass(frozen=True)
class MemoryRow:
    """One device's bytes by category: a row of :class:`MemoryTable`.

    Attributes:
        device: The device, as ``str(ctx)`` (``'cpu(0)'``).
        params, grads, optimizer, aux, inputs, module_copy: Bytes of each
            category (see the module).
        total: Their sum, or with storage totals the device's whole.
        other: Activations and workspace (the storage total less the
            arrays), or ``None`` without storage totals.
    """
    device: str
    params: int
    grads: int
    optimizer: int
    aux: int
    inputs: int
    module_copy: int
    total: int
    other: int = None


@dataclass(frozen=True)
class MemoryTable:
    """Memory per device of a Module: one :class:`MemoryRow` per device,
    sorted by device; ``str()`` prints it as the training command does.

    Attributes:
        rows: The rows, a tuple.
    """
    rows: tuple

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, device):
        """The row of ``device`` (``'cpu(0)'`` or ``mx.cpu(0)``).

        Raises:
            KeyError: no row for it.
        """
        for row in self.rows:
            if row.device == str(device):
                return row
        raise KeyError('device: expected one of %s, found %s'
                       % (', '.join(r.device for r in self.rows), device))

    @property
    def devices(self):
        """The devices, in row order."""
        return [row.device for row in self.rows]

    @property
    def total(self):
        """Bytes on every device together."""
        return sum(row.total for row in self.rows)

    def as_dict(self):
        """``{device: {category: bytes}}`` as :func:`device_memory` returns
        it, with ``total`` in every row."""
        names = [f.name for f in fields(MemoryRow) if f.name != 'device']
        return {row.device: {n: getattr(row, n) for n in names if getattr(row, n) is not None}
                for row in self.rows}

    def lines(self, title=None):
        """The table's lines (:func:`format_memory`), with ``title`` first if given."""
        return format_memory(self.as_dict(), title)

    def __str__(self):
        return '\n'.join(self.lines())


def memory_table(module, storage=None):
    """Bytes per device and category of a bound Module, in this process.

    The arrays' own sizes (:func:`device_memory`): parameters, gradients,
    optimizer state, auxiliary states, inputs and the Module's host copy of
    the parameters, each on the device its arrays live on; ``total`` is
    their sum. Activations and workspace are not arrays a Module exposes:
    give ``storage`` (the storage profiler's totals) to add them as
    ``other``, or let :func:`measure_memory` measure a training graph in a
    fresh process.

    Example::

        mod = pipe.module(loss='softmax')
        mod.bind(...); mod.init_params(); mod.init_optimizer(...)
        table = mp_symbolic.memory_table(mod)
        print(table)                     # one row per device, and 'all'
        table['cpu(0)'].module_copy      # 0: the devices hold the only copy

    Args:
        module: A bound ``mx.mod.Module`` (a :class:`~mp_symbolic.PipelineModule`
            or any other) or an ``mx.executor.Executor``. Optimizer state is
            made lazily: it shows after ``init_optimizer`` and one ``update``.
        storage: ``{device: bytes}`` each device holds in all, as
            :func:`device_memory` takes it.

    Returns:
        A :class:`MemoryTable`.

    Raises:
        ValueError: ``module`` is not a bound Module or an executor, or
            ``storage`` holds less on a device than its arrays take.
    """
    if isinstance(module, mx.mod.BaseModule) and not module.binded:
        raise ValueError('module: expected a bound Module (after bind or fit), found an '
                         'unbound %s' % type(module).__name__)
    rows = []
    for device, row in device_memory(module, storage).items():
        values = {c: row[c] for c in CATEGORIES}
        rows.append(MemoryRow(device=device, total=row.get('total', sum(values.values())),
                              other=row.get('other'), **values))
    return MemoryTable(tuple(rows))


def _run_child(spec):
    """In a fresh process: profile storage, bind, one step, report (``__main__``)."""
    trace_path = start_storage_profile()  # before the first allocation: every array counted
    symbol = kernels.load_symbol_json(spec['symbol'])
    data_shapes = [(n, tuple(s)) for n, s in spec['data_shapes']]
    label_shapes = [(n, tuple(s)) for n, s in spec['label_shapes']]
    group2ctx = {g: _context(c) for g, c in (spec['group2ctx'] or {}).items()}
    # the Module a Pipeline makes: no host copy of the parameters, unless asked
    mod = DeviceModule(symbol, data_names=[n for n, _ in data_shapes],
                       label_names=[n for n, _ in label_shapes],
                       context=_context(spec['context']), group2ctxs=group2ctx or None,
                       fixed_param_names=spec.get('fixed_param_names') or None,
                       host_copy=spec.get('host_copy', False))
    with split_bind(group2ctx, symbol,  # bound as training binds it
                    fixed=spec.get('fixed_param_names') or ()):
        mod.bind(data_shapes=data_shapes, label_shapes=label_shapes)
    # Any callable initialiser will do: values do not change sizes.
    mod.init_params(initializer=lambda desc, arr: arr.__setitem__(slice(None), 0.01))
    mod.init_optimizer(kvstore=None, optimizer=spec['optimizer'],
                       optimizer_params=spec['optimizer_params'])
    mod._updater = PerDeviceUpdater(mod._updater)  # one fused update per device
    if spec.get('held') is not None:  # a replica's share: the others' states never made
        mod._updater = _HeldUpdater(mod._updater, [
            n in set(spec['held']) for n in mod._exec_group.param_names])
    result = {'devices': device_memory(mod, profiled_step(mod, data_shapes, label_shapes,
                                                          trace_path))}
    gpu_ids = sorted({int(d[4:-1]) for d in result['devices'] if d.startswith('gpu(')})
    if gpu_ids:
        result['gpu_memory_info'] = {'gpu(%d)' % i: list(mx.context.gpu_memory_info(i))
                                     for i in gpu_ids}
    return result


class _HeldUpdater:  # pylint: disable=too-few-public-methods
    """An updater that updates (and makes the state of) the parameters
    ``held[index]`` marks only (one device: MXNet's index is the parameter's)."""

    def __init__(self, updater, held):
        self.updater, self.held = updater, held

    def __call__(self, index, grad, weight):
        kept = [(i, g, w) for i, g, w in zip(index, grad, weight) if self.held[i]]
        if kept:
            self.updater(*[list(c) for c in zip(*kept)])

    def __getattr__(self, name):
        return getattr(self.updater, name)


def start_storage_profile(prefix='mp-memory-'):
    """MXNet's storage profiler started on a trace file of a new temporary
    folder of its own (``set_config`` unlinks the file it names), before
    the first allocation to count: that file's path."""
    path = os.path.join(tempfile.mkdtemp(prefix=prefix), 'memory.json')
    mx.profiler.set_config(profile_symbolic=False, profile_imperative=False, profile_api=False,
                           profile_memory=True, aggregate_stats=False, filename=path,
                           continuous_dump=False)
    mx.profiler.set_state('run')
    return path


def counted_storage(path):
    """The storage per device the profiler that :func:`start_storage_profile`
    started on ``path`` counted, once every op has run; the profiler is
    stopped and the trace file and its folder removed."""
    mx.nd.waitall()
    mx.profiler.set_state('stop')
    dump(path)
    storage = storage_bytes(load_trace(path))
    os.remove(path)
    os.rmdir(os.path.dirname(path))
    return storage


def profiled_step(module, data_shapes, label_shapes, trace_path):
    """One training step of the bound ``module`` (ones in, zeros as labels)
    under the storage profiler started on ``trace_path``: the storage per
    device it counted, less the batch's own arrays. The profiler is stopped
    and its trace file and folder removed."""
    batch = mx.io.DataBatch([mx.nd.ones(s) for _, s in data_shapes],
                            [mx.nd.zeros(s) for _, s in label_shapes])
    module.forward_backward(batch)
    module.update()
    return _batch_free(counted_storage(trace_path), batch)


def _batch_free(storage, batch):
    """``storage`` less the child's batch arrays, which are not the model's."""
    out = {_ctx_name(d): b for d, b in storage.items()}
    for arr in batch.data + batch.label:
        out[str(arr.context)] = out.get(str(arr.context), 0) - _nbytes(arr)
    return out


def _run_forked(spec):
    """:func:`_run_child` in a process forked from this one (which has imported
    MXNet and allocated nothing): its result, read from a pipe; ``None`` if
    it failed (its traceback went to the shared stderr)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the measurement's own process: no Python shutdown, no MXNet teardown
        status = 1
        try:
            os.close(read_end)
            with os.fdopen(write_end, 'w') as out:
                out.write(json.dumps(_run_child(spec)))
            status = 0
        except BaseException:  # pylint: disable=broad-except
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(status)  # pylint: disable=protected-access
    os.close(write_end)
    with os.fdopen(read_end) as result:
        text = result.read()
    _, status = os.waitpid(pid, 0)
    return json.loads(text) if status == 0 else None


def _main():
    """``python -m mp_symbolic.tools.memory``: one spec (a JSON object) on
    stdin measured in this process, or a list of them each in a fork of it;
    prints the result (a list for a list) as one JSON line."""
    given = json.loads(sys.stdin.read())
    if isinstance(given, dict):
        print(json.dumps(_run_child(given)))
        return 0
    results = []
    for spec in given:
        results.append(_run_forked(spec))
        if results[-1] is None:
            return 1
    print(json.dumps(results))
    return 0


if __name__ == '__main__':
    sys.exit(_main())
