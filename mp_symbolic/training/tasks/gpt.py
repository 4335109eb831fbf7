"""A GPT-style decoder (minGPT / nanoGPT's model) as Gluon blocks, for
:class:`~mp_symbolic.Pipeline` to split.

``build_blocks`` returns ``[Embed, Block x num_layers, TiedOutput]``: each
block takes one input and returns one output, so a Pipeline splits the list
by blocks (``Pipeline(blocks, ...)``) or the :class:`GPT` of the same blocks
by its graph. The output layer reads the token embedding's weight (tied
weights): split over stages, the weight lives on the first stage and the
last reads it there.

Every shape is read from the input in the graph (``arange_like``), not fixed
when it is built, so one trained graph runs on any batch size and any
sequence length up to ``block_size`` (an exported ONNX file too).

The dense and embedding layers come from a :class:`Layers` factory, so that
tensor-parallel versions of them (column-/row-parallel dense, a
vocabulary-parallel embedding, the output tied to its shards, and the
attention and GELU run on each shard's heads and units) replace Gluon's own
without touching the model; the default factory builds Gluon's layers. The
attention works on whole heads of ``head_dim`` features, so it gives the same
result on all heads at once or on any whole number of them per shard.

The training step is written for MXNet 1.9.1 on CPU, where reductions and
broadcasts run through a generic kernel that is slow next to its matrix
products (measured in docs/lm.md): the LayerNorm is an op of the project's
own, one pass a row each way, or, where that op cannot be built, computes
its means and its parameters' gradients as matrix products
(:class:`LayerNorm`); the causal mask and the position embeddings are added
without a broadcast in the backward pass, and the attention's scale
multiplies the queries, not the scores. The parameters, their names and
shapes are Gluon's.
Imports MXNet and the project's operators (:mod:`mp_symbolic.core.kernels`).
"""
from dataclasses import dataclass

import mxnet as mx
from mxnet import gluon

from mp_symbolic.core import kernels

__all__ = []

INIT = mx.init.Normal(0.02)  # GPT-2's initialisation of every weight matrix


def _dense(units, in_units, prefix, kind):
    """A position-wise ``Dense`` on ``(N, T, in_units)``. ``kind`` says its
    role (``'column'``: q/k/v and the MLP's first layer; ``'row'``: the
    attention's and the MLP's output), which a tensor-parallel factory maps to
    Megatron-LM's column- and row-parallel layers."""
    del kind
    return gluon.nn.Dense(units, in_units=in_units, flatten=False, prefix=prefix,
                          weight_initializer=INIT)


def _embedding(input_dim, output_dim, prefix):
    return gluon.nn.Embedding(input_dim, output_dim, prefix=prefix, weight_initializer=INIT)


@dataclass(frozen=True)
class Layers:
    """Where the model gets its dense and embedding layers.

    Attributes:
        dense: ``dense(units, in_units, prefix, kind) -> HybridBlock`` on
            ``(N, T, in_units)`` -> ``(N, T, units)``; ``kind`` is
            ``'column'`` or ``'row'`` (Megatron-LM's split of each layer).
        embedding: ``embedding(input_dim, output_dim, prefix) -> HybridBlock``
            with a ``weight`` parameter of shape ``(input_dim, output_dim)``
            (the output layer reads it, unless ``output`` is given).
        per_shard: ``None`` (the default): the attention and the GELU run
            as plain ops. Else ``per_shard(fn, units, prefix) -> HybridBlock``
            that applies ``fn(F, *parts)`` to the parts of its inputs
            (``units`` wide each) that each column layer's shard computed,
            as :class:`mp_symbolic.PerShard` does.
        output: ``None`` (the default): the logits are a ``FullyConnected``
            on the token embedding's ``weight``. Else ``output(embedding,
            vocab_size, in_units, prefix) -> HybridBlock``: the logits
            ``(N, T, vocab_size)`` from the embedding block's parameters.
    """
    dense: object = _dense
    embedding: object = _embedding
    per_shard: object = None
    output: object = None


@dataclass(frozen=True)
class GPTConfig:
    """The model's size."""
    vocab_size: int = 96      # distinct characters
    block_size: int = 128     # longest context, in characters (position embeddings)
    num_layers: int = 4       # transformer blocks
    num_heads: int = 4        # attention heads per block
    num_hiddens: int = 128    # model width; a multiple of num_heads

    def __post_init__(self):
        for name in ('vocab_size', 'block_size', 'num_layers', 'num_heads', 'num_hiddens'):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError('%s: expected a positive integer, found %r' % (name, value))
        if self.num_hiddens % self.num_heads:
            raise ValueError('num_hiddens: expected a multiple of num_heads (%d), found %d'
                             % (self.num_heads, self.num_hiddens))


class LayerNorm(gluon.HybridBlock):
    """``gluon.nn.LayerNorm`` over the last axis (the same ``gamma`` and
    ``beta``, epsilon 1e-5): the project's fused op, or its reductions
    written as matrix products.

    ``fused``: ``None`` (the default) uses the op
    ``fused_layer_norm`` (:mod:`mp_symbolic.core.kernels`: forward and
    backward each one pass a row, 0.28 to 0.38 of the products' time)
    wherever MXNet is a CPU build and the op builds, as
    ``MP_SYMBOLIC_FUSED_NORM`` says; ``True`` or ``False`` chooses. The
    export writes MXNet's ``LayerNorm`` in its place.

    MXNet 1.9.1's ``LayerNorm`` backward on CPU reduces through the generic
    broadcast kernel: 28 % of the language model's step on one device, 20
    times its forward. Here the mean and the variance over the ``C`` features
    of each position are ``FullyConnected`` products with a constant ``1/C``
    row, spread back over the features by a product with a column of ones;
    each position's reciprocal deviation is spread by a product with
    ``gamma``, and ``beta`` by a product of a column of ones with it, so
    their gradients (sums over every position) are the weight gradients of
    those products: five products a norm. The result equals ``LayerNorm`` to
    float32 rounding (``tests/test_lm.py``) and exports to ONNX with MXNet's
    own converters.
    """

    def __init__(self, in_channels, epsilon=1e-5, fused=None, **kwargs):
        super().__init__(**kwargs)
        self.in_channels, self.epsilon = in_channels, epsilon
        if fused is None:
            fused = kernels.use_fused_norm()
        elif fused and not kernels.fused_layer_norm()[0]:
            raise kernels.KernelError('LayerNorm(fused=True): the fused op is not available: %s'
                                      % kernels.fused_layer_norm()[1])
        self.fused = bool(fused)
        with self.name_scope():
            self.gamma = self.params.get('gamma', shape=(in_channels,), init='ones',
                                         allow_deferred_init=True)
            self.beta = self.params.get('beta', shape=(in_channels,), init='zeros',
                                        allow_deferred_init=True)

    def hybrid_forward(self, F, x, gamma, beta):  # pylint: disable=arguments-differ
        if self.fused:
            x, gamma, beta = kernels.as_inputs(F, x, gamma, beta)  # gradients that add
            return F.fused_layer_norm(x, gamma, beta, eps=self.epsilon)
        C = self.in_channels
        rows = F.reshape(x, shape=(-1, C))                                  # (R, C): R positions
        ones = F.BlockGrad(F.ones_like(gamma))                              # (C,), on its device
        mean_of = F.reshape(ones, shape=(1, C)) * (1.0 / C)                 # (1, C) constant
        spread = F.reshape(ones, shape=(C, 1))                              # (C, 1) constant
        centred = rows - F.FullyConnected(
            F.FullyConnected(rows, mean_of, no_bias=True, num_hidden=1),    # (R, 1) means
            spread, no_bias=True, num_hidden=C)
        variance = F.FullyConnected(F.square(centred), mean_of, no_bias=True, num_hidden=1)
        # each position's 1 / deviation times gamma, (R, 1) x (1, C) in one product:
        # gamma's gradient is its weight gradient, and no (R, C) spread of gamma is kept
        scale = F.FullyConnected(F.reciprocal(F.sqrt(variance + self.epsilon)),
                                 F.reshape(gamma, shape=(C, 1)), no_bias=True, num_hidden=C)
        each = F.BlockGrad(F.ones_like(variance))                           # (R, 1) constant
        out = centred * scale + F.FullyConnected(each, F.reshape(beta, shape=(C, 1)),
                                                 no_bias=True, num_hidden=C)
        return F.reshape_like(out, x)                                       # (..., C)


class Embed(gluon.HybridBlock):
    """Token ids ``(N, T)`` (float) -> token + position embeddings ``(N, T, C)``."""

    def __init__(self, cfg, layers=Layers(), **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.token = layers.embedding(cfg.vocab_size, cfg.num_hiddens, 'token_')
            self.position = _embedding(cfg.block_size, cfg.num_hiddens, 'position_')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        # each position's id at every row of the batch (N, T): the position
        # embedding's gradient is then the Embedding's sparse sum, where a
        # broadcast (1, T, C) + (N, T, C) would reduce over the batch
        positions = F.broadcast_like(F.reshape(F.contrib.arange_like(x, axis=1), shape=(1, -1)),
                                     x)                                 # (N, T)
        return self.token(x) + self.position(positions)                  # (N, T, C)


class _Attend:
    """Causal attention of queries, keys and values ``(N, T, h D)`` holding
    whole heads of ``head_dim`` features (all ``H`` heads, or a shard's): the
    result ``(N, T, h D)``, head by head, whatever ``h`` is. ``fused``: the
    project's ``causal_attention`` op (:mod:`mp_symbolic.core.kernels`,
    loaded first), all of it in one op; else MXNet's ops, the two products
    the op ``product`` names: MXNet's ``batch_dot``, or the project's
    ``small_batch_dot``."""

    def __init__(self, head_dim, product='batch_dot', fused=False):
        self.head_dim = head_dim
        self.product = product
        self.fused = fused
        self.__name__ = 'attention'

    def __call__(self, F, q, k, v):
        if self.fused:
            q, k, v = kernels.as_inputs(F, q, k, v)  # gradients that add
            return getattr(F, kernels.CAUSAL_ATTENTION)(q, k, v, head_dim=self.head_dim)
        return kernels.attention_of_mxnet_ops(F, q, k, v, self.head_dim, product=self.product)


def _gelu(F, x):
    return F.LeakyReLU(x, act_type='gelu')


class CausalSelfAttention(gluon.HybridBlock):
    """Multi-head self-attention where position t sees positions <= t."""

    def __init__(self, cfg, layers=Layers(), **kwargs):
        super().__init__(**kwargs)
        C = cfg.num_hiddens
        # the project's causal_attention op where its library loads (the export
        # writes MXNet's ops in its place); else the products by MXNet's batch_dot,
        # or by the project's small_batch_dot where MP_SYMBOLIC_SMALL_BATCH_DOT asks
        # (it keeps the scores to the backward pass), batch_dot in the export
        fused = kernels.use_fused_attention()
        self.attend = _Attend(C // cfg.num_heads, fused=fused, product=kernels.SMALL_BATCH_DOT
                              if not fused and kernels.use_small_batch_dot() else 'batch_dot')
        with self.name_scope():
            self.query = layers.dense(C, C, 'query_', 'column')
            self.key = layers.dense(C, C, 'key_', 'column')
            self.value = layers.dense(C, C, 'value_', 'column')
            if layers.per_shard is not None:  # on each shard's heads
                self.heads = layers.per_shard(self.attend, C, 'heads_')
            self.proj = layers.dense(C, C, 'proj_', 'row')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        q, k, v = (layer(x) for layer in (self.query, self.key, self.value))  # (N, T, C) each
        heads = getattr(self, 'heads', None)
        out = heads(q, k, v) if heads is not None else self.attend(F, q, k, v)  # (N, T, C)
        return self.proj(out)


class Block(gluon.HybridBlock):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg, layers=Layers(), **kwargs):
        super().__init__(**kwargs)
        C = cfg.num_hiddens
        with self.name_scope():
            self.ln1 = LayerNorm(C, prefix='ln1_')
            self.attention = CausalSelfAttention(cfg, layers, prefix='attention_')
            self.ln2 = LayerNorm(C, prefix='ln2_')
            self.fc = layers.dense(4 * C, C, 'fc_', 'column')
            if layers.per_shard is None:
                self.gelu = gluon.nn.GELU(prefix='gelu_')
            else:  # on each shard's units, between the column and the row layer
                self.gelu = layers.per_shard(_gelu, 4 * C, 'gelu_')
            self.out = layers.dense(C, 4 * C, 'out_', 'row')

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        x = x + self.attention(self.ln1(x))
        return x + self.out(self.gelu(self.fc(self.ln2(x))))


class TiedOutput(gluon.HybridBlock):
    """Final LayerNorm, then logits ``(N, T, vocab)`` from the token
    embedding's own weight (no parameter of its own but the norm's)."""

    def __init__(self, cfg, embed, layers=Layers(), **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = cfg.vocab_size
        with self.name_scope():
            self.ln = LayerNorm(cfg.num_hiddens, prefix='ln_')
            if layers.output is not None:  # a layer made with the embedding's parameters
                self.out = layers.output(embed.token, cfg.vocab_size, cfg.num_hiddens, 'out_')
        if layers.output is None:
            # the same Parameter, listed among this block's own so that a
            # Pipeline sees both stages read it (a tied weight)
            self.weight = embed.token.weight
            self.params.update(embed.token.params)

    def hybrid_forward(self, F, x, weight=None):  # pylint: disable=arguments-differ
        if weight is None:
            return self.out(self.ln(x))
        return F.FullyConnected(self.ln(x), weight, no_bias=True, flatten=False,
                                num_hidden=self.vocab_size)


class GPT(gluon.HybridBlock):
    """The blocks of :func:`build_blocks` as one network (a Pipeline cuts it
    by its graph); the blocks keep their own parameter names."""

    def __init__(self, blocks, **kwargs):
        super().__init__(**kwargs)
        self.layers = blocks
        for i, block in enumerate(blocks):
            self.register_child(block, 'layer%d' % i)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        for block in self.layers:
            x = block(x)
        return x


def build_blocks(cfg, layers=Layers()):
    """``[Embed, Block x num_layers, TiedOutput]`` with fixed parameter names
    (``embed_token_weight``, ``block0_attention_query_weight``, ...,
    ``head_ln_gamma``): token ids ``(N, T)`` -> logits ``(N, T, vocab)``."""
    embed = Embed(cfg, layers, prefix='embed_')
    return [embed] + [Block(cfg, layers, prefix='block%d_' % i) for i in range(cfg.num_layers)] \
        + [TiedOutput(cfg, embed, layers, prefix='head_')]


def build_network(cfg, layers=Layers()):
    """:func:`build_blocks` as one :class:`GPT`."""
    return GPT(build_blocks(cfg, layers), prefix='gpt_')
