"""The language model's GPT (:mod:`mp_symbolic.training.tasks.gpt`) in PyTorch,
for ``python -m bench.peer`` to time beside the project's.

The same function with the same parameters under the project's names:
``[Embed, Block x num_layers, TiedOutput]``; token plus position embeddings;
pre-LayerNorm blocks (epsilon 1e-5), causal multi-head attention, an MLP of
``4 C`` units with the exact (erf) GELU; the logits a product with the token
embedding's weight (tied). The attention is written out (``'explicit'``: the
queries scaled, the scores masked and softmaxed, two batched products, as the
project's graph does) or torch's fused
``scaled_dot_product_attention`` (``'sdpa'``).

:func:`stages` cuts the blocks at the project's stage boundary; the stage
that holds the output keeps its own copy of the token embedding's weight,
whose gradient :func:`sum_tied_grad` adds across the two processes before
each update (Megatron-LM's tied embedding over pipeline stages).

Imports torch and numpy: a process that imports GluonCV must not import it.
"""
import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ['GPT', 'stages', 'load', 'names', 'sum_tied_grad', 'TIED']

ATTENTION = ('explicit', 'sdpa')
TIED = 'embed_token_weight'


class Embed(nn.Module):
    """Token ids ``(N, T)`` -> token + position embeddings ``(N, T, C)``."""

    def __init__(self, vocab_size, block_size, width):
        super().__init__()
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(block_size, width)

    def forward(self, x):
        return self.token(x) + self.position(torch.arange(x.shape[1], device=x.device))


class Block(nn.Module):
    """``x + attn(ln1(x))``, then ``x + out(gelu(fc(ln2(x))))``."""

    def __init__(self, width, num_heads, attention):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError('attention: expected one of %s, found %r'
                             % (', '.join(ATTENTION), attention))
        self.heads, self.head_dim, self.attention = num_heads, width // num_heads, attention
        self.ln1, self.ln2 = nn.LayerNorm(width, eps=1e-5), nn.LayerNorm(width, eps=1e-5)
        self.query, self.key, self.value, self.proj = (nn.Linear(width, width) for _ in range(4))
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def _heads(self, x):
        n, t, _ = x.shape
        return x.view(n, t, self.heads, self.head_dim).transpose(1, 2)   # (N, H, T, D)

    def attend(self, x):
        n, t, c = x.shape
        q, k, v = (self._heads(layer(x)) for layer in (self.query, self.key, self.value))
        if self.attention == 'sdpa':
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q * (1.0 / math.sqrt(self.head_dim))) @ k.transpose(-2, -1)  # (N, H, T, T)
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            out = torch.softmax(scores.masked_fill(future, -1e9), dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(n, t, c))

    def forward(self, x):
        x = x + self.attend(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TiedOutput(nn.Module):
    """The final LayerNorm, then the logits from the token embedding's weight:
    the :class:`Embed`'s own ``token`` (one process) or a copy (a stage apart)."""

    def __init__(self, width, token=None, vocab_size=None):
        super().__init__()
        self.ln = nn.LayerNorm(width, eps=1e-5)
        if token is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, width))
        else:
            self._token = [token]   # not registered: the Embed owns it

    def forward(self, x):
        weight = self.weight if hasattr(self, 'weight') else self._token[0].weight
        return self.ln(x) @ weight.t()


def _layers(vocab_size, block_size, num_layers, num_heads, width, attention):
    embed = Embed(vocab_size, block_size, width)
    blocks = [Block(width, num_heads, attention) for _ in range(num_layers)]
    return embed, blocks


class GPT(nn.Sequential):
    """The whole model in one process: token ids ``(N, T)`` -> logits ``(N, T, V)``."""

    def __init__(self, vocab_size, block_size, num_layers, num_heads, width,
                 attention='explicit'):
        embed, blocks = _layers(vocab_size, block_size, num_layers, num_heads, width, attention)
        super().__init__(embed, *blocks, TiedOutput(width, token=embed.token))


def stages(vocab_size, block_size, num_layers, num_heads, width, balance,
           attention='explicit'):
    """The model cut into ``len(balance)`` ``nn.Sequential`` stages of
    ``balance[i]`` of the project's blocks each (``[Embed, Block...,
    TiedOutput]``); a stage after the first that holds ``TiedOutput`` has its
    own ``weight`` for the tied embedding.

    Raises:
        ValueError: ``balance`` does not add up to ``num_layers + 2`` blocks.
    """
    if sum(balance) != num_layers + 2 or min(balance) < 1:
        raise ValueError('balance: expected positive block counts adding up to %d, found %s'
                         % (num_layers + 2, list(balance)))
    embed, blocks = _layers(vocab_size, block_size, num_layers, num_heads, width, attention)
    every = [embed] + blocks + [None]
    out, start = [], 0
    for count in balance:
        part = every[start:start + count]
        if part[-1] is None:
            part[-1] = (TiedOutput(width, token=embed.token) if start == 0
                        else TiedOutput(width, vocab_size=vocab_size))
        stage = nn.Sequential(*part)
        stage.block_offset = max(start - 1, 0)
        out.append(stage)
        start += count
    return out


def names(module):
    """``{project name: torch Parameter}`` of a :class:`GPT` or a stage of
    :func:`stages` (the tied copy under ``embed_token_weight``)."""
    out = {}
    for layer in module:
        if isinstance(layer, Embed):
            out['embed_token_weight'] = layer.token.weight
            out['embed_position_weight'] = layer.position.weight
        elif isinstance(layer, TiedOutput):
            out['head_ln_gamma'], out['head_ln_beta'] = layer.ln.weight, layer.ln.bias
            if hasattr(layer, 'weight'):
                out[TIED] = layer.weight
    blocks = [layer for layer in module if isinstance(layer, Block)]
    first = _first_block(module)
    for i, block in enumerate(blocks, first):
        prefix = 'block%d_' % i
        for ln in ('ln1', 'ln2'):
            norm = getattr(block, ln)
            out[prefix + ln + '_gamma'], out[prefix + ln + '_beta'] = norm.weight, norm.bias
        for part in ('query', 'key', 'value', 'proj'):
            layer = getattr(block, part)
            out[prefix + 'attention_%s_weight' % part] = layer.weight
            out[prefix + 'attention_%s_bias' % part] = layer.bias
        for part in ('fc', 'out'):
            layer = getattr(block, part)
            out[prefix + part + '_weight'], out[prefix + part + '_bias'] = layer.weight, layer.bias
    return out


def _first_block(module):
    """The project's index of the first :class:`Block` in ``module`` (set by
    :func:`stages` through ``block_offset``; 0 for a whole model)."""
    return getattr(module, 'block_offset', 0)


def load(module, values):
    """Copies ``values`` (``{project name: numpy array}``) into ``module``'s
    parameters of the same names.

    Raises:
        ValueError: a parameter missing from ``values``, or of another shape.
    """
    for name, param in names(module).items():
        if name not in values:
            raise ValueError('initial values: expected %s, found none' % name)
        value = np.asarray(values[name], dtype=np.float32)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError('initial values: expected %s of shape %s, found %s'
                             % (name, tuple(param.shape), value.shape))
        with torch.no_grad():
            param.copy_(torch.from_numpy(value))


def sum_tied_grad(module, group=None):
    """Adds the tied embedding weight's gradient over the processes of
    ``group`` (each holds it once: the first stage's embedding, the last
    stage's copy), so each applies the same update to the same value."""
    weight = names(module).get(TIED)
    if weight is not None and weight.grad is not None:
        torch.distributed.all_reduce(weight.grad, group=group)
