"""MXNet's checkpoint file pair, read back with checks, and a training
checkpoint committed as one unit.

A checkpoint pair is ``<prefix>-symbol.json`` plus
``<prefix>-<epoch:04d>.params``, the files ``mx.model.save_checkpoint`` writes
and ``mx.model.load_checkpoint`` reads. A training run commits the pair, its
optimizer state and ``summary.json`` together through
:class:`~mp_symbolic.tools.store.Store` (:func:`commit_checkpoint`); a run over
node processes commits the symbol and one part per node instead
(:func:`save_part`), which :func:`write_pair` turns into the pair; single files
(reports, pictures) are written to a temporary file and renamed into place
(:func:`mp_symbolic.tools.files.atomic_path`).
"""
import ast
import contextlib
import json
import os
import zipfile
from collections import OrderedDict

import mxnet as mx
import numpy as np



from ..core import kernels
from ..core.base.compat import error_line as first_line
from ..core.graph.names import DATA_NAME, SHAPE_ATTR
from .files import check_writable_dir  # pylint: disable=unused-import  (its home is files)

__all__ = []


class CheckpointError(ValueError):
    """A checkpoint file that is missing, corrupt, or does not fit its symbol."""


def save_params(path, arg_params, aux_params=None):
    """Writes the bytes ``mx.nd.save`` writes for the arrays with MXNet's
    ``arg:``/``aux:`` names on ``cpu()``, one array at a time, and reads
    them back one array at a time: the file must hold every array at its
    name, shape and type, with the bytes written (sha256).

    Args:
        arg_params, aux_params: ``{name: array}``: NDArrays on any device,
            numpy arrays, or functions of no arguments returning one (each
            called when its array is written, and let go once written).

    Raises:
        OSError: The file could not be written (a full disk, a file size
            limit) or does not read back as written; one line.
        ValueError: an array of a type MXNet's format does not hold; one
            line.
    """
    # pylint: disable=import-outside-toplevel
    from ..core.base.parts import MxnetParams, PartError, mxnet_params_index, write_mxnet_params

    def lazy(value):
        return lambda: _host(value() if callable(value) else value)

    items = [('arg:%s' % k, lazy(v)) for k, v in arg_params.items()]
    items += [('aux:%s' % k, lazy(v)) for k, v in (aux_params or {}).items()]
    digests = {}
    try:
        written = write_mxnet_params(path, items, replace=True, digests=digests)
    except OSError as err:
        raise OSError('%s: cannot write the parameters (%s; a full disk or a file size limit?)'
                      % (path, ' '.join(str(err).split())[:200])) from None
    try:
        found = mxnet_params_index(path)
        if found == written:
            saved = MxnetParams(path)
            found = {k: v for k, v in found.items() if saved.digest(k) == digests[k]}
    except (OSError, PartError) as err:
        raise OSError('%s: expected the parameters just written to read back, found %s'
                      % (path, ' '.join(str(err).split())[:200])) from None
    differ = [k for k in set(written) | set(found) if found.get(k) != written.get(k)]
    if differ:
        raise OSError('%s: expected %d arrays to read back as written, found %d that differ'
                      % (path, len(written), len(differ)))


def save_symbol(path, symbol):
    """``symbol.save(path)``, read back and parsed.

    MXNet's ``Symbol.save`` ignores write errors: under a full disk or a file
    size limit it leaves a truncated file and returns. The file must hold
    exactly ``symbol.tojson()`` and parse as JSON.

    Raises:
        OSError: The file is not what was written; one line.
    """
    expected = symbol.tojson().encode('utf-8')
    symbol.save(path)
    size = os.path.getsize(path)
    if size != len(expected):
        raise OSError('%s: expected the %d bytes of the symbol written, found %d bytes '
                      '(a full disk or a file size limit?)' % (path, len(expected), size))
    with open(path, 'rb') as f:
        data = f.read(len(expected) + 1)
    try:
        json.loads(data.decode('utf-8'))
    except (UnicodeDecodeError, ValueError, RecursionError):
        data = None
    if data != expected:
        raise OSError('%s: expected the symbol just written to read back, found other bytes'
                      % path)


def _check_json_written(path, obj):
    """Reads back a JSON file just written; raises OSError unless it holds ``obj``."""
    try:
        with open(path, 'rb') as f:
            found = json.loads(f.read().decode('utf-8'))
    except (UnicodeDecodeError, ValueError, RecursionError):
        found = None
    if found is None or json.dumps(found, sort_keys=True) != json.dumps(obj, sort_keys=True):
        raise OSError('%s: expected the JSON just written to read back, found %s'
                      % (path, 'other values' if found is not None else 'no valid JSON'))


def _read_params(params_path):
    """The arrays of an MXNet ``.params`` file: ``{name: NDArray}`` (or a
    list, for a file of unnamed arrays), each read on its own from its
    offset (:class:`~mp_symbolic.core.base.parts.MxnetParams`), so that no more
    than one array is held twice at a time; a file of another kind than
    named dense arrays (sparse, unnamed, not one at all) is read by
    ``mx.nd.load``, whose message says what it is.

    Raises:
        CheckpointError: not an MXNet params file (one line).
    """
    from ..core.base.parts import MxnetParams, PartError  # pylint: disable=import-outside-toplevel
    try:
        params = MxnetParams(params_path)
        saved = {}
        for name in params.names():
            value = params.read(name)
            saved[name] = mx.nd.array(value, dtype=value.dtype)
            del value
        return saved
    except (PartError, OSError, UnicodeDecodeError):
        pass
    try:
        return mx.nd.load(params_path)
    except (mx.base.MXNetError, ValueError) as err:
        raise CheckpointError('%s is not an MXNet params file: %s'
                              % (params_path, first_line(err))) from None


def load_checkpoint(sym_path, params_path, input_shapes=None):
    """Loads a symbol and its parameters and checks that they fit.

    The params file is read one array at a time (:func:`_read_params`).

    Every non-input argument of the symbol must have an array, of the shape
    the symbol records (its variables' ``__shape__`` attributes) and that
    MXNet's shape inference accepts with the others; no array may be left
    over.

    Args:
        input_shapes: ``{input name: one sample's shape}`` where the symbol
            does not record them (shape inference needs them for some ops).

    Returns:
        ``(symbol, arg_params, aux_params)``; arrays on ``cpu()``.

    Raises:
        CheckpointError: a file is missing or corrupt, or symbol and
            parameters do not match (the message lists what differs).
    """
    for path in (sym_path, params_path):
        if not os.path.isfile(path):
            raise CheckpointError('expected a checkpoint file at %s, found none' % path)
    try:
        symbol = kernels.load_symbol(sym_path)
    except kernels.KernelError as err:
        raise CheckpointError(str(err)) from None
    except (mx.base.MXNetError, ValueError, UnicodeDecodeError) as err:
        raise CheckpointError('%s is not an MXNet symbol file: %s'
                              % (sym_path, first_line(err))) from None
    saved = _read_params(params_path)
    if not isinstance(saved, dict):
        raise CheckpointError('%s holds unnamed arrays; expected arg:/aux: names'
                              % params_path)
    arg_params, aux_params = {}, {}
    for key, value in saved.items():
        kind, _, name = key.partition(':')
        if kind == 'arg':
            arg_params[name] = value
        elif kind == 'aux':
            aux_params[name] = value
        else:
            raise CheckpointError("%s: expected array names 'arg:<name>' or 'aux:<name>', "
                                  'found %r' % (params_path, key))
    check_params(symbol, arg_params, aux_params, where=params_path, input_shapes=input_shapes)
    return symbol, arg_params, aux_params


def input_names(symbol, data_name=DATA_NAME):
    """The arguments of ``symbol`` that are inputs, not parameters: ``data``
    (or ``data0``, ``data1``, ... for several, as ``HybridBlock.export``
    names them) and the labels (MXNet names them ``<head>_label`` or ``label``)."""
    return [a for a in symbol.list_arguments()
            if a == data_name or a.endswith('label')
            or (a.startswith(data_name) and a[len(data_name):].isdigit())]


def _inputs_at_batch_one(symbol, given=None):
    """``{input: (1,) + per-sample shape}`` for each input whose ``__shape__``
    records ``(0,) + per-sample shape``, and each of ``given``."""
    inputs = set(input_names(symbol))
    found = {name: (1,) + tuple(shape) for name, shape in (given or {}).items()
             if name in inputs}
    for name, attrs in symbol.attr_dict().items():
        recorded = attrs.get(SHAPE_ATTR)
        if name in inputs and recorded:
            try:
                shape = tuple(ast.literal_eval(recorded))
            except (ValueError, SyntaxError, TypeError):
                continue
            if name not in found and shape and shape[0] == 0 and all(
                    isinstance(d, int) and d > 0 for d in shape[1:]):
                found[name] = (1,) + shape[1:]
    return found


def _one_number_inputs(symbol, recorded, data):
    """``recorded`` with each data input it lacks as one number per sample
    (a module records the inputs of more than one axis only: BERT's valid
    lengths are not), if the symbol then infers; else ``{}`` (one input's
    shape alone misleads a concat just as well)."""
    guess = dict(recorded, **{name: (1,) for name in data - set(recorded)})
    try:
        symbol.infer_shape_partial(**guess)
    except mx.base.MXNetError:
        return {}
    return guess


def check_params(symbol, arg_params, aux_params, where='params', input_shapes=None):
    """Raises :class:`CheckpointError` unless the arrays fit ``symbol``
    (with inputs of ``input_shapes``, one sample each, where given)."""
    inputs = set(input_names(symbol))
    expected = [a for a in symbol.list_arguments() if a not in inputs]
    missing = sorted(set(expected) - set(arg_params))
    extra = sorted(set(arg_params) - set(expected))
    extra_aux = sorted(set(aux_params) - set(symbol.list_auxiliary_states()))
    problems = []
    if missing:
        problems.append('missing %s' % ', '.join(missing))
    if extra or extra_aux:
        problems.append('unexpected %s' % ', '.join(extra + extra_aux))
    other = ['%s %s' % (k, np.dtype(v.dtype).name) for k, v in
             list(arg_params.items()) + list(aux_params.items()) if v.dtype != np.float32]
    if other:
        problems.append('expected float32 arrays (the graph computes in float32), found %s'
                        % ', '.join(other[:3]) + (' ...' if len(other) > 3 else ''))
    shapes = {k: tuple(v.shape) for k, v in arg_params.items()}
    try:
        # Gluon records each parameter's shape in its variable's __shape__, a
        # Pipeline module each input's with batch 0 ("unknown"); inferred from
        # a batch of 0, a concat or flatten after it gets wrong widths (and
        # attention ops fail), so inputs are inferred at batch 1.
        batch_one = _inputs_at_batch_one(symbol, input_shapes)
        data = {a for a in input_names(symbol) if not a.endswith('label')}
        if batch_one and set(batch_one) != data:
            batch_one = _one_number_inputs(symbol, batch_one, data)
        arg_shapes, _, _ = symbol.infer_shape_partial(**batch_one)
    except mx.base.MXNetError as err:
        raise CheckpointError('%s: cannot infer the shapes its symbol expects: %s'
                              % (where, first_line(err))) from None
    for name, inferred in zip(symbol.list_arguments(), arg_shapes):
        if name in shapes and inferred and 0 not in inferred and tuple(inferred) != shapes[name]:
            problems.append('%s has shape %s, the symbol expects %s'
                            % (name, shapes[name], tuple(inferred)))
    if not problems:
        # Without __shape__ attributes only the arrays themselves say the shapes:
        # run MXNet's inference over all of them.
        known = {k: v for k, v in shapes.items() if k in expected}
        known.update({k: tuple(v.shape) for k, v in aux_params.items()})
        known.update(batch_one)
        try:
            symbol.infer_shape_partial(**known)
        except mx.base.MXNetError as err:
            problems.append('the arrays do not fit together: %s' % first_line(err))
    if problems:
        raise CheckpointError('%s does not match its symbol: %s' % (where, '; '.join(problems)))


# -- training checkpoints committed as one unit ------------------------------

SUMMARY_NAME = 'summary.json'
PARTS = 'parts'  # the manifest's "layout" of a checkpoint of one part per node
STATES_MEMBER = 'states'  # a part's optimizer state (JSON), its arrays 'state:<i>'


class _Stored:
    """A stored array's shape and dtype, without its values (what
    :func:`check_params` reads of an array)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)


class Checkpoint:
    """A verified, committed training checkpoint (see :func:`read_checkpoint`).

    Two layouts: MXNet's pair (``<name>-symbol.json``,
    ``<name>-NNNN.params``, ``<name>-NNNN.states``), what one process
    commits; or, committed by node processes, the symbol and one part per
    node (``<name>-NNNN-node<k>.npz``: that node's parameters, auxiliary
    states and optimizer state), never merged. Either is read one array at a
    time, taking only the arrays asked for (:meth:`load`,
    :meth:`load_states` with ``names``).

    Attributes:
        folder: The snapshot folder (``OUT/snap-...``, what ``OUT/current`` names).
        meta: What the run recorded: ``epoch``, ``task``, ``files``, ``complete``, ...
        summary: ``summary.json`` of the snapshot.
        symbol_path: Verified file path.
        params_path, states_path: Verified file paths of a pair (``None`` for parts).
        part_paths: Verified file paths of the parts (``[]`` for a pair).
        epoch: Epochs trained.

    One from :func:`read_checkpoint` holds its snapshot against removal by the
    folder's writer until :meth:`close` (or the end of a ``with`` block, or
    garbage collection), so its files stay whole while they are read even if
    the run that writes the folder commits meanwhile.
    """

    def __init__(self, snapshot):
        self.snapshot = snapshot
        self.folder = snapshot.folder
        self.meta = snapshot.meta
        files = self.meta.get('files') if isinstance(self.meta, dict) else None
        parts = files.get('parts') if isinstance(files, dict) else None
        if isinstance(parts, list) and parts and all(isinstance(p, str) for p in parts) \
                and isinstance(files.get('symbol'), str):
            self.params_path = self.states_path = None
            self.part_paths = [snapshot.path(p) for p in parts]
        elif isinstance(files, dict) and all(isinstance(files.get(k), str)
                                             for k in ('symbol', 'params', 'states')):
            self.params_path = snapshot.path(files['params'])
            self.states_path = snapshot.path(files['states'])
            self.part_paths = []
        else:
            raise CheckpointError('%s: expected a training checkpoint naming its symbol, params '
                                  'and states files (or its parts), found %r'
                                  % (self.folder, files))
        self.symbol_path = snapshot.path(files['symbol'])
        self.summary = _read_summary(snapshot.path(SUMMARY_NAME))
        self.epoch = self.meta.get('epoch')
        if type(self.epoch) is not int or not 0 <= self.epoch <= 10 ** 9:
            raise CheckpointError('%s: expected "epoch" to be a count of epochs, found %s'
                                  % (os.path.join(self.folder, 'MANIFEST.json'),
                                     _excerpt(self.epoch)))
        self._index = None

    @property
    def files(self):
        """The files holding the arrays: the params file, or the parts."""
        return self.part_paths or [self.params_path]

    def index(self):
        """``{'arg:<name>' | 'aux:<name>': (shape, dtype, file)}`` of every
        stored array, read from the files' headers only.

        Raises:
            CheckpointError: a file is not what it should be, or two files
                hold one array.
        """
        if self._index is not None:
            return self._index
        # pylint: disable=import-outside-toplevel
        from ..core.base.parts import PartError, mxnet_params_index, npz_index
        index = {}
        try:
            for path in self.files:
                found = npz_index(path) if self.part_paths else mxnet_params_index(path)
                for key, (shape, dtype) in found.items():
                    if not key.startswith(('arg:', 'aux:')):
                        if self.part_paths and (key == STATES_MEMBER
                                                or key.startswith('state:')):
                            continue
                        raise CheckpointError("%s: expected array names 'arg:<name>' or "
                                              "'aux:<name>', found %r" % (path, key))
                    if key in index:
                        raise CheckpointError('%s: expected each array in one part, found %s '
                                              'in %s too' % (path, key, index[key][2]))
                    index[key] = (shape, dtype, path)
        except PartError as err:
            raise CheckpointError(str(err)) from None
        self._index = index
        return index

    def load(self, names=None, input_shapes=None):
        """``(symbol, arg_params, aux_params)``, checked to fit together
        (the shapes of every stored array against the symbol), holding only
        the arrays of ``names``.

        Args:
            names: Parameter and auxiliary-state names to read (others are
                not read); ``None``: all.
            input_shapes: As :func:`load_checkpoint`'s.

        Raises:
            CheckpointError: a file is missing or corrupt, the arrays do not
                fit the symbol, or ``names`` names an array not stored.
        """
        if self.params_path is not None and names is None:
            return load_checkpoint(self.symbol_path, self.params_path, input_shapes)
        if not os.path.isfile(self.symbol_path):
            raise CheckpointError('expected a checkpoint file at %s, found none'
                                  % self.symbol_path)
        try:
            symbol = kernels.load_symbol(self.symbol_path)
        except kernels.KernelError as err:
            raise CheckpointError(str(err)) from None
        except (mx.base.MXNetError, ValueError, UnicodeDecodeError) as err:
            raise CheckpointError('%s is not an MXNet symbol file: %s'
                                  % (self.symbol_path, first_line(err))) from None
        index = self.index()
        stored = {k: _Stored(shape, dtype) for k, (shape, dtype, _) in index.items()}
        check_params(symbol, {k[4:]: v for k, v in stored.items() if k.startswith('arg:')},
                     {k[4:]: v for k, v in stored.items() if k.startswith('aux:')},
                     where=', '.join(self.files), input_shapes=input_shapes)
        wanted = None if names is None else set(names)
        arg_params, aux_params = {}, {}
        for key, value in self.arrays(k for k in index
                                      if wanted is None or k[4:] in wanted):
            (arg_params if key.startswith('arg:') else aux_params)[key[4:]] = \
                mx.nd.array(value, dtype=value.dtype)
        missing = sorted((wanted or set()) - set(arg_params) - set(aux_params))
        if missing:
            raise CheckpointError('%s: expected arrays for %s, found none'
                                  % (self.folder, ', '.join(missing[:5])))
        return symbol, arg_params, aux_params

    def arrays(self, keys):
        """``(key, numpy array)`` for each of ``keys`` (``'arg:<name>'`` or
        ``'aux:<name>'``), read one at a time, file by file.

        Raises:
            CheckpointError: a key not stored, or a file that cannot be read.
        """
        # pylint: disable=import-outside-toplevel
        from ..core.base.parts import MxnetParams, NpzReader, PartError
        index = self.index()
        keys = list(keys)
        unknown = [k for k in keys if k not in index]
        if unknown:
            raise CheckpointError('%s: expected arrays for %s, found none'
                                  % (self.folder, ', '.join(unknown[:5])))
        try:
            for path in self.files:
                mine = [k for k in keys if index[k][2] == path]
                if not mine:
                    continue
                if self.part_paths:
                    with NpzReader(path) as part:
                        for key in mine:
                            yield key, part.read(key)
                else:
                    params = MxnetParams(path)
                    for key in mine:
                        yield key, params.read(key)
        except PartError as err:
            raise CheckpointError(str(err)) from None

    def load_states(self, names=None):
        """The optimizer state (:mod:`~mp_symbolic.core.optim.optstate`'s form) of
        the parameters ``names`` (``None``: all), reading only their arrays.

        Raises:
            OptimizerStateError: a file is unreadable or holds states that
                :func:`~mp_symbolic.core.optim.optstate.check_states` refuses.
        """
        # pylint: disable=import-outside-toplevel
        from ..core.optim.optstate import load_states
        if self.states_path is None:
            return _part_states(self.part_paths, names)
        if names is None:
            return load_states(self.states_path)
        return _part_states([self.states_path], names, 'meta', 'a%d')

    def close(self):
        """Releases the snapshot: the folder's writer may remove it once it is not current."""
        self.snapshot.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _part_states(paths, names=None, meta_member=STATES_MEMBER, array_member='state:%d'):
    """The optimizer state held by the parts at ``paths``, of the parameters
    ``names`` (``None``: all): each part's JSON read whole, only the arrays
    of those parameters (a ``.states`` file of a pair is read so with its
    ``meta`` and ``a<i>`` members).

    Raises:
        OptimizerStateError: a part's state is unreadable or refused by
            :func:`~mp_symbolic.core.optim.optstate.check_states`.
    """
    # pylint: disable=import-outside-toplevel
    from ..core.optim.optstate import FORMAT, OptimizerStateError, check_states, merge_states, \
        _spec_arrays
    from ..core.base.parts import NpzReader, PartError, npz_index
    wanted = None if names is None else set(names)
    found = []
    for path in paths:
        try:
            prefix = array_member[:-len('%d')]
            count = sum(1 for k in npz_index(path)
                        if k.startswith(prefix) and k[len(prefix):].isdigit())
            with NpzReader(path) as part:
                meta = json.loads(str(part.read(meta_member)))
                if not isinstance(meta, dict) or meta.get('format') != FORMAT \
                        or not isinstance(meta.get('params'), dict):
                    raise OptimizerStateError('expected optimizer states of format %s' % FORMAT)
                params, arrays, taken = {}, [], {}
                for name, entry in meta['params'].items():
                    if wanted is not None and name not in wanted:
                        continue
                    if not isinstance(entry, dict) or 'state' not in entry:
                        raise OptimizerStateError('%s: expected {count, state}, found %s'
                                                  % (name, _excerpt(entry)))
                    for i in _spec_arrays(entry['state'], count, name, 0):
                        if i not in taken:
                            taken[i] = len(arrays)
                            arrays.append(part.read(array_member % i))
                    params[name] = dict(entry, state=_renumbered(entry['state'], taken))
            states = dict(meta, params=params, arrays=arrays)
            check_states(states)
        except (PartError, OptimizerStateError, ValueError, RecursionError) as err:
            raise OptimizerStateError('%s: %s' % (path, ' '.join(str(err).split())[:300])) \
                from None
        found.append(states)
    return merge_states(found)


def _renumbered(spec, taken):
    if spec['t'] == 'nd':
        return dict(spec, a=taken[spec['a']])
    if 'items' in spec:
        return dict(spec, items=[_renumbered(s, taken) for s in spec['items']])
    return spec


MAX_SUMMARY_BYTES = 64 << 20  # a summary holds a few numbers per epoch


def _excerpt(value, limit=60):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + '...'


def _read_summary(path):
    """``summary.json`` as a dict whose known fields have their types.

    Raises:
        CheckpointError: The file is over 64 MiB, not JSON (or nested too
            deeply to read), or a field is of the wrong type; the message
            names the file.
    """
    from .store import StoreError, read_bounded  # pylint: disable=import-outside-toplevel
    try:
        summary = json.loads(read_bounded(path, MAX_SUMMARY_BYTES, 'summary').decode('utf-8'))
    except StoreError as err:
        raise CheckpointError(str(err)) from None
    except RecursionError:
        raise CheckpointError('%s: expected a training summary, found JSON nested too deeply '
                              'to read' % path) from None
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError('%s: expected a training summary (JSON), found %s'
                              % (path, ' '.join(str(err).split())[:200])) from None
    if not isinstance(summary, dict):
        raise CheckpointError('%s: expected a JSON object, found %s'
                              % (path, type(summary).__name__))
    checks = {'config': (dict, 'an object'), 'devices': (list, 'a list'),
              'epoch_losses': (list, 'a list of numbers')}
    for key, (kind, expected) in checks.items():
        if key in summary and not isinstance(summary[key], kind):
            raise CheckpointError('%s: expected "%s" to be %s, found %s'
                                  % (path, key, expected, _excerpt(summary[key])))
    losses = summary.get('epoch_losses', [])
    bad = [v for v in losses if type(v) not in (int, float)]
    if bad:
        raise CheckpointError('%s: expected "epoch_losses" to be a list of numbers, found %s'
                              % (path, _excerpt(bad[0])))
    return summary


def commit_checkpoint(store, name, epoch, symbol, arg_params, aux_params, states, summary,
                      complete, group=None):
    """Commits one checkpoint as a unit: symbol, params, optimizer state and
    summary land together in a new snapshot, or not at all.

    Args:
        store: A :class:`~mp_symbolic.tools.store.Store` whose lock is held
            (``None`` on a node other than node 0).
        name: File prefix (the task's name).
        states: Optimizer state by parameter name (:mod:`~mp_symbolic.core.optim.optstate`).
        summary: JSON-able dict written as ``summary.json``.
        complete: Whether this is the run's final checkpoint.
        group: The node processes of one pipeline
            (:class:`~mp_symbolic.core.transport.comm.ControlPlane`), each holding its
            stages' parameters and states (``arg_params``, ``aux_params``,
            ``states``: this node's; values may be functions making each
            array when called, see :func:`save_part`): every node writes its
            part (:func:`part_name`) into the shared folder, node 0 the
            symbol and the summary, and the parts are committed as they are,
            never merged (:func:`~mp_symbolic.tools.store.commit_across`:
            all or nothing). No node reads or holds another's arrays.

    Returns:
        The :class:`Checkpoint` (``None`` on a node other than node 0).

    Raises:
        OSError: A file could not be written or does not read back as
            written (every file is checked before the commit); the previous
            checkpoint stays current.
        PartError: (with ``group``) a node could not write its part, or node
            0 could not commit; every node raises it.
    """
    from .store import commit_across  # pylint: disable=import-outside-toplevel
    files = {'symbol': '%s-symbol.json' % name, 'params': '%s-%04d.params' % (name, epoch),
             'states': '%s-%04d.states' % (name, epoch)}

    def write_rest(folder):
        save_symbol(os.path.join(folder, files['symbol']), symbol)
        content = dict(summary, files=files, epoch=epoch, complete=complete)
        summary_path = os.path.join(folder, SUMMARY_NAME)
        with open(summary_path, 'w') as f:
            json.dump(content, f, indent=2, sort_keys=True)
            f.write('\n')
        _check_json_written(summary_path, content)

    if group is None:
        meta = {'epoch': epoch, 'task': name, 'files': files, 'complete': complete}

        def write(folder):
            # Each file is read back before the store writes the manifest over it.
            save_params(os.path.join(folder, files['params']), arg_params, aux_params)
            _save_states(os.path.join(folder, files['states']), states)
            write_rest(folder)
        return Checkpoint(store.commit(write, meta))

    # over nodes: one part per node, never merged (no process holds the model)
    files = {'symbol': files['symbol'],
             'parts': [part_name(name, epoch, k) for k in range(group.count)]}
    meta = {'epoch': epoch, 'task': name, 'files': files, 'complete': complete,
            'layout': PARTS}

    def write_part(folder):
        part = files['parts'][group.rank]
        save_part(os.path.join(folder, part), arg_params, aux_params, states)
        return [part]

    committed = commit_across(store, group, write_part, write_rest, meta)
    return Checkpoint(committed) if group.rank == 0 else None


def part_name(name, epoch, node):
    """The file of node ``node``'s part: ``<name>-<epoch:04d>-node<k>.npz``."""
    return '%s-%04d-node%d.npz' % (name, epoch, node)


def _host(value):
    """A value as a numpy array (an NDArray copied to the host)."""
    return value.asnumpy() if isinstance(value, mx.nd.NDArray) else np.asarray(value)


def save_part(path, arg_params, aux_params, states):
    """Writes one node's part of a checkpoint: an ``.npz`` file holding its
    parameters (``arg:<name>``), auxiliary states (``aux:<name>``) and
    optimizer state (``states``: JSON of :mod:`~mp_symbolic.core.optim.optstate`'s
    fields; its arrays ``state:<i>``), one array at a time, read back.

    Args:
        arg_params, aux_params: ``{name: array}``: NDArrays, numpy arrays,
            or functions of no arguments returning one (each called when
            its array is written, and let go once written).
        states: :func:`~mp_symbolic.core.optim.optstate.states_by_name` output.

    Raises:
        OSError: the file could not be written or does not read back as
            written (a full disk, a file size limit); one line.
    """
    from ..core.base.parts import PartError, npz_index, write_npz  # pylint: disable=import-outside-toplevel
    meta = {k: v for k, v in states.items() if k != 'arrays'}

    def lazy(value):
        return lambda: _host(value() if callable(value) else value)

    members = [('arg:%s' % k, lazy(v)) for k, v in arg_params.items()]
    members += [('aux:%s' % k, lazy(v)) for k, v in (aux_params or {}).items()]
    members.append((STATES_MEMBER, np.array(json.dumps(meta, sort_keys=True))))
    members += [('state:%d' % i, lazy(a)) for i, a in enumerate(states['arrays'])]
    try:
        written = write_npz(path, members)
    except (OSError, zipfile.LargeZipFile) as err:
        raise OSError('%s: cannot write the checkpoint part (%s; a full disk or a file size '
                      'limit?)' % (path, ' '.join(str(err).split())[:200])) from None
    try:
        found = npz_index(path)
    except PartError as err:
        raise OSError('%s: expected the part just written to read back, found %s'
                      % (path, err)) from None
    if found != written:
        raise OSError('%s: expected %d arrays to read back as written, found %d that differ'
                      % (path, len(written), len(found)))


def _save_states(path, states):
    """``save_states``, read back one member at a time: it must hold every
    array written, at its name, shape and type, with the bytes written
    (sha256).

    Raises:
        OSError: it could not be written or does not read back as written
            (a full disk, a file size limit); one line.
    """
    # pylint: disable=import-outside-toplevel
    from ..core.optim.optstate import save_states
    from ..core.base.parts import PartError, npz_digests, npz_index
    digests = {}
    try:
        written = save_states(path, states, digests=digests)
    except (OSError, zipfile.LargeZipFile) as err:
        raise OSError('%s: cannot write the optimizer state (%s; a full disk or a file size '
                      'limit?)' % (path, ' '.join(str(err).split())[:200])) from None
    try:
        same = npz_index(path) == written and npz_digests(path) == digests
    except PartError as err:
        raise OSError('%s: expected the optimizer state just written to read back, found '
                      '%s' % (path, err)) from None
    if not same:
        raise OSError('%s: expected the optimizer state just written to read back, found '
                      'other arrays or bytes' % path)


def read_checkpoint(folder):
    """The committed checkpoint of a training folder, verified file by file.

    The checkpoint holds its snapshot against removal until it is closed
    (``with read_checkpoint(folder) as checkpoint:``): a run still training in
    ``folder`` keeps committing, and the snapshot read stays whole.

    Raises:
        CheckpointError: nothing committed there, or a file does not match
            what the commit recorded (``StoreError`` is a ``ValueError`` too).
    """
    from .store import Store  # pylint: disable=import-outside-toplevel
    snapshot = Store(folder).current(hold=True)
    if snapshot is None:
        try:  # what a store writes first, a run killed before its first commit left
            entries = len(set(os.listdir(folder)) - {'.lock', '.kind'})
        except OSError:
            entries = 0  # nothing there (or not a folder): a run may be trained into it
        if entries:  # a folder of other files: training into it would be refused too
            raise CheckpointError('expected a training run in %s (its current/ snapshot), found '
                                  'a folder of %d entr%s without it'
                                  % (folder, entries, 'y' if entries == 1 else 'ies'))
        raise CheckpointError('expected a training run in %s (its current/ snapshot), found '
                              'none; train one first, e.g. python -m mp_symbolic train --out %s'
                              % (folder, folder))
    try:
        return Checkpoint(snapshot)
    except BaseException:
        snapshot.close()
        raise


def write_pair(checkpoint, out, log=print):
    """Commits a checkpoint of parts (committed by node processes) to the
    training folder ``out`` as MXNet's own pair, which
    ``mx.model.load_checkpoint(out + '/current/<name>', epoch)`` reads: the
    symbol, one ``.params`` file of every part's arrays and one ``.states``
    file of every part's optimizer state, with the summary. Each array is
    read from its part and written in its turn, one at a time (the params
    in MXNet's own format, byte for byte what ``mx.nd.save`` writes).

    Args:
        checkpoint: A :class:`Checkpoint` of parts.
        out: A new (or empty) folder, or a training folder; one writer at
            a time.

    Returns:
        The committed :class:`Checkpoint` in ``out``.

    Raises:
        CheckpointError: ``checkpoint`` is MXNet's pair already, or its
            parts do not fit its symbol.
        OSError: a file could not be written; ``out`` keeps what it held.
        StoreError: ``out`` is in use or holds something else.
    """
    # pylint: disable=import-outside-toplevel
    from ..core.optim.optstate import FORMAT, merge_states, _spec_arrays
    from ..core.base.parts import NpzReader, mxnet_params_index, npz_index, write_mxnet_params, write_npz
    from .store import Store
    if not checkpoint.part_paths:
        raise CheckpointError('expected a checkpoint of one part per node, found MXNet\'s pair '
                              'already in %s (mx.model.load_checkpoint reads it as it is)'
                              % checkpoint.folder)
    checkpoint.load(names=())  # the parts fit the symbol: checked before anything is written
    name, epoch = checkpoint.meta.get('task'), checkpoint.epoch
    name = name if isinstance(name, str) and name and '/' not in name else 'model'
    files = {'symbol': '%s-symbol.json' % name, 'params': '%s-%04d.params' % (name, epoch),
             'states': '%s-%04d.states' % (name, epoch)}
    index = checkpoint.index()
    readers = {path: NpzReader(path) for path in checkpoint.part_paths}
    parts = []
    for path, reader in readers.items():
        meta = json.loads(str(reader.read(STATES_MEMBER)))
        count = sum(1 for k in npz_index(path) if k.startswith('state:'))
        if meta.get('format') != FORMAT or not isinstance(meta.get('params'), dict):
            raise CheckpointError('%s: expected optimizer states of format %s' % (path, FORMAT))
        for param, entry in meta['params'].items():
            _spec_arrays(entry.get('state') if isinstance(entry, dict) else None, count,
                         param, 0)
        parts.append(dict(meta, arrays=[
            (lambda r=reader, i=i: r.read('state:%d' % i)) for i in range(count)]))
    states = merge_states(parts)

    def write(folder):
        with open(checkpoint.symbol_path, 'rb') as f:
            symbol = kernels.load_symbol_json(f.read().decode('utf-8'), checkpoint.symbol_path)
        save_symbol(os.path.join(folder, files['symbol']), symbol)
        path = os.path.join(folder, files['params'])
        written = write_mxnet_params(path, [
            (key, lambda k=key: readers[index[k][2]].read(k)) for key in index])
        if mxnet_params_index(path) != written:
            raise OSError('%s: expected the %d arrays just written to read back, found others'
                          % (path, len(written)))
        path = os.path.join(folder, files['states'])
        meta = {k: v for k, v in states.items() if k != 'arrays'}
        write_npz(path, [('meta', np.array(json.dumps(meta)))] +
                  [('a%d' % i, a) for i, a in enumerate(states['arrays'])])
        if len(npz_index(path)) != len(states['arrays']) + 1:
            raise OSError('%s: expected the optimizer state just written to read back' % path)
        summary = dict(checkpoint.summary, files=files)
        summary_path = os.path.join(folder, SUMMARY_NAME)
        with open(summary_path, 'w') as f:
            json.dump(summary, f, indent=2, sort_keys=True)
            f.write('\n')
        _check_json_written(summary_path, summary)

    meta = {k: v for k, v in checkpoint.meta.items() if k != 'layout'}
    meta['files'] = files
    store = Store(out, kind='training')
    try:
        with store.locked():
            committed = Checkpoint(store.commit(write, meta))
    finally:
        for reader in readers.values():
            reader.close()
    log('%s: %s, %s and %s from %d parts (mx.model.load_checkpoint(%r, %d))'
        % (os.path.join(out, 'current'), files['symbol'], files['params'], files['states'],
           len(checkpoint.part_paths), os.path.join(out, 'current', name), epoch))
    return committed


# -- a Pipeline's Module, saved and restored from Python ---------------------

def save_checkpoint(module, folder, epoch, name='model', summary=None):
    """Commits a Pipeline's Module to ``folder`` as one unit: the graph (with
    its ``ctx_group`` s and per-sample input shape), parameters, optimizer
    state by parameter name, and the plan, through the crash-safe store
    (``folder/current`` names the last whole checkpoint).

    ``mx.model.load_checkpoint(folder + '/current/' + name, epoch)`` reads
    it back as MXNet's own pair (over nodes, the checkpoint is one part per
    node: ``python -m mp_symbolic pair`` writes the pair, :func:`write_pair`);
    :func:`read_checkpoint` and ``PipelineModule.restore`` continue it on any
    plan, in another process.

    Args:
        module: A bound, initialised :class:`~mp_symbolic.PipelineModule`
            (``fit`` leaves it so).
        folder: The output folder; one writer at a time.
        epoch: Epochs trained (names the params file).
        name: File prefix.
        summary: More JSON-able facts to record in ``summary.json``.

    Over nodes (``Pipeline(..., nodes=N)``) every node calls it with the
    same ``folder``, which they share; each writes its stages' part, one
    array at a time from its devices, and node 0 commits the parts together
    (see :func:`commit_checkpoint`).

    Returns:
        The committed :class:`Checkpoint` (``None`` on a node but node 0).

    Raises:
        ValueError: the module is not bound and initialised, or ``epoch`` is
            not a non-negative integer; ``FolderInUse`` (a ValueError too):
            another process writes to ``folder``.
    """
    # pylint: disable=import-outside-toplevel
    from ..core.placement.devices import format_device
    from ..core.engine.module import PipelineModule, with_input_shape
    from .store import Store, abandon_across
    if not isinstance(module, PipelineModule):
        raise ValueError('module: expected a PipelineModule (pipe.module(...)), found %s'
                         % type(module).__name__)
    if not (module.binded and module.params_initialized):
        raise ValueError('module: expected it bound with parameters (after fit, or bind and '
                         'init_params), found it %s' % ('unbound' if not module.binded
                                                        else 'without parameters'))
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError('epoch: expected a non-negative integer, found %r' % (epoch,))
    pipe = module.pipeline
    symbol = with_input_shape(module.export_graph, module.recorded_shapes(), None,
                              module.recorded_layouts())
    arg_params, aux_params, states = module_arrays(module)
    devices = [format_device(d) for d in pipe.plan.all_devices]
    facts = {'devices': devices,  # what the exporter records as the training devices
             'plan': {'devices': devices, 'balance': list(pipe.balance), 'chunks': pipe.chunks,
                      'replicas': pipe.replicas, 'stages': pipe.stage_names},
             'parameters': list(arg_params) + list(aux_params)}
    facts.update(summary or {})
    if pipe.nodes is not None:  # every node calls this: node 0 commits every node's part
        from ..core.transport.comm import control  # pylint: disable=import-outside-toplevel
        group = control(pipe.nodes, node_of_stage=pipe.plan.node_of_stage)
        facts['parameters'] = [n for names in group.gather(facts['parameters']) for n in names]
        if group.rank != 0:
            return commit_checkpoint(None, name, epoch, symbol, arg_params, aux_params, states,
                                     facts, complete=True, group=group)
    else:
        group = None
    store = Store(folder, kind='training')
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(store.locked())
        except ValueError as err:  # the folder cannot be locked: the other nodes wait for it
            if group is not None:
                abandon_across(group, 'node 0 could not commit the checkpoint: %s' % err)
            raise
        return commit_checkpoint(store, name, epoch, symbol, arg_params, aux_params, states,
                                 facts, complete=True, group=group)


def module_arrays(module):
    """What a checkpoint of ``module`` (a bound, initialised
    :class:`~mp_symbolic.PipelineModule`) holds, made as late as it can be:
    ``(arg_params, aux_params, states)`` as :func:`commit_checkpoint` takes
    them. Over nodes, and in one process where the devices hold each
    parameter once (one replica, unsplit, no host copy), each parameter and
    each optimizer state is a function making that one array on the host
    when its turn to be written comes; otherwise the parameters are
    ``get_params``' (the replicas averaged, shards joined) and the states
    are made one at a time all the same. The optimizer state is
    :data:`EMPTY_STATES` before ``init_optimizer``."""
    if module.pipeline.nodes is not None:  # each array made from its device when written
        arg_params, aux_params = module.lazy_params()
    elif _one_copy(module):  # each array read from its device when its turn comes
        arg_params, aux_params = _device_params(module)
    else:
        arg_params, aux_params = module.get_params()
    states = module.optimizer_states(lazy=True) if module.optimizer_initialized \
        else EMPTY_STATES
    return arg_params, aux_params, states


def _one_copy(module):
    """Whether ``module``'s devices hold each parameter once, as ``get_params``
    returns it: one replica, dense, unsplit, no host copy kept."""
    # pylint: disable=protected-access
    return len(module._context) == 1 and not module.host_copy and \
        module._kept[0] is None and not module.pipeline.sharded and \
        all(a[0].stype == 'default' for a in module._exec_group.param_arrays)


def _device_params(module):
    """``get_params``' names, each value a function of no arguments that
    copies that one array from its device to the host (numpy), the bits
    ``get_params`` copies (for a module where :func:`_one_copy` holds)."""
    # pylint: disable=protected-access
    from ..core.engine.device_module import aux_written  # pylint: disable=import-outside-toplevel
    group = module._exec_group
    aux_written(group)  # the running statistics' last update done before they are read

    def host(block):
        return block[0].asnumpy

    return (OrderedDict((n, host(b)) for n, b in zip(module._param_names, group.param_arrays)),
            OrderedDict((n, host(b)) for n, b in zip(module._aux_names, group.aux_arrays)))


# The optimizer state of a module saved before its optimizer existed.
EMPTY_STATES = {'format': 'mp_symbolic.optimizer_states/1', 'optimizer': None, 'num_update': 0,
                'params': {}, 'arrays': []}
