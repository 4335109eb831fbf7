"""Interleaved stages on the stage runtime: ``Pipeline(..., schedule='interleaved',
virtual=v)`` cuts the network into ``v x K`` stages placed round-robin on
the K devices, trains as the one GPipe graph does, and follows Megatron-LM's
interleaved order in MXNet's profiler trace (traced in one child beside 1F1B,
which starts backwards before its last forward, and GPipe, which does not);
a device listed twice is still refused."""
import mxnet as mx
import numpy as np
import pytest

from mp_symbolic import Pipeline
from mp_symbolic.core import kernels
from mp_symbolic.core import schedule as sched
from mp_symbolic.core.placement.devices import DeviceSpecError
from test_stages import TOL, _lm, _train

SMALL = dict(vocab_size=32, block_size=32, num_layers=2, num_heads=2, num_hiddens=32)


@pytest.mark.parametrize('make, devices, chunks, replicas', [
    (_lm, 'cpu:0,cpu:1', 2, 1), (_lm, 'cpu:0,cpu:1', 4, 1),
    (lambda: _lm(whole=True), 'cpu:0,cpu:1', 2, 1), (_lm, 'cpu:0,cpu:1,cpu:2,cpu:3', 2, 2)])
def test_interleaved_equals_the_gpipe_graph_after_three_steps(make, devices, chunks, replicas):
    """The language model (its token embedding tied to its output layer,
    across stages 0 and 3), as a block list, as one whole network cut, and
    in two replicas."""
    _, expected_out, expected = _train(make, devices, chunks, 'gpipe', replicas)
    pipe, out, params = _train(make, devices, chunks, 'interleaved', replicas)
    assert pipe.plan.num_stages == 4 and pipe.tied
    np.testing.assert_allclose(out, expected_out, rtol=TOL, atol=TOL)
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(params[name], value, rtol=TOL, atol=TOL, err_msg=name)


def test_virtual_stages_go_round_robin_and_each_binds_what_it_keeps_in_flight():
    net, sample = _lm()
    pipe = Pipeline(net, 'cpu:0,cpu:1', sample=sample, chunks=4, schedule='interleaved',
                    virtual=2)
    assert pipe.plan.devices == (mx.cpu(0), mx.cpu(1), mx.cpu(0), mx.cpu(1))
    assert pipe.devices_per_replica == 2 and pipe.virtual == 2
    mod = pipe.module(loss='softmax')
    mod.bind([('data', sample)], [('softmax_label', sample)])
    runtime = mod._runtimes[0]  # pylint: disable=protected-access
    flight = sched.interleaved(2, 4, 2).in_flight()
    assert [len(slots) for slots in runtime.slots] == [flight[s] for s in range(4)]
    assert [slots[0].executor.outputs[0].context for slots in runtime.slots] == \
        list(pipe.plan.devices)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'interleaved'])
def test_a_device_listed_twice_is_refused_as_before_under_every_schedule(schedule):
    with pytest.raises(DeviceSpecError, match=r'^expected each device once, found cpu:0 twice '
                                              r'in cpu:0,cpu:1,cpu:0$'):
        Pipeline(_lm()[0], 'cpu:0,cpu:1,cpu:0', chunks=3, schedule=schedule)


@pytest.mark.parametrize('kwargs, message', [
    (dict(schedule='1f1b', virtual=2), r"^virtual: expected None with schedule='1f1b'"),
    (dict(schedule='interleaved', virtual=0), r'^virtual: expected a positive integer'),
    (dict(schedule='interleaved', chunks=3), r'^micro-batches: expected a multiple of the 2 '
                                             r'devices for the interleaved schedule, found 3$'),
])
def test_what_interleaving_cannot_run_is_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Pipeline(_lm()[0], 'cpu:0,cpu:1', **kwargs)


@pytest.mark.parametrize('schedule, virtual', [('gpipe', None), ('1f1b', None),
                                               ('interleaved', None), ('interleaved', 2)])
def test_a_pipeline_checks_its_virtual_stages_once(monkeypatch, schedule, virtual):
    """``Pipeline(virtual=...)`` is checked by the schedule record once, before
    the placement; the placement and the schedule take the checked count."""
    calls = []
    check = sched.check_spec

    def counted(*args):
        calls.append(args)
        return check(*args)

    monkeypatch.setattr(sched, 'check_spec', counted)
    pipe = Pipeline(_lm()[0], 'cpu:0,cpu:1', chunks=2, schedule=schedule, virtual=virtual)
    assert calls == [(schedule, virtual)]
    assert pipe.virtual == (2 if schedule == 'interleaved' else 1)
    assert pipe.plan.num_stages == 2 * pipe.virtual


def _entered(schedule, device=0):
    """Micro-batches the first stage takes in on ``device`` before its first backward."""
    actions = schedule[device]
    first = next(k for k, a in enumerate(actions) if a.kind == 'B')
    return sum(1 for a in actions[:first] if a.stage == 0)


@pytest.fixture(scope='module')
def traced():
    """``{schedule: stats}`` of one traced step (the median span of 3) of the
    small language model under each schedule, K = 2, M = 4, in one child
    (MXNet's profiler serves one trace per process)."""
    from bench.schedules import spec, trace  # pylint: disable=import-outside-toplevel
    specs = [spec('gpipe', 2, 4, 8, SMALL), spec('1f1b', 2, 4, 8, SMALL),
             spec('interleaved', 2, 4, 8, SMALL, virtual=2)]
    return {one['schedule']: stats for one, stats in zip(specs, trace(specs))}


def test_under_1f1b_every_device_runs_a_backward_before_its_last_forward(traced):
    """In MXNet's profiler trace, not only in the order Python issues them:
    under GPipe's one graph no device starts a dense layer's backward before
    its last forward; under 1F1B (K = 2, M = 4) every device does (a stage's
    executors are reused, so a forward waits for the backward that frees its
    executor)."""
    assert traced['gpipe']['backward_before_last_forward'] == {'cpu/0': False, 'cpu/1': False}
    assert traced['1f1b']['backward_before_last_forward'] == {'cpu/0': True, 'cpu/1': True}


def test_interleaved_has_the_smaller_ideal_bubble_and_its_order_shows_in_the_trace(traced):
    """The ideal (one unit per action) is below 1F1B's at K = 2, 3; in MXNet's
    trace (K = 2, M = 4) every device starts a backward before its last
    forward, and the first device begins as many micro-batches before its
    first backward as the schedule says: 3 under interleaved, 2 under 1F1B
    (begun: one of its ``Embedding`` ops started; on a loaded machine the
    engine ran the third micro-batch's other one after the backward, which
    does not wait for it; a wall-clock bubble on this shared machine is
    reported by ``make bench-pipeline``, not asserted)."""
    for k, m in ((2, 4), (3, 6)):
        assert sched.bubble(sched.interleaved(k, m, 2)) < sched.bubble(sched.one_f_one_b(k, m))
    one_f_one_b, interleaved = traced['1f1b'], traced['interleaved']
    assert interleaved['backward_before_last_forward'] == {'cpu/0': True, 'cpu/1': True}
    assert one_f_one_b['microbatches_before_first_backward'] == \
        {'cpu/0': _entered(sched.one_f_one_b(2, 4))} == {'cpu/0': 2}
    assert interleaved['microbatches_before_first_backward'] == \
        {'cpu/0': _entered(sched.interleaved(2, 4, 2))} == {'cpu/0': 3}


def test_a_virtual_count_too_large_for_the_blocks_is_blamed_on_virtual(capsys, tmp_path):
    from conftest import cli_status  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    assert cli_status(main, ['train', '--schedule', 'interleaved', '--virtual', '1000000',
                             '--epochs', '1', '--out', str(tmp_path / 'out')]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        'error: --virtual: too many stages for the blocks (devices per replica: 3, 1000000 '
        'stages on each: 3000000 stages, blocks: 3); expected at most one stage per block')


def test_a_virtual_count_too_large_for_a_whole_networks_ops_is_blamed_on_virtual(capsys, tmp_path):
    from conftest import cli_status  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.cli import main  # pylint: disable=import-outside-toplevel
    assert cli_status(main, ['train', '--task', 'lm', '--task-arg', 'whole=True', '--schedule',
                             'interleaved', '--virtual', '1000000', '--epochs', '1', '--out',
                             str(tmp_path / 'out')]) == 2
    # each norm one op, or five products; each attention one op (and the identities
    # of its three inputs), or 32 of MXNet's
    ops = (109 if kernels.use_fused_norm() else 204) - (2 * 28 if kernels.use_fused_attention()
                                                        else 0)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        'error: --virtual: too many stages for the graph (devices per replica: 3, 1000000 '
        'stages on each: 3000000 stages, ops: %d); expected at most one stage per op' % ops)


def test_too_few_ops_of_a_whole_network_for_the_virtual_stages_is_refused_counting_stages():
    from mxnet import gluon  # pylint: disable=import-outside-toplevel
    net = gluon.nn.Dense(2, in_units=4)  # one op, cut through its graph
    net.initialize()
    with pytest.raises(DeviceSpecError, match=r'^too many stages for the graph \(devices per '
                                              r'replica: 2, 2 stages on each: 4 stages, ops: '
                                              r'1\); expected at most one stage per op$'):
        Pipeline(net, 'cpu:0,cpu:1', sample=(4, 4), chunks=2, schedule='interleaved')


def test_too_few_blocks_for_the_virtual_stages_is_refused_counting_stages_not_devices():
    from mxnet import gluon  # pylint: disable=import-outside-toplevel
    blocks = [gluon.nn.Dense(4, in_units=4), gluon.nn.Dense(2, in_units=4)]
    with pytest.raises(DeviceSpecError, match=r'^too many stages for the blocks \(devices per '
                                              r'replica: 2, 2 stages on each: 4 stages, blocks: '
                                              r'2\); expected at most one stage per block$'):
        Pipeline(blocks, 'cpu:0,cpu:1', chunks=2, schedule='interleaved')
