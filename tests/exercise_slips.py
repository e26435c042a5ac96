"""The audit's slips: one plausible mistake per exercise, planted in the lesson's own function.

Each is what a learner who half-understood the lesson would write (a factor borrowed from another lesson, a
group ignored, a cap forgotten that only bites at another shape, a transpose dropped), chosen without looking at
the exercise's catalogue of mistakes, so that the audit measures how the judge meets a slip it was not built
for. `Exercise.audit_test` plants each in the judged solution (`Planted`: the text `old`, found
exactly once in the function, replaced by `new`), judges it with the exercise's wrong answers in the same spawn,
and asserts that a claim fails and, where `names` is given, that the first hint (level 1) names the slip by
those words. The table in lessons/exercises/README.md records, per slip, whether the first hint named it before
and after the judge was improved; the slips never reach lessons/exercises/.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from exercise_kit import Answer


@dataclass(frozen=True)
class Slip:
    what: str  # the slip in one line, as the audit's table says it
    old: str
    new: str
    names: str = ""  # a regex the level-1 message must match: the first hint names the slip
    within: str = ""  # the lesson's function or class holding `old`, when not the judged one
    missed: str = ""  # why the judge cannot catch it yet: its audit test is then an expected (strict) failure
    unnamed: str = ""  # caught, but the first hint does not name it: what it says instead (the README's table)


@dataclass(frozen=True)
class Planted(Answer):
    """The judged solution with one slip planted in its source: the text `old`, which must occur exactly once
    in the function (or class) `name`, replaced by `new`; `what` says the slip in one line. The audit's
    answers (tests/exercise_slips.py): mistakes a learner who half-understood the lesson would write, kept out
    of the exercise files and out of the catalogue, so that the audit measures how the judge meets the
    unforeseen."""

    old: str = ""
    new: str = ""
    what: str = ""
    within: str = ""  # the function or class the slip is in, when not `name` itself (a helper it calls)

    def load(self) -> Callable[..., Any]:
        source = self.path.read_text()
        nodes = {n.name: n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        namespace = dict(vars(self.module()))  # the lesson's own globals; the lesson itself stays untouched
        for name in dict.fromkeys((self.within or self.name, self.name)):  # the slipped one first, then its caller
            node = nodes[name]
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])  # its decorators too
            text = "\n".join(source.splitlines()[first - 1 : node.end_lineno])
            if name == (self.within or self.name):
                if text.count(self.old) != 1:
                    raise ValueError(f"{name} holds {self.old!r} {text.count(self.old)} times: the slip no longer fits")
                text = text.replace(self.old, self.new)
            padded = "\n" * (first - 1) + text  # the lesson's line numbers, in a traceback
            exec(compile(padded, str(self.path), "exec"), namespace)
        return namespace[self.name]


SLIPS = {
    "model_parallel_step": Slip(
        "the loss divided by P as well, as data parallelism would",
        "loss = F.mse_loss(a_out, target)",
        "loss = F.mse_loss(a_out, target) / dist.get_world_size()",
        names=r"1/P",
    ),
    "gpipe": Slip(
        "the last rank runs each backward right after its forward (it needs no gradient from anyone)",
        '[Action(kind, i, r) for kind in "FI" for i in range(microbatches)] for r',
        '[Action(kind, i, r) for i in range(microbatches) for kind in "FI"] if r == num_ranks - 1 else '
        '[Action(kind, i, r) for kind in "FI" for i in range(microbatches)] for r',
        names=r"frees micro-batches early",
    ),
    "one_f_one_b": Slip(
        "the warm-up not capped at M: P - r - 1 forwards even when fewer micro-batches exist",
        "warmup = min(num_ranks - r - 1, microbatches)",
        "warmup = num_ranks - r - 1",
        names=r"warm up with P - r - 1",
    ),
    "pipeline_for_rank": Slip(
        "each micro-batch's loss divided by M by hand, as lesson 02 taught (torch's schedule already scales by 1/M)",
        "loss_fn=F.mse_loss",
        "loss_fn=lambda out, target: F.mse_loss(out, target) / microbatches",
        names=r"1/M",
    ),
    "zb_h1": Slip(
        "one W too few held back: the oldest W runs once r are waiting, not more than r",
        "if len(waiting) > r:",
        "if len(waiting) >= r:",
        names=r"one W fewer than it can",
    ),
    "all_reduce_gradients": Slip(
        "the division by P dedented out of the loop: only the last parameter's gradient is divided",
        "        param.grad /= rt.world_size",
        "    param.grad /= rt.world_size",
        names=r"P times",
    ),
    "zero1": Slip(
        "the reduce-scatter taken for a mean already (as FSDP2's is) and divided by P again",
        "shard.grad = z.ring.reduce_scatter(unit.flatten(grads)) / rt.world_size",
        "shard.grad = z.ring.reduce_scatter(unit.flatten(grads)) / rt.world_size / rt.world_size",
        names=r"1/P",
    ),
    "Copy": Slip(
        "f all-reduces in the forward too (the sum taken both ways)",
        "return x.view_as(x)",
        "y = x.clone()\n        dist.all_reduce(y, group=group)\n        return y",
        names=r"g's forward: an all-reduce",
    ),
    "ring_forward": Slip(
        "the causal tiles past the diagonal computed anyway (skipping read as a mere speed-up)",
        "                if kind == SKIP:\n                    continue\n",
        "",
        names=r"must add nothing",
    ),
    "expert_parallel_moe": Slip(
        "the combined output started from the input u (a dropped token passing through) instead of zeros",
        "out = torch.zeros_like(u).index_add(",
        "out = u.clone().index_add(",
        names=r"the block adds the residual around it",
    ),
    "ulysses_attention": Slip(
        "the group dropped: both all-to-alls on the default group, every rank of the job",
        "ledger: Ledger, group=None) -> torch.Tensor:",
        "ledger: Ledger, group=None) -> torch.Tensor:\n    group = None  # (the default group: the world)",
        names=r"the sequence-parallel group is a few ranks",
    ),
    "parallelize": Slip(
        "only the blocks wrapped by FSDP2: the embedding and head never sharded (nor their gradients reduced)",
        "return fully_shard(model, mesh=shards, reshard_after_forward=False)",
        "return model",
    ),
    "rank_bytes": Slip(
        "the activations of the whole global batch on every rank, as if data parallelism did not split it",
        "rows = batch.global_batch // parallel.dp",
        "rows = batch.global_batch",
        names=r"one reading, not a diagnosis: P = ",
    ),
    "fp8_matmul": Slip(
        "the product returned in bfloat16 (the inputs are 8-bit, so the output needs little precision)",
        "out_dtype=torch.float32",
        "out_dtype=torch.bfloat16",
        names=r"lost its low bits",
    ),
    "fp8_all_gather": Slip(
        "the amax taken without abs: the largest value, not the largest magnitude",
        "shard.abs().max()",
        "shard.max()",
        names=r"amax is a magnitude",
    ),
    "Offloader": Slip(
        "the prefetch fetches the next group in pack order (the forward's direction), not the one before it",
        "if self.prefetch and order.index(group) > 0:\n                self._fetch(order[order.index(group) - 1])",
        "if self.prefetch and order.index(group) < len(order) - 1:\n"
        "                self._fetch(order[order.index(group) + 1])",
        names=r"fetched again after backward had used it",
    ),
    "powersgd_hook": Slip(
        "the plain steps' mean left as a sum: no division by P before the all-reduce",
        '        flat.div_(world)\n        state.all_reduce(flat, "plain")',
        '        state.all_reduce(flat, "plain")',
        names=r"the first steps are plain DDP",
    ),
    "all_gather_matmul": Slip(
        "every step sends this rank's own block on, not the block it just received",
        "[(held, right)]",
        "[(x.contiguous(), right)]",
        names=r"a ring passes blocks on",
    ),
    "dualpipev": Slip(
        "the V's way down warms up with P - r - 1 forwards, as 1F1B does, not 2 (P - r - 1)",
        "for _ in range(2 * (P - r - 1)):  # 1. down",
        "for _ in range(P - r - 1):  # 1. down",
        names=r"2 \(P - r - 1\) down the V",
    ),
    "outer_step_by_hand": Slip(
        "the pseudogradients averaged over the world's ranks, not over the islands",
        "delta /= ISLANDS",
        "delta /= dist.get_world_size()",
        names=r"an island may hold many ranks",
    ),
    "global_loss_times_p": Slip(
        "the loss multiplied by this rank's rows C, not by P",
        "return rt.world_size * loss, value",
        "return len(z_x) * loss, value",
        names=r"a factor C where P belongs",
    ),
    "local_clip_loss": Slip(
        "the logits divided by the logit scale s (s read as the temperature tau)",
        "logits_x = s * local_z_x @ all_z_y.T  # rows of S\n    logits_y = s * local_z_y @ all_z_x.T",
        "logits_x = local_z_x @ all_z_y.T / s  # rows of S\n    logits_y = local_z_y @ all_z_x.T / s",
        names=r"s = 1/tau is a scale",
    ),
    "gather_all_reduce": Slip(
        "the backward all-reduces only this rank's own rows of the gradient (the rows it returns)",
        "summed = grad.contiguous().clone()",
        "summed = grad[ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c].contiguous().clone()\n"
        "        ctx.rank, ctx.c = 0, len(summed)",
        within="AllGatherSumBackward",
        names=r"reduced only the rows it returns",
    ),
    "grad_cache_step": Slip(
        "the random state saved after the forward that draws the masks, not before",
        "state.append(RandContext(part))  #     the random state before the draw\n"
        "                rep.append(tower(part))",
        "rep.append(tower(part))\n                state.append(RandContext(part))",
        names=r"what differs between step \(1\) and step \(3\)",
    ),
    "streamed_backward": Slip(
        "DDP's reduction in the first micro-batch's backward, not the last's",
        "with ddp.no_sync() if k < len(micro) - 1 else nullcontext():",
        "with ddp.no_sync() if k > 0 else nullcontext():",
        names=r"added after DDP's reduction",
    ),
    "ring_by_hand": Slip(
        "G_y's part computed without the transpose: s D Z_x, not s D^T Z_x",
        "mine = s * d.T @ x",
        "mine = s * d @ x",
        names=r"reads the coefficient matrix the other way",
    ),
    "clip_step": Slip(
        "the gradient clipped after the optimizer's step",
        "torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)\n"
        "    optimizer.step()",
        "optimizer.step()\n"
        "    torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)",
        names=r"clipped only after the step",
    ),
}


# The second audit (issue 49): one more slip per exercise, planted after the judge learnt to say what each rank's
# answer ran and to read a ratio only as one possibility; chosen from the lessons alone, none of them a catalogued
# mistake nor the first audit's slip. `names` is what a first hint must say to name the slip; where it does not,
# the slip carries `unnamed=` (its test then asserts only that it is caught) and the README's table says so.
NEW_SLIPS = {
    "model_parallel_step": Slip(
        "the received gradient divided by the micro-batch's rows again before backward (a mean taken twice)",
        "a_out.backward(grad_out)",
        "a_out.backward(grad_out / len(x))",
        unnamed="ranks 0 and 1 off by 1/64 and 1/8, no reading; the exercise's first hint",
    ),
    "gpipe": Slip(
        "the micro-batches numbered from 1 to M, not from 0",
        '[Action(kind, i, r) for kind in "FI" for i in range(microbatches)]',
        '[Action(kind, i, r) for kind in "FI" for i in range(1, microbatches + 1)]',
        unnamed="the validator's 'once for each of the 5 micro-batches' and the claim's hint, not the numbering",
    ),
    "one_f_one_b": Slip(
        "the steady state runs the newest micro-batch's backward, not the oldest's",
        'order += [Action("F", warmup + k, r), Action("I", k, r)]',
        'order += [Action("F", warmup + k, r), Action("I", warmup + k, r)]',
        unnamed="'2I1 appears twice' and the warm-up cap's hint: another mistake",
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
        unnamed="caught once M = 1 was judged (after planting); the validator's words and the claim's hint only",
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
        names=r"bytes sent per step .* failed too.*what the answer ran: every rank: broadcast",
    ),
    "Copy": Slip(
        "f's backward all-reduces a copy and returns the gradient it was given",
        "dist.all_reduce(grad, group=ctx.group)",
        "dist.all_reduce(grad.clone(), group=ctx.group)",
        unnamed="'an identity backward': what the copy does, not the copy (a class: its collectives unwatched)",
    ),
    "ring_forward": Slip(
        "each tile's positions read from this rank's own pieces, not those of the block it holds",
        "for cols, key_positions in layout.pieces(source):",
        "for cols, key_positions in layout.pieces(ring.rank):",
        unnamed="the tiles after the diagonal counted 108, not 81, and the exercise's first hint",
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
        unnamed="a size mismatch raised inside torch's schedule; the ranks' scatters and broadcasts",
    ),
    "rank_bytes": Slip(
        "every bias cut by tp, out's and fc2's too (they stay whole on every rank)",
        "psi = (attention - d) // tp + d + (mlp - d) // tp + d + norms",
        "psi = attention // tp + mlp // tp + norms",
        unnamed="weights off by 0.998292 under TP, no reading; the exercise's first hint",
    ),
    "fp8_matmul": Slip(
        "b's transpose made contiguous (row-major) where _scaled_mm wants it column-major",
        "bt_q.contiguous().t(),",
        "bt_q.t().contiguous(),",
        missed="on the CPU torch's _scaled_mm takes a row-major b and computes the same product",
    ),
    "fp8_all_gather": Slip(
        "rho computed and returned but never applied before the cast",
        "mine = (shard.float() * rho).clamp(-top, top).to(fmt)",
        "mine = shard.float().clamp(-top, top).to(fmt)",
        unnamed="the exercise's first hint (cast with the agreed scale), not that rho was never applied",
    ),
    "Offloader": Slip(
        "a saved tensor keyed by its storage alone: two views of one storage share one copy",
        "key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())",
        "key = (storage.data_ptr(),)",
        missed="no layer of the judged model saves two views of one storage at different offsets",
    ),
    "powersgd_hook": Slip(
        "the error feedback's sign slipped: Delta_r = what every rank uses - M_r",
        "state.errors[index] = before - flat",
        "state.errors[index] = flat - before",
        unnamed="the parameters off by 5e-2, equal to none of the catalogued variants; the first hint",
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
        unnamed="the loss off by about 1/2 on every rank, equal to none of the catalogued variants",
    ),
    "gather_all_reduce": Slip(
        "the backward returns rows r .. r + C - 1 of the sum, not rC .. rC + C - 1",
        "return summed[ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c]",
        "return summed[ctx.rank : ctx.rank + ctx.c]",
        within="AllGatherSumBackward",
        unnamed="rank 0 right (rC = r there), the others equal to no variant; the first hint",
    ),
    "grad_cache_step": Slip(
        "the cached gradient cut into B pieces (chunk), not pieces of B rows (split)",
        "leaf.grad.split(b)",
        "leaf.grad.chunk(b)",
        missed="the judged sizes cut the cached gradient into as many pieces as a piece has rows",
    ),
    "streamed_backward": Slip(
        "dL/ds multiplied by s, not divided (the derivative of s x read as s)",
        "g_s = (z_x[glob] * g_x).sum() / s",
        "g_s = (z_x[glob] * g_x).sum() * s",
        unnamed="only logit_scale missed: the hint of a scale with no gradient, another mistake",
    ),
    "ring_by_hand": Slip(
        "the bias beta left out of the logits inside the sigmoid",
        "(s * x @ block.T + beta)",
        "(s * x @ block.T)",
        unnamed="G_x and G_y equal to no variant; the ring's hint",
    ),
    "clip_step": Slip(
        "each gradient's values clipped (clip_grad_value_), not the global norm",
        "torch.nn.utils.clip_grad_norm_([p for p in ddp.parameters() if p.requires_grad], clip_norm)",
        "torch.nn.utils.clip_grad_value_([p for p in ddp.parameters() if p.requires_grad], clip_norm)",
        unnamed="every tower's update wrong, the logit scale's right; the exercise's first hint",
    ),
}
