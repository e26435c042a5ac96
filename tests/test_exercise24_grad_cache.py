"""Exercise 24: GradCache's three steps, judged on one rank (the lesson's part 1), dropout off and on.

The reference is plain autograd on the whole batch with the very dropout masks the answer's first pass
draws: the same seed, the towers run on the same parts in the same order, with a graph. The lesson's
claims, dropout off and on: the loss equals the reference's, and every parameter's gradient does (float64,
rtol 1e-10), with parts of b = 3 rows that do not divide n = 10 (4 parts: as many parts as rows in a part nowhere);
and beyond numbers, each part's backward in step (3) receives the rows of G = dL/dH of that very part (the judge
sees which rows of the reference's G each part's forward with a graph is next given), no tower ever runs with a
graph on more than b rows, and each row runs with a graph once (forward hooks count the rows)."""

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from exercise_kit import Exercise
from exercise_signatures import Equals, Mistake, Scaled
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distlab.contrastive.losses import clip_loss
from distlab.pieces.random_state import RandContext
from distlab.proof.compare import grads_of
from distlab.proof.models import TwoTower, paired_data

LESSON, NAME = "grad_cache", "grad_cache_step"
N, B, TAU, SEED, D = 10, 3, 0.1, 7, 8  # D: the towers' output width
PARTS = -(-N // B)  # K = 4 parts: 3, 3, 3, 1 rows (4 parts of 3 rows: cut into B parts, 3 of 4, 4, 2 rows)
PER_PART = "the gradient of the sum of each part's own loss (the batch cut into K small batches)"


def _loss(rep_x, rep_y):
    return clip_loss(F.normalize(rep_x, dim=-1), F.normalize(rep_y, dim=-1), 1 / TAU)


def _rows_with_graph(towers: list[nn.Module]) -> list[list[int]]:
    """Per tower, the rows of every forward it runs with a graph."""
    rows = [[] for _ in towers]

    def counter(seen: list):
        def hook(module, inputs, out):
            if torch.is_grad_enabled():
                seen.append(len(inputs[0]))

        return hook

    for tower, seen in zip(towers, rows):
        tower.register_forward_hook(counter(seen))
    return rows


class Received(TorchDispatchMode):
    """Step (3) as the judge sees it: every forward a tower runs with a graph (which tower, which rows of its
    input) and, in order, every rows x D tensor (or its flattening) an op is given, a copy. `pairs(G)` reads them:
    the first block of rows of G (of either tower) given after each forward with a graph is what that part's
    backward received."""

    def __init__(self, towers: list[nn.Module], inputs: tuple) -> None:
        super().__init__()
        self.events: list = []
        for k, (tower, inp) in enumerate(zip(towers, inputs)):
            tower.register_forward_hook(lambda module, args, out, k=k, inp=inp: self._forward(k, args[0], inp))

    def _forward(self, k: int, part: torch.Tensor, inp: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            self.events.append(("forward", k, _rows_in(part.detach().reshape(len(part), -1), inp)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and (t.shape[-1:] == (D,) or t.dim() == 1):
                if t.numel() and t.numel() % D == 0 and t.numel() < N * D:
                    self.events.append(("given", t.detach().clone().reshape(-1, D)))
        return func(*args, **(kwargs or {}))

    def pairs(self, caches: list[torch.Tensor]) -> list[tuple]:
        """(tower, its part's rows, (tower whose G, rows of it) or None) for each part given a block of G."""
        found, current = [], None
        for event in self.events:
            if event[0] == "forward":
                current = event[1:]
            elif current is not None:
                block = next(((k, r) for k, g in enumerate(caches) if (r := _rows_in(event[1], g))), None)
                if block is not None:
                    found.append((*current, block))
                    current = None
        return found


def _rows_in(block: torch.Tensor, whole: torch.Tensor) -> tuple[int, int] | None:
    """(first, last) when `block` is rows first..last of `whole`, else None."""
    n = len(block)
    for a in range(len(whole) - n + 1):
        if block.shape[1:] == whole.shape[1:] and torch.allclose(block, whole[a : a + n], rtol=1e-9, atol=1e-15):
            return a, a + n - 1
    return None


def _received(pairs: list[tuple], towers: int) -> tuple[bool, str]:
    """Whether every part's backward received its own rows of its tower's G, every row once; and what each
    part received that was not its own."""
    names = "xy"
    wrong = [
        f"tower {names[k]}'s part of rows {rows[0]}..{rows[1]} received rows {got[1][0]}..{got[1][1]} of "
        f"G_{names[got[0]]}"
        for k, rows, got in pairs
        if (k, rows) != (got[0], got[1])
    ]
    covered = [sorted(r for k, rows, (g, r) in pairs if k == g == t) for t in range(towers)]
    whole = all(sum(b - a + 1 for a, b in c) == N and c[0][0] == 0 for c in covered if c)
    if not wrong and not (all(covered) and whole):
        wrong = [f"the parts given rows of G cover {', '.join(f'{len(c)}' for c in covered)} parts, not {PARTS}"]
    return not wrong, "; ".join(wrong) or "every part received its own rows of G"


def _per_part(model: TwoTower, x, y) -> dict:
    """The misreading: each part of b pairs treated as a batch of its own, the parts' gradients added."""
    twin = copy.deepcopy(model)
    for part_x, part_y in zip(x.split(B), y.split(B)):
        _loss(twin.encoder_x(part_x), twin.encoder_y(part_y)).backward()
    return grads_of(twin)


def _ranks(rt, grad_cache_step, claims) -> None:
    for dropout in (0.0, 0.3):
        case = f"dropout {dropout}"
        model, ref = TwoTower(dropout=dropout, seed=1), TwoTower(dropout=dropout, seed=1)
        x, y = paired_data(N, seed=2)
        towers = [model.encoder_x, model.encoder_y]
        alternatives = {PER_PART: _per_part(model, x, y)} if not dropout else {}
        rows, received, raised = _rows_with_graph(towers), Received(towers, (x, y)), None
        torch.manual_seed(SEED)
        with received:
            try:
                loss = grad_cache_step(towers, (x, y), B, _loss)
            except NotImplementedError:  # the blank
                raise
            except RuntimeError as err:  # told below when a part received rows not its own, else raised again
                raised = err
        torch.manual_seed(SEED)  # the same masks, drawn in the same order
        parts = [[tower(part) for part in inp.split(B)] for tower, inp in ((ref.encoder_x, x), (ref.encoder_y, y))]
        reps = [torch.cat(p) for p in parts]
        for rep in reps:
            rep.retain_grad()
        ref_loss = _loss(*reps)
        ref_loss.backward()
        own, said = _received(received.pairs([rep.grad for rep in reps]), len(towers))
        if raised is not None and own:
            raise raised
        claims.holds(
            f"{case}: in step (3) each part's backward receives the rows of G = dL/dH of that very part",
            own and raised is None,
            what="the rows of G each part's backward received",
            note=said + (f"; then the step raised {type(raised).__name__}: {raised}" if raised else ""),
            hints=("G = dL/dH has a row per row of the batch: part k of b rows pairs with G's rows kb .. kb + b - 1",),
        )
        if raised is not None:
            return
        claims.equal(
            f"{case}: the loss equals the whole batch's",
            float(loss),
            ref_loss.item(),
            ok=abs(float(loss) - ref_loss.item()) < 1e-10,
            what="L",
        )
        claims.tensors(
            f"{case}: every parameter's gradient equals the whole batch's",
            grads_of(model),
            grads_of(ref),
            what="the gradients",
            alternatives=alternatives,
        )
        largest, total = [max(r, default=0) for r in rows], [sum(r) for r in rows]
        claims.equal(
            f"{case}: each tower runs with a graph on at most b rows at a time, every row once",
            (largest, total),
            ([B, B], [N, N]),
            ok=max(largest) <= B and total == [N, N],
            what="(largest forward with a graph, rows with a graph) per tower",
            hints=("step (1) keeps no graph: only step (3) runs with one, part by part",),
        )


MISTAKES = (
    Mistake(
        "the random state not replayed",
        "dropout 0.3: every parameter",
        (),
        (
            "with dropout off the gradients are right: what differs between step (1) and step (3) when it is on?",
            "step (3) must draw the same dropout masks as step (1): record each part's random state before its "
            "first forward, restore it for the second",
            "state = RandContext(part) before step (1)'s forward; `with state: h = tower(part)` in step (3)",
        ),
        holds=("dropout 0.0: every parameter", "loss equals"),
    ),
    Mistake(
        "each part's own loss",
        "dropout 0.0: every parameter",
        (Equals(PER_PART),),
        (
            "the loss couples all n pairs: a part's gradient depends on every other part's representations",
            "compute the loss once, on every part's representations, and cache G = dL/dH for all n rows",
            "step (2): L = loss_fn(*leaves) on the whole batch; step (3) back-propagates <h, G[part]> per part",
        ),
    ),
    Mistake(
        "G divided by the number of parts",
        "dropout 0.0: every parameter",
        (Scaled("1/K", lambda p: 1 / PARTS),),
        (
            "the parts' backwards add up to the whole batch's gradient: nothing to average",
            "<h_k, G_k> summed over the parts is <H, G>, whose gradient is dL/dtheta exactly",
            "back-propagate torch.dot(h.flatten(), g.flatten()), not divided by the number of parts",
        ),
    ),
)


def _three_steps(towers, inputs, b, loss_fn, slip: str | None):
    """GradCache as a learner writes it, with one slip (None: none): "no replay", "divided", "graph kept"."""
    parts = [x.split(b) for x in inputs]
    states, reps = [[] for _ in towers], [[] for _ in towers]
    with torch.no_grad() if slip != "graph kept" else torch.enable_grad():
        for tower, cut, state, rep in zip(towers, parts, states, reps):
            for part in cut:
                state.append(RandContext(part))
                rep.append(tower(part))
    leaves = [torch.cat(rep).detach().requires_grad_() for rep in reps]
    loss = loss_fn(*leaves)
    loss.backward()
    for tower, cut, state, leaf in zip(towers, parts, states, leaves):
        for part, replay, g in zip(cut, state, leaf.grad.split(b)):
            with replay if slip != "no replay" else torch.enable_grad():
                h = tower(part)
            scale = len(cut) if slip == "divided" else 1
            (torch.dot(h.flatten(), g.flatten()) / scale).backward()
    return loss.detach()


def without_replay(towers, inputs, b, loss_fn):
    """Step (3) draws new dropout masks instead of replaying step (1)'s."""
    return _three_steps(towers, inputs, b, loss_fn, "no replay")


def each_part_alone(towers, inputs, b, loss_fn):
    """No cache at all: the batch cut into parts of b pairs, each part's loss back-propagated."""
    for part_x, part_y in zip(*(x.split(b) for x in inputs)):
        loss = loss_fn(towers[0](part_x), towers[1](part_y))
        loss.backward()
    return loss.detach()


def divided_by_parts(towers, inputs, b, loss_fn):
    """Each part's <h, G> divided by the number of parts, as if averaging accumulated micro-batches."""
    return _three_steps(towers, inputs, b, loss_fn, "divided")


def graph_kept(towers, inputs, b, loss_fn):
    """Right numbers, step (1) run with a graph: every row's activations kept until the end."""
    return _three_steps(towers, inputs, b, loss_fn, "graph kept")


# World sizes: one process: GradCache is the lesson's part 1, on one rank.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    1,
    MISTAKES,
    hints=(
        "the parameters reach the loss only through the n x d representations H: cache dL/dH",
        "(1) H without a graph, part by part; (2) the loss on H as leaves, backward gives G; (3) each part again "
        "with a graph, under the same random state, back-propagating <h, G[part]>",
        "leaves = [torch.cat(reps).requires_grad_()]; loss_fn(*leaves).backward(); per part: "
        "`with state: h = tower(part)`, then torch.dot(h.flatten(), leaf.grad[part].flatten()).backward()",
    ),
    numbers="loss|gradient",
    quantities=lambda p: {"N": N, "B": B},
)
WRONG = {
    "the random state not replayed": "without_replay",
    "each part's own loss": "each_part_alone",
    "G divided by the number of parts": "divided_by_parts",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"graph_kept": "at most b rows"})

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
