"""Optimizer state by parameter name, free of devices, so that a run resumes
onto another device plan: each parameter's state as numpy arrays with its
update count and the optimizer's ``num_update``, in one ``.npz`` file (no
pickle), restored onto the device of the parameter it belongs to.
Invariant: an uninterrupted run and a resumed one compute the same updates."""
import json
import zipfile

import mxnet as mx
import numpy as np

__all__ = []

FORMAT = 'mp_symbolic.optimizer_states/1'


class OptimizerStateError(ValueError):
    """An optimizer-state file that is unreadable or does not fit the model."""


class Deferred:  # pylint: disable=too-few-public-methods
    """An optimizer-state array not copied to the host yet; called, it returns
    the numpy array. ``ndim`` is known before."""

    def __init__(self, make, ndim):
        self.make, self.ndim = make, ndim

    def __call__(self):
        return self.make()


def encode_state(state, arrays, lazy=False):
    """One parameter's state as its spec (``{'t': ...}``), its arrays appended to
    ``arrays`` (numpy, or :class:`Deferred` if ``lazy``)."""
    if state is None:
        return {'t': 'none'}
    if isinstance(state, mx.nd.NDArray):
        arrays.append(Deferred(state.asnumpy, state.ndim) if lazy else state.asnumpy())
        return {'t': 'nd', 'a': len(arrays) - 1}
    if isinstance(state, (tuple, list)):
        return {'t': type(state).__name__,
                'items': [encode_state(s, arrays, lazy) for s in state]}
    raise OptimizerStateError('expected optimizer states made of NDArrays, tuples and None, '
                              'found %s' % type(state).__name__)


def _decode(spec, arrays, ctx):
    kind = spec['t']
    if kind == 'none':
        return None
    if kind == 'nd':
        return mx.nd.array(arrays[spec['a']], ctx=ctx, dtype=arrays[spec['a']].dtype)
    items = [_decode(s, arrays, ctx) for s in spec['items']]
    return tuple(items) if kind == 'tuple' else items


def _count_of(optimizer, index):
    # pylint: disable=protected-access
    for counts in optimizer._all_index_update_counts.values():
        if index in counts:
            return counts[index]
    return None


def states_by_name(updater, optimizer, names, lazy=False):
    """The state of each parameter of ``names`` (``{index: name}``) in
    ``updater`` (an ``mx.optimizer.Updater`` or a wrapper of one) of
    ``optimizer``; with ``lazy``, each array a :class:`Deferred`.

    Returns:
        ``{'format', 'optimizer', 'num_update', 'params': {name: {'count',
        'state'}}, 'arrays': [numpy arrays]}``; a parameter never updated has
        no entry.
    """
    return states_of(optimizer, [(name, index, updater) for index, name in names.items()],
                     lazy)


def states_of(optimizer, sources, lazy=False):
    """:func:`states_by_name` with an updater per parameter: ``sources``
    ``[(name, index, updater)]``."""
    arrays, params = [], {}
    for name, index, updater in sources:
        if index not in updater.states:
            continue
        params[name] = {'count': _count_of(optimizer, index),
                        'state': encode_state(updater.states[index], arrays, lazy)}
    return {'format': FORMAT, 'optimizer': type(optimizer).__name__.lower(),
            'num_update': optimizer.num_update, 'params': params, 'arrays': arrays}


def set_states_by_name(updater, optimizer, states, targets):
    """Restores :func:`states_by_name` output, each state to ``targets[name]``,
    ``(index, device)``.

    Raises:
        OptimizerStateError: another optimizer, or a state for a parameter
            ``targets`` does not name.
    """
    set_states_of(optimizer, states, {name: [(updater, index, device, [device.device_id])]
                                      for name, (index, device) in targets.items()})


def set_states_of(optimizer, states, targets):
    """Restores :func:`states_of` output, a parameter's state to each of its
    copies.

    Args:
        targets: ``{name: [(updater, index, device, count_ids)]}``: each copy's
            updater, its index there, the device its state goes to (``None``:
            the CPU, moved by the updater on first use) and the device ids
            whose update count is set.

    Raises:
        OptimizerStateError: another optimizer, or a state for a parameter
            ``targets`` does not name.
    """
    kind = type(optimizer).__name__.lower()
    if states.get('optimizer') != kind:
        raise OptimizerStateError('expected optimizer state of %s, found state of %s'
                                  % (kind, states.get('optimizer')))
    unknown = sorted(set(states['params']) - set(targets))
    if unknown:
        raise OptimizerStateError('expected optimizer state for this model\'s parameters, '
                                  'found state for %s' % ', '.join(unknown[:5]))
    # pylint: disable=protected-access
    for name, entry in states['params'].items():
        for updater, index, device, count_ids in targets[name]:
            updater.states[index] = _decode(entry['state'], states['arrays'],
                                            device or mx.cpu())
            updater.states_synced[index] = device is not None
            if entry['count'] is not None:
                for device_id in count_ids:
                    optimizer._all_index_update_counts.setdefault(device_id, {})[index] = \
                        entry['count']
    optimizer.num_update = states['num_update']


def drop_states(states, names):
    """``states`` without the entries of ``names``."""
    names = set(names)
    return dict(states, params={n: e for n, e in states['params'].items() if n not in names})


def merge_states(parts):
    """One :func:`states_by_name` output from several of disjoint parameters;
    raises OptimizerStateError for parts of other optimizers or two naming
    one parameter."""
    merged = {'format': FORMAT, 'optimizer': None, 'num_update': 0, 'params': {},
              'arrays': []}
    for part in parts:
        if part['optimizer'] is not None:
            if merged['optimizer'] not in (None, part['optimizer']):
                raise OptimizerStateError('expected every part of one optimizer, found %s and %s'
                                          % (merged['optimizer'], part['optimizer']))
            merged['optimizer'] = part['optimizer']
        merged['num_update'] = max(merged['num_update'], part['num_update'])
        offset = len(merged['arrays'])
        for name, entry in part['params'].items():
            if name in merged['params']:
                raise OptimizerStateError('expected each parameter in one part, found %s in two'
                                          % name)
            merged['params'][name] = dict(entry, state=_rebased(entry['state'], offset))
        merged['arrays'] += list(part['arrays'])
    return merged


def _rebased(spec, offset):
    if spec['t'] == 'nd':
        return dict(spec, a=spec['a'] + offset)
    if 'items' in spec:
        return dict(spec, items=[_rebased(s, offset) for s in spec['items']])
    return spec


def save_states(path, states, digests=None):
    """Writes :func:`states_by_name` output to ``path`` as ``np.savez`` would
    (``meta``, then ``a0``, ``a1``, ...), one array at a time (an array may be
    a function returning it); ``digests`` as for
    :func:`~mp_symbolic.core.base.parts.write_npz`. Returns ``{member: (shape,
    dtype)}``; raises OSError where the file cannot be written."""
    from ..base.parts import write_npz  # pylint: disable=import-outside-toplevel
    meta = {k: v for k, v in states.items() if k != 'arrays'}
    members = [('meta', np.array(json.dumps(meta)))]
    members += [('a%d' % i, a) for i, a in enumerate(states['arrays'])]
    return write_npz(path, members, replace=True, digests=digests)


def load_states(path):
    """Reads :func:`save_states` output; raises OptimizerStateError where the
    file is missing, unreadable, of another format, or refused by
    :func:`check_states`."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data['meta']))
            if not isinstance(meta, dict) or meta.get('format') != FORMAT:
                raise OptimizerStateError('%s: expected optimizer states of format %s, found %r'
                                          % (path, FORMAT, meta.get('format')
                                             if isinstance(meta, dict) else type(meta).__name__))
            arrays = [data['a%d' % i] for i in range(len(data.files) - 1)]
    except OptimizerStateError:
        raise
    # a truncated or forged file: zipfile, numpy and json each fail in their own way
    except (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError, RecursionError,
            zipfile.BadZipFile) as err:
        raise OptimizerStateError('%s is not a readable optimizer-state file: %s: %s'
                                  % (path, type(err).__name__,
                                     ' '.join(str(err).split())[:200])) from None
    meta['arrays'] = arrays
    try:
        check_states(meta)
    except OptimizerStateError as err:
        raise OptimizerStateError('%s: %s' % (path, err)) from None
    return meta


MAX_DEPTH = 8  # nesting of one parameter's state (MXNet's optimizers use 2 at most)


def check_states(states, shapes=None):
    """Checks :func:`states_by_name` output read from a file, each state array
    of its parameter's shape in ``shapes`` (``None``: not checked).

    Raises:
        OptimizerStateError: a field of the wrong kind, or an array that is
            not finite floating point or not of its parameter's shape.
    """
    def bad(what, expected, found):
        raise OptimizerStateError('%s: expected %s, found %s' % (what, expected, found))

    arrays = states.get('arrays')
    if not isinstance(states.get('optimizer'), (str, type(None))):
        bad('optimizer', 'a name', type(states.get('optimizer')).__name__)
    if not _count(states.get('num_update')):
        bad('num_update', 'an integer >= 0', repr(states.get('num_update'))[:40])
    params = states.get('params')
    if not isinstance(params, dict):
        bad('params', 'a dict of states by parameter name', type(params).__name__)
    for i, array in enumerate(arrays):
        if not np.issubdtype(array.dtype, np.floating):
            bad('array %d' % i, 'floating-point optimizer state', 'dtype %s' % array.dtype)
        if not np.all(np.isfinite(array)):
            bad('array %d' % i, 'finite values', 'NaN or infinity')
    for name, entry in params.items():
        if not isinstance(entry, dict) or set(entry) != {'count', 'state'}:
            bad(name, "{'count', 'state'}", repr(entry)[:60])
        if entry['count'] is not None and not _count(entry['count']):
            bad('%s count' % name, 'an integer >= 0 or None', repr(entry['count'])[:40])
        shape = None if shapes is None else tuple(shapes[name]) if name in shapes else None
        for index in _spec_arrays(entry['state'], len(arrays), name, 0):
            if shape is not None and arrays[index].shape != shape:
                bad(name, 'a state of the parameter\'s shape %s' % (shape,),
                    'shape %s' % (arrays[index].shape,))


def _count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _spec_arrays(spec, num_arrays, name, depth):
    """The array indices a state spec refers to; raises OptimizerStateError for
    a spec :func:`encode_state` does not write."""
    kind = spec.get('t') if isinstance(spec, dict) else None
    if kind == 'none':
        return []
    if kind == 'nd':
        index = spec.get('a')
        if not _count(index) or index >= num_arrays:
            raise OptimizerStateError('%s: expected a state naming one of the %d arrays, found '
                                      '%s' % (name, num_arrays, repr(index)[:40]))
        return [index]
    if kind in ('tuple', 'list') and isinstance(spec.get('items'), list) and depth < MAX_DEPTH:
        return [i for item in spec['items']
                for i in _spec_arrays(item, num_arrays, name, depth + 1)]
    raise OptimizerStateError('%s: expected a state of NDArrays, tuples and None nested at '
                              'most %d deep, found %s' % (name, MAX_DEPTH, repr(spec)[:60]))


def _merge(specs, arrays, out, axis, ndim):
    """One spec from a parameter's shards' specs: arrays of the weight's rank
    joined along ``axis``, others taken from shard 0."""
    kind = specs[0]['t']
    if kind == 'none':
        return {'t': 'none'}
    if kind == 'nd':
        parts = [arrays[s['a']] for s in specs]
        if parts[0].ndim != ndim:
            out.append(parts[0])
        elif isinstance(parts[0], Deferred):  # joined when called
            out.append(Deferred(lambda: np.concatenate([p() for p in parts], axis=axis), ndim))
        else:
            out.append(np.concatenate(parts, axis=axis))
        return {'t': 'nd', 'a': len(out) - 1}
    return {'t': kind, 'items': [_merge([s['items'][j] for s in specs], arrays, out, axis, ndim)
                                 for j in range(len(specs[0]['items']))]}


def _cut(spec, arrays, out, axis, sizes, ndim):
    """A parameter's state spec cut into one spec per shard (``sizes`` along ``axis``)."""
    kind = spec['t']
    if kind == 'none':
        return [{'t': 'none'} for _ in sizes]
    if kind == 'nd':
        array, specs, start = arrays[spec['a']], [], 0
        for size in sizes:
            if array.ndim == ndim:
                index = [slice(None)] * ndim
                index[axis] = slice(start, start + size)
                out.append(np.ascontiguousarray(array[tuple(index)]))
            else:
                out.append(array)
            specs.append({'t': 'nd', 'a': len(out) - 1})
            start += size
        return specs
    items = [_cut(s, arrays, out, axis, sizes, ndim) for s in spec['items']]
    return [{'t': kind, 'items': [item[i] for item in items]} for i in range(len(sizes))]


def gather_states(states, sharded):
    """:func:`states_by_name` output with each tensor-parallel parameter's
    shards' states joined under its unsplit name (``sharded``: ``{unsplit
    name: ShardedParam}``)."""
    if not sharded:
        return states
    shard_of = {n: p for p in sharded.values() for n in p.names}
    arrays, out, params = states['arrays'], [], {}
    for name, entry in states['params'].items():
        param = shard_of.get(name)
        if param is None:
            params[name] = {'count': entry['count'],
                            'state': _merge([entry['state']], arrays, out, 0, -1)}
        elif param.name not in params and all(n in states['params'] for n in param.names):
            entries = [states['params'][n] for n in param.names]
            params[param.name] = {'count': entries[0]['count'],
                                  'state': _merge([e['state'] for e in entries], arrays, out,
                                                  param.axis, len(param.shape))}
    return dict(states, params=params, arrays=out)


def split_states(states, sharded):
    """The inverse of :func:`gather_states`."""
    if not sharded:
        return states
    arrays, out, params = states['arrays'], [], {}
    for name, entry in states['params'].items():
        param = sharded.get(name)
        if param is None:
            params[name] = {'count': entry['count'],
                            'state': _merge([entry['state']], arrays, out, 0, -1)}
            continue
        sizes = [p.shape[param.axis] for p in param.shards]
        for shard, spec in zip(param.names, _cut(entry['state'], arrays, out, param.axis, sizes,
                                                 len(param.shape))):
            params[shard] = {'count': entry['count'], 'state': spec}
    return dict(states, params=params, arrays=out)
