"""The second audit's slips: one more plausible mistake per exercise, planted after the judge learnt to say what
each rank's answer ran, to agree on every claim across ranks and to read a ratio only as one possibility; chosen
from the lessons alone, none of them a catalogued mistake nor the first audit's slip (`exercise_slips.SLIPS`).
Each is a `Slip`: `names` is what the first hint (level 1) says that names it; where it does not, `unnamed` says
what the hint said instead; where no claim fails, `missed` says why (its test is then an expected failure). The
table in lessons/exercises/README.md records them; `Exercise.audit_test(here, second=True)` asserts them."""

from exercise_slips import Slip

NEW_SLIPS = {
    "model_parallel_step": Slip(
        "the received gradient divided by the micro-batch's rows again before backward (a mean taken twice)",
        "a_out.backward(grad_out)",
        "a_out.backward(grad_out / len(x))",
        names=r"its gradients are 0\.125 x the backward of what it received: it changed the received gradient",
    ),
    "gpipe": Slip(
        "the micro-batches numbered from 1 to M, not from 0",
        '[Action(kind, i, r) for kind in "FI" for i in range(microbatches)]',
        '[Action(kind, i, r) for kind in "FI" for i in range(1, microbatches + 1)]',
        names=r"every rank runs micro-batches 1, 2, 3, 4, not 0\.\.3",
    ),
    "one_f_one_b": Slip(
        "the steady state runs the newest micro-batch's backward, not the oldest's",
        'order += [Action("F", warmup + k, r), Action("I", k, r)]',
        'order += [Action("F", warmup + k, r), Action("I", warmup + k, r)]',
        names=r"rank 2's action 2 \(from 0\) is 2I1 [^\n]*; the lesson's order runs 2I0 [^\n]*micro-batches 0, 1",
    ),
    "pipeline_for_rank": Slip(
        "the schedule's name ignored: ScheduleGPipe for both",
        '{"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[name]',
        "pipelining.ScheduleGPipe",
        names=r"the order is the other schedule's",
    ),
    "zb_h1": Slip(
        "the warm-up not capped at M (P - r - 1 forwards even when fewer micro-batches exist)",
        "warmup = min(num_ranks - r - 1, microbatches)",
        "warmup = num_ranks - r - 1",
        names=r"at M = 1, per rank: forwards before the first I 2, 1, 1 \(the lesson's 1, 1, 1\)",
    ),
    "all_reduce_gradients": Slip(
        "the sum divided by P - 1 (the other ranks), not by P",
        "param.grad /= rt.world_size",
        "param.grad /= rt.world_size - 1",
        names=r"one reading, not a diagnosis: P/\(P-1\)",
    ),
    "zero1": Slip(
        "each rank steps its shard of its own gradient: the reduce-scatter left out",
        "shard.grad = z.ring.reduce_scatter(unit.flatten(grads)) / rt.world_size",
        "shard.grad = unit.my_shard(unit.flatten(grads))",
        names=r"'bytes sent per step = 2 \(P-1\) e Psi_P' failed too[^\n]*: 352, not 704(.|\n)*ran: every rank: broadc",
    ),
    "Copy": Slip(
        "f's backward all-reduces a copy and returns the gradient it was given",
        "dist.all_reduce(grad, group=ctx.group)",
        "dist.all_reduce(grad.clone(), group=ctx.group)",
        names=r"what f's backward returned: the gradient it was given \(its all-reduce's result left unused\)",
    ),
    "ring_forward": Slip(
        "each tile's positions read from this rank's own pieces, not those of the block it holds",
        "for cols, key_positions in layout.pieces(source):",
        "for cols, key_positions in layout.pieces(ring.rank):",
        names=r"\(0, 3\) masked with the diagonal's triangle \(as if its queries and keys were one piece\), where the",
    ),
    "expert_parallel_moe": Slip(
        "the combine's all-to-all given the dispatch's splits, not the swapped ones",
        "back = AllToAll.apply(done, plan.recv, plan.send, layer.group, layer.ledger, COMBINE)",
        "back = AllToAll.apply(done, plan.send, plan.recv, layer.group, layer.ledger, COMBINE)",
        names=r"Split sizes doesn't match.*\n.*all_to_all_single",
    ),
    "ulysses_attention": Slip(
        "the group passed to the first all-to-all only: the way back runs on every rank of the job",
        "return heads_to_seq(out, ledger, PHASES, group)",
        "return heads_to_seq(out, ledger, PHASES)",
        names=r"all_to_all on ranks 0-1 x3, all_to_all on ranks 0-3",
    ),
    "parallelize": Slip(
        "only the blocks tensor-parallel: the embedding and head left whole on the tp ranks",
        'parallelize_module(model, mesh["tp"], {k: v for k, v in EDGES.items() if getattr(model, k) is not None})',
        "pass",
        names=r"tp leaves whole embed\.weight, head\.weight, which the lesson's plan cuts",
    ),
    "rank_bytes": Slip(
        "every bias cut by tp, out's and fc2's too (they stay whole on every rank)",
        "psi = (attention - d) // tp + d + (mlp - d) // tp + d + norms",
        "psi = attention // tp + mlp // tp + norms",
        names=r"-768 bytes: exactly the whole biases, attn\.out\.bias and mlp\.fc2\.bias cut by tp",
    ),
    "fp8_matmul": Slip(
        "b's transpose made contiguous (row-major) where _scaled_mm wants it column-major",
        "bt_q.contiguous().t(),",
        "bt_q.t().contiguous(),",
        names=r"handed to torch\._scaled_mm: b row-major in every call, not a row-major, b column-major",
    ),
    "fp8_all_gather": Slip(
        "rho computed and returned but never applied before the cast",
        "mine = (shard.float() * rho).clamp(-top, top).to(fmt)",
        "mine = shard.float().clamp(-top, top).to(fmt)",
        names=r"the 8-bit shard it sent was cast at: 1 \(rho never applied\), not rho",
    ),
    "Offloader": Slip(
        "a saved tensor keyed by its storage alone: two views of one storage share one copy",
        "key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())",
        "key = (storage.data_ptr(),)",
        names=r"the saved view at offset 6 \(columns 6\.\.\) came back holding the half at offset 0's values",
    ),
    "powersgd_hook": Slip(
        "the error feedback's sign slipped: Delta_r = what every rank uses - M_r",
        "state.errors[index] = before - flat",
        "state.errors[index] = flat - before",
        names=r"the answer kept \(state\.errors\): every compressed step \(2, 3, 4\): what every rank uses - M_r",
    ),
    "all_gather_matmul": Slip(
        "the ring run the other way (sent left, received from the right) with the blocks labelled as before",
        "[(held, right)], [(torch.empty_like(held), left)]",
        "[(held, left)], [(torch.empty_like(held), right)]",
        names=r"rank 0: send to rank 2 on ranks 0-2 x2, recv from rank 1",
    ),
    "dualpipev": Slip(
        "the turn runs r pairs of forwards, not r + 1",
        "for _ in range(r + 1):  # 2. the turn",
        "for _ in range(r):  # 2. the turn",
        names=r"r \+ 1 at the turn",
    ),
    "outer_step_by_hand": Slip(
        "theta never moved to the stepped weights: every round's pseudogradient taken from the first round's start",
        "theta[param] = param.detach().clone()",
        "pass",
        names=r"theta holds the new weights",
    ),
    "global_loss_times_p": Slip(
        "the loss divided by P (DDP's sum undone by hand), not multiplied",
        "return rt.world_size * loss, value",
        "return loss / rt.world_size, value",
        names=r"one reading, not a diagnosis: 1/P\^2",
    ),
    "local_clip_loss": Slip(
        "the second direction's logits against the text tower again: z_y Z_y^T, not z_y Z_x^T",
        "logits_y = s * local_z_y @ all_z_x.T",
        "logits_y = s * local_z_y @ all_z_y.T",
        names=r"s z_x Z_y\^T and s z_y Z_y\^T, not s z_x Z_y\^T and s z_y Z_x\^T",
    ),
    "gather_all_reduce": Slip(
        "the backward returns rows r .. r + C - 1 of the sum, not rC .. rC + C - 1",
        "return summed[ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c]",
        "return summed[ctx.rank : ctx.rank + ctx.c]",
        within="AllGatherSumBackward",
        names=r"failed too, on rank\(s\) 1, 2: rows 1\.\.4 of the sum, not rows 4\.\.7",
    ),
    "grad_cache_step": Slip(
        "the cached gradient cut into B pieces (chunk), not pieces of B rows (split)",
        "leaf.grad.split(b)",
        "leaf.grad.chunk(b)",
        names=r"tower x's part of rows 0\.\.2 received rows 0\.\.3 of G_x",
    ),
    "streamed_backward": Slip(
        "dL/ds multiplied by s, not divided (the derivative of s x read as s)",
        "g_s = (z_x[glob] * g_x).sum() / s",
        "g_s = (z_x[glob] * g_x).sum() * s",
        names=r"the gradient that reached s is 100 x P dL/ds \(= s\^2 at s = 10\)",
    ),
    "ring_by_hand": Slip(
        "the bias beta left out of the logits inside the sigmoid",
        "(s * x @ block.T + beta)",
        "(s * x @ block.T)",
        names=r"block 0: s z_x Z_y\[j\]\^T, no beta",
    ),
    "clip_step": Slip(
        "each gradient's values clipped (clip_grad_value_), not the global norm",
        "torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)",
        "torch.nn.utils.clip_grad_value_([p for p in ddp.parameters() if p.requires_grad], clip_norm)",
        names=r"the whole batch's gradient, each value clamped to \+-the bound, not",
    ),
}
