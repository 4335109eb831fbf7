"""The device plan and the --devices flag: what is accepted, what is refused."""
import os
import re

import mxnet as mx
import pytest

from mp_symbolic.training.cli import build_parser, main
from mp_symbolic.core.placement.devices import DeviceSpecError, make_plan, parse_devices, partition


def test_parse_devices_mixed():
    assert parse_devices('cpu:0, gpu:1', num_gpus=2) == [mx.cpu(0), mx.gpu(1)]


@pytest.mark.parametrize('layers, stages, expected', [
    (3, 3, (0, 1, 2)), (3, 2, (0, 0, 1)), (3, 1, (0, 0, 0)), (5, 2, (0, 0, 0, 1, 1))])
def test_partition_is_contiguous_and_balanced(layers, stages, expected):
    assert partition(layers, stages) == expected


def test_default_plan_uses_cpu_stand_ins_without_gpus():
    plan, note = make_plan(3, None, num_gpus=0)
    assert plan.devices == (mx.cpu(0), mx.cpu(1), mx.cpu(2))
    assert 'stand-in' in note


def test_default_plan_uses_gpus_when_there_are_enough():
    plan, note = make_plan(3, None, num_gpus=4)
    assert plan.devices == (mx.gpu(0), mx.gpu(1), mx.gpu(2))
    assert '3 GPUs' in note


def test_group2ctx_names_match_the_block_groups():
    plan, _ = make_plan(3, 'cpu:0,cpu:1')
    assert plan.group2ctx == {'stage0': mx.cpu(0), 'stage1': mx.cpu(1)}
    assert plan.stage_of_layer == (0, 0, 1)


def test_replicas_list_their_devices_replica_by_replica():
    plan, _ = make_plan(2, 'cpu:0,cpu:1,cpu:2,cpu:3', replicas=2)
    assert plan.group2ctxs == [{'stage0': mx.cpu(0), 'stage1': mx.cpu(1)},
                               {'stage0': mx.cpu(2), 'stage1': mx.cpu(3)}]
    with pytest.raises(DeviceSpecError, match='found 3 devices for 2 replicas'):
        make_plan(2, 'cpu:0,cpu:1,cpu:2', replicas=2)


@pytest.mark.parametrize('spec, message', [
    ('cpu:0,cpu:1,cpu:2,cpu:3', 'too many devices for the blocks (devices per replica: 4, '
                                'blocks: 3)'),
    ('cpu:\uff10', "found 'cpu:\\uff10'"),        # a full-width digit zero
    ('cpu:\u0663', "found 'cpu:\\u0663'"),        # an Arabic-Indic three
    ('gpu:0', 'gpu:0 requested but MXNet sees 0 GPU(s)'),
    ('cpu:0,gpu:2', 'gpu:2 requested but MXNet sees 0 GPU(s)'),
    ('cpu0', "expected devices of the form 'cpu:N' or 'gpu:N' (N in ASCII digits), found 'cpu0'"),
    ('cpu:-1', "found 'cpu:-1'"),
    ('tpu:0', "found 'tpu:0'"),
    ('cpu:0,,cpu:1', "found ''"),
    ('', 'found an empty string'),
    ('cpu:1,cpu:1', 'expected each device once, found cpu:1 twice'),
    ('cpu:99999999999', "expected cpu:N with N at most 63, found 'cpu:99999999999'"),
])
def test_bad_devices_exit_2_with_one_line(spec, message, capsys):
    assert main(['train', '--devices', spec, '--no-progress']) == 2
    captured = capsys.readouterr()
    assert captured.err.count('\n') == 1, captured.err
    assert captured.err.startswith('error: ')
    assert message in captured.err
    assert 'Traceback' not in captured.err
    assert captured.out == ''


def test_bad_gpu_count_is_a_device_spec_error():
    with pytest.raises(DeviceSpecError, match='gpu:3 requested but MXNet sees 2 GPU'):
        parse_devices('gpu:3', num_gpus=2)


@pytest.mark.parametrize('argv, message', [
    (['--epochs', '0'], '--epochs: expected a positive integer, found 0'),
    (['--lr', 'nan'], '--lr: expected a number in [1e-30, 1e6], found nan'),
    (['--lr', '1e308'], '--lr: expected a number in [1e-30, 1e6], found 1e+308'),
    (['--widths', '3,2,1'], '--widths: expected input width 2 and output width 1'),
    (['--widths', '2,100000,100000,1'], '--widths: expected at most 2**28 parameters in all'),
    (['--batch-size', '20000'], "--batch-size: expected at most the task's 10000 training examples"),
])
def test_bad_config_values_exit_2_naming_the_flag(argv, message, capsys):
    assert main(['train', '--no-progress'] + argv) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and message in err, err


def test_help_lists_every_option():
    # pylint: disable=protected-access
    text = build_parser()._subparsers._group_actions[0].choices['train'].format_help()
    for flag in ('--variant', '--api', '--devices', '--epochs', '--batch-size', '--lr',
                 '--optimizer', '--momentum', '--widths', '--num-examples', '--seed',
                 '--out', '--profile', '--no-progress', '--task', '--chunks', '--replicas',
                 '--kvstore', '--balance', '--checkpoint-every', '--resume'):
        assert flag in text


@pytest.mark.parametrize('devices, message', [
    ([mx.cpu(0), mx.cpu(0)], 'expected each device once, found cpu:0 twice'),
    ([mx.cpu(0), mx.gpu(7)], 'gpu:7 requested but MXNet sees 0 GPU(s)'),
])
def test_device_lists_are_checked_like_strings(devices, message):
    with pytest.raises(DeviceSpecError, match=re.escape(message)):
        make_plan(3, devices, num_gpus=0)


@pytest.mark.parametrize('argv, message', [
    (['--optimizer', 'adam', '--momentum', '0.9'],
     "--momentum: expected 0 with optimizer 'adam'"),
    (['--variant', 'imperative', '--api', 'executor'],
     "--api: expected 'module' (the default) with variant 'imperative'"),
])
def test_flags_that_would_be_ignored_are_refused(argv, message, capsys):
    assert main(['train', '--no-progress'] + argv) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and message in err, err


def test_profiling_a_device_past_the_profiler_rows_is_refused(capsys):
    cpu = os.cpu_count() + 2
    assert main(['train', '--no-progress', '--profile', '--devices',
                 'cpu:0,cpu:%d' % cpu]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and '--profile: expected cpu:N devices with N below' in err


def test_out_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    target = tmp_path / 'a-file'
    target.write_text('keep me')
    assert main(['train', '--no-progress', '--out', str(target)]) == 2
    assert '--out: expected a folder, found a file at' in capsys.readouterr().err
    assert main(['train', '--no-progress', '--out', str(target / 'below')]) == 2
    assert '--out: expected a folder, found a file at' in capsys.readouterr().err
    assert target.read_text() == 'keep me'


@pytest.mark.parametrize('out, message', [
    ('/proc/mp-out', '--out: expected a folder this user can create'),
    ('/tmp/' + 'x' * 300, '--out: expected a path this system can open (names of at most 255 '
                          'bytes, 4096 in all), found /tmp/xxx'),
])
def test_an_out_the_system_refuses_is_an_error_before_training(out, message, capsys):
    assert main(['train', '--no-progress', '--out', out]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and message in err


def test_an_out_mxnet_cannot_open_is_refused_before_training(capsys):
    """A name that is not UTF-8 (bytes 0xff, as a shell passes them) cannot be
    opened by MXNet, which names files in UTF-8."""
    assert main(['train', '--no-progress', '--out', '/tmp/bad\udcffname']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and '--out: expected a path MXNet can open (UTF-8' in err
