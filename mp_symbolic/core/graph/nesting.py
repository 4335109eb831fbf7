"""Nested inputs and outputs (GluonNLP's ``(inputs, begin_state)`` ->
``(out, [h, c])``) flattened into the graph's leaves in order and back,
depth first as Gluon's ``_flatten`` / ``_regroup``. A nesting is
:data:`LEAF`, or ``(list, children)`` / ``(tuple, children)``."""
from ..base.checks import excerpt, is_int

__all__ = []

LEAF = None
# Lists and tuples nested deeper than this are refused (:func:`check`): a
# network's inputs nest two or three deep (AWDRNN's ``[[h, c], ...]``), and
# Python's own recursion would give out before a few thousand.
MAX_DEPTH = 32


def is_shape(value):
    """Whether ``value`` is a shape: a non-empty tuple or list of integers."""
    return isinstance(value, (tuple, list)) and bool(value) and all(is_int(d) for d in value)


def _is_leaf(value):
    """An array (NDArray, Symbol, numpy) or a shape; a list or tuple of anything
    else is a container."""
    return hasattr(value, 'shape') or hasattr(value, 'list_outputs') or is_shape(value) or \
        not isinstance(value, (tuple, list))


def check(value, field, is_leaf=_is_leaf):
    """Raises ValueError unless ``value``'s lists and tuples nest at most
    :data:`MAX_DEPTH` deep and none holds itself (walked without recursion).

    Args:
        field: What ``value`` is, for the message.
    """
    if is_leaf(value):
        return
    path, on_path, items = [value], {id(value)}, [iter(value)]
    while items:
        item = next(items[-1], _END)
        if item is _END:
            items.pop()
            on_path.discard(id(path.pop()))
        elif not is_leaf(item):
            if id(item) in on_path:
                raise ValueError('%s: expected batches in lists and tuples, found a %s that '
                                 'holds itself' % (field, type(item).__name__))
            if len(path) == MAX_DEPTH:
                raise ValueError('%s: expected lists and tuples nested at most %d deep, found '
                                 'them deeper' % (field, MAX_DEPTH))
            path.append(item)
            on_path.add(id(item))
            items.append(iter(item))


def flatten(value, is_leaf=_is_leaf):
    """``(leaves, nesting)`` of ``value``: its leaves depth first, in order."""
    if is_leaf(value):
        return [value], LEAF
    leaves, children = [], []
    for item in value:
        sub, nesting = flatten(item, is_leaf)
        leaves += sub
        children.append(nesting)
    return leaves, (list if isinstance(value, list) else tuple, tuple(children))


def unflatten(nesting, leaves):
    """The leaves (in order) put back in ``nesting``; the inverse of :func:`flatten`."""
    leaves = iter(leaves)
    value = _build(nesting, leaves)
    rest = next(leaves, _END)
    assert rest is _END, 'more leaves than the nesting holds'
    return value


_END = object()


def _build(nesting, leaves):
    if nesting is LEAF:
        return next(leaves)
    kind, children = nesting
    return kind(_build(child, leaves) for child in children)


def count(nesting):
    """The leaves ``nesting`` holds."""
    if nesting is LEAF:
        return 1
    return sum(count(child) for child in nesting[1])


def is_flat(nesting):
    """Whether ``nesting`` is a leaf or a list or tuple of leaves."""
    return nesting is LEAF or all(child is LEAF for child in nesting[1])


def alike(one, other):
    """Whether two nestings hold their leaves alike, a list and a tuple counting
    as the same."""
    if one is LEAF or other is LEAF:
        return one is other
    return len(one[1]) == len(other[1]) and all(alike(a, b) for a, b in zip(one[1], other[1]))


def map_leaves(fn, value, is_leaf=_is_leaf):
    """``value`` with ``fn`` applied to each leaf, its nesting kept."""
    leaves, nesting = flatten(value, is_leaf)
    return unflatten(nesting, [fn(leaf) for leaf in leaves])


def describe(nesting, leaf='x'):
    """``nesting`` written without values: ``(x, [x, x])``; ``leaf`` is what each
    leaf is written as, or an iterator of them in order."""
    if nesting is LEAF:
        return leaf if isinstance(leaf, str) else next(leaf)
    kind, children = nesting
    inner = ', '.join(describe(child, leaf) for child in children)
    if kind is tuple:
        return '(%s,)' % inner if len(children) == 1 else '(%s)' % inner
    return '[%s]' % inner


def describe_value(value):
    """``value`` written by kind and shape, never by its values
    (``NDArray(2, 4, 200)``, a shape as itself, else its type), nested as it is."""
    if hasattr(value, 'shape') and not isinstance(value, (tuple, list)):
        shape = getattr(value, 'shape', None)
        shape = ', '.join(str(d) for d in shape) if isinstance(shape, tuple) else '?'
        return '%s(%s)' % (type(value).__name__, shape)
    if hasattr(value, 'list_outputs'):
        return 'Symbol'
    if is_shape(value):
        return excerpt(str(tuple(int(d) for d in value)))
    if isinstance(value, (tuple, list)):
        inner = ', '.join(describe_value(item) for item in value)
        if isinstance(value, tuple):
            return '(%s,)' % inner if len(value) == 1 else '(%s)' % inner
        return '[%s]' % inner
    return type(value).__name__


def _is_name(value):
    return isinstance(value, str)


def flat_names(inputs):
    """The names of nested names ``inputs`` (``('data0', ['data1',
    'data2'])``), in order; a name alone is one."""
    return flatten(inputs if isinstance(inputs, str) else list(inputs), _is_name)[0]


def map_names(fn, inputs):
    """Nested names ``inputs`` with ``fn`` applied to each name (a list of the
    positional inputs; a name alone stays alone)."""
    if isinstance(inputs, str):
        return fn(inputs)
    return map_leaves(fn, list(inputs), _is_name)
