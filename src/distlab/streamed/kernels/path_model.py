"""A bytes-and-FLOPs model of the three CUDA paths of the tile work, and each one's floor at a shape.

    "triton"     fused: S in registers everywhere (`lse`, `product`); every multiply-add at the fused kernels'
                 rate, nothing of S in memory
    "triton-mm"  W in memory: the folds fused; each product's S made by a Triton GEMM whose epilogue writes W
                 (`coefficients`), then cuBLAS multiplies W
    "triton-s"   S in memory: every S made by cuBLAS into memory, then a memory-bound pass (`s_in_memory`): the
                 fold reads S, the coefficients read S and write W over it, then cuBLAS multiplies W

One rank's work at a shape, counted in C N d multiply-adds (one C x N pass of S, or one product with it) and in
bytes per element of S (C N elements a rank). The torch tiles' counts (`ring`, `step`): the InfoNCE ring 4 C N d
(fold, then S again for two products), gathered 6 C N d (two row folds, two products each making S; the torch
tiles save the own block's C^2 d, `own_block`, the kernels do not), the sigmoid ring 3 C N d, gathered 4 C N d.
The fused kernels make S once more for every second product (5 C N d, 4 C N d). What a path moves through memory per
element of S: W in memory writes W (2 bytes in bf16, 4 in float32) from its GEMM's epilogue; S in memory writes
S in float32 (4), reads it in the fold (4), and for a product writes S, reads it and writes W (4 + 4 + 2) where
the ring did not keep pass 1's S (`s_in_memory.Kept`: the visits the budget holds).

The floor: the work at each engine's rate, one after the other (no overlap between a GEMM and a pass: they are
separate launches on one stream):

    floor = 2 C N d (n_gemm / gemm + n_triton / triton_gemm + sum_kind n_kind / fused_kind) + C N b / bandwidth

with n_... the C N d multiply-adds each engine does and b the bytes per element of S.

The rates are measured on a card (`RATES`: the H200 of 2026-11-28; the GPU scripts measure their own card's and
pass them in: benchmarks/gpu_next.py), never assumed: a card with none has no modelled floor. The floor is a
bound the path cannot beat with these engines at these rates, not a prediction: the GPU run prints each timed row
beside its floor, so every row says how far it is from its own.
"""

from __future__ import annotations

from dataclasses import dataclass

PATHS = ("triton", "triton-mm", "triton-s")  # fused, W in memory, S in memory
S_BYTES = 4  # float32 S in memory (the GEMM's output dtype, `s_in_memory.s_chunk`)


@dataclass(frozen=True)
class Rates:
    """What one card does per second: cuBLAS GEMM FLOPs at the step's matmul precision, the Triton coefficient
    GEMM's FLOPs, the fused kernels' FLOPs by kind (S in registers: "fold" the rows' fold, "ring-fold" the ring's
    with column statistics, "infonce" and "sigmoid" the fused products; `tuning`'s kinds), and memory bytes;
    `source` says where they came from."""

    gemm: float
    triton_gemm: float
    fused: dict
    bandwidth: float
    source: str


# Rates measured on one H200 at bf16, one rank of N = 65,536, P = 8, d = 1,024
# (benchmarks/results/gpu/2026-11-28-decide-h200; C N d = 5.5e11 multiply-adds), each the fastest seen, so
# that no row on record lies below its floor: cuBLAS 6 C N d in 0.0128 s (516 TFLOP/s); the coefficient GEMM
# 462-502 TFLOP/s (w_rows 2,048-8,192); the ring's fold, a visit in 0.0010 s (138); the rows' fold 310, what the
# gathered triton-mm step (0.0162 s) leaves after its products at the two GEMM rates and W's bytes; the fused
# InfoNCE products 170 (the fused gather, 0.0332 s, less its folds), the fused sigmoid's 101 (its ring, 4 C N d in
# 0.0437 s). Bandwidth was not measured there: the datasheet's 4.8 TB/s stands in until gpu_next.py's copy row
# measures it (a floor too low, never too high).
RATES = {
    "NVIDIA H200": Rates(
        516e12,
        502e12,
        {"fold": 310e12, "ring-fold": 138e12, "infonce": 170e12, "sigmoid": 101e12},
        4.8e12,
        "H200 2026-11-28 (bandwidth: datasheet)",
    ),
}


@dataclass(frozen=True)
class Shape:
    """One rank's share of a step: the loss ("infonce" | "sigmoid"), the exchange ("ring" | "gather"), N, P, d,
    the bytes of one element of W (2 in bf16), and the bytes of S the budget keeps (W_MEMORY_MIB's rule)."""

    loss: str
    exchange: str
    n: int
    world: int
    d: int
    w_itemsize: int = 2
    budget: int = 512 * 2**20


@dataclass(frozen=True)
class Work:
    """Multiply-adds by engine (in units of C N d; the fused kernels' by kind) and bytes through memory (per
    element of S)."""

    gemm: float = 0.0
    triton_gemm: float = 0.0
    fused: tuple = ()  # (kind, C N d multiply-adds) pairs
    bytes_per_element: float = 0.0


def products_of(shape: Shape) -> tuple[float, float, float]:
    """(folds, lone products, shared visits) per rank, each over a C x N of S: folds, products that each make
    their own S, and visits whose one S feeds two products."""
    if shape.loss == "sigmoid":  # one S per visit for both products (ring); rows', then columns' (gathered)
        return (0, 0, 1) if shape.exchange == "ring" else (0, 2, 0)
    if shape.exchange == "gather":  # each product its own S (the own block's shared S is the torch tiles' only)
        return (2, 2, 0)
    return (1, 0, 1)


def kept_share(shape: Shape) -> float:
    """The InfoNCE ring's visits whose S stays from pass 1 to pass 2 (`s_in_memory.Kept`): as many as fit."""
    c = shape.n // shape.world
    visit = c * c * S_BYTES
    return min(shape.world, shape.budget // visit) / shape.world if visit else 0.0


def work(path: str, shape: Shape) -> Work:
    """The work of one rank's tile work on `path` at `shape`, from its folds, its lone products (each making its
    own S) and its shared visits (one S for two products; `products_of`), in the module docstring's units."""
    folds, alone, shared = products_of(shape)
    w, fold_kind = shape.w_itemsize, "ring-fold" if shape.exchange == "ring" else "fold"
    product_kind = "sigmoid" if shape.loss == "sigmoid" else "infonce"
    if path == "triton":  # a fold 1; a lone product 2 (S, then W k); a shared visit 4 (S made for each product)
        return Work(fused=((fold_kind, folds), (product_kind, 2 * alone + 4 * shared)))
    if path == "triton-mm":  # S and W by the Triton GEMM (W written), each product by cuBLAS
        bytes_w = w * (alone + shared)
        return Work(alone + 2 * shared, alone + shared, ((fold_kind, folds),), bytes_w)
    if path != "triton-s":
        raise ValueError(f"no model of path {path!r}: one of {PATHS}")
    # the InfoNCE ring's pass 2 makes S again only for the visits not kept; the sigmoid's visit makes its one S
    again = 1.0 - kept_share(shape) if shape.loss == "infonce" else 1.0
    gemm = folds + 2 * alone + shared * (2 + again)
    fold_bytes = folds * 2 * S_BYTES  # S written by the GEMM, read by the fold
    product_bytes = alone * (2 * S_BYTES + w) + shared * (again * S_BYTES + S_BYTES + w)  # S written, read; W written
    return Work(gemm=gemm, bytes_per_element=fold_bytes + product_bytes)


def floor(path: str, shape: Shape, rates: Rates) -> float:
    """Seconds below which `path` cannot do one rank's tile work at `shape` with these rates."""
    elements = (shape.n // shape.world) * shape.n  # C N: one rank's elements of S
    flops = 2.0 * elements * shape.d  # of C N d multiply-adds
    done = work(path, shape)
    fused = sum(count / rates.fused[kind] for kind, count in done.fused if count)
    compute = flops * (done.gemm / rates.gemm + done.triton_gemm / rates.triton_gemm + fused)
    return compute + elements * done.bytes_per_element / rates.bandwidth


def floors(shape: Shape, rates: Rates) -> dict[str, float]:
    """Every path's floor at `shape`, fastest first."""
    return dict(sorted(((path, floor(path, shape, rates)) for path in PATHS), key=lambda item: item[1]))


def rates_for(device_name: str) -> Rates | None:
    """The rates on record for a card (`torch.cuda.get_device_name`'s words, matched by prefix), else None."""
    return next((rates for name, rates in RATES.items() if device_name.startswith(name)), None)
