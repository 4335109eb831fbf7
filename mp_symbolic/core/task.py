"""``Task``: a workload the command line trains, written by its user. A task
file defines ``task(**kwargs)`` returning a :class:`Task`; ``python -m
mp_symbolic train --task FILE.py --task-arg KEY=VALUE`` calls it with the
``--task-arg`` values (docs/tasks.md, docs/your-own-model.md)."""
from collections import namedtuple
from dataclasses import dataclass, field
import re

import mxnet as mx
import numpy as np

from .base.checks import LR_EXPECTED, MOMENTUM_EXPECTED, POSITIVE_EXPECTED, is_lr, is_momentum, \
    is_positive_int, raised
from .graph.heads import LOSSES, class_axis, head_of, read_head
from .graph.names import LABEL_NAME

__all__ = []

# What a task's data becomes: numpy arrays, examples first, float32; ``X`` and
# ``X_val`` are tuples of arrays (one per input) for a network of several inputs.
Data = namedtuple('Data', 'X y X_val y_val')


# What a task's data may hold by default (Task.max_data_bytes), train and val
# each: its examples and labels as float32 (a DataIter that never ends is
# refused there, not by the kernel).
MAX_DATA_BYTES = 4 << 30


def as_inputs(X):
    """``X`` as a tuple of arrays, one per input of the network."""
    return tuple(X) if isinstance(X, tuple) else (X,)


def num_examples(X):
    """How many examples ``X`` (one array, or a tuple of them) holds."""
    return len(as_inputs(X)[0])

_NAME_RE = re.compile(r'^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$')


class TaskError(ValueError):
    """A task that cannot be trained: a field of the wrong kind, or data that
    does not fit the network."""


@dataclass(frozen=True)
class Report:
    """How the trained network did (what :attr:`Task.evaluate` returns).

    Attributes:
        metrics: JSON-ready figures, recorded in ``summary.json``.
        lines: Printed after training.
        score: Lower is better; training that does not lower it fails.
        short: A few characters for tables (``'acc 97.49%'``).
        score_name: What ``score`` is, for messages.
    """
    metrics: dict
    lines: list
    score: float
    short: str
    score_name: str = 'score'


@dataclass(frozen=True)
class Task:
    """A workload: a network of Gluon blocks, its data, loss and defaults.

    Args:
        name: Names the checkpoint files and the default output folder;
            letters, digits, ``.``, ``_``, ``-``.
        blocks: A list of Gluon ``HybridBlock`` s, a ``HybridSequential``, or a
            callable returning either; give blocks a ``prefix=`` for stable
            parameter names.
        train: ``(X, y)`` numpy arrays (examples first) or an ``mx.io.DataIter``
            with a label, read once into memory. For several inputs, ``X`` is a
            tuple of arrays, one per positional input (``data0``, ``data1``,
            ...), or the DataIter has one data array per input. Or a bucketed
            DataIter (:func:`is_bucketed`), never read into arrays: each epoch
            is trained as it makes its batches (``set_epoch(epoch)`` where it
            has one, then ``reset()``), its batch size the run's.
        loss: ``'l2'``, ``'softmax'``, ``'logistic'`` or a callable
            ``(prediction, label) -> Symbol``. ``'softmax'`` takes its classes
            on the axis the labels leave: the last for ``(N, C)`` or ``(N, T,
            V)`` outputs, axis 1 for ``(N, C, H, W)`` with ``(N, H, W)``.
        val: Held-out data like ``train`` (bucketed where ``train`` is), or
            ``None``: the metric is then computed on ``train``.
        metric: An MXNet metric name or an ``mx.metric.EvalMetric``; ``None``:
            the loss head's default (``'mse'``, ``'acc'`` on the class axis,
            accuracy at 0.5 for ``'logistic'``; ``'mse'`` for ``MakeLoss``).
        batch_size, num_epochs, optimizer, lr, momentum: Defaults of the
            ``--batch-size``, ``--epochs``, ``--optimizer`` (``'sgd'`` or
            ``'adam'``), ``--lr`` and ``--momentum`` flags.
        input_shape: Shape of one example (a tuple of shapes for several
            inputs); ``None``: read off the data.
        label_name: The label variable's name; ``None``: ``'softmax_label'``.
        description: One line saying what the task is.
        evaluate: ``None`` (the metric on ``val``) or a callable
            ``evaluate(params, predict, data) -> Report`` (``params``: name ->
            numpy; ``predict(X)``: the output in its head's inference form;
            ``data``: a :data:`Data`).
        out_dir: Default output folder, a format string over ``{name}`` and
            ``{variant}``; ``None``: ``artifacts/{name}`` for the symbolic
            variant, ``artifacts/{name}-{variant}`` for others.
        max_data_bytes: The most ``train`` and ``val`` may each hold as
            float32; a DataIter is read no further.
        lr_schedule: ``None`` (the learning rate stays the run's ``lr``) or
            a callable ``lr_schedule(lr, steps)`` returning the
            ``mx.lr_scheduler.LRScheduler`` of a run of ``steps`` updates
            from the run's ``lr`` (``steps``: its epochs times the batches of
            one); not with a bucketed DataIter (its batches are not counted
            before they come).

    Raises:
        TaskError: a field of the wrong kind or out of range; with a bucketed
            ``train``, a ``val`` that is not one, an ``evaluate``, an
            ``input_shape`` or an ``lr_schedule``.
    """
    name: str
    blocks: object
    train: object
    loss: object = 'softmax'
    val: object = None
    metric: object = None
    batch_size: int = 64
    num_epochs: int = 10
    optimizer: str = 'sgd'
    lr: float = 0.1
    momentum: float = 0.0
    input_shape: tuple = None
    label_name: str = None
    description: str = ''
    evaluate: object = None
    out_dir: str = None
    max_data_bytes: int = MAX_DATA_BYTES
    lr_schedule: object = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        def bad(name, expected):
            raise TaskError('%s: expected %s, found %s' % (name, expected,
                                                          _describe(getattr(self, name))))

        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            bad('name', 'a file-name prefix of letters, digits, ., _ or - (up to 64)')
        if not (callable(self.loss) or self.loss in LOSSES):
            bad('loss', '%s or a callable (prediction, label) -> Symbol'
                % ', '.join(repr(l) for l in LOSSES))
        for name in ('batch_size', 'num_epochs', 'max_data_bytes'):
            value = getattr(self, name)
            if not is_positive_int(value):
                bad(name, POSITIVE_EXPECTED)
        if self.optimizer not in ('sgd', 'adam'):
            bad('optimizer', "'sgd' or 'adam'")
        if not is_lr(self.lr):
            bad('lr', LR_EXPECTED)
        if not is_momentum(self.momentum):
            bad('momentum', MOMENTUM_EXPECTED)
        if self.optimizer != 'sgd' and self.momentum:
            bad('momentum', "0 with optimizer %r (momentum is an SGD setting)" % self.optimizer)
        if self.input_shape is not None:
            several = isinstance(self.input_shape, (tuple, list)) and bool(self.input_shape) \
                and all(isinstance(d, (tuple, list)) for d in self.input_shape)
            shapes = [_positive_shape(d) for d in
                      (self.input_shape if several else [self.input_shape])]
            if not all(shapes):
                bad('input_shape', 'the shape of one example, positive integers (a tuple of '
                    'shapes for several inputs)')
            object.__setattr__(self, 'input_shape', tuple(shapes) if several else shapes[0])
        if self.label_name is not None and not isinstance(self.label_name, str):
            bad('label_name', 'a string')
        if self.evaluate is not None and not callable(self.evaluate):
            bad('evaluate', 'None or a callable (params, predict, data) -> Report')
        if self.lr_schedule is not None and not callable(self.lr_schedule):
            bad('lr_schedule', 'None or a callable (lr, steps) -> mx.lr_scheduler.LRScheduler')
        if self.out_dir is not None and not isinstance(self.out_dir, str):
            bad('out_dir', 'None or a folder path')
        if not isinstance(self.description, str):
            bad('description', 'a string')
        if self.metric is not None and not isinstance(self.metric, (str, mx.metric.EvalMetric)):
            bad('metric', 'an MXNet metric name or an mx.metric.EvalMetric')
        if self.bucketed:
            if self.val is not None and not is_bucketed(self.val):
                bad('val', 'a bucketed DataIter like train (one with default_bucket_key) or None')
            if self.evaluate is not None:
                bad('evaluate', 'None with a bucketed DataIter (the metric is read batch by batch; '
                    'evaluate takes arrays)')
            if self.input_shape is not None:
                bad('input_shape', "None with a bucketed DataIter (its provide_data gives the "
                    "default bucket's shapes)")
            if self.lr_schedule is not None:
                bad('lr_schedule', 'None with a bucketed DataIter (its batches are not counted '
                    'before they come)')

    # -- what the training loop reads --------------------------------------

    def make_blocks(self):
        """The network's blocks (calling ``blocks`` once if it is a function); raises
        TaskError where it gives no HybridBlock or raises."""
        if 'blocks' not in self._cache:
            blocks = self.blocks
            if callable(blocks) and not isinstance(blocks, mx.gluon.Block):
                try:
                    blocks = blocks()
                except Exception as err:  # pylint: disable=broad-except
                    # the user's function: whatever it raises is a fault of the task
                    raise TaskError('blocks: expected blocks() to return the network, found '
                                    'it raised %s' % raised(err)) from None
            if isinstance(blocks, mx.gluon.Block):
                if not isinstance(blocks, mx.gluon.HybridBlock):
                    raise TaskError('blocks: expected Gluon HybridBlocks, found %s'
                                    % type(blocks).__name__)
            else:
                try:
                    blocks = list(blocks)
                except TypeError:
                    raise TaskError('blocks: expected a list of Gluon HybridBlocks, a '
                                    'HybridSequential or a function returning one, found %s'
                                    % _describe(blocks)) from None
                if not blocks or not all(isinstance(b, mx.gluon.HybridBlock) for b in blocks):
                    raise TaskError('blocks: expected a non-empty list of Gluon HybridBlocks, '
                                    'found %s' % _describe(blocks))
            self._cache['blocks'] = blocks
        return self._cache['blocks']

    @property
    def bucketed(self):
        """Whether ``train`` is a bucketed DataIter (:func:`is_bucketed`)."""
        return is_bucketed(self.train)

    def batch_iters(self):
        """``(train, val)``: the bucketed DataIters (``val`` is ``train`` without
        one)."""
        return self.train, (self.train if self.val is None else self.val)

    def batch_labels(self):
        """``[('train', labels), ('val', labels)]`` of a bucketed DataIter, each read
        once, its labels flattened without padding.

        Raises:
            TaskError: a DataIter that raises, has no batch, a batch without a
                label, or more than ``max_data_bytes`` in one epoch.
        """
        if 'labels' not in self._cache:
            found = []
            for name, data in zip(('train', 'val'), self.batch_iters()):
                if name == 'val' and self.val is None:
                    found.append((name, found[0][1]))
                    continue
                try:
                    found.append((name, _iter_labels(data, name, self.max_data_bytes)))
                except TaskError:
                    raise
                except Exception as err:  # pylint: disable=broad-except
                    # the user's iterator: whatever it raises is a fault of the task
                    raise TaskError('%s: expected a DataIter that can be read, found %s raising '
                                    '%s: %s' % (name, type(data).__name__, type(err).__name__,
                                                _one_line(err))) from None
            self._cache['labels'] = found
        return self._cache['labels']

    def data(self):
        """The data as numpy arrays, a :data:`Data` (validation arrays the training
        ones without ``val``).

        Raises:
            TaskError: data that is not ``(X, y)`` arrays or a DataIter, whose
                examples and labels do not pair up, or a bucketed DataIter.
        """
        if self.bucketed:
            raise TaskError('train: expected arrays or a DataIter of one shape here, found a '
                            'bucketed DataIter (its batches are read one at a time)')
        if 'data' not in self._cache:
            X, y = _arrays(self.train, 'train', self.max_data_bytes)
            if self.val is None:
                X_val, y_val = X, y
            else:
                X_val, y_val = _arrays(self.val, 'val', self.max_data_bytes)
                if _shapes(X_val) != _shapes(X):
                    raise TaskError('val: expected examples of shape %s like train, found %s'
                                    % (_shape_text(X), _shape_text(X_val)))
            if self.input_shape is not None and \
                    _shapes(X) != _shapes(self.input_shape, examples=False):
                raise TaskError('train: expected examples of input_shape %s, found %s'
                                % (_shape_text(self.input_shape, examples=False),
                                   _shape_text(X)))
            self._cache['data'] = Data(X, y, X_val, y_val)
        return self._cache['data']

    @property
    def sample_shapes(self):
        """Shape of one example of each input, a tuple of shapes."""
        if self.input_shape is not None:
            return _shapes(self.input_shape, examples=False)
        if self.bucketed:  # the default bucket's
            return tuple(tuple(d[1][1:]) for d in _descs(self.train.provide_data))
        return _shapes(self.data().X)

    @property
    def sample_shape(self):
        """Shape of one example (the first input's, for several inputs)."""
        return self.sample_shapes[0]

    def data_shapes(self, batch_size, names):
        """``[(name, (batch_size,) + example shape)]``, one per input, named ``names``."""
        shapes = self.sample_shapes
        if len(names) != len(shapes):
            raise TaskError('train: expected %d input array(s), one per input of the network '
                            '(%s), found %d' % (len(names), ', '.join(names), len(shapes)))
        return [(n, (batch_size,) + tuple(s)) for n, s in zip(names, shapes)]

    @property
    def label_shape(self):
        """Shape of one example's label (a bucketed DataIter's: its default bucket's)."""
        if self.bucketed:
            return tuple(_descs(self.train.provide_label)[0][1][1:])
        return self.data().y.shape[1:]

    @property
    def label(self):
        """The label variable's name."""
        return self.label_name or LABEL_NAME

    # -- the loss head, fitted to the network's output ---------------------

    def fit_head(self, output_shape, training_symbol):
        """Fits the loss head to the network and remembers it (``'softmax'`` on the
        class axis its labels leave in outputs of ``output_shape``, ``None`` for
        the last; a callable's head read off its graph); returns the training
        graph ``training_symbol(loss)`` of the fitted head."""
        loss = self.loss
        head = head_of(loss)
        if head is not None and head.classes and output_shape is not None:
            axis = class_axis(output_shape, (output_shape[0],) + tuple(self.label_shape))
            loss = head.on_axis(-1 if axis is None else axis)  # None: the graph refuses them
        symbol = training_symbol(loss)
        self._cache['head'] = (loss, head_of(loss) or read_head(symbol))
        return symbol

    @property
    def graph_loss(self):
        """The loss as the graph, the Module and the twin take it: the fitted head's
        record, else ``loss`` as given."""
        return self._cache['head'][0] if 'head' in self._cache else self.loss

    @property
    def head(self):
        """The :class:`~mp_symbolic.core.graph.heads.Head` whose loss is printed, or
        ``None`` for a callable head of no known op."""
        return self._cache['head'][1] if 'head' in self._cache else head_of(self.loss)

    @property
    def loss_label(self):
        """What the per-epoch line calls the batch loss."""
        return self.head.label if self.head is not None else 'loss'

    def default_out_dir(self, variant):
        if self.out_dir is not None:
            return self.out_dir.format(name=self.name, variant=variant)
        return 'artifacts/%s' % self.name + ('' if variant == 'symbolic' else '-' + variant)

    def batch_loss(self, output, label):
        """The batch's mean loss from the head's output, on its device."""
        if self.head is not None:
            return self.head.mean_loss(output, label)
        return mx.nd.mean(output)  # MakeLoss outputs the loss itself

    def report(self, params, predict):
        """How the network with ``params`` (name -> numpy) does, through
        ``predict(X)`` (numpy outputs in inference form; ``predict(batch)`` for a
        bucketed DataIter). See ``evaluate``."""
        if self.bucketed:
            return self._batch_report(predict)
        data = self.data()
        if self.evaluate is not None:
            report = self.evaluate(params, predict, data)
            if not isinstance(report, Report):
                raise TaskError('evaluate: expected it to return an mp_symbolic.Report, found %s'
                                % _describe(report))
            return report
        out = predict(data.X_val)
        where = 'validation' if self.val is not None else 'training'
        metric = _make_metric(self.metric, self.head)
        metric.reset()
        metric.update([mx.nd.array(data.y_val)], [mx.nd.array(out)])
        name, value = metric.get()
        loss = float(self.batch_loss(mx.nd.array(out), mx.nd.array(data.y_val)).asscalar())
        lines = ['%s %s: %.4f (%d examples)' % (where, name, value, len(data.y_val)),
                 '%s %s: %.4e' % (where, self.loss_label.replace('batch ', ''), loss)]
        return Report(metrics={'%s_%s' % (where, name.replace(' ', '_')): float(value),
                               '%s_loss' % where: loss},
                      lines=lines, score=loss, short='%s %.4g' % (name, value),
                      score_name='%s loss' % where)


    def _batch_report(self, predict):
        """The metric and the mean batch loss over the bucketed ``val`` (``train``
        without one), padding cut."""
        where = 'validation' if self.val is not None else 'training'
        metric = _make_metric(self.metric, self.head)
        metric.reset()
        total, count = 0.0, 0
        data = self.batch_iters()[1]
        data.reset()
        for batch in data:
            keep = batch.data[0].shape[0] - (batch.pad or 0)
            out = mx.nd.array(predict(batch)[:keep])
            label = mx.nd.array(_numpy(batch.label[0])[:keep])
            metric.update([label], [out])
            total += float(self.batch_loss(out, label).asscalar()) * keep
            count += keep
        data.reset()
        if not count:
            raise TaskError('%s: expected a DataIter with at least one batch, found none'
                            % ('val' if self.val is not None else 'train'))
        name, value = metric.get()
        loss = total / count
        lines = ['%s %s: %.4f (%d examples)' % (where, name, value, count),
                 '%s %s: %.4e' % (where, self.loss_label.replace('batch ', ''), loss)]
        return Report(metrics={'%s_%s' % (where, name.replace(' ', '_')): float(value),
                               '%s_loss' % where: loss},
                      lines=lines, score=loss, short='%s %.4g' % (name, value),
                      score_name='%s loss' % where)


def is_bucketed(data):
    """Whether ``data`` is a bucketed ``mx.io.DataIter``: one with a
    ``default_bucket_key``, as ``mx.mod.BucketingModule.fit`` reads it."""
    return isinstance(data, mx.io.DataIter) and \
        getattr(data, 'default_bucket_key', None) is not None


def _descs(provided):
    """``[(name, shape)]`` of a ``provide_data`` / ``provide_label`` list."""
    return [(d.name, tuple(d.shape)) if hasattr(d, 'name') else (d[0], tuple(d[1]))
            for d in provided]


def _make_metric(metric, head):
    """``metric`` (``None``: the head's default) as an ``mx.metric.EvalMetric``
    on the head's class axis."""
    if metric is None:
        metric = head.metric if head is not None else 'mse'
    if isinstance(metric, mx.metric.EvalMetric):
        return metric
    if metric in ('acc', 'accuracy') and head is not None and head.classes and \
            head.axis is not None:
        return mx.metric.Accuracy(axis=head.axis)  # (N, T, V): -1; (N, C, H, W): 1
    if metric == 'binary accuracy':
        return mx.metric.CustomMetric(
            lambda label, pred: float(np.mean((pred.reshape(label.shape) > 0.5) == label)),
            name='binary accuracy')
    try:
        return mx.metric.create(metric)
    except ValueError as err:
        raise TaskError('metric: expected an MXNet metric name (acc, mse, mae, rmse, f1, '
                        'top_k_accuracy, ...), found %r: %s' % (metric, err)) from None


def _arrays(data, name, limit):
    """``(X, y)`` float32 arrays from a pair or a DataIter (``X`` a tuple for
    several inputs), of at most ``limit`` bytes."""
    if isinstance(data, mx.io.DataIter):
        try:
            inputs, y = _read_iter(data, name, limit)
        except TaskError:
            raise
        except Exception as err:  # pylint: disable=broad-except
            # the user's iterator: whatever it raises is a fault of the task, told in one line
            raise TaskError('%s: expected a DataIter that can be read, found %s raising %s: %s'
                            % (name, type(data).__name__, type(err).__name__,
                               _one_line(err))) from None
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        X, y = data
        inputs = tuple(X) if _several(X, y) else (X,)  # one array per input
        if not inputs:
            raise TaskError('%s: expected (X, y) with X an array or a tuple of arrays (one per '
                            'input), found an empty tuple' % name)
    else:
        raise TaskError('%s: expected (X, y) arrays or an mx.io.DataIter, found %s'
                        % (name, _describe(data)))
    y = _numpy(y)
    inputs = [_numpy(x) for x in inputs]
    size = 4 * sum(a.size for a in inputs + [y])
    if size > limit:
        raise TaskError('%s: expected at most %s of examples and labels as float32 '
                        '(max_data_bytes), found %s' % (name, _bytes(limit), _bytes(size)))
    inputs = tuple(_checked(name, x, y, 'X' if len(inputs) == 1 else 'X[%d]' % i)
                   for i, x in enumerate(inputs))
    with np.errstate(over='ignore'):  # 1e39 becomes inf, refused below
        y = y.astype(np.float32)
    if not np.all(np.isfinite(y)):
        raise TaskError('%s: expected finite labels as float32 (within +-3.4e38), found NaN or '
                        'infinity' % name)
    return (inputs[0] if len(inputs) == 1 else inputs), y


def _several(X, y):
    """Whether ``X`` is several inputs: a tuple, or a list of arrays each holding
    one example per label."""
    if isinstance(X, tuple):
        return True
    if not isinstance(X, list) or not X:
        return False
    try:
        count = len(y)
    except TypeError:
        return False
    return all(isinstance(x, (np.ndarray, mx.nd.NDArray)) and x.ndim >= 2 and len(x) == count
               for x in X)


def _bytes(count):
    return '%.1f GiB' % (count / 2 ** 30) if count >= 2 ** 30 else '%d bytes' % count


def _numpy(array):
    return array.asnumpy() if isinstance(array, mx.nd.NDArray) else np.asarray(array)


def _checked(name, X, y, which):
    """The input ``X`` (called ``which``) as float32, checked with its labels ``y``."""
    # one of several inputs may hold one number per example (BERT's valid lengths)
    if X.ndim < (2 if which == 'X' else 1) or y.ndim < 1 or len(X) != len(y):
        raise TaskError('%s: expected %s of shape (examples, ...) and y with one label per '
                        'example, found %s %s and y %s' % (name, which, which, X.shape, y.shape))
    if not (np.issubdtype(X.dtype, np.number) and np.issubdtype(y.dtype, np.number)):
        raise TaskError('%s: expected numeric arrays, found %s and %s' % (name, X.dtype, y.dtype))
    if np.iscomplexobj(X) or np.iscomplexobj(y):
        # float32 would keep the real part only, without a word
        raise TaskError('%s: expected real numbers, found arrays of %s and %s'
                        % (name, X.dtype, y.dtype))
    if not len(X):
        raise TaskError('%s: expected at least one example, found none (%s %s)'
                        % (name, which, X.shape))
    with np.errstate(over='ignore'):  # 1e39 becomes inf, refused below
        X = X.astype(np.float32)
    if not np.all(np.isfinite(X)):
        raise TaskError('%s: expected finite values as float32 (within +-3.4e38), found NaN or '
                        'infinity in %s' % (name, which))
    return X


def _batches(data, name, limit):
    """``(batch, examples kept)`` of every batch of the DataIter ``data`` in one
    epoch, padding cut, ``data`` reset after. Raises TaskError for no batch, a
    batch without a label, or more than ``limit`` bytes."""
    count, size = 0, 0
    data.reset()
    for batch in data:
        if not batch.label:
            raise TaskError('%s: expected a DataIter with labels, found one without' % name)
        keep = batch.data[0].shape[0] - (batch.pad or 0)
        size += 4 * sum(int(np.prod(a.shape[1:])) * keep for a in
                        list(batch.data) + [batch.label[0]])
        if size > limit:
            raise TaskError('%s: expected a DataIter of at most %s of examples and labels as '
                            'float32 (max_data_bytes), found more after %d batches (one that '
                            'never ends?)' % (name, _bytes(limit), count + 1))
        count += 1
        yield batch, keep
    data.reset()
    if not count:
        raise TaskError('%s: expected a DataIter with at least one batch, found none' % name)


def _read_iter(data, name, limit):
    """Every batch of the DataIter ``data``, padding cut, as ``([X of each
    input], y)``. Raises as :func:`_batches`, or for batches of different
    input counts."""
    xs, ys = [], []
    for batch, keep in _batches(data, name, limit):
        if xs and len(batch.data) != len(xs[0]):
            raise TaskError('%s: expected every batch to have %d data arrays like the first, '
                            'found %d' % (name, len(xs[0]), len(batch.data)))
        xs.append([d.asnumpy()[:keep] for d in batch.data])
        ys.append(batch.label[0].asnumpy()[:keep])
    return [np.concatenate(part) for part in zip(*xs)], np.concatenate(ys)


def _iter_labels(data, name, limit):
    """The labels of every batch of the bucketed DataIter ``data``, flattened,
    padding cut."""
    return np.concatenate([_numpy(batch.label[0])[:keep].ravel()
                           for batch, keep in _batches(data, name, limit)])


def _one_line(err, limit=120):
    """An exception's message on one line, cut to ``limit`` characters."""
    text = ' '.join(str(err).split())
    return text if len(text) <= limit else text[:limit - 3] + '...'


def _positive_shape(shape):
    """``shape`` as a tuple of positive ints, or ``None``."""
    try:
        shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return None
    return shape if shape and min(shape) >= 1 else None


def _shapes(X, examples=True):
    """Shapes of one example of each input of ``X`` (with ``examples=False``,
    ``X`` is an ``input_shape``)."""
    if not examples:
        return tuple(X) if X and isinstance(X[0], tuple) else (tuple(X),)
    return tuple(x.shape[1:] for x in as_inputs(X))


def _shape_text(X, examples=True):
    shapes = _shapes(X, examples)
    return str(shapes[0]) if len(shapes) == 1 else ', '.join(str(s) for s in shapes)


def _describe(value):
    text = repr(value)
    return text if len(text) <= 60 else '%s %s...' % (type(value).__name__, text[:40])
