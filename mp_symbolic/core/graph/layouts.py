"""Where the batch is in each input and output of the Module: MXNet's
``DataDesc`` layouts (the Module splits each input at its layout's ``N``,
axis 0 without one), or the Pipeline's ``batch_axis``."""
import mxnet as mx

__all__ = []

DEFAULT_LAYOUT = 'NCHW'  # MXNet's DataDesc default: every (name, shape) pair and NDArrayIter's
LETTERS = 'TCHWDEFGIJKLM'  # the axes that are not the batch, in a layout written here


def layout_of(axis, ndim):
    """A layout of ``ndim`` axes with ``N`` at ``axis`` (``'TN'`` for
    ``(T, N)``, ``'TNC'`` for ``(L, N, C)``); ``axis`` -1: no ``N``."""
    if axis < 0:
        return LETTERS[:max(ndim, 1)]
    return LETTERS[:axis] + 'N' + LETTERS[axis:max(ndim, axis + 1) - 1]


def batch_axis_of(desc):
    """The batch axis of an ``mx.io.DataDesc`` (0 for a ``(name, shape)`` pair)."""
    return mx.io.DataDesc.get_batch_axis(getattr(desc, 'layout', None))


def batch_descs(descs, batch_axis, chunks, labels=False):
    """``descs`` (``mx.io.DataDesc`` s or ``(name, shape)`` pairs) as
    ``DataDesc`` s whose layouts put ``N`` on each one's batch axis.

    A pair or a ``DataDesc`` of MXNet's default layout has its batch on
    ``batch_axis``; another layout keeps its own where ``batch_axis`` is 0 and
    ``chunks`` 1, and must otherwise agree with it. A label (``labels``) keeps
    its own layout whatever ``batch_axis``.

    Raises:
        ValueError: a layout without ``N`` or with ``N`` past the shape, an
            array without ``batch_axis``, or a batch axis that differs from the
            Pipeline's where it cannot.
    """
    out = []
    for desc in descs:
        name, shape = (desc.name, tuple(desc.shape)) if hasattr(desc, 'name') else \
            (desc[0], tuple(desc[1]))
        layout = getattr(desc, 'layout', None)
        if layout in (None, DEFAULT_LAYOUT):
            if batch_axis and len(shape) <= batch_axis:
                raise ValueError('%s: expected an array with the batch on axis %d (batch_axis), '
                                 'found shape %s%s' % (name, batch_axis, shape,
                                                       " (give a label of another layout as "
                                                       "mx.io.DataDesc(name, shape, layout='N'))"
                                                       if labels else ''))
            layout = DEFAULT_LAYOUT if batch_axis == 0 else layout_of(batch_axis, len(shape))
        else:
            axis = layout.find('N')
            if not 0 <= axis < max(len(shape), 1):
                raise ValueError('%s: expected a layout with N at the batch axis of shape %s, '
                                 'found %r' % (name, shape, layout))
            if axis != batch_axis and batch_axis and not labels:
                raise ValueError('%s: expected a layout with N at axis %d (the Pipeline\'s '
                                 'batch_axis), found %r (N at axis %d)'
                                 % (name, batch_axis, layout, axis))
            if axis != batch_axis and chunks > 1 and not labels:  # a label's layout is its own
                raise ValueError('%s: expected the batch on axis 0 with chunks=%d (the '
                                 'micro-batches split there; Pipeline(..., batch_axis=%d) '
                                 'splits them on axis %d), found layout %r (N at axis %d)'
                                 % (name, chunks, axis, axis, layout, axis))
        out.append(mx.io.DataDesc(name, shape, layout=layout) if not hasattr(desc, 'dtype') else
                   mx.io.DataDesc(name, shape, desc.dtype, layout))
    return out


def output_batch_axes(symbol, descs):
    """The batch axis of each output of ``symbol`` bound on ``descs``: the axis
    whose size doubles when every input's batch does, -1 where none does;
    ``None`` when the shapes cannot be inferred."""
    def shapes(scale):
        given = {}
        for desc in descs:
            shape, axis = list(desc.shape), batch_axis_of(desc)
            if axis >= 0:
                shape[axis] *= scale
            given[desc.name] = tuple(shape)
        try:
            _, outputs, _ = symbol.infer_shape_partial(**given)
        except mx.base.MXNetError:
            return None
        return outputs

    one, two = shapes(1), shapes(2)
    if not one or not two:
        return None
    axes = []
    for a, b in zip(one, two):
        grown = [i for i, (x, y) in enumerate(zip(a, b)) if x and y == 2 * x]
        axes.append(grown[0] if grown else -1)
    return axes
