"""The pipeline timeline picture: device rows against time, one step per panel.

Each op of the step is a bar on its device's row, coloured by its micro-batch
(:func:`mp_symbolic.tools.trace.label_chunks`); forward bars are solid, backward
bars hatched and lighter, whole-batch ops (split, concat, loss, gradient
sums) light grey, cross-device copies dark grey, weight updates black.
GPipe's fill (forward chunks entering stage after stage) and drain (backward
chunks leaving in reverse) show as the staircase at each end.
"""
import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from mp_symbolic.core.graph.names import stage_name  # noqa: E402
from mp_symbolic.tools.trace import clip, label_chunks, op_intervals, step_windows  # noqa: E402

__all__ = ['plot_timeline', 'median_step']


def median_step(ops, windows, devices):
    """The window whose ops span the median time (the step the tables report)."""
    def span(window):
        inside = [iv for d in devices for iv in clip(ops, window).get(d, [])]
        return max(iv[1] for iv in inside) - min(iv[0] for iv in inside)
    return sorted(windows, key=span)[(len(windows) - 1) // 2]


def plot_timeline(trace, configs, path):
    """Writes one panel per config: ``(stages, chunks)`` for the steps between
    markers ``'K<k>-M<m>'``, or ``(stages, chunks, suffix)`` for ``'K<k>-M<m><suffix>'``."""
    ops = op_intervals(trace)
    colours = plt.get_cmap('tab10').colors
    fig, axes = plt.subplots(len(configs), 1, figsize=(11, 1.0 + 1.1 * sum(
        c[0] for c in configs)), squeeze=False)
    for ax, (k, m, *suffix) in zip(axes[:, 0], configs):
        devices = ['cpu/%d' % s for s in range(k)]
        marker = 'K%d-M%d%s' % (k, m, ''.join(suffix))
        window = median_step(ops, step_windows(trace, marker), devices)
        step = clip(ops, window)
        t0 = min(iv[0] for d in devices for iv in step.get(d, []))
        for row, device in enumerate(devices):
            for start, end, _, phase, chunk in label_chunks(step.get(device, []), m):
                colour = {'update': 'black', 'copy': 'dimgrey'}.get(
                    phase, 'lightgrey' if chunk is None else colours[chunk % len(colours)])
                ax.broken_barh([((start - t0) / 1e3, (end - start) / 1e3)], (row - 0.4, 0.8),
                               facecolors=colour, edgecolor='white', linewidth=0.3,
                               hatch='///' if phase == 'backward' else None,
                               alpha=0.55 if phase == 'backward' else 0.95)
        ax.set_yticks(range(k))
        ax.set_yticklabels(['%s %s' % (stage_name(s), d) for s, d in enumerate(devices)])
        ax.invert_yaxis()
        ax.set_title('K=%d stages, M=%d micro-batches%s: one training step'
                     % (k, m, ', forward order forced' if suffix else ''), fontsize=10, loc='left')
        ax.set_xlabel('ms from the step\'s first op')
    handles = [Patch(facecolor=colours[c], label='chunk %d' % c)
               for c in range(max(c[1] for c in configs))]
    handles += [Patch(facecolor='white', edgecolor='black', label='forward (solid)'),
                Patch(facecolor='white', edgecolor='black', hatch='///',
                      label='backward (hatched)'),
                Patch(facecolor='lightgrey', label='whole batch'),
                Patch(facecolor='dimgrey', label='cross-device copy'),
                Patch(facecolor='black', label='SGD update')]
    fig.legend(handles=handles, loc='upper right', fontsize=8, ncol=2)
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
