"""Exercise 27: two steps of CLIP training with distributed_backward, judged on 2 ranks.

A small DigitsCLIP (float64, learned scale started just above open_clip's bound of 100) under DDP takes
two steps of the answer on each rank's C rows (micro-batches of B < C: the recompute path) with SGD and a
tight clipping norm; the reference is a deep copy stepped in one process: plain autograd on clip_loss over
the whole batch, the same clipping, SGD and clamp. The lesson's claims, at each step: the loss is the whole
batch's, and every parameter's update, the logit scale's included, equals the reference's (float64, rtol
1e-10)."""

import copy
import math
from pathlib import Path

import torch
from exercise_kit import Exercise
from exercise_signatures import Equals, Mistake, Proportional, Tensors
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.digits import DigitsCLIP
from distlab.contrastive.losses import clip_loss
from distributed_clip import distributed_backward

LESSON, NAME = "train_clip", "clip_step"
P, C, VOCAB, LENGTH, LR, CLIP_NORM = 2, 4, 12, 5, 0.5, 1e-2
CONFIG = {"GLOBAL_BATCH_SIZE": P * C, "MICRO_BATCH_SIZE": 3, "STREAM_CHUNK_SIZE": 3}
CLAMP_FIRST = "the reference's step with the clamp run before the optimizer's step, not after"
TOWERS_ONLY = "the reference's step with the norm clipped over the towers alone, the logit scale left out"


def _reference_step(ref, images, ids, clamp_first: bool = False, towers_only: bool = False, seen=None):
    """One step of the whole batch in one process, plain autograd: clip, SGD, then the clamp (or one of
    two misreadings: the clamp first; the logit scale left out of the clipped norm); returns the loss."""
    optimizer = torch.optim.SGD(ref.parameters(), lr=LR)  # plain SGD keeps no state: a fresh one is the same
    optimizer.zero_grad()
    loss = clip_loss(*ref(images, ids))  # z_x, z_y, s: the whole batch
    loss.backward()
    if seen is not None:  # the whole batch's gradient, before the clipping
        seen["whole"] = _grads(ref)
    clipped = [p for n, p in ref.named_parameters() if not (towers_only and n == "logit_scale")]
    torch.nn.utils.clip_grad_norm_(clipped, CLIP_NORM)
    if seen is not None:
        seen["clipped"] = _grads(ref)
    if clamp_first:
        ref.clamp_logit_scale_()
    optimizer.step()
    if not clamp_first:
        ref.clamp_logit_scale_()
    return loss


def _ranks(rt, clip_step, claims) -> None:
    gen = torch.Generator().manual_seed(5)
    images = torch.randn(P * C, 1, 8, 8, generator=gen, dtype=torch.float64)
    ids = torch.randint(1, VOCAB, (P * C, LENGTH), generator=gen)
    model = DigitsCLIP(VOCAB, LENGTH, dim=8, width=4, seed=1).double()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100.0) + 0.05)  # s just above the bound: the clamp has work to do
    ref, ddp, rows = copy.deepcopy(model), DDP(model), slice(rt.rank * C, (rt.rank + 1) * C)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    stepped = []  # the gradient each optimizer step used, recorded as the step starts
    names = {p: n for n, p in model.named_parameters()}
    ran = _order(optimizer, ddp, model)  # backward, zero_grad, step, in the order the answer ran them
    optimizer.register_step_pre_hook(lambda opt, *_: stepped.append(_grads_of(names)))
    for step in (1, 2):
        mine, theirs = _values(model), _values(ref)
        del ran[:]
        loss = clip_step(ddp, optimizer, images[rows], ids[rows], CONFIG, CLIP_NORM)
        misread, towers = copy.deepcopy(ref), copy.deepcopy(ref)
        _reference_step(misread, images, ids, clamp_first=True)
        _reference_step(towers, images, ids, towers_only=True)
        grads = {}
        ref_loss = _reference_step(ref, images, ids, seen=grads)
        claims.equal(
            f"step {step}: the loss is the whole batch's",
            float(loss),
            ref_loss.item(),
            ok=abs(float(loss) - ref_loss.item()) < 1e-10,
            what="L",
        )
        claims.tensors(
            f"step {step}: every parameter's update equals one process's",
            {n: p - mine[n] for n, p in _values(model).items()},
            {n: p - theirs[n] for n, p in _values(ref).items()},
            what="the updates",
            alternatives={
                CLAMP_FIRST: {n: p - theirs[n] for n, p in _values(misread).items()},
                TOWERS_ONLY: {n: p - theirs[n] for n, p in _values(towers).items()},
            },
        )
        claims.equal(
            f"step {step}: the optimizer steps with the whole batch's gradient, its global norm clipped",
            stepped_with(stepped[-1] if len(stepped) == step else None, grads["whole"], grads["clipped"], ran),
            "the whole batch's gradient, clipped to the norm bound",
            what="what the optimizer's step used",
            hints=("look at .grad when optimizer.step() starts: clip the global norm, after the backward",),
        )


def _order(optimizer, ddp, model) -> list:
    """A list that fills, as the answer runs, with "backward" (a gradient accumulated into a parameter; once a
    run of them), "zero_grad" (the optimizer's or the model's) and "step" (the optimizer's)."""
    ran = []
    for owner in (optimizer, ddp):
        plain = owner.zero_grad
        owner.zero_grad = lambda *a, plain=plain, **k: (ran.append("zero_grad"), plain(*a, **k))[1]

    def backward(_) -> None:
        if ran[-1:] != ["backward"]:
            ran.append("backward")

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(backward)
    optimizer.register_step_pre_hook(lambda *_: ran.append("step"))
    return ran


def _grads_of(names: dict) -> dict:
    """Every parameter's .grad as an optimizer step starts (None where it has none)."""
    return {n: None if p.grad is None else p.grad.clone() for p, n in names.items()}


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def stepped_with(used: dict | None, whole: dict, clipped: dict, ran: list = ()) -> str:
    """What the gradient an optimizer step used is, in words, told from the whole batch's gradient G and G
    clipped: "the whole batch's gradient, clipped to the norm bound" (right), "... not clipped", "... each
    value clamped to +-the bound", "... each tensor's norm clipped on its own", "k x the whole batch's
    gradient" (clipped to another bound), or its global norm against the bound's."""
    if used is None:
        return "no optimizer step, or more than one, in the call"
    empty = [n for n, g in used.items() if g is None]
    if empty:  # what the answer had run by then says where the gradient went
        which = "every parameter" if len(empty) == len(used) else ", ".join(empty)
        return f"no gradient: .grad was None on {which} as optimizer.step() started (the answer ran {', '.join(ran)})"

    def same(a: dict) -> bool:
        return set(a) == set(used) and all(torch.allclose(used[n], a[n], rtol=1e-9, atol=1e-14) for n in a)

    def norm(g: dict) -> float:
        return math.sqrt(sum((t * t).sum().item() for t in g.values()))

    def each_norm(n: str) -> torch.Tensor:
        return whole[n] * min(1.0, CLIP_NORM / (whole[n].norm().item() + 1e-6))  # clip_grad_norm_'s own eps

    readings = {
        "the whole batch's gradient, clipped to the norm bound": clipped,
        "the whole batch's gradient, not clipped": whole,
        "the whole batch's gradient, each value clamped to +-the bound": {
            n: g.clamp(-CLIP_NORM, CLIP_NORM) for n, g in whole.items()
        },
        "the whole batch's gradient, each tensor's norm clipped on its own": {n: each_norm(n) for n in whole},
    }
    for words, value in readings.items():
        if same(value):
            return words
    if set(used) == set(whole):
        k = sum((used[n] * whole[n]).sum().item() for n in whole) / norm(whole) ** 2
        if all(torch.allclose(used[n], k * whole[n], rtol=1e-9, atol=1e-14) for n in whole):
            return f"{k:.6g} x the whole batch's gradient (global norm {norm(used):.6g}; the bound is {CLIP_NORM:g})"
    return f"a gradient of global norm {norm(used):.6g}, no multiple of the whole batch's (the bound is {CLIP_NORM:g})"


def _values(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


MISTAKES = (
    Mistake(
        "the logit scale left out of the clipped norm",
        "step 1: every parameter",
        (Equals(TOWERS_ONLY),),
        (
            "the gradient was clipped, but its norm left out one parameter: every update is off by a little",
            "the bound is on the norm of every trainable parameter's gradient together, the logit scale's "
            "included: leave none out of the list",
            "torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)",
        ),
    ),
    Mistake(
        "the gradient not clipped",
        "step 1: every parameter",
        (Proportional(but=("logit_scale",)),),
        (
            "every update is the same multiple of the reference's: the step used a gradient whose norm was never "
            "bounded (not clipped, or clipped only after the step had used it)",
            "clip the global norm of the gradient (all trainable parameters together) after the backward, "
            "before the step",
            "torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)",
        ),
        holds=("step 1: the loss",),
    ),
    Mistake(
        "the clamp before the step",
        "step 1: every parameter",
        (Tensors(("logit_scale",)), Equals(CLAMP_FIRST)),
        (
            "the clamp ran, but before the optimizer's step: the step then carries s past its bound again",
            "the bound holds for the parameter the next forward reads: clamp after optimizer.step(), not before",
            "optimizer.step(); ddp.module.clamp_logit_scale_()  (in that order)",
        ),
    ),
    Mistake(
        "the logit scale not clamped",
        "step 1: every parameter",
        (Tensors(("logit_scale",)),),
        (
            "only the logit scale moved differently: open_clip keeps s = exp(logit_scale) in [1, 100]",
            "after the optimizer's step, clamp the scale back into its bound",
            "ddp.module.clamp_logit_scale_() after optimizer.step()",
        ),
    ),
    Mistake(
        "the gradients never zeroed",
        "step 2: every parameter",
        (),
        (
            "step 1 is right and step 2 is not: what does step 2 start from?",
            "distributed_backward adds into .grad, as loss.backward() does: last step's gradient is still there",
            "optimizer.zero_grad(set_to_none=True) first",
        ),
        holds=("step 1",),
    ),
)


def without_clipping(ddp, optimizer, images, captions, config, clip_norm, bf16=False):
    """The step without clipping the gradient's norm."""
    optimizer.zero_grad(set_to_none=True)
    loss = distributed_backward(ddp, images, captions, config)
    optimizer.step()
    ddp.module.clamp_logit_scale_()
    return loss


def without_clamp(ddp, optimizer, images, captions, config, clip_norm, bf16=False):
    """The step with s left wherever the optimizer put it."""
    optimizer.zero_grad(set_to_none=True)
    loss = distributed_backward(ddp, images, captions, config)
    torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)
    optimizer.step()
    return loss


def clamp_before_step(ddp, optimizer, images, captions, config, clip_norm, bf16=False):
    """The clamp where it does nothing: before the step that moves s again."""
    optimizer.zero_grad(set_to_none=True)
    loss = distributed_backward(ddp, images, captions, config)
    torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)
    ddp.module.clamp_logit_scale_()
    optimizer.step()
    return loss


def towers_only_clipped(ddp, optimizer, images, captions, config, clip_norm, bf16=False):
    """The norm clipped over the towers' parameters alone: the logit scale's gradient not in the norm."""
    optimizer.zero_grad(set_to_none=True)
    loss = distributed_backward(ddp, images, captions, config)
    towers = [p for n, p in ddp.module.named_parameters() if p.requires_grad and n != "logit_scale"]
    torch.nn.utils.clip_grad_norm_(towers, clip_norm)
    optimizer.step()
    ddp.module.clamp_logit_scale_()
    return loss


def without_zero_grad(ddp, optimizer, images, captions, config, clip_norm, bf16=False):
    """The step that starts from whatever the last one left in .grad."""
    loss = distributed_backward(ddp, images, captions, config)
    torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)
    optimizer.step()
    ddp.module.clamp_logit_scale_()
    return loss


# World sizes: P = 2 only: clipping and the clamp read the same at any P; exactness of the loss at P = 2 against one
# process.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "distributed_backward is loss.backward() for the global batch: the rest is any training step",
        "zero the gradients, back-propagate, bound the gradient's norm, step, keep the scale in its bound",
        "zero_grad; L = distributed_backward(ddp, images, captions, config); clip_grad_norm_; step; "
        "ddp.module.clamp_logit_scale_(); return L",
    ),
    numbers="loss|update",
    quantities=lambda p: {"C": C, "N": p * C},
)
WRONG = {
    "the logit scale left out of the clipped norm": "towers_only_clipped",
    "the gradient not clipped": "without_clipping",
    "the clamp before the step": "clamp_before_step",
    "the logit scale not clamped": "without_clamp",
    "the gradients never zeroed": "without_zero_grad",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
