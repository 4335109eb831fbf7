"""Text from a trained character-level model: ``python -m mp_symbolic sample``
(also ``python -m mp_symbolic.training.sample``).

Reads either a training folder's committed checkpoint (``--checkpoint DIR``,
bound on one device with MXNet) or an exported ONNX file (``--model X.onnx``,
run by onnxruntime), and continues ``--prompt`` one character at a time,
drawing each from the model's next-character distribution sharpened by
``--temperature`` (lower: likelier text; 0: always the likeliest character).
The same ``--seed`` draws the same text. The vocabulary comes from the run's
``summary.json`` (its ``vocabulary``, which the ``lm`` task reports), or from
the ONNX file's ``training_summary`` metadata.

Example::

    python -m mp_symbolic sample --checkpoint artifacts/lm --prompt 'def ' --length 200
    python -m mp_symbolic sample --model artifacts/export-lm/current/lm.onnx --prompt 'import '
"""
import os
import stat
import sys

from ..tools.interrupts import exit_on_signals, ignore_signals

if __name__ == '__main__':
    exit_on_signals()  # before numpy, onnx and MXNet load: Ctrl-C while starting is one line
    from ..tools.blas import at_start
    at_start()  # OpenBLAS at the CPU's kernel, chosen before MXNet loads
    from ..tools.startup import mxnet_without_sklearn
    mxnet_without_sklearn()  # MXNet loads as where scikit-learn is absent
# pylint: disable=wrong-import-position
import json  # noqa: E402

import numpy as np  # noqa: E402

from ..tools.cliargs import OneLineArgumentParser, print_error  # noqa: E402
from ..core.graph.names import DATA_NAME, SHAPE_ATTR  # noqa: E402

__all__ = []

MAX_LENGTH = 10_000  # characters one command draws: one forward pass each, ms apiece
MAX_SEED = 2 ** 32 - 1  # numpy's RandomState takes 0..2**32 - 1
MAX_MODEL_BYTES = 2 << 30  # protobuf's own limit on one message (an ONNX file)


class MXNetModel:
    """A checkpoint's graph bound on ``cpu(0)`` for windows of ``block_size``.

    The graph is causal, so a context shorter than the window is placed at
    its start and the rest is padding the context's positions never see: one
    bind serves every length.
    """

    def __init__(self, folder):
        import mxnet as mx  # pylint: disable=import-outside-toplevel
        from ..tools.checkpoint import read_checkpoint  # pylint: disable=import-outside-toplevel
        checkpoint = read_checkpoint(folder)
        self.summary = checkpoint.summary
        symbol, arg_params, aux_params = checkpoint.load()
        shape = _recorded_shape(symbol)
        if len(shape) != 2:
            raise ValueError('--checkpoint: expected a model of character sequences (input '
                             '(batch, length)), found input %s in %s' % (shape, folder))
        # the longest context: the position table's length, else the trained length
        self.block_size = arg_params['embed_position_weight'].shape[0] \
            if 'embed_position_weight' in arg_params else shape[-1]
        label = [n for n in symbol.list_arguments() if n.endswith('_label')]
        shapes = {'data': (1, self.block_size)}
        shapes.update({n: (1, self.block_size) for n in label})
        self._exe = symbol.simple_bind(ctx=mx.cpu(0), grad_req='null', **shapes)
        self._exe.copy_params_from(arg_params, aux_params)

    def next_probs(self, ids):
        """Probabilities of the character after ``ids`` (at most ``block_size`` of them)."""
        window = np.zeros((1, self.block_size), dtype=np.float32)
        window[0, :len(ids)] = ids
        self._exe.forward(is_train=False, data=window)  # the head's forward is its softmax
        return self._exe.outputs[0][0, len(ids) - 1].asnumpy()


class OnnxModel:
    """An exported ONNX file run by onnxruntime, fed exactly the context
    (its batch and sequence length are dynamic)."""

    def __init__(self, path):
        import onnx  # pylint: disable=import-outside-toplevel
        import onnxruntime as ort  # pylint: disable=import-outside-toplevel
        from google.protobuf.message import DecodeError  # pylint: disable=import-outside-toplevel
        data = _read_model_file(path)
        try:
            model = onnx.load_from_string(data)
        except (DecodeError, ValueError, RuntimeError) as err:
            raise ValueError('--model: expected an ONNX file, found %s that is not one '
                             '(%s: %s)' % (path, type(err).__name__, err)) from None
        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
            # weights kept beside the file, as onnx.load(path) would read them
            from onnx.external_data_helper import load_external_data_for_model  # pylint: disable=import-outside-toplevel
            load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
        props = {p.key: p.value for p in model.metadata_props}
        if 'training_summary' not in props:
            raise ValueError('--model: expected an ONNX file exported from a training folder '
                             '(its training_summary metadata holds the vocabulary), found none '
                             'in %s' % path)
        self.summary = json.loads(props['training_summary'])
        dims = model.graph.input[0].type.tensor_type.shape.dim
        if len(dims) != 2 or not dims[1].dim_param:
            raise ValueError('--model: expected an input (batch, sequence) with a dynamic '
                             'sequence length (python -m export --dynamic 1=seq), found %s'
                             % [d.dim_param or d.dim_value for d in dims])
        weights = {i.name: i for i in model.graph.initializer}
        position = weights.get('embed_position_weight')
        self.block_size = position.dims[0] if position is not None else None
        self._session = ort.InferenceSession(model.SerializeToString(),
                                             providers=['CPUExecutionProvider'])
        self._input = self._session.get_inputs()[0].name

    def next_probs(self, ids):
        out = self._session.run(None, {self._input: np.asarray([ids], dtype=np.float32)})[0]
        return out[0, -1]


def _read_model_file(path):
    """The bytes of the regular file ``path``, at most :data:`MAX_MODEL_BYTES`.

    Raises:
        ValueError: ``path`` cannot be opened, is not a regular file (a FIFO
            or a device would block or never end) or is too large.
    """
    try:
        # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise ValueError('--model: cannot read %s (%s)' % (path, err.strerror)) from None
    info = os.fstat(fd)  # the file checked is the file read
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MODEL_BYTES:
        os.close(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError('--model: expected an ONNX file, found %s that is not a regular '
                             'file' % path)
        raise ValueError('--model: expected an ONNX file of at most %d bytes, found %d '
                         'bytes in %s' % (MAX_MODEL_BYTES, info.st_size, path))
    with os.fdopen(fd, 'rb') as f:
        try:
            return f.read(MAX_MODEL_BYTES + 1)
        except OSError as err:
            raise ValueError('--model: cannot read %s (%s)' % (path, err.strerror)) from None


def _recorded_shape(symbol):
    shape = symbol.get_internals()[DATA_NAME].attr(SHAPE_ATTR)
    if not shape:
        raise ValueError('--checkpoint: expected a checkpoint recording its input shape, '
                         'found none')
    return tuple(int(d) for d in shape.strip('()[] ').split(',') if d.strip())


def sample(model, vocab, prompt, length, temperature=1.0, seed=0):
    """``prompt`` and ``length`` characters drawn after it.

    Args:
        model: ``next_probs(ids)`` -> probabilities of the next character;
            ``block_size``: the longest context it takes.
        vocab: Character of each id.
        temperature: Divides the log-probabilities; 0 takes the likeliest.

    Raises:
        ValueError: a prompt character outside the vocabulary, an empty
            prompt, or an option :func:`check_options` refuses.
    """
    if not prompt:
        raise ValueError('--prompt: expected at least one character, found an empty prompt')
    missing = sorted(set(prompt) - set(vocab))
    if missing:
        raise ValueError('--prompt: expected characters of the model\'s %d-character vocabulary, '
                         'found %s' % (len(vocab), ', '.join(repr(c) for c in missing)))
    check_options(length, temperature, seed)
    index = {c: i for i, c in enumerate(vocab)}
    ids = [index[c] for c in prompt]
    rng = np.random.RandomState(seed)
    for _ in range(length):
        probs = np.asarray(model.next_probs(ids[-model.block_size:]), dtype=np.float64)
        if temperature == 0:
            ids.append(int(np.argmax(probs)))
            continue
        logits = np.log(np.maximum(probs, 1e-30)) / temperature
        p = np.exp(logits - logits.max())
        ids.append(int(rng.choice(len(p), p=p / p.sum())))
    return ''.join(vocab[i] for i in ids)


def check_options(length, temperature, seed):
    """Checks ``--length``, ``--temperature`` and ``--seed`` before any model loads.

    Raises:
        ValueError: a length outside 0..:data:`MAX_LENGTH`, a temperature
            below 0 or not finite, a seed outside 0..2**32 - 1.
    """
    if not 0 <= length <= MAX_LENGTH:
        raise ValueError('--length: expected 0 to %d characters, found %d' % (MAX_LENGTH, length))
    if not 0 <= temperature < float('inf'):
        raise ValueError('--temperature: expected a number >= 0, found %r' % temperature)
    if not 0 <= seed <= MAX_SEED:
        raise ValueError('--seed: expected an integer in 0..%d, found %d' % (MAX_SEED, seed))


DESCRIPTION = ('Continue a prompt with a trained character-level model (the lm task): '
               'from a training checkpoint or an exported ONNX file.')


def build_parser():
    parser = OneLineArgumentParser(prog='python -m mp_symbolic.training.sample',
                                   description=DESCRIPTION)
    add_sample_flags(parser)
    return parser


def add_sample_flags(parser):
    """The flags of ``sample``, on ``parser`` (its own, or ``python -m mp_symbolic``'s)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument('--checkpoint', metavar='DIR',
                        help='a training folder (its committed checkpoint, DIR/current)')
    source.add_argument('--model', metavar='FILE.onnx',
                        help='an ONNX file exported with a dynamic sequence length')
    parser.add_argument('--prompt', default='def ', help='text to continue (default: %(default)r)')
    parser.add_argument('--length', type=int, default=200,
                        help='characters to draw, at most %d (default: %%(default)s)' % MAX_LENGTH)
    parser.add_argument('--temperature', type=float, default=0.8,
                        help='sharpens (<1) or flattens (>1) the distribution; 0: the likeliest '
                             'character each time (default: %(default)s)')
    parser.add_argument('--seed', type=int, default=0,
                        help='seeds the draws, 0..2**32-1 (default: 0)')


def main(argv=None):
    return run(build_parser().parse_args(argv))


def run(args):
    """Runs ``sample`` for parsed ``args``; returns the exit status (2: refused)."""
    try:
        check_options(args.length, args.temperature, args.seed)
        model = OnnxModel(args.model) if args.model else MXNetModel(args.checkpoint)
        vocab = model.summary.get('vocabulary')
        if not isinstance(vocab, str) or not vocab:
            raise ValueError('expected a run whose summary records its vocabulary (a complete '
                             'lm checkpoint), found none')
        print(sample(model, vocab, args.prompt, args.length, args.temperature, args.seed))
    except (ValueError, OSError) as err:
        print_error(' '.join(str(err).split()))
        return 2
    return 0


if __name__ == '__main__':
    STATUS = main()
    ignore_signals()  # done and printed: a signal while MXNet shuts down would end it silently
    sys.exit(STATUS)
