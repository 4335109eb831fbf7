"""Reading MXNet 1.9.1's profiler trace: op intervals per device, overlap, bubble.

MXNet's profiler (``mx.profiler.set_config(profile_symbolic=True, ...)``,
``set_state('run')``, ..., ``set_state('stop')``, ``dump()``) writes a Chrome
trace: a ``'M'`` ``process_name`` event names each device row (``args.name``
``'cpu/0'``, ``'cpu/1'``, ..., ``'gpu/0'``, ...), and each operator run is a
``'B'``/``'E'`` pair with ``cat 'operator'``, ``pid`` = the device row and
``name`` = the op *type* (``'FullyConnected'``, ``'_backward_FullyConnected'``;
``'[op,op,...]'`` when the engine ran several ops as one bulked segment, see
``MXNET_EXEC_BULK_EXEC_TRAIN``). The ``'b'``/``'e'`` duplicates under the
``'operator'`` process are ignored. ``mx.profiler.Marker(...).mark()`` writes
``'n'`` instant events, used here to cut the trace into training steps.

**Device rows past the core count.** The profiler keeps one CPU row per core
(``omp_get_num_procs``), then one per GPU, then ``'cpu pinned/'`` and
``'cpu shared/'``; ``cpu(i)`` is recorded on row ``i``. So on a 2-core machine
without GPUs ``cpu(2)`` lands on ``'cpu pinned/'`` and ``cpu(3)`` on
``'cpu shared/'`` (and ``cpu(4)`` aborts the process). :func:`device_rows`
reads those two rows back as ``cpu/<cores>`` and ``cpu/<cores + 1>`` when the
trace has no GPU rows; such a row also holds any pinned or shared memory (a
kvstore's buffers in pinned memory: ``mp_symbolic.tools.memory.host_rows``
names the row ``cpu_pinned(0)`` where the model does not run on
``cpu(<cores>)``). With GPU rows
present the two rows keep their names, since there ``cpu(cores)`` would collide
with ``gpu/0``.

**A later dump in the same process.** MXNet writes the ``{"traceEvents": [``
header and the device rows on a process's first ``dump()`` only; a later one
writes a headless fragment. :func:`dump` writes a complete trace either way.

This file reads JSON; only :func:`dump` and :func:`discard` import MXNet, and
:func:`label_chunks`, which asks the loss heads table for the ops each head runs;
nothing imports training code.
"""
import json
import os
import re
import shutil
import tempfile

__all__ = []

PINNED_ROW, SHARED_ROW = 'cpu pinned/', 'cpu shared/'


class TraceError(ValueError):
    """The trace is not a complete MXNet profiler dump, or lacks what is asked."""


def load_trace(path):
    """The trace at ``path`` as a dict.

    Raises:
        TraceError: the file is not a complete trace. MXNet 1.9.1 writes the
            ``{"traceEvents": [`` header and the device rows only on the first
            ``dump()`` of a process (later dumps there write headless
            fragments), and ``set_config`` after ``dump()`` fails: profile in
            a fresh process for each file.
    """
    with open(path) as f:
        text = f.read()
    try:
        trace = json.loads(text)
    except ValueError as e:
        raise TraceError('%s: expected a complete MXNet profiler trace (the first dump() of '
                         'a process), found invalid JSON (%s)' % (path, e)) from None
    if not isinstance(trace, dict) or 'traceEvents' not in trace:
        raise TraceError('%s: expected a dict with "traceEvents", found %s'
                         % (path, type(trace).__name__))
    return trace


def dump(path):
    """``mx.profiler.dump()`` to ``path`` (the file ``set_config`` named), made a
    complete trace when MXNet leaves out the device rows (a process's later
    dump): MXNet's own header and rows are put before the events."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    mx.profiler.dump()
    with open(path) as f:
        text = f.read()
    if '"process_name"' in text[:4096] and '"cpu/0"' in text[:4096]:
        return
    gpus = 32 if mx.runtime.Features().is_enabled('CUDA') else 0
    with open(path, 'w') as f:
        f.write(completed(text, len(os.sched_getaffinity(0)), gpus))


def discard():
    """What MXNet's profiler recorded, dropped: dumped once into a private
    temporary folder, which is then removed, so that nothing is written when
    the process ends. ``set_config`` unlinks the file it names (as root,
    ``os.devnull`` too): it is given only a file of its own."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    folder = tempfile.mkdtemp(prefix='mp-profile-')
    try:
        mx.profiler.set_config(filename=os.path.join(folder, 'discarded.json'),
                               continuous_dump=False)
        mx.profiler.dump()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def completed(text, cores, gpus=0):
    """The complete trace of MXNet's dump ``text`` without device rows (with or
    without its header): the header and the rows MXNet writes on a process's
    first dump (``cores`` CPU rows, ``gpus`` GPU rows, then ``'cpu pinned/'``
    and ``'cpu shared/'``) put before the events."""
    body = text.lstrip()
    if body.startswith('{'):
        body = body[body.index('[') + 1:].lstrip('\n')
    names = (['cpu/%d' % i for i in range(cores)] + ['gpu/%d' % i for i in range(gpus)]
             + [PINNED_ROW, SHARED_ROW])
    rows = ',\n'.join(json.dumps({'ph': 'M', 'args': {'name': n}, 'pid': pid,
                                   'name': 'process_name'}) for pid, n in enumerate(names))
    return '{\n    "traceEvents": [\n' + rows + body

def device_rows(trace):
    """``{pid: device}`` of the trace's device rows, e.g. ``{0: 'cpu/0', 1: 'cpu/1'}``.

    ``'cpu pinned/'`` and ``'cpu shared/'`` become ``'cpu/<cores>'`` and
    ``'cpu/<cores + 1>'`` when the trace has no GPU rows (module docstring).

    Raises:
        TraceError: the trace names no device rows.
    """
    names = {e['pid']: e['args']['name'] for e in trace['traceEvents']
             if e.get('ph') == 'M' and e.get('name') == 'process_name'}
    devices = {pid: n for pid, n in names.items()
               if re.fullmatch(r'(cpu|gpu)/\d+', n) or n in (PINNED_ROW, SHARED_ROW)}
    if not devices:
        raise TraceError('expected process_name rows such as "cpu/0", found %s'
                         % (sorted(names.values()) or 'none'))
    cores = sum(1 for n in devices.values() if n.startswith('cpu/'))
    if not any(n.startswith('gpu/') for n in devices.values()):
        alias = {PINNED_ROW: 'cpu/%d' % cores, SHARED_ROW: 'cpu/%d' % (cores + 1)}
        devices = {pid: alias.get(n, n) for pid, n in devices.items()}
    return devices


def op_intervals(trace):
    """``{device: [(start_us, end_us, op_name), ...]}``, each list sorted by start.

    Only devices with at least one op appear.

    Raises:
        TraceError: a ``'B'`` event has no matching ``'E'`` or the reverse.
    """
    rows = device_rows(trace)
    open_ops, out = {}, {}
    events = [e for e in trace['traceEvents']
              if e.get('cat') == 'operator' and e.get('ph') in ('B', 'E') and e['pid'] in rows]
    # MXNet writes each op's 'B' and 'E' one after the other: pair them in file
    # order (sorting by time would misorder a zero-length op's pair).
    for e in events:
        key = (e['pid'], e.get('tid'), e['name'])
        if e['ph'] == 'B':
            open_ops.setdefault(key, []).append(e['ts'])
        else:
            if not open_ops.get(key):
                raise TraceError('expected a "B" event before the "E" of %r on %s at %d us, '
                                 'found none' % (e['name'], rows[e['pid']], e['ts']))
            start = open_ops[key].pop()
            out.setdefault(rows[e['pid']], []).append((start, e['ts'], e['name']))
    unmatched = [(rows[k[0]], k[2]) for k, v in open_ops.items() if v]
    if unmatched:
        raise TraceError('expected an "E" event for every "B", found %d open: %s'
                         % (len(unmatched), unmatched[:3]))
    return {d: sorted(v) for d, v in out.items()}


def _union(intervals):
    """Sorted, disjoint ``[(start, end)]`` covering ``intervals``."""
    merged = []
    for start, end, *_ in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(m) for m in merged]


def busy_time(intervals):
    """Length of the union of ``[(start, end, ...)]``: time the device ran any op."""
    return sum(end - start for start, end in _union(intervals))


def overlap_time(intervals_by_device, at_least=2):
    """Time during which at least ``at_least`` devices ran an op at once."""
    edges = []
    for intervals in intervals_by_device.values():
        for start, end in _union(intervals):
            edges += [(start, 1), (end, -1)]
    edges.sort(key=lambda e: (e[0], e[1]))  # an end before a start at a tie
    total, busy, last = 0, 0, None
    for t, delta in edges:
        if busy >= at_least:
            total += t - last
        busy += delta
        last = t
    return total


def step_windows(trace, marker='step'):
    """``[(start_us, end_us)]`` between consecutive instant markers named ``marker``.

    Mark once before each profiled step and once after the last, each after
    ``mx.nd.waitall()``: a step's ops then run inside its window. (Cutting at
    the longest idle gaps instead is not safe: with ``waitall()`` between
    steps the gap between two steps is short, and on this project's
    benchmark trace a wait inside a step was longer in 2 of 10 configurations.)

    Raises:
        TraceError: fewer than two such markers.
    """
    marks = sorted(e['ts'] for e in trace['traceEvents']
                   if e.get('ph') in ('n', 'i', 'I') and e.get('name') == marker)
    if len(marks) < 2:
        raise TraceError('expected at least 2 %r markers (one before each step and one after '
                         'the last), found %d' % (marker, len(marks)))
    return list(zip(marks[:-1], marks[1:]))


def clip(intervals_by_device, window):
    """The ops that start inside ``window = (start, end)``, per device."""
    lo, hi = window
    return {d: [iv for iv in v if lo <= iv[0] < hi] for d, v in intervals_by_device.items()}


def step_stats(intervals_by_device, devices):
    """Busy time per device, overlap and bubble of one step.

    Args:
        intervals_by_device: The step's ops (:func:`clip`).
        devices: The plan's devices (``'cpu/0'``, ...); one with no op counts
            as idle for the whole step.

    Returns:
        ``{'span_us', 'busy_us': {device: us}, 'overlap_us', 'bubble'}`` where
        span is first op start to last op end over all devices and
        ``bubble = 1 - sum(busy) / (len(devices) * span)``.

    Raises:
        TraceError: the step has no ops, or ops on a device not in ``devices``.
    """
    extra = sorted(d for d, v in intervals_by_device.items() if v and d not in devices)
    if extra:
        raise TraceError('expected ops only on %s, found ops on %s' % (list(devices), extra))
    ops = [iv for d in devices for iv in intervals_by_device.get(d, [])]
    if not ops:
        raise TraceError('expected ops in the step on %s, found none' % list(devices))
    span = max(iv[1] for iv in ops) - min(iv[0] for iv in ops)
    busy = {d: busy_time(intervals_by_device.get(d, [])) for d in devices}
    return {'span_us': span, 'busy_us': busy,
            'overlap_us': overlap_time({d: intervals_by_device.get(d, []) for d in devices}),
            'bubble': 1 - sum(busy.values()) / (len(devices) * span) if span else 0.0}


def pipeline_steps(trace, devices, num_chunks, marker='step'):
    """:func:`step_stats` of every step of ``trace``, GPipe's bubble beside each.

    Args:
        trace: A profiler trace (:func:`load_trace`).
        devices: The pipeline's devices in stage order (``'cpu/0'``, ...).
        num_chunks: Micro-batches per step (M).
        marker: Name of the instant markers around the steps (:func:`step_windows`).

    Returns:
        A list, one dict per step: :func:`step_stats`'s keys plus
        ``'window_us'`` and ``'gpipe_bubble'``.
    """
    ops = op_intervals(trace)
    windows = step_windows(trace, marker)
    ideal = gpipe_bubble(len(devices), num_chunks)
    return [dict(step_stats(clip(ops, w), devices), window_us=w, gpipe_bubble=ideal)
            for w in windows]


def gpipe_bubble(num_stages, num_chunks):
    """GPipe's idle share ``(K - 1) / (M + K - 1)`` for K equal stages, M micro-batches."""
    if num_stages < 1 or num_chunks < 1:
        raise ValueError('expected num_stages >= 1 and num_chunks >= 1, found %d and %d'
                         % (num_stages, num_chunks))
    return (num_stages - 1) / (num_chunks + num_stages - 1)


# Ops of which every call sees the whole batch: the split into micro-batches,
# the concat, and the sums of the per-chunk weight gradients. A loss head's
# calls are the heads table's (heads_here).
WHOLE_BATCH_OPS = frozenset([
    'SliceChannel', 'Concat', 'add_n', 'ElementWiseSum', '_grad_add', '_backward_SliceChannel',
    '_backward_Concat'])


def heads_here(counts):
    """``{op: calls}`` of the loss heads that ran on a device in one step: each
    head of the heads table (:func:`mp_symbolic.core.graph.heads.head_calls`)
    whose every op the device ran at least as often as the head alone runs it.

    Args:
        counts: ``{op: calls}`` of the device in the step.
    """
    # pylint: disable=import-outside-toplevel
    from ..core.graph.heads import LOSSES, head_calls  # MXNet binds each head once
    here = {}
    for loss in LOSSES:
        calls = head_calls(loss)
        if all(counts.get(op, 0) >= n for op, n in calls.items()):
            for op, n in calls.items():
                here[op] = here.get(op, 0) + n
    return here


def label_chunks(intervals, num_chunks):
    """Phase and micro-batch of each op of one device in one step.

    The profiler names op types only, so the chunk is inferred from order:
    the ``i``-th forward op of a type on a device belongs to chunk ``i``, the
    ``i``-th backward op of a type to chunk ``M - 1 - i``: the executor runs
    forward chunks in order and backward in reverse (GPipe's fill and
    drain). Checked on this machine with unequal chunks (``slice_axis`` of
    128, 256 and 640 rows, two stages): the forward ``FullyConnected``
    durations grew and the backward ones shrank on both devices. A type
    whose count is not a multiple of ``num_chunks`` (bulked segments, see
    ``MXNET_EXEC_BULK_EXEC_TRAIN``) gets no chunk; with ``L`` ops of a type
    per chunk, occurrences go ``L`` at a time.

    A loss head that ran on the device (:func:`heads_here`) sees the whole
    batch: where a type's count less the head's calls of it is a multiple of
    ``num_chunks``, those calls are the type's last forward ones (the head
    reads every chunk's output) or first backward ones (every chunk's
    backward reads the head's gradient) and get no chunk, and the others
    theirs (the ``'log_softmax'`` head's ``softmax`` beside the attention's).

    Args:
        intervals: ``[(start, end, name)]`` of one device, one step.
        num_chunks: Micro-batches per step (M).

    Returns:
        ``[(start, end, name, phase, chunk)]`` in start order; ``phase`` is
        ``'forward'``, ``'backward'``, ``'update'`` (names ending ``_update``)
        or ``'copy'`` (cross-device copies, either direction); ``chunk`` an
        int, or None for whole-batch ops, updates and copies.
    """
    def phase(name):
        if name.endswith('_update'):
            return 'update'
        if name.startswith(('Copy', '_CrossDeviceCopy')):
            return 'copy'  # activations forward or gradients back: the name does not say
        sums = ('add_n', 'ElementWiseSum', '_grad_add')  # of the chunks' weight gradients
        return 'backward' if name.startswith('_backward') or name in sums else 'forward'

    ops = sorted(intervals)
    counts = {}
    for _, _, name in ops:
        counts[name] = counts.get(name, 0) + 1
    head = {op: n for op, n in heads_here(counts).items()
            if (counts[op] - n) % num_chunks == 0}
    seen, out = {}, []
    for start, end, name in ops:
        p, chunk = phase(name), None
        whole = head.get(name, 0)
        # the head's calls: a forward type's last, a backward type's first
        k = seen.get(name, 0) - (whole if p == 'backward' else 0)
        chunked = counts[name] - whole
        regular = chunked % num_chunks == 0 and not name.startswith('[')
        if p in ('forward', 'backward') and name not in WHOLE_BATCH_OPS and regular \
                and 0 <= k < chunked:
            per_chunk = chunked // num_chunks
            i = k // per_chunk
            chunk = i if p == 'forward' else num_chunks - 1 - i
        seen[name] = seen.get(name, 0) + 1
        out.append((start, end, name, p, chunk))
    return out


def storage_bytes(trace):
    """``{device: bytes}`` held at the end of the trace, from the storage counters.

    With ``profile_memory=True`` MXNet writes a ``'C'`` event (``cat 'Device
    Storage'``, ``args {'Memory: cpu/0': bytes}``) on every allocation and
    release; the last value per device is what it holds when profiling stopped.
    Device names get the same pinned/shared reading as :func:`device_rows`.

    Raises:
        TraceError: the trace has no storage counters (``profile_memory`` off,
            or the profiler started after every allocation).
    """
    last = {}
    for e in sorted((e for e in trace['traceEvents']
                     if e.get('ph') == 'C' and e.get('cat') == 'Device Storage'),
                    key=lambda e: e['ts']):
        for key, value in e.get('args', {}).items():
            if key.startswith('Memory: '):
                last[key[len('Memory: '):]] = value
    if not last:
        raise TraceError('expected "Device Storage" counter events (profile_memory=True), '
                         'found none')
    # The counters name devices as the rows do: read pinned/shared the same way.
    names = {n: n for n in last}
    if not any(n.startswith('gpu/') for n in last):
        cores = sum(1 for e in trace['traceEvents'] if e.get('ph') == 'M'
                    and re.fullmatch(r'cpu/\d+', str(e.get('args', {}).get('name'))))
        names.update({PINNED_ROW: 'cpu/%d' % cores, SHARED_ROW: 'cpu/%d' % (cores + 1)})
    return {names.get(n, n): int(v) for n, v in last.items()}
