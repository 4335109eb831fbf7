"""Text from a trained character-level model: ``python -m mp_symbolic.training.sample``.

Reads either a training folder's committed checkpoint (``--checkpoint DIR``,
bound on one device with MXNet) or an exported ONNX file (``--model X.onnx``,
run by onnxruntime), and continues ``--prompt`` one character at a time,
drawing each from the model's next-character distribution sharpened by
``--temperature`` (lower: likelier text; 0: always the likeliest character).
The same ``--seed`` draws the same text. The vocabulary comes from the run's
``summary.json`` (its ``vocabulary``, which the ``lm`` task reports), or from
the ONNX file's ``training_summary`` metadata.

Example::

    python -m mp_symbolic.training.sample --checkpoint artifacts/lm --prompt 'def ' --length 200
    python -m mp_symbolic.training.sample --model artifacts/export-lm/current/lm.onnx --prompt 'import '
"""
import json
import sys

import numpy as np

from ..tools.cliargs import OneLineArgumentParser, print_error

__all__ = []


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
        model = onnx.load(path)
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


def _recorded_shape(symbol):
    shape = symbol.get_internals()['data'].attr('__shape__')
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
            prompt, a negative length or temperature.
    """
    if not prompt:
        raise ValueError('--prompt: expected at least one character, found an empty prompt')
    missing = sorted(set(prompt) - set(vocab))
    if missing:
        raise ValueError('--prompt: expected characters of the model\'s %d-character vocabulary, '
                         'found %s' % (len(vocab), ', '.join(repr(c) for c in missing)))
    if length < 0:
        raise ValueError('--length: expected 0 or more characters, found %d' % length)
    if not temperature >= 0:
        raise ValueError('--temperature: expected a number >= 0, found %r' % temperature)
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


def build_parser():
    parser = OneLineArgumentParser(
        prog='python -m mp_symbolic.training.sample',
        description='Continue a prompt with a trained character-level model (the lm task): '
                    'from a training checkpoint or an exported ONNX file.')
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument('--checkpoint', metavar='DIR',
                        help='a training folder (its committed checkpoint, DIR/current)')
    source.add_argument('--model', metavar='FILE.onnx',
                        help='an ONNX file exported with a dynamic sequence length')
    parser.add_argument('--prompt', default='def ', help='text to continue (default: %(default)r)')
    parser.add_argument('--length', type=int, default=200,
                        help='characters to draw (default: %(default)s)')
    parser.add_argument('--temperature', type=float, default=0.8,
                        help='sharpens (<1) or flattens (>1) the distribution; 0: the likeliest '
                             'character each time (default: %(default)s)')
    parser.add_argument('--seed', type=int, default=0, help='seeds the draws (default: 0)')
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
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
    sys.exit(main())
