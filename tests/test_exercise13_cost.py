"""Exercise 13: one rank's bytes held and sent by hand, judged on 2 ranks and then on 3 (where (P - 1) and
2 (P - 1)/P part: a naive all-reduce's price equals the ring's at P = 2 only) against what the lesson's own runs
hold and send there (DDP, DDP recomputing every block, TP, TP + SP, float32, a 2-block stack; and DDP at a width
d = 100 whose block P = 3 does not divide, where the ring's padding shows), and against `distlab.cost`'s prediction.
Then, the answer being a pure function, at three more shapes (`EXTRA`: other d, d_ff, blocks, tokens, a group of 5)
against `distlab.cost` alone. A number that misses is explained in named pieces where one fits exactly at every shape
where it missed (`cost_pieces.explain`: which tensors' bytes, the ring's padding, one pass, left out, counted twice,
cut by tp where whole, a ring priced as whole tensors): what the answer counted, not a ratio.

Each rank runs every configuration once with `distlab.cost.trial.Trial` (what it holds by storage, what its forward
keeps, what its collectives send per step) and calls the answer. The claims: weights, gradients, AdamW's
moments, activations and bytes sent each equal the measurement and the cost model, exactly."""

import dataclasses
from pathlib import Path

from cost_pieces import explain, parts
from exercise_kit import Exercise, solution
from exercise_signatures import Equals, Mistake

from distlab.cost import memory, traffic
from distlab.cost.inputs import PRECISIONS, Batch, ParallelDims
from distlab.cost.step import step_cost
from distlab.cost.trial import Stack, Trial
from distlab.proof.sizes import Transformer

LESSON, NAME, P, ALSO = "13_cost", "rank_bytes", 2, 3
MODEL, BATCH, E = Transformer(2, 96, 12, 384), Batch(12, 48), 4
STACK = Stack(MODEL, BATCH, lr=1e-3, seed=0)
# and a width P = 3 does not divide into a block's parameters (Psi_b = 118,084 at d = 100; 111,840 at d = 96 divides
# by 2, 3 and 6): there the ring's padding to P equal chunks shows, so data parallelism alone is judged at it too
PADDED = Transformer(2, 100, 4, 384)
WIDE = Stack(PADDED, BATCH, lr=1e-3, seed=0)
ITEMS = ("weights", "gradients", "moments", "activations", "sent")
ONE_PASS = "the all-reduce priced as one pass of the ring, (P-1)/P of the gradient"
NAIVE = "the all-reduce priced as P - 1 whole gradients, (P-1) Psi e"
ONE_MOMENT = "one moment, e Psi"
ALL_CUT = "every activation cut by tp, the gathered inputs too"
NO_VECTORS = "no all-reduce of the LayerNorms' and row biases' gradients"
UNPADDED = "the ring's chunks taken as Psi_b / P exactly, the padding to P equal chunks left out"
_MEASURED: dict = {}  # per process: each configuration is run once, whatever answer is judged


def measured(rt, name: str, parallel, stack: Stack = STACK) -> dict[str, int]:
    """What the lesson's own run of `parallel` (on `stack`'s sizes) held and sent on this rank."""
    key = (name, rt.world_size)
    if key not in _MEASURED:
        got = Trial(rt, stack, parallel, solution(LESSON, "OPTIONS").load()).measured(0.0)
        _MEASURED[key] = {k: got.held[k] for k in ITEMS[:3]} | {
            "activations": got.activations,
            "sent": sum(got.sent.values()),
        }
    return _MEASURED[key]


def predicted(model, parallel, batch: Batch = BATCH) -> dict[str, int]:
    """distlab.cost's numbers for the same configuration."""
    rank = step_cost(model, batch, parallel, "float32").ranks[0]
    kept = memory.stage_activations(model, batch, parallel, 0, PRECISIONS["float32"], E)
    return {k: rank.memory[k] for k in ITEMS[:3]} | {"activations": kept, "sent": rank.traffic.total}


def wrong_values(model, parallel, right: dict[str, int], batch: Batch = BATCH) -> dict[str, dict[str, int]]:
    """What each catalogued misreading computes, from the right numbers (never from the answer)."""
    tp, tokens, d = parallel.tp, batch.tokens, model.dim
    out = {"moments": {ONE_MOMENT: right["moments"] // 2}}
    if tp == 1:
        f, p = model.ffn, parallel.world
        psi_b = (4 * d * d + 4 * d) + (2 * d * f + f + d) + 4 * d  # one block's parameters
        out["sent"] = {
            ONE_PASS: right["sent"] // 2,
            NAIVE: model.layers * (p - 1) * psi_b * E,
            UNPADDED: model.layers * 2 * (p - 1) * psi_b * E // p,
        }
    if parallel.sp:
        gathered = 2 * tokens * d * E * model.layers
        out["activations"] = {ALL_CUT: right["activations"] - gathered + gathered // tp}
        vectors = traffic.per_rank(model, batch, parallel, "float32").sent["tp", "all_reduce"]
        out["sent"] = {NO_VECTORS: right["sent"] - vectors}
    return out


# Three more shapes, judged against distlab.cost alone (the answer is a pure function: no run, no rank): the blocks,
# d, d_ff, the tokens and (the last) the group apart from the judged one's, so pieces of equal bytes there part
EXTRA = (
    ("3 blocks, d = 48, d_ff = 120, 6 x 24 tokens", Transformer(3, 48, 6, 120), Batch(6, 24), 0),
    ("1 block, d = 60, d_ff = 300, 6 x 12 tokens", Transformer(1, 60, 6, 300), Batch(6, 12), 0),
    ("2 blocks, d = 40, d_ff = 100, 10 x 20 tokens, a group of 5", Transformer(2, 40, 5, 100), Batch(10, 20), 5),
)


def elsewhere(parallel) -> list[tuple]:
    """The extra shapes `parallel` fits (on its own group, or a group of 5): (label, model, batch, parallel)."""
    out = []
    for label, model, batch, group in EXTRA:
        dims = (ParallelDims(dp=group) if parallel.tp == 1 else ParallelDims(tp=group)) if group else parallel.dims
        there = dataclasses.replace(parallel, dims=dims)
        tp, sp = there.tp, there.sp
        if (
            batch.global_batch % there.dp
            or model.dim % tp
            or model.ffn % tp
            or model.heads % tp
            or sp
            and batch.seq % tp
        ):
            continue
        out.append((label, model, batch, there))
    return out


def _ranks(rt, rank_bytes, claims) -> None:
    p = rt.world_size
    splits = [(name, parallel, MODEL, STACK) for name, parallel in solution(LESSON, "configurations").load()(p).items()]
    splits.append(("DDP at d = 100", splits[0][1], PADDED, WIDE))
    for name, parallel, model, stack in splits:
        got, right = rank_bytes(model, BATCH, parallel, E), predicted(model, parallel)
        wrong, here = wrong_values(model, parallel, right), measured(rt, name, parallel, stack)
        others = [
            (label, m, b, par, rank_bytes(m, b, par, E), predicted(m, par, b))
            for label, m, b, par in elsewhere(parallel)
        ]
        misread = [wrong_values(o[1], o[3], o[5], o[2]) for o in others]
        for item in ITEMS:
            value, alternatives = (got or {}).get(item), wrong.get(item, {})
            shapes = [(value, right[item], parts(model, BATCH, parallel, E, item), parallel.tp, model)]
            shapes += [
                ((g or {}).get(item), r[item], parts(m, b, par, E, item), par.tp, m) for _, m, b, par, g, r in others
            ]
            note = explain(shapes, E)
            claims.equal(
                f"{name}: {item} = measured on {p} ranks",
                value,
                here[item],
                what=f"{item}, bytes",
                alternatives=alternatives,
                note=note if here[item] == right[item] else "",
            )
            claims.equal(
                f"{name}: {item} = distlab.cost's",
                value,
                right[item],
                what=f"{item}, bytes",
                alternatives=alternatives,
                note=note,
            )
            claims.equal(
                f"{name}: {item} at {len(others)} more shapes = distlab.cost's",
                tuple(s[0] for s in shapes[1:]),
                tuple(s[1] for s in shapes[1:]),
                alternatives={k: tuple(w.get(item, {}).get(k) for w in misread) for k in alternatives},
                what=f"{item}, bytes at {'; '.join(o[0] for o in others)}",
                note=explain(shapes[1:], E) and explain(shapes, E),
            )


MISTAKES = (
    Mistake(
        "an all-reduce priced as one pass",
        "^DDP: sent",
        (Equals(ONE_PASS),),
        (
            "an all-reduce is two passes of the ring: what does each rank send in a reduce-scatter, and again?",
            "a ring all-reduce sends 2 (P-1)/P of the tensor per rank: a reduce-scatter, then an all-gather",
            "sent = layers x 2 (P-1) ceil(Psi_b / P) e  (each block's flat gradient padded to P chunks)",
        ),
        holds=("DDP: weights",),
    ),
    Mistake(
        "an all-reduce priced as P - 1 whole gradients",
        "^DDP: sent",
        (Equals(NAIVE),),
        (
            "a ring all-reduce never sends a whole gradient: each rank sends chunks of 1/P of it",
            "P - 1 chunks to reduce-scatter, P - 1 more to all-gather: 2 (P-1)/P of the tensor, not (P-1) of it; "
            "the two agree at P = 2 only",
            "sent = layers x 2 (P-1) ceil(Psi_b / P) e",
        ),
        holds=("DDP: weights",),
    ),
    Mistake(
        "the padding to P equal chunks left out",
        "^DDP at d = 100: sent",
        (Equals(UNPADDED),),
        (
            "a ring cuts a tensor into P equal chunks; what if P does not divide its length?",
            "each block's flat gradient is padded to P ceil(Psi_b / P) elements, and every chunk travels whole: "
            "at d = 100 Psi_b = 118,084 is not a multiple of 3",
            "sent = layers x 2 (P-1) ceil(Psi_b / P) e, with ceil: -(-Psi_b // P)",
        ),
        holds=(r"^DDP: sent",),
    ),
    Mistake(
        "one moment, not two",
        "moments",
        (Equals(ONE_MOMENT),),
        (
            "AdamW keeps two running averages per parameter: which?",
            "m (the gradient's average) and v (its square's): two tensors the size of the weights",
            "moments = 2 x weights' bytes",
        ),
        holds=("weights",),
    ),
    Mistake(
        "the gathered inputs cut too",
        r"TP \+ SP: activations at",  # there at a group of 5: (P - 1)/P of them cut differs from half of them
        (Equals(ALL_CUT),),
        (
            "sequence parallelism cuts the region between the parallel layers, but not every tensor",
            "f-bar all-gathers the LayerNorm's output before q, k, v and fc1: those inputs are whole on every rank",
            "kept = (region + inside) / tp + gathered, gathered = 2 N seq d (lesson 08's cost.py)",
        ),
        holds=(r"^TP: activations",),
    ),
    Mistake(
        "the LayerNorms' gradients never reduced",
        r"TP \+ SP: sent",
        (Equals(NO_VECTORS),),
        (
            "with the sequence cut, some parameters see only this rank's tokens: what of their gradients?",
            "the LayerNorms' weights and biases and the row layers' biases get partial sums: all-reduce them once",
            "sent += layers x 2 (tp-1)/tp x 6 d e",
        ),
        holds=(r"^TP: sent",),
    ),
)


def _with(change):
    """The lesson's answer with one piece computed wrong."""

    def answer(model, batch, parallel, e):
        out = solution(LESSON, NAME).load()(model, batch, parallel, e)
        return change(out, model, batch, parallel, e)

    return answer


def _one_pass(out, model, batch, parallel, e):
    return out | ({"sent": out["sent"] // 2} if parallel.tp == 1 else {})


def _naive(out, model, batch, parallel, e):
    d, f, p = model.dim, model.ffn, parallel.world
    psi_b = (4 * d * d + 4 * d) + (2 * d * f + f + d) + 4 * d
    return out | ({"sent": model.layers * (p - 1) * psi_b * e} if parallel.tp == 1 else {})


def _unpadded(out, model, batch, parallel, e):
    d, f, p = model.dim, model.ffn, parallel.world
    psi_b = (4 * d * d + 4 * d) + (2 * d * f + f + d) + 4 * d
    return out | ({"sent": model.layers * 2 * (p - 1) * psi_b * e // p} if parallel.tp == 1 else {})


def _one_moment(out, model, batch, parallel, e):
    return out | {"moments": out["moments"] // 2}


def _all_cut(out, model, batch, parallel, e):
    gathered = 2 * batch.tokens * model.dim * e * model.layers
    return out | ({"activations": out["activations"] - gathered + gathered // parallel.tp} if parallel.sp else {})


def _no_vectors(out, model, batch, parallel, e):
    vectors = 2 * (parallel.tp - 1) * 6 * model.dim * model.layers * e // parallel.tp
    return out | ({"sent": out["sent"] - vectors} if parallel.sp else {})


ring_priced_as_one_pass = _with(_one_pass)
naive_all_reduce = _with(_naive)
unpadded = _with(_unpadded)
one_moment = _with(_one_moment)
gathered_cut_too = _with(_all_cut)
no_layernorm_reduction = _with(_no_vectors)

# World sizes: P = 2 and P = 3 (also_at): a naive all-reduce's (P - 1) Psi equals the ring's 2 (P-1)/P Psi at P = 2
# only; at P = 3 the width d = 100 leaves a remainder the ring pads.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "each item is one of lesson 07's or 08's formulas, on this rank's share: whose rows, whose columns?",
        "weights: a block's Psi_b cut by tp where q, k, v, fc1 (rows) and out, fc2 (columns) are cut; activations: "
        "lesson 08's region + gathered + inside on the rows this rank sees; sent: the ring's fractions",
        "data parallel: sent = layers 2 (P-1) ceil(Psi_b / P) e; tensor parallel: 8 (tp-1)/tp N seq d e a block, "
        "plus 2 (tp-1)/tp 6 d e with sp",
    ),
    also_at=(ALSO,),
    numbers=" = ",  # every claim here is a number of bytes: no structure to contradict a ratio's reading
)
WRONG = {
    "an all-reduce priced as one pass": "ring_priced_as_one_pass",
    "an all-reduce priced as P - 1 whole gradients": "naive_all_reduce",
    "the padding to P equal chunks left out": "unpadded",
    "one moment, not two": "one_moment",
    "the gathered inputs cut too": "gathered_cut_too",
    "the LayerNorms' gradients never reduced": "no_layernorm_reduction",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
