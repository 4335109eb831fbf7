"""The memory table of a plan before anything is allocated:
:func:`estimate_memory` (``mp_symbolic.estimate_memory``) and the table
``python -m mp_symbolic plan`` prints.

The estimate is :func:`mp_symbolic.core.planning.estimate.estimate`'s (shapes and
MXNet 1.9.1's own memory planning); this module gives it as the
:class:`~mp_symbolic.tools.memory.MemoryTable` a measured Module gives
(:func:`~mp_symbolic.tools.memory.memory_table`), rows and units alike.
"""
import mxnet as mx

from ..core.planning.estimate import estimate
from .memory import CATEGORIES, MemoryRow, MemoryTable

__all__ = []


def estimate_memory(model, devices=None, sample=None, loss='softmax', output=None,
                    data_shapes=None, label_shapes=None, optimizer='sgd',
                    optimizer_params=None, workers=1, rank=0, nodes=None, node=None, **plan):
    """Bytes per device and category of one training step, without binding
    or running anything; over node processes, per node.

    Example::

        net = vision.resnet18_v1(classes=10)
        table = mp_symbolic.estimate_memory(net, 'cpu:0,cpu:1', sample=(64, 3, 32, 32),
                                            chunks=4, schedule='1f1b',
                                            optimizer='adam')
        print(table)                  # the rows train --memory measures
        table['cpu(0)'].total         # bytes

    Args:
        model: A :class:`~mp_symbolic.Pipeline` (its plan is the plan), or a
            network (a list of blocks or one ``HybridBlock``) that is made a
            Pipeline with ``devices``, ``sample`` and ``plan``.
        devices: The devices of a network's Pipeline (``'cpu:0,cpu:1'``).
        sample: The batch (a shape, an array, or one per input), as
            ``Pipeline`` takes it; for a Pipeline, its batch's shape if
            ``data_shapes`` is not given (default: the ``sample`` the
            Pipeline was made with).
        loss, output: The loss head, as :meth:`~mp_symbolic.Pipeline.module`
            takes them.
        data_shapes: ``[(name, shape)]`` of the whole batch (default: from ``sample``).
        label_shapes: ``[(name, shape)]``, the label's name the loss head's
            (default: ``softmax_label``, its shape as the loss head infers it).
        optimizer, optimizer_params: As ``init_optimizer`` takes them.
        workers, rank: Over ``dist_sync`` workers, their count and the rank
            whose table is estimated (its batch is ``sample``: its share):
            under ``shard_optimizer`` its optimizer rows hold its share of
            the state dealt over replicas x workers.
        nodes, node: Over node processes, their count and the node whose
            table is estimated: its stages' arrays, executors and buffers
            alone, on its devices, as each replica's devices are dealt over
            the nodes. A Pipeline over nodes: its own (``node`` by default
            this process's). A network or a Pipeline of one process: the
            plan over ``nodes`` processes, made in this one (no rendezvous);
            without ``node``, the whole job: one table per node.
        **plan: ``Pipeline`` arguments (``chunks``, ``replicas``, ``schedule``,
            ``virtual``, ``mirror``, ``balance``, ``tensor_parallel``,
            ``batch_axis``, ``shard_optimizer``: each replica's optimizer
            row then holds its share) for a network.

    Returns:
        A :class:`~mp_symbolic.tools.memory.MemoryTable` whose ``other`` is
        the activations and workspace MXNet's plan gives each device; with
        ``nodes`` and no ``node`` for a network or a Pipeline of one
        process, a tuple of them, node by node.

    Raises:
        ValueError: a plan or shapes the Pipeline refuses, nodes or a node
            the plan does not have, an optimizer the estimate does not know,
            or no batch shape (one line each).
    """
    from ..core.pipeline import Pipeline  # pylint: disable=import-outside-toplevel
    if isinstance(model, Pipeline):
        if plan:
            raise ValueError('plan: expected no Pipeline arguments with a Pipeline (its plan '
                             'is the plan), found %s' % ', '.join(sorted(plan)))
        pipe = model
    else:
        if devices is None or sample is None:
            raise ValueError('devices, sample: expected both for a network, found devices=%r, '
                             'sample=%s' % (devices, 'given' if sample is not None else None))
        pipe = Pipeline(model, devices, sample=sample, **plan)
    if data_shapes is None:
        data_shapes = _shapes_of(pipe, sample)

    def table_of(node):
        return _table(estimate(pipe, data_shapes, label_shapes, loss=loss, output=output,
                               label_name=label_shapes[0][0] if label_shapes else None,
                               optimizer=optimizer, optimizer_params=optimizer_params,
                               workers=workers, rank=rank, nodes=nodes, node=node))

    if pipe.nodes is None and node is None and nodes not in (None, 1):
        first = table_of(0)  # nodes checked
        return (first,) + tuple(table_of(k) for k in range(1, nodes))
    return table_of(node)


def _table(table):
    """The :class:`MemoryTable` of :func:`estimate`'s ``{device: {category: bytes}}``."""
    rows = []
    for device, row in table.items():
        values = {c: row[c] for c in CATEGORIES}
        rows.append(MemoryRow(device=device, total=row['total'], other=row['other'], **values))
    return MemoryTable(tuple(rows))


def _shapes_of(pipe, sample):
    """``[(input name, shape)]`` of the batch ``sample`` (a shape, an array,
    or one of them per input, nested as the network's inputs are)."""
    if sample is None:
        if pipe.placement.sample_shapes is None:
            raise ValueError('sample: expected the batch (a shape or arrays) or data_shapes, '
                             'found neither (nor a Pipeline made with sample=)')
        leaves = [tuple(s) for s in pipe.placement.sample_shapes]
    elif isinstance(sample, tuple) and all(isinstance(n, int) for n in sample):
        leaves = [sample]
    else:
        leaves = [tuple(getattr(a, 'shape', a)) for a in _flat(sample)]
    names = pipe.input_names
    if len(names) != len(leaves):
        raise ValueError('sample: expected %d inputs (%s), found %d'
                         % (len(names), ', '.join(names), len(leaves)))
    return list(zip(names, leaves))


def _flat(nested):
    if isinstance(nested, (list, tuple)) and not (nested and all(isinstance(n, int)
                                                                 for n in nested)):
        return [a for part in nested for a in _flat(part)]
    if isinstance(nested, mx.nd.NDArray):
        return [nested.shape]
    return [nested]
