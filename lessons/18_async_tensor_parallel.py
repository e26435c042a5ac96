"""Lesson 18: async tensor parallelism, the all-gather and the reduce-scatter of lesson 08 hidden under
the matmuls that need them, by cutting each matmul into P pieces that run while the next piece travels.

    torchrun --nproc-per-node 2 lessons/18_async_tensor_parallel.py    # P = 1..4 (P must divide seq, d_ff)

Lesson 08's sequence-parallel MLP holds x cut along the sequence: rank q has X_q (N x seq/P x d), the
whole is X = [X_0; ...; X_{P-1}] along seq. Its column-parallel fc1 (rank r: A_r, d_ff/P x d) needs the
whole X, so f-bar all-gathers it and the matmul waits for the last byte. But a matmul is row by row:

    Y_r = X A_r^T + b_r = [X_0 A_r^T + b_r; X_1 A_r^T + b_r; ...; X_{P-1} A_r^T + b_r]

and a block's rows can be computed as soon as that block is here. All-gather + matmul as a ring of P
steps: in step k rank r holds X_{(r-k) mod P}; it posts the send of that block to r+1 and the receive of
X_{(r-k-1) mod P} from r-1 (batch_isend_irecv, `distlab.comm.p2p.post`), computes the block's rows of Y_r
while the messages fly, then waits. Every row comes from the same product on the same numbers as in the
unsplit matmul: equal bit for bit, as long as the BLAS computes a row the same way whatever the number of
rows. It does at the lesson's shapes (checked); with a handful of rows (a few per block, under about 32 in
the whole matmul) this machine's MKL takes another kernel for the blocks, and the last bit may differ.

The row-parallel fc2 (rank r: B_r, d x d_ff/P) on H_r = GELU(Y_r) leaves a partial sum, and g-bar keeps
rank r's rows of the total: Z_r = sum_q H_q[rows r] B_q^T + b, matmul then reduce-scatter. Decomposed, a
travelling partial sum: in step k rank r computes its term for the rows c = (r - k - 1) mod P, adds the
sum that arrived from r-1 (the terms of r-1, ..., r-k for the same rows) and sends it on to r+1; the
next term is computed while the sum travels. At k = P - 1 the rows are c = r: rank r holds all P terms
of its own rows. The sum is the same, added in another order: equal to rounding, 1e-12 in float64.

Backward, each is the other's transpose. fc1's dX = sum_r dY_r A_r is a partial sum on every rank wanted
cut along the sequence: the travelling sum again. fc2's dH_r = dZ B_r needs the whole dZ on every rank:
the ring again. The weight gradients use what the rings assembled (dA_r = dY_r^T X, dB_r = dZ^T H_r).

Bytes: each ring sends P - 1 blocks of 1/P of the whole, (P-1)/P of it: what a ring all-gather or reduce-
scatter sends (lesson 06). Not one byte is saved; the gain is time. On the emulated device
(`distlab.proof.emulate`: a partial matmul costs t_m of wall time, a block's message t_c, both slept):

    gather, then matmul:   T_plain = (P-1) t_c + P t_m
    the ring:              T_async = t_m + (P-1) max(t_m, t_c)   (every message under a partial matmul)

At t_c = t_m the speed-up is (2P-1)/P: 1.5 at P = 2, 1.75 at P = 4. (`distlab.cost` counts tensor
parallelism's collectives as exposed; this is the term async TP takes off.) torchtitan measured 1.09x on
a 70B model over 256 H100s: a real layer's matmuls are not all next to a collective.

torch's own: with `torch._inductor.config._micro_pipeline_tp = True` and symmetric memory enabled for the
group, inductor rewrites all-gather + matmul into `torch.ops.symm_mem.fused_all_gather_matmul` and matmul +
reduce-scatter into `fused_matmul_reduce_scatter`, which run this decomposition on CUDA (the copies on the
copy engines). When the pattern does not match, nothing fuses and nothing says so (torchtitan #1185): the
plain version runs, with the same numbers. The fused ops are CUDA-only; their Python fallbacks
(`torch.distributed._symmetric_memory`) state what they compute and run on gloo: the lesson checks ours
against them.
"""

from __future__ import annotations

import copy
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.nn.functional as F
from torch import nn

from distlab.comm.ledger import Ledger
from distlab.comm.p2p import Posted, post
from distlab.comm.watch import CollectiveWatch
from distlab.layer_split.tensor_parallel import operators
from distlab.layer_split.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, reference_shards
from distlab.processes.console import compact_table, print0
from distlab.processes.flags import check_flags_against_world, nonnegative_float, positive_int, require
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof import emulate
from distlab.proof.cli import add_emulate_args, lesson_parser
from distlab.proof.compare import all_ok, compare
from distlab.proof.verdict import Verdict

SEQ = 1  # the sequence dim of an activation (N, seq, d): the dim the blocks are cut along

# ---- the clock: spans of work, and the emulated device's costs ---------------------------------------


@dataclass
class Clock:
    """Spans (kind, label, start, end) of this rank's partial matmuls (kind "M") and messages ("T"), each
    labelled by the block it carries. On the emulated device a partial matmul lasts `matmul_ms` and a
    message `link_ms` (the real work runs inside, then the rank sleeps the rest); with both 0 it only
    records. A message's span runs from its post to its arrival."""

    matmul_ms: float = 0.0
    link_ms: float = 0.0
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)

    @contextmanager
    def compute(self, label: str, units: int = 1):
        start = time.perf_counter()
        with emulate.EmulatedDevice(self.matmul_ms).pad(units):
            yield
        self.spans.append(("M", label, start, time.perf_counter()))

    @contextmanager
    def blocking(self, label: str, messages: int):
        """A collective that holds the rank until its `messages` ring steps are done (plain TP)."""
        start = time.perf_counter()
        with emulate.EmulatedDevice(self.link_ms).pad(messages):
            yield
        self.spans.append(("T", label, start, time.perf_counter()))

    def post(self, label: str, sends, receives, group) -> Transfer:
        return Transfer(post(sends, receives, group), label, time.perf_counter(), self)


@dataclass
class Transfer:
    """Messages posted at `start`; `wait()` returns the received tensors no earlier than start + link_ms."""

    posted: Posted
    label: str
    start: float
    clock: Clock

    def wait(self) -> list[torch.Tensor]:
        received = self.posted.wait()
        left = self.start + self.clock.link_ms / 1e3 - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self.clock.spans.append(("T", self.label, self.start, max(time.perf_counter(), self.start)))
        return received


# ---- the mechanism: the two rings ---------------------------------------------------------------------


@torch.no_grad()  # values only: the autograd Functions below write the backward out
def all_gather_matmul(x, weight, bias, group=None, clock: Clock | None = None):
    """x: this rank's block (N, seq/P, d_in); weight: (d_out', d_in). Returns (X, X weight^T + bias): the
    gathered (N, seq, d_in) and the product (N, seq, d_out'), one block's rows at a time while the next
    block is on its way."""
    clock = clock if clock is not None else Clock()
    r, P = dist.get_rank(group), dist.get_world_size(group)
    right, left = (r + 1) % P, (r - 1) % P
    held = x.contiguous()
    gathered = held.new_empty(held.shape[0], P * held.shape[1], held.shape[2])
    y = held.new_empty(held.shape[0], P * held.shape[1], weight.shape[0])
    for k in range(P):
        source = (r - k) % P  # whose block this rank holds in step k
        gathered.chunk(P, dim=SEQ)[source].copy_(held)
        if k < P - 1:  # the next block starts travelling before this one is multiplied
            transfer = clock.post(str((r - k - 1) % P), [(held, right)], [(torch.empty_like(held), left)], group)
        with clock.compute(str(source)):
            y.chunk(P, dim=SEQ)[source].copy_(F.linear(held, weight, bias))
        if k < P - 1:
            (held,) = transfer.wait()
    return gathered, y


@torch.no_grad()
def matmul_reduce_scatter(h, weight, group=None, clock: Clock | None = None):
    """h: (N, seq, k) whole sequence, this rank's term h weight^T of a sum over ranks. Returns rank r's
    rows (N, seq/P, d_out) of the sum: a partial sum travels the ring, each rank adding its term."""
    clock = clock if clock is not None else Clock()
    r, P = dist.get_rank(group), dist.get_world_size(group)
    right, left = (r + 1) % P, (r - 1) % P
    parts, transfer = h.chunk(P, dim=SEQ), None
    for k in range(P):
        rows = (r - k - 1) % P  # the rows whose sum passes through this rank in step k; the last: r
        with clock.compute(str(rows)):  # while the previous sum travels
            term = F.linear(parts[rows], weight)
        if transfer is not None:
            (arrived,) = transfer.wait()
            term = arrived + term  # the terms of ranks r-1, ..., r-k for these rows, and this rank's
        if k < P - 1:
            transfer = clock.post(str(rows), [(term, right)], [(torch.empty_like(term), left)], group)
    return term


class AllGatherMatmul(torch.autograd.Function):
    """fc1 with f-bar inside: the ring forward; backward dX = sum_r dY_r A_r by the travelling sum."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, clock):
        gathered, y = all_gather_matmul(x, weight, bias, group, clock)
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.clock = group, clock
        return y

    @staticmethod
    def backward(ctx, dy):
        gathered, weight = ctx.saved_tensors
        dx = matmul_reduce_scatter(dy, weight.t(), ctx.group, ctx.clock)
        dw = dy.flatten(0, -2).t() @ gathered.flatten(0, -2)  # dA_r = dY_r^T X over every token
        return dx, dw, dy.sum((0, 1)), None, None


class MatmulReduceScatter(torch.autograd.Function):
    """fc2 with g-bar inside: the travelling sum forward; backward dH_r = dZ B_r by the ring."""

    @staticmethod
    def forward(ctx, h, weight, group, clock):
        ctx.save_for_backward(h, weight)
        ctx.group, ctx.clock = group, clock
        return matmul_reduce_scatter(h, weight, group, clock)

    @staticmethod
    def backward(ctx, dz):
        h, weight = ctx.saved_tensors
        whole_dz, dh = all_gather_matmul(dz, weight.t(), None, ctx.group, ctx.clock)
        return dh, whole_dz.flatten(0, -2).t() @ h.flatten(0, -2), None, None


class AsyncMLP(nn.Module):
    """Lesson 08's sequence-parallel MLP, fc1 column then fc2 row, the rings in place of f-bar and g-bar."""

    def __init__(self, mlp: nn.Sequential, rank: int, world_size: int, group=None, clock: Clock | None = None):
        super().__init__()
        self.fc1, self.fc2 = ColumnParallelLinear(mlp[0], rank, world_size), RowParallelLinear(mlp[2], rank, world_size)
        self.group, self.clock = group, clock if clock is not None else Clock()

    def forward(self, x):  # (N, seq/P, d) -> (N, seq/P, d)
        y = AllGatherMatmul.apply(x, self.fc1.weight, self.fc1.bias, self.group, self.clock)
        z = MatmulReduceScatter.apply(F.gelu(y), self.fc2.weight, self.group, self.clock)
        return z + self.fc2.bias  # the bias once, after the sum (each rank its own rows)


class PlainMLP(AsyncMLP):
    """The same layers with lesson 08's f-bar and g-bar (the library's): gather, multiply, multiply, scatter."""

    def forward(self, x):
        self.ledger = Ledger()
        y = self.fc1(operators.GatherFromSP.apply(x, self.group, self.ledger))
        return operators.ScatterToSP.apply(self.fc2(F.gelu(y)), self.group, self.ledger) + self.fc2.bias


# ---- the chapter --------------------------------------------------------------------------------------


def problem(args, dtype=torch.float64):
    """The unsplit MLP (d -> d_ff -> d), the whole batch x (N, seq, d) and an upstream gradient dz."""
    gen = torch.Generator().manual_seed(args.seed)
    mlp = nn.Sequential(nn.Linear(args.dim, args.ffn_width), nn.GELU(), nn.Linear(args.ffn_width, args.dim))
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=dtype) / p.shape[-1] ** 0.5
    x, dz = (torch.randn(args.global_batch, args.seq_len, args.dim, generator=gen, dtype=dtype) for _ in range(2))
    return mlp, x, dz


def show_rings(rt: Runtime, args, verdict: Verdict) -> None:
    print0("\n[bold]1. The two rings against gather-then-multiply and multiply-then-scatter, float64[/]")
    P, r, group = rt.world_size, rt.rank, dist.group.WORLD
    mlp, x, _ = problem(args)
    col, row = ColumnParallelLinear(mlp[0], r, P), RowParallelLinear(mlp[2], r, P)
    mine, h = x.chunk(P, dim=SEQ)[r], F.gelu(F.linear(x, mlp[0].weight, mlp[0].bias)).chunk(P, dim=2)[r]
    _, ours = all_gather_matmul(mine, col.weight, col.bias)
    whole = operators.GatherFromSP.apply(mine, group, Ledger())
    plain = col(whole)
    gathered, (torchs,) = symm_mem._fused_all_gather_matmul_fallback(mine, [col.weight.t()], SEQ, group.group_name)
    torch_ag_ok = torch.equal(gathered, whole) and torch.equal(torchs, F.linear(whole, col.weight))
    ours_rs = matmul_reduce_scatter(h, row.weight)
    plain_rs = operators.ScatterToSP.apply(F.linear(h, row.weight), group, Ledger())
    torch_rs = symm_mem._fused_matmul_reduce_scatter_fallback(h, row.weight.t(), "sum", SEQ, group.group_name)
    rs_err = (ours_rs - plain_rs).abs().max().item()
    out = compact_table(
        f"Rank {r}'s result against plain TP's (lesson 08's f-bar, g-bar)",
        ("operator", "ours: max err", "torch fallback: max err"),
        caption="torch fallback: torch.distributed._symmetric_memory's _fused_all_gather_matmul_fallback and "
        "_fused_matmul_reduce_scatter_fallback (the semantics of the CUDA ops), on gloo",
    )
    out.add_row("all-gather + matmul", _err(ours, plain), _err(torchs, F.linear(whole, col.weight)))
    out.add_row("matmul + reduce-scatter", f"{rs_err:.1e}", _err(torch_rs, plain_rs))
    print0(out)
    verdict.check("all-gather + matmul by the ring = all-gather then matmul, bit for bit", torch.equal(ours, plain))
    verdict.check("matmul + reduce-scatter by the travelling sum = matmul then reduce-scatter to 1e-12", rs_err < 1e-12)
    verdict.check(
        "torch's fallbacks of fused_all_gather_matmul / fused_matmul_reduce_scatter compute the same",
        torch_ag_ok and torch.allclose(torch_rs, plain_rs, rtol=0, atol=1e-12),
    )
    verdict.figure("reduce_scatter_max_err", rs_err)


def _err(got: torch.Tensor, want: torch.Tensor) -> str:
    return "0 (bit for bit)" if torch.equal(got, want) else f"{(got - want).abs().max().item():.1e}"


def mlp_run(rt: Runtime, args, kind: type, clock: Clock | None = None):
    """One forward and backward of the split MLP on this rank's rows: (output, named gradients, watch)."""
    mlp, x, dz = problem(args)
    model = kind(mlp, rt.rank, rt.world_size, dist.group.WORLD, clock)
    mine = x.chunk(rt.world_size, dim=SEQ)[rt.rank].clone().requires_grad_()
    with CollectiveWatch({"tp": dist.group.WORLD}) as watch:
        watch.phase = "forward"
        out = model(mine)
        watch.phase = "backward"
        out.backward(dz.chunk(rt.world_size, dim=SEQ)[rt.rank])
    dist.all_reduce(model.fc2.bias.grad)  # used on this rank's rows only: partial, summed (lesson 08)
    grads = {"input": mine.grad} | {n: p.grad for n, p in model.named_parameters()}
    return out.detach(), grads, watch, model


def show_mlp(rt: Runtime, args, verdict: Verdict) -> None:
    print0("\n[bold]2. The MLP with both rings, against the unsplit MLP in one process (float64)[/]")
    P, r = rt.world_size, rt.rank
    mlp, x, dz = problem(args)
    ref, whole = copy.deepcopy(mlp), x.clone().requires_grad_()
    ref_out = ref(whole)
    ref_out.backward(dz)
    out, grads, watch, model = mlp_run(rt, args, AsyncMLP)
    want = {"input": whole.grad.chunk(P, dim=SEQ)[r]}
    want |= reference_shards(
        {n.replace("0.", "fc1.").replace("2.", "fc2."): p.grad for n, p in ref.named_parameters()}, model, r, P
    )
    rows = compare({"output": ref_out.detach().chunk(P, dim=SEQ)[r]} | want, {"output": out} | grads, 1e-10, 1e-12)
    plain_out, _, _, plain = mlp_run(rt, args, PlainMLP)
    sent = {phase: watch.ledgers["tp"].sent_in(phase) for phase in ("forward", "backward")}
    plain_sent = {phase: plain.ledger.sent_in(phase) for phase in ("forward", "backward")}
    whole_bytes = args.global_batch * args.seq_len * args.dim * 8
    formula = 2 * (P - 1) * whole_bytes // P
    out_table = compact_table(
        f"Bytes rank {r} sent, one forward and backward",
        ("phase", "async (sends counted)", "plain TP (ledger)", "2(P-1)/P N seq d e"),
        caption="async: every message as it left the rank (distlab.comm.watch); plain: f-bar and g-bar's "
        "ring accounting (distlab.comm.ledger); one all-gather and one reduce-scatter of N x seq x d each way",
    )
    for phase in sent:
        out_table.add_row(phase, f"{sent[phase]:,}", f"{plain_sent[phase]:,}", f"{formula:,}")
    print0(out_table)
    worst = max(row.max_abs for row in rows)
    print0(f"output and {len(rows) - 1} gradients (input, fc1, fc2) against one process: max err {worst:.1e}")
    verdict.check(f"the async MLP = the unsplit MLP, output and every gradient (P = {P})", all_ok(rows))
    verdict.check("its forward output = plain TP's MLP to 1e-12", torch.allclose(out, plain_out, rtol=0, atol=1e-12))
    verdict.check(
        "bytes per rank = plain TP's = 2(P-1)/P N seq d e each way", sent == plain_sent == dict.fromkeys(sent, formula)
    )


def timed(rt: Runtime, args, run) -> tuple[float, Clock]:
    """The median over --repeats of one op's wall time on the emulated device, and the last run's clock."""
    seconds = []
    for _ in range(args.repeats):
        clock = Clock(args.emulate_ms, args.link_ms)
        dist.barrier()
        start = time.perf_counter()
        run(clock)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3, clock


def hidden(clock: Clock) -> int:
    """How many messages ran while a partial matmul of this rank ran (spans that intersect)."""
    matmuls = [(a, b) for kind, _, a, b in clock.spans if kind == "M"]
    return sum(any(a < mb and ma < b for ma, mb in matmuls) for kind, _, a, b in clock.spans if kind == "T")


def render(clock: Clock, width: int = 60) -> str:
    """Two rows over time, this rank's matmuls and its messages: each span drawn with its block's number
    (the block multiplied, the block in flight), '.' where nothing runs."""
    t0, t1 = min(a for _, _, a, _ in clock.spans), max(b for _, _, _, b in clock.spans)
    rows = {"M": ["."] * width, "T": ["."] * width}
    for kind, label, a, b in clock.spans:
        lo = min(width - 1, int((a - t0) / (t1 - t0) * width))
        for i in range(lo, max(lo + 1, round((b - t0) / (t1 - t0) * width))):
            rows[kind][i] = label
    return f"  matmul {''.join(rows['M'])}\n  wire   {''.join(rows['T'])}"


def show_emulated(rt: Runtime, args, verdict: Verdict) -> None:
    P, t_m, t_c = rt.world_size, args.emulate_ms, args.link_ms
    print0(f"\n[bold]3. On the emulated device[/]: a partial matmul {t_m:g} ms, a block's message {t_c:g} ms")
    mlp, x, _ = problem(args)
    col, group = ColumnParallelLinear(mlp[0], rt.rank, P), dist.group.WORLD
    mine = x.chunk(P, dim=SEQ)[rt.rank]

    def plain(clock: Clock):
        with clock.blocking("*", P - 1):  # a ring all-gather: P - 1 messages, one after another
            whole = operators.GatherFromSP.apply(mine, group, Ledger())
        with clock.compute("*", P):  # then the whole matmul: P blocks' worth
            col(whole)

    (plain_ms, plain_clock), (async_ms, async_clock) = (timed(rt, args, run) for run in (plain, _ring(mine, col)))
    predicted = ((P - 1) * t_c + P * t_m, t_m + (P - 1) * max(t_m, t_c))
    out = compact_table(
        "All-gather + matmul, measured (median) beside the cost model",
        ("version", "measured ms", "predicted ms", "messages under a matmul"),
        caption="predicted: (P-1) t_c + P t_m gathered first, t_m + (P-1) max(t_m, t_c) by the ring",
    )
    out.add_row("gather, then matmul", f"{plain_ms:.0f}", f"{predicted[0]:g}", f"{hidden(plain_clock)} of {P - 1}")
    out.add_row("the ring (async)", f"{async_ms:.0f}", f"{predicted[1]:g}", f"{hidden(async_clock)} of {P - 1}")
    print0(out)
    print0(
        f"rank {rt.rank}, gather then matmul:\n{render(plain_clock)}\nrank {rt.rank}, the ring:\n{render(async_clock)}"
    )
    print0(f"speed-up {plain_ms / async_ms:.2f}x measured, {predicted[0] / predicted[1]:.2f}x predicted")
    verdict.check(
        f"the ring hides all P - 1 = {P - 1} messages under partial matmuls; plain TP none",
        hidden(async_clock) == P - 1 and hidden(plain_clock) == 0,
    )
    verdict.figure("emulated_ms", {"plain": plain_ms, "async": async_ms, "predicted": list(predicted)})


def _ring(mine, col):
    return lambda clock: all_gather_matmul(mine, col.weight, col.bias, None, clock)


def parse_args():
    parser = lesson_parser(__doc__)
    parser.add_argument("--global-batch", type=positive_int, default=4, help="sequences, N")
    parser.add_argument("--seq-len", type=positive_int, default=12, help="tokens per sequence, seq (P must divide it)")
    parser.add_argument("--dim", type=positive_int, default=24, help="model width d")
    parser.add_argument("--ffn-width", type=positive_int, default=48, help="MLP hidden width d_ff (P must divide it)")
    add_emulate_args(parser, ms_per_layer=20.0, unit="ms of one partial matmul (a block of rows)")
    parser.add_argument(
        "--link-ms", type=nonnegative_float, default=20.0, help="emulated device: ms per block's message"
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="emulated runs timed (the median is shown)")
    return parser.parse_args()


def world_rules(args, world_size: int) -> None:
    require(
        args.seq_len % world_size == 0, "--seq-len", f"seq = {args.seq_len} does not cut into P = {world_size} blocks"
    )
    require(
        args.ffn_width % world_size == 0, "--ffn-width", f"d_ff = {args.ffn_width} does not cut over P = {world_size}"
    )


def main() -> int:
    args = check_flags_against_world(parse_args(), world_rules)
    with distributed(args.device) as rt:
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 18: async tensor parallelism[/] - P = {rt.world_size}, N = {args.global_batch}, "
            f"seq = {args.seq_len}, d = {args.dim}, d_ff = {args.ffn_width}, backend {rt.backend}, float64"
        )
        show_rings(rt, args, verdict)
        show_mlp(rt, args, verdict)
        if args.emulate_ms > 0:
            show_emulated(rt, args, verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
