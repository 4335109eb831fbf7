"""Side-by-side run of the variants: same start, same batches, one table.

Trains the symbolic graph model-parallel (Module API), its imperative Gluon
twin on the same device plan, and the symbolic graph on the plan's first
device alone, from the same initial parameters and in the same batch order.
Then reports whether they learned the same thing (within the tolerance of the
project's equivalence test), what model parallelism cost in samples/s, where
each stage ran, and how many cross-device copies one training step makes.

Writes to ``cfg.out`` (default ``artifacts/compare/``): ``compare.json``,
``loss_curves.png`` and the device-coloured training graph
(``graph.dot``, plus ``graph.png`` / ``graph.svg`` when ``dot`` is installed).

References: MXNet 1.9.1 ``tests/python/unittest/test_model_parallel.py``
(split graph vs one-device graph), ``src/executor/graph_executor.cc``
(``AssignContext`` inserts ``_CrossDeviceCopy`` nodes at group boundaries).
"""
from dataclasses import dataclass, replace
import os

import mxnet as mx
from mxnet import autograd
import numpy as np

from ..tools.files import atomic_path, write_json
from .graphviz_plot import write_graph
from .metrics import AGREE_ATOL, AGREE_RTOL
from ..core.placement.devices import format_device
from ..tools.text import columns
from ..core.graph.ir import PlacedGraph
from ..core.task import TaskError, as_inputs
from .loop import build_pipeline, fit, initial_values, load, make_stepper

__all__ = []

REFERENCE = 'symbolic MP'  # the run every other one is compared with


@dataclass
class CompareResult:
    """What :func:`compare` measured; ``rows`` holds one dict per variant."""
    rows: list
    agree: bool
    files: dict


def count_autograd_copies(stepper, X):  # X: one array, or a tuple of arrays (one per input)
    """Cross-device copies of one imperative training step.

    Records one forward pass and counts the ``_copyto`` nodes autograd kept
    (each ``as_in_context`` to another device). Each recorded copy has one
    backward copy taking its gradient back to the source device, so backward
    equals forward. Parameters are not changed (no backward, no update).

    Returns:
        ``(forward, backward)``.
    """
    with autograd.record():
        pred = stepper.pipe(*[mx.nd.array(x, ctx=stepper.plan.first_device)
                              for x in as_inputs(X)])
    forward = sum(n.op == '_copyto' for n in PlacedGraph.from_symbol(autograd.get_symbol(pred)).ops)
    return forward, forward


def _max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def _close(a, b):
    return bool(np.allclose(a, b, rtol=AGREE_RTOL, atol=AGREE_ATOL))


def agrees(losses, ref_losses, params, ref_params, steps=None):
    """Whether a run agrees with the reference within the equivalence tolerance.

    Args:
        losses, ref_losses: The batch loss of every step.
        params, ref_params: Name -> final value.
        steps: ``None``: every step's loss and every final parameter; ``N``:
            the losses of the first N steps only. A network whose training is
            chaotic (BatchNorm CNNs) turns float32 rounding differences of a
            few steps into drift; its first steps still show whether the split
            computes what one device computes.
    """
    if steps is not None:
        return _close(losses[:steps], ref_losses[:steps])
    return _close(losses, ref_losses) and all(_close(params[k], ref_params[k])
                                              for k in ref_params)


def _runs(cfg, plan):
    """``(name, config)`` of each variant; the reference first."""
    sym = replace(cfg, variant='symbolic', api='module')
    return [(REFERENCE, sym),
            ('imperative MP', replace(cfg, variant='imperative')),
            ('symbolic 1-device', replace(sym, devices=format_device(plan.first_device),
                                          balance=None))]


def _train_run(name, cfg, task, data, log):
    """Trains one run; returns ``(table row, per-step losses, final params)``."""
    pipe, _ = build_pipeline(cfg, task)
    plan = pipe.plan
    X, y = data.X, data.y
    stepper = make_stepper(cfg, pipe, task, initial_values(pipe, cfg.seed), task.label_shape)
    if cfg.variant == 'imperative':
        copies = count_autograd_copies(stepper, tuple(x[:cfg.batch_size] for x in as_inputs(X)))
        method = 'autograd-recorded _copyto nodes; each has one backward copy'
    else:
        copies = stepper.cross_device_copies()
        method = '_CrossDeviceCopy nodes in the bound graph (debug_str)'
    result = fit(stepper, X, y, cfg, lambda line: log('  %s: %s' % (name, line)), task.loss_label)
    report = task.report(result.params, stepper.predict)
    row = {
        'variant': name, 'api': cfg.api if cfg.variant == 'symbolic' else 'gluon',
        'metrics': report.metrics, 'result': report.lines[0], 'short': report.short,
        'samples_per_sec': result.samples_per_sec,
        'wall_time_s': result.wall_time,
        'stage_devices': [format_device(d) for d in plan.devices],
        'stage_of_layer': list(plan.stage_of_layer),
        # every array as MXNet reports it: [name, device, gradient device or None]
        'placement': [[n, str(d), str(g) if g is not None else None]
                      for n, d, g in result.placement],
        'cross_device_copies_per_step': sum(copies),
        'copies_forward': copies[0], 'copies_backward': copies[1], 'copy_count_method': method,
    }
    return row, result.step_losses, result.params


def check_comparable(task):
    """Raises:
        TaskError: ``task``'s data is a bucketed DataIter, which the
            imperative twin and the executor API cannot take.
    """
    if task.bucketed:
        raise TaskError('train: expected arrays or a DataIter of one shape to compare (the '
                        'imperative twin and the executor API take arrays), found a bucketed '
                        'DataIter')


def compare(cfg, log=print, task=None):
    """Trains the three runs, prints the table, writes JSON, plot and graph.

    Args:
        cfg: A :class:`~mp_symbolic.training.config.TrainConfig`; ``variant`` and
            ``api`` are ignored, ``out=None`` means ``artifacts/compare``;
            ``agree_steps`` as :func:`agrees` takes ``steps`` (the differences
            in the table are over every step and parameter either way).
        log: Called with each line of output.

    Returns:
        A :class:`CompareResult`.

    Raises:
        DeviceSpecError: ``cfg.devices`` cannot make a device plan.
        TaskError: the task's data is a bucketed DataIter.
        OSError: an output file cannot be written.
    """
    out_dir = cfg.out if cfg.out is not None else os.path.join('artifacts', 'compare')
    if task is None:
        task, cfg = load(cfg)
    check_comparable(task)
    pipe, note = build_pipeline(cfg, task)
    if note:
        log(note)
    cfg = replace(cfg, devices=pipe.plan.spec)
    data = task.data()

    rows, losses, params = [], {}, {}
    for name, run_cfg in _runs(cfg, pipe.plan):
        log('training %s ...' % name)
        row, losses[name], params[name] = _train_run(name, run_cfg, task, data, log)
        rows.append(row)

    steps = cfg.agree_steps
    agree = True
    for row in rows:
        ref_l, ref_p = losses[REFERENCE], params[REFERENCE]
        mine_l, mine_p = losses[row['variant']], params[row['variant']]
        row['max_step_loss_diff'] = _max_diff(mine_l, ref_l)
        row['max_param_diff'] = max(_max_diff(mine_p[k], ref_p[k]) for k in ref_p)
        row['agree'] = agrees(mine_l, ref_l, mine_p, ref_p, steps)
        agree = agree and row['agree']

    for line in format_table(rows):
        log(line)
    log('max|dloss|, max|dparam|: largest difference from %s over every step\'s %s '
        'and every final parameter' % (REFERENCE, task.loss_label))
    judged = 'losses of every step and final parameters' if steps is None else \
        'losses of the first %d steps (--agree-steps)' % steps
    log('agree: %s (%s vs %s, rtol=%g, atol=%g)' % ('yes' if agree else 'no', judged,
                                                     REFERENCE, AGREE_RTOL, AGREE_ATOL))

    files = {'loss_plot': plot_losses(losses, os.path.join(out_dir, 'loss_curves.png'))}
    graph_files, graph_note = write_graph(
        pipe.training_symbol(task.graph_loss, label_name=task.label), pipe.plan,
        os.path.join(out_dir, 'graph'))
    files.update(graph_files)
    if graph_note:
        log(graph_note)
    files['results'] = os.path.join(out_dir, 'compare.json')
    write_json(files['results'], {
        'config': dict(cfg.to_dict(), out=out_dir), 'reference': REFERENCE,
        'tolerance': {'rtol': AGREE_RTOL, 'atol': AGREE_ATOL,
                      'applies_to': 'per-step %s and final parameters' % task.loss_label
                                    if steps is None else
                                    '%s of the first %d steps' % (task.loss_label, steps)},
        'agree': agree, 'variants': rows, 'step_losses': losses,
        'files': {k: os.path.basename(v) for k, v in files.items()},
        'mxnet_version': mx.__version__,
    })
    log('wrote %s' % ', '.join(sorted(files.values())))
    return CompareResult(rows=rows, agree=agree, files=files)


def format_table(rows):
    """Lines of the comparison table, one row per variant."""
    head = ('variant', 'result', 'max|dloss|', 'max|dparam|', 'samples/s',
            'stage devices', 'copies/step', 'agree')
    body = [(r['variant'], _short(r), '%.1e' % r['max_step_loss_diff'],
             '%.1e' % r['max_param_diff'], '%.0f' % r['samples_per_sec'],
             ','.join(r['stage_devices']),
             '%d (%d fwd + %d bwd)' % (r['cross_device_copies_per_step'],
                                      r['copies_forward'], r['copies_backward']),
             'yes' if r['agree'] else 'no') for r in rows]
    return columns([head] + body)


def _short(row):
    return row['short']


def plot_losses(losses, path):
    """Per-step batch loss of each variant, log-scale y, written atomically as PNG.

    Returns:
        ``path``.
    """
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use('Agg')  # no display needed
    from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
    fig, ax = plt.subplots(figsize=(7, 4))
    # Curves coincide when the variants agree; distinct styles keep each visible.
    for (name, values), style in zip(losses.items(), ('-', '--', ':')):
        ax.plot(np.arange(1, len(values) + 1), values, style, linewidth=1.5, label=name)
    ax.set_yscale('log')
    ax.set_xlabel('step')
    ax.set_ylabel('batch loss')
    ax.set_title('Training loss per step, same start and batch order')
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format='png', dpi=100)
    plt.close(fig)
    return path
