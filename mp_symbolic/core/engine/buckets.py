"""Variable-length batches: a Module's runtimes bound once per bucket key, as
``mx.mod.BucketingModule`` binds a Module per key on the default's arrays.

A batch carries its shape as ``BucketingModule`` reads it (``bucket_key``,
``provide_data``, ``provide_label``). Each key's runtimes bind the Module's
parameter, gradient and auxiliary arrays, with inputs and activations at
that key's shapes, sharing the memory pools of the other keys' executors.
The default bucket is the shapes the Module was bound at; a batch whose
``bucket_key`` is ``None`` runs on it. The optimizer and its state are the
Module's own whatever the key. ``buckets=`` declares the keys ahead, and a
batch of another key is refused.
"""
from collections import OrderedDict

__all__ = []


class Buckets:
    """The forms a Module has bound, by bucket key, each made on the key's first
    batch and kept.

    Args:
        declared: ``None``: any key; or the keys the Module takes (a non-empty
            iterable of hashable values).

    Attributes:
        declared: The declared keys, a tuple, or ``None``.
        bound: ``{key: form}`` in the order the keys were first seen.

    Raises:
        ValueError: ``declared`` empty, not iterable, or holding an unhashable
            key or ``None``.
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
    """``(data shapes, label shapes)`` of a batch as ``[(name, shape)]``: its
    ``provide_data`` and ``provide_label``, or its arrays' shapes by the names
    given."""
    def pairs(provided, arrays, names):
        if provided:
            return [(d.name, tuple(d.shape)) if hasattr(d, 'name') else (d[0], tuple(d[1]))
                    for d in provided]
        return [(n, tuple(a.shape)) for n, a in zip(names, arrays or ())]
    data = pairs(getattr(data_batch, 'provide_data', None), data_batch.data, data_names)
    labels = pairs(getattr(data_batch, 'provide_label', None), data_batch.label, label_names)
    return data, labels


def with_labels(symbol, data_shapes, label_shapes, label_names):
    """``label_shapes``, completed where a label of ``label_names`` is missing
    with the shape ``symbol`` infers from ``data_shapes``."""
    given = dict(label_shapes)
    missing = [n for n in label_names if n not in given]
    if not missing:
        return list(label_shapes)
    arguments = symbol.list_arguments()
    shapes, _, _ = symbol.infer_shape_partial(**dict(data_shapes))
    inferred = dict(zip(arguments, shapes))
    return [(n, given[n] if n in given else tuple(inferred[n])) for n in label_names]
