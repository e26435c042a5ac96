"""The toy models and data every lesson uses, built identically on every rank from a seed.

- `layered_mlp`: an `nn.Sequential` of layers to cut into pipeline stages. Each child is one whole
  layer (Linear, then Tanh except for the last), so a cut never separates a Linear from its activation.
- `regression_batch`: inputs and targets from a fixed random "teacher" network, so the MSE loss a
  pipeline trains on can actually go down.
- `TwoTower`: the contrastive model `distributed_clip` expects: `encoder_x`, `encoder_y`, and `forward(x, y)`
  returning L2-normalised embeddings (z_x, z_y); optional dropout.
- `paired_data`: pairs (x_i, y_i) that are two noisy nonlinear views of one shared latent, so a two-tower
  model can learn to retrieve y_i from x_i and retrieval accuracy means something.

Seeding goes through a local `torch.Generator`, never the global RNG, so building a model or a batch
does not disturb the random stream a lesson is using for dropout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_WIDTHS = (16, 32, 32, 32, 32, 32, 32, 32, 8)  # 8 layers


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


def regression_batch(
    batch_size: int, in_features: int, out_features: int, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) with x ~ N(0, I) and y = teacher(x), a fixed random two-layer tanh network."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, in_features, generator=gen, dtype=dtype)
    hidden = torch.randn(in_features, 2 * in_features, generator=gen, dtype=dtype) / in_features**0.5
    head = torch.randn(2 * in_features, out_features, generator=gen, dtype=dtype) / (2 * in_features) ** 0.5
    return x, torch.tanh(x @ hidden) @ head


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
