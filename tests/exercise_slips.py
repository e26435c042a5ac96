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
        lines = source.splitlines()  # the source as compiled, for `exercise_values.noted` on a child's raise
        for name in dict.fromkeys((self.within or self.name, self.name)):  # the slipped one first, then its caller
            node = nodes[name]
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])  # its decorators too
            text = "\n".join(source.splitlines()[first - 1 : node.end_lineno])
            if name == (self.within or self.name):
                if text.count(self.old) != 1:
                    raise ValueError(f"{name} holds {self.old!r} {text.count(self.old)} times: the slip no longer fits")
                text = text.replace(self.old, self.new)
                slipped = text.splitlines()  # the rest keeps its lines where the slip is shorter
                lines[first - 1 : node.end_lineno] = slipped + [""] * (node.end_lineno - first + 1 - len(slipped))
            padded = "\n" * (first - 1) + text  # the lesson's line numbers, in a traceback
            exec(compile(padded, str(self.path), "exec"), namespace)
        namespace["__planted_lines__"] = [line + "\n" for line in lines]
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
