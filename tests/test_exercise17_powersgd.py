"""Exercise 17: PowerSGD as a DDP communication hook, judged on 3 ranks against torch's powerSGD_hook.

Each rank trains the same MLP under torch's DDP with the answer registered as its comm hook (ell = 2, the first
two steps plain, then compressed with error feedback and warm start), 5 SGD steps on its C rows. The lesson's
claims: the parameters equal those under torch's `powerSGD_hook` (float64, rtol 1e-10); and the all-reduces
send, by the ring formula 2 (P-1)/P, e x the whole bucket in each plain step and e (sum (n + m) ell + the vectors)
in each compressed one, never the whole matrices."""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from exercise_kit import Exercise, solution
from exercise_signatures import Equals, Mistake
from exercise_watch import Watch

LESSON, NAME = "powersgd", "powersgd_hook"
P, STEPS = 3, 5
ARGS = argparse.Namespace(width=24, layers=2, global_batch=24, steps=STEPS, lr=0.2, seed=3, approx_rank=2)
ARGS.min_compression_rate = 2.0
EVERYTHING = 24 * 16 + 24 + 24 * 24 + 24 + 8 * 24 + 8  # parameters of 16 -> 24 -> 24 -> 8
COMPRESSED = (24 + 16) * 2 + (24 + 24) * 2 + (8 + 24) * 2 + 24 + 24 + 8  # (n + m) ell, and the biases whole
UNCOMPRESSED, NO_FEEDBACK, SUMMED, COLD = (
    "uncompressed DDP (the mean of the whole bucket)",
    "PowerSGD without error feedback",
    "PowerSGD with V summed, not averaged",
    "PowerSGD with a fresh V every step",
)
PLAIN_SUMMED = "PowerSGD with the plain steps' gradients summed, not averaged"
FEEDBACK = "error feedback: Delta_r = M_r - what every rank uses, kept after each compressed step"
RIGHT = "M_r - what every rank uses"


def _lesson():
    return solution(LESSON, NAME).module()


def _train(rt, hook) -> dict:
    """--steps under DDP with `hook` (None: DDP's own all-reduce): the parameters by name."""
    lesson = _lesson()
    params, _, _ = lesson.train_ddp(rt, ARGS, "none" if hook is None else hook, ARGS.approx_rank)
    names = [n for n, _ in lesson.make_problem(ARGS)[0].named_parameters()]
    return dict(zip(names, params))


def _hook_bytes(watch: Watch) -> float:
    """What the watched collectives send by the ring formulas, DDP's own setup (its broadcasts, its shape
    all-gather) left out."""
    hook_only = Watch()
    hook_only.collectives = [c for c in watch.collectives if c[0] not in ("broadcast", "all_gather")]
    return hook_only.sent(P)


def _named(fn):
    """`fn` as a hook DDP accepts (a plain function of (state, bucket))."""

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return fn(state, bucket)

    return hook


def _watched(fn, kept: list):
    """`fn` as a hook DDP accepts, each compressed step's error feedback kept in `kept`: (the step, G_r as DDP
    handed it, the error stored before, the buffer the hook returned, the error stored after), read from
    `state.errors` once the hook's future holds its buffer."""
    done = [0]  # the steps completed: each ends with its last bucket

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        index, step, given = bucket.index(), done[0], bucket.buffer().clone()
        before = state.errors.get(index)
        before = None if before is None else before.clone()
        done[0] += bucket.is_last()

        def record(future):
            after = state.errors.get(index)
            if step >= _lesson().START_ITER:
                kept.append((step, given, before, future.value().clone(), None if after is None else after.clone()))
            return future.value()

        return fn(state, bucket).then(record)

    return hook


def feedback(kept: list) -> str:
    """What the answer's error feedback held after each compressed step, against Delta_r = M_r - what every rank
    uses (M_r = G_r + the error it kept before): the steps where it held something else, named."""
    named = [(step, _kept_as(given, before, used, after)) for step, given, before, used, after in kept]
    wrong = [(step, name) for step, name in named if name != RIGHT]
    if not wrong:
        return RIGHT
    if len(wrong) == len(named) and len({name for _, name in wrong}) == 1:
        return f"every compressed step ({', '.join(str(step) for step, _ in wrong)}): {wrong[0][1]}"
    return f"step {wrong[0][0]} (from 0): {wrong[0][1]}"


def _kept_as(given, before, used, after) -> str:
    if after is None:
        return "nothing (state.errors holds no error for the bucket)"
    m = given + (0 if before is None else before)
    readings = {
        RIGHT: m - used,
        "what every rank uses - M_r: the sign flipped": used - m,
        "G_r - what every rank uses: the error kept before left out of M_r": given - used,
        "M_r: what every rank uses never subtracted": m,
        "zero": torch.zeros_like(m),
    }
    if before is not None:
        readings["the error kept before, unchanged"] = before
    name = next((n for n, t in readings.items() if t.shape == after.shape and _close(after, t)), None)
    right = readings[RIGHT]
    k = (after * right).sum().item() / max((right * right).sum().item(), 1e-300) if after.shape == m.shape else 0
    if name is None and k and _close(after, k * right):
        name = f"{RIGHT}, x {k:.6g}"
    return name or "none of M_r - what every rank uses, its negative or a multiple, G_r - what every rank uses, zero"


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= 1e-9 * want.abs().max().clamp(min=1e-300))


def _ranks(rt, powersgd_hook, claims) -> None:
    lesson, kept = _lesson(), []
    with Watch() as watch:
        try:
            got = _train(rt, _watched(powersgd_hook, kept))
        except RuntimeError as err:  # DDP wraps what the hook raised
            if "not written yet" in str(err):
                raise NotImplementedError(str(err).split("NotImplementedError: ")[-1].splitlines()[0]) from err
            raise
    # DDP's construction broadcasts the parameters and all-gathers their shapes: the hook's traffic is the
    # all-reduces (a learner's other collectives are counted too, by their ring formulas)
    sent = _hook_bytes(watch)
    kept_as = feedback(kept)
    claims.equal(
        FEEDBACK,
        kept_as,
        RIGHT,
        ok=kept_as == RIGHT,
        what="the error the answer kept (state.errors)",
        hints=(
            "Delta_r is what compression took from this rank's M_r = G_r + Delta_r: M_r less what every rank now "
            "uses, added back to the next step's gradient",
        ),
    )
    torch_state = dict(zip(got, lesson.train_ddp(rt, ARGS, "torch", ARGS.approx_rank)[0]))
    claims.tensors(
        "the parameters equal those under torch's powerSGD_hook",
        got,
        torch_state,
        what="the parameters after 5 SGD steps",
        alternatives={
            UNCOMPRESSED: _train(rt, None),
            NO_FEEDBACK: _train(rt, _named(no_error_feedback)),
            SUMMED: _train(rt, _named(v_summed)),
            COLD: _train(rt, _named(cold_start)),
            PLAIN_SUMMED: _train(rt, _named(plain_summed)),
        },
    )
    formula = 2 * (P - 1) / P * 8 * (EVERYTHING * 2 + COMPRESSED * (STEPS - 2))
    claims.equal(
        "bytes sent = 2 (P-1)/P e (the bucket in the plain steps, the factors and vectors after)",
        sent,
        formula,
        what="bytes sent by the all-reduces (ring formula)",
        note=f"collectives: {dict(watch.calls())}",
        hints=("send U and V, (n + m) ell numbers per matrix, never the n m of the matrix itself",),
    )


# ---- the catalogued mistakes, as wrong hooks (the lesson's, one piece wrong) ------------------------------


def no_error_feedback(state, bucket):
    """The error E_p dropped after every step."""
    future = _lesson().powersgd_hook(state, bucket)
    state.errors.clear()
    return future


def v_summed(state, bucket):
    """V summed over the ranks, never divided by P: the compressed gradients P times too large."""
    lesson = _lesson()
    future = lesson.powersgd_hook(state, bucket)
    if state.step > lesson.START_ITER:
        for g in bucket.gradients():
            if lesson.compressed_rank(g.shape, state.ell, state.min_compression_rate):
                g.mul_(dist.get_world_size())
    return future


def plain_summed(state, bucket):
    """The first steps' whole bucket all-reduced but never divided by P."""
    lesson = _lesson()
    if state.step < lesson.START_ITER:
        bucket.buffer().mul_(dist.get_world_size())  # the lesson's hook divides by P: undone
    return lesson.powersgd_hook(state, bucket)


def cold_start(state, bucket):
    """A fresh random V every step: no warm start."""
    state.vs.clear()
    return _lesson().powersgd_hook(state, bucket)


def mean_of_everything(state, bucket):
    """The whole bucket all-reduced and averaged: no compression at all."""
    flat = bucket.buffer()
    state.all_reduce(flat, "plain")
    flat.div_(dist.get_world_size())
    state.bucket_done(bucket)
    future = torch.futures.Future()
    future.set_result(flat)
    return future


def wasteful(state, bucket):
    """Right numbers, wrong bytes: the lesson's hook, plus an all-reduce of the whole bucket thrown away."""
    dist.all_reduce(bucket.buffer().clone())
    return _lesson().powersgd_hook(state, bucket)


def chained_future(state, bucket):
    """Right, written another way: the buffer handed back through a future chained on the lesson's."""
    return _lesson().powersgd_hook(state, bucket).then(lambda future: future.value())


MISTAKES = (
    Mistake(
        "no compression",
        "parameters equal",
        (Equals(UNCOMPRESSED),),
        (
            "the hook must send the two thin factors of each matrix, not the matrix",
            "U_r = M_r V (n x ell), all-reduce; orthonormalise; V_r = M_r^T U (m x ell), all-reduce, divide by P",
            "for each compressed matrix m: bmm(m, v) into U's buffer; all_reduce; Gram-Schmidt; bmm(m.t(), u) ...",
        ),
    ),
    Mistake(
        "no error feedback",
        "parameters equal",
        (Equals(NO_FEEDBACK),),
        (
            "what the low-rank approximation leaves out must come back next step",
            "add state.errors[i] to the buffer first, keep Delta_r = M_r - (the buffer after) last, the vectors too",
            "before = flat.clone() after flat.add_(error); at the end state.errors[i] = before - flat",
        ),
    ),
    Mistake(
        "V summed, not averaged",
        "parameters equal",
        (Equals(SUMMED),),
        (
            "DDP's gradient is a mean over the ranks, not a sum",
            "U needs no 1/P (the orthonormalisation forgets its scale) but V does",
            "after the all-reduce of the V buffer: v_flat.div_(world_size)",
        ),
    ),
    Mistake(
        "the plain steps summed, not averaged",
        "parameters equal",
        (Equals(PLAIN_SUMMED),),
        (
            "the first steps are plain DDP, and DDP's gradient is a mean over the ranks, not a sum",
            "in the steps before compression starts, divide the bucket by P around its all-reduce",
            "flat.div_(world) before state.all_reduce(flat, 'plain')",
        ),
    ),
    Mistake(
        "a fresh V every step",
        "parameters equal",
        (Equals(COLD),),
        (
            "one power iteration per step only converges if it starts where the last one ended",
            "draw V once per bucket; keep the all-reduced V in state.vs and re-orthonormalise it each step",
            "if bucket.index() not in state.vs: draw; otherwise orthonormalise the V you kept",
        ),
    ),
)

# World sizes: P = 3 only: the 1/P of the plain and V steps and the ring's 2 (P-1)/P differ from 1/P^2 and (P-1) at P
# = 3.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "the gradient every rank uses is U V^T: two thin matrices all-reduced instead of one wide one",
        "plain mean for 2 steps; then add the error, U = sum M V, orthonormalise, V = mean M^T U, U V^T, new error",
        "see lessons/17_powersgd.py's powersgd_hook: bucket.gradients() are views into bucket.buffer()",
    ),
    numbers="equal",
)
WRONG = {
    "no compression": "mean_of_everything",
    "no error feedback": "no_error_feedback",
    "V summed, not averaged": "v_summed",
    "a fresh V every step": "cold_start",
    "the plain steps summed, not averaged": "plain_summed",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"wasteful": "bytes sent"})
test_the_judge_accepts_another_way = EXERCISE.accepts_test(Path(__file__), ["chained_future"])

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
