"""Lesson 27: train a real CLIP with the streamed step, on scikit-learn's handwritten digits and their
captions, and classify held-out digits zero-shot.

    torchrun --nproc-per-node 2 lessons/27_train_clip.py        # P = 1, 2, 4: any P dividing N
    torchrun --nproc-per-node 2 lessons/27_train_clip.py --loss sigmoid --exchange ring

The idea. CLIP trains an image tower and a text tower so that an image and its caption land close
together and apart from the other N - 1 captions of the global batch: with unit-norm embeddings
Z_x (images), Z_y (captions) and a learned logit scale s = exp(logit_scale) = 1/tau,

    S = s Z_x Z_y^T,   L = 1/(2N) sum_i (a_i + b_i - 2 S_ii),   a = row LSE(S), b = column LSE(S)

Nothing in training says "classify": yet embed the ten prompts "the handwritten digit zero" ...
"nine", and each image's nearest prompt is a digit classifier that was never trained as one
(zero-shot). The data ships inside scikit-learn (1,797 8 x 8 images; no download): each training image
is paired with a caption from six templates ("a handwritten seven", "the number seven written by
hand", ...), drawn afresh every epoch; a fifth of the images, every digit in proportion, are held out,
and so is the prompt: its template is none of the six (its words all occur in them).

The temperature learns too. dL/dS_ij = (R_ij + Q_ij - 2 [i = j]) / (2N) and S_ij = s z_x_i . z_y_j, so
dL/ds = sum_ij dL/dS_ij S_ij / s = <G_x, Z_x> / s: a sum over each rank's rows of what the step already
has, no extra pass over the tiles (lesson 25 derives it).

What to expect. A batch of N = 256 holds about 26 images of each digit, and for an image every caption
of its digit is as good a match as its own: the loss cannot fall much below log(N / 10) = 3.2, and
stops there while zero-shot accuracy is already high. s settles where two pulls balance: separating
the digits wants it large; preferring one same-digit caption over another (the image cannot know which
template its caption was drawn from) is a mistake, and wants it small.

The sigmoid loss (`--loss sigmoid`; lesson 26). The model gains SigLIP's learned bias beta and returns
(z_x, z_y, s, beta), which is what selects the loss in `distributed_backward`: S = s Z_x Z_y^T + beta,
L = -(1/N) sum_ij log sigma(eps_ij S_ij), eps_ij = +1 on the diagonal, -1 elsewhere. Each of the N^2
pairs is its own binary classification ("does this caption belong to this image?"): no normaliser
over the batch couples a row or a column. N - 1 of each row's N pairs are negatives, so every pair
starts near "no": beta = -10 and s = 10 (SigLIP's initialisation); with beta = 0 the N^2 - N
negatives' log 2 each (L = 177 at N = 256, against 10.2 here) would swamp the first steps. The lr,
schedule and clamp stay the InfoNCE's (open_clip clamps SigLIP's s into [1, 100] too; beta is not
clamped): nothing is tuned, and held-out accuracy reaches 99% at P = 2. beta moves little (to -10.08
in 150 steps: AdamW moves it about lr a step at most). L sums each row's N terms, so its values are
not comparable with InfoNCE's. `--exchange ring` (either loss): C x d blocks pass from rank to rank
instead of an all-gather, so no rank holds N x d; the gradients are the same (lesson 26).

The mechanism. `distributed_backward` in src/distributed_clip.py (the phases in
src/distlab/streamed/step.py) adds the exact global gradient into .grad, like loss.backward();
the caller owns everything else, as in any CLIP training loop (open_clip's `train_one_epoch`):

    optimizer.zero_grad()
    with torch.autocast(device, torch.bfloat16, enabled=bf16):
        loss = distributed_backward(ddp_model, images, captions, config)   # config has no TAU: s is learned
    clip_grad_norm_(params, 1.0); optimizer.step(); scheduler.step(); model.clamp_logit_scale_()

The data, the tiny word tokenizer, the towers and the zero-shot classifier are in
src/distlab/contrastive/digits.py (each rank's rows at each step in digits_data.py); AdamW's decay
groups and the warm-up + cosine schedule in src/distlab/contrastive/optim.py. With B >= C every rank's C pairs
are one micro-batch and the towers run once per step; with B < C each micro-batch runs twice (a
no-grad embed, then a recompute with grad).

bf16 autocast helps where the towers are a large share of the step and the hardware has bf16 units
(GPUs): `--autocast auto` turns it on for CUDA. On the CPU it does not help this lesson, so auto leaves
it off. Measured on a 2-core Xeon with AMX (one thread; notebook 27 measures it again): autocast makes
the towers' forward + backward 1.2-1.3x faster at C = 128 pairs and 1.4-1.6x at 1024 (three runs), but a
step here is mostly communication and per-call overhead, and 150 steps at P = 2 took as long either
way (10.0, 10.6, 7.0 s in float32 against 10.7, 9.9, 6.8 s in bf16, interleaved on a shared machine).
`--autocast bf16` turns it on; the loss machinery runs in float32 under it either way.

A crash that loses nothing. `--checkpoint-dir DIR` writes everything the run is every
`--checkpoint-every` steps (model and learned scale, AdamW's moments, the schedule, the curves, every
rank's random generators; the data order is a function of seed and step) and resumes from the newest
whole checkpoint it finds (a save while another run's save writes the directory is refused in one line
naming that writer); `--crash-at-step 95` kills rank `--crash-rank` (default the last) at step 95 on
torchrun's first attempt. Under `torchrun --max-restarts 1` the run is restarted, resumes and ends
bit-identical to an uninterrupted one: compare the `parameters sha256` lines (src/distlab/contrastive/checkpointing.py).

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 lessons/27_train_clip.py \
        --checkpoint-dir /tmp/clip --crash-at-step 95

The self-checks. Step 1's gradients, the logit scale's (and bias's) included, equal those of a deep copy
on the whole global batch in one process (plain autograd of the run's loss, s and beta ordinary tensors); held-out
zero-shot top-1 accuracy must reach MIN_ACCURACY, eight times chance (10%), after training. The global
batches do not depend on P, so runs at P = 1, 2 and 4 are the same training: their losses and learned
temperatures agree to float32 rounding step by step (the test compares P = 1 and P = 2).
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.checkpointing import Checkpoints, parameters_sha256
from distlab.contrastive.digits import (
    SIGLIP_INIT_LOGIT_BIAS,
    ZERO_SHOT_TEMPLATE,
    DigitsCLIP,
    confusion_matrix,
    load_split,
)
from distlab.contrastive.digits_data import Digits
from distlab.contrastive.losses import clip_loss, sigmoid_loss
from distlab.contrastive.optim import decay_groups, warmup_cosine
from distlab.contrastive.reference import full_batch_gradients
from distlab.processes.console import print0, progress
from distlab.processes.flags import (
    add_global_batch,
    check_flags_against_world,
    divides_global_batch,
    fraction,
    launched_world_size,
    positive_float,
    positive_int,
    writable_dir,
)
from distlab.processes.reproducible import exact_float32
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import lesson_parser
from distlab.proof.compare import all_ok, compare, grads_of, tolerances
from distlab.proof.verdict import Verdict
from distlab.streamed.config import EXCHANGES
from distributed_clip import distributed_backward

MIN_ACCURACY = 0.80  # chance is 1 in 10 digits; 8x chance is not luck
AUTOCAST = ("auto", "bf16", "off")
LOSSES = ("infonce", "sigmoid")


RESUME_FLAGS = ("checkpoint_dir", "checkpoint_every", "crash_at_step", "crash_rank")


def add_resume_args(parser: argparse.ArgumentParser, every: int = 10) -> argparse.ArgumentParser:
    """Where to checkpoint and how often, and the fault that proves a crash loses nothing."""
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        type=writable_dir,
        help="checkpoint here, and resume from the newest whole checkpoint found here",
    )
    parser.add_argument(
        "--checkpoint-every", type=positive_int, default=every, metavar="STEPS", help="steps between checkpoints"
    )
    parser.add_argument(
        "--crash-at-step",
        type=positive_int,
        metavar="STEP",
        help="rank --crash-rank exits abruptly at this step, on torchrun's first attempt only",
    )
    parser.add_argument("--crash-rank", type=int, metavar="RANK", help="the rank that crashes; default the last")
    return parser


def check_resume_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One line naming the flag, before any process group exists (P is torchrun's WORLD_SIZE; outside
    torchrun the rank is not checked, and `distributed()` says how to launch)."""
    world = launched_world_size()
    if args.crash_at_step is not None and args.checkpoint_dir is None:
        parser.error("argument --crash-at-step: needs --checkpoint-dir (a crash with nothing to resume from)")
    if args.crash_at_step is not None and args.crash_at_step > args.steps:
        parser.error(f"argument --crash-at-step: must be at most --steps ({args.steps}), got {args.crash_at_step}")
    if args.crash_rank is not None and world is not None and not 0 <= args.crash_rank < world:
        parser.error(f"argument --crash-rank: must be a rank, 0 <= r < P = {world}, got {args.crash_rank}")


def checkpoints_of(args: argparse.Namespace, rt) -> Checkpoints:
    """The checkpoints the flags ask for; the other flags (but --json) define the run a checkpoint must belong
    to: resuming with another --lr or --seed is refused, not silently mixed."""
    run = {k: v for k, v in vars(args).items() if k not in RESUME_FLAGS + ("json",)}
    return Checkpoints(rt, args.checkpoint_dir, args.checkpoint_every, run, args.crash_at_step, args.crash_rank)


def parse_args():
    parser = lesson_parser(__doc__)
    add_global_batch(parser, 256)
    parser.add_argument(
        "--micro-batch-size", type=positive_int, default=64, help="B; B >= C = N / P runs the towers once per step"
    )
    parser.add_argument("--stream-chunk", type=positive_int, default=128, help="T: tiles are at most T x T")
    parser.add_argument("--steps", type=positive_int, default=150, help="optimiser steps")
    parser.add_argument("--warmup", type=positive_int, default=15, help="warm-up steps of the schedule")
    parser.add_argument("--lr", type=positive_float, default=5e-3, help="AdamW's peak learning rate")
    parser.add_argument("--weight-decay", type=fraction, default=0.1, help="AdamW's, on weight matrices only")
    parser.add_argument("--clip-norm", type=positive_float, default=1.0, help="max global gradient norm")
    parser.add_argument("--dim", type=positive_int, default=64, help="d, the embedding width")
    parser.add_argument("--width", type=positive_int, default=32, help="the towers' width")
    parser.add_argument("--test-fraction", type=fraction, default=0.2, help="held-out share of each digit")
    parser.add_argument("--eval-every", type=positive_int, default=10, help="zero-shot evaluation interval")
    parser.add_argument("--autocast", choices=AUTOCAST, default="auto", help="bf16 autocast; auto: on CUDA only")
    parser.add_argument("--loss", choices=LOSSES, default="infonce", help="sigmoid: SigLIP's, with a learned bias")
    parser.add_argument("--exchange", choices=EXCHANGES, default="gather", help="ring: C x d blocks rank to rank")
    args = add_resume_args(parser).parse_args()  # --checkpoint-dir, --checkpoint-every, --crash-at-step, --crash-rank
    check_resume_args(parser, args)
    if args.warmup >= args.steps:  # needs no P: refused before any process group exists
        parser.error(f"argument --warmup: must be below --steps ({args.steps}), got {args.warmup}")
    if args.test_fraction == 0:
        parser.error("argument --test-fraction: the zero-shot claim needs held-out images, got 0")
    train_images = len(load_split(args.test_fraction, args.seed).train_labels)
    if args.global_batch > train_images:
        parser.error(f"argument --global-batch: N = {args.global_batch} exceeds the {train_images} training images")
    return args


def reference_gradients(model: DigitsCLIP, images: torch.Tensor, ids: torch.Tensor) -> tuple[dict, float]:
    """A deep copy on the whole global batch in one process: plain autograd on `clip_loss`, or on
    `sigmoid_loss` when the model has a bias; s and beta ordinary tensors (the model has no dropout, so
    no random stream needs replaying)."""
    loss_fn = clip_loss if model.logit_bias is None else sigmoid_loss
    loss, grads = full_batch_gradients(model, images, ids, None, loss_fn=loss_fn)
    return grads, loss


def part_table(rows: list, caption: str) -> Table:
    """The per-tensor comparison, one line per part of the model (its worst tensor shown)."""
    table = Table(
        title="Step 1 gradients: distributed_backward vs one process, whole batch",
        caption=caption,
        title_justify="left",
        caption_justify="left",
    )
    for column in ("part", "tensors", "max |a-r|", "max |a-r| / max |r|", "allclose"):
        table.add_column(column, justify="left" if column == "part" else "right")
    for part in dict.fromkeys(row.name.split(".")[0] for row in rows):
        mine = [row for row in rows if row.name.split(".")[0] == part]
        table.add_row(
            part,
            str(len(mine)),
            f"{max(r.max_abs for r in mine):.2e}",
            f"{max(r.max_rel for r in mine):.2e}",
            "yes" if all_ok(mine) else "[red]no[/]",
        )
    return table


def check_first_step(ddp, model, data: Digits, config: dict, verdict: Verdict) -> None:
    """Step 1's gradient, in float32 without autocast, against the single-process full batch. In IEEE
    float32 (`exact_float32`): on a GPU cuDNN would run the image tower's convolutions in TF32."""
    shards = [data.rows(0, r)[0] for r in range(data.rt.world_size)]  # step 1's rows of every rank
    with exact_float32():
        loss = distributed_backward(ddp, *data.batch(0, shards[data.rt.rank]), config)
        ref_grads, ref_loss = reference_gradients(model, *data.batch(0, torch.cat(shards)))
    rows = compare(ref_grads, grads_of(model))
    rtol, atol = tolerances(torch.float32)
    print0(part_table(rows, f"allclose with rtol {rtol:g}, atol {atol:g}; rank 0"))
    print0(f"step 1 loss: distributed {loss:.7f}, one process {ref_loss:.7f}")
    learned = "logit scale" if model.logit_bias is None else "logit scale and bias"
    verdict.check(
        f"step 1's gradients ({learned} included) equal the full batch's",
        all_ok(rows) and abs(loss - ref_loss) <= atol + rtol * abs(ref_loss),
    )
    ddp.zero_grad(set_to_none=True)


# ---- the mechanism: one CLIP step with distributed_backward, and the caller's loop ---------------


def clip_step(ddp, optimizer, images, captions, config: dict, clip_norm: float, bf16: bool = False) -> float:
    """One step of the caller-owned loop: the exact global gradient into .grad, clipped, applied."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(images.device.type, torch.bfloat16, enabled=bf16):
        loss = distributed_backward(ddp, images, captions, config)  # the exact global gradient, added
    torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)
    optimizer.step()
    ddp.module.clamp_logit_scale_()  # s in [1, 100], as open_clip does
    return loss


def train(ddp, optimizer, scheduler, data: Digits, config: dict, args, bf16: bool) -> dict:
    """The caller-owned loop; returns the curves. With --checkpoint-dir it starts after the newest whole
    checkpoint, if any, and writes one every --checkpoint-every steps (src/distlab/contrastive/checkpointing.py)."""
    model = ddp.module
    curves = {"loss": [], "logit_scale": [], "lr": [], "eval_step": [], "accuracy": []}
    if model.logit_bias is not None:
        curves["logit_bias"] = []  # the sigmoid loss's beta
    checkpoints = checkpoints_of(args, data.rt)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "curves": curves}
    first = checkpoints.restore(state)  # and every rank's generators
    for step, (images, ids) in progress(
        zip(range(first, args.steps), data.batches(first)), args.steps - first, "training"
    ):
        checkpoints.crash_if_asked(step + 1)  # --crash-at-step: os._exit here
        curves["lr"].append(scheduler.get_last_lr()[0])
        loss = clip_step(ddp, optimizer, images, ids, config, args.clip_norm, bf16)
        scheduler.step()
        curves["loss"].append(loss)
        curves["logit_scale"].append(model.logit_scale.exp().item())
        if model.logit_bias is not None:
            curves["logit_bias"].append(model.logit_bias.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curves["eval_step"].append(step + 1)
            curves["accuracy"].append(data.zero_shot(model)[0])
        checkpoints.after_step(step + 1, state)  # every --checkpoint-every steps: write, rename
    return curves


# ---- the chapter, part by part -------------------------------------------------------------------


def curve_table(curves: dict) -> Table:
    table = Table(title="Training (zero-shot: top-1 on held-out digits)", title_justify="left")
    bias = curves.get("logit_bias")
    for column in ("step", "lr", "loss", "s = 1/tau", "tau") + (("beta",) if bias else ()) + ("zero-shot",):
        table.add_column(column, justify="right")
    shown = curves["eval_step"][:: max(1, len(curves["eval_step"]) // 8)]
    for step in dict.fromkeys(shown + curves["eval_step"][-1:]):
        k, s = step - 1, curves["logit_scale"][step - 1]
        accuracy = curves["accuracy"][curves["eval_step"].index(step)]
        table.add_row(
            str(step),
            f"{curves['lr'][k]:.2e}",
            f"{curves['loss'][k]:.4f}",
            f"{s:.2f}",
            f"{1 / s:.4f}",
            *([f"{bias[k]:.3f}"] if bias else []),
            f"{accuracy:.1%}",
        )
    return table


def train_clip(args, rt, data: Digits, verdict: Verdict) -> dict:
    """Model, DDP, optimiser; step 1 checked, then trained. Returns what the report needs."""
    n, bf16 = args.global_batch, args.autocast == "bf16" or (args.autocast == "auto" and rt.device.type == "cuda")
    bias = SIGLIP_INIT_LOGIT_BIAS if args.loss == "sigmoid" else None  # beta, and s = 10 at the start
    model = DigitsCLIP(len(data.tokenizer), data.tokenizer.length, args.dim, args.width, args.seed, bias).to(rt.device)
    ddp = DDP(model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(decay_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))
    config = {
        "GLOBAL_BATCH_SIZE": n,
        "MICRO_BATCH_SIZE": args.micro_batch_size,
        "STREAM_CHUNK_SIZE": args.stream_chunk,
        "EXCHANGE": args.exchange,
    }  # the loss: what the model returns
    forwards = "once a step" if args.micro_batch_size >= n // rt.world_size else "twice a step: embed, recompute"
    print0(
        f"[bold]Lesson 27: train a CLIP on digits[/] with distributed_backward\n"
        f"{args.loss} loss, {args.exchange} exchange; N={n} over P={rt.world_size}: C={n // rt.world_size}, "
        f"B={args.micro_batch_size} (the towers run {forwards}), T={args.stream_chunk}, d={args.dim}; "
        f"{len(data.labels)} training, {len(data.split.test_labels)} held-out images; "
        f"bf16 autocast {'on' if bf16 else 'off'}; {rt.backend}"
    )
    (before, guesses), s_before = data.zero_shot(model), model.logit_scale.exp().item()
    beta_before = None if model.logit_bias is None else model.logit_bias.item()
    check_first_step(ddp, model, data, config, verdict)
    start = time.perf_counter()
    curves = train(ddp, optimizer, scheduler, data, config, args, bf16)
    after, predictions = data.zero_shot(model)
    return dict(
        curves=curves,
        seconds=time.perf_counter() - start,
        before=before,
        after=after,
        s_before=s_before,
        beta_before=beta_before,
        guesses=guesses,
        predictions=predictions,
        bf16=bf16,
        digest=parameters_sha256(model),
    )


def main() -> int:
    args = check_flags_against_world(parse_args(), divides_global_batch)
    with distributed(args.device, deterministic=True) as rt:  # resumed runs end bit-identical, on GPUs too
        verdict, data = Verdict(rt), Digits(rt, args.global_batch, args.test_fraction, args.seed)
        run = train_clip(args, rt, data, verdict)
        curves, before, after, predictions = run["curves"], run["before"], run["after"], run["predictions"]
        print0(curve_table(curves))
        s_before, s_after = run["s_before"], curves["logit_scale"][-1]
        print0(
            f"learned temperature: tau = {1 / s_before:.4f} (s = {s_before:.2f}) at the start, "
            f"tau = {1 / s_after:.4f} (s = {s_after:.2f}) after {args.steps} steps in {run['seconds']:.1f} s"
        )
        if "logit_bias" in curves:
            print0(f"learned bias: beta = {run['beta_before']:.2f} at the start, {curves['logit_bias'][-1]:.3f} after")
        print0(
            f"zero-shot top-1 on {len(predictions)} held-out digits, "
            f'prompt "{ZERO_SHOT_TEMPLATE.format("<digit>")}" (no training caption\'s template): '
            f"{before:.1%} before training, {after:.1%} after (chance 10%)"
        )
        verdict.check(
            f"held-out zero-shot accuracy >= {MIN_ACCURACY:.0%} (chance 10%)", after >= MIN_ACCURACY, f"{after:.1%}"
        )
        confusions = {
            when: confusion_matrix(data.split.test_labels, p)
            for when, p in (("before", run["guesses"]), ("after", predictions))
        }
        for key, value in dict(
            accuracy_before=before,
            accuracy_after=after,
            seconds=run["seconds"],
            world_size=rt.world_size,
            global_batch=args.global_batch,
            confusion=confusions,
            bf16=run["bf16"],
            **curves,
        ).items():
            verdict.figure(key, value)
        print0(f"parameters sha256: {run['digest']}", highlight=False)  # equal digests: bit-identical models
        code = verdict.finish(args.json)
        print0(f"zero-shot accuracy on held-out digits: {after:.1%}", highlight=False)
    return code


if __name__ == "__main__":
    run_main(main)
