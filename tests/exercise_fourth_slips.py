"""The fourth audit's slips: one more plausible mistake per exercise (01-27), chosen after the judge's session-3
changes by someone who never read the judge's hint code (tests/exercise_kit.py, exercise_ranks.py,
exercise_claims.py, exercise_watch.py, exercise_signatures.py, exercise_ratios.py, exercise_schedules.py,
tests/cost_pieces.py): each from the lesson's judged function alone, then checked against the exercise's
catalogue (`MISTAKES`, `WRONG`, the structure and accepts tests' answers), the first audit's
(`exercise_slips.SLIPS`), the second's (`exercise_new_slips.NEW_SLIPS`) and the third's
(`exercise_third_slips.THIRD_SLIPS`), and chosen again where it duplicated one. Beside each, `# named if:` says
what a learner must read in the first hint (level 1) to know the slip: the criterion, fixed before judging.
They were only loaded (`Planted.load`: `old` found once), never judged by the one who chose them; the lead
judges them once on the final tree (`python scripts/audit_slips.py --fourth NN`), and nothing in the judge is
to be changed for them. Each is a `Slip`: `names` is what the first hint says that names it, `unnamed` what it
said instead. Judged once at 12:06 UTC on 2 Dec 2026: 26 of 27 caught (23's reduce to rank 0 passed every claim:
gloo leaves the sum on every rank at the judged sizes) and the first hint named 8 (02, 03, 05, 08, 09, 17, 18,
22), 30%, short of the 80% aimed at; six of the unnamed raised, and the first hint gave torch's error. Then 23
got a claim that the sum reaches every rank by the collective's contract (its `names` is that claim's, after)."""

from exercise_slips import Slip

FOURTH_SLIPS = {
    # named if: the loss (and the gradients) is d_out = 3 times the reference's, read as a squared error summed
    # over each row's outputs and averaged over the rows (not over all N d_out elements)
    "model_parallel_step": Slip(
        "the loss averaged over the rows only: each row's squared error summed over its d_out outputs",
        "loss = F.mse_loss(a_out, target)",
        'loss = F.mse_loss(a_out, target, reduction="sum") / len(a_out)',
        unnamed="one reading, not a diagnosis: P = 3 (a sum over the P); the factor is d_out = 3, the outputs summed",
    ),
    # named if: every rank runs micro-batches 0..M-2 only (the last micro-batch, M - 1, never forwarded nor
    # back-propagated)
    "gpipe": Slip(
        "the last micro-batch left out: range(M - 1), not range(M)",
        '[Action(kind, i, r) for kind in "FI" for i in range(microbatches)]',
        '[Action(kind, i, r) for kind in "FI" for i in range(microbatches - 1)]',
        names=r"every rank runs micro-batches 0, 1, 2, not 0\.\.3",
    ),
    # named if: the drain's backwards start at the warm-up count w, not at M - w: a rank runs again backwards it
    # already ran (the last rank, w = 0, every one of them twice), named by the rank and the repeated backwards
    "one_f_one_b": Slip(
        "the drain runs the backwards from micro-batch w (the warm-up count), not from M - w",
        'order += [Action("I", i, r) for i in range(microbatches - warmup, microbatches)]',
        'order += [Action("I", i, r) for i in range(warmup, microbatches)]',
        names=r"3I0 appears twice \(ranks 3 and 3\)",
    ),
    # named if: the parameters the judge reads got no gradient (none, or zero) because the stage runs a copy of
    # the module, not the module itself
    "pipeline_for_rank": Slip(
        "the PipelineStage built on a deep copy of the module: the caller's module is never trained",
        "stage = pipelining.PipelineStage(module, p, num_ranks, device)",
        "import copy\n\n    stage = pipelining.PipelineStage(copy.deepcopy(module), p, num_ranks, device)",
        unnamed="the gradients zero on every rank, tensors listed; not that the stage ran a copy",
    ),
    # named if: rank r's last r W's (those still waiting at the end) never run: the W's missing are named
    # (micro-batches M - r .. M - 1 on rank r), not only "not a schedule"
    "zb_h1": Slip(
        "the W's still waiting at the end dropped: the last r W's of rank r never run",
        "schedule.append(order + list(waiting))",
        "schedule.append(order)",
        names=r"rank 1 runs 3 W, the lesson's order 4 W; rank 2 runs 2 W, the lesson's order 4 W",
    ),
    # named if: the frozen parameters (requires_grad False, no gradient) were handed to the all-reduce: a
    # gradient of None reached dist.all_reduce, named as the frozen parameters not skipped
    "all_reduce_gradients": Slip(
        "every parameter reduced, the frozen ones too (no filter on requires_grad): their .grad is None",
        "for param in unused_check(model, rt, find_unused_parameters):",
        "for param in model.parameters():",
        unnamed="torch's TypeError at dist.all_reduce(param.grad): not a tensor; not that it was None",
    ),
    # named if: the flat gradient handed to the reduce-scatter was not padded to P ceil(Psi_u / P) elements (a
    # unit of Psi_u elements, which P does not divide), so the shards are cut at the wrong places or refused
    "zero1": Slip(
        "each unit's flat gradient not padded to P equal shards: torch.cat of the gradients as they are",
        "shard.grad = z.ring.reduce_scatter(unit.flatten(grads)) / rt.world_size",
        "shard.grad = z.ring.reduce_scatter(torch.cat([g.reshape(-1) for g in grads])) / rt.world_size",
        unnamed="torch's size error (7 vs 9) at the reduce-scatter's line; not the padding left out",
    ),
    # named if: f's backward ran its all-reduce but recorded it in the ledger as the forward's (phase "forward"),
    # so the backward's bytes recorded are none
    "Copy": Slip(
        "f's all-reduce recorded in the ledger as the forward's (f read as 'the forward's op')",
        'ctx.ledger.record("backward", "all_reduce", grad, ctx.group)',
        'ctx.ledger.record("forward", "all_reduce", grad, ctx.group)',
        names=r"0 recorded, 384 sent, not 384 recorded, 384 sent",
    ),
    # named if: the tiles before the diagonal were skipped and the tiles after it folded in (each query attends
    # to the later keys, not the earlier ones): the tile kinds or the output named as anti-causal off the
    # diagonal, not only "the tiles after the diagonal folded in"
    "ring_forward": Slip(
        "tile_kind given the keys' positions first: the tiles before and after the diagonal swap kinds",
        "kind = layouts.tile_kind(positions, key_positions, layout.causal)",
        "kind = layouts.tile_kind(key_positions, positions, layout.causal)",
        names=r"\(0, 7\) whole, where the lesson's is skipped; \(7, 0\) never folded",
    ),
    # named if: the tokens that arrived were counted per expert by the first E/P columns of kept (local expert
    # indices 0..), not by this rank's experts' global indices (right on rank 0 only)
    "expert_parallel_moe": Slip(
        "this rank's experts' counts read from kept's first E/P columns (local indices), not their global ones",
        "plan.kept[:, [int(i) for i in layer.experts]]",
        "plan.kept[:, : len(layer.experts)]",
        unnamed="torch's split_with_sizes error in run_experts; not the local expert indices",
    ),
    # named if: the rearrangement after the first all-to-all is wrong: heads and positions mixed on the way in
    # (seq_to_heads' transpose of the wrong dimensions), named as the way in, not the exchange or the way back
    "ulysses_attention": Slip(
        "seq_to_heads transposes the wrong dimensions: (1, 2), not (0, 1)",
        ".transpose(0, 1)",
        ".transpose(1, 2)",
        within="seq_to_heads",
        unnamed="12 of out's 12 heads hold another block, rows that are no row of SDPA's: not the way in",
    ),
    # named if: the ring's layout disagrees with the tokens' positions: the cp ranks' attention run with
    # contiguous blocks while the tokens are the zig-zag pieces (wrong only at cp = 2)
    "parallelize": Slip(
        "the cp ring built with the contiguous layout while the tokens are the zig-zag pieces",
        'Layout(shape.cp, cfg.seq, "zigzag", causal=True)',
        'Layout(shape.cp, cfg.seq, "contiguous", causal=True)',
        unnamed="losses off by 1e-3 and the parameters, no factor; the exercise's hint on groups",
    ),
    # named if: the LayerNorms' parameters counted half: 2 d a block, not 4 d (their biases left out), named as
    # the norms (or their biases) in weights, gradients, moments and DDP's bytes
    "rank_bytes": Slip(
        "each LayerNorm counted as d parameters, its bias left out: 2 d a block, not 4 d",
        "2 * d * f + f + d, 4 * d",
        "2 * d * f + f + d, 2 * d",
        unnamed="-1536 bytes read as attn.out.bias and mlp.fc2.bias left out: equal in bytes to the norms' biases",
    ),
    # named if: in the rowwise case scale_b was handed to _scaled_mm as a column (cols x 1), not a row (1 x cols):
    # its transpose missing
    "fp8_matmul": Slip(
        "rowwise: b's scales handed to _scaled_mm untransposed, a column where a row belongs",
        "scale_b=b_scale.reciprocal().t() if rowwise else b_scale.reciprocal(),",
        "scale_b=b_scale.reciprocal(),",
        unnamed="torch's _scaled_mm error listing the scales' sizes ([16, 1]); not b's scale untransposed",
    ),
    # named if: the gathered bytes were converted to the format by value (uint8 codes cast as numbers), not
    # reinterpreted (viewed) as the format
    "fp8_all_gather": Slip(
        "the gathered bytes cast to the format by value (.to), not reinterpreted (.view)",
        "return whole.view(fmt), rho",
        "return whole.to(fmt), rho",
        unnamed="the gathered weight off, equals none of the one misreading offered; the exercise's hint",
    ),
    # named if: a tensor saved twice (the tanh output the next Linear saves again) had its device copy dropped
    # after its first unpack: its second user was not counted
    "Offloader": Slip(
        "a tensor saved again shares the handle but its second user is not counted",
        "            self.users[handle] += 1\n            return handle",
        "            return handle",
        unnamed="KeyError: 3 in unpack; not the second user left uncounted",
    ),
    # named if: the error kept (state.errors) left out the error kept before: G_r - what every rank uses, not
    # M_r - what every rank uses (M_r = G_r + Delta_r)
    "powersgd_hook": Slip(
        "the copy taken before the error is added: Delta_r = G_r - what every rank uses, not M_r - it",
        "    if opts.use_error_feedback:\n"
        "        flat.add_(state.errors.setdefault(index, torch.zeros_like(flat)))  # M_r = G_r + Delta_r, the whole "
        "bucket\n"
        "    before = flat.clone()",
        "    before = flat.clone()\n"
        "    if opts.use_error_feedback:\n"
        "        flat.add_(state.errors.setdefault(index, torch.zeros_like(flat)))  # M_r = G_r + Delta_r, the whole "
        "bucket",
        names=r"G_r - what every rank uses: the error kept before left out of M_r",
    ),
    # named if: X came back whole and right, but every block of Y is this rank's own block's product (the input
    # x multiplied each step, not the block held)
    "all_gather_matmul": Slip(
        "every step multiplies this rank's own input x, not the block it holds",
        "F.linear(held, weight, bias)",
        "F.linear(x, weight, bias)",
        names=r"Y on every failing rank: equal to this rank's own block, P times",
    ),
    # named if: the last rank's first steady-state pair runs its I on stage b before the F on stage a that it
    # needs: the turn's own micro-batch, rank P - 1, named (not only "not a schedule")
    "dualpipev": Slip(
        "the steady state's pairs written alike on every rank: rank P - 1's first pair not split",
        "            if k == 0 and r == P - 1:  # the turn's own micro-batch: its backward needs this forward first\n"
        '                me.add(me.next("F", a))\n'
        '                me.add(me.next("I", b))\n'
        "            else:\n"
        '                me.add(me.next("F", a), me.next("I", b))',
        '            me.add(me.next("F", a), me.next("I", b))',
        unnamed="(forward, backward) pairs on rank 1: 8, not 7; not the I before its F",
    ),
    # named if: the outer step was applied and then undone: the weights after each round are theta (the round's
    # start), the step overwritten by the copy back
    "outer_step_by_hand": Slip(
        "the outer step taken before the copy back to theta, which then overwrites it",
        "            param.copy_(theta[param])  # every island back to the round's start ...\n"
        "            outer.step(param, delta)  # ... and one outer step with delta as the gradient",
        "            outer.step(param, delta)  # ... and one outer step with delta as the gradient\n"
        "            param.copy_(theta[param])  # every island back to the round's start ...",
        unnamed="the weights off, equals none of the sign slip offered; the claim's hint",
    ),
    # named if: the embeddings were detached before the gather: the loss back-propagated has no graph to this
    # rank's towers (z_x gets no gradient), named as the detach or the missing path to z_x
    "global_loss_times_p": Slip(
        "z_x and z_y detached before the gather (as lesson 01 sends A_p.detach()): no path back to the towers",
        "loss = clip_loss(gather(z_x), gather(z_y), 1 / tau)",
        "loss = clip_loss(gather(z_x.detach()), gather(z_y.detach()), 1 / tau)",
        within="global_loss",
        unnamed="torch's 'element 0 of tensors does not require grad', no line of the answer",
    ),
    # named if: the loss is C = 4 times rank r's L_r: each direction's cross-entropy summed over the rows, not
    # averaged
    "local_clip_loss": Slip(
        "each direction's cross-entropy summed over this rank's C rows, not averaged",
        "(F.cross_entropy(logits_x, labels) + F.cross_entropy(logits_y, labels)) / 2",
        '(F.cross_entropy(logits_x, labels, reduction="sum") + F.cross_entropy(logits_y, labels, reduction="sum")) / 2',
        names=r"one reading, not a diagnosis: C = 4 \(= N/P here\): C times too large: a sum over the C",
    ),
    # named if: the backward ran a reduce to rank 0, not an all-reduce: rank 0's gradient right, the others' not
    "gather_all_reduce": Slip(
        "the backward's sum reduced to rank 0 (dist.reduce), not all-reduced",
        "dist.all_reduce(summed, op=dist.ReduceOp.SUM)",
        "dist.reduce(summed, dst=0, op=dist.ReduceOp.SUM)",
        within="AllGatherSumBackward",
        names=r"the backward's sum reaches every rank \(no reduce to one rank\)' failed",
    ),
    # named if: each part's <h, G> was averaged over its elements (rows x d): each part's gradient divided by its
    # own size (3 x d for the first three parts, d for the last), not one factor for all
    "grad_cache_step": Slip(
        "step (3)'s surrogate a mean: (h * G).mean(), not the dot product <h, G>",
        "torch.dot(h.flatten(), g.flatten()).backward()",
        "(h * g).mean().backward()",
        unnamed="the gradients off, equals none of the one misreading offered; the exercise's hint",
    ),
    # named if: G_y was computed with the row log-sum-exps a (of S) where b (of S^T) belongs: a and b swapped in G_y
    # (G_x right)
    "streamed_backward": Slip(
        "G_y's tiles given a and b in G_x's order: S's row log-sum-exps where S^T's belong",
        "grad_by_tiles(z_y[glob], z_x, b[glob], a, s, cfg.t, glob.start)",
        "grad_by_tiles(z_y[glob], z_x, a[glob], b, s, cfg.t, glob.start)",
        unnamed="z_y's gradient off, no factor; the exercise's hint",
    ),
    # named if: G_x holds only the last step's block term (block j = r + 1's), the earlier blocks' terms not added
    # (overwritten, not accumulated); G_y right
    "ring_by_hand": Slip(
        "G_x assigned each step, not accumulated: only the last block's term survives",
        "g_x += s * d @ block",
        "g_x = s * d @ block",
        unnamed="G_x off, equals none of the one misreading offered; the exercise's hint",
    ),
    # named if: the step used the gradient clipped to a norm of clip_norm / P (half the bound at P = 2), named as
    # the bound divided by P
    "clip_step": Slip(
        "the norm bound divided by P, as if each rank clipped its share",
        "torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)",
        "torch.nn.utils.clip_grad_norm_(\n"
        "        [p for p in ddp.parameters() if p.requires_grad], clip_norm / torch.distributed.get_world_size()\n"
        "    )",
        unnamed="every update 0.5 x, read as a gradient never bounded (not clipped): another mistake",
    ),
}
