"""The cost model's rules: a model, batch, split and precision that cannot run are refused in one line naming the
field (`check`), the same wording wherever they are asked about (the planner's flags, lesson 13's splits), before
any formula of `distlab.cost` is evaluated on them. The records themselves are `distlab.cost.shapes`."""

from __future__ import annotations

from dataclasses import fields

from distlab.cost.shapes import ATTENTION, PRECISIONS, Batch, Mlp, Parallel, Transformer, schedule_of
from distlab.data_split.sharding.accounting import STAGES


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
    if parallel.ep > 1 and not getattr(model, "experts", 0):
        _refuse("ep", "expert parallelism needs a mixture-of-experts model (experts > 0)")
    if parallel.dp % parallel.ep:
        _refuse(
            "ep", f"expert parallelism takes its ranks from dp; ep = {parallel.ep} does not divide dp = {parallel.dp}"
        )
    if parallel.recompute and parallel.selective:
        _refuse("recompute", "full or selective recomputation, not both")
    if parallel.grad_bytes not in (0, 2, 4):
        _refuse("grad_bytes", f"gradients are bf16 (2) or float32 (4) bytes, got {parallel.grad_bytes}")
    rows = parallel.dp * batch.micro_batches
    if batch.global_batch % rows:
        _refuse("global_batch", f"N = {batch.global_batch} does not cut into dp x M = {rows} equal micro-batches")
    if isinstance(model, Mlp):
        if len(model.widths) < 2 or min(model.widths) < 1:
            _refuse("widths", f"need at least two positive widths, got {list(model.widths)}")
        if parallel.tp > 1 or parallel.cp > 1:
            _refuse("tp" if parallel.tp > 1 else "cp", "the layered MLP has no heads or sequence to split")
    else:
        _check_transformer(model, batch, parallel)
    if parallel.pp * parallel.stages_per_rank > model.layers:
        _refuse("pp", f"pp x v = {parallel.pp * parallel.stages_per_rank} stages, but only {model.layers} layers")
    try:
        schedule_of(parallel.schedule, parallel.pp, batch.micro_batches, parallel.stages_per_rank)
    except ValueError as err:
        _refuse("schedule", str(err))


def _check_transformer(model: Transformer, batch: Batch, parallel: Parallel) -> None:
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
    if model.experts % parallel.ep or model.expert_ffn % parallel.tp:
        _refuse(
            "ep",
            f"ep = {parallel.ep}, tp = {parallel.tp} do not divide {model.experts} experts of width {model.expert_ffn}",
        )
    if model.dense_layers > model.layers:
        _refuse("dense_layers", f"{model.dense_layers} dense layers, but only {model.layers} layers")
    if model.mla and parallel.cp > 1:
        _refuse("cp", "the ring of lesson 09 sends k and v blocks; multi-head latent attention's are not priced")
    kv = model.kv_heads or model.heads
    if model.heads % kv:
        _refuse("kv_heads", f"{kv} key/value heads do not divide h = {model.heads}")
    tp = parallel.tp
    for name, value in (("kv_heads" if model.kv_heads else "heads", kv), ("ffn", model.ffn), ("vocab", model.vocab)):
        if value % tp:
            _refuse("tp", f"tp = {tp} does not divide {name} = {value}")
    if parallel.cp > 1 and batch.seq % (2 * parallel.cp):
        _refuse("cp", f"the zig-zag ring cuts seq = {batch.seq} into 2 cp = {2 * parallel.cp} pieces: it does not")
    if parallel.cp > 1 and model.attention != "sdpa":
        _refuse("cp", "ring attention folds blocks online: attention written out keeps the whole seq x seq")
    if parallel.cut_gathered and not parallel.sp:
        _refuse("cut_gathered", "only sequence parallelism gathers the inputs it could keep cut (sp)")
    if parallel.sp and (batch.seq // parallel.cp) % tp:
        _refuse("sp", f"sequence parallelism cuts seq / cp = {batch.seq // parallel.cp} tokens over tp = {tp}")
