"""The bytes-and-FLOPs model of the three CUDA paths (`distlab.streamed.kernels.path_model`) and the rule by which
KERNELS "auto" reads the measured rows (`kernels.tuning`), without a GPU.

- The model's cuBLAS work of each path equals the matmul FLOPs counted (from the shapes of every mm and addmm
  dispatched) in one rank's step on the meta device (every S and every product of "triton-s" and the products
  of "triton-mm" are torch matmuls; the fused kernels none), for both losses and both exchanges at P = 4, with
  the ring's S kept from pass 1 (budget large) and made again (budget one byte).
- With every rate equal and memory free, the floors are in the ratio of the multiply-adds each path does:
  the InfoNCE ring 5 : 4 : 3 (fused, W in memory, S in memory, S kept), the sigmoid ring 4 : 3 : 3.
- "auto" on CUDA keeps W in memory while the table of S-in-memory rows is empty (what it logs says so, with
  the modelled floors), takes S in memory only where every row for that card and d is faster, and not where one
  is slower.
"""

import dataclasses

import kernel_helpers  # noqa: F401 - sets TRITON_INTERPRET=1 before the kernels are imported
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.streamed.config import parse_config
from distlab.streamed.kernel_choice import auto_choice, tile_ops
from distlab.streamed.kernels import path_model, tuning
from distlab.streamed.rank_work import one_rank

N, P, D = 64, 4, 8


class MatmulFlops(TorchDispatchMode):
    """2 m k n for every matmul dispatched (mm, addmm and its in-place and out= forms), counted from the shapes."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            a, b = args[:2] if name == "mm" else args[1:3]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def counted_gemm_flops(kernels: str, loss: str, exchange: str, w_mib: int | None) -> int:
    """Matmul FLOPs of rank 0's tile work at N, P, D on the meta device (float32 embeddings at tf32: every
    product a torch addmm that the counter sees)."""
    keys = {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": N // P, "EXCHANGE": exchange, "KERNELS": kernels}
    keys |= {"MATMUL_PRECISION": "tf32"} | ({"W_MEMORY_MIB": w_mib} if w_mib else {})
    cfg = parse_config(keys, P, 0)
    meta = torch.device("meta")
    z_x, z_y = (torch.empty(N, D, device=meta) for _ in range(2))
    ops = tile_ops(kernels, "tf32", 8, meta, torch.float32, D, cfg.w_budget)
    if w_mib == 0:  # no room for any visit's S: every S of pass 2 made again
        ops = dataclasses.replace(ops, w_budget=1, kept=None)
    with MatmulFlops() as counter:
        one_rank(cfg, z_x, z_y, loss, ops)
    return counter.flops


@pytest.mark.parametrize("loss", ["infonce", "sigmoid"])
@pytest.mark.parametrize("exchange", ["ring", "gather"])
def test_the_models_cublas_work_is_what_the_step_multiplies(loss, exchange):
    x_flops = 2 * (N // P) * N * D  # C N d multiply-adds
    for kernels, w_mib in (("triton-s", None), ("triton-s", 0), ("triton-mm", None), ("triton", None)):
        budget = 1 if w_mib == 0 else 512 * 2**20
        shape = path_model.Shape(loss, exchange, N, P, D, w_itemsize=4, budget=budget)
        modelled = path_model.work(kernels, shape).gemm * x_flops
        assert counted_gemm_flops(kernels, loss, exchange, w_mib) == pytest.approx(modelled), (kernels, w_mib)


def test_with_equal_rates_the_floors_are_the_multiply_adds():
    same = path_model.Rates(1e12, 1e12, dict.fromkeys(("fold", "ring-fold", "infonce", "sigmoid"), 1e12), 1e30, "-")
    x_seconds = 2 * (N // P) * N * D / 1e12
    for loss, counts in (("infonce", (5, 4, 3)), ("sigmoid", (4, 3, 3))):
        floors = path_model.floors(path_model.Shape(loss, "ring", N, P, D), same)
        assert [round(floors[path] / x_seconds, 6) for path in path_model.PATHS] == list(counts), loss
    with pytest.raises(ValueError, match="no model of path 'torch'"):
        path_model.work("torch", path_model.Shape("infonce", "ring", N, P, D))


def test_auto_takes_s_in_memory_only_where_measured_faster(monkeypatch, caplog):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: tuning.H200)
    assert tuning.S_IN_MEMORY_MEASURED == {}  # nothing timed yet: the default stays W in memory
    with caplog.at_level("INFO", logger=tuning.__name__):
        kernels, why = auto_choice(cuda, 1024, torch.bfloat16, "bf16")
    assert kernels == "triton-mm" and "S in memory not yet timed" in why and "modelled floors" in why
    assert any("triton-s" in record.getMessage() for record in caplog.records)  # the model's floors, logged
    rows = [("infonce", "ring", 0.010, 0.0152), ("sigmoid", "ring", 0.0080, 0.0085)]
    monkeypatch.setitem(tuning.S_IN_MEMORY_MEASURED, tuning.H200, {1024: rows})
    kernels, why = auto_choice(cuda, 768, torch.bfloat16, "bf16")  # the d on record nearest
    assert kernels == "triton-s" and "measured faster" in why
    slower = rows[:1] + [("sigmoid", "ring", 0.0090, 0.0085)]  # one loss slower: not taken
    monkeypatch.setitem(tuning.S_IN_MEMORY_MEASURED, tuning.H200, {1024: slower})
    assert auto_choice(cuda, 1024, torch.bfloat16, "bf16")[0] == "triton-mm"
