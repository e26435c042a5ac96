"""Exercise 15: the FP8 all-gather of ZeRO-3 shards, judged on 3 ranks against one process casting the whole
weight.

Each rank takes its shard of a 7 x 9 weight (Psi = 63, Psi_P = 21) whose largest values lie on the last rank's
shard, and calls the answer under a Watch. The claims: the gathered weight equals one process's tensorwise cast
of the whole weight, bit for bit (its bytes), on every rank; rho equals that cast's scale; and the collectives
send no more than (P-1) Psi_P bytes of weight plus at most 8 bytes per peer for the scale (the lesson's
all-gather of the amaxes sends 4, an all-reduce of one float32 8 (P-1)/P)."""

import math
from pathlib import Path

import torch
import torch.distributed as dist
from exercise_kit import Exercise
from exercise_signatures import Equals, Mistake
from exercise_watch import Watch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

LESSON, NAME, P = "15_mxfp8_sharding", "fp8_all_gather", 3
E4M3 = torch.float8_e4m3fn
PSI, PSI_P = 63, math.ceil(63 / P)
EXACT = 1e-300
OWN_AMAX = "each shard cast with its own amax, then gathered"
SIGNED = "max_f / max w, the largest value, not the largest magnitude"
CAST_AT = "each rank sends its shard cast at the agreed scale rho"
AGREED, NOTHING_SENT = "rho (the agreed scale)", "no 8-bit payload of Psi_P bytes sent (the bytes claim says what was)"


def _weight() -> torch.Tensor:
    weight = torch.randn(7, 9, generator=torch.Generator().manual_seed(15))
    weight[P * 2 :] *= 10.0  # the last rank's shard holds the largest values
    flat = weight.flatten()
    top = flat.abs().argmax()
    flat[top] = -flat[top].abs()  # the largest magnitude negative: max |w| is not max w
    return flat


def _cast(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rho = (448.0 / t.abs().max().double().clamp(min=1e-12)).float()
    return (t.float() * rho).clamp(-448, 448).to(E4M3), rho


def _shard(flat: torch.Tensor, rank: int) -> torch.Tensor:
    padded = torch.cat([flat, flat.new_zeros(P * PSI_P - PSI)])
    return padded[rank * PSI_P : (rank + 1) * PSI_P]


def _ranks(rt, fp8_all_gather, claims) -> None:
    flat = _weight()
    one, rho_one = _cast(flat)
    own = torch.cat([_cast(_shard(flat, r))[0].float() for r in range(P)])[:PSI]
    with Watch() as watch, Payloads() as payloads:
        gathered, rho = fp8_all_gather(_shard(flat, rt.rank), E4M3)
    scale = cast_at(payloads.sent, _shard(flat, rt.rank), rho_one, float((448.0 / flat.max().double()).float()))
    claims.equal(
        CAST_AT,
        scale,
        AGREED,
        ok=scale in (AGREED, NOTHING_SENT),
        what="the scale the 8-bit shard it sent was cast at",
        hints=(
            "rho maps the whole weight's amax onto max_f: the bytes sent are the cast of shard x rho, once, so that "
            "dividing by rho brings the weight back",
        ),
    )
    claims.close(
        "the gathered weight equals one process's cast bit for bit",
        gathered[:PSI].float(),
        one.float(),
        what="the gathered weight (as numbers)",
        tol=EXACT,
        alternatives={OWN_AMAX: own},
    )
    signed = float((448.0 / flat.max().double()).float())
    claims.equal(
        "rho equals one process's scale", float(rho), float(rho_one), what="rho", alternatives={SIGNED: signed}
    )
    sent = watch.sent(P)
    claims.equal(
        "bytes sent: (P-1) Psi_P of weight in 1 byte each, plus at most 8 per peer for the scale",
        sent,
        (P - 1) * (PSI_P + 4),
        ok=(P - 1) * PSI_P <= sent <= (P - 1) * (PSI_P + 8),
        what="bytes sent (ring formulas)",
        note=f"collectives: {dict(watch.calls())}",
        hints=("gather the 8-bit shards, not the float32 ones: cast first, then gather",),
    )


# what each collective sends from this rank: the argument holding it (c10d: an all-gather's inputs are its second)
SENDS = {"allgather_": 1, "_allgather_base_": 1, "allgather_coalesced_": 1, "allgather_into_tensor_coalesced_": 1}


class Payloads(TorchDispatchMode):
    """A copy of every 1-byte tensor this rank hands to a collective to send (`sent`), taken before it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd") and args:
            name = func.__name__.split(".")[0]
            if not name.startswith(("recv", "wait", "_wrap", "barrier", "monitored")):
                leaves = tree_leaves(args[SENDS.get(name, 0)] if func.namespace == "c10d" else args[0])
                self.sent += [
                    t.detach().clone() for t in leaves if isinstance(t, torch.Tensor) and t.element_size() == 1
                ]
        return func(*args, **(kwargs or {}))


def cast_at(sent: list[torch.Tensor], shard: torch.Tensor, rho: torch.Tensor, signed: float) -> str:
    """The scale this rank's 8-bit shard was cast at, named: among the Psi_P-byte payloads it sent, the first
    that is the shard cast at rho, at 1, at rho twice, at 1/rho, at its own amax's scale or at the signed max's."""
    own = 448.0 / shard.abs().max().double().clamp(min=1e-12)
    scales = {
        AGREED: rho,
        "1 (rho never applied)": torch.tensor(1.0),
        "rho^2 (rho applied twice)": rho * rho,
        "1/rho (rho inverted)": rho.reciprocal(),
        "max_f / max |shard| (this rank's own amax, not the agreed one)": own.float(),
        "max_f / max w (the signed values' max)": torch.tensor(signed),
    }
    payloads = [t.view(torch.uint8) for t in sent if t.numel() == shard.numel()]
    for name, scale in scales.items():
        want = (shard.float() * scale).clamp(-448, 448).to(E4M3).view(torch.uint8)
        if any(torch.equal(t, want) for t in payloads):
            return name
    return "none of: rho, 1, rho^2, 1/rho, its own amax's, the signed max's" if payloads else NOTHING_SENT


MISTAKES = (
    Mistake(
        "each shard cast with its own amax",
        "gathered weight equals",
        (Equals(OWN_AMAX),),
        (
            "a tensorwise scale belongs to the whole weight, and no rank sees the whole weight",
            "agree on amax first: every rank contributes max |shard|, every rank takes the maximum of all of them",
            "all-gather (or all-reduce with MAX) each shard's amax, then rho = max_f / max(amaxes); cast; gather",
        ),
    ),
    Mistake(
        "the amax of the signed values",
        "rho equals",
        (Equals(SIGNED),),
        (
            "the scale must keep the most negative value in range too: amax is a magnitude",
            "amax = max |w| over the whole weight: each rank's max of shard.abs(), then the maximum of those",
            "shard.abs().max(), not shard.max()",
        ),
    ),
)


def signed_amax(shard, fmt, group=None):
    """The amax agreed, but of the signed values: the most negative weight overflows the format."""
    amaxes = shard.new_empty(dist.get_world_size(group))
    dist.all_gather_single(amaxes, shard.max().reshape(1).float(), group=group)
    top = torch.finfo(fmt).max
    rho = (top / amaxes.max().double().clamp(min=1e-12)).float()
    whole = torch.empty(dist.get_world_size(group) * shard.numel(), dtype=torch.uint8)
    dist.all_gather_single(whole, (shard.float() * rho).clamp(-top, top).to(fmt).view(torch.uint8), group=group)
    return whole.view(fmt), rho


def own_amax(shard, fmt, group=None):
    """No agreement: rank r's shard cast with its own amax, the bytes gathered."""
    top = torch.finfo(fmt).max
    rho = (top / shard.abs().max().double().clamp(min=1e-12)).float()
    mine = (shard.float() * rho).clamp(-top, top).to(fmt)
    whole = torch.empty(dist.get_world_size(group) * shard.numel(), dtype=torch.uint8)
    dist.all_gather_single(whole, mine.view(torch.uint8), group=group)
    return whole.view(fmt), rho


def gathered_in_float32(shard, fmt, group=None):
    """Right numbers, 4 bytes an element: the float32 shards gathered, then the whole weight cast."""
    whole = torch.empty(dist.get_world_size(group) * shard.numel())
    dist.all_gather_single(whole, shard.float(), group=group)
    top = torch.finfo(fmt).max
    rho = (top / whole.abs().max().double().clamp(min=1e-12)).float()
    return (whole * rho).clamp(-top, top).to(fmt), rho


def all_reduced_amax(shard, fmt, group=None):
    """Right, written another way: the amax agreed by an all-reduce with MAX, the bytes gathered into a list."""
    amax = shard.abs().max().reshape(1).float()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    top = torch.finfo(fmt).max
    rho = (top / amax[0].double().clamp(min=1e-12)).float()
    mine = (shard.float() * rho).clamp(-top, top).to(fmt).view(torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return torch.cat(parts).view(fmt), rho


# World sizes: P = 3 only: the amax agreed over three shards, the largest magnitude (negative) on the last; (P-1)
# Psi_P has no look-alike at P = 3.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "agree on the scale, cast your own shard with it, then gather 1 byte per element",
        "amax: each rank's max |shard| gathered (or all-reduced with MAX); rho = max_f / amax as lesson 14; the "
        "cast shard viewed as uint8 so gloo can gather it",
        "dist.all_gather_single(amaxes, shard.abs().max().reshape(1), group); ...; "
        "dist.all_gather_single(whole_u8, shard_q.view(torch.uint8), group); whole_u8.view(fmt)",
    ),
    numbers="equals",
)
WRONG = {"each shard cast with its own amax": "own_amax", "the amax of the signed values": "signed_amax"}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"gathered_in_float32": "bytes sent"})
test_the_judge_accepts_another_way = EXERCISE.accepts_test(Path(__file__), ["all_reduced_amax"])

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
