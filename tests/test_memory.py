"""Memory per device: exact array bytes, activations from the storage profiler."""
import os

import mxnet as mx
import numpy as np
import pytest

import mp_symbolic
from mp_symbolic.tools.memory import (CATEGORIES, MemoryTable, compare_memory, device_memory,
                                      format_bytes, format_memory, measure_memories,
                                      measure_memory)
from mp_symbolic import Pipeline
from mp_symbolic.training.tasks import gpt
from mp_symbolic.training.tasks.regression import build_blocks

WIDTHS = (64, 128, 128, 4)
DATA, LABEL = [('data', (32, 64))], [('label', (32, 4))]
GROUP2CTX = {'stage0': 'cpu(0)', 'stage1': 'cpu(1)'}


def _symbol():
    """Three dense layers, the first on stage0 and the other two on stage1."""
    pipe = Pipeline(build_blocks(WIDTHS), 'cpu:0,cpu:1', balance=[1, 2])
    return pipe.training_symbol('l2', label_name='label')


def _param_bytes_by_device(symbol):
    """Bytes of each parameter, summed per stage device, from shapes and ctx_group alone."""
    arg_shapes, _, _ = symbol.infer_shape(**dict(DATA + LABEL))
    attrs = symbol.attr_dict()
    out = {}
    for name, shape in zip(symbol.list_arguments(), arg_shapes):
        if name in ('data', 'label'):
            continue
        device = GROUP2CTX[attrs[name]['ctx_group']]
        size = 1
        for dim in shape:
            size *= dim
        out[device] = out.get(device, 0) + 4 * size  # float32
    return out


@pytest.fixture(scope='module')
def measured():
    """``(symbol, {'split', 'one_device', 'split_again', 'host_copy'})``: the
    split plan measured again after the one-device plan, in the same child,
    then with the Module's host copy of the parameters."""
    symbol = _symbol()
    common = dict(symbol=symbol, data_shapes=DATA, label_shapes=LABEL,
                  optimizer_params={'momentum': 0.9})
    split, one_device, again, host_copy = measure_memories([
        dict(common, group2ctx=GROUP2CTX), common, dict(common, group2ctx=GROUP2CTX),
        dict(common, group2ctx=GROUP2CTX, host_copy=True)])
    return symbol, {'split': split, 'one_device': one_device, 'split_again': again,
                    'host_copy': host_copy}


def test_each_measurement_of_one_child_starts_from_a_fresh_process(measured):
    """A measurement after others in the same child counts what it would
    alone: MXNet's workspace and the arrays of the ones before are not in
    its process (each runs in a fork made before any of them)."""
    assert measured[1]['split_again'] == measured[1]['split']
    assert measured[1]['split']['devices']['cpu(0)']['other'] > 0


def test_the_measured_module_keeps_a_host_copy_of_the_parameters_only_when_asked(measured):
    """As a Pipeline's Module: no ``module_copy`` by default; with
    ``host_copy=True``, MXNet's copy of every parameter on cpu(0), which
    then holds that much more in all."""
    symbol, result = measured
    params = sum(_param_bytes_by_device(symbol).values())
    split, kept = result['split']['devices'], result['host_copy']['devices']
    assert [row['module_copy'] for row in split.values()] == [0, 0]
    assert kept['cpu(0)']['module_copy'] == params and kept['cpu(1)']['module_copy'] == 0
    assert kept['cpu(0)']['total'] >= split['cpu(0)']['total'] + params
    assert kept['cpu(1)']['total'] == split['cpu(1)']['total']


def test_params_grads_and_momentum_bytes_equal_the_stage_arrays_on_each_device(measured):
    symbol, result = measured
    expected = _param_bytes_by_device(symbol)
    split = result['split']['devices']
    assert sorted(split) == ['cpu(0)', 'cpu(1)']
    for device, nbytes in expected.items():
        assert split[device]['params'] == nbytes
        assert split[device]['grads'] == nbytes
        assert split[device]['optimizer'] == nbytes  # one momentum array per parameter


def test_activations_are_measured_on_both_devices(measured):
    split = measured[1]['split']['devices']
    assert split['cpu(0)']['other'] > 0 and split['cpu(1)']['other'] > 0
    for row in split.values():
        assert row['total'] == sum(v for k, v in row.items() if k != 'total')


def test_a_split_graph_of_dense_layers_keeps_storage_sharing_for_its_activations(measured):
    """Split binds give intermediate arrays storage of their own only for
    graphs with convolution-like ops (compat.ONEDNN_LAYOUT_OPS): these dense
    layers' activations over two devices are 1.24 times one device's (the
    copies between them and each device's workspace), 1.49 with the storage
    of their own that the workaround gives."""
    one = measured[1]['one_device']['devices']['cpu(0)']['other']
    split = sum(row['other'] for row in measured[1]['split']['devices'].values())
    assert split <= 1.3 * one


# A language model of --task lm's shape, smaller: one block per stage.
LM = gpt.GPTConfig(vocab_size=32, block_size=32, num_layers=2, num_heads=4, num_hiddens=32)
LM_BATCH = 8


@pytest.fixture(scope='module')
def lm_measured():
    pipe = Pipeline(gpt.build_blocks(LM), 'cpu:0,cpu:1', sample=(LM_BATCH, LM.block_size))
    symbol = pipe.training_symbol('softmax', label_name='label')
    shape = (LM_BATCH, LM.block_size)
    return compare_memory(symbol, [('data', shape)], [('label', shape)], pipe.plan.group2ctx,
                          optimizer='adam')


def test_the_language_model_split_over_two_stages_holds_at_most_1_3_times_one_device_activations(
        lm_measured):
    """The split's activations and workspace (``other``, summed over its
    devices) against the same model on one device, both bound as training
    binds them, as the memory table measures them. It was 2.0 times when
    every split bind gave each array storage of its own; what is left is
    each device's own oneDNN workspace, the boundary's activation and
    gradient copies and each device's own working arrays (docs/pipelining.md):
    0.43 to 0.47 MB, whether the attention is the project's op and the norms
    the fused op (one device 1.58 MB, 1.27 times), the attention MXNet's ops
    (1.88 MB, 1.25 times) or the norms matrix products too (2.39 MB, 1.20
    times)."""
    one = lm_measured['one_device']['devices']['cpu(0)']['other']
    split = sum(row['other'] for row in lm_measured['split']['devices'].values())
    assert split <= 1.3 * one, (split, one)


def test_split_plan_puts_less_parameter_memory_on_each_device_than_one_device(measured):
    one = measured[1]['one_device']['devices']
    split = measured[1]['split']['devices']
    assert list(one) == ['cpu(0)']
    assert all(row['params'] < one['cpu(0)']['params'] for row in split.values())
    assert sum(row['params'] for row in split.values()) == one['cpu(0)']['params']


def test_device_memory_of_a_module_in_this_process_without_storage_totals():
    symbol = _symbol()
    mod = mx.mod.Module(symbol, data_names=['data'], label_names=['label'],
                        group2ctxs={g: mx.Context('cpu', int(c[4])) for g, c in GROUP2CTX.items()})
    mod.bind(data_shapes=DATA, label_shapes=LABEL)
    mod.init_params()
    table = device_memory(mod)
    assert {d: row['params'] for d, row in table.items()} == _param_bytes_by_device(symbol)
    assert table['cpu(0)']['inputs'] == 32 * 64 * 4 and table['cpu(1)']['inputs'] == 32 * 4 * 4
    assert 'other' not in table['cpu(0)']
    with pytest.raises(ValueError, match='expected the storage total to cover its arrays'):
        device_memory(mod, storage={'cpu/0': 1, 'cpu/1': 1})


def test_format_shows_kib_and_mib():
    assert format_bytes(512) == '512 B'
    assert format_bytes(1536) == '1.5 KiB'
    assert format_bytes(3 << 20) == '3.0 MiB'
    lines = format_memory({'cpu(0)': dict.fromkeys(
        ('params', 'grads', 'optimizer', 'aux', 'inputs', 'module_copy'), 2048)}, 'split')
    assert lines[0] == 'split' and lines[2].startswith('cpu(0)') and '2.0 KiB' in lines[2]


def test_device_memory_of_an_executor_counts_gradient_free_arguments_as_inputs():
    symbol = _symbol()
    grad_req = {n: 'null' if n in ('data', 'label') else 'write' for n in symbol.list_arguments()}
    exe = symbol.simple_bind(mx.cpu(0), group2ctx={g: mx.Context('cpu', int(c[4]))
                                                   for g, c in GROUP2CTX.items()},
                             grad_req=grad_req, **dict(DATA + LABEL))
    table = device_memory(exe)
    assert {d: row['params'] for d, row in table.items()} == _param_bytes_by_device(symbol)
    assert {d: row['grads'] for d, row in table.items()} == _param_bytes_by_device(symbol)
    assert table['cpu(1)']['inputs'] == 32 * 4 * 4 and table['cpu(0)']['module_copy'] == 0
    with pytest.raises(ValueError, match='expected a bound mx.mod.Module or an '
                                         'mx.executor.Executor, found Symbol'):
        device_memory(symbol)


def test_a_device_past_the_profiler_rows_is_refused_before_any_child_runs():
    symbol = _symbol()
    with pytest.raises(ValueError, match=r"profiler aborts past them\), found cpu:%d"
                                         % (os.cpu_count() + 2)):
        measure_memory(symbol, DATA, LABEL, {'stage0': 'cpu(0)',
                                             'stage1': 'cpu(%d)' % (os.cpu_count() + 2)})


def _pipeline_module(host_copy=False):
    """The split of :func:`_symbol` as a Pipeline's Module after one step
    (SGD with momentum: one state per parameter), and its Pipeline."""
    pipe = Pipeline(build_blocks(WIDTHS), 'cpu:0,cpu:1', balance=[1, 2])
    mod = pipe.module(loss='l2', label_name='label', host_copy=host_copy)
    mod.bind(data_shapes=DATA, label_shapes=LABEL)
    mod.init_params()
    mod.init_optimizer(kvstore=None, optimizer='sgd', optimizer_params={'momentum': 0.9})
    mod.forward_backward(mx.io.DataBatch([mx.nd.ones(DATA[0][1])], [mx.nd.ones(LABEL[0][1])]))
    mod.update()
    return pipe, mod


@pytest.mark.parametrize('host_copy', [False, True])
def test_memory_table_rows_are_device_memorys_and_params_are_each_stages_bytes(host_copy):
    pipe, mod = _pipeline_module(host_copy)
    table = mp_symbolic.memory_table(mod)
    expected = device_memory(mod)
    assert isinstance(table, MemoryTable) and table.devices == ['cpu(0)', 'cpu(1)']
    for row in table:
        assert {c: getattr(row, c) for c in CATEGORIES} == expected[row.device]
        assert row.total == sum(expected[row.device].values()) and row.other is None
    assert table.total == sum(sum(r.values()) for r in expected.values())
    # each stage's device holds its own parameters, gradients and momentum
    for stage, device in enumerate(pipe.plan.all_devices):
        owned = sum(4 * int(np.prod(p.shape)) for block, s in  # float32
                    zip(pipe.blocks, pipe.plan.stage_of_layer) if s == stage
                    for p in block.collect_params().values())
        row = table[device]
        assert row.params == row.grads == row.optimizer == owned > 0
    params = sum(row.params for row in table)
    assert table['cpu(0)'].module_copy == (params if host_copy else 0)
    assert table['cpu(1)'].module_copy == 0


def test_memory_table_prints_as_the_training_command_does_and_reads_as_a_dict():
    _, mod = _pipeline_module()
    table = mp_symbolic.memory_table(mod)
    assert str(table).splitlines() == format_memory(table.as_dict())
    header, first, _, everything = str(table).splitlines()
    assert header.split() == ['device'] + list(CATEGORIES) + ['total']
    assert first.split()[0] == 'cpu(0)' and everything.split()[0] == 'all'
    assert everything.split()[-2:] == format_bytes(table.total).split()
    assert table.as_dict()['cpu(1)']['total'] == table['cpu(1)'].total
    with pytest.raises(KeyError, match=r'device: expected one of cpu\(0\), cpu\(1\), '
                                       r'found cpu\(2\)'):
        table[mx.cpu(2)]


def test_memory_table_with_storage_totals_adds_other():
    _, mod = _pipeline_module()
    arrays = {d: sum(r.values()) for d, r in device_memory(mod).items()}
    table = mp_symbolic.memory_table(mod, storage={'cpu/0': arrays['cpu(0)'] + 100,
                                                  'cpu/1': arrays['cpu(1)']})
    assert (table['cpu(0)'].other, table['cpu(0)'].total) == (100, arrays['cpu(0)'] + 100)
    assert table['cpu(1)'].other == 0
    assert 'other' in str(table).splitlines()[0].split()


def test_memory_table_of_an_unbound_module_or_a_symbol_is_refused():
    pipe = Pipeline(build_blocks(WIDTHS), 'cpu:0,cpu:1', balance=[1, 2])
    with pytest.raises(ValueError, match='^module: expected a bound Module .after bind or fit., '
                                         'found an unbound PipelineModule$'):
        mp_symbolic.memory_table(pipe.module(loss='l2'))
    with pytest.raises(ValueError, match='expected a bound mx.mod.Module or an '
                                         'mx.executor.Executor, found Symbol'):
        mp_symbolic.memory_table(_symbol())


def test_the_measuring_child_imports_this_very_package_from_any_folder(monkeypatch, tmp_path):
    """The child that measures is given this package's folder on its path,
    so that run from any folder it imports this package, not another copy
    (an installed one) that the folder or the environment would find."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools import memory  # pylint: disable=import-outside-toplevel
    seen, real_run = {}, subprocess.run

    def run(argv, **kwargs):
        seen['env'] = kwargs['env']
        raise RuntimeError('stop before the child')

    monkeypatch.setattr(memory.subprocess, 'run', run)
    monkeypatch.delenv('PYTHONPATH', raising=False)
    with pytest.raises(RuntimeError, match='stop before the child'):
        memory.measure_memories([dict(symbol=mx.sym.var('x'), data_shapes=[('x', (1,))],
                                      label_shapes=[])])
    found = real_run([sys.executable, '-c', 'import mp_symbolic; print(mp_symbolic.__file__)'],
                     env=seen['env'], cwd=tmp_path, capture_output=True, text=True,
                     check=True).stdout.strip()
    assert os.path.realpath(found) == os.path.realpath(mp_symbolic.__file__)
