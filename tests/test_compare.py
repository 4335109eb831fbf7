"""``compare``: the side-by-side run, its files, the copy counts, and the seed's loop.

One small comparison (2 000 examples, 5 epochs: 100 steps) is trained once per module and
shared by the tests that read its results.
"""
from dataclasses import replace
import json
import os
import re
import shutil

import mxnet as mx
import numpy as np
import pytest

from bench.seed_loop import SeedLoop
from mp_symbolic.training.cli import main
from mp_symbolic.training import compare as compare_module
from mp_symbolic.training.compare import REFERENCE, compare, count_autograd_copies
from mp_symbolic.training.graphviz_plot import DEVICE_COLOURS
from mp_symbolic.training.metrics import AGREE_ATOL, AGREE_RTOL
from mp_symbolic.training.loop import build_pipeline, initial_values, make_stepper

from conftest import THREE_DEVICES, load_config, make_config

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'
ROW_FIELDS = {'variant', 'short', 'metrics', 'result', 'max_step_loss_diff', 'max_param_diff', 'samples_per_sec',
              'stage_devices', 'cross_device_copies_per_step', 'copies_forward',
              'copies_backward', 'copy_count_method', 'placement', 'agree'}


@pytest.fixture(scope='module')
def compared(tmp_path_factory):
    """``(CompareResult, results JSON, output folder)`` of one small comparison."""
    out = str(tmp_path_factory.mktemp('compare'))
    cfg = make_config(devices=THREE_DEVICES, num_examples=2000, num_epochs=5,
                      progress=False, out=out)
    result = compare(cfg, log=lambda line: None)
    with open(result.files['results']) as f:
        return result, json.load(f), out


def test_results_json_has_every_field_and_the_variants_agree(compared):
    result, saved, _ = compared
    assert saved['tolerance']['rtol'] == AGREE_RTOL == 1e-4
    assert saved['tolerance']['atol'] == AGREE_ATOL == 1e-5
    assert saved['config']['num_epochs'] == 5
    assert [r['variant'] for r in saved['variants']][0] == REFERENCE
    assert len(saved['variants']) == 3
    for row in saved['variants']:
        assert ROW_FIELDS <= set(row), 'missing %s' % (ROW_FIELDS - set(row))
        assert row['agree'], row['variant']
        bound = AGREE_ATOL + AGREE_RTOL * max(saved['step_losses'][REFERENCE])
        assert row['max_step_loss_diff'] <= bound
        assert row['metrics']['final_mse'] < 1e-4  # learned the map (noise floor 1e-6)
    assert saved['agree'] is result.agree is True
    losses = saved['step_losses']
    for name, values in losses.items():
        np.testing.assert_allclose(values, losses[REFERENCE], rtol=AGREE_RTOL, atol=AGREE_ATOL,
                                   err_msg=name)
    assert saved['variants'][2]['stage_devices'] == ['cpu:0']
    assert saved['variants'][0]['result'].startswith('full-data MSE: ')


def test_loss_plot_is_a_png(compared):
    result, _, _ = compared
    with open(result.files['loss_plot'], 'rb') as f:
        data = f.read()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 5000  # three curves and axes, not an empty canvas


def _graph_nodes():
    pipe, _ = build_pipeline(*reversed(load_config(devices=THREE_DEVICES)))
    symbol = pipe.training_symbol('l2', label_name='label')
    return pipe.plan, json.loads(symbol.tojson())['nodes']


def test_graph_dot_has_every_node_coloured_by_its_device(compared):
    result, _, _ = compared
    with open(result.files['graph_dot']) as f:
        source = f.read()
    plan, nodes = _graph_nodes()
    drawn = dict(re.findall(r'^\s*n(\d+) \[.*fillcolor="(#[0-9a-f]{6})"', source, re.M))
    assert sorted(int(i) for i in drawn) == list(range(len(nodes)))
    stage_of_group = {'stage%d' % s: s for s in range(plan.num_stages)}
    for i, node in enumerate(nodes):
        stage = stage_of_group[node['attrs']['__ctx_group__']]
        assert drawn[str(i)] == DEVICE_COLOURS[stage], node['name']
    for s in range(plan.num_stages):  # the legend names each device with its colour
        assert re.search(r'legend%d \[label="cpu:%d: stage%d" fillcolor="%s"'
                         % (s, s, s, DEVICE_COLOURS[s]), source)
    # the two activations that cross stages are drawn as cross-device edges
    assert source.count('style=dashed') == 2


@pytest.mark.skipif(shutil.which('dot') is None,
                    reason='graphviz `dot` is not installed; only the .dot source is written')
def test_graph_png_is_rendered_when_dot_is_installed(compared):
    result, _, _ = compared
    with open(result.files['graph_png'], 'rb') as f:
        data = f.read()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    assert os.path.getsize(result.files['graph_svg']) > 1000


@pytest.mark.parametrize('devices, expected', [
    # Two stage boundaries (stage0 -> stage1 -> stage2): MXNet inserts one copy of
    # the activation at each going forward and one of its gradient at each going
    # back. data, label and parameters are bound on their own stage's device.
    (THREE_DEVICES, (2, 2)),
    ('cpu:0,cpu:1', (1, 1)),  # layers (0, 0, 1): one boundary (balance 2,1)
    ('cpu:0', (0, 0)),
])
@pytest.mark.parametrize('api', ['module', 'executor'])
def test_bound_graph_has_one_copy_per_boundary_each_way(devices, expected, api):
    task, cfg = load_config(devices=devices, api=api, num_examples=200, progress=False,
                            balance=None if devices != 'cpu:0,cpu:1' else (2, 1))
    pipe, _ = build_pipeline(cfg, task)
    stepper = make_stepper(cfg, pipe, task, initial_values(pipe, 0), (1,))
    assert stepper.cross_device_copies() == expected


@pytest.mark.parametrize('api', ['module', 'executor'])
def test_the_stage_runtime_counts_one_copy_per_boundary_each_way_as_the_one_graph(api):
    """Under ``1f1b`` the boundary tensors cross between devices through the
    transport, not as ``_CrossDeviceCopy`` nodes: counted there, both APIs
    give the one graph's count (two boundaries over three devices)."""
    task, cfg = load_config(devices=THREE_DEVICES, api=api, num_examples=200, progress=False,
                            schedule='1f1b', chunks=2)
    pipe, _ = build_pipeline(cfg, task)
    stepper = make_stepper(cfg, pipe, task, initial_values(pipe, 0), (1,))
    assert stepper.cross_device_copies() == (2, 2)


@pytest.mark.parametrize('devices', [THREE_DEVICES, 'cpu:0,cpu:1', 'cpu:0'])
def test_imperative_twin_records_a_copy_where_the_bound_graph_has_one(small_data, devices):
    """autograd records one ``_copyto`` per stage boundary, as many as the
    forward ``_CrossDeviceCopy`` nodes of the bound graph. (The backward count
    of the imperative twin is taken as equal: one gradient copy per recorded
    copy, as the profiler's CopyCPU2CPU count per step shows.)"""
    X, _ = small_data
    task, cfg = load_config(devices=devices, progress=False)
    pipe, _ = build_pipeline(cfg, task)
    init = initial_values(pipe, 0)
    bound_forward, _ = make_stepper(cfg, pipe, task, init, (1,)).cross_device_copies()
    stepper = make_stepper(replace(cfg, variant='imperative'), pipe, task, init, (1,))
    before = stepper.params()
    forward, _ = count_autograd_copies(stepper, X[:cfg.batch_size])
    assert forward == bound_forward == pipe.plan.num_stages - 1
    after = stepper.params()
    for name in before:  # counting records a forward pass only: nothing is updated
        np.testing.assert_array_equal(after[name], before[name])


def test_bench_runs_every_variant_and_prints_ratios():
    """A smoke run of ``python -m bench`` (no figures are checked: timing is not tested)."""
    from bench.__main__ import run  # pylint: disable=import-outside-toplevel
    from bench.variants import VARIANTS  # pylint: disable=import-outside-toplevel
    lines = []
    results = run(repeats=1, num_steps=2, tta_max_seconds=0.5, log=lines.append)
    text = '\n'.join(lines)
    for name in VARIANTS:
        assert text.count(name) >= 2, name  # a throughput row and a time-to-accuracy row
        assert results['throughput'][100][name] > 0
    assert 'symbolic 1-device          ' in text and '1.00x' in text
    assert results['tta']['symbolic MP (Module)'][1]  # reached 1e-5 within the cap


def test_compare_cli_rejects_a_bad_device_list(capsys):
    assert main(['compare', '--devices', 'cpu:0,cpu:0', '--no-progress']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: ') and 'twice' in err[0]


def test_seed_loop_updates_parameters_on_every_device(small_data):
    """The seed question: do gradients reach every layer? Its own ``mytrainer``
    raises if a parameter's gradient was not written, so three steps passing
    means every layer got a fresh gradient each step."""
    X, y = small_data
    devices = [mx.cpu(0), mx.cpu(1), mx.cpu(2)]
    pipe, _ = build_pipeline(*reversed(load_config(devices=THREE_DEVICES)))
    init = initial_values(pipe, 0)[0]
    loop = SeedLoop(devices, batch_size=50, init=init)
    for i, block in enumerate(loop.net):
        assert block.w.data().context == block.b.data().context == devices[i]
    np.testing.assert_array_equal(loop.params()['layer0_weight'], init['layer0_weight'])
    loop.run(X, y, num_steps=3)
    after = loop.params()
    for name, value in init.items():
        assert np.all(after[name] != value), '%s did not change in every entry' % name
    assert loop.iteration == 2 and loop.results[0][0] == 0  # loss read at iteration 0


def test_compare_of_diverging_runs_stops_with_one_line_and_writes_no_json(tmp_path, capsys):
    assert main(['compare', '--no-progress', '--lr', '100', '--num-examples', '1000',
                 '--devices', THREE_DEVICES, '--out', str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: training diverged: batch loss ')
    assert not (tmp_path / 'compare.json').exists()


def test_agree_steps_judges_the_first_steps_of_runs_that_drift_later():
    ref = [2.0, 1.5, 1.2, 1.0]
    drift = [2.0, 1.5, 1.2 + 1e-3, 1.0 + 2e-3]  # equal for two steps, then apart
    params = {'w': np.ones(3)}
    assert not compare_module.agrees(drift, ref, params, params)
    assert compare_module.agrees(drift, ref, params, params, steps=2)
    assert not compare_module.agrees(drift, ref, params, params, steps=3)
    # the final parameters are not judged with steps
    assert compare_module.agrees(ref, ref, {'w': np.zeros(3)}, params, steps=4)
    assert not compare_module.agrees(ref, ref, {'w': np.zeros(3)}, params)


def test_compare_cli_agree_steps_says_what_it_judged(tmp_path, capsys):
    status = main(['compare', '--num-examples', '400', '--epochs', '1', '--no-progress',
                   '--devices', 'cpu:0,cpu:1,cpu:2', '--agree-steps', '3',
                   '--out', str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0
    assert 'agree: yes (losses of the first 3 steps (--agree-steps) vs symbolic MP' in out
    results = json.loads((tmp_path / 'compare.json').read_text())
    assert results['tolerance']['applies_to'] == 'batch MSE of the first 3 steps'
    assert results['config']['agree_steps'] == 3


def test_compare_cli_refuses_agree_steps_below_one(capsys):
    assert main(['compare', '--agree-steps', '0', '--no-progress']) == 2
    assert capsys.readouterr().err.strip() == \
        'error: --agree-steps: expected a positive integer, found 0'
