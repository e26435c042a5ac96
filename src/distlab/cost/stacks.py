"""Efficiency profiles: the software a run used, as the time model's assumptions fitted to published runs.

The same layout on the same GPUs runs at different speeds under different software. A tuned stack (Megatron-LM
with fused kernels, FlashAttention and sequence parallelism; torchtitan; Llama 3's) reaches about 80% of the
dense peak in its large products and computes only the causal half of attention; the Megatron-DeepSpeed runs of
2021-22 (MT-NLG, BLOOM) ran attention as two batched products over the whole seq x seq square with a fused
softmax between them, and reached about half the peak in their products. A `Stack` names that software and
carries the `Assumptions` fitted to it, the published runs it was fitted on, and the regime those runs span
(GPU types, model sizes): `python -m distlab.plan --stack NAME` prices with it, and warns when a plan falls
outside the regime its profile was fitted on (`outside`), where the fitted figures are a guess.

Fitting (`distlab.plan.presets.PUBLISHED` holds the runs, each marked fitted or held out): the tuned profile's
figures are the time model's defaults, set against the Llama 3 405B rows of Table 4; the Megatron-DeepSpeed
profile's one figure (its products' and attention's share of the peak, one number) is the value at which MT-NLG
on 2,240 A100 predicts its published 60.1 s a step (bisection, `tests/test_plan.py` refits it). The held-out
runs (MT-NLG on 2,800 and 3,360 GPUs, BLOOM) were not used: docs/planner.md lists them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.cost.timing import Assumptions

SIZE_ROUNDING = 0.01  # a published size is rounded to its leading digits: 405 B for 405.9 B
MEGATRON_DEEPSPEED_EFFICIENCY = 0.519  # fitted: MT-NLG 530B, 2,240 A100, 60.1 s a step (module docstring)


@dataclass(frozen=True)
class Stack:
    """A software stack's efficiency profile and the regime it was fitted on."""

    name: str
    software: str
    assumptions: Assumptions
    gpus: tuple[str, ...]  # the GPU types of its fitted runs (keys of distlab.proof.hardware.DEVICES)
    parameters: tuple[float, float]  # the model sizes of its fitted runs, fewest to most, as their papers round

    def outside(self, gpu: str, parameters: int) -> str | None:
        """Why a plan for `gpu` and a model of `parameters` lies outside the fitted regime; None if inside. The
        sizes are the papers' rounded ones (405 B, 530 B): a model within `SIZE_ROUNDING` of them is inside (Llama
        3 405B counts 405.9 B)."""
        low, high = self.parameters
        if gpu not in self.gpus:
            return f"the {self.name} profile was fitted on {', '.join(self.gpus)} runs, not {gpu}"
        if not low * (1 - SIZE_ROUNDING) <= parameters <= high * (1 + SIZE_ROUNDING):
            sizes = f"{low / 1e9:,.0f}" + (f"-{high / 1e9:,.0f}" if high > low else "")
            return (
                f"the {self.name} profile was fitted on models of {sizes} B parameters, not {parameters / 1e9:,.3g} B"
            )
        return None


STACKS = {
    s.name: s
    for s in (
        Stack(
            "megatron-lm",
            "Megatron-LM, torchtitan or Llama 3's stack: fused kernels, FlashAttention (causal half), sequence "
            "parallelism, overlapped data-parallel reductions",
            Assumptions(),
            ("h100",),
            (405e9, 405e9),
        ),
        Stack(
            "megatron-deepspeed",
            "Megatron-DeepSpeed of 2021-22 (MT-NLG, BLOOM): attention as two batched products over the whole "
            "square, a fused softmax between, no sequence parallelism",
            Assumptions(
                matmul_efficiency=MEGATRON_DEEPSPEED_EFFICIENCY,
                attention_efficiency=MEGATRON_DEEPSPEED_EFFICIENCY,
                attention_share=1.0,
            ),
            ("a100",),
            (530e9, 530e9),
        ),
    )
}
DEFAULT_STACK = "megatron-lm"
