"""A character-level GPT on the Python standard library's own source
(``--task lm``): a corpus every machine with Python has, read from the running
interpreter's installation, nothing downloaded.

The corpus is every top-level ``*.py`` module of ``sysconfig``'s ``stdlib``
folder, sorted by name and joined; its first 90% trains, the last 10% is
held out (by position, so no file straddles both in a way that depends on a
seed). The model (:mod:`.gpt`) reads windows of ``block_size`` characters and
predicts each next character; it is judged by its validation loss in bits per
character beside an add-k character n-gram measured on the same held-out
positions (``k`` chosen on the end of the training part, not on validation).
"""
import functools
import glob
import math
import os
import sysconfig

import mxnet as mx
import numpy as np

import mp_symbolic
from mp_symbolic.core.base.checks import is_int, positive_int

from . import gpt

__all__ = []

VAL_FRACTION = 0.1
# The model's size, bounded: 4096 wide, one block holds 12 x 4096^2 = 2.0e8
# parameters (0.75 GiB of float32); past the bounds MXNet refuses an array of
# 2**31 elements (its int32 sizes) or a CPU run takes hours to build.
MAX_LAYERS = 128
MAX_HIDDENS = 4096
_K_GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
_EVAL_WINDOWS = 256    # windows per predict() call in evaluate
# The loss head: 'softmax''s probabilities and gradient, the gradient through
# oneDNN's log_softmax (MXNet's SoftmaxOutput runs a generic softmax in training)
LOSS = 'log_softmax'
# The training recipe's defaults (docs/lm.md, "The recipe"): each measured
# against the others at the same training-loop time.
BATCH_SIZE = 16
LR = 6e-3
WARMUP = 0.02
LR_END = 0.1


def corpus_files(stdlib=None):
    """The top-level ``*.py`` modules of the standard library, sorted by name.

    Raises:
        FileNotFoundError: the folder holds no ``.py`` file.
    """
    stdlib = stdlib or sysconfig.get_paths()['stdlib']
    files = sorted(glob.glob(os.path.join(stdlib, '*.py')))
    if not files:
        raise FileNotFoundError('expected the standard library\'s *.py modules in %s, found none'
                                % stdlib)
    return files


def load_corpus(stdlib=None):
    """The corpus text: every module of :func:`corpus_files`, in order (UTF-8;
    undecodable bytes become U+FFFD)."""
    parts = []
    for path in corpus_files(stdlib):
        with open(path, encoding='utf-8', errors='replace') as f:
            parts.append(f.read())
    return ''.join(parts)


def vocabulary(text):
    """Every character of ``text``, sorted: character ``vocab[i]`` has id ``i``."""
    return ''.join(sorted(set(text)))


def encode(text, vocab):
    """``text`` as an int64 array of ids in ``vocab``.

    Raises:
        ValueError: a character is not in ``vocab`` (names it).
    """
    index = {c: i for i, c in enumerate(vocab)}
    try:
        return np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))
    except KeyError as err:
        raise ValueError('text: expected characters of the vocabulary, found %r' % err.args[0]) \
            from None


def split(ids, val_fraction=VAL_FRACTION):
    """``(train, val)``: the first ``1 - val_fraction`` of ``ids`` and the rest."""
    cut = int(round(len(ids) * (1 - val_fraction)))
    return ids[:cut], ids[cut:]


def windows(ids, block_size, count):
    """``count`` windows spread evenly over ``ids``: ``X`` (count, block_size)
    and ``y`` (count, block_size), the next character of each, as float32;
    also the start of each window."""
    last = len(ids) - block_size - 1
    if last < 0 or count < 1:
        raise ValueError('expected at least %d characters for one window, found %d'
                         % (block_size + 1, len(ids)))
    starts = np.unique(np.linspace(0, last, count).astype(np.int64))
    index = starts[:, None] + np.arange(block_size)[None, :]
    return ids[index].astype(np.float32), ids[index + 1].astype(np.float32), starts


# -- the n-gram baseline ----------------------------------------------------

def _codes(ids, order, vocab_size):
    """Code of each n-gram ``ids[i - order + 1 .. i]`` for ``i >= order - 1``."""
    code = np.zeros(len(ids) - order + 1, dtype=np.int64)
    for j in range(order):
        code = code * vocab_size + ids[j:len(ids) - order + 1 + j]
    return code


class NGram:
    """An add-k character n-gram: ``P(c | h) = (n(h c) + k) / (n(h) + k V)``.

    Args:
        ids: Training ids.
        order: n (3: a trigram, two characters of context).
        vocab_size: V.
    """

    def __init__(self, ids, order, vocab_size):
        if order < 1 or vocab_size ** order >= 2 ** 62:
            raise ValueError('order: expected 1 to %d for %d characters, found %d'
                             % (int(62 / math.log2(vocab_size)), vocab_size, order))
        self.order, self.vocab_size = order, vocab_size
        self.grams, self.gram_counts = np.unique(_codes(ids, order, vocab_size),
                                                 return_counts=True)
        # a context's count: the n-grams that continue it (so the n-1 first
        # characters of the text's last n-gram are counted like every other)
        contexts = self.grams // vocab_size
        self.contexts, starts = np.unique(contexts, return_index=True)
        self.context_counts = np.add.reduceat(self.gram_counts, starts)

    @staticmethod
    def _lookup(keys, counts, codes):
        at = np.minimum(np.searchsorted(keys, codes), len(keys) - 1)
        return np.where(keys[at] == codes, counts[at], 0)

    def bits(self, ids, positions, k):
        """Mean -log2 P of ``ids[p]`` given the ``order - 1`` characters
        before it, over ``positions`` (each at least ``order - 1``)."""
        positions = np.asarray(positions)
        code = np.zeros(len(positions), dtype=np.int64)
        for j in range(self.order - 1, -1, -1):
            code = code * self.vocab_size + ids[positions - j]
        gram = self._lookup(self.grams, self.gram_counts, code)
        context = self._lookup(self.contexts, self.context_counts, code // self.vocab_size)
        p = (gram + k) / (context + k * self.vocab_size)
        return float(-np.mean(np.log2(p)))


def ngram_baseline(train_ids, val_ids, positions, order, vocab_size, dev_fraction=0.05):
    """Bits per character of an add-k n-gram on ``val_ids[positions]``.

    ``k`` is chosen from a grid on the last ``dev_fraction`` of the training
    ids with counts from the rest; the n-gram then counts all of them.

    Returns:
        ``(bits, k)``.
    """
    cut = int(len(train_ids) * (1 - dev_fraction))
    dev_model = NGram(train_ids[:cut], order, vocab_size)
    dev = train_ids[cut - order + 1:]
    dev_positions = np.arange(order - 1, len(dev))
    k = min(_K_GRID, key=lambda k: dev_model.bits(dev, dev_positions, k))
    # the val text's first characters take their context from the end of train
    joined = np.concatenate([train_ids[-(order - 1):] if order > 1 else train_ids[:0], val_ids])
    bits = NGram(train_ids, order, vocab_size).bits(joined, np.asarray(positions) + order - 1, k)
    return bits, k


# -- the model's layers ------------------------------------------------------

def sharded_layers(shards):
    """The model's layers split over ``shards`` devices of a stage
    (Megatron-LM's transformer): query, key and value column-parallel (each
    shard computes whole heads), the attention on each shard's heads, the
    output projection row-parallel; the MLP column- then row-parallel with the
    GELU on each shard's units; the token embedding vocabulary-parallel and the
    output layer on its shards. With ``shards=1``: Gluon's own layers."""
    if shards == 1:
        return gpt.Layers()

    def dense(units, in_units, prefix, kind):
        cls = mp_symbolic.ColumnParallelDense if kind == 'column' \
            else mp_symbolic.RowParallelDense
        return cls(units, in_units, shards, flatten=False, prefix=prefix,
                   weight_initializer=gpt.INIT)

    def embedding(input_dim, output_dim, prefix):
        return mp_symbolic.VocabParallelEmbedding(input_dim, output_dim, shards, prefix=prefix,
                                                  weight_initializer=gpt.INIT)

    def per_shard(fn, units, prefix):
        return mp_symbolic.PerShard(fn, units, shards, prefix=prefix)

    def output(embed, vocab_size, in_units, prefix):
        # the embedding's shards as a column layer's: vocabulary split as the table is
        return mp_symbolic.ColumnParallelDense(vocab_size, in_units, shards, use_bias=False,
                                               flatten=False, prefix=prefix,
                                               params=embed.params)

    return gpt.Layers(dense=dense, embedding=embedding, per_shard=per_shard, output=output)


# -- the task ----------------------------------------------------------------

def bits_per_char(predict, X, y):
    """Mean -log2 of the probability ``predict`` gives each next character.

    Args:
        predict: ``predict(X)`` -> probabilities ``(N, T, vocab)``.
        X, y: Windows and their next characters, ``(N, T)``.
    """
    total = 0.0
    for start in range(0, len(X), _EVAL_WINDOWS):
        probs = predict(X[start:start + _EVAL_WINDOWS])
        labels = y[start:start + _EVAL_WINDOWS].astype(np.int64)
        picked = np.take_along_axis(probs, labels[..., None], axis=-1)[..., 0]
        total += float(np.sum(-np.log2(np.maximum(picked, 1e-30))))
    return total / y.size


def make_evaluate(vocab, baseline, order, k):
    """``evaluate`` for the Task: validation bits per character beside the
    n-gram's on the same positions; the vocabulary goes into the metrics (and
    so into the checkpoint's summary), for sampling."""
    def evaluate(params, predict, data):
        del params
        bits = bits_per_char(predict, data.X_val, data.y_val)
        lines = ['validation: %.4f bits per character (%d characters in %d windows of the '
                 'held-out %d%%)' % (bits, data.y_val.size, len(data.y_val),
                                     round(100 * VAL_FRACTION)),
                 'baseline:   %.4f bits per character, add-k %d-gram (k=%g) on the same '
                 'characters' % (baseline, order, k)]
        return mp_symbolic.Report(
            metrics={'val_bits_per_char': bits, 'baseline_bits_per_char': baseline,
                     'baseline': 'add-k %d-gram, k=%g' % (order, k), 'vocabulary': vocab},
            lines=lines, score=bits, short='%.3f bits/char' % bits,
            score_name='validation bits per character')
    return evaluate


def lr_schedule(warmup, lr_end):
    """The task's ``lr_schedule``: over a run of ``steps`` updates from
    ``lr``, a linear rise from 0 over the first ``warmup`` of the steps, then
    half a cosine down to ``lr_end`` times ``lr`` at the last step (MXNet's
    ``CosineScheduler``); ``None`` (``lr`` throughout) for ``warmup=0`` and
    ``lr_end=1``.

    Raises:
        ValueError: ``warmup`` not in [0, 1) or ``lr_end`` not in [0, 1]
            (names the argument).
    """
    for name, value, most, closed in (('warmup', warmup, 1, False), ('lr_end', lr_end, 1, True)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not (0 <= value <= most if closed else 0 <= value < most):
            raise ValueError('%s: expected a number from 0 to 1%s, found %r'
                             % (name, '' if closed else ' (1 excluded)', value))
    if warmup == 0 and lr_end == 1:
        return None

    def schedule(lr, steps):
        return mx.lr_scheduler.CosineScheduler(steps, base_lr=lr, final_lr=lr * lr_end,
                                               warmup_steps=int(warmup * steps))
    return schedule


@functools.lru_cache(maxsize=4)
def prepare(block_size, train_chars, val_chars, ngram_order, stdlib=None):
    """The data of a task (cached: tests build several tasks in a process).

    Returns:
        ``(vocab, (X, y), (X_val, y_val), baseline bits, k)``.

    Raises:
        ValueError: a size that cannot work (names the argument).
    """
    for name, value in (('block_size', block_size), ('train_chars', train_chars),
                        ('val_chars', val_chars), ('ngram_order', ngram_order)):
        positive_int(name, value)
    text = load_corpus(stdlib)
    vocab = vocabulary(text)
    train_ids, val_ids = split(encode(text, vocab))
    for name, chars, ids in (('train_chars', train_chars, train_ids),
                             ('val_chars', val_chars, val_ids)):
        if not block_size <= chars <= len(ids) - 1:
            raise ValueError('%s: expected %d to %d (block_size to the part\'s length), found %d'
                             % (name, block_size, len(ids) - 1, chars))
    X, y, _ = windows(train_ids, block_size, train_chars // block_size)
    X_val, y_val, starts = windows(val_ids, block_size, val_chars // block_size)
    positions = (starts[:, None] + 1 + np.arange(block_size)[None, :]).ravel()
    baseline, k = ngram_baseline(train_ids, val_ids, positions, ngram_order, len(vocab))
    for array in (X, y, X_val, y_val):
        array.setflags(write=False)  # shared by every task made from the cache
    return vocab, (X, y), (X_val, y_val), baseline, k


def task(num_layers=2, num_heads=4, num_hiddens=64, block_size=64, train_chars=1 << 22,
         val_chars=1 << 17, ngram_order=4, whole=False, shards=1, warmup=WARMUP, lr_end=LR_END):
    """The character-level GPT on the standard library as a
    :class:`~mp_symbolic.Task`.

    Args:
        num_layers, num_heads, num_hiddens, block_size: The model's size
            (``block_size``: characters of context, the window length);
            ``num_layers`` at most :data:`MAX_LAYERS`, ``num_hiddens`` at
            most :data:`MAX_HIDDENS`.
        train_chars: Training characters per epoch: ``train_chars //
            block_size`` windows spread evenly over the training part.
        val_chars: Validation characters: windows spread evenly over the
            held-out part (the n-gram is measured on the same characters).
        ngram_order: The baseline's n.
        whole: Hand the Pipeline one network to cut by its graph instead of
            the list of blocks to split by blocks (the same parameters).
        shards: Tensor-parallel parts of each attention, MLP and the tied
            embedding/output (:func:`sharded_layers`): a stage of ``shards``
            devices holds 1/``shards`` of each; 1 builds Gluon's layers. The
            parameters keep the unsplit names and shapes wherever they are
            seen (checkpoints load across shard counts).
        warmup, lr_end: The learning rate's schedule over the run
            (:func:`lr_schedule`): the fraction of the steps it rises over,
            and where it ends as a fraction of ``--lr``.

    Raises:
        ValueError: a size or schedule that cannot work (names the argument).
    """
    for name, value, most in (('num_layers', num_layers, MAX_LAYERS),
                              ('num_hiddens', num_hiddens, MAX_HIDDENS)):
        if is_int(value) and value > most:
            raise ValueError('%s: expected a positive integer at most %d, found %d'
                             % (name, most, value))
    positive_int('shards', shards)
    if isinstance(num_heads, int) and num_heads % shards:
        raise ValueError('shards: expected a divisor of num_heads (%d), found %d'
                         % (num_heads, shards))
    schedule = lr_schedule(warmup, lr_end)
    vocab, train, val, baseline, k = prepare(block_size, train_chars, val_chars, ngram_order)
    cfg = gpt.GPTConfig(vocab_size=len(vocab), block_size=block_size, num_layers=num_layers,
                        num_heads=num_heads, num_hiddens=num_hiddens)
    if not isinstance(whole, bool):
        raise ValueError('whole: expected True or False, found %r' % (whole,))
    build = gpt.build_network if whole else gpt.build_blocks
    layers = sharded_layers(shards)
    return mp_symbolic.Task(
        name='lm', blocks=lambda: build(cfg, layers), loss=LOSS, train=train, val=val,
        batch_size=BATCH_SIZE, num_epochs=2, optimizer='adam', lr=LR, lr_schedule=schedule,
        evaluate=make_evaluate(vocab, baseline, ngram_order, k),
        description='a character-level GPT (%d blocks, width %d, %d heads, context %d%s) on '
                    'the Python standard library\'s %d modules' % (
                        num_layers, num_hiddens, num_heads, block_size,
                        ', %d tensor-parallel shards' % shards if shards > 1 else '',
                        len(corpus_files())))
