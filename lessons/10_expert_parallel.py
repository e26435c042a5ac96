"""Lesson 10: expert parallelism. A mixture-of-experts MLP whose E experts are split over the ranks: every
token travels to the rank that owns its experts and back, by two all-to-alls.

    torchrun --nproc-per-node 4 lessons/10_expert_parallel.py    # P must divide E (--experts)

The layer (`distlab/layer_split/expert_parallel/moe.py`, also the one-process reference): a router gives every token a
softmax gate over the E experts; the token goes to its kappa best (top-kappa, kappa = 1 or 2), and their
outputs are added with the chosen gates as weights (renormalised over the two when kappa = 2). An expert
takes at most capacity = ceil(gamma kappa N seq / E) tokens a step, by this lesson's rule, global order: for
every expert, the tokens routed to it in global order (rank 0's first), the first `capacity` kept, the rest
dropped; the same tokens at any P, so the split layer equals one process, drops and all. GShard and Switch
count capacity locally instead, per rank: each rank's buffer for an expert holds ceil(gamma kappa C seq / E) of
that rank's own tokens (section 5 prints both, and each rank's drops under each).
The load-balancing loss is L_aux = E sum_i phi_i pi_i: phi_i the fraction of the step's choices (all kappa of
each token's) that went to expert i, pi_i the mean gate of expert i; the loss is L_task + alpha L_aux. (GShard's
f_i counts each token's top-1 choice only; Switch, kappa = 1, cannot tell the two apart.) alpha = 1 here (the
--aux-weight default) is 100 times Switch's usual 0.01: at this toy size and these few steps the balancing term
must be strong enough to show within the run; at scale 0.01 (or less) keeps it from fighting the task loss.

Expert parallelism. Rank r holds C = N / P sequences (C seq tokens) and the experts r E/P .. (r+1) E/P - 1;
attention, LayerNorms and router are replicated and their gradients averaged as DDP averages (lesson 06).
A forward, on every rank:

  1. route its own tokens, and sort its (token, expert) choices by expert;
  2. the counts first: one all-gather of every rank's E counts gives every rank the P x E routing counts,
     and from them, with no further message, the capacity rule (rank r keeps for expert i what is left of
     the capacity after ranks 0 .. r-1, global order), the rows it sends each rank and the rows it receives;
  3. dispatch: `all_to_all_single` with those uneven splits takes the tokens to their experts' owners;
  4. every expert runs on its tokens from every rank;
  5. combine: the reverse all-to-all (the splits swapped) brings the outputs home, each added to its
     token's row with its weight.

An all-to-all only moves rows, so its backward is the reverse all-to-all (`AllToAll`, proven equal to torch's
`all_to_all_single_autograd`). An expert's gradient arrives summed over every rank's tokens: divided by P
it is the gradient of the mean over the step, exactly as DDP's average is for the replicated weights.

The pitfall. DDP averages what every rank computes. L_aux from each rank's own counts phi^r, averaged, is
(1/P) sum_r E sum_i phi^r_i pi^r_i, a mean of products and not the product of the means E sum_i phi_i pi_i:
its gradient differs (measured below). The fix is the counts exchanged before the product (the all-gather of
step 2; an all-reduce of phi would do), so that every rank uses the step's phi. Capacity is a choice between two
rules, not a bug: GShard's local rule (each rank keeps its own first ceil(gamma kappa C seq / E)) drops other
tokens than one process would, spread over the ranks that overflow; this lesson's global order drops exactly the
one process's, and so puts every drop on the highest ranks (for each expert, a rank loses tokens only once the
ranks before it have filled the capacity: at P = 4 the last rank takes most of the drops), and need not drop
fewer (section 5 prints each rule's drops per rank). With global statistics and global order the layer equals
one process on the whole batch, float64, drops and all. What the wrong statistics do to training (section 6): on
data whose ranks hold different domains, local statistics make every rank spread its own tokens over every
expert, so no expert can specialise in a domain, and the task loss stays higher; global statistics leave the
ranks free to specialise. They balance the step's load only on average, not in every run: the table prints the
step's load max/mean beside the task loss, and at P = 2 the global run's is the higher one. Qiu et
al. (2025), "Demons in the Detail: On Implementing Load Balancing Loss for Training Specialized
Mixture-of-Expert Models" (https://arxiv.org/abs/2501.11873), show the same at scale.

Bytes rank r sends, a token's row being d values of e bytes: dispatch, its tokens that leave for other
ranks; combine, the other ranks' tokens it returns; backward, the same rows the other way; and the counts
(`distlab/layer_split/expert_parallel/cost.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from distlab.comm import compat
from distlab.comm.agree import rank_table
from distlab.comm.collectives import all_to_all_bytes
from distlab.comm.differentiable import all_to_all
from distlab.comm.ledger import Ledger
from distlab.comm.ring import Ring
from distlab.layer_split.expert_parallel import cost, report, runs, training
from distlab.layer_split.expert_parallel.checks import check_all_to_all, uneven_counts
from distlab.layer_split.expert_parallel.moe import (
    MoE,
    MoEBlock,
    MoEConfig,
    balance_loss,
    capacity,
    kept_choices,
    route,
)
from distlab.processes.console import print0, rows_table
from distlab.processes.flags import (
    add_global_batch,
    check_flags_against_world,
    divides_global_batch,
    nonnegative_float,
    positive_float,
    positive_int,
    require,
)
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import lesson_parser
from distlab.proof.compare import compare_whole, grads_of
from distlab.proof.training import mean_over_ranks, reduce_gradients
from distlab.proof.verdict import Verdict

# ---- the mechanism: the all-to-all and its backward; the plan; dispatch, experts, combine --------


def _row_bytes(x: torch.Tensor) -> int:
    return x[0].numel() * x.element_size() if len(x) else 0


class AllToAll(torch.autograd.Function):
    """Rows send[q] of x to rank q, recv[s] rows from rank s. Backward: every gradient row goes back to the
    rank its row came from, the all-to-all with the counts swapped (it only moves rows: nothing to sum)."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group, ledger: Ledger, phases: tuple[str, str]):
        ctx.counts, ctx.group, ctx.ledger, ctx.phase = (send, recv), group, ledger, phases[1]
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        ledger.add(phases[0], "all_to_all", all_to_all_bytes(send, _row_bytes(x), dist.get_rank(group)))
        return out

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.counts
        back = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), send, recv, group=ctx.group)  # recv rows out, send in
        ctx.ledger.add(ctx.phase, "all_to_all", all_to_all_bytes(recv, _row_bytes(grad), dist.get_rank(ctx.group)))
        return back, None, None, None, None, None


DISPATCH, COMBINE = ("dispatch", "dispatch backward"), ("combine", "combine backward")


@dataclass
class Plan:
    """Who sends which tokens where, derived on every rank from the counts every rank shares."""

    routed: torch.Tensor  # (P, E): tokens of rank s that chose expert i, before drops
    kept: torch.Tensor  # (P, E): of those, the ones the capacity rule keeps
    tokens: torch.Tensor  # this rank's kept choices, sorted by expert: the token ...
    slots: torch.Tensor  # ... and which of its kappa choices it is
    send: list[int]  # rows to each rank: my kept tokens for its experts
    recv: list[int]  # rows from each rank: its kept tokens for my experts


def make_plan(chosen: torch.Tensor, experts: int, most: int | None, group, ledger: Ledger, rule: str) -> Plan:
    """Sort this rank's choices by expert, exchange the counts, keep what the capacity `most` allows, split.
    rule "global": expert i keeps the step's first `most` tokens in global order, so rank r keeps what is
    left after ranks 0 .. r-1; rule "rank" (the pitfall): every rank its own first `most`."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    kappa, per_rank = chosen.shape[1], experts // world
    flat = chosen.flatten()  # choice j of token t at t kappa + j: token order
    order = torch.argsort(flat, stable=True)  # by expert; within an expert token order stays
    counts = torch.bincount(flat, minlength=experts)
    routed = counts.new_empty(world * experts)
    compat.all_gather_single(routed, counts, group=group)  # the counts first: every rank's, on every rank
    routed = routed.view(world, experts)
    ledger.record("counts", "all_gather", routed, group)
    kept = routed.clone()
    if most is not None:
        before = routed.cumsum(0) - routed if rule == "global" else torch.zeros_like(routed)
        kept = (most - before).clamp(min=0).minimum(routed)  # what is left of the capacity, per (rank, expert)
    expert = flat[order]
    place = torch.arange(len(order), device=flat.device) - (counts.cumsum(0) - counts)[expert]  # i-th for expert
    keep = order[place < kept[rank][expert]]
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    send, recv = kept[rank].view(world, per_rank).sum(1), kept[:, mine].sum(1)
    return Plan(routed, kept, keep // kappa, keep % kappa, send.tolist(), recv.tolist())


class ExpertParallelMoE(nn.Module):
    """`moe` with this rank's E / P experts: u (this rank's tokens, d) -> (MoE(u), L_aux). statistics
    "global" or "local": whose counts phi comes from; rule "global" or "rank": where capacity is counted."""

    def __init__(self, moe: MoE, ledger: Ledger, statistics: str = "global", rule: str = "global", group=None):
        super().__init__()
        self.cfg, self.ledger, self.statistics, self.rule, self.group = moe.cfg, ledger, statistics, rule, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.router = moe.router  # replicated: every rank routes its own tokens
        mine = range(self.rank * moe.cfg.experts // self.world, (self.rank + 1) * moe.cfg.experts // self.world)
        self.experts = nn.ModuleDict({str(i): moe.experts[str(i)] for i in mine})  # keyed by global index
        self.plan = None  # the last forward's, for the lesson's tables

    def forward(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return expert_parallel_moe(self, u)


def expert_parallel_moe(layer: ExpertParallelMoE, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Route, exchange the counts, dispatch, run my experts, combine: (MoE(u), L_aux) for this rank's tokens."""
    routing = route(layer.router, u, layer.cfg.top_k)
    step_tokens = len(u) * (layer.world if layer.rule == "global" else 1)  # equal shares: N seq, or C seq
    most = capacity(layer.cfg, step_tokens)
    layer.plan = plan = make_plan(routing.chosen, layer.cfg.experts, most, layer.group, layer.ledger, layer.rule)
    arrived = AllToAll.apply(u[plan.tokens], plan.send, plan.recv, layer.group, layer.ledger, DISPATCH)
    done = run_experts(layer.experts, arrived, plan.kept[:, [int(i) for i in layer.experts]])
    back = AllToAll.apply(done, plan.recv, plan.send, layer.group, layer.ledger, COMBINE)  # the splits swapped
    weight = routing.weights[plan.tokens, plan.slots].unsqueeze(-1)
    out = torch.zeros_like(u).index_add(0, plan.tokens, weight * back)  # each output home, weighted
    return out, aux_loss(routing.gates, plan.routed, layer.statistics, layer.rank)


def run_experts(experts: nn.ModuleDict, arrived: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """Rows arrive by source rank, within a source by expert (mine[s, j] rows of rank s for my expert j).
    Expert j takes its rows of every source in rank order (global order); its outputs go back in place."""
    world, per_rank = mine.shape
    pieces = list(arrived.split(mine.flatten().tolist()))  # source-major
    for j, expert in enumerate(experts.values()):
        where = [s * per_rank + j for s in range(world)]
        outputs = expert(torch.cat([pieces[k] for k in where])).split(mine[:, j].tolist())
        for k, y in zip(where, outputs):
            pieces[k] = y
    return torch.cat(pieces)


def aux_loss(gates: torch.Tensor, routed: torch.Tensor, statistics: str, rank: int) -> torch.Tensor:
    """L_aux with this rank's pi (its mean gates). Global statistics: phi of the step's counts (every rank's,
    exchanged), so the ranks' mean is E sum_i phi_i pi_i; local: phi of this rank's own counts."""
    counts = (routed.sum(0) if statistics == "global" else routed[rank]).to(gates.dtype)  # not int / int: float32
    return balance_loss(counts / counts.sum(), gates.mean(0))


def average_gradients(model: nn.Module, world: int) -> None:
    """DDP's average for the replicated weights (one all-reduce of them all, / P); an expert's gradient
    already holds every rank's tokens (the combine's backward brought them), so it is only divided by P."""
    for param in model.parameters():
        if param.grad is None:  # an expert no token reached
            param.grad = torch.zeros_like(param)
    replicated = [p for name, p in model.named_parameters() if ".experts." not in name]
    reduce_gradients(replicated, lambda flat: dist.all_reduce(flat) or flat)
    for param in model.parameters():
        param.grad /= world


# ---- the runs: the expert-parallel block, and what the reference decides -------------------------


def parallel_block(rt: Runtime, cfg: MoEConfig, statistics: str = "global", rule: str = "global"):
    """(the block with its MoE split over the ranks, its layer): every rank builds the whole MoEBlock from
    the same seed and keeps its own experts only."""
    block = MoEBlock(cfg)
    block.moe = layer = ExpertParallelMoE(block.moe, Ledger(), statistics, rule)
    return block.to(rt.device), layer


def model_config(args, top_k: int | None = None, drops: bool = True) -> MoEConfig:
    gamma = args.capacity_factor if drops else None
    return MoEConfig(
        args.dim, args.heads, args.ffn_width, args.experts, top_k or args.top_k, gamma, args.aux_weight, args.seed
    )


def problem(args) -> runs.Problem:
    return runs.Problem(args.global_batch, args.seq_len, args.seed, args.steps, args.lr)


# ---- the chapter, part by part -------------------------------------------------------------------


def show_all_to_all(rt: Runtime, verdict: Verdict) -> None:
    print0("\n[bold]1. The all-to-all with uneven splits, forward and backward, against one process[/]")
    ledger, ring = Ledger(), Ring()
    ways = {
        "the lesson's AllToAll": lambda x, s, r: AllToAll.apply(x, s, r, None, ledger, ("forward", "backward")),
        "distlab.comm.differentiable": lambda x, s, r: all_to_all(x, s, r),
        "torch's all_to_all_single_autograd": lambda x, s, r: funcol.all_to_all_single_autograd(
            x, r, s, dist.group.WORLD
        ),
    }
    exact = {name: check_all_to_all(rt, way) for name, way in ways.items()}
    exact["by hand (Ring.all_to_all), twice"] = check_all_to_all(rt, ring.all_to_all, by_hand=True)
    counts = uneven_counts(rt.world_size)
    send, recv = counts[rt.rank], [row[rt.rank] for row in counts]
    formula = {"forward": all_to_all_bytes(send, 3 * 8, rt.rank), "backward": all_to_all_bytes(recv, 3 * 8, rt.rank)}
    counted = [ledger.sent_in(phase) for phase in formula]
    print0("rank s sends rank q (s + 2q) mod 3 rows of 3 float64 values (some none)", highlight=False)
    mark = {True: "exact", False: "[red]differs[/]"}
    table = [(name, mark[f], mark[b]) for name, (f, b) in exact.items()]
    print0(rows_table("", ("against one process", "forward", "backward"), table))
    print0(f"the lesson's bytes, rank 0: {counted}; formula {list(formula.values())}", highlight=False)
    verdict.check(
        "all-to-all: ours, by hand and torch's = one process, forward and backward", all(map(all, exact.values()))
    )
    verdict.check(
        "all-to-all bytes = rows that leave the rank x row bytes, each way", counted == list(formula.values())
    )


def show_exactness(rt: Runtime, args, verdict: Verdict) -> None:
    print0(f"\n[bold]2. Expert parallelism against one process on the whole batch, {args.steps} SGD steps[/]")
    table, rows = [], problem(args).rows(rt.rank, rt.world_size)
    for top_k, drops in ((1, False), (1, True), (2, False), (2, True)):
        cfg = model_config(args, top_k, drops)
        block, _ = parallel_block(rt, cfg)
        (run, z), (ref, ref_z) = (
            runs.split_run(rt, block, cfg, problem(args), sync(block, rt)),
            runs.one_process_run(cfg, problem(args)),
        )
        errors, ok = runs.differences(ref, ref_z[rows], run, z)
        every = rank_table([*errors, ok], rt.device)
        held = bool(every[:, -1].min())
        label = f"kappa {top_k}, " + (f"gamma {args.capacity_factor:g}" if drops else "no drop")
        table.append((label, *(f"{v:.0e}" for v in every[:, :-1].max(0).values.tolist()), "yes" if held else "NO"))
        verdict.check(f"{label}: output, gradients, parameters, losses = one process", held)
    print0("largest |a - r| / max |r| over the ranks (step 1's output and gradients)", highlight=False)
    print0(rows_table("", ("", "out", *runs.PARTS, "params", "loss", "="), table))


PHASES = ("counts", "dispatch", "combine", "combine backward", "dispatch backward")  # cost.expected_bytes' order
GAMMAS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


def show_routing(rt: Runtime, args, verdict: Verdict) -> None:
    print0("\n[bold]3. Where the tokens go, what is dropped, and the bytes each rank sends[/]")
    cfg, p = model_config(args), rt.world_size
    block, layer = parallel_block(rt, cfg)
    x, target = (t.to(rt.device) for t in problem(args).batch(cfg.dim, problem(args).rows(rt.rank, p)))
    runs.loss_of(block(x), target, cfg.aux_weight).backward()  # one forward and backward, counted
    ref = runs.decisions(cfg, problem(args), p)
    same = torch.equal(layer.plan.kept.cpu(), ref.kept_counts) and torch.equal(
        layer.plan.routed.cpu(), ref.routed_counts
    )
    verdict.check("every rank's plan keeps what the one-process capacity rule keeps", same)
    to_owner, most = cost.routing_matrix(ref.kept_counts, p), capacity(cfg, len(ref.kept))
    print0(report.owner_table(to_owner.tolist()))
    print0(
        report.load_table(
            ref.routed_counts.sum(0).tolist(), ref.kept_counts.sum(0).tolist(), most, args.capacity_factor
        )
    )
    every = [list(cost.expected_bytes(ref.kept_counts, s, args.dim * 8).values()) for s in range(p)]
    counted = rank_table([layer.ledger.sent_in(phase) for phase in PHASES], rt.device).long().tolist()
    print0(report.bytes_table(counted, every, args.dim * 8))
    verdict.check("bytes = formula: the counts; dispatch and combine, forward and backward", counted == every)
    drops = [(g, capacity(replace(cfg, capacity_factor=g), len(ref.kept))) for g in GAMMAS]
    drops = [(g, c, int((~kept_choices(ref.routing, c)).sum())) for g, c in drops]
    print0(report.drops_table(drops, ref.kept.numel()))
    routing = {"to_owner": to_owner.tolist(), "routed": ref.routed_counts.tolist(), "kept": ref.kept_counts.tolist()}
    verdict.figure("routing", {**routing, "capacity": most})
    verdict.figure("bytes", {"counted": counted, "formula": every, "phases": PHASES})
    verdict.figure("drops", {"rows": drops, "choices": ref.kept.numel()})


def show_statistics(rt: Runtime, args, verdict: Verdict) -> None:
    print0("\n[bold]4. The pitfall: L_aux from each rank's own counts, averaged as DDP averages[/]")
    cfg, x = model_config(args), problem(args).batch(args.dim)[0]
    reference = MoEBlock(cfg)
    want = reference(x)[1]
    want.backward()  # L_aux alone: its gradient reaches the router, and through u attention and LayerNorms
    expected, found, same = {n: g for n, g in grads_of(reference).items() if ".experts." not in n}, {}, {}
    for statistics in ("local", "global"):
        block, _ = parallel_block(rt, cfg, statistics)
        aux = block(x[problem(args).rows(rt.rank, rt.world_size)].to(rt.device))[1]
        aux.backward()
        sync(block, rt)()
        diff = compare_whole(expected, {n: g for n, g in grads_of(block).items() if n in expected})
        every = rank_table([runs.relative(diff, expected), diff.cosine, diff.ok], rt.device)
        found[statistics] = (mean_over_ranks([aux.item()], rt)[0], every[:, 0].max().item(), every[:, 1].min().item())
        same[statistics] = bool(every[:, 2].min()) and abs(found[statistics][0] - want.item()) < 1e-12
    print0(report.statistics_table(found, want.item()))
    verdict.check("global statistics: L_aux and its gradient = one process's", same["global"])
    verdict.check(
        "local statistics: a mean of products; L_aux, gradient differ (P > 1)", rt.world_size == 1 or not same["local"]
    )
    verdict.figure(
        "statistics", {k: {"aux": v[0], "rel": v[1]} for k, v in found.items()} | {"one process": want.item()}
    )


def show_capacity(rt: Runtime, args, verdict: Verdict) -> None:
    print0("\n[bold]5. Two capacity rules: GShard's per rank (local), and this lesson's global order[/]")
    cfg, p, rows = model_config(args), rt.world_size, problem(args).rows(rt.rank, rt.world_size)
    ref, x = runs.decisions(cfg, problem(args), p), problem(args).batch(cfg.dim)[0]
    z_want, share = MoEBlock(cfg)(x)[0].detach()[rows], len(ref.kept) // p
    want, facts, plans = ref.kept[rt.rank * share : (rt.rank + 1) * share], {}, {}
    for rule, tokens in (("rank", share), ("global", len(ref.kept))):
        block, layer = parallel_block(rt, cfg, rule=rule)
        with torch.no_grad():
            z = block(x[rows].to(rt.device))[0]
        got = torch.zeros_like(want)
        got[layer.plan.tokens.cpu(), layer.plan.slots.cpu()] = True
        every = rank_table([(~got).sum(), (got != want).sum(), compare_whole({"z": z_want}, {"z": z}).ok], rt.device)
        per_rank = [int(v) for v in every[:, 0].tolist()]
        facts[rule] = (capacity(cfg, tokens), sum(per_rank), int(every[:, 1].sum()), bool(every[:, 2].min()), per_rank)
        plans[rule] = (layer.plan.routed.cpu(), layer.plan.kept.cpu())
    print0(report.capacity_table(facts, (capacity(cfg, len(ref.kept)), int((~ref.kept).sum()))))
    verdict.check("global order: the reference's drops, its output", facts["global"][2:4] == (0, True))
    verdict.check("global order drops on the highest ranks, expert by expert", drops_last(*plans["global"]))
    verdict.check("GShard's per-rank rule drops other tokens (P > 1)", p == 1 or facts["rank"][2] > 0)
    verdict.figure("capacity", facts)


def drops_last(routed: torch.Tensor, kept: torch.Tensor) -> bool:
    """For every expert (a column of the P x E counts): once a rank drops some of its tokens, every later rank
    drops all of its own (kept 0), and every earlier rank kept all of its own."""
    for r in range(len(routed)):
        short = kept[r] < routed[r]
        if bool((short & ((kept[r + 1 :] > 0).any(0) if r + 1 < len(routed) else torch.zeros_like(short))).any()):
            return False
    return True


def show_training(rt: Runtime, args, verdict: Verdict) -> None:
    steps, last = args.train_steps, max(1, args.train_steps // 5)
    print0(f"\n[bold]6. Local statistics in training: {steps} AdamW steps, rank r's data from domain r[/]")
    setup = training.Setup(args.global_batch, args.seq_len, args.dim, steps, args.train_lr, args.aux_weight, args.seed)
    cfg = model_config(args, drops=False)
    trained = {statistics: train_with(rt, cfg, statistics, setup) for statistics in ("local", "global")}
    means = {name: [run.tail(k, last) for k in training.SERIES] for name, run in trained.items()}
    print0(report.training_table(means, last, cfg.experts // cfg.top_k))
    (task, _, _, own), (task_g, _, _, own_g) = means["local"], means["global"]
    if rt.world_size == 1:
        verdict.check(
            "P = 1: local and global statistics are the same", trained["local"].task == trained["global"].task
        )
    else:
        verdict.check("global statistics: a lower task loss than local ones", task_g < task)
        verdict.check("local statistics: every rank's own load flatter (no expert per domain)", own < own_g)
    verdict.figure("training", {name: vars(run) for name, run in trained.items()})


def train_with(rt: Runtime, cfg: MoEConfig, statistics: str, setup: training.Setup) -> training.BalanceRun:
    block, layer = parallel_block(rt, cfg, statistics)
    return training.train_for_balance(rt, block, lambda: layer.plan.routed, sync(block, rt), setup)


def sync(block: nn.Module, rt: Runtime):
    return lambda: average_gradients(block, rt.world_size)


def parse_args():
    parser = lesson_parser(__doc__)
    add_global_batch(parser, 12)
    parser.add_argument("--seq-len", type=positive_int, default=8, help="tokens per sequence, seq")
    parser.add_argument("--dim", type=positive_int, default=8, help="model width d (h must divide it)")
    parser.add_argument("--heads", type=positive_int, default=2, help="attention heads h")
    parser.add_argument("--ffn-width", type=positive_int, default=16, help="hidden width d_ff of each expert")
    parser.add_argument("--experts", type=positive_int, default=12, help="experts E (P must divide it)")
    parser.add_argument("--top-k", type=int, choices=(1, 2), default=2, help="experts per token, kappa")
    parser.add_argument("--capacity-factor", type=positive_float, default=1.0, help="gamma: capacity factor")
    parser.add_argument(
        "--aux-weight", type=nonnegative_float, default=1.0, help="alpha: L_aux's weight (Switch's usual: 0.01)"
    )
    parser.add_argument("--steps", type=positive_int, default=3, help="SGD steps of the equivalence check")
    parser.add_argument("--lr", type=positive_float, default=0.1, help="SGD learning rate of the check")
    parser.add_argument("--train-steps", type=positive_int, default=50, help="AdamW steps of section 6")
    parser.add_argument("--train-lr", type=positive_float, default=0.03, help="AdamW learning rate of section 6")
    args = parser.parse_args()
    require(args.dim % args.heads == 0, "--dim", f"d = {args.dim} is not a multiple of h = {args.heads}")
    require(args.top_k <= args.experts, "--top-k", f"kappa = {args.top_k} experts per token, only E = {args.experts}")
    return args


def world_rules(args, world_size: int) -> None:
    """E / P experts per rank and C = N / P sequences per rank, both whole."""
    require(args.experts % world_size == 0, "--experts", f"P = {world_size} ranks must divide E = {args.experts}")
    divides_global_batch(args, world_size)


def main() -> int:
    args = check_flags_against_world(parse_args(), world_rules)  # before any process group, every rank alike
    with distributed(args.device) as rt:
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 10: expert parallelism[/] - P = {rt.world_size}, E = {args.experts} "
            f"({args.experts // rt.world_size} a rank), kappa = {args.top_k}, gamma = {args.capacity_factor:g}, "
            f"N = {args.global_batch}, seq = {args.seq_len}, d = {args.dim}, alpha = {args.aux_weight:g}, "
            f"float64, {rt.backend}"
        )
        show_all_to_all(rt, verdict)
        show_exactness(rt, args, verdict)
        show_routing(rt, args, verdict)
        show_statistics(rt, args, verdict)
        show_capacity(rt, args, verdict)
        show_training(rt, args, verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
