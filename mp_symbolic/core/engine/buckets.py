"""Variable-length batches: a Module's runtimes bound once per bucket key.

MXNet trains batches of several shapes (sentences batched by length:
GluonNLP's ``FixedBucketSampler``) with ``mx.mod.BucketingModule``: one
Module per bucket key, bound on first use with ``shared_module=`` the
default bucket's, so that every bucket's executors read and write the
default's parameter and gradient arrays and one optimizer updates them.
A Pipeline's Module does the same within itself, for batches that carry
their shape as ``BucketingModule`` reads it: an ``mx.io.DataBatch`` with
``bucket_key`` and ``provide_data`` (and ``provide_label``; where it is
missing, the labels' own shapes, or for a batch without labels the shapes
the graph infers from the data):

each key's runtimes (:class:`~mp_symbolic.core.engine.module.PipelineModule`'s,
one per replica: the stage runtime's, or GPipe's fused graph) bind the
Module's parameter, gradient and auxiliary arrays, with inputs, receive
buffers and activations at that key's shapes, and share the memory pools
of the bound shapes' executors (never run at once).

The default bucket is the shapes the Module was bound at (``fit`` binds
the iterator's ``provide_data``: MXNet's bucketing iterators give the
default key's); a key whose shapes are those runs on it. The optimizer and
its state are the Module's own, whatever the key. A batch whose
``bucket_key`` is ``None`` (``NDArrayIter``'s) runs as before, on the
default form.

``buckets=`` (``pipe.module(..., buckets=[...])``) declares the keys
ahead: a batch of another key is refused in one line, so the bound forms,
and their memory, stay within the declared count.
"""
from collections import OrderedDict

__all__ = []


class Buckets:
    """The forms a Module has bound, by bucket key: made on a key's first
    batch, kept (a key bound once is never bound again).

    Args:
        declared: ``None``: any key, each bound on first use; or the keys
            the Module takes (a non-empty iterable of hashable values).

    Attributes:
        declared: The declared keys, a tuple, or ``None``.
        bound: ``{key: form}`` in the order the keys were first seen.

    Raises:
        ValueError: ``declared`` empty, not iterable, or holding a key that
            cannot be a dict key, or ``None`` (a batch of no key).
    """

    def __init__(self, declared=None):
        if declared is not None:
            try:
                declared = tuple(declared)
                hashes = [hash(k) for k in declared]
            except TypeError:
                raise ValueError('buckets: expected an iterable of bucket keys (as '
                                 'DataBatch.bucket_key gives them), found %r' % (declared,)) \
                    from None
            if not hashes or any(k is None for k in declared):
                raise ValueError('buckets: expected at least one bucket key, none of them None, '
                                 'found %r' % (declared,))
        self.declared = declared
        self.bound = OrderedDict()

    def check(self, key):
        """Raises ValueError in one line where ``key`` is not declared."""
        if self.declared is not None and key not in self.declared:
            raise ValueError('bucket_key: expected one of the declared buckets (%s), found %r'
                             % (', '.join(repr(k) for k in self.declared), key))

    def get(self, key, make):
        """The form of ``key``: the one bound before, or ``make()``'s, kept.

        Raises:
            ValueError: ``key`` is not declared (nothing is made).
        """
        self.check(key)
        if key not in self.bound:
            self.bound[key] = make()
        return self.bound[key]

    def clear(self):
        """Forgets every form (a new bind of the Module)."""
        self.bound.clear()


def bucket_key(data_batch):
    """The batch's ``bucket_key`` (``None`` where it has none)."""
    return getattr(data_batch, 'bucket_key', None)


def batch_shapes(data_batch, data_names, label_names):
    """``(data shapes, label shapes)`` of a batch, as ``[(name, shape)]``:
    ``provide_data`` and ``provide_label`` as ``BucketingModule`` reads
    them, or, where the batch lacks them, its arrays' shapes by the names
    given (labels only where the batch has them)."""
    def pairs(provided, arrays, names):
        if provided:
            return [(d.name, tuple(d.shape)) if hasattr(d, 'name') else (d[0], tuple(d[1]))
                    for d in provided]
        return [(n, tuple(a.shape)) for n, a in zip(names, arrays or ())]
    data = pairs(getattr(data_batch, 'provide_data', None), data_batch.data, data_names)
    labels = pairs(getattr(data_batch, 'provide_label', None), data_batch.label, label_names)
    return data, labels


def with_labels(symbol, data_shapes, label_shapes, label_names):
    """``label_shapes``, or where a label of ``label_names`` is missing
    (a batch to predict), the label shapes ``symbol`` infers from
    ``data_shapes`` (its loss head's, never read)."""
    given = dict(label_shapes)
    missing = [n for n in label_names if n not in given]
    if not missing:
        return list(label_shapes)
    arguments = symbol.list_arguments()
    shapes, _, _ = symbol.infer_shape_partial(**dict(data_shapes))
    inferred = dict(zip(arguments, shapes))
    return [(n, given[n] if n in given else tuple(inferred[n])) for n in label_names]
