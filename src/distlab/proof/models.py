"""The toy models and data every lesson uses, built identically on every rank from a seed.

- `layered_mlp`: an `nn.Sequential` of layers to cut into pipeline stages. Each child is one whole
  layer (Linear, then Tanh except for the last), so a cut never separates a Linear from its activation.
- `regression_batch`: inputs and targets from a fixed random "teacher" network, so the MSE loss a
  pipeline trains on can actually go down.
- `Block`: a pre-LayerNorm transformer block (lessons 07-08), with the options the lessons need: causal
  attention or not, q, k, v from one fused Linear or three, attention by torch's fused kernel or written
  out, dropout masks given to forward or none; `token_batch` the (N, seq, d) inputs and targets it trains on.
- `TwoTower`: the contrastive model `distributed_clip` expects: `encoder_x`, `encoder_y`, and `forward(x, y)`
  returning L2-normalised embeddings (z_x, z_y); optional dropout.
- `RealShapes`: the shapes a real model's parameters take that a plain stack of layers lacks (lessons 06-07 and
  their tests): a parameter on the root module (CLIP's `logit_scale`), an embedding / output weight tied across
  two children, a frozen tower and a frozen bias, and a branch that forward never takes.
- `paired_data`: pairs (x_i, y_i) that are two noisy nonlinear views of one shared latent, so a two-tower
  model can learn to retrieve y_i from x_i and retrieval accuracy means something.

Seeding goes through a local `torch.Generator`, never the global RNG, so building a model or a batch
does not disturb the random stream a lesson is using for dropout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_WIDTHS = (16, 32, 32, 32, 32, 32, 32, 32, 8)  # 8 layers
MLP_IN, MLP_OUT = DEFAULT_WIDTHS[0], DEFAULT_WIDTHS[-1]  # features in and out of every layered MLP


def mlp_widths(layers: int, width: int) -> tuple[int, ...]:
    """The widths of a layered MLP of `layers` layers, `width` wide inside: MLP_IN -> width ... -> MLP_OUT."""
    return (MLP_IN, *[width] * (layers - 1), MLP_OUT)


def _init_linear_(layer: nn.Linear, gen: torch.Generator) -> nn.Linear:
    """PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn from our own generator."""
    bound = layer.in_features**-0.5
    with torch.no_grad():
        layer.weight.uniform_(-bound, bound, generator=gen)
        layer.bias.uniform_(-bound, bound, generator=gen)
    return layer


def layered_mlp(
    widths: Sequence[int] = DEFAULT_WIDTHS, seed: int = 0, dtype: torch.dtype = torch.float64
) -> nn.Sequential:
    """`len(widths) - 1` layers; layer i maps widths[i] -> widths[i + 1]."""
    if len(widths) < 2:
        raise ValueError(f"need at least two widths (one layer), got {list(widths)}")
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        linear = _init_linear_(nn.Linear(fan_in, fan_out, dtype=dtype), gen)
        last = i == len(widths) - 2
        layers.append(linear if last else nn.Sequential(linear, nn.Tanh()))
    return nn.Sequential(*layers)


class _Embed(nn.Module):
    """A (V, d) table applied to a soft one-hot row: x @ weight (an embedding lookup when x is one-hot)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


SHAPES = ("root", "tied", "frozen", "unused")  # RealShapes' shapes, each on unless named in `without`


class RealShapes(nn.Module):
    """x (N, V) -> (N, V) through d hidden units, with every shape of `SHAPES` but those named in `without`:

        h = tanh(x E); h = tanh(tower(h)); h = tanh(mix(h)); [h = h + branch(h), never here]
        out = logit_scale * (h E^T + head.bias)

    - `root`: `logit_scale`, one number held by the model itself, no child's (shape (1,): fully_shard refuses
      0-dim parameters);
    - `tied`: `head.weight` IS `embed.weight` (E, V x d), one tensor held by two children (GPT-2's tied
      embedding); untied, head gets its own (V, d) weight;
    - `frozen`: `tower` (weight and bias) and `mix.bias` do not require grad (a frozen tower, LiT's; a frozen bias);
    - `unused`: `branch` exists and requires grad, but forward never calls it (a branch not taken).
    """

    def __init__(
        self, v: int = 6, d: int = 5, seed: int = 0, dtype: torch.dtype = torch.float64, without: tuple[str, ...] = ()
    ):
        unknown = set(without) - set(SHAPES)
        if unknown:
            raise ValueError(f"unknown shapes {sorted(unknown)}; known: {SHAPES}")
        root, tied, frozen, unused = (shape not in without for shape in SHAPES)
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        if root:
            self.logit_scale = nn.Parameter(torch.full((1,), 1.5, dtype=dtype))  # 1-D: FSDP2 refuses 0-dim
        self.embed = _Embed(nn.Parameter(torch.randn(v, d, generator=gen, dtype=dtype) / d**0.5))
        self.tower = _init_linear_(nn.Linear(d, d, dtype=dtype), gen).requires_grad_(not frozen)
        self.mix = _init_linear_(nn.Linear(d, d, dtype=dtype), gen)
        self.mix.bias.requires_grad_(not frozen)
        self.branch = _init_linear_(nn.Linear(d, d, dtype=dtype), gen) if unused else None
        self.head = _init_linear_(nn.Linear(d, v, dtype=dtype), gen)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.tower(h))
        h = torch.tanh(self.mix(h))  # self.branch is never called: its parameters get no gradient
        out = self.head(h)
        return out * self.logit_scale if hasattr(self, "logit_scale") else out


def regression_batch(
    batch_size: int, in_features: int, out_features: int, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) with x ~ N(0, I) and y = teacher(x), a fixed random two-layer tanh network."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, in_features, generator=gen, dtype=dtype)
    hidden = torch.randn(in_features, 2 * in_features, generator=gen, dtype=dtype) / in_features**0.5
    head = torch.randn(2 * in_features, out_features, generator=gen, dtype=dtype) / (2 * in_features) ** 0.5
    return x, torch.tanh(x @ hidden) @ head


@dataclass(frozen=True)
class BlockOptions:
    """What differs between the lessons' blocks (each changes what autograd saves, so what a rank holds)."""

    causal: bool = False  # query i attends to keys j <= i only
    fused_qkv: bool = False  # q, k, v from one Linear(d, 3d), `attn.qkv`; else three, `attn.q`, `.k`, `.v`
    sdpa: bool = True  # torch's scaled_dot_product_attention (saves a log-sum-exp per head and row), else
    # written out, softmax(q k^T / sqrt(d_h)) v (saves the h x seq x seq weights)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_h)) v per head, on (N, heads, seq, d_h) tensors; masked above the diagonal
    when causal. The heads never mix, so a rank holding h / P of them runs exactly this on its own."""
    if options.sdpa:
        return F.scaled_dot_product_attention(q, k, v, is_causal=options.causal)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (N, heads, seq, seq)
    if options.causal:
        seq = scores.shape[-1]
        above = torch.ones(seq, seq, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, BlockOptions], torch.Tensor]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, options: BlockOptions, core: Core = attention
) -> torch.Tensor:
    """Attention of (N, seq, heads * d_h) projections, head by head, whatever the number of heads they
    hold (all h, or one rank's h / P): (N, seq, heads * d_h) out. `core` computes the heads' attention on
    (N, heads, seq, d_h) tensors: `attention` above, or one that holds only part of the sequence and
    meets the rest by messages (the ring of lesson 09, under context parallelism)."""
    n, seq = q.shape[:2]
    split = [t.reshape(n, seq, -1, head_dim).transpose(1, 2) for t in (q, k, v)]  # (N, heads, seq, d_h)
    return core(*split, options).transpose(1, 2).reshape(n, seq, -1)


class Attention(nn.Module):
    """Attention(u) = concat_heads(softmax(q k^T / sqrt(d_h)) v) W_o^T + b_o, with q = u W_q^T + b_q, ..."""

    def __init__(self, dim: int, heads: int, options: BlockOptions, gen: torch.Generator, dtype: torch.dtype):
        super().__init__()
        self.heads, self.head_dim, self.options = heads, dim // heads, options
        self.core: Core = attention  # a context-parallel run swaps in its ring (not a parameter, not saved)
        if options.fused_qkv:
            self.qkv = _init_linear_(nn.Linear(dim, 3 * dim, dtype=dtype), gen)
        else:
            self.q, self.k, self.v = (_init_linear_(nn.Linear(dim, dim, dtype=dtype), gen) for _ in range(3))
        self.out = _init_linear_(nn.Linear(dim, dim, dtype=dtype), gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.options.fused_qkv:
            return self.out(attend(self.q(x), self.k(x), self.v(x), self.head_dim, self.options, self.core))
        n, seq, _ = x.shape  # one (N, seq, 3d) product; q, k, v are views of it, (N, heads, seq, d_h) each
        q, k, v = self.qkv(x).view(n, seq, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.out(self.core(q, k, v, self.options).transpose(1, 2).reshape(n, seq, -1))


class MLP(nn.Module):
    """MLP(u) = GELU(u W_1^T + b_1) W_2^T + b_2, of hidden width d_ff."""

    def __init__(self, dim: int, ffn: int, gen: torch.Generator, dtype: torch.dtype):
        super().__init__()
        self.fc1 = _init_linear_(nn.Linear(dim, ffn, dtype=dtype), gen)
        self.fc2 = _init_linear_(nn.Linear(ffn, dim, dtype=dtype), gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Dropout with a given mask (0 or 1/(1-p) per element; None: no dropout)."""
    return x if mask is None else x * mask


class Block(nn.Module):
    """A pre-LayerNorm transformer block on x of shape (N, seq, d), h heads of width d_h = d / h:

        y = x + m_1 * Attention(LN_1(x)),    z = y + m_2 * MLP(LN_2(y))

    m_1, m_2 are dropout masks passed to forward rather than drawn inside (None: no dropout), so a split
    block and this one can be handed the very same masks. The LayerNorms' gains and biases are drawn too
    (1 + 0.1 N(0, 1) and 0.1 N(0, 1)), so that their gradients are not trivial."""

    def __init__(
        self,
        dim: int,
        heads: int,
        ffn: int,
        options: BlockOptions = BlockOptions(),
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
    ):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.ln1 = _init_layer_norm_(nn.LayerNorm(dim, dtype=dtype), gen)
        self.attn = Attention(dim, heads, options, gen, dtype)
        self.ln2 = _init_layer_norm_(nn.LayerNorm(dim, dtype=dtype), gen)
        self.mlp = MLP(dim, ffn, gen, dtype)

    def forward(self, x: torch.Tensor, masks: tuple | None = None) -> torch.Tensor:
        m1, m2 = masks if masks is not None else (None, None)
        y = x + masked(self.attn(self.ln1(x)), m1)
        return y + masked(self.mlp(self.ln2(y)), m2)


def _init_layer_norm_(layer: nn.LayerNorm, gen: torch.Generator) -> nn.LayerNorm:
    with torch.no_grad():
        layer.weight.copy_(1 + 0.1 * torch.randn(layer.weight.shape, generator=gen, dtype=layer.weight.dtype))
        layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=gen, dtype=layer.bias.dtype))
    return layer


def token_batch(
    n: int, seq: int, dim: int, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, target): N sequences of seq tokens of width d, and a regression target of the same shape, N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n, seq, dim)
    return torch.randn(shape, generator=gen, dtype=dtype), torch.randn(shape, generator=gen, dtype=dtype)


class TwoTower(nn.Module):
    """Two MLP encoders and L2-normalised outputs: the model contract of `distributed_clip`."""

    def __init__(
        self,
        dim_x: int = 12,
        dim_y: int = 10,
        hidden: int = 32,
        embed_dim: int = 8,
        dropout: float = 0.0,
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
    ):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def encoder(dim_in: int) -> nn.Sequential:
            return nn.Sequential(
                _init_linear_(nn.Linear(dim_in, hidden, dtype=dtype), gen),
                nn.Tanh(),
                nn.Dropout(dropout),
                _init_linear_(nn.Linear(hidden, embed_dim, dtype=dtype), gen),
            )

        self.encoder_x = encoder(dim_x)
        self.encoder_y = encoder(dim_y)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.encoder_x(x), dim=-1), F.normalize(self.encoder_y(y), dim=-1)


LATENT_DIM, NOISE, WORLD_SEED = 6, 0.1, 0  # the world every paired data set is drawn from


def paired_data(
    n: int, dim_x: int = 12, dim_y: int = 10, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """n pairs (x_i, y_i): two noisy nonlinear views of one latent u_i ~ N(0, I).

    x = tanh(u A) + noise, y = tanh(u B) + noise. The views A, B are fixed (WORLD_SEED), so a training
    set and a held-out set drawn with different `seed`s live in the same world; u and the noise
    come from `seed`.
    """
    world = torch.Generator().manual_seed(WORLD_SEED)
    view_x = torch.randn(LATENT_DIM, dim_x, generator=world, dtype=dtype)
    view_y = torch.randn(LATENT_DIM, dim_y, generator=world, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(n, LATENT_DIM, generator=gen, dtype=dtype)
    x = torch.tanh(u @ view_x) + NOISE * torch.randn(n, dim_x, generator=gen, dtype=dtype)
    y = torch.tanh(u @ view_y) + NOISE * torch.randn(n, dim_y, generator=gen, dtype=dtype)
    return x, y
