"""Trace analysis on small synthetic traces whose answers are known exactly,
and on a profiled GPipe step of the language model."""
import json
import os
import subprocess
import sys

import pytest

from mp_symbolic.core.graph.heads import head_calls
from mp_symbolic.tools.trace import (TraceError, busy_time, clip, device_rows, gpipe_bubble,
                               label_chunks, load_trace, op_intervals, overlap_time,
                               pipeline_steps, step_stats, step_windows, storage_bytes)

from conftest import ROOT


def _rows(*names):
    return [{'ph': 'M', 'name': 'process_name', 'pid': pid, 'args': {'name': n}}
            for pid, n in enumerate(names)]


def _op(pid, name, start, end):
    return [{'ph': 'B', 'cat': 'operator', 'name': name, 'pid': pid, 'tid': 7, 'ts': start},
            {'ph': 'E', 'cat': 'operator', 'name': name, 'pid': pid, 'tid': 7, 'ts': end}]


def _mark(ts):
    return {'ph': 'n', 'name': 'step', 'cat': 'bench,instant_marker', 'pid': 99, 'ts': ts}


def _trace():
    """Two steps on two devices, plus the async duplicates MXNet also writes.

    Step 1 (100..200): cpu/0 busy 100-140 and 130-150 (union 50), cpu/1 busy
    140-180 (40); both busy 140-150 (10); span 100-180 (80).
    Step 2 (200..300): only cpu/0, 210-230.
    """
    events = _rows('cpu/0', 'cpu/1', 'cpu pinned/', 'cpu shared/')
    events += [{'ph': 'M', 'name': 'process_name', 'pid': 55, 'args': {'name': 'operator'}}]
    events += _op(0, 'FullyConnected', 100, 140) + _op(0, 'relu', 130, 150)
    events += _op(1, '_backward_FullyConnected', 140, 180)
    events += _op(0, 'FullyConnected', 210, 230)
    events += [dict(e, ph=e['ph'].lower(), pid=55) for e in _op(0, 'FullyConnected', 0, 999)]
    events += [_mark(100), _mark(200), _mark(300)]
    return {'traceEvents': events}


def test_op_intervals_pair_begin_and_end_per_device_and_ignore_async_duplicates():
    ops = op_intervals(_trace())
    assert ops == {'cpu/0': [(100, 140, 'FullyConnected'), (130, 150, 'relu'),
                             (210, 230, 'FullyConnected')],
                   'cpu/1': [(140, 180, '_backward_FullyConnected')]}


def test_busy_time_is_the_union_of_intervals():
    assert busy_time([(0, 10), (5, 15), (20, 30)]) == 25
    assert busy_time([]) == 0


def test_overlap_time_counts_only_simultaneous_devices():
    by_device = {'a': [(0, 10), (5, 15)], 'b': [(12, 20)], 'c': [(14, 30)]}
    assert overlap_time(by_device) == 8  # 12-20: a&b 12-15, b&c 14-20, counted once
    assert overlap_time(by_device, at_least=3) == 1  # 14-15
    assert overlap_time({'a': [(0, 10)], 'b': [(10, 20)]}) == 0  # touching is not overlapping


def test_step_stats_give_busy_overlap_and_bubble_of_each_step():
    trace = _trace()
    windows = step_windows(trace)
    assert windows == [(100, 200), (200, 300)]
    first = step_stats(clip(op_intervals(trace), windows[0]), ['cpu/0', 'cpu/1'])
    assert first == {'span_us': 80, 'busy_us': {'cpu/0': 50, 'cpu/1': 40}, 'overlap_us': 10,
                     'bubble': 1 - 90 / (2 * 80)}
    second = step_stats(clip(op_intervals(trace), windows[1]), ['cpu/0', 'cpu/1'])
    assert second['bubble'] == 0.5 and second['overlap_us'] == 0  # cpu/1 idle all step


def test_step_with_ops_outside_the_plan_is_refused():
    with pytest.raises(TraceError, match=r"expected ops only on \['cpu/0'\], found ops on "
                                         r"\['cpu/1'\]"):
        step_stats(clip(op_intervals(_trace()), (100, 200)), ['cpu/0'])


def test_pinned_and_shared_rows_read_as_the_cpus_past_the_cores():
    rows = device_rows(_trace())
    assert [rows[pid] for pid in (0, 1, 2, 3)] == ['cpu/0', 'cpu/1', 'cpu/2', 'cpu/3']
    assert 55 not in rows  # the 'operator' process is not a device
    with_gpu = {'traceEvents': _rows('cpu/0', 'cpu/1', 'gpu/0', 'cpu pinned/', 'cpu shared/')}
    assert device_rows(with_gpu)[3] == 'cpu pinned/'


def test_gpipe_bubble():
    assert gpipe_bubble(1, 4) == 0
    assert gpipe_bubble(2, 1) == 0.5
    assert gpipe_bubble(3, 8) == 2 / 10
    with pytest.raises(ValueError, match='num_chunks >= 1'):
        gpipe_bubble(2, 0)


def test_storage_bytes_is_the_last_counter_value_in_time_per_device():
    events = _rows('cpu/0', 'cpu/1', 'cpu pinned/', 'cpu shared/') + [
        {'ph': 'C', 'cat': 'Device Storage', 'ts': ts, 'args': {'Memory: ' + d: v}}
        for ts, d, v in [(3, 'cpu/0', 30), (1, 'cpu/0', 10), (2, 'cpu pinned/', 5),
                         (4, 'cpu/1', 7)]]
    assert storage_bytes({'traceEvents': events}) == {'cpu/0': 30, 'cpu/2': 5, 'cpu/1': 7}
    with pytest.raises(TraceError, match='profile_memory=True'):
        storage_bytes(_trace())


def test_unclosed_trace_is_refused_with_the_reason(tmp_path):
    path = tmp_path / 'fragment.json'
    path.write_text(json.dumps(_trace())[:-3])
    with pytest.raises(TraceError, match='first dump'):
        load_trace(str(path))
    path.write_text(json.dumps(_trace()))
    assert load_trace(str(path)) == _trace()


def test_label_chunks_runs_forward_in_order_and_backward_in_reverse():
    ops = [(0, 1, 'SliceChannel'), (1, 2, 'FullyConnected'), (2, 3, 'FullyConnected'),
           (5, 6, '_backward_FullyConnected'), (6, 7, '_backward_FullyConnected'),
           (7, 8, 'add_n'), (8, 9, 'sgd_mom_update'), (9, 10, '[relu,relu]'),
           (10, 11, 'CopyCPU2CPU'), (11, 12, 'CopyCPU2CPU')]
    assert [(name, phase, chunk) for _, _, name, phase, chunk in label_chunks(ops, 2)] == [
        ('SliceChannel', 'forward', None), ('FullyConnected', 'forward', 0),
        ('FullyConnected', 'forward', 1), ('_backward_FullyConnected', 'backward', 1),
        ('_backward_FullyConnected', 'backward', 0), ('add_n', 'backward', None),
        ('sgd_mom_update', 'update', None), ('[relu,relu]', 'forward', None),
        ('CopyCPU2CPU', 'copy', None), ('CopyCPU2CPU', 'copy', None)]


def test_label_chunks_gives_a_loss_heads_calls_no_chunk_and_the_networks_theirs():
    """The 'log_softmax' head on the last stage's device, M=2: its one softmax
    after the two chunks' attention softmax, its backward ops before theirs."""
    head = sorted(head_calls('log_softmax'))
    assert {'softmax', 'log_softmax', 'pick', 'MakeLoss', '_backward_log_softmax'} <= set(head)
    names = (['softmax', 'softmax'] + [op for op in head if not op.startswith('_backward')]
             + [op for op in head if op.startswith('_backward')]
             + ['_backward_softmax', '_backward_softmax'])
    ops = [(t, t + 1, name) for t, name in enumerate(names)]
    labelled = [(name, chunk) for _, _, name, _, chunk in label_chunks(ops, 2)]
    assert labelled == ([('softmax', 0), ('softmax', 1)] + [(op, None) for op in names[2:-2]]
                        + [('_backward_softmax', 1), ('_backward_softmax', 0)])
    # a device without the head: every softmax is a chunk's
    assert [chunk for _, _, _, _, chunk in label_chunks(ops[:2], 2)] == [0, 1]


def test_loss_heads_calls_are_the_ops_mxnet_runs_for_them():
    assert head_calls('l2') == {'LinearRegressionOutput': 1, '_backward_linear_reg_out': 1}
    assert head_calls('softmax') == {'SoftmaxOutput': 1, '_backward_SoftmaxOutput': 1}
    with pytest.raises(ValueError, match="loss: expected one of l2, softmax, logistic, "
                                         "log_softmax, found 'hinge'"):
        head_calls('hinge')


# A GPipe step of a small language model (its loss head 'log_softmax') over
# cpu(0) and cpu(1), M=2, profiled one op per engine operation; argv[1] the trace.
LM_GPIPE_STEP = """
import sys
import mxnet as mx
import numpy as np
from mp_symbolic import Pipeline
from mp_symbolic.tools.trace import dump
from mp_symbolic.training.tasks import load_task
task, _ = load_task('lm', (('num_layers', 2), ('num_heads', 2), ('num_hiddens', 16),
                           ('block_size', 8), ('train_chars', 4096), ('val_chars', 1024)))
pipe = Pipeline(task.make_blocks(), 'cpu:0,cpu:1', sample=(8, 8), chunks=2, schedule='gpipe')
mod = pipe.module(loss=task.loss)
mod.bind(data_shapes=[('data', (8, 8))], label_shapes=[('softmax_label', (8, 8))])
mod.init_params()
mod.init_optimizer()
X = mx.nd.array(np.random.RandomState(0).randint(0, 20, (8, 8)))
batch = mx.io.DataBatch([X], [X])
mod.forward_backward(batch)
mod.update()
mx.nd.waitall()
mx.profiler.set_config(profile_symbolic=True, filename=sys.argv[1], aggregate_stats=False)
marker = mx.profiler.Marker(mx.profiler.Domain('test'), 'step')
mx.profiler.set_state('run')
marker.mark()
mod.forward_backward(batch)
mod.update()
mx.nd.waitall()
marker.mark()
mx.profiler.set_state('stop')
dump(sys.argv[1])
"""


def test_a_gpipe_trace_of_the_language_model_gives_every_attention_softmax_its_chunk(tmp_path):
    """The 'log_softmax' head runs one softmax over the whole batch on the
    last stage's device beside each chunk's attention softmax (the attention
    in MXNet's ops, MP_SYMBOLIC_FUSED_ATTENTION=0): the head's gets no
    chunk, and each attention's its own."""
    path = str(tmp_path / 'trace.json')
    run = subprocess.run([sys.executable, '-c', LM_GPIPE_STEP, path], capture_output=True,
                         text=True, timeout=120, cwd=ROOT,
                         # the attention in MXNet's ops, its softmax among them
                         env=dict(os.environ, PYTHONPATH=ROOT, MXNET_EXEC_BULK_EXEC_TRAIN='0',
                                  MP_SYMBOLIC_FUSED_ATTENTION='0'))
    assert run.returncode == 0, run.stderr[-2000:]
    trace = load_trace(path)
    step = clip(op_intervals(trace), step_windows(trace)[0])
    head_devices = [d for d, ops in step.items() if any(op == 'log_softmax' for *_, op in ops)]
    assert len(head_devices) == 1
    for device in ('cpu/0', 'cpu/1'):
        labelled = label_chunks(step[device], 2)
        forward = [chunk for _, _, name, _, chunk in labelled if name == 'softmax']
        backward = [chunk for _, _, name, _, chunk in labelled if name == '_backward_softmax']
        head = [None] if device in head_devices else []
        attention = len(backward) // 2  # per chunk: one each layer on the device
        assert attention >= 1, device
        assert forward == [0] * attention + [1] * attention + head, device
        assert backward == [1] * attention + [0] * attention, device


def test_pipeline_steps_give_each_step_with_gpipe_beside_it():
    trace = _trace()
    steps = pipeline_steps(trace, ['cpu/0', 'cpu/1'], num_chunks=1)
    assert [s['window_us'] for s in steps] == [(100, 200), (200, 300)]
    assert [s['bubble'] for s in steps] == [1 - 90 / 160, 0.5]
    assert all(s['gpipe_bubble'] == 0.5 for s in steps)


def test_no_profiler_configuration_of_the_project_names_a_file_not_its_own():
    """MXNet's set_config unlinks the file it names: no call in the project
    may name os.devnull (run as root, that removed /dev/null)."""
    import ast  # pylint: disable=import-outside-toplevel
    import pathlib  # pylint: disable=import-outside-toplevel
    root = pathlib.Path(__file__).resolve().parent.parent
    found = []
    for folder in ('mp_symbolic', 'bench', 'export'):
        for path in sorted((root / folder).rglob('*.py')):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, 'attr', None) == 'set_config':
                    for keyword in node.keywords:
                        if keyword.arg == 'filename' and 'devnull' in ast.dump(keyword.value):
                            found.append('%s:%d' % (path.relative_to(root), node.lineno))
    assert not found, found
