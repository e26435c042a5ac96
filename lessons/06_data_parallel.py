"""Lesson 06: collectives and data parallelism, by hand, with buckets and overlap, and with DDP. The
bridge from the pipelines (01-05), which split the model, to the contrastive lessons (21-27), which
split the batch.

    torchrun --nproc-per-node 2 lessons/06_data_parallel.py     # any P that divides N (960: P = 1..4)

Collectives. Rank r holds x_r. all_reduce leaves sum_q x_q on every rank; all_gather the
concatenation (x_0, ..., x_{P-1}); reduce_scatter chunk r of the sum on rank r; broadcast rank 0's
x_0 everywhere. For a full tensor of `bytes` a ring algorithm sends, per rank,

    all_reduce      2(P-1)/P x bytes   (a reduce-scatter, then an all-gather of the reduced chunks)
    all_gather       (P-1)/P x bytes   reduce_scatter  (P-1)/P x bytes
    broadcast                  bytes   (a pipelined chain; the last rank sends nothing)

The rings are written out below (`RingByHand`): the P ranks stand in a circle, each sends only to its
right neighbour r+1 and receives only from its left one r-1, so every link carries data at every step.
The full tensor is cut into P chunks. Reduce-scatter: at step k rank r passes its partial sum of chunk
r-k-1 on and adds the partial of chunk r-k-2 that arrives; after P-1 steps chunk r holds every rank's
contribution. All-gather: at step k rank r passes chunk r-k on and receives chunk r-k-1, which its left
neighbour received one step earlier. All-reduce: the two, one after the other. Broadcast: a chain
0 -> 1 -> ... -> P-1 in pieces, each rank forwarding a piece as soon as it has it. Each step posts its
send first (`isend`) and then receives: with a blocking send first on every rank, all P would wait for
a receive nobody has posted yet.

`distlab/comm/collectives.py` (`COLLECTIVES`) holds what each collective computes and its formula;
`distlab/comm/ring.py` (`Ring`) is the library's twin of the rings below, on the one post-then-wait
exchange that lessons 07 and 09 use: the lesson proves the two equal (the same results, bit for bit, and
the same bytes). Each result is checked against the same computation in one process, the bytes against
the formula, and torch's time against the bytes.

Data parallelism. Every rank holds the whole model and C = N/P of the N rows. For a loss that is a
MEAN OVER SAMPLES, L = 1/N sum_i l_i = 1/P sum_r L_r with L_r = 1/C sum_{i in r} l_i, so

    dL/dtheta = 1/P sum_r dL_r/dtheta:

backward on the local rows, all_reduce every gradient, divide by P (`all_reduce_gradients`, below),
and every rank holds the gradient one process gets on the whole batch.

Buckets and overlap. Backward produces gradients last layer first. `GradientBuckets` (below) packs them into
buckets of about --bucket-mib, and a `register_post_accumulate_grad_hook` on each parameter launches the bucket's
all-reduce asynchronously as soon as its last gradient is in, so the reduction runs while backward computes the
earlier layers; `wait()` comes before the optimizer step. DDP's reducer does the same in C++, and launches the
buckets strictly in order, as the class here does, so that every rank's k-th all-reduce is the same bucket. The
training loop they plug into is `distlab/data_split/data_parallel/training.py` (`train`); the timing,
`distlab/data_split/data_parallel/overlap.py`.

The shapes real models have. Rank 0's parameters and buffers are broadcast first (`broadcast_parameters`;
`GradientBuckets` does it at construction, as DDP does), so ranks that built the model from different seeds train
one model. Only parameters that require grad are reduced, each tensor once (`unused_check`): a frozen tower or
bias is skipped (never stepped or decayed), a weight tied across two children (an embedding and its output layer)
is one parameter with one gradient, and one held by the model itself (CLIP's `logit_scale`) is reduced like any
other. A parameter with no gradient in a step (a branch not taken) is an error naming it, before the step's first
all-reduce, unless `find_unused_parameters=True`: then one more all-reduce counts the ranks that used each
parameter, the others add zeros (exact: nothing added to the sum), and one no rank used keeps no gradient, as in
one process, so no optimizer moves it. tests/test_real_shapes.py trains all of these against one process.

What that buys, measured twice. On the real CPU (gloo, P ranks sharing this machine's cores with
other jobs) buckets pay and overlap does not: every message has a fixed cost, so one all-reduce per
tensor is slower than a few buckets, but gloo copies and sums on the same cores backward computes
on, so backward slows down beside the all-reduces and the step is about as long either way. On the
emulated device (`--emulate-ms`, `--link-ms-per-mib`, `distlab/proof/emulate.py`: each layer's forward
costs a fixed time and its backward twice that, slept inside autograd with the real math running;
each all-reduce waits its bytes' time on a link thread of its own, then runs) the two no longer
compete, as on GPUs, where NCCL runs on its own CUDA stream. There the bucket of the last layers
reduces while backward computes the first ones; only what is still on the link when backward ends
is exposed. If the link keeps up with backward, all but the last bucket hide:

    hidden share of the communication  ~  1 - (the last bucket's bytes) / (all the bytes).

DDP, measured (`distlab/data_split/data_parallel/ddp.py`): it averages; `no_sync()` for gradient accumulation
(`accumulate`: same gradient, one synchronised backward instead of one per micro-batch, counted by a
comm hook); `find_unused_parameters` (`unused_branch`): with a branch a step does not use, torch 2.13
returns from that step's backward with the gradients NOT averaged (no error), then raises at the next
forward; if ranks disagree about the branch, the ranks that launched the all-reduce wait for the
others until the group's timeout (a test shows it with a 2 s timeout). With the flag DDP searches the
autograd graph for unused parameters after every forward (and warns when a step used them all, as
step 1 here does) and every step is exact.

The one fact the contrastive lessons hinge on. Averaging is right for a mean over samples. A loss
that is not split over ranks, one every rank computes whole over the all-gathered batch (here a
log-sum-exp over all N rows, `distlab/data_split/data_parallel/problem.py`; lesson 21's InfoNCE), back-propagates
on rank r only through its own rows: g_r, with dL/dtheta = sum_r g_r. DDP's average is then
dL/dtheta / P: exactly P times too small. Back-propagating P * L makes it exact (lesson 21).

Every claim is checked against an independent reference: a deep copy of the model run on the whole
batch in one process with plain autograd. Times come from a shared CPU: read them as ratios.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist
from torch import nn

from distlab.comm.ledger import Ledger
from distlab.data_split.data_parallel import ddp
from distlab.data_split.data_parallel.measure import measure_collectives
from distlab.data_split.data_parallel.overlap import (
    backward_timeline,
    emulated_overlap,
    no_communication,
    time_strategies,
)
from distlab.data_split.data_parallel.problem import DataParallelConfig, batch_lse_loss, build, mean_loss, world_rules
from distlab.data_split.data_parallel.report import (
    cost_table,
    gradient_table,
    semantics_table,
    timeline_table,
    timing_table,
)
from distlab.data_split.data_parallel.training import train
from distlab.processes.console import print0, rows_table
from distlab.processes.flags import check_flags_against_world, positive_float, positive_int
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof import emulate
from distlab.proof.cli import add_emulate_args, add_mlp_args, lesson_parser
from distlab.proof.compare import DTYPES, all_ok, compare, compare_whole, tolerances
from distlab.proof.memory import MIB
from distlab.proof.reference import one_process, sgd
from distlab.proof.verdict import Verdict

# ---- the mechanism, part 1: the collectives as rings by hand -------------------------------------

BROADCAST_PIECES = 8  # the chain forwards a piece while the next one arrives


class RingByHand:
    """Rank r's place in a ring of P ranks: it sends only to r + 1 and receives only from r - 1, and
    counts every byte it sends in `ledger` (the measured side of the ring formulas)."""

    def __init__(self, rt: Runtime):
        self.rank, self.world = rt.rank, rt.world_size
        self.right, self.left = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        self.ledger = Ledger()

    def send(self, chunk: torch.Tensor, to: int) -> dist.Work:
        self.ledger.count_sends([chunk])  # bytes handed to the transport
        return dist.isend(chunk, to)  # returns at once: the receive below can be posted meanwhile

    def step(self, chunk: torch.Tensor, into: torch.Tensor) -> None:
        """One ring step: `chunk` goes right while `into` fills from the left."""
        sending = self.send(chunk, self.right)
        dist.recv(into, self.left)
        sending.wait()

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Chunk r of sum_q x_q on rank r. Sent: (P-1) chunks of bytes / P."""
        r, P = self.rank, self.world
        chunks = x.clone().chunk(P)  # views into one copy: the partial sums grow in place
        incoming = torch.empty_like(chunks[0])
        for k in range(P - 1):
            self.step(chunks[(r - k - 1) % P], incoming)  # my partial of chunk r-k-1 goes on ...
            chunks[(r - k - 2) % P].add_(incoming)  # ... and the left's partial of chunk r-k-2 joins mine
        return chunks[r].clone()  # after P-1 steps: every rank's contribution to chunk r

    def all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        """(x_0, ..., x_{P-1}) on every rank. Sent: (P-1) chunks of bytes / P."""
        r, P = self.rank, self.world
        out = mine.new_empty(P * mine.numel())
        chunks = out.chunk(P)  # views: each arriving chunk lands in place
        chunks[r].copy_(mine)
        for k in range(P - 1):  # chunk r-k arrived one step ago (my own at k = 0): pass it on
            self.step(chunks[(r - k) % P], chunks[(r - k - 1) % P])
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """sum_q x_q on every rank: reduce-scatter, then all-gather the reduced chunks. Sent: 2 (P-1)/P bytes."""
        return self.all_gather(self.reduce_scatter(x))

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, down the chain 0 -> 1 -> ... -> P-1. Sent: bytes, but by the last rank."""
        r, P = self.rank, self.world
        out = x.clone()
        forwarding = []
        for piece in out.chunk(BROADCAST_PIECES):
            if r > 0:
                dist.recv(piece, r - 1)  # lands in place
            if r < P - 1:  # on its way while the next piece arrives
                forwarding.append(self.send(piece, r + 1))
        for sending in forwarding:
            sending.wait()
        return out


def ring_by_hand(rt: Runtime, name: str, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Collective `name` on this rank's x by the ring above: (the result, the bytes this rank sent)."""
    ring = RingByHand(rt)
    return getattr(ring, name)(x), ring.ledger.sent


# ---- the mechanism, part 2: data parallelism by hand ---------------------------------------------


def broadcast_parameters(model: nn.Module, rt: Runtime) -> None:
    """Rank 0's parameters and buffers on every rank, in place: replicas built from different seeds (or
    loaded differently) become one model before the first step, as torch's DDP does at construction."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:  # each tensor once: a tied weight is one
            dist.broadcast(t, src=0)


def unused_check(model: nn.Module, rt: Runtime, find_unused_parameters: bool) -> list[nn.Parameter]:
    """The parameters to reduce this step (those that require grad). One without a gradient (a branch not taken)
    is an error naming it, before any collective, unless `find_unused_parameters`: then one all-reduce counts
    who used what; zeros stand in where a rank did not (exact), and one no rank used keeps no gradient."""
    params = [p for p in model.parameters() if p.requires_grad]  # each tensor once: a tied weight is one
    if not find_unused_parameters:
        missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
        if missing:
            raise RuntimeError(
                f"no gradient this step for {missing}: a branch not taken would leave the ranks apart; "
                "pass find_unused_parameters=True if a step may leave parameters unused"
            )
        return params
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=rt.device)
    dist.all_reduce(used)  # how many ranks used each parameter
    reduced = [p for p, n in zip(params, used.tolist()) if n > 0]
    for p in reduced:
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
    return reduced


def all_reduce_gradients(model: nn.Module, rt: Runtime, find_unused_parameters: bool = False) -> None:
    """After backward: every gradient summed over the ranks, divided by P (the mean of the ranks'
    means is the global mean when the shares are equal). Frozen parameters have none and are skipped."""
    for param in unused_check(model, rt, find_unused_parameters):
        dist.all_reduce(param.grad)  # in place, on the gradient's device: rt.device
        param.grad /= rt.world_size


class GradientBuckets:
    """All-reduce the gradients in buckets, each launched from backward as soon as it is full, in order.
    At construction rank 0's weights are broadcast (`broadcast_parameters`)."""

    def __init__(
        self,
        model: nn.Module,
        rt: Runtime,
        bucket_bytes: float,
        overlap: bool = True,
        link=None,
        find_unused_parameters: bool = False,
    ):
        self.model, self.rt, self.overlap, self.link = model, rt, overlap, link  # link: emulate.EmulatedLink, or gloo
        self.find_unused = find_unused_parameters
        broadcast_parameters(model, rt)
        # Backward produces gradients from the last layer to the first; filling the buckets in that order (as
        # DDP does) makes the first bucket complete early in backward. A bucket closes at bucket_bytes (0: 1 tensor).
        self.buckets: list[list[nn.Parameter]] = [[]]
        for param in reversed([p for p in model.parameters() if p.requires_grad]):
            if self.buckets[-1] and sum(p.numel() * p.element_size() for p in self.buckets[-1]) >= bucket_bytes:
                self.buckets.append([])
            self.buckets[-1].append(param)
        self.missing = [len(bucket) for bucket in self.buckets]
        self.launched = 0  # buckets 0 .. launched - 1 are on the wire
        self.in_flight: list[tuple[int, torch.Tensor, dist.Work]] = []
        self.events: dict[str, dict[int, float]] = {"launched": {}, "done": {}}  # for the timeline
        for i, bucket in enumerate(self.buckets):
            for param in bucket:
                param.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))

    def _grad_ready(self, i: int, param: nn.Parameter) -> None:  # autograd: param.grad is complete
        self.missing[i] -= 1
        # Launched strictly in order, as DDP's reducer does: every rank's k-th all-reduce is bucket k,
        # even when gradients arrive in another order (a tied weight, a parameter used late).
        while self.overlap and self.launched < len(self.buckets) and self.missing[self.launched] == 0:
            self._launch(self.launched)

    def _launch(self, i: int) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])  # one message per bucket
        # Returns at once; the backend (or the emulated link's thread) reduces meanwhile.
        work = self.link.all_reduce(flat) if self.link else dist.all_reduce(flat, async_op=True)
        self.in_flight.append((i, flat, work))
        self.launched = i + 1
        self.events["launched"][i] = time.perf_counter()
        work.get_future().then(lambda _: self.events["done"].__setitem__(i, time.perf_counter()))

    def wait(self) -> None:
        """Before the optimizer step: every bucket reduced, divided by P, copied back into .grad. A bucket still
        waiting for a gradient (a branch not taken) is launched now with zeros for it under find_unused_parameters
        (used by no rank: no gradient after); without the flag, an error naming it, before any more launches."""
        params = [p for bucket in self.buckets for p in bucket]
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.rt.device)
        if not self.find_unused and not all(used.tolist()):
            unused_check(self.model, self.rt, False)  # raises, naming the parameters
        for i in range(self.launched, len(self.buckets)):  # the baseline (no overlap), or a gradient never made
            for p in self.buckets[i]:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            self._launch(i)
        if self.find_unused:  # who used what: after every bucket, so the same k-th all-reduce on every rank
            dist.all_reduce(used)
        for i, flat, work in self.in_flight:
            work.wait()
            flat /= self.rt.world_size
            for param, grad in zip(self.buckets[i], flat.split([p.numel() for p in self.buckets[i]])):
                param.grad.copy_(grad.view_as(param))
        self.in_flight.clear()
        for p, n in zip(params, used.tolist()):
            if self.find_unused and n == 0:
                p.grad = None  # no rank used it: no gradient, as in one process (the optimizer skips it)
        self.missing = [len(bucket) for bucket in self.buckets]
        self.launched = 0


# ---- the chapter, part by part -------------------------------------------------------------------


def show_collectives(rt: Runtime, args, verdict: Verdict) -> None:
    print0("\n[bold]1. The collectives: what they compute, what they send, how long they take[/]")
    nbytes = int(args.message_mib * MIB)
    rows = measure_collectives(rt, nbytes, DTYPES[args.dtype], args.seed, args.repeats, ring_by_hand)
    for row in rows:
        verdict.check(
            f"{row.name} = one process's; the ring sent {row.formula}",
            row.ok and row.ring_ok and row.counted_bytes == row.formula_bytes,
        )
    verdict.check(
        "the rings by hand = comm's Ring: the same results, bit for bit, and the same bytes",
        all(row.same_as_library for row in rows),
    )
    print0(semantics_table(rows))
    print0(cost_table(rows))
    verdict.figure("collectives", [vars(row) for row in rows])


def show_data_parallel(rt: Runtime, cfg: DataParallelConfig, args, verdict: Verdict) -> tuple:
    print0(f"\n[bold]2. Data parallelism on a mean over samples: {cfg.steps} SGD steps[/]")
    model, x, target = build(cfg)
    ref = one_process(model, lambda k: (x, target), mean_loss, sgd(cfg.lr), cfg.steps)  # one process, whole batch
    runs = {}
    by_hand = build(cfg)[0].to(rt.device)
    runs["by hand: all_reduce / P"] = train(rt, cfg, by_hand, lambda: all_reduce_gradients(by_hand, rt))
    bucketed = build(cfg)[0].to(rt.device)
    buckets = GradientBuckets(bucketed, rt, args.bucket_mib * MIB)
    runs[f"by hand: {len(buckets.buckets)} buckets"] = train(rt, cfg, bucketed, buckets.wait)
    runs["DDP"] = train(rt, cfg, ddp.wrap(build(cfg)[0], rt), lambda: None)
    rows = []
    for name, run in runs.items():
        grads, params = compare_whole(ref.first_grads, run.first_grads), all_ok(compare(ref.params, run.params))
        losses = torch.allclose(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=tolerances(cfg.dtype)[0])
        verdict.check(f"{name}: gradients, losses, parameters = one process's", grads.ok and params and losses)
        rows.append((name, "one process", grads, True))
    print0(gradient_table(rows, f"Step 1's gradients on P = {rt.world_size} ranks against one process"))
    return ref.first_grads, rows[-1]


def show_overlap(rt: Runtime, cfg: DataParallelConfig, args, verdict: Verdict) -> None:
    print0("\n[bold]3. Buckets and overlap: all-reduce after backward, or from hooks during it[/]")
    cap = args.bucket_mib * MIB
    seconds = time_strategies(
        rt,
        cfg,
        {
            "compute only": no_communication,
            "all_reduce per tensor, after": lambda m: (m, functools.partial(all_reduce_gradients, m, rt)),
            "buckets, after backward": lambda m: (m, GradientBuckets(m, rt, cap, overlap=False).wait),
            "buckets from hooks (overlap)": lambda m: (m, GradientBuckets(m, rt, cap).wait),
            "DDP (same bucket size)": lambda m: (ddp.wrap(m, rt, bucket_mib=args.bucket_mib), lambda: None),
        },
        args.repeats,
    )
    print0(timing_table(seconds, baseline="compute only"))
    model = build(cfg)[0].to(rt.device)
    buckets = GradientBuckets(model, rt, cap)
    line = backward_timeline(rt, cfg, model, buckets.wait, buckets.events)
    sizes = [sum(p.numel() * p.element_size() for p in b) for b in buckets.buckets]
    print0(timeline_table(line.launched_ms, line.done_ms, sizes, line.backward_end_ms))
    verdict.check(
        "every bucket's all-reduce launched from a hook during backward",
        len(line.launched_ms) == len(sizes) and max(line.launched_ms) < line.backward_end_ms,
    )
    verdict.figure("step_seconds", {name: vars(t) for name, t in seconds.items()})
    verdict.figure("timeline", vars(line) | {"bucket_bytes": sizes})
    if args.emulate_ms:
        device, link = emulate.EmulatedDevice(args.emulate_ms), emulate.EmulatedLink(args.link_ms_per_mib)
        buckets_on = lambda m, overlap: GradientBuckets(m, rt, cap, overlap, link)  # noqa: E731
        verdict.figure("emulated", emulated_overlap(rt, cfg, device, link, args.repeats, buckets_on))
        link.close()


def show_ddp(rt: Runtime, cfg: DataParallelConfig, k: int, verdict: Verdict, ref_grads: dict) -> None:
    print0("\n[bold]4. DDP: no_sync for gradient accumulation, find_unused_parameters[/]")
    rows, calls = [], {}
    for no_sync in (True, False):
        grads, calls[no_sync] = ddp.accumulate(rt, cfg, k, no_sync)
        name = "no_sync but the last" if no_sync else "every micro-batch synced"
        rows.append((name, "one process", compare_whole(ref_grads, grads), True))
    print0(gradient_table(rows, f"Gradient accumulation over {k} micro-batches per rank under DDP"))
    print0(f"DDP all-reduce calls (comm hook): {calls[True]} with no_sync, {calls[False]} without")
    verdict.check(
        f"no_sync: gradients = one process's; all-reduce in 1 of {k} backwards",
        all(r[2].ok for r in rows) and calls[True] * k == calls[False] and calls[True] > 0,
    )
    verdict.figure("allreduce_calls", {"no_sync": calls[True], "every": calls[False], "micro_batches": k})
    unused = ddp.unused_outcome(rt, cfg)
    header = ("find_unused_parameters", "step 1", "step 2", "step 3")
    per_flag = [(str(flag), *cells) for flag, cells in unused.cells.items()]
    print0(rows_table("A branch used in steps 1 and 3, not in step 2: gradients per step", header, per_flag))
    print0(f"without the flag, step 3's forward raised: {unused.errors[False].split('. ')[0]}.", highlight=False)
    print0(
        f"with the flag DDP searches the graph for unused parameters after every forward; in step 1, which used them "
        f"all, torch {'warned' if unused.warned else 'did not warn'} (on every rank; caught here and said once) that "
        "the search found none and only costs time: the flag's price on the steps that do not need it",
        highlight=False,
    )
    verdict.check(
        "unused branch: un-averaged, then an error; with the flag exact",
        unused.cells[False] == unused.expected_without and unused.cells[True] == ["= one process"] * 3,
    )


def show_global_loss(rt: Runtime, cfg: DataParallelConfig, verdict: Verdict, ddp_mean_row: tuple) -> None:
    print0("\n[bold]5. Averaging: right for a mean over samples, P times too small for a global loss[/]")
    model, x, target = build(cfg)
    ref = one_process(model, lambda k: (x, target), batch_lse_loss, sgd(cfg.lr), 1)
    world = rt.world_size
    loss, plain = ddp.global_loss_gradients(rt, cfg, times_p=False)
    _, scaled = ddp.global_loss_gradients(rt, cfg, times_p=True)
    rows = [
        ("mean loss", "one process", ddp_mean_row[2], True),
        ("log-sum-exp, L", "one process", compare_whole(ref.first_grads, plain), world == 1),
        ("log-sum-exp, L", "one process / P", compare_whole(ref.first_grads, plain, 1 / world), True),
        ("log-sum-exp, P * L", "one process", compare_whole(ref.first_grads, scaled), True),
    ]
    print0(gradient_table(rows, "Under DDP: a mean over samples, and a loss every rank computes whole"))
    ratio, (rtol, atol) = rows[1][2].norm_ratio, tolerances(cfg.dtype)
    same_loss = abs(loss - ref.losses[0]) <= atol + rtol * abs(ref.losses[0])
    print0(f"the loss L: one process {ref.losses[0]:.12f}, every rank under DDP {loss:.12f}")
    verdict.check(
        f"global loss: DDP gives one process's / P (ratio {ratio:.6f}); P * L exact",
        rows[2][2].ok and rows[3][2].ok and same_loss,
    )
    verdict.figure("global_loss_norm_ratio", ratio)


def parse_args():
    parser = lesson_parser(__doc__)
    add_mlp_args(parser, layers=6, width=256, global_batch=960, steps=3)
    parser.add_argument(
        "--message-mib", type=positive_float, default=4.0, help="size of the full tensor of each collective, MiB"
    )
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed repetitions (median reported)")
    parser.add_argument("--bucket-mib", type=positive_float, default=0.5, help="gradient bucket size, MiB")
    parser.add_argument(
        "--accumulation-steps",
        type=positive_int,
        default=3,
        help="micro-batches per rank in the no_sync part (at most C = N / P)",
    )
    add_emulate_args(parser, ms_per_layer=10.0)  # long enough that the real compute and all-reduces fit inside
    parser.add_argument("--link-ms-per-mib", type=positive_float, default=40.0, help="emulated: ms per MiB on the link")
    return parser.parse_args()


def main() -> int:
    args = check_flags_against_world(parse_args(), lambda a, p: world_rules(a.global_batch, a.accumulation_steps, p))
    cfg = DataParallelConfig(
        args.global_batch, args.layers, args.width, args.steps, args.lr, args.seed, DTYPES[args.dtype]
    )
    with distributed(args.device) as rt:
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 06: collectives and data parallelism[/] - P = {rt.world_size}, N = {cfg.global_batch} "
            f"(C = {cfg.global_batch // rt.world_size}), backend {rt.backend}, {args.dtype}"
        )
        show_collectives(rt, args, verdict)
        ref_grads, ddp_mean_row = show_data_parallel(rt, cfg, args, verdict)
        show_overlap(rt, cfg, args, verdict)
        show_ddp(rt, cfg, args.accumulation_steps, verdict, ref_grads)
        show_global_loss(rt, cfg, verdict, ddp_mean_row)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
