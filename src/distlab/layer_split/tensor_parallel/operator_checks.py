"""Each communication operator against what one process computes from every rank's tensors.

Rank r feeds x_r into the operator and back-propagates sum(w_r * out); one process, holding every x_q
and w_q, knows what each rank must get (cat along dim 1 is the sequence; chunk r its r-th part):

    f       forward x_r                    backward sum_q w_q
    g       forward sum_q x_q              backward w_r
    f-bar   forward cat_q x_q              backward chunk r of sum_q w_q
    g-bar   forward chunk r of sum_q x_q   backward cat_q w_q
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.comm.ledger import Ledger
from distlab.proof.compare import Comparison, all_ok, compare_whole

ROWS, PART, WIDTH = 2, 2, 3  # a tensor (ROWS, PART * P or PART, WIDTH): small, distinct on every rank


def _full(q: int, world: int, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * salt + q)
    return torch.randn(ROWS, PART * world, WIDTH, generator=gen, dtype=torch.float64)


def _part(t: torch.Tensor, r: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=1)[r]


MATH = {  # name -> (rank r's input, rank r's output gradient weights, expected forward, expected backward)
    "f": (lambda q, p: _full(q, p, 1), lambda q, p: _full(q, p, 2), lambda xs, r, p: xs[r], lambda ws, r, p: sum(ws)),
    "g": (lambda q, p: _full(q, p, 1), lambda q, p: _full(q, p, 2), lambda xs, r, p: sum(xs), lambda ws, r, p: ws[r]),
    "f-bar": (
        lambda q, p: _part(_full(q, p, 1), q, p),
        lambda q, p: _full(q, p, 2),
        lambda xs, r, p: torch.cat(xs, dim=1),
        lambda ws, r, p: _part(sum(ws), r, p),
    ),
    "g-bar": (
        lambda q, p: _full(q, p, 1),
        lambda q, p: _part(_full(q, p, 2), q, p),
        lambda xs, r, p: _part(sum(xs), r, p),
        lambda ws, r, p: torch.cat(ws, dim=1),
    ),
}


@dataclass(frozen=True)
class OperatorResult:
    """One operator run on this rank: its forward output and its input's gradient, the bytes it sent,
    and how far each is from what one process computes (exact to 1e-12: only sums' order differs)."""

    name: str
    forward: torch.Tensor
    backward: torch.Tensor
    ledger: Ledger
    against: dict[str, Comparison]  # "forward", "backward"

    @property
    def ok(self) -> bool:
        return all_ok(self.against.values())


def check_operator(rt, name: str, function, group=None) -> OperatorResult:
    """Run `function.apply(x_r, group, ledger)` forward and backward on this rank; against one process."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    make_x, make_w, forward, backward = MATH[name]
    xs, ws = [make_x(q, p) for q in range(p)], [make_w(q, p) for q in range(p)]
    x = xs[r].clone().to(rt.device).requires_grad_()
    ledger = Ledger()
    out = function.apply(x, group, ledger)
    (out * ws[r].to(rt.device)).sum().backward()
    got, want = (
        {"forward": out.detach().cpu(), "backward": x.grad.cpu()},
        {
            "forward": forward(xs, r, p),
            "backward": backward(ws, r, p),
        },
    )
    against = {k: compare_whole({k: want[k]}, {k: got[k]}, name=k, rtol=0.0, atol=1e-12) for k in want}
    return OperatorResult(name, got["forward"], got["backward"], ledger, against)
