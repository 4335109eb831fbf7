"""The training graph as a picture, each node coloured by the device it runs on.

Built from the symbol's JSON (every variable and op node, with its
``__ctx_group__`` attribute) and the device plan's ``group2ctx``; edges whose
ends sit on different devices are where MXNet inserts ``_CrossDeviceCopy``
nodes when it binds the graph, and are drawn dashed. Follows
``mxnet/visualization.py::plot_network`` (graphviz ``Digraph`` from
``symbol.tojson()``), but keeps the parameter nodes, which carry placement too.

The ``.dot`` source is always written; PNG and SVG are rendered by the
graphviz ``dot`` program when it is installed.
"""
import shutil
import subprocess

from graphviz import Digraph

from ..tools.files import atomic_path, write_text
from ..core.placement.devices import format_device
from ..core.graph.ir import PlacedGraph
from ..core.graph.names import stage_name

__all__ = []

# Fill colour of stage s's device: DEVICE_COLOURS[s % len(DEVICE_COLOURS)].
DEVICE_COLOURS = ('#8dd3c7', '#fdb462', '#bebada', '#fb8072', '#80b1d3', '#b3de69')
UNPLACED_COLOUR = '#ffffff'  # a node without __ctx_group__ (none in this project's graphs)


def device_graph(symbol, plan):
    """The graph of ``symbol`` with nodes filled by device and a legend.

    Args:
        symbol: A Symbol whose nodes carry ``__ctx_group__`` attributes.
        plan: The :class:`~mp_symbolic.core.placement.devices.DevicePlan` whose
            ``group2ctx`` maps those groups to devices.

    Returns:
        A ``graphviz.Digraph``: node ``n<i>`` for the symbol's JSON node ``i``,
        node ``legend<s>`` for stage ``s``'s device.

    Raises:
        ValueError: a node names a ``ctx_group`` the plan has no device for.
    """
    group2ctx = plan.group2ctx
    colour = {ctx: DEVICE_COLOURS[s % len(DEVICE_COLOURS)]
              for s, ctx in enumerate(plan.devices)}
    dot = Digraph(name='training_graph', graph_attr={'rankdir': 'BT', 'fontname': 'Helvetica'},
                  node_attr={'style': 'filled', 'fontname': 'Helvetica'})
    device = []
    for i, node in enumerate(PlacedGraph.from_symbol(symbol).nodes):
        if node.group is not None and node.group not in group2ctx:
            raise ValueError('node %s: ctx_group %r has no device in the plan (groups: %s)'
                             % (node.name, node.group, ', '.join(sorted(group2ctx))))
        ctx = group2ctx.get(node.group)
        device.append(ctx)
        label = node.name if node.is_variable else r'%s\n%s' % (node.op, node.name)
        dot.node('n%d' % i, label=label, shape='ellipse' if node.is_variable else 'box',
                 fillcolor=colour.get(ctx, UNPLACED_COLOUR))
        for src, _, _ in node.inputs:
            crosses = device[src] != ctx
            dot.edge('n%d' % src, 'n%d' % i, style='dashed' if crosses else 'solid',
                     color='red' if crosses else 'black')
    with dot.subgraph(name='cluster_legend') as legend:
        legend.attr(label='device (dashed red edge: cross-device copy)')
        for s, ctx in enumerate(plan.devices):
            legend.node('legend%d' % s, label='%s: %s' % (format_device(ctx), stage_name(s)),
                        shape='box', fillcolor=colour[ctx])
    return dot


def write_graph(symbol, plan, path_prefix, formats=('png', 'svg')):
    """Writes ``<path_prefix>.dot`` and, if ``dot`` is installed, renders it.

    Returns:
        ``(files, note)``: ``{'graph_dot': ..., 'graph_png': ..., ...}`` of the
        files written, and a one-line note when rendering was skipped
        (else ``None``).

    Raises:
        ValueError: see :func:`device_graph`.
        OSError: a file cannot be written.
        subprocess.CalledProcessError: ``dot`` failed on the source.
    """
    source_path = path_prefix + '.dot'
    write_text(source_path, device_graph(symbol, plan).source)
    files = {'graph_dot': source_path}
    dot_program = shutil.which('dot')
    if dot_program is None:
        return files, ('graphviz `dot` not found: wrote %s only (install graphviz, e.g. '
                       '`apt-get install graphviz`, to render PNG/SVG)' % source_path)
    for fmt in formats:
        path = '%s.%s' % (path_prefix, fmt)
        with atomic_path(path) as tmp:
            subprocess.run([dot_program, '-T' + fmt, '-o', tmp, source_path],
                           check=True, capture_output=True)
        files['graph_' + fmt] = path
    return files, None
