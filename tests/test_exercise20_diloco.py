"""Exercise 20: DiLoCo's outer step, judged on 2 ranks (2 islands of one rank) and on 4 (2 islands of two ranks,
lesson 20's `island_groups`, where the islands are not the world's ranks) against one process.

Each island starts from the shared weights theta, takes H = 2 SGD steps on its own rows,
and calls the answer, twice (two rounds, so the momentum counts). The lesson's claims: after each round
every island's weights equal one process's (the islands' mean pseudogradient theta - theta_i fed to
torch.optim.SGD with Nesterov momentum as its gradient; float64, rtol 1e-10), theta holds them too, and a
round sends one all-reduce of the fragment between the 2 islands (the judge prices what it sees)."""

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from exercise_kit import Exercise
from exercise_signatures import Equals, Mistake
from exercise_watch import Watch
from helpers import load_lesson

from distlab.proof.models import layered_mlp, regression_batch

LESSON, NAME = "diloco", "outer_step_by_hand"
P, ROWS, WIDTHS, H, ROUNDS, INNER_LR, LR, MU = 2, 4, (5, 8, 3), 2, 2, 0.1, 0.7, 0.9
ISLANDS, TWO_EACH = 2, 4  # two islands: of one rank each at P = 2, of two ranks each at P = 4
OVER_WORLD = "the islands' mean scaled by ISLANDS/P: a mean over the world's ranks, not over the islands"
SLIP, LOCAL, SUM = "the sign slip: theta_i - theta", "the step taken from the island's own weights", "the sum"
MOVED = "the weights after this round's inner steps (theta moved with them)"


class Nesterov:
    """The outer optimizer the answer is handed: buf = mu buf + g; param -= lr (g + mu buf)."""

    def __init__(self):
        self.buf = {}

    def step(self, param, grad) -> None:
        buf = self.buf.get(id(param))
        buf = grad.clone() if buf is None else buf.mul_(MU).add_(grad)
        self.buf[id(param)] = buf
        param.add_(grad.add(buf, alpha=MU), alpha=-LR)


def _inner(model, seed: int) -> None:
    x, y = regression_batch(ROWS, WIDTHS[0], WIDTHS[-1], seed=seed)
    for _ in range(H):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= INNER_LR * p.grad


def _theta_kept(claims, model, theta, world, rnd: int) -> None:
    """Round rnd + 1's theta, after its inner steps: the weights the last outer step left (world's, not yet
    stepped this round); which of theta's tensors share storage with the weights, where any does."""
    shared = [n for n, p in model.named_parameters() if _aliases(theta.get(p), p)]
    claims.tensors(
        f"round {rnd + 1}: theta after the inner steps still holds the round's start",
        {n: theta.get(p) for n, p in model.named_parameters()},
        {n: w.detach().clone() for n, w in world.named_parameters()},
        what="theta after the inner steps",
        alternatives={MOVED: {n: p.detach().clone() for n, p in model.named_parameters()}},
        note=f"theta shares storage with the weights: {', '.join(shared)}" if shared else "",
        hints=("theta is the round's start: a copy that the inner steps cannot move, not the weights themselves",),
    )


def _aliases(t, param) -> bool:
    return t is not None and t.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()


def _ranks(rt, outer_step_by_hand, claims) -> None:
    island, _, _, across = load_lesson("diloco").island_groups(rt)  # across: this member's group of 2 islands
    model = layered_mlp(WIDTHS, seed=1)
    world = copy.deepcopy(model)  # one process's global weights
    twins = [copy.deepcopy(model) for _ in range(P)]  # one process's islands
    outer_opt = torch.optim.SGD(world.parameters(), lr=LR, momentum=MU, nesterov=True)
    theta = {p: p.detach().clone() for p in model.parameters()}
    outer, size = Nesterov(), sum(p.numel() * 8 for p in model.parameters())
    for rnd in range(ROUNDS):
        _inner(model, seed=10 * rnd + island)  # an island's ranks train alike (its own DDP, in the lesson)
        if rnd > 0:  # the theta the answer kept last round must be the round's start still, the inner steps taken
            _theta_kept(claims, model, theta, world, rnd)
        for i, twin in enumerate(twins):
            _inner(twin, seed=10 * rnd + i)
        with torch.no_grad():
            deltas = {n: [w - t.get_parameter(n) for t in twins] for n, w in world.named_parameters()}
            slip = {
                n: w + (d[0] + d[1]) / 2 * LR * (1 + MU) for (n, w), d in zip(world.named_parameters(), deltas.values())
            }
            over_world = {
                n: w - (d[0] + d[1]) / 2 * ISLANDS / rt.world_size * LR * (1 + MU)
                for (n, w), d in zip(world.named_parameters(), deltas.values())
            }
            local = {n: twins[island].get_parameter(n) - (d[0] + d[1]) / 2 * LR * (1 + MU) for n, d in deltas.items()}
            for n, w in world.named_parameters():
                w.grad = (deltas[n][0] + deltas[n][1]) / 2
            outer_opt.step()
            for twin in twins:
                twin.load_state_dict(world.state_dict())
        with Watch() as watch:
            sent = outer_step_by_hand(model, theta, outer, across)
        alternatives = {SLIP: slip, LOCAL: local} if rnd == 0 else {}
        if rnd == 0 and rt.world_size != ISLANDS:  # the same as the right answer when every island is one rank
            alternatives[OVER_WORLD] = over_world
        if not claims.tensors(
            f"round {rnd + 1}: the weights equal one process's islands",
            dict(model.named_parameters()),
            dict(world.named_parameters()),
            what="the weights after the outer step",
            alternatives=alternatives,
            hints=("delta = theta - theta_i, averaged; the outer step starts from theta",),
        ):
            return
        claims.tensors(
            f"round {rnd + 1}: theta holds the new weights",
            {n: theta[p] for n, p in model.named_parameters()},
            dict(world.named_parameters()),
            what="theta",
        )
        claims.equal(
            f"round {rnd + 1}: bytes sent = one all-reduce of the fragment between 2 islands",
            watch.sent(P),
            size,
            what="bytes sent (ring formulas)",
            note=f"collectives: {dict(watch.calls())}",
        )
        claims.equal(f"round {rnd + 1}: the bytes returned are the bytes sent", sent, size, what="the return value")


MISTAKES = (
    Mistake(
        "the pseudogradient's sign slipped",
        "weights equal",
        (Equals(SLIP),),
        (
            "the outer optimizer subtracts its gradient: which way must delta point?",
            "delta = theta - theta_i (before minus after), the direction a gradient points",
            "delta = theta[param] - param, all-reduced and halved, then outer.step(param, delta) from theta",
        ),
    ),
    Mistake(
        "the mean over the world's ranks, not over the islands",
        "weights equal",
        (Equals(OVER_WORLD),),
        (
            "the pseudogradients are averaged over the islands, and an island may hold many ranks",
            "the all-reduce runs on `across`, one rank per island: divide by its size (the islands), not the world's",
            "delta /= dist.get_world_size(across) (or the islands' count), not dist.get_world_size()",
        ),
    ),
    Mistake(
        "the outer step from the island's own weights",
        "weights equal",
        (Equals(LOCAL),),
        (
            "every island must take the outer step from the same place",
            "the outer step starts from theta, the round's start, not from where this island went",
            "param.copy_(theta[param]) before outer.step(param, delta)",
        ),
    ),
)


def _answer(param, theta, outer, delta, start) -> None:
    param.copy_(start)
    outer.step(param, delta)
    theta[param] = param.detach().clone()


def sign_slip(fragment, theta, outer, across) -> int:
    """theta_i - theta: the weights walk away from where the islands went."""
    with torch.no_grad():
        for param in fragment.parameters():
            delta = param - theta[param]
            dist.all_reduce(delta, group=across)
            _answer(param, theta, outer, delta / 2, theta[param])
    return sum(p.numel() * 8 for p in fragment.parameters())


def from_local(fragment, theta, outer, across) -> int:
    """The outer step from this island's own weights: the islands end apart."""
    with torch.no_grad():
        for param in fragment.parameters():
            delta = theta[param] - param
            dist.all_reduce(delta, group=across)
            _answer(param, theta, outer, delta / 2, param.detach().clone())
    return sum(p.numel() * 8 for p in fragment.parameters())


def over_the_world(fragment, theta, outer, across) -> int:
    """The islands' sum divided by the world's size: right while every island is one rank."""
    with torch.no_grad():
        for param in fragment.parameters():
            delta = theta[param] - param
            dist.all_reduce(delta, group=across)
            _answer(param, theta, outer, delta / dist.get_world_size(), theta[param])
    return sum(p.numel() * 8 for p in fragment.parameters())


def rebroadcast(fragment, theta, outer, across) -> int:
    """Right numbers, bytes twice over: the stepped weights broadcast from island 0 "to be safe"."""
    with torch.no_grad():
        for param in fragment.parameters():
            delta = theta[param] - param
            dist.all_reduce(delta, group=across)
            _answer(param, theta, outer, delta / 2, theta[param])
            dist.broadcast(param, src=0, group=across)
    return sum(p.numel() * 8 for p in fragment.parameters())


# World sizes: P = 2 (islands of one rank) and P = 4 (islands of two ranks, also_at): a mean over the world's ranks
# equals the islands' mean at P = 2 only.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "the islands agree once per round, on the mean of where they went",
        "delta = theta - theta_i; one all-reduce, halve it; the step starts from theta",
        "for every parameter: delta = theta[p] - p; all_reduce; delta /= 2; p.copy_(theta[p]); "
        "outer.step(p, delta); theta[p] = p.clone()",
    ),
    also_at=(TWO_EACH,),
)
WRONG = {
    "the pseudogradient's sign slipped": "sign_slip",
    "the outer step from the island's own weights": "from_local",
    "the mean over the world's ranks, not over the islands": "over_the_world",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"rebroadcast": "bytes sent"})

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
