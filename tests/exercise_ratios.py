"""A ratio the judge measured, read in the exercise's own quantities (P, M, C, ...): the simple expressions of
one or two of them (q, 1/q, q^2, (q-1)/q, a ring's q/2, ...) and what a factor equal to each usually means. The
judge prints a reading only as one possibility (`exercise_signatures.describe`), never as the diagnosis: a
factor of 3 reads as "a sum over the P" at P = 3 whether or not the answer summed anything."""

from __future__ import annotations

import math

_READINGS = {  # an expression in one quantity q, and what a factor equal to it usually means
    "q": "{q} times too large: a sum over the {q} where a mean was wanted (or a 1/{q} left out)",
    "1/q": "divided by {q} once too often (a mean where a sum was wanted, or a 1/{q} applied twice)",
    "q^2": "{q} twice over: a sum over the {q} applied twice, or a 1/{q} left out twice",
    "1/q^2": "divided by {q} twice: the 1/{q} applied two times",
    "(q-1)/q": "one of {q} parts missing: this rank's own part left out",
    "q/(q-1)": "one part counted that should not be ({q} - 1 parts wanted, {q} summed)",
    "q/2": "({q} - 1) where 2 ({q} - 1)/{q} belongs: a ring's two passes read as {q} - 1 whole tensors",
    "2/q": "2 ({q} - 1)/{q} where ({q} - 1) belongs: a ring's price where whole tensors travel",
}


def _candidates(quantities: dict, rings: bool = True) -> list[tuple[str, float, str]]:
    """(expression, value, reading) for every quantity (those equal to 1 or 2 read nothing), the products
    and quotients of two of them, and the constants 2 and 1/2; a ring's readings (q/2, 2/q) only where
    `rings` (a claim about bytes sent)."""
    out = []
    usable = {q: float(v) for q, v in quantities.items() if isinstance(v, (int, float)) and v not in (0, 1)}
    for q, v in usable.items():
        forms = {
            "q": v,
            "1/q": 1 / v,
            "q^2": v * v,
            "1/q^2": 1 / (v * v),
            "(q-1)/q": (v - 1) / v,
            "q/(q-1)": v / (v - 1),
            "q/2": v / 2,
            "2/q": 2 / v,
        }
        for form, value in forms.items():
            if not rings and form in ("q/2", "2/q"):
                continue
            text = form.replace("q", q) if len(q) == 1 else form.replace("q", f"({q})")
            out.append((text, value, _READINGS[form].format(q=q)))
    names = list(usable)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            out.append((f"{a} {b}", usable[a] * usable[b], f"both {a} and {b} times too large"))
            out.append((f"1/({a} {b})", 1 / (usable[a] * usable[b]), f"divided by {a} and by {b} once too often"))
            out.append((f"{a}/{b}", usable[a] / usable[b], f"a factor {a} where {b} belongs"))
            out.append((f"{b}/{a}", usable[b] / usable[a], f"a factor {b} where {a} belongs"))
    out += [("2", 2.0, "twice too large: counted twice"), ("1/2", 0.5, "half: one of two halves missing")]
    return out


def name_ratio(k: float | None, quantities: dict, rings: bool = True) -> str | None:
    """ "1/P^2 = 0.111111: divided by P twice ..." when k is one of the quantities' simple expressions (the
    first that fits, the others equal to it named too, and the first of them that reads otherwise read too:
    C/(C-1) = C/P at C = 4, P = 3 is one part too many or a C where P belongs), else None."""
    if k is None:
        return None
    candidates = _candidates(quantities, rings)
    fits = [(text, reading) for text, value, reading in candidates if math.isclose(k, value, rel_tol=1e-6)]
    if not fits:
        return None
    text, reading = fits[0]
    same = sorted({t for t, _ in fits[1:] if t != text})
    also = f" (= {', '.join(same)} here)" if same else ""
    other = next(((t, r) for t, r in fits[1:] if r != reading), None)  # the same number read another way
    otherwise = f"; or, read as {other[0]}: {other[1]}" if other else ""
    return f"{text} = {k:.6g}{also}: {reading}{otherwise}"
