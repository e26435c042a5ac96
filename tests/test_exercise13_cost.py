"""Exercise 13: one rank's bytes held and sent by hand, judged on 2 ranks and then on 3 (where (P - 1) and
2 (P - 1)/P part: a naive all-reduce's price equals the ring's at P = 2 only) against what the lesson's own runs
hold and send there (DDP, DDP recomputing every block, TP, TP + SP, float32, a 2-block stack; and DDP at a width
d = 100 whose block P = 3 does not divide, where the ring's padding shows), and against `distlab.cost`'s prediction.
A number that misses is explained in named pieces where one fits exactly (`explain`: which tensors' bytes, the
ring's padding, one pass, left out, counted twice, cut by tp where whole): what the answer counted, not a ratio.

Each rank runs every configuration once with `distlab.cost.trial.Trial` (what it holds by storage, what its forward
keeps, what its collectives send per step) and calls the answer. The claims: weights, gradients, AdamW's
moments, activations and bytes sent each equal the measurement and the cost model, exactly."""

from fractions import Fraction
from pathlib import Path

from exercise_kit import Exercise, solution
from exercise_signatures import Equals, Mistake

from distlab.cost import memory, traffic
from distlab.cost.inputs import PRECISIONS, Batch
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


def predicted(model, parallel) -> dict[str, int]:
    """distlab.cost's numbers for the same configuration."""
    rank = step_cost(model, BATCH, parallel, "float32").ranks[0]
    kept = memory.stage_activations(model, BATCH, parallel, 0, PRECISIONS["float32"], E)
    return {k: rank.memory[k] for k in ITEMS[:3]} | {"activations": kept, "sent": rank.traffic.total}


def wrong_values(model, parallel, right: dict[str, int]) -> dict[str, dict[str, int]]:
    """What each catalogued misreading computes, from the right numbers (never from the answer)."""
    tp, tokens, d = parallel.tp, BATCH.tokens, model.dim
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
        vectors = traffic.per_rank(model, BATCH, parallel, "float32").sent["tp", "all_reduce"]
        out["sent"] = {NO_VECTORS: right["sent"] - vectors}
    return out


# ---- a byte difference explained: which tensors' bytes, and how they were counted --------------------------

SINGLE = "every block's "  # how a lone tensor of the block is named among the pieces
_GROUPS = {  # named groups of a block's tensors, each held whole or cut by tp as `Transformer.block_weights` says
    "the whole biases, attn.out.bias and mlp.fc2.bias": ("attn.out.bias", "mlp.fc2.bias"),
    "every bias": (
        "ln1.bias",
        "attn.q.bias",
        "attn.k.bias",
        "attn.v.bias",
        "attn.out.bias",
        "ln2.bias",
        "mlp.fc1.bias",
        "mlp.fc2.bias",
    ),
    "the LayerNorms' weights and biases": ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"),
    "the attention's tensors": ("attn.q", "attn.k", "attn.v", "attn.out"),
    "the MLP's tensors": ("mlp.fc1", "mlp.fc2"),
}


def parts(model, batch, parallel, e: int, item: str) -> dict[str, tuple[Fraction, bool | None]]:
    """The named pieces `item`'s right number is made of, on one rank: name -> (bytes, whether tp cuts it, or
    None where cutting it means nothing), from the model's sizes alone (never from the answer)."""
    tp, layers = parallel.tp, model.layers
    if item in ("weights", "gradients", "moments"):
        copies = 2 if item == "moments" else 1
        weights = model.block_weights()
        held = {w.name: (Fraction(w.on_rank(tp) * layers * e * copies), w.split != "whole") for w in weights}
        total = sum(v for v, _ in held.values())
        out = {"one of AdamW's two moments (m or v)": (total / 2, None)} if item == "moments" else {}
        for name, members in _GROUPS.items():  # the groups first: a group's reading before a lone tensor's
            chosen = [n for n in held if any(n == m or n.startswith(m + ".") for m in members)]
            cuts = {held[n][1] for n in chosen}
            out[name] = (sum(held[n][0] for n in chosen), cuts.pop() if len(cuts) == 1 else None)
        if tp > 1:  # by how tensor parallelism holds them: what a share taken for the whole, or the reverse, misses
            out["every tensor tp cuts"] = (sum(v for v, cut in held.values() if cut), True)
            out["every tensor held whole on every rank"] = (sum(v for v, cut in held.values() if not cut), False)
        out["one of the blocks (the layers counted one off)"] = (total / layers, None)
        return out | {f"{SINGLE}{name}": value for name, value in held.items()}
    tokens, d, f = batch.global_batch // parallel.dp * batch.seq, model.dim, model.ffn
    if item == "activations":
        each = Fraction(tokens * layers * e)  # bytes of one element a token, over every block
        return {
            "the region between the parallel layers (2 d + 4 a token)": ((2 * d + 4) * each, parallel.sp),
            "the gathered inputs of q, k, v and fc1 (2 d a token)": (2 * d * each, False),
            "the inside of attention and the MLP (4 d + 2 d_ff a token)": ((4 * d + 2 * f) * each, True),
            "each block's output (d a token)": (d * each, None),
        }
    if tp == 1:
        psi_b = sum(w.numel for w in model.block_weights())
        exact = Fraction(layers * 2 * (parallel.world - 1) * psi_b * e, parallel.world)
        right = layers * 2 * (parallel.world - 1) * -(-psi_b // parallel.world) * e
        return {
            "the ring's padding of each block's gradient to P equal chunks": (right - exact, None),
            "one pass of the ring (a reduce-scatter or an all-gather)": (Fraction(right, 2), None),
            "one block's all-reduce": (Fraction(right, layers), None),
        }
    passes = Fraction(layers * 4 * (tp - 1) * tokens * d * e, tp)
    out = {"the forward's all-reduces (f-bar, g)": (passes, None), "the backward's all-reduces": (passes, None)}
    if parallel.sp:
        out["the LayerNorms' and row biases' all-reduce"] = (Fraction(2 * (tp - 1) * 6 * d * layers * e, tp), None)
    return out


def in_widths(diff: int, model, e: int, tp: int) -> str:
    """A difference read as a d + b d_ff elements in each block (on this rank, or a tp-th of it) with small
    integers a, b, the simplest first: a tensor sized with the wrong width (d where d_ff belongs), "" when none
    fits."""
    d, f = model.dim, model.ffn
    shares = ((1, ""), (tp, " / tp")) if tp > 1 else ((1, ""),)
    fits = [
        (abs(a) + abs(b), a, b, where)
        for share, where in shares
        for a in range(-4, 5)
        for b in range(-4, 5)
        if (a or b) and a * d + b * f == Fraction(diff * share, model.layers * e)
    ]
    if not fits:
        return ""
    _, a, b, where = min(fits)
    terms = " ".join(
        f"{'+' if k > 0 else '-'} {f'{abs(k)} ' if abs(k) > 1 else ''}{n}" for k, n in ((a, "d"), (b, "d_ff")) if k
    )
    terms = terms.removeprefix("+ ").replace("- ", "-", 1) if terms.startswith("- ") else terms.removeprefix("+ ")
    return f"{terms}{where} elements in each block: a tensor sized with the wrong width?"


def explain(got, want: int, pieces: dict[str, tuple[Fraction, bool | None]], tp: int, model=None, e: int = 4) -> str:
    """What a byte difference got - want is, exactly, in named pieces: a piece left out or counted twice, cut by
    tp where it is whole, counted whole where tp cuts it (within a byte: an answer may floor a fraction); else
    in the block's widths (`in_widths`). Single tensors that fit alike (bytes cannot tell the block's
    d-element vectors apart) are named together, every one of them, as one reading."""
    if not isinstance(got, int) or got == want:
        return ""
    diff, found, alike = got - want, [], {}
    for name, (size, cut) in pieces.items():
        ways = {"left out": -size, "counted twice": size}
        if tp > 1 and cut is False:
            ways["cut by tp, though whole on every rank"] = size / tp - size
        if tp > 1 and cut:
            ways[f"counted whole, though tp = {tp} cuts it"] = size * (tp - 1)
            ways["cut by tp twice"] = size / tp - size
        fits = [way for way, value in ways.items() if size and abs(value - diff) < 1]
        if name.startswith(SINGLE):
            for way in fits:
                alike.setdefault(way, []).append(name.removeprefix(SINGLE))
        else:
            found += [f"{name} {way}" for way in fits]
    for way, names in alike.items():
        one = f"one of every block's {', '.join(names)}" if len(names) > 1 else f"every block's {names[0]}"
        found.append(f"{one} {way}")
    said = "; or ".join(found[:3])
    if found:
        return f"{diff:+} bytes: exactly {said}"
    widths = in_widths(diff, model, e, tp) if model is not None else ""
    return f"off by {diff:+} bytes = {widths}" if widths else f"off by {diff:+} bytes, no one named piece"


def _ranks(rt, rank_bytes, claims) -> None:
    p = rt.world_size
    splits = [(name, parallel, MODEL, STACK) for name, parallel in solution(LESSON, "configurations").load()(p).items()]
    splits.append(("DDP at d = 100", splits[0][1], PADDED, WIDE))
    for name, parallel, model, stack in splits:
        got, right = rank_bytes(model, BATCH, parallel, E), predicted(model, parallel)
        wrong, here = wrong_values(model, parallel, right), measured(rt, name, parallel, stack)
        for item in ITEMS:
            value, alternatives = (got or {}).get(item), wrong.get(item, {})
            note = explain(value, right[item], parts(model, BATCH, parallel, E, item), parallel.tp, model, E)
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
        r"TP \+ SP: activations",
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
