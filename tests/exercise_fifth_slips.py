"""The fifth audit's slips: one more plausible mistake per exercise (01-27), 27 in all, chosen after the judge's
session-4 changes by someone who never read the judge's hint code (tests/exercise_kit.py, exercise_ranks.py,
exercise_claims.py, exercise_watch.py, exercise_signatures.py, exercise_ratios.py, exercise_schedules.py,
exercise_values.py, tests/cost_pieces.py): each from the lesson's judged function alone (or a helper of the same
lesson file that it calls: `within`), then checked against the exercise's catalogue (`MISTAKES`, `WRONG`, the
structure and accepts tests' answers) and the four earlier audits (`exercise_slips.SLIPS`,
`exercise_new_slips.NEW_SLIPS`, `exercise_third_slips.THIRD_SLIPS`, `exercise_fourth_slips.FOURTH_SLIPS`), and
chosen again where it duplicated one. Beside each, `# named if:` says what a learner must read in the first hint
(level 1) to know the slip, either the mistake itself stated, or the statement that holds it pointed at with how
its value differs from the lesson's in a way that shows the slip: the criterion, fixed before judging. They were
only loaded (`Planted.load`: `old` found once), never judged by the one who chose them; the lead judges them once
on the final tree (`python scripts/audit_slips.py --fifth`), and nothing in the judge is to be changed for them.
Each is a `Slip`: `names` is what the first hint says that names it, `unnamed` what it said instead.
Judged once at 16:00 UTC on 2 Dec 2026, on the judge with `exercise_trace` (where the answer first departs from
the lesson's function): 27 of 27 caught, and the first hint named 16 (59%): 02, 03, 05, 09, 11, 12, 13, 14, 15, 18,
19, 22, 23, 24, 25, 27, short of the 80% aimed at. Named by the departure alone (no claim names them): 11, 14, 15,
18. Judged generously, by the pointing form: 11 (the extra division at SDPA's line, the op the lesson never runs),
12 (the cp bytes 0 and the tp claim failed, not "the tp group"), 13 (the backward's all-reduces offered beside the
forward's, equal in bytes), 14 (the cast at quantize's line in e4m3 where the lesson's is e5m2, in the second
call); strictly, 12 of 27 (44%). That judge compared the operations by op, shape and dtype only (a local name
shadowed the flag that sums their values: a bug, fixed after). After two readings made for 20 and 26 and the fix,
18 of 27, not a measure."""

from exercise_slips import Slip

FIFTH_SLIPS = {
    # named if: rank p sent back the activation it received (A_{p-1}, `a_in`) where dL/dA_{p-1} (`a_in.grad`)
    # belongs, or the hint points at the `dist.send(a_in..., dst=p - 1)` line and says what was sent back equals
    # the unsplit model's A_{p-1} (the forward's activation), not its gradient
    "model_parallel_step": Slip(
        "the received activation itself sent back to rank p - 1, not its gradient: a_in, not a_in.grad",
        "dist.send(a_in.grad, dst=p - 1)",
        "dist.send(a_in, dst=p - 1)",
        unnamed="the gradients off, no factor; stage 0's weight gradients after the call, not the send of a_in",
    ),
    # named if: rank r's actions are on stage r + 1 (the stages numbered 1 .. P, not 0 .. P - 1): no rank runs
    # stage 0, and rank P - 1 is given a stage P that does not exist
    "gpipe": Slip(
        "the stages numbered from 1: rank r's actions on stage r + 1",
        "Action(kind, i, r)",
        "Action(kind, i, r + 1)",
        names=r"stages must be 0 \.\. vP-1, got \[1, 2, 3\]",
    ),
    # named if: the steady state's forwards restart at micro-batch 0 (F_k, not F_{w + k}): a rank with a warm-up
    # runs F_0 .. F_{w-1} twice and never the last w forwards F_{M-w} .. F_{M-1}, named by the repeated and the
    # missing forwards (or the steady state's `Action("F", ...)` pointed at with its index missing the + w)
    "one_f_one_b": Slip(
        "the steady state's forward indexed k, not warmup + k: the warm-up's forwards run again",
        'Action("F", warmup + k, r)',
        'Action("F", k, r)',
        names=r"2F0 appears twice \(ranks 2 and 2\)",
    ),
    # named if: the schedule was built without a loss function (no loss_fn): the last stage computes no loss and
    # no backward runs, so every gradient is None or zero, named as the missing loss_fn (not only "zero
    # gradients")
    "pipeline_for_rank": Slip(
        "the schedule built without loss_fn: the last stage computes no loss, no backward runs",
        "schedule_class(stage, microbatches, loss_fn=F.mse_loss)",
        "schedule_class(stage, microbatches)",
        unnamed="torch's error 'Expecting 4 losses but got 0' at the schedule's step; not the missing loss_fn",
    ),
    # named if: ranks 0 .. P - 2 (those with a warm-up) run a forward of micro-batch M (F_4 at M = 4, one past the
    # last), named as that forward or as the condition `warmup + i < M` written `<=` (an off-by-one)
    "zb_h1": Slip(
        "the steady state's forward condition <= M, not < M: ranks with a warm-up run a forward of micro-batch M",
        "if warmup + i < microbatches:",
        "if warmup + i <= microbatches:",
        names=r"rank 0 runs micro-batches 0, 1, 2, 3, 4, not 0\.\.3",
    ),
    # named if: the reduction ran in single precision: each gradient all-reduced as a float32 copy (then copied
    # back), or the hint points at the all-reduce and says the gradients differ from one process's by a rounding
    # error of float32's size (relative ~1e-7, no factor, no rank's own rows)
    "all_reduce_gradients": Slip(
        "each gradient all-reduced as a float32 copy (half the bytes) and copied back: the sum rounded to float32",
        "dist.all_reduce(param.grad)",
        "low = param.grad.float()\n        dist.all_reduce(low)\n        param.grad.copy_(low)",
        unnamed="rel. error 5.7e-08, no factor; nothing points at the float32 all-reduce",
    ),
    # named if: the all-gather after the step gathered each shard's gradient (`shard.grad`), not the stepped shard,
    # or the hint points at the `z.ring.all_gather(...)` line and says the weights it wrote equal the mean gradient
    # (the reference's dL/dtheta), not the stepped weights
    "zero1": Slip(
        "after the step, the shards' gradients all-gathered into the weights, not the stepped shards",
        "z.ring.all_gather(shard.detach())",
        "z.ring.all_gather(shard.grad)",
        unnamed="the parameters off after 3 steps, no factor (the slip is in a hook: no departure)",
    ),
    # named if: f's all-reduce recorded in the ledger with no group (priced over the world): at P = 4 in pairs
    # the recorded bytes are the world's ring, 2 (4-1)/4 = 1.5 x what the pair's all-reduce sent, named as the
    # ledger's record missing ctx.group (or the `ctx.ledger.record` line pointed at with that 1.5 x)
    "Copy": Slip(
        "f's all-reduce recorded in the ledger without its group: priced over the world, not the group",
        'ctx.ledger.record("backward", "all_reduce", grad, ctx.group)',
        'ctx.ledger.record("backward", "all_reduce", grad)',
        unnamed="288 recorded, 192 sent (1.5 x) on f's backward; not the record's missing group",
    ),
    # named if: the ring runs P - 1 steps, not P, so the k/v block that arrives last (rank r + 1's) is never folded
    # in; or the hint points at the `for step in range(...)` line and says each rank's output leaves out the keys
    # of rank r + 1's block (the block that arrived in the last exchange unused)
    "ring_forward": Slip(
        "the ring loop runs P - 1 steps, not P: the block that arrives last is never folded in",
        "for step in range(ring.world_size):",
        "for step in range(ring.world_size - 1):",
        names=r"step 3 \(rank 1's block, pieces 1,6\): \(0, 1\) never folded",
    ),
    # named if: L_aux's phi counted from the kept choices (plan.kept, after the capacity drops), not from the
    # routed ones (plan.routed, before them); or the hint points at the `aux_loss(...)` call and says L_aux (with
    # the output right) equals E sum phi_i pi_i with phi of the kept counts
    "expert_parallel_moe": Slip(
        "L_aux's phi from the counts after the capacity drops (kept), not the routed choices",
        "aux_loss(routing.gates, plan.routed, layer.statistics, layer.rank)",
        "aux_loss(routing.gates, plan.kept, layer.statistics, layer.rank)",
        unnamed="L_aux off by 0.3%-7% per rank, no factor; not phi from the kept counts",
    ),
    # named if: the attention's logits scaled twice: q divided by sqrt(d_h) by hand before SDPA, which scales by
    # 1/sqrt(d_h) itself (1/d_h in all), named as the extra scaling (or SDPA's line pointed at with the logits'
    # scale 1/d_h, not 1/sqrt(d_h))
    "ulysses_attention": Slip(
        "q divided by sqrt(d_h) by hand before SDPA, which scales by 1/sqrt(d_h) itself: the scale taken twice",
        "F.scaled_dot_product_attention(*whole, is_causal=causal)",
        "F.scaled_dot_product_attention(whole[0] / q.shape[-1] ** 0.5, *whole[1:], is_causal=causal)",
        names=r"whole\[0\] / q\.shape\[-1\] \*\* 0\.5.* runs div\.Tensor",
    ),
    # named if: the cp ring was built on the tp group (`mesh.get_group("tp")`), not the cp group: its k/v blocks
    # travel between the tp ranks (other heads), named as the ring's group (or the cp group's bytes missing and
    # the tp group's too many, at 1 x 1 x 2 x 2)
    "parallelize": Slip(
        "the cp ring built on the tp group, not the cp group",
        'Ring(mesh.get_group("cp"))',
        'Ring(mesh.get_group("tp"))',
        names=r"bytes this rank sent on its cp group in step 2: 0, not 131072",
    ),
    # named if: the bytes sent under tensor parallelism count f and g one way only (2 all-reduces a block, not 4:
    # the backward's left out), named as the backward's all-reduces missing, or the `sent = layers * ...` line
    # pointed at with its activations' all-reduces half the lesson's
    "rank_bytes": Slip(
        "tensor parallelism's f and g counted in the forward only: 2 all-reduces a block, not 4",
        "sent = layers * 4 * 2 * (tp - 1) * tokens * d * e // tp",
        "sent = layers * 2 * 2 * (tp - 1) * tokens * d * e // tp",
        names=r"or the backward's all-reduces left out",
    ),
    # named if: the two operands' formats swapped: a cast to b_fmt and b to a_fmt; or the hint points at the
    # `quantize(a, ...)` line and says a's codes are in b's format (dY in e4m3, the other operand in e5m2 in the
    # backward's matmuls), the forward right
    "fp8_matmul": Slip(
        "a quantized in b's format and b in a's: the operands' formats swapped",
        "a_fmt, rowwise, power_of_two)\n    bt_q, b_scale = quantize(b.t(), b_fmt",
        "b_fmt, rowwise, power_of_two)\n    bt_q, b_scale = quantize(b.t(), a_fmt",
        names=r"in its call 2, the first operation: .* float8_e4m3fn \[24, 16\], the lesson's -> float8_e5m2",
    ),
    # named if: rho computed from the sum of the ranks' amaxes, not their largest: rho = max_f / sum_r amax_r,
    # named as the amaxes summed (or rho pointed at and said to be the lesson's times max / sum of the amaxes)
    "fp8_all_gather": Slip(
        "the ranks' amaxes summed, not their largest taken: rho = max_f / sum of the amaxes",
        "amaxes.max()",
        "amaxes.sum()",
        names=r"amaxes\.sum\(\).* runs sum -> float32 \[\] where the lesson's runs max",
    ),
    # named if: the parameters the layers save (the Linear weights) were offloaded too (the skip of parameters
    # left out); or the hint points at `pack` and says the bytes to the host (and back) exceed the activation
    # formula by exactly the saved weights' bytes
    "Offloader": Slip(
        "no skip for the parameters: the weights the Linears save are copied to the host and back like activations",
        "        if storage.data_ptr() in self.skip:\n"
        "            return t  # a parameter: on the device anyway, never moved\n",
        "",
        unnamed="bytes to the host 84992, not 45056 (1.89 x); not the weights offloaded",
    ),
    # named if: U orthonormalised before its all-reduce, not after (each rank orthonormalises its own M_r V and
    # the sum of those is used); or the hint points at the U all-reduce or step 2 and says the U used is not
    # orthonormal: the sum of the ranks' orthonormalised U_r
    "powersgd_hook": Slip(
        "each rank's U orthonormalised before the all-reduce, not the sum after it",
        '    state.all_reduce(u_flat, "U")  # sum_r M_r V: no 1/P, the orthonormalisation forgets the scale\n'
        "    for u in us:\n"
        "        orthonormalise(u, opts.orthogonalization_epsilon)  # 2.\n",
        "    for u in us:\n"
        "        orthonormalise(u, opts.orthogonalization_epsilon)  # 2.\n"
        '    state.all_reduce(u_flat, "U")  # sum_r M_r V: no 1/P, the orthonormalisation forgets the scale\n',
        unnamed="the parameters off, none of five PowerSGD variants; not U orthonormalised first",
    ),
    # named if: Y was allocated with weight.shape[1] = d_in columns (8), not weight.shape[0] = d_out' (6): the
    # weight read as (d_in, d_out), named at the `y = held.new_empty(...)` line with its last size 8 against the
    # product's 6
    "all_gather_matmul": Slip(
        "Y allocated with d_in columns (weight.shape[1]), not d_out (weight.shape[0])",
        "y = held.new_empty(held.shape[0], P * held.shape[1], weight.shape[0])",
        "y = held.new_empty(held.shape[0], P * held.shape[1], weight.shape[1])",
        names=r"weight\.shape\[1\]\)\): its new_empty gives -> float64 \[4, 12, 8\], the lesson's .* \[4, 12, 6\]",
    ),
    # named if: rank r's second stage is P + r (the interleaved placement of lesson 05), not 2P - 1 - r (the V):
    # named by the stage each rank runs on the way up (rank 0 stage 2 and rank 1 stage 3 at P = 2, swapped)
    "dualpipev": Slip(
        "the way up's stage b = P + r (interleaved), not 2P - 1 - r (the V)",
        "a, b, me = r, 2 * P - 1 - r, _Rank()",
        "a, b, me = r, P + r, _Rank()",
        names=r"`b` in dualpipev, set at line 155 .*yours is 2, the lesson's 3",
    ),
    # named if: the bytes returned are the last parameter's only: the `sent = ring_bytes(...)` line overwrites
    # what it should add (the return value equals one parameter's ring bytes, not the fragment's)
    "outer_step_by_hand": Slip(
        "the bytes sent assigned each parameter, not added: only the last parameter's are returned",
        "sent += ring_bytes(",
        "sent = ring_bytes(",
        unnamed="the `sent = ring_bytes(...)` line pointed at, 64 vs 384; not that it overwrites, not adds",
    ),
    # named if: the loss pairs Z_x with itself: z_x gathered where z_y belongs (z_y never reaches the loss, its
    # gradient zero), named as z_x gathered twice or z_y left out
    "global_loss_times_p": Slip(
        "z_x gathered twice: the loss of Z_x against itself, z_y never used",
        "gather(z_y)",
        "gather(z_x)",
        within="global_loss",
        unnamed="the line `loss = clip_loss(gather(z_x), gather(z_x), ...)` at 0.0202 x; not z_x twice",
    ),
    # named if: each rank's loss is 1/P of its rows' share (C/N): the cross-entropies summed over its C rows and
    # divided by N, not averaged over C, named as the division by N (or the loss pointed at as 1/P = C/N times
    # the lesson's)
    "local_clip_loss": Slip(
        "the rank's C rows' cross-entropies summed and divided by N (the global batch), not averaged over C",
        "(F.cross_entropy(logits_x, labels) + F.cross_entropy(logits_y, labels)) / 2",
        '(F.cross_entropy(logits_x, labels, reduction="sum") + F.cross_entropy(logits_y, labels, reduction="sum"))'
        " / (2 * len(all_z_x))",
        names=r"read as C/N: a factor C where N belongs",
    ),
    # named if: the backward's rows sliced by d (z.shape[1] = 5), not by C (len(z) = 4): ctx.c set from the wrong
    # dimension, named at the `ctx.rank, ctx.c = ...` line or by the returned gradient's 5 rows against z's 4
    "gather_all_reduce": Slip(
        "ctx.c taken from z's columns (d), not its rows (C): the backward's slice has the wrong rows",
        "ctx.rank, ctx.c = dist.get_rank(), len(z)",
        "ctx.rank, ctx.c = dist.get_rank(), z.shape[1]",
        within="AllGatherSumBackward",
        names=r"got \[5, 5\] but expected shape compatible with \[4, 5\]",
    ),
    # named if: the second tower's step (3) used the first tower's cached gradient G_x (leaves[0].grad), not its
    # own G_y: the y tower's parameter gradients off while the x tower's are right, named as G_x given to the
    # y tower
    "grad_cache_step": Slip(
        "step (3) of every tower given the first tower's G (leaves[0].grad), not its own",
        "leaf.grad.split(b)",
        "leaves[0].grad.split(b)",
        names=r"tower y's part of rows 0\.\.2 received rows 0\.\.2 of G_x",
    ),
    # named if: the logit scale's gradient is twice the reference's: dL/ds summed over both towers' terms
    # (z_x . G_x + z_y . G_y), each of which is already the whole dL/ds, named as the factor 2 on s's gradient
    "streamed_backward": Slip(
        "dL/ds counted from both towers: (z_x . G_x + z_y . G_y) / s, twice the derivative",
        "g_s = (z_x[glob] * g_x).sum() / s",
        "g_s = ((z_x[glob] * g_x).sum() + (z_y[glob] * g_y).sum()) / s",
        names=r"the gradient that reached s is 2 x P dL/ds",
    ),
    # named if: the positives' eps is 0, not +1 (the eye added once to the -1s, not twice); or the hint points at
    # the `labels += ...` line and says its diagonal is 0 where the lesson's is +1 (the positive pairs contribute
    # nothing to G_x and G_y)
    "ring_by_hand": Slip(
        "the eye added once to the -1 labels: eps = 0 on the diagonal, not +1",
        "labels += 2 * torch.eye(c, dtype=x.dtype, device=x.device) if j == r else 0",
        "labels += torch.eye(c, dtype=x.dtype, device=x.device) if j == r else 0",
        unnamed="the `labels += torch.eye(...)` line, 4 of 16 elements off by 100%; not its diagonal 0 for +1",
    ),
    # named if: each parameter's gradient clipped to clip_norm by its own norm, not all of them by their global
    # norm; or the hint points at the clipping and says each tensor's gradient norm is capped at clip_norm alone,
    # so the clipped gradient's global norm exceeds clip_norm (each tensor scaled by its own factor, not one)
    "clip_step": Slip(
        "each parameter's gradient clipped by its own norm, not the global norm over all of them",
        "torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)",
        "for p in ddp.parameters():\n"
        "        if p.requires_grad:\n"
        "            torch.nn.utils.clip_grad_norm_([p], clip_norm)",
        names=r"each tensor's norm clipped on its own",
    ),
}
