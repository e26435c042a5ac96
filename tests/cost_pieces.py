"""Exercise 13's readings of a byte number that missed (tests/test_exercise13_cost.py): the named pieces a rank's
weights, gradients, moments, activations and bytes sent are made of, from the model's sizes alone, and which of them,
counted which way, makes the difference exactly, at every shape the answer is judged at together (bytes alone cannot
tell equal-sized pieces apart at one shape; at shapes whose d, d_ff, blocks, tokens and group differ they part)."""

from fractions import Fraction

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
            "one of the two gathered inputs, q, k, v's or fc1's (d a token)": (d * each, False),
            "attention's log-sum-exp (one a head and token)": (model.heads * each, True),
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
    out[f"every f and g of the step, both passes {RING}"] = (2 * passes, None)
    if parallel.sp:
        out["the LayerNorms' and row biases' all-reduce"] = (Fraction(2 * (tp - 1) * 6 * d * layers * e, tp), None)
    return out


def _widths(diff: int, model, e: int, tp: int) -> list[tuple]:
    """A difference read as a d + b d_ff elements in each block (on this rank, or a tp-th of it), small integers
    a, b, the simplest first: (a, b, " / tp" or "")."""
    d, f = model.dim, model.ffn
    shares = ((1, ""), (tp, " / tp")) if tp > 1 else ((1, ""),)
    fits = [
        (abs(a) + abs(b), a, b, where)
        for share, where in shares
        for a in range(-4, 5)
        for b in range(-4, 5)
        if (a or b) and a * d + b * f == Fraction(diff * share, model.layers * e)
    ]
    return [fit[1:] for fit in sorted(fits)]


def _in_words(a: int, b: int, where: str, model=None, tp: int = 1) -> str:
    """The reading in words; for d - d_ff (or the reverse), the block's tensors of the width that went missing."""
    sized = ""
    if model is not None and a == -b:
        width, other = (model.ffn, "d") if b < 0 else (model.dim, "d_ff")
        share = tp if where else 1  # the tensor holds width / share elements on this rank
        names = [w.name for w in model.block_weights() if w.on_rank(tp) * share == width]
        sized = f": every block's {' or '.join(names)} sized {other}?" if names else ""
    terms = " ".join(
        f"{'+' if k > 0 else '-'} {f'{abs(k)} ' if abs(k) > 1 else ''}{n}" for k, n in ((a, "d"), (b, "d_ff")) if k
    )
    terms = terms.removeprefix("+ ").replace("- ", "-", 1) if terms.startswith("- ") else terms.removeprefix("+ ")
    return f"{terms}{where} elements in each block" + (sized or ": a tensor sized with the wrong width?")


def in_widths(diff: int, model, e: int, tp: int) -> str:
    """`_widths`' simplest reading in words ("d - d_ff elements in each block: ..."), "" when none fits."""
    fits = _widths(diff, model, e, tp)
    return _in_words(*fits[0]) if fits else ""


WAYS = {  # how a piece may have been counted, and what that adds: its bytes, tp (the group)
    "left out": lambda size, tp: -size,
    "counted twice": lambda size, tp: size,
    "cut by tp, though whole on every rank": lambda size, tp: size / tp - size,
    "counted whole, though tp = {tp} cuts it": lambda size, tp: size * (tp - 1),
    "cut by tp twice": lambda size, tp: size / tp - size,
    "priced as {tp} - 1 whole tensors, not a ring's 2 ({tp} - 1)/{tp} of them": lambda size, tp: size * (tp - 2) / 2,
}


def _fits(got: int, want: int, pieces: dict, tp: int) -> list[tuple[str, str]]:
    """Every (piece, way) whose bytes make exactly got - want (within a byte: an answer may floor a fraction)."""
    diff, found = got - want, []
    for name, (size, cut) in pieces.items():
        ways = ["left out", "counted twice"]
        ways += ["cut by tp, though whole on every rank"] if tp > 1 and cut is False else []
        ways += ["counted whole, though tp = {tp} cuts it", "cut by tp twice"] if tp > 1 and cut else []
        ways += [w for w in WAYS if w.startswith("priced") and RING in name and tp > 2]
        found += [(name, way) for way in ways if size and abs(WAYS[way](size, tp) - diff) < 1]
    return found


RING = "(a ring)"  # in a piece's name: priced by the ring's fractions, so read also as whole tensors sent


def explain(shapes: list[tuple], e: int = 4) -> str:
    """What a byte difference got - want is, exactly, in named pieces, at every shape judged where the number
    missed together (`shapes`: (got, want, pieces, tp, model), the judged one first): a piece left out or counted
    twice, cut by tp where it is whole, counted whole where tp cuts it, a ring priced as whole tensors; else in the
    block's widths (`in_widths`). Single tensors that fit alike (bytes cannot tell the block's d-element vectors
    apart at any shape) are named together, every one of them, as one reading."""
    missed = [s for s in shapes if isinstance(s[0], int) and s[0] != s[1]]
    if not missed:
        return ""
    got, want, _, tp, model = missed[0]
    diff = got - want
    every = f" (at each of the {len(missed)} shapes where it missed)" if len(missed) > 1 else ""
    each = [_fits(*s[:4]) for s in missed]
    common = [fit for fit in each[0] if all(fit in other for other in each[1:])]
    if common:
        return f"{diff:+} bytes: exactly {_said(common, tp)}{every}"
    widths = [w for w in _widths(diff, model, e, tp) if all(w in _widths(g - r, m, e, t) for g, r, _, t, m in missed)]
    if widths:
        return f"off by {diff:+} bytes = {_in_words(*widths[0], model, tp)}{every}"
    if each[0]:
        shown = "; ".join(f"{s[0] - s[1]:+}" for s in missed[1:])
        return (
            f"{diff:+} bytes: here exactly {_said(each[0], tp)}; but no one named piece fits at every shape where it "
            f"missed (off there by {shown} bytes)"
        )
    return f"off by {diff:+} bytes, no one named piece" + (" at any shape" if every else "")


def _said(fits: list[tuple[str, str]], tp: int) -> str:
    found, alike = [], {}
    for name, way in fits:
        if name.startswith(SINGLE):
            alike.setdefault(way, []).append(name.removeprefix(SINGLE))
        else:
            found.append(f"{name} {way.format(tp=tp)}")
    for way, names in alike.items():
        one = f"one of every block's {', '.join(names)}" if len(names) > 1 else f"every block's {names[0]}"
        found.append(f"{one} {way.format(tp=tp)}")
    return "; or ".join(found[:3])
