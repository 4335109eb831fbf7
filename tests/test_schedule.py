"""Pipeline schedules as data: the lists of actions per device, their checks,
what they keep in flight, their ideal bubble and their printed form."""
import pytest

from mp_symbolic.core import schedule as sched
from mp_symbolic.core.schedule import Action, Schedule, ScheduleError


def _all_actions(schedule):
    return [a for actions in schedule for a in actions]


@pytest.mark.parametrize('make', [sched.gpipe, sched.one_f_one_b])
@pytest.mark.parametrize('stages, microbatches', [(1, 1), (2, 1), (2, 4), (3, 2), (3, 8), (4, 3)])
def test_every_stage_runs_forward_and_backward_once_per_microbatch(make, stages, microbatches):
    schedule = make(stages, microbatches)
    actions = _all_actions(schedule)
    assert len(actions) == len(set(actions)) == 2 * stages * microbatches
    for d, device_actions in enumerate(schedule):
        assert {a.stage for a in device_actions} == {d}
        order = {a: k for k, a in enumerate(device_actions)}
        for s, i, kind in device_actions:
            if kind == 'B':
                assert order[Action(s, i, 'F')] < order[Action(s, i, 'B')]


@pytest.mark.parametrize('stages, microbatches', [(2, 1), (2, 2), (2, 8), (3, 2), (3, 8), (4, 16)])
def test_1f1b_keeps_at_most_stages_minus_stage_microbatches_in_flight(stages, microbatches):
    flight = sched.one_f_one_b(stages, microbatches).in_flight()
    assert flight == {s: min(stages - s, microbatches) for s in range(stages)}
    assert sched.gpipe(stages, microbatches).in_flight() == \
        {s: microbatches for s in range(stages)}


@pytest.mark.parametrize('stages, microbatches', [(2, 2), (2, 8), (3, 4), (4, 8)])
def test_gpipe_and_1f1b_bubble_is_the_ideal_k_minus_1_over_m_plus_k_minus_1(stages,
                                                                            microbatches):
    ideal = (stages - 1) / (microbatches + stages - 1)
    assert sched.bubble(sched.gpipe(stages, microbatches)) == pytest.approx(ideal)
    assert sched.bubble(sched.one_f_one_b(stages, microbatches)) == pytest.approx(ideal)


@pytest.mark.parametrize('stages, microbatches, times', [(2, 2, (1, 2)), (3, 8, (1, 2, 1)),
                                                          (3, 4, (2, 1, 1)), (2, 8, (1, 3))])
def test_bubble_at_uneven_stage_times_is_the_flow_shops_under_gpipe_and_no_more_under_1f1b(
        stages, microbatches, times):
    # GPipe's forwards (then backwards) are a flow shop: the last ends after
    # sum(t) + (M - 1) max(t); 1F1B's clock is never longer
    cost = {(s, kind): times[s] for s in range(stages) for kind in 'FB'}
    span = 2 * sum(times) + (microbatches - 1) * 2 * max(times)
    flow_shop = 1 - 2 * microbatches * sum(times) / (stages * span)
    assert sched.bubble(sched.gpipe(stages, microbatches), cost) == pytest.approx(flow_shop)
    assert sched.bubble(sched.one_f_one_b(stages, microbatches), cost) <= flow_shop + 1e-12
    even = {(s, kind): 3 for s in range(stages) for kind in 'FB'}
    assert sched.bubble(sched.one_f_one_b(stages, microbatches), even) == \
        pytest.approx((stages - 1) / (microbatches + stages - 1))


@pytest.mark.parametrize('devices, microbatches, virtual', [(2, 2, 2), (2, 4, 2), (2, 8, 2),
                                                             (3, 6, 2), (4, 8, 2), (2, 4, 3),
                                                             (3, 3, 1)])
def test_interleaved_puts_v_stages_per_device_and_reaches_its_smaller_bubble(devices, microbatches,
                                                                             virtual):
    schedule = sched.interleaved(devices, microbatches, virtual)
    assert schedule.num_stages == devices * virtual
    for d, actions in enumerate(schedule):
        assert {a.stage for a in actions} == {d + c * devices for c in range(virtual)}
    assert len(set(_all_actions(schedule))) == 2 * devices * virtual * microbatches
    ideal = (devices - 1) / (virtual * microbatches + devices - 1)
    assert sched.bubble(schedule) == pytest.approx(ideal)


def test_interleaved_refuses_microbatches_not_a_multiple_of_devices():
    with pytest.raises(ValueError, match=r'^micro-batches: expected a multiple of the 2 devices'
                                         r' for the interleaved schedule, found 3$'):
        sched.interleaved(2, 3, 2)


@pytest.mark.parametrize('make', [sched.gpipe, sched.one_f_one_b])
def test_counts_that_are_not_positive_integers_are_refused(make):
    with pytest.raises(ValueError, match=r'^micro-batches: expected a positive integer, '
                                         r'found 0$'):
        make(2, 0)
    with pytest.raises(ValueError, match=r'^stages: expected a positive integer, found 1.5$'):
        make(1.5, 2)


def _schedule(lists, stages=2, microbatches=1):
    return Schedule('test', tuple(tuple(Action(*a) for a in l) for l in lists), stages,
                    microbatches, tuple(range(stages)))


@pytest.mark.parametrize('lists, message', [
    ([[(0, 0, 'F'), (0, 0, 'B')], [(1, 0, 'F')]], r'found 1B0 missing'),
    ([[(0, 0, 'F'), (0, 0, 'F'), (0, 0, 'B')], [(1, 0, 'F'), (1, 0, 'B')]],
     r'0F0 once, found it twice'),
    ([[(0, 0, 'F'), (1, 0, 'B'), (0, 0, 'B')], [(1, 0, 'F')]],
     r'1B0 on device 1 \(its stage\'s\), found it on device 0'),
    ([[(0, 0, 'F'), (0, 0, 'B')], [(1, 0, 'F'), (1, 0, 'X')]], r'found \(1, 0, \'X\'\)'),
    # the backward of stage 0 before stage 1's: device 0 waits on itself
    ([[(0, 0, 'B'), (0, 0, 'F')], [(1, 0, 'F'), (1, 0, 'B')]],
     r'found every device waiting \(device 0 at 0B0, device 1 at 1F0\)'),
])
def test_a_schedule_that_cannot_run_is_refused_in_one_line(lists, message):
    with pytest.raises(ScheduleError, match=r'^schedule: expected .*' + message) as err:
        sched.check(_schedule(lists))
    assert '\n' not in str(err.value)


def test_issue_order_respects_every_devices_list_and_every_dependency():
    schedule = sched.one_f_one_b(3, 5)
    order = sched.issue_order(schedule)
    assert sorted(order) == sorted(_all_actions(schedule))
    for actions in schedule:
        assert [a for a in order if a in set(actions)] == list(actions)
    done = set()
    for action in order:
        s, i, kind = action
        if kind == 'F' and s:
            assert Action(s - 1, i, 'F') in done
        if kind == 'B':
            assert Action(s, i, 'F') in done
            assert s == 2 or Action(s + 1, i, 'B') in done
        done.add(action)


def test_a_schedule_prints_as_a_table_of_devices_on_a_clock():
    text = str(sched.one_f_one_b(2, 2))
    assert text.splitlines() == ['step  dev0  dev1',
                                 '0     0F0',
                                 '1     0F1   1F0',
                                 '2           1B0',
                                 '3     0B0   1F1',
                                 '4           1B1',
                                 '5     0B1']


def _user_schedule(num_stages, microbatches):
    """GPipe's lists from a function: the user's own schedule."""
    return list(sched.gpipe(num_stages, microbatches))


def test_every_schedule_answers_what_the_runtime_the_planner_and_the_estimate_ask():
    """Each named schedule's record, and a function's (``Schedule`` itself),
    say before any is made whether it runs fused, its virtual stages by
    default and the counts it takes; a made one, its virtual stages, what it
    holds in flight and the twin's order of its forwards."""
    answers = {name: (sched.kind(name).fused, sched.kind(name).virtual_default,
                      sched.kind(name).takes(2, 3), sched.kind(name).takes(2, 4))
               for name in sched.NAMES}
    assert answers == {'gpipe': (True, None, True, True), '1f1b': (False, None, True, True),
                       'interleaved': (False, 2, False, True)}
    assert sched.kind(_user_schedule) is Schedule
    assert (Schedule.fused, Schedule.virtual_default, Schedule.takes(2, 3)) == (False, 1, True)
    assert sched.VIRTUAL == {'interleaved': 2}
    made = {name: sched.make(name, 4, 4, sched.check_spec(name)) for name in sched.NAMES}
    made['user'] = sched.make(_user_schedule, 4, 4)
    assert {n: (type(s).__name__, s.fused, s.virtual) for n, s in made.items()} == {
        'gpipe': ('GPipe', True, 1), '1f1b': ('OneFOneB', False, 1),
        'interleaved': ('Interleaved', False, 2), 'user': ('Schedule', False, 1)}
    assert made['1f1b'].in_flight() == {0: 4, 1: 3, 2: 2, 3: 1}
    assert made['user'].in_flight() == made['gpipe'].in_flight() == {s: 4 for s in range(4)}
    assert made['user'].forwards() == made['gpipe'].forwards()
    assert [a for a in sched.issue_order(made['1f1b']) if a.kind == 'F'] == \
        made['1f1b'].forwards()
    with pytest.raises(ValueError, match=r"^schedule: expected one of 'gpipe', '1f1b', "
                                         r"'interleaved' or a function"):
        sched.kind('zigzag')
