"""Exercise 10: the expert-parallel MoE layer (counts, capacity rule, dispatch and combine by all-to-all with
uneven splits, L_aux), judged on 3 ranks against one process's MoE block on the whole batch.

Each rank builds the same MoE block with the lesson's expert-parallel layer, its forward replaced by the
answer, runs forward and backward of MSE + L_aux on its C sequences, and averages the gradients as DDP does
(replicated weights all-reduced / P, experts / P: their gradient already sums every rank's tokens). The
lesson's claims: the block's output, this rank's L_aux (E sum phi_i pi_i with the step's phi and this rank's
pi), the gradients of its experts and of the replicated weights equal one process's (float64, rtol 1e-10);
and its all-to-alls send the kept tokens' rows each way and little more (the judge prices every all-to-all
it sees by the bytes that leave the rank)."""

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from exercise_kit import Exercise, solution
from exercise_signatures import Equals, Mistake, Zero
from exercise_watch import Watch

from distlab.comm.ledger import Ledger
from distlab.layer_split.expert_parallel import cost, runs
from distlab.layer_split.expert_parallel.moe import (
    MoEBlock,
    MoEConfig,
    Routing,
    balance_loss,
    capacity,
    kept_choices,
    route,
)
from distlab.proof.compare import grads_of

LESSON, NAME = "10_expert_parallel", "expert_parallel_moe"
P = 3
CFG = MoEConfig(dim=6, heads=2, ffn=8, experts=6, top_k=2, capacity_factor=1.0, aux_weight=1.0, seed=7)
PROBLEM = runs.Problem(n=6, seq=6, seed=2)  # 36 tokens, 72 choices, capacity 12 per expert
PER_RANK = "the output with the capacity counted per rank (each rank its own first ceil(gamma kappa C seq / E))"
UNWEIGHTED = "the output with the experts' outputs added unweighted"
LOCAL = "L_aux with phi from this rank's own counts"
ON_U = "the output with the experts' outputs added onto u, the layer's input, not onto zeros"


def _alternatives(reference: MoEBlock, x: torch.Tensor, rows: slice) -> dict:
    """This rank's block output under each misreading, from the whole batch in one process."""
    with torch.no_grad():
        y, u = reference.tokens(x)
        mine = slice(rows.start * PROBLEM.seq, rows.stop * PROBLEM.seq)
        per_rank = reference.moe(u[mine])[0]  # the reference rule on this rank's tokens alone
        routing = route(reference.moe.router, u, CFG.top_k)
        kept = kept_choices(routing, capacity(CFG, len(u)))
        whole = reference.moe(u)[0]  # the layer's output on the whole batch, the global rule
        plain = torch.zeros_like(u)
        for t, slot in kept.nonzero().tolist():
            plain[t] += reference.moe.experts[str(int(routing.chosen[t, slot]))](u[t])
    return {
        PER_RANK: y[rows] + per_rank.view_as(y[rows]),
        UNWEIGHTED: (y + plain.view_as(y))[rows],
        ON_U: (y + (whole + u).view_as(y))[rows],
    }


def _aux(reference: MoEBlock, x: torch.Tensor, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's L_aux with the step's phi, and with its own phi), from the whole batch in one process."""
    with torch.no_grad():
        _, u = reference.tokens(x)
        routing = route(reference.moe.router, u, CFG.top_k)
    mine = slice(rows.start * PROBLEM.seq, rows.stop * PROBLEM.seq)
    counts = [
        torch.bincount(c.flatten(), minlength=CFG.experts).double() for c in (routing.chosen, routing.chosen[mine])
    ]
    pi = routing.gates[mine].mean(0)
    return tuple(balance_loss(c / c.sum(), pi) for c in counts)


def _sync(block, world) -> None:
    """DDP's average: the replicated weights all-reduced and / P, the experts' gradients / P (none: zero)."""
    for name, param in block.named_parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if ".experts." not in name:
            dist.all_reduce(param.grad)
        param.grad /= world


def reached(t: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors `t`'s graph reaches, read off its autograd nodes (nothing runs backward)."""
    leaves, seen, stack = set(), set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.add(id(node.variable))
        stack += [after for after, _ in node.next_functions]
    return leaves


def cut_from(layer, out: torch.Tensor) -> str:
    """The layer's replicated weights (the router's) that its output carries no graph to: their gradient then
    comes from L_aux alone, nothing through the gate weights. "" when the output reaches every one."""
    ids = reached(out)
    cut = [f"moe.{n}" for n, p in layer.named_parameters() if ".experts." not in f".{n}" and id(p) not in ids]
    if not cut:
        return ""
    through = "its gradient is L_aux's alone, none through the gate weights"
    return f"the MoE layer's output carries no graph to {', '.join(cut)}: {through}"


def _ranks(rt, expert_parallel_moe, claims) -> None:
    lesson = solution(LESSON, NAME).module()
    rows = PROBLEM.rows(rt.rank, P)
    x, target = PROBLEM.batch(CFG.dim)
    reference = MoEBlock(CFG)
    block = copy.deepcopy(reference)
    block.moe = layer = lesson.ExpertParallelMoE(block.moe, Ledger())
    graph = {}  # what the answer's output reaches, read as it returns

    def forward(u):
        result = expert_parallel_moe(layer, u)
        out = result[0] if isinstance(result, tuple) else result
        graph["cut"] = cut_from(layer, out) if isinstance(out, torch.Tensor) else ""
        return result

    layer.forward = forward
    with Watch() as watch:
        z, aux = block(x[rows])
        runs.loss_of((z, aux), target[rows], CFG.aux_weight).backward()
    _sync(block, P)
    alternatives = _alternatives(reference, x, rows)
    want_aux, local_aux = _aux(reference, x, rows)
    ref_z, ref_aux = reference(x)
    runs.loss_of((ref_z, ref_aux), target, CFG.aux_weight).backward()
    want = grads_of(reference)
    got = {n: p.grad for n, p in block.named_parameters()}
    output = claims.close(
        "the block's output equals one process's", z, ref_z[rows], what="the output", alternatives=alternatives
    )
    claims.close(
        "L_aux equals E sum phi_i pi_i with the step's phi",
        aux.reshape(1),
        want_aux.reshape(1),
        what="L_aux",
        alternatives={LOCAL: local_aux.reshape(1)},
    )
    mine = [n for n in got if ".experts." in n]
    claims.tensors(
        "the experts' gradients equal one process's",
        {n: got[n] for n in mine},
        {n: want[n] for n in mine},
        what="the experts' gradients",
    )
    # attn.k.bias: its gradient is zero in exact arithmetic (a key bias adds q . b to every score of a query
    # alike, and softmax ignores that), so only rounding is left of it, with no scale of its own to compare at
    shared = [n for n in got if ".experts." not in n and n != "attn.k.bias"]
    claims.tensors(
        "the replicated weights' gradients equal one process's",
        {n: got[n] for n in shared},
        {n: want[n] for n in shared},
        what="the router's, attention's and LayerNorms' gradients",
        note=graph.get("cut", ""),
    )
    if output:
        kept = runs.decisions(CFG, PROBLEM, P).kept_counts
        tokens = cost.expected_bytes(kept, rt.rank, CFG.dim * 8)
        rows_bytes = tokens["dispatch"] + tokens["combine"] + tokens["combine backward"] + tokens["dispatch backward"]
        sent = sum(call.nbytes for call in watch.collectives if call.kind == "all_to_all")
        claims.equal(
            "bytes: the all-to-alls send the kept tokens' rows each way, and little more",
            sent,
            rows_bytes,
            ok=rows_bytes <= sent <= rows_bytes + 2 * P * CFG.experts * 8,  # room for counts sent by all-to-all
            what="bytes the all-to-alls sent",
            note=f"all-to-alls seen: {dict(watch.calls()).get('all_to_all', 0)}",
            hints=("a dropped token's row need not travel: drop before you send",),
        )


MISTAKES = (
    Mistake(
        "the combine started from the input",
        "block's output equals",
        (Equals(ON_U),),
        (
            "the layer's output is the weighted experts' outputs alone: the block adds the residual around it",
            "each token's output starts from zeros, and a dropped token's output stays zero (the residual carries it)",
            "out = torch.zeros_like(u).index_add(0, tokens, weight * back)",
        ),
    ),
    Mistake(
        "L_aux from this rank's own counts",
        "L_aux equals",
        (Equals(LOCAL),),
        (
            "DDP averages what each rank computes: the mean of the ranks' E sum phi^r pi^r is not E sum phi pi",
            "phi must be the step's (every rank's counts, exchanged before the product); pi stays this rank's, "
            "and DDP's mean of it is the step's",
            "counts = the P x E counts you exchanged, summed over ranks; phi = counts / counts.sum(); "
            "balance_loss(phi, gates.mean(0))",
        ),
        holds=("output equals",),
    ),
    Mistake(
        "capacity counted per rank",
        "output equals",
        (Equals(PER_RANK),),
        (
            "the capacity belongs to the step: ceil(gamma kappa N seq / E), the tokens in global order",
            "rank r keeps for expert i what ranks 0 .. r-1 left of its capacity: that needs every rank's counts",
            "kept = (capacity - (routed.cumsum(0) - routed)).clamp(min=0).minimum(routed), routed the P x E counts",
        ),
    ),
    Mistake(
        "the outputs combined without their weights",
        "output equals",
        (Equals(UNWEIGHTED),),
        (
            "each expert's output counts with its gate weight",
            "multiply the rows that come back by the weights of the choices they answer, then add them in",
            "out.index_add(0, tokens, weights[tokens, slots].unsqueeze(-1) * back)",
        ),
    ),
    Mistake(
        "an all-to-all autograd cannot see",
        "experts' gradients",
        (Zero(),),
        (
            "the output is right but no gradient reached the experts: the way home has no backward",
            "dist.all_to_all_single writes into a buffer autograd knows nothing of; wrap it in an autograd "
            "Function whose backward is the reverse all-to-all",
            "distlab.comm.differentiable.all_to_all(rows, send, recv, group), or torch's "
            "all_to_all_single_autograd(rows, recv, send, group), both ways",
        ),
        holds=("output equals",),
    ),
)


def _solve(layer, u):
    return solution(LESSON, NAME).load()(layer, u)


def onto_the_input(layer, u):
    """Every token's weighted expert outputs added onto its own row of u (a dropped token "passing through")."""
    out, aux = _solve(layer, u)
    return out + u, aux


def local_statistics(layer, u):
    """phi from this rank's own counts."""
    layer.statistics = "local"
    try:
        return _solve(layer, u)
    finally:
        layer.statistics = "global"


def per_rank_capacity(layer, u):
    """Each rank keeps its own first ceil(gamma kappa C seq / E) per expert."""
    layer.rule = "rank"
    try:
        return _solve(layer, u)
    finally:
        layer.rule = "global"


def _unit_weights(router, u, top_k):
    routing = route(router, u, top_k)
    return Routing(routing.gates, routing.chosen, torch.ones_like(routing.weights))


def unweighted(layer, u):
    """The experts' outputs added as they come back, without their weights."""
    from exercise_kit import swapped

    with swapped(solution(LESSON, NAME), route=_unit_weights):
        return _solve(layer, u)


class _Untracked:
    """An all-to-all that moves the rows and tells autograd nothing."""

    @staticmethod
    def apply(x, send, recv, group, ledger, phases):
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.detach().contiguous(), recv, send, group=group)
        return out


def no_backward(layer, u):
    """dist.all_to_all_single both ways, with no autograd Function around it."""
    from exercise_kit import swapped

    with swapped(solution(LESSON, NAME), AllToAll=_Untracked):
        return _solve(layer, u)


def dropped_sent_anyway(layer, u):
    """Right numbers: every chosen token sent and computed, the dropped ones weighted 0 at home; more bytes."""
    lesson = solution(LESSON, NAME).module()
    routing = route(layer.router, u, layer.cfg.top_k)
    most = capacity(layer.cfg, len(u) * layer.world)
    everything = lesson.make_plan(routing.chosen, layer.cfg.experts, None, layer.group, Ledger(), "global")
    kept = lesson.make_plan(routing.chosen, layer.cfg.experts, most, layer.group, Ledger(), "global")
    keep = torch.zeros_like(routing.chosen, dtype=torch.bool)
    keep[kept.tokens, kept.slots] = True
    arrived = lesson.AllToAll.apply(u[everything.tokens], everything.send, everything.recv, None, Ledger(), ("f", "b"))
    done = lesson.run_experts(layer.experts, arrived, everything.kept[:, [int(i) for i in layer.experts]])
    back = lesson.AllToAll.apply(done, everything.recv, everything.send, None, Ledger(), ("f", "b"))
    weight = (routing.weights * keep)[everything.tokens, everything.slots].unsqueeze(-1)
    out = torch.zeros_like(u).index_add(0, everything.tokens, weight * back)
    return out, lesson.aux_loss(routing.gates, everything.routed, "global", layer.rank)


# World sizes: P = 3 only: global and per-rank capacity, and uneven all-to-all splits, differ at P = 3; the layer's
# group is the world.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "every token's row goes to the rank owning its expert and its output comes back: two all-to-alls, "
        "their splits from the counts every rank shares",
        "route; sort the choices by expert; all-gather the E counts; keep by the capacity in global order; "
        "all-to-all the kept rows (send: per rank, its experts' kept rows); experts; all-to-all back; add weighted",
        "counts = bincount(chosen); routed = all-gathered (P, E); kept = (capacity - earlier ranks').clamp "
        "(min=0).minimum(routed); send = kept[r] summed per owner; recv = kept[:, my experts] summed per source",
    ),
    numbers="equals|equal one",
)
WRONG = {
    "L_aux from this rank's own counts": "local_statistics",
    "capacity counted per rank": "per_rank_capacity",
    "the outputs combined without their weights": "unweighted",
    "an all-to-all autograd cannot see": "no_backward",
    "the combine started from the input": "onto_the_input",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"dropped_sent_anyway": "bytes"})

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
