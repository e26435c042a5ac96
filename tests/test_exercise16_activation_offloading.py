"""Exercise 16: activation offloading, judged in one process against plain autograd.

The answer (the class `Offloader`) runs the lesson's step in place of the lesson's own: an MLP 16 -> 48 -> 48 ->
48 -> 8 on N = 32 rows, float64, with prefetch. The lesson's claims: the gradients equal those without offloading
bit for bit; the bytes copied to the host, and back, each equal lesson 07's activation formula; the device peak
of saved activations equals max (H_k + H_(k-1)) over consecutive groups. The judge reads the counts the contract
asks the class to keep (`sent`, `received`, `peak`). Then, in the same process, Linear 16 -> 12, Halves
(h[:, :6] * h[:, 6:], whose backward saves two views of one storage at offsets 0 and 6), Linear 6 -> 8: each view
comes back with its own values (Halves keeps what its backward got), each copied once, the gradients bit for bit."""

import argparse
import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F
from exercise_kit import Exercise, solution, swapped
from exercise_signatures import Equals, Mistake
from torch import nn

from distlab.data_split.sharding.accounting import mlp_activations

LESSON, NAME = "activation_offloading", "Offloader"
ARGS = argparse.Namespace(width=48, layers=3, global_batch=32, seed=4, emulate_ms=0.0, link_ms_per_mib=0.0)
E = 8
TWICE, NO_PREFETCH, NEVER_FREED = (
    "every saved tensor copied, a tensor saved twice twice",
    "no prefetch: one group resident at a time",
    "device copies never released",
)


def _ranks(rt, offloader, claims) -> None:
    lesson = solution(LESSON, NAME).module()
    plain = lesson.step(ARGS, "plain")
    with swapped(solution(LESSON, NAME), Offloader=offloader):
        run = lesson.step(ARGS, "offload")
    names = [f"parameter {k}" for k in range(len(plain["grads"]))]
    claims.tensors(
        "the gradients equal those without offloading, bit for bit",
        dict(zip(names, run["grads"])),
        dict(zip(names, plain["grads"])),
        what="the gradients",
        tol=1e-300,
    )
    widths, off = plain["widths"], run["offloader"]
    formula = mlp_activations(ARGS.global_batch, widths, E)
    doubled = formula + E * ARGS.global_batch * sum(widths[1:-1])  # each tanh output copied again
    claims.equal(
        "bytes to the host = lesson 07's formula",
        off.sent,
        formula,
        what="bytes copied to the host",
        alternatives={TWICE: doubled},
    )
    claims.equal(
        "bytes back = the same",
        off.received,
        formula,
        what="bytes copied back",
        alternatives={TWICE: doubled},
        hints=(
            "more came back than went: a group was fetched again after backward had used it and let it go",
            "backward walks the groups in reverse pack order: prefetch the group before the one it reached, "
            "never one it is done with",
        ),
    )
    groups = lesson.group_bytes(widths, ARGS.global_batch, E)
    claims.equal(
        "device peak = max (H_k + H_(k-1))",
        off.peak,
        max(a + b for a, b in zip(groups, groups[1:])),
        what="the peak of saved activations resident on the device",
        alternatives={NO_PREFETCH: max(groups), NEVER_FREED: 2 * sum(groups)},  # kept when packed, again fetched
    )
    _views(offloader, claims)


# ---- a layer whose backward saves two views of one storage -------------------------------------------------

K = 6  # the halves' width: Linear 16 -> 2K, then h[:, :K] * h[:, K:], then Linear K -> 8


class Halves(torch.autograd.Function):
    """h -> h[:, :K] * h[:, K:]: backward needs both halves, two views of h's storage at offsets 0 and K (same
    shape, same stride); what its backward got back is kept in `restored`."""

    restored: list = []

    @staticmethod
    def forward(ctx, h):
        first, second = h[:, :K], h[:, K:]
        ctx.save_for_backward(first, second)
        return first * second

    @staticmethod
    def backward(ctx, g):
        first, second = ctx.saved_tensors
        Halves.restored.append((first.detach().clone(), second.detach().clone()))
        return torch.cat([g * second, g * first], dim=1)


def _halves_step(offloader) -> tuple[list, tuple, object]:
    """One forward and backward of Linear -> Halves -> Linear -> MSE on N rows, offloaded by `offloader` (None:
    plainly); its gradients, the halves its backward got back and the offloader."""
    gen = torch.Generator().manual_seed(ARGS.seed)
    first, last = nn.Linear(16, 2 * K, dtype=torch.float64), nn.Linear(K, 8, dtype=torch.float64)
    for p in (*first.parameters(), *last.parameters()):
        p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64) / 4
    x, y = (torch.randn(ARGS.global_batch, w, generator=gen, dtype=torch.float64) for w in (16, 8))
    off = offloader([*first.parameters(), *last.parameters()], 0.0, prefetch=True) if offloader else None
    Halves.restored.clear()
    with off or contextlib.nullcontext():
        layers = (first, Halves.apply, last)
        h = x
        for k, layer in enumerate(layers):
            if off:
                off.group = k
            h = layer(h)
        if off:
            off.group = len(layers)
        loss = F.mse_loss(h, y)
        if off:
            off.drain()
    loss.backward()
    if off:
        off.close()
    grads = [p.grad for p in (*first.parameters(), *last.parameters())]
    return grads, Halves.restored[0], off


def _restored(got: tuple, want: tuple) -> str:
    """Which saved half came back holding which values: "the half at offset K came back holding the half at
    offset 0's values", or that each came back with its own."""
    said = []
    for name, g in zip(("offset 0", f"offset {K}"), got):
        holds = [n for n, w in zip(("offset 0", f"offset {K}"), want) if torch.equal(g, w)]
        if holds != [name]:
            what = f"the half at {holds[0]}'s values" if holds else "neither half's values"
            said.append(f"the saved view at {name} (columns {name[7:]}..) came back holding {what}")
    return "; ".join(said) or "each view came back with its own values"


def _views(offloader, claims) -> None:
    plain, want, _ = _halves_step(None)
    grads, got, off = _halves_step(offloader)
    restored = _restored(got, want)
    claims.holds(
        "two views of one storage (h[:, :K], h[:, K:]) each come back with their own values",
        restored == "each view came back with its own values",
        what="what Halves' backward got back",
        note=restored,
        hints=("two views of one storage at different offsets are two saved tensors: a key must tell them apart",),
    )
    saved = 8 * ARGS.global_batch * (16 + K + K + K + 8 + 8)  # x, both halves, the product, the loss's two
    claims.equal(
        "bytes to the host = every saved tensor once (two views of one storage: two copies)",
        off.sent,
        saved,
        what="bytes copied to the host, Linear -> Halves -> Linear",
        note=f"one half is {8 * ARGS.global_batch * K} bytes",
    )
    names = [f"parameter {k}" for k in range(len(plain))]
    claims.tensors(
        "Linear -> Halves -> Linear: the gradients equal those without offloading, bit for bit",
        dict(zip(names, grads)),
        dict(zip(names, plain)),
        what="the gradients",
        tol=1e-300,
    )


# ---- the catalogued mistakes: the lesson's class, one piece wrong ------------------------------------------

_Right = solution(LESSON, NAME).load()


class CopiesTwice(_Right):
    """No dedup: the tanh output the next Linear saves again travels again."""

    def pack(self, t):
        self.alive.clear()
        return super().pack(t)


class NoPrefetch(_Right):
    """Every group fetched only when backward asks for it."""

    def __init__(self, parameters, link_ms_per_mib, prefetch=True):
        super().__init__(parameters, link_ms_per_mib, prefetch=False)


class NeverFreed(_Right):
    """The device copies kept until the end: resident bytes only grow."""

    def _resident(self, nbytes):
        super()._resident(max(nbytes, 0))


MISTAKES = (
    Mistake(
        "a tensor saved twice copied twice",
        "bytes to the host",
        (Equals(TWICE),),
        (
            "a tanh's output is saved by the tanh and again by the next Linear: one storage",
            "remember the tensors you packed (address, offset, shape, stride) while they live; return the same handle",
            "if key in self.alive: self.users[handle] += 1; return handle",
        ),
    ),
    Mistake(
        "no prefetch",
        "device peak",
        (Equals(NO_PREFETCH),),
        (
            "the next group backward needs should already be travelling while this one computes",
            "on the first touch of group k, submit the fetch of the group packed before it",
            "order = list(self.groups); self._fetch(order[order.index(group) - 1])",
        ),
        holds=("gradients", "bytes"),
    ),
    Mistake(
        "device copies never released",
        "device peak",
        (Equals(NEVER_FREED),),
        (
            "a saved tensor leaves the device once its copy to the host is done, and again after its last unpack",
            "count the users of each handle; subtract its bytes when the copy finishes and when the last user unpacked",
            "future.add_done_callback(lambda _: self._resident(-nbytes)); and at users == 0: self._resident(-nbytes)",
        ),
        holds=("gradients", "bytes"),
    ),
)

# World sizes: one process: the lesson offloads within one process.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    1,
    MISTAKES,
    hints=(
        "saved_tensors_hooks(pack, unpack): pack copies to the host and returns a handle, unpack brings it back",
        "a copy thread (ThreadPoolExecutor(1)); handles by count, never by address; groups for the prefetch",
        "see lessons/16_activation_offloading.py's Offloader",
    ),
    numbers="equal",
)
WRONG = {
    "a tensor saved twice copied twice": "CopiesTwice",
    "no prefetch": "NoPrefetch",
    "device copies never released": "NeverFreed",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(
    Path(__file__), {"CopiesTwice": "bytes to the host", "NoPrefetch": "device peak"}
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
