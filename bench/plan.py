"""``python -m bench.plan [--quick] [--json FILE]``: the planner's pick
(``Pipeline(..., plan='auto', memory_per_device=...)``) against every plan
it scored, measured.

For each bundled task (``regression``, ``digits``, ``lm``, and ``lm-tp``:
the language model under ``tensor_parallel='auto'``, its candidates with
stages of two shards among them) on ``cpu:0,cpu:1`` under a budget per
device, the planner ranks its candidates
(:class:`mp_symbolic.core.planning.planner.Planner`, the task's loss and
optimizer). Then every candidate it scored is trained: its Module bound,
initialised and stepped (``forward_backward`` and ``update``), the plans
in alternating rounds (one plan's steps, then the next's, round after
round) so that a change in the host's load touches them alike; a round's
time is its fastest step (the least touched by other work on the host, as
the planner's stage times are), a plan's step time the median of its
rounds', its spread the gap between its slowest and fastest round over
that median. It prints each plan's predicted
and measured step time, then:

* whether the pick (the first that fits) is within 5% of the best measured
  plan that fits, or within the run-to-run spread;
* Kendall's tau between predicted and measured step times, per task and
  over every plan (``scipy.stats.kendalltau``), and beside it per task
  over the pairs of plans whose measured gap exceeds both plans'
  run-to-run spread (:func:`resolved_kendall`: the pairs the noise does
  not order);
* the devices' capacity at once (``Timings.capacity``) and while one
  replica's stages run on them (``Timings.pipelined``), in the title;
* the pick's peak memory per device, measured in a process of its own
  (:func:`bench.estimate.measure`: one profiled training step), against
  the budget;
* the host's load average as the task's planning began and as its
  measuring ended (the step times carry the other work on the host).
"""
import argparse
import json
import os
import statistics
import sys
import time

__all__ = ['TASKS', 'main']

# task -> (the budget per device: below what the fastest plans need, so that
# the budget decides; rounds; steps a round)
TASKS = {'regression': ('4KiB', 5, 20), 'digits': ('2MiB', 5, 20), 'lm': ('12MiB', 5, 10),
         'lm-tp': ('12MiB', 5, 10)}
# an entry of TASKS -> the task it plans under tensor_parallel='auto' (the
# planner's candidates then include stages of shards: Candidate.shards)
SHARDED = {'lm-tp': 'lm'}
DEVICES = 'cpu:0,cpu:1'


def _planner(task):
    from mp_symbolic.core.planning.planner import Planner  # pylint: disable=import-outside-toplevel
    from bench.estimate import MOMENTUM  # pylint: disable=import-outside-toplevel
    batch = task.batch_size
    return Planner(loss=task.graph_loss, label_name=task.label,
                   label_shapes=[(task.label, (batch,) + tuple(task.label_shape))],
                   optimizer=task.optimizer,
                   optimizer_params=MOMENTUM if task.optimizer == 'sgd' else {})


def plan(name, budget):
    """``(task, ranking, seconds the planning took)`` of the entry ``name``
    of :data:`TASKS` (a task, or one of :data:`SHARDED`: its task under
    ``tensor_parallel='auto'``)."""
    from mp_symbolic.training.tasks import load_task  # pylint: disable=import-outside-toplevel
    task, _ = load_task(SHARDED.get(name, name))
    start = time.perf_counter()
    ranking = _planner(task).choose(task.make_blocks(), DEVICES,
                                    (task.batch_size,) + tuple(task.sample_shapes[0]), budget,
                                    tensor_parallel='auto' if name in SHARDED else None)
    return task, ranking, time.perf_counter() - start


def _module(task, candidate):
    """A bound, initialised Module of ``candidate`` with its optimizer, and a batch."""
    # pylint: disable=import-outside-toplevel
    import mxnet as mx
    import numpy as np
    from mp_symbolic import Pipeline
    from bench.estimate import MOMENTUM
    batch = task.batch_size
    mx.random.seed(0)
    pipe = Pipeline(task.make_blocks(), sample=(batch,) + tuple(task.sample_shapes[0]),
                    **candidate.pipeline_args())
    data_shapes = task.data_shapes(batch, pipe.data_names())
    label_shapes = [(task.label, (batch,) + tuple(task.label_shape))]
    mod = pipe.module(loss=task.graph_loss, label_name=task.label)
    mod.bind(data_shapes=data_shapes, label_shapes=label_shapes)
    mod.init_params(initializer=mx.init.Xavier())
    mod.init_optimizer(kvstore='local' if candidate.replicas > 1 else None,
                       optimizer=task.optimizer,
                       optimizer_params=dict(MOMENTUM if task.optimizer == 'sgd' else {},
                                             learning_rate=1e-3))
    data = task.data()
    x = data.X if isinstance(data.X, (list, tuple)) else [data.X]
    arrays = [mx.nd.array(np.asarray(a[:batch])) for a in x]
    label = mx.nd.array(np.asarray(data.y[:batch]))
    return mod, mx.io.DataBatch(arrays, [label])


def measure(task, candidates, rounds, steps):
    """``[[fastest step's seconds of each round]]`` per candidate, in rounds."""
    from mp_symbolic.core.base.timing import seconds  # pylint: disable=import-outside-toplevel
    built = [_module(task, c) for c in candidates]
    times = [[] for _ in candidates]

    def step(mod, batch):
        mod.forward_backward(batch)
        mod.update()
    for mod, batch in built:  # the first steps make oneDNN's primitives and the pools
        for _ in range(2):
            seconds(lambda: step(mod, batch))
    for _ in range(rounds):
        for i, (mod, batch) in enumerate(built):
            times[i].append(min(seconds(lambda: step(mod, batch)) for _ in range(steps)))
    return times


def _cell(task, candidate):
    return dict(model=task.name, devices=candidate.devices, schedule=candidate.schedule,
                chunks=candidate.chunks, replicas=candidate.replicas, mirror=candidate.mirror,
                balance=None if candidate.balance is None else list(candidate.balance),
                virtual=candidate.virtual if candidate.schedule == 'interleaved' else None,
                shard_optimizer=bool(candidate.shard_optimizer), optimizer=task.optimizer,
                tensor_parallel=candidate.tensor_parallel)


def kendall(x, y):
    """Kendall's tau-b of ``x`` and ``y``."""
    from scipy.stats import kendalltau  # pylint: disable=import-outside-toplevel
    return float(kendalltau(x, y).statistic)


def resolved_kendall(rows):
    """``(tau, pairs counted, pairs)``: Kendall's tau (concordant less
    discordant pairs over the pairs counted) between predicted and measured
    step times over the pairs of ``rows`` whose measured gap exceeds both
    plans' run-to-run spread (its slowest round less its fastest); ``tau``
    ``None`` where no pair does."""
    concordant = counted = 0
    pairs = len(rows) * (len(rows) - 1) // 2
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            gap = b['measured'] - a['measured']
            if abs(gap) <= max(a['spread'] * a['measured'], b['spread'] * b['measured']):
                continue
            counted += 1
            order = (b['predicted'] - a['predicted']) * gap
            concordant += (order > 0) - (order < 0)
    return (concordant / counted if counted else None), counted, pairs


def run(tasks, rounds, steps, log=print):
    """Plans, measures and reports each task; returns the rows."""
    from bench import estimate as memory  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.planning.sizes import format_size, parse_size
    out = []
    for name, (budget, task_rounds, task_steps) in tasks.items():
        load = [os.getloadavg()[0]]
        task, ranking, took = plan(name, budget)
        scored = ranking.ranked
        rounds_of = measure(task, [s.candidate for s in scored], rounds or task_rounds,
                            steps or task_steps)
        rows = []
        for s, times in zip(scored, rounds_of):
            middle = statistics.median(times)
            rows.append(dict(plan=s.candidate.label(), fits=s.fits, predicted=s.seconds,
                             measured=middle, spread=(max(times) - min(times)) / middle,
                             memory=s.largest, cell=_cell(task, s.candidate)))
        pick = rows[0]
        peak = memory.measure([pick['cell']])[0]
        pick['peak'] = {d: r['total'] for d, r in peak.items()} if 'error' not in peak else peak
        load.append(os.getloadavg()[0])
        out.append(dict(task=name, budget=parse_size(budget), planning=took,
                        capacity=ranking.timings.capacity,
                        pipelined=dict(ranking.timings.pipelined), skipped=ranking.skipped,
                        merged=ranking.merged,
                        rows=rows, load=load))
        report([out[-1]], log, format_size)
    if len(out) > 1:
        report_all(out, log)
    return out


def report(tasks, log=print, format_size=None):
    """Each task's table and its figures."""
    if format_size is None:
        from mp_symbolic.core.planning.sizes import format_size  # pylint: disable=import-outside-toplevel
    for entry in tasks:
        rows, budget = entry['rows'], entry['budget']
        log('%s on %s, budget %s per device: %d plans scored%s in %.0f s (capacity of the '
            'devices at once: %s%s)' % (entry['task'], DEVICES, format_size(budget), len(rows),
                                        _skipped(entry), entry['planning'], ', '.join(
                                    '%s: %.2f' % kv for kv in sorted(entry['capacity'].items())),
                                _pipelined(entry)))
        width = max(len(r['plan']) for r in rows)
        log('  rank  %s  fits  memory     predicted  measured   spread' % 'plan'.ljust(width))
        for i, r in enumerate(rows, 1):
            log('  %-4d  %s  %-4s  %-9s  %-9s  %-9s  %.1f%%'
                % (i, r['plan'].ljust(width), 'yes' if r['fits'] else 'no',
                   format_size(r['memory']), '%.2f ms' % (r['predicted'] * 1e3),
                   '%.2f ms' % (r['measured'] * 1e3), 100 * r['spread']))
        for line in figures(entry, format_size):
            log('  ' + line)
        if entry.get('load'):
            log('  load average (1 min) as the planning began: %.1f; as the measuring ended: %.1f'
                % tuple(entry['load']))


def _skipped(entry):
    """``' (and 9 with recomputation or ZeRO not scored: ...)'`` and
    ``' (and 4 balanced by time as by size: ...)'``, or ``''`` where none
    was left unscored (or a run's JSON does not say)."""
    words = ''
    if entry.get('skipped'):
        words += (' (and %d with recomputation or ZeRO not scored: the same plan without it '
                  'fits)' % entry['skipped'])
    if entry.get('merged'):
        words += (' (and %d balanced by time as by size: each scored once with that plan, '
                  'rule size=time)' % entry['merged'])
    return words


def _pipelined(entry):
    """``'; pipelined: graph 1.52, staged 1.52'``: the two devices' capacity
    while one replica's stages run on them (``Timings.pipelined``), or
    ``''`` where the planner measured none (or a run's JSON has none)."""
    found = entry.get('pipelined') or {}
    if not found:
        return ''
    return '; pipelined: %s' % ', '.join('%s %.2f' % kv for kv in sorted(found.items()))


def figures(entry, format_size):
    """The pick against the best measured plan that fits, tau, the pick's peak."""
    rows, budget = entry['rows'], entry['budget']
    fitting = [r for r in rows if r['fits']]
    pick, best = rows[0], min(fitting, key=lambda r: r['measured'])
    gap = pick['measured'] / best['measured'] - 1
    spread = max(pick['spread'], best['spread'])
    verdict = 'within 5%' if gap <= 0.05 else (
        'within the run-to-run spread (%.1f%%)' % (100 * spread) if gap <= spread
        else 'NOT within 5%% or the spread (%.1f%%)' % (100 * spread))
    lines = ['pick: %s, measured %.2f ms; the best measured plan that fits: %s, %.2f ms; '
             'the pick %+.1f%%: %s' % (pick['plan'], pick['measured'] * 1e3, best['plan'],
                                       best['measured'] * 1e3, 100 * gap, verdict)]
    lines.append("Kendall's tau, predicted against measured step times: %.2f over %d plans"
                 % (kendall([r['predicted'] for r in rows], [r['measured'] for r in rows]),
                    len(rows)))
    tau, counted, pairs = resolved_kendall(rows)
    lines.append("Kendall's tau over the pairs of plans measured further apart than their "
                 "run-to-run spread: %s over %d of %d pairs"
                 % ('-' if tau is None else '%.2f' % tau, counted, pairs))
    peak = pick.get('peak', {})
    if 'error' in peak:
        lines.append('peak memory of the pick: not measured (%s)' % peak['error'])
    elif peak:
        top = max(peak.values())
        lines.append('peak memory of the pick, measured: %s (%s), budget %s: %s'
                     % (format_size(top), ', '.join('%s %s' % (d, format_size(v))
                                                    for d, v in sorted(peak.items())),
                        format_size(budget), 'within' if top <= budget else 'OVER'))
    return lines


def report_all(tasks, log=print):
    """Over every task: the plans, the picks, tau."""
    rows = [r for entry in tasks for r in entry['rows']]
    within = 0
    for entry in tasks:
        fitting = [r for r in entry['rows'] if r['fits']]
        pick, best = entry['rows'][0], min(fitting, key=lambda r: r['measured'])
        gap = pick['measured'] / best['measured'] - 1
        within += gap <= max(0.05, pick['spread'], best['spread'])
    taus = [kendall([r['predicted'] for r in e['rows']], [r['measured'] for r in e['rows']])
            for e in tasks]
    log('over %d tasks, %d plans measured: the pick within 5%% of the best measured plan (or '
        'the spread) on %d of %d tasks; Kendall\'s tau per task %s, over every plan %.2f'
        % (len(tasks), len(rows), within, len(tasks), ', '.join('%.2f' % t for t in taus),
           kendall([r['predicted'] for r in rows], [r['measured'] for r in rows])))
    resolved = [resolved_kendall(e['rows']) for e in tasks]
    log("Kendall's tau over the pairs of plans measured further apart than their run-to-run "
        'spread, per task: %s' % ', '.join('%s (%d of %d pairs)' % (
            '-' if tau is None else '%.2f' % tau, counted, pairs)
                                            for tau, counted, pairs in resolved))


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.plan', description=__doc__)
    parser.add_argument('--quick', action='store_true',
                        help='one task (regression), 2 rounds of 3 steps: a smoke run')
    parser.add_argument('--rounds', type=int, default=None,
                        help='rounds of every plan (default: 5)')
    parser.add_argument('--steps', type=int, default=None,
                        help='steps per plan a round (default: 20, 10 for lm)')
    parser.add_argument('--only', default=None, metavar='TASK,...', help='these tasks only')
    parser.add_argument('--json', default=None, metavar='FILE',
                        help='also write every plan\'s figures to FILE')
    parser.add_argument('--report', default=None, metavar='FILE',
                        help='print the tables of a run --json wrote, measuring nothing')
    args = parser.parse_args(argv)
    if args.report:
        with open(args.report) as given:
            tasks = json.load(given)
        for entry in tasks:
            entry['capacity'] = {int(k): v for k, v in entry['capacity'].items()}
        report(tasks)
        if len(tasks) > 1:
            report_all(tasks)
        return 0
    tasks = dict(TASKS)
    if args.only:
        tasks = {k: v for k, v in tasks.items() if k in args.only.split(',')}
    rounds, steps = args.rounds, args.steps
    if args.quick:
        tasks, rounds, steps = {'regression': TASKS['regression']}, 2, 3
    rows = run(tasks, rounds, steps)
    if args.json:
        with open(args.json, 'w') as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
