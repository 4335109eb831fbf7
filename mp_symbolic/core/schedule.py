"""Pipeline schedules as data: which device runs which stage's forward or
backward pass on which micro-batch, in what order (after
torch.distributed.pipelining and Megatron-LM; docs/pipelining.md).

An :class:`Action` is ``(stage, microbatch, kind)``, ``kind`` ``'F'`` or
``'B'``; a :class:`Schedule` holds one list of actions per device, in issue
order. Every schedule made here is checked (:func:`check`): each ``(stage,
micro-batch)`` runs forward once and backward once, on its stage's device,
and the devices can run their lists without waiting on each other for ever
(a stage's forward after the previous stage's; its backward after its
forward and the next stage's backward). ``print(schedule)`` draws it.
"""
from collections import namedtuple
from dataclasses import dataclass
import reprlib
import threading

from .base.checks import excerpt, is_int, positive_int

__all__ = []

KINDS = ('F', 'B')
# Seconds a schedule function may take to return its lists and have them
# read (:func:`make`): one that sleeps, or returns an endless iterable, is
# refused once they have passed. Set ``schedule.TIME_LIMIT`` to allow more.
TIME_LIMIT = 10.0


class ScheduleError(ValueError):
    """A schedule that cannot run: an action missing, repeated, on the wrong
    device, or an order in which the devices wait on each other for ever."""


class Action(namedtuple('Action', 'stage microbatch kind')):
    """One step of a device: ``kind`` (``'F'`` or ``'B'``) of ``stage`` on
    micro-batch ``microbatch``; printed ``<stage><kind><microbatch>``."""
    __slots__ = ()

    def __str__(self):
        return '%d%s%d' % (self.stage, self.kind, self.microbatch)


@dataclass(frozen=True)
class Schedule:
    """One list of :class:`Action` s per device, in issue order, and what the
    runtime, the planner, the estimate and the twin ask of a schedule. A named
    schedule is a subclass in :data:`NAMED`, whose class attributes and
    :meth:`takes` answer for its name before one is made; ``Schedule`` itself
    answers for a function's. A new schedule is a subclass and its entry.

    Attributes:
        name: ``'gpipe'``, ``'1f1b'``, ``'interleaved'``, or the function's name.
        devices: A tuple per device of its actions.
        num_stages: Stages (``v x`` devices for ``v`` virtual stages per device).
        microbatches: Micro-batches per batch.
        device_of_stage: ``device_of_stage[s]``: the device running stage ``s``.
        fused: (class) Whether it runs in one process as MXNet's one bound
            graph of every micro-batch, its order left to MXNet's engine,
            rather than on the stage runtime.
        virtual_default: (class) Its virtual stages per device when ``virtual``
            is not given; ``None``: one, and ``virtual`` refused.
    """
    name: str
    devices: tuple
    num_stages: int
    microbatches: int
    device_of_stage: tuple

    fused = False
    virtual_default = 1

    @classmethod
    def takes(cls, devices, microbatches):  # pylint: disable=unused-argument
        """Whether it runs ``microbatches`` over ``devices`` devices (the planner's
        candidates)."""
        return True

    @property
    def virtual(self):
        """The stages each device runs."""
        return self.num_stages // len(self.devices)

    def in_flight(self):
        """``{stage: most micro-batches between their forward and their backward
        at once}``, in each device's order: the activations a stage keeps."""
        most = {s: 0 for s in range(self.num_stages)}
        for actions in self.devices:
            alive = {s: 0 for s in most}
            for s, _, kind in actions:
                alive[s] += 1 if kind == 'F' else -1
                most[s] = max(most[s], alive[s])
        return most

    def forwards(self):
        """The forward actions in :func:`issue_order`: the imperative twin's order."""
        return [a for a in issue_order(self) if a.kind == 'F']

    def bubble(self, cost=None):
        """:func:`bubble`: the idle fraction of the devices' time."""
        return bubble(self, cost)

    def __iter__(self):
        return iter(self.devices)

    def __len__(self):
        return len(self.devices)

    def __getitem__(self, device):
        return self.devices[device]

    def __str__(self):
        return format_schedule(self)


def _make(name, lists, num_stages, microbatches, device_of_stage, kind=Schedule):
    schedule = kind(name, tuple(tuple(actions) for actions in lists), num_stages,
                    microbatches, tuple(device_of_stage))
    check(schedule)
    return schedule


def gpipe(num_stages, microbatches):
    """GPipe's fill and drain: every device runs all its forwards, then all its
    backwards, each in micro-batch order.

    Raises:
        ValueError: a count that is not a positive integer.
    """
    stages = positive_int('stages', num_stages)
    m = positive_int('micro-batches', microbatches)
    lists = [[Action(s, i, 'F') for i in range(m)] + [Action(s, i, 'B') for i in range(m)]
             for s in range(stages)]
    return _make('gpipe', lists, stages, m, range(stages), GPipe)


def one_f_one_b(num_stages, microbatches):
    """1F1B (PipeDream-flush): stage ``s`` of ``K`` runs ``min(K - 1 - s, M)``
    forwards, then one forward and one backward in turn, then its remaining
    backwards; it holds at most ``K - s`` micro-batches in flight.

    Raises:
        ValueError: a count that is not a positive integer.
    """
    stages = positive_int('stages', num_stages)
    m = positive_int('micro-batches', microbatches)
    lists = []
    for s in range(stages):
        warmup = min(stages - 1 - s, m)
        actions = [Action(s, i, 'F') for i in range(warmup)]
        forward, backward = warmup, 0
        while forward < m:
            actions += [Action(s, forward, 'F'), Action(s, backward, 'B')]
            forward, backward = forward + 1, backward + 1
        actions += [Action(s, i, 'B') for i in range(backward, m)]
        lists.append(actions)
    return _make('1f1b', lists, stages, m, range(stages), OneFOneB)


def interleaved(num_devices, microbatches, virtual):
    """Megatron-LM's interleaved 1F1B: device ``d`` of ``K`` holds stages ``d, d +
    K, ..., d + (v - 1) K``. Its ``k``-th forward is of its stage ``(k // K) mod
    v`` on micro-batch ``(k // (K v)) K + k mod K``; its backwards the same,
    the stages reversed.

    Raises:
        ValueError: a count that is not a positive integer, or ``M`` not a
            multiple of ``K``.
    """
    k = positive_int('devices', num_devices)
    m = positive_int('micro-batches', microbatches)
    v = positive_int('virtual stages', virtual)
    if m % k:
        raise ValueError('micro-batches: expected a multiple of the %d devices for the '
                         'interleaved schedule, found %d' % (k, m))
    total = m * v

    def nth(d, n, backward):
        chunk = (n // k) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk * k + d, (n // (k * v)) * k + n % k

    lists = []
    for d in range(k):
        warmup = min((k - d - 1) * 2 + (v - 1) * k, total)
        actions = [Action(*nth(d, n, False), 'F') for n in range(warmup)]
        forward, backward = warmup, 0
        while forward < total:
            actions += [Action(*nth(d, forward, False), 'F'), Action(*nth(d, backward, True), 'B')]
            forward, backward = forward + 1, backward + 1
        actions += [Action(*nth(d, n, True), 'B') for n in range(backward, total)]
        lists.append(actions)
    return _make('interleaved', lists, k * v, m, [s % k for s in range(k * v)], Interleaved)


class GPipe(Schedule):
    """:func:`gpipe`'s schedule: in one process, MXNet's one graph."""
    fused = True
    virtual_default = None

    @staticmethod
    def build(num_stages, microbatches, virtual):  # pylint: disable=unused-argument
        return gpipe(num_stages, microbatches)


class OneFOneB(Schedule):
    """:func:`one_f_one_b`'s schedule."""
    virtual_default = None

    @staticmethod
    def build(num_stages, microbatches, virtual):  # pylint: disable=unused-argument
        return one_f_one_b(num_stages, microbatches)


class Interleaved(Schedule):
    """:func:`interleaved`'s schedule: 2 virtual stages per device unless given."""
    virtual_default = 2

    @classmethod
    def takes(cls, devices, microbatches):
        return microbatches % devices == 0

    @staticmethod
    def build(num_stages, microbatches, virtual):
        return interleaved(num_stages // virtual, microbatches, virtual)


# The named schedules: each name's Schedule subclass, whose ``build(stages,
# micro-batches, virtual stages per device)`` makes it. ``NAMES``, ``VIRTUAL``
# (the names that take virtual stages, each with its default) follow.
NAMED = {'gpipe': GPipe, '1f1b': OneFOneB, 'interleaved': Interleaved}
NAMES = tuple(NAMED)
VIRTUAL = {name: cls.virtual_default for name, cls in NAMED.items()
           if cls.virtual_default is not None}
DEFAULT = 'gpipe'


def kind(spec):
    """The :class:`Schedule` class that answers for ``spec``: a name's
    (:data:`NAMED`), or ``Schedule`` for a function.

    Raises:
        ValueError: an unknown name.
    """
    if callable(spec) and not isinstance(spec, str):
        return Schedule
    if not isinstance(spec, str) or spec not in NAMED:
        raise ValueError('schedule: expected one of %s or a function (num_stages, '
                         'microbatches) -> one list of actions per device, found %s'
                         % (', '.join(repr(k) for k in NAMES), excerpt(repr(spec))))
    return NAMED[spec]


def whole_batch(num_stages):
    """The schedule of a batch run as one micro-batch."""
    return gpipe(num_stages, 1)


def check_spec(spec, virtual=None):
    """The virtual stages per device of schedule ``spec`` (a name of :data:`NAMES`
    or a function), after checking both.

    Raises:
        ValueError: an unknown name; ``virtual`` given to a schedule of one
            stage per device, or not a positive integer.
    """
    default = kind(spec).virtual_default
    if virtual is not None and default is None:
        raise ValueError('virtual: expected None with schedule=%r (virtual stages are the '
                         '%s schedule\'s), found %r' % (spec, ' or '.join(
                             repr(k) for k in VIRTUAL), virtual))
    return positive_int('virtual', (default or 1) if virtual is None else virtual)


def round_robin(devices, virtual):
    """The device of each of ``devices x virtual`` stages, stage ``s`` on
    device ``s mod devices``: how every named schedule lays its stages out
    (``virtual`` a count :func:`check_spec` gave)."""
    return tuple(s % devices for s in range(devices * virtual))


def make(spec, num_stages, microbatches, virtual=1):
    """The checked :class:`Schedule` of ``spec`` (see :func:`check_spec`) over
    ``num_stages`` stages, ``virtual`` per device: stage ``s`` on device ``s mod
    (num_stages / virtual)``.

    A function's lists may be any iterables of :class:`Action` s or ``(stage,
    microbatch, kind)`` tuples. It is called once, in a thread of its own; it
    and the reading of its lists must end within :data:`TIME_LIMIT` seconds,
    and at most ``2 x num_stages x microbatches`` actions are read per device.

    Raises:
        ScheduleError: the function's schedule cannot run (:func:`check`), is
            not one list of actions per device, holds more actions than that on
            a device, or the function or the reading raised or overran
            :data:`TIME_LIMIT`.
        ValueError: a count that is not a positive integer, or (interleaved)
            micro-batches not a multiple of the devices.
    """
    if not callable(spec) or isinstance(spec, str):
        return kind(spec).build(num_stages, microbatches, virtual)
    devices = num_stages // virtual
    name = getattr(spec, '__name__', None)
    name = name if isinstance(name, str) else type(spec).__name__
    lists = _within_time_limit(lambda: _read(spec, name, num_stages, microbatches, devices),
                               '%s(%d, %d)' % (name, num_stages, microbatches))
    return _make(name, lists, num_stages, microbatches, [s % devices for s in range(num_stages)])


def _within_time_limit(read, call):
    """``read()`` in a thread of its own (a signal's alarm would reach only the
    main thread), waited on for :data:`TIME_LIMIT` seconds.

    Raises:
        ScheduleError: it is still running then (the thread is left to end).
        BaseException: what ``read`` raised.
    """
    done = {}

    def run():
        try:
            done['value'] = read()
        except BaseException as err:  # pylint: disable=broad-except
            done['error'] = err

    thread = threading.Thread(target=run, name='schedule %s' % call, daemon=True)
    thread.start()
    thread.join(TIME_LIMIT)
    if thread.is_alive():
        raise ScheduleError('schedule: expected %s to return its lists of actions within %g s '
                            '(schedule.TIME_LIMIT), found it still running then'
                            % (call, TIME_LIMIT))
    if 'error' in done:
        error = done.pop('error')
        raise error.with_traceback(None) if isinstance(error, ScheduleError) else error
    return done['value']


def _described(err):
    """``'KeyError: message'`` on one line, cut to an excerpt."""
    try:
        message = ' '.join(str(err).split())
    except Exception:  # pylint: disable=broad-except
        message = ''
    return excerpt('%s%s' % (type(err).__name__, ': ' + message if message else ''))


_END = object()


def _read(spec, name, num_stages, microbatches, devices):
    """``spec(num_stages, microbatches)`` read into one list of :class:`Action` s
    per device, every iterable read under a bound.

    Raises:
        ScheduleError: as :func:`make`.
    """
    call = '%s(%d, %d)' % (name, num_stages, microbatches)
    try:
        lists = spec(num_stages, microbatches)
    except Exception as err:  # pylint: disable=broad-except
        raise ScheduleError('schedule: expected %s to return one list of actions per '
                            'device, found it raising %s' % (call, _described(err))) from None
    if isinstance(lists, Schedule):
        lists = lists.devices

    def not_lists():
        return ScheduleError('schedule: expected %s to return one list of (stage, microbatch, '
                             'kind) actions per device, found %s'
                             % (name, excerpt(_repr.repr(lists))))

    def items(value):
        try:
            iterator = iter(value)
        except TypeError:
            raise not_lists() from None
        except Exception as err:  # pylint: disable=broad-except
            raise read_error(err) from None
        while True:
            try:
                item = next(iterator, _END)
            except Exception as err:  # pylint: disable=broad-except
                raise read_error(err) from None
            if item is _END:
                return
            yield item

    def read_error(err):
        return ScheduleError('schedule: expected the lists %s returns to be read, found '
                             'reading them raising %s' % (call, _described(err)))

    limit = 2 * num_stages * microbatches
    read = []
    for actions in items(lists):
        if len(read) == devices:
            raise ScheduleError('schedule: expected %s to return one list of actions per '
                                'device (%d), found %s lists' % (
                                    name, devices, len(lists) if isinstance(lists, (list, tuple))
                                    else 'more than %d' % devices))
        read.append([])
        for action in items(actions):
            if len(read[-1]) == limit:
                raise ScheduleError(
                    'schedule: expected at most 2 x stages x micro-batches = 2 x %d x %d = %d '
                    'actions on a device from %s (a longer list repeats one), found more on '
                    'device %d' % (num_stages, microbatches, limit, call, len(read) - 1))
            fields = []
            for field in items(action):
                fields.append(field)
                if len(fields) > 3:
                    break
            if len(fields) != 3:
                raise not_lists()
            read[-1].append(Action(*fields))
    if len(read) != devices:
        raise ScheduleError('schedule: expected %s to return one list of actions per device '
                            '(%d), found %d lists' % (name, devices, len(read)))
    return read


_repr = reprlib.Repr()  # a value echoed in a message: bounded, whatever its size or depth
_repr.maxlevel, _repr.maxlist, _repr.maxtuple, _repr.maxother = 4, 8, 8, 40


def _needs(action, num_stages):
    """The actions that must be done before ``action`` can start."""
    s, i, kind = action
    if kind == 'F':
        return [Action(s - 1, i, 'F')] if s else []
    return [Action(s, i, 'F')] + ([Action(s + 1, i, 'B')] if s + 1 < num_stages else [])


def timeline(schedule, cost=None):
    """The devices' clock: ``[(start, end, action)]`` per device in its order, each
    action started once its device is free and the actions it needs have ended;
    ``cost`` ``{kind: time}`` or ``{(stage, kind): time}`` (``None``: one unit).

    Raises:
        ScheduleError: the devices wait on each other for ever (the message
            names what each waits for).
        KeyError: ``cost`` lacks an action's stage and kind.
    """
    cost = cost or {'F': 1, 'B': 1}
    end = {}
    position = [0] * len(schedule)
    free = [0] * len(schedule)
    rows = [[] for _ in schedule]
    remaining = sum(len(actions) for actions in schedule)
    while remaining:
        progressed = False
        for d, actions in enumerate(schedule):
            while position[d] < len(actions):
                action = actions[position[d]]
                needs = _needs(action, schedule.num_stages)
                if any(n not in end for n in needs):
                    break
                start = max([free[d]] + [end[n] for n in needs])
                took = cost[(action.stage, action.kind)] if (action.stage, action.kind) in cost \
                    else cost[action.kind]
                end[action] = free[d] = start + took
                rows[d].append((start, end[action], action))
                position[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ['device %d at %s' % (d, actions[position[d]])
                     for d, actions in enumerate(schedule) if position[d] < len(actions)]
            raise ScheduleError('schedule: expected an order the devices can run, found '
                                'every device waiting (%s)' % ', '.join(stuck))
    return rows


def check(schedule):
    """Checks that ``schedule`` can run (see the module docstring).

    Raises:
        ScheduleError: an action missing, repeated, of an unknown kind or
            stage, or on another device than its stage's; devices that wait on
            each other for ever.
    """
    seen = set()
    for d, actions in enumerate(schedule):
        for action in actions:
            s, i, kind = action
            if kind not in KINDS or not is_int(s) or not is_int(i) or \
                    not 0 <= s < schedule.num_stages or not 0 <= i < schedule.microbatches:
                raise ScheduleError('schedule: expected actions (stage < %d, micro-batch < %d, '
                                    'F or B), found %r on device %d'
                                    % (schedule.num_stages, schedule.microbatches,
                                       tuple(action), d))
            if schedule.device_of_stage[s] != d:
                raise ScheduleError('schedule: expected %s on device %d (its stage\'s), found '
                                    'it on device %d' % (action, schedule.device_of_stage[s], d))
            if action in seen:
                raise ScheduleError('schedule: expected %s once, found it twice' % (action,))
            seen.add(action)
    expected = schedule.num_stages * schedule.microbatches * len(KINDS)
    if len(seen) != expected:
        missing = sorted(Action(s, i, k) for s in range(schedule.num_stages)
                         for i in range(schedule.microbatches) for k in KINDS
                         if Action(s, i, k) not in seen)
        raise ScheduleError('schedule: expected every stage forward and backward on every '
                            'micro-batch, found %s missing' % ', '.join(map(str, missing[:4])))
    timeline(schedule)


def bubble(schedule, cost=None):
    """The idle fraction of the devices' time from the first start to the last
    end on :func:`timeline`'s clock, ``cost`` as it takes it (copies between
    stages free).

    Raises:
        KeyError: ``cost`` lacks an action's stage and kind.
    """
    rows = timeline(schedule, cost)
    span = max(row[-1][1] for row in rows if row)
    busy = sum(e - s for row in rows for s, e, _ in row)
    return 1 - busy / (span * len(rows))


def issue_order(schedule):
    """Every action once, in :func:`timeline`'s clock order (at a tie the older
    micro-batch first, then the devices in turn): the order one thread issues
    them to MXNet's engine."""
    rows = timeline(schedule)
    return [a for _, _, _, a in sorted((start, a.microbatch, d, a) for d, row in enumerate(rows)
                                       for start, _, a in row)]


def format_schedule(schedule):
    """A table: one row per unit of :func:`timeline`'s clock, one column per
    device, ``<stage><F|B><micro-batch>`` or blank."""
    rows = timeline(schedule)
    span = max(row[-1][1] for row in rows if row)
    grid = [[''] * len(rows) for _ in range(span)]
    for d, row in enumerate(rows):
        for start, _, action in row:
            grid[start][d] = str(action)
    header = ['step'] + ['dev%d' % d for d in range(len(rows))]
    width = max(len(h) for h in header + [str(a) for row in grid for a in row]) + 2
    lines = [''.join(h.ljust(width) for h in header).rstrip()]
    for t, cells in enumerate(grid):
        lines.append(''.join(c.ljust(width) for c in [str(t)] + cells).rstrip())
    return '\n'.join(lines)
