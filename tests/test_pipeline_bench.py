"""Smoke run of the pipeline benchmark, its graph's transparency, and its refusals.

The benchmark profiles, and MXNet's profiler serves one trace per process, so
the run happens in a child process.
"""
import json
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from bench.chunked import bind, build_chunked_symbol, stage_devices
from bench.lm import model_flops_per_token
from mp_symbolic import Pipeline
from bench.pipeline import main
from mp_symbolic.training.tasks import gpt


@pytest.mark.slow
def test_quick_run_writes_report_and_timeline(tmp_path):
    env = dict(os.environ, MXNET_SUBGRAPH_VERBOSE='0')
    proc = subprocess.run([sys.executable, '-m', 'bench.pipeline', '--quick', '--stages', '2',
                           '--chunks', '1,2', '--out', str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / 'pipeline.json').read_text())
    configs = {(c['plan'], c['chunks']): c for c in report['configs']}
    assert sorted(configs) == [('one device', 1), ('split', 1), ('split', 2)]
    for c in configs.values():
        assert 0 <= c['bubble'] < 1 and c['samples_per_s'] > 0
        assert all(c['busy_us'][d] > 0 for d in c['devices'])
    assert configs[('split', 2)]['gpipe_bubble'] == 1 / 3
    assert configs[('split', 2)]['overlap_us'] <= min(configs[('split', 2)]['busy_us'].values())
    assert (tmp_path / 'pipeline-timeline.png').stat().st_size > 0
    split = report['memory']['K2-M2']['split']['devices']
    assert split['cpu(0)']['other'] > 0 and split['cpu(1)']['other'] > 0
    assert [(c['stages'], c['chunks']) for c in report['ordered']] == [(2, 2)]
    # re-materialisation's row without mirroring is the split plan at the largest M
    assert report['mirror']['none']['memory'] == report['memory']['K2-M2']['split']
    assert report['mirror']['none']['recomputed_ops'] == 0
    assert report['mirror']['MXNET_BACKWARD_DO_MIRROR=1']['recomputed_ops'] > 0
    assert 'CPU stand-in devices share' in proc.stdout
    # the schedules side by side (--quick: the smallest M above 1 of --chunks)
    rows = {r['schedule'] + (' on stages' if r.get('runtime') else ''): r
            for r in report['schedules']}
    assert sorted(rows) == ['1f1b', 'gpipe', 'gpipe on stages', 'interleaved']
    assert {r['chunks'] for r in rows.values()} == {2}
    assert rows['gpipe']['ideal'] == rows['1f1b']['ideal'] == pytest.approx(1 / 3)
    assert rows['interleaved']['ideal'] == pytest.approx(1 / 5)
    for r in rows.values():
        assert 0 <= r['bubble'] < 1 and r['step_vs_gpipe'] > 0
        # tokens/s of the steps not profiled, and the utilisation they make of a matrix product
        assert r['tokens_per_sec'] > 0 and r['gemm_flops_per_sec'] > 0
        assert r['mfu'] == pytest.approx(r['tokens_per_sec'] * model_flops_per_token(
            gpt.GPTConfig(**r['lm'])) / r['gemm_flops_per_sec'])
        assert sorted(r['memory']) == ['cpu(0)', 'cpu(1)'] and min(r['memory'].values()) > 0
    assert rows['gpipe']['step_vs_gpipe'] == 1
    assert 'schedules on the language model' in proc.stdout


def test_chunked_symbol_is_the_pipelines_graph_with_every_node_on_its_stage():
    symbol = build_chunked_symbol(3, 4, 8)
    blocks = [mx.gluon.nn.Dense(8, activation='relu', in_units=8, prefix='s%d_' % s)
              for s in range(3)]
    library = Pipeline(blocks, 'cpu:0,cpu:1,cpu:2', chunks=4).training_symbol('softmax')
    assert symbol.tojson() == library.tojson()
    attrs = symbol.attr_dict()
    groups = {n['name']: attrs.get(n['name'], {}).get('ctx_group')
              for n in json.loads(symbol.tojson())['nodes']}
    assert None not in groups.values()
    assert groups['data'] == 'stage0' and groups['chunk'] == 'stage0'
    assert groups['s1_fwd_chunk3'] == 'stage1' and groups['s2_weight'] == 'stage2'
    assert groups['join'] == 'stage2' and groups['softmax_label'] == 'stage2'
    exe = symbol.simple_bind(mx.cpu(0), group2ctx={'stage%d' % s: mx.cpu(s) for s in range(3)},
                             data=(8, 8))
    assert exe.arg_dict['s2_weight'].context == mx.cpu(2)


def test_chunking_and_forcing_the_forward_order_leave_outputs_and_gradients_unchanged():
    """Same parameters and batch: M=1, M=4, M=4 ordered give the same step."""
    results = []
    for m, ordered in ((1, False), (4, False), (4, True)):
        exe = bind(build_chunked_symbol(2, m, 16, order_forward=ordered), 8, 16,
                   stage_devices(2), seed=3)
        exe.forward(is_train=True)
        exe.backward()
        results.append([exe.outputs[0].asnumpy()]
                       + [exe.grad_dict[n].asnumpy() for n in sorted(exe.grad_dict)
                          if exe.grad_dict[n] is not None])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_batch_not_divisible_by_the_chunks_is_refused(capsys):
    assert main(['--batch-size', '10', '--chunks', '1,4']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('error: --batch-size: expected a multiple')


def test_more_stages_than_the_profiler_records_is_refused(capsys):
    assert main(['--stages', '2,%d' % (os.cpu_count() + 3)]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and "MXNet's profiler aborts past" in err


@pytest.mark.slow
def test_op_times_of_the_digits_step_count_each_micro_batch():
    """``python -m bench.bn_chunks --ops``'s measurement (two child processes):
    each op type of the digits step, once per micro-batch with chunks=4; no
    timing is checked."""
    from bench.bn_chunks import op_times  # pylint: disable=import-outside-toplevel
    times = op_times(rounds=1)
    for op, calls in (('Convolution', 2), ('_backward_Convolution', 2), ('BatchNorm', 2),
                      ('_backward_FullyConnected', 2)):
        assert times[1][op][0] == calls and times[4][op][0] == 4 * calls, op
        assert times[1][op][1] > 0 and times[4][op][1] > 0
    assert 'add_n' not in times[1] and times[4]['add_n'][0] > 0  # chunk gradients summed


def test_the_schedules_bench_counts_the_bubble_at_the_stages_times_alone():
    """``bench.schedules``: the ideal at uneven stage times is the schedule's
    clock at those times, and a step whose span is that clock's leaves the
    bubble at the stage times equal to it (the work counted at its time
    alone, not at the trace's busy time)."""
    from bench.schedules import alone_bubble, spec, timed_ideal  # pylint: disable=C0415
    from mp_symbolic.core import schedule  # pylint: disable=import-outside-toplevel
    one = spec('1f1b', 2, 4, 8)
    stage_us = {'0F': 10.0, '0B': 20.0, '1F': 20.0, '1B': 40.0}
    cost = {(0, 'F'): 10.0, (0, 'B'): 20.0, (1, 'F'): 20.0, (1, 'B'): 40.0}
    rows = schedule.timeline(schedule.one_f_one_b(2, 4), cost)
    span = max(row[-1][1] for row in rows)
    uneven = schedule.bubble(schedule.one_f_one_b(2, 4), cost)
    assert timed_ideal(one, stage_us) == pytest.approx(uneven)
    assert uneven > schedule.bubble(schedule.one_f_one_b(2, 4))  # the unit clock's 1/5
    assert alone_bubble(one, {'stage_us': stage_us, 'span_us': span}) == \
        pytest.approx(timed_ideal(one, stage_us))
    assert alone_bubble(one, {'stage_us': stage_us, 'span_us': 2 * span}) > \
        timed_ideal(one, stage_us)
