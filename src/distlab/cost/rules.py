"""The cost model's rules: a model, batch, split and precision that cannot run are refused in one line naming the
field (`check`), the same wording wherever they are asked about (the planner's flags, lesson 13's splits), before
any formula of `distlab.cost` is evaluated on them. The records themselves are `distlab.cost.inputs`."""

from __future__ import annotations

from dataclasses import fields

from distlab.cost.inputs import MEASURES, PRECISIONS, Batch, Mlp, Parallel, schedule_of
from distlab.cost.schedule import CLOSED_FORMS, check_closed_form
from distlab.data_split.sharding.accounting import STAGES
from distlab.proof.sizes import ATTENTION, Transformer


def _sizes(obj) -> dict[str, int]:
    """The integer fields of a dataclass (its flags, bools, are not sizes)."""
    values = {f.name: getattr(obj, f.name) for f in fields(obj)}
    return {k: v for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool)}


def _refuse(field: str, message: str) -> None:
    raise ValueError(f"{field}: {message}")


def check(model: Transformer | Mlp, batch: Batch, parallel: Parallel, precision: str) -> None:
    """Every reason the configuration cannot run, the first one raised as one line naming its field."""
    for obj in (batch, parallel):
        for name, value in _sizes(obj).items():
            if value < 1 and name != "grad_bytes":  # 0: as the precision's e
                _refuse(name, f"must be a positive integer, got {value}")
    if precision not in PRECISIONS:
        _refuse("precision", f"{precision!r} is not one of {', '.join(PRECISIONS)}")
    if parallel.zero not in STAGES:
        _refuse("zero", f"{parallel.zero!r} is not one of {', '.join(STAGES)} (FSDP2 is ZeRO-3)")
    if parallel.recompute + parallel.selective + parallel.act_fn > 1:
        _refuse("recompute", "one of full, selective (Megatron's) or act-fn recomputation, not two")
    unknown = [m for m in parallel.measures if m not in MEASURES]
    if unknown:
        _refuse("measures", f"{unknown[0]!r} is not one of {', '.join(MEASURES)}")
    if parallel.grad_bytes not in (0, 2, 4):
        _refuse("grad_bytes", f"gradients are bf16 (2) or float32 (4) bytes, got {parallel.grad_bytes}")
    if isinstance(model, Mlp):
        if len(model.widths) < 2 or min(model.widths) < 1:
            _refuse("widths", f"need at least two positive widths, got {list(model.widths)}")
        if parallel.tp > 1 or parallel.cp > 1:
            _refuse("tp" if parallel.tp > 1 else "cp", "the layered MLP has no heads or sequence to split")
        if parallel.ep > 1:
            _refuse("ep", "expert parallelism needs a mixture-of-experts model (experts > 0)")
    else:
        _check_transformer(model, parallel)
    # the shape's one validation (`ParallelDims.check`: what dp, pp, tp, cp and ep must divide), as lesson 12 and
    # the planner's search ask it; building the shape refuses an ep that does not divide dp
    parallel.dims.check(
        model, batch.global_batch, batch.seq, batch.micro_batches, parallel.sp, parallel.stages_per_rank
    )
    try:
        if parallel.schedule in CLOSED_FORMS:
            check_closed_form(parallel.schedule, parallel.pp, batch.micro_batches, parallel.stages_per_rank)
        else:
            schedule_of(parallel.schedule, parallel.pp, batch.micro_batches, parallel.stages_per_rank)
    except ValueError as err:
        _refuse("schedule", str(err))


def _check_transformer(model: Transformer, parallel: Parallel) -> None:
    """The model's own rules, and those of a strategy on it (what a shape must divide is `ParallelDims.check`)."""
    for name, value in _sizes(model).items():
        if value < (1 if name in ("layers", "dim", "heads", "ffn") else 0):
            _refuse(name, f"must be positive, got {value}")
    if model.attention not in ATTENTION:
        _refuse("attention", f"{model.attention!r} is not one of {', '.join(ATTENTION)}")
    llama = model.gated or model.rms_norm or model.kv_heads not in (0, model.heads) or not model.bias
    if model.attention == "written" and (llama or parallel.tp > 1):
        _refuse("attention", "written out, attention is lesson 07's one-rank block: no Llama options, tp = 1")
    if model.dim % model.heads and not model.head_size:
        _refuse("heads", f"h = {model.heads} does not divide d = {model.dim}")
    if model.experts and not (1 <= model.top_k <= model.experts and model.expert_ffn):
        _refuse("top_k", f"a mixture of {model.experts} experts needs 1 <= top_k <= experts and an expert width")
    if model.dense_layers > model.layers:
        _refuse("dense_layers", f"{model.dense_layers} dense layers, but only {model.layers} layers")
    if model.mla and parallel.cp > 1:
        _refuse("cp", "the ring of lesson 09 sends k and v blocks; multi-head latent attention's are not priced")
    kv = model.kv_heads or model.heads
    if model.heads % kv:
        _refuse("kv_heads", f"{kv} key/value heads do not divide h = {model.heads}")
    if parallel.cp > 1 and model.attention != "sdpa":
        _refuse("cp", "ring attention folds blocks online: attention written out keeps the whole seq x seq")
    if parallel.cut_gathered and not parallel.sp:
        _refuse("cut_gathered", "only sequence parallelism gathers the inputs it could keep cut (sp)")
