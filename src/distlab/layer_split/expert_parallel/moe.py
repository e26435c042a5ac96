"""A mixture-of-experts MLP in a transformer block, in one process: the model lesson 10 splits, and the
reference it is checked against.

Tokens. The block runs on x of shape (N, seq, d); the MoE sees its N seq tokens as rows u_t (t in global
order: sequence by sequence, so rank r's C sequences are tokens r C seq .. (r+1) C seq - 1).

The router (a Linear d -> E, no bias) gives every token a softmax over the E experts, gate_t = softmax(u_t
W_router^T). Each token goes to its kappa best experts (top-kappa, kappa = 1 or 2; the literature's top-k,
but k is the keys here). Its combine weights are the chosen gates, renormalised to add up to 1 when kappa > 1
(GShard's top-2, Mixtral's); with kappa = 1 the gate itself, so that the router still learns from the task loss
(Switch). The output is the weighted sum of the chosen experts' outputs,

    MoE(u_t) = sum_{i chosen by t, kept} weight_t,i Expert_i(u_t),

each expert an MLP of the ground floor (`distlab.proof.models.MLP`, hidden width d_ff).

Capacity, and the drop rule. An expert takes at most capacity = ceil(gamma kappa N seq / E) tokens a step
(gamma: the capacity factor; gamma kappa N seq / E is its share at perfect balance times gamma). The rule
this repository follows, deterministic and the same whatever P: **for every expert, the tokens routed to it
in global token order, the first `capacity` kept**. A dropped (token, expert) pair contributes nothing, the
remaining weights are not renormalised; in the block the residual carries a token whose every choice was
dropped. gamma = None: no capacity, nothing dropped.

The load-balancing loss (Switch, GShard): with phi_i the fraction of the step's kappa N seq choices that
went to expert i (counted before drops; Switch's f_i) and pi_i the mean gate of expert i over the step's
tokens (Switch's P_i),

    L_aux = E sum_i phi_i pi_i,

which is 1 at perfect balance. phi comes from an argmax and carries no gradient; pi carries the router's.
The training loss is L_task + alpha L_aux.

Nothing here knows about ranks: the capacity loop below is the single-process rule, and lesson 10's
expert-parallel layer is checked against it, never against itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from distlab.proof.models import MLP, Block


@dataclass(frozen=True)
class MoEConfig:
    dim: int  # d
    heads: int  # h, of the block's attention
    ffn: int  # d_ff, of each expert
    experts: int  # E
    top_k: int  # kappa, experts per token (1 or 2)
    capacity_factor: float | None  # gamma; None: no capacity, nothing dropped
    aux_weight: float = 0.01  # alpha, the load-balancing loss's weight
    seed: int = 0


def capacity(cfg: MoEConfig, tokens: int) -> int | None:
    """The most tokens an expert takes in a step of `tokens` tokens: ceil(gamma kappa tokens / E), or None."""
    if cfg.capacity_factor is None:
        return None
    return math.ceil(cfg.capacity_factor * cfg.top_k * tokens / cfg.experts - 1e-9)


@dataclass
class Routing:
    """What the router decided for some tokens (rows): every gate, the kappa experts chosen and their weights."""

    gates: torch.Tensor  # (tokens, E): softmax over the experts
    chosen: torch.Tensor  # (tokens, kappa): expert indices, best first
    weights: torch.Tensor  # (tokens, kappa): combine weights of the chosen


def route(router: nn.Linear, u: torch.Tensor, top_k: int) -> Routing:
    """Softmax gate, top-kappa, the combine weights (renormalised over the chosen when kappa > 1)."""
    gates = torch.softmax(router(u), dim=-1)
    best, chosen = gates.topk(top_k, dim=-1)
    weights = best / best.sum(-1, keepdim=True) if top_k > 1 else best
    return Routing(gates, chosen, weights)


def choice_counts(routing: Routing, experts: int) -> torch.Tensor:
    """How many of these tokens chose each expert (before any drop): E integers."""
    return torch.bincount(routing.chosen.flatten(), minlength=experts)


def kept_choices(routing: Routing, capacity: int | None) -> torch.Tensor:
    """(tokens, kappa) booleans: which choices the capacity rule keeps. For every expert, the (token, slot)
    pairs that chose it in global token order (a token chooses an expert at most once); the first
    `capacity` kept, the rest dropped. Every choice kept when `capacity` is None."""
    kept = torch.ones_like(routing.chosen, dtype=torch.bool)
    if capacity is not None:
        for i in range(routing.gates.shape[-1]):
            tokens, slots = (routing.chosen == i).nonzero(as_tuple=True)  # row-major: token order
            kept[tokens[capacity:], slots[capacity:]] = False
    return kept


def balance_loss(phi: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """E sum_i phi_i pi_i: phi the fractions of choices per expert, pi the mean gates."""
    return len(phi) * (phi * pi).sum()


def make_experts(cfg: MoEConfig, dtype: torch.dtype) -> nn.ModuleDict:
    """The E expert MLPs, keyed by their global index ("0" .. "E-1"), drawn from the config's seed."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    return nn.ModuleDict({str(i): MLP(cfg.dim, cfg.ffn, gen, dtype) for i in range(cfg.experts)})


class MoE(nn.Module):
    """The MoE MLP on the whole batch in one process: u (tokens, d) -> (MoE(u), L_aux)."""

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype = torch.float64):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False, dtype=dtype)
        with torch.no_grad():  # PyTorch's default U(-1/sqrt(d), 1/sqrt(d)), from our own generator
            bound = cfg.dim**-0.5
            self.router.weight.uniform_(-bound, bound, generator=torch.Generator().manual_seed(cfg.seed + 2))
        self.experts = make_experts(cfg, dtype)

    def forward(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routing = route(self.router, u, self.cfg.top_k)
        kept = kept_choices(routing, capacity(self.cfg, len(u)))
        out = torch.zeros_like(u)
        for i in range(self.cfg.experts):
            tokens, slots = ((routing.chosen == i) & kept).nonzero(as_tuple=True)
            if len(tokens):
                weight = routing.weights[tokens, slots].unsqueeze(-1)
                out = out.index_add(0, tokens, weight * self.experts[str(i)](u[tokens]))
        phi = choice_counts(routing, self.cfg.experts).to(u.dtype) / (self.cfg.top_k * len(u))  # (in u's dtype:
        return out, balance_loss(phi, routing.gates.mean(0))  # integers divided would give torch's default float32)


class MoEBlock(nn.Module):
    """The ground floor's pre-LayerNorm block (`distlab.proof.models.Block`: its LayerNorms and attention) with
    the MLP replaced by a mixture of experts:

        y = x + Attention(LN_1(x)),    z = y + MoE(LN_2(y)),    forward(x) = (z, L_aux).

    `moe` is any module u -> (MoE(u), L_aux): `MoE` here, or lesson 10's expert-parallel layer."""

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype = torch.float64):
        super().__init__()
        dense = Block(cfg.dim, cfg.heads, cfg.ffn, seed=cfg.seed, dtype=dtype)
        self.ln1, self.attn, self.ln2 = dense.ln1, dense.attn, dense.ln2
        self.moe = MoE(cfg, dtype)

    def tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, u): the residual stream after attention, and the MoE's rows u = LN_2(y), (N seq, d)."""
        y = x + self.attn(self.ln1(x))
        return y, self.ln2(y).reshape(-1, y.shape[-1])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, u = self.tokens(x)
        mixed, aux = self.moe(u)
        return y + mixed.view_as(y), aux
