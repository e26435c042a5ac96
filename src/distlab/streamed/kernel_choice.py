"""Which code does the step's tile work: the torch tiles or the Triton kernels (config key KERNELS), at the
step's matmul precision (MATMUL_PRECISION, `precision`).

    "auto"    (the default) the measured winner for the card and d (`kernels.tuning.auto_kernels`, said once
              in the log): "triton-mm" for CUDA tensors when triton imports and MATMUL_PRECISION is "bf16"
              or "tf32" (tensor cores), the torch tiles elsewhere: for float64 on CUDA (the dtype that checks
              exactness, not a fast path) and for IEEE float32, where cuBLAS's float32 matmul beat the kernels'
              FMA products 0.16 s to 0.75 s on an H100 (benchmarks/results/gpu/2026-11-26-kernels-h100). W in
              memory, not in registers: on an H200 at one rank of N = 65,536, P = 8, d = 1,024 it took 0.017 s
              where the fused kernels took 0.033 s (InfoNCE) and 0.0085 s where they took 0.042 s (the sigmoid
              ring), every path exact in bf16 there (benchmarks/results/gpu/2026-11-28-decide-h200)
    "torch"   the torch tiles: T x T tiles of S in memory, a dozen ops on each (`torch_tiles`, `sigmoid`)
    "triton"  the Triton kernels (`distlab.streamed.kernels`), S and W in registers: CUDA tensors, or CPU
              tensors under Triton's interpreter (TRITON_INTERPRET=1 set before the kernels are first imported)
    "triton-mm"  the same, except phase 3's products (and the sigmoid's): W made by a Triton GEMM's epilogue
              in chunks of rows in memory, then multiplied by torch's matmul (`kernels.coefficients`)
    "triton-s"  S in memory: every block of S made by one cuBLAS GEMM in chunks of rows (the W_MEMORY_MIB rule),
              then one memory-bound Triton pass that folds it into the row and column statistics or turns it
              into W in place, then torch's matmul for the products; the InfoNCE ring keeps pass 1's S for
              pass 2 where the budget holds it (`kernels.s_in_memory`). "auto" takes it only where a GPU run
              measured it faster (`kernels.tuning.S_IN_MEMORY_MEASURED`, empty until then)

`TorchTiles` and `TritonTiles` answer the same questions, so phases 2 and 3, the ring's passes and the sigmoid
loss are written once: `row_lse` (a row log-sum-exp and its nll), `both_lse` (every row's and every
column's), `pair_product` (sum_j (R + Q - 2 delta)_ij k_j), `sigmoid_block`, and the ring's `ring_fold` and
`ring_products`. Their arithmetic differs in one place: the torch tiles multiply each S tile twice in one
T x T tile (the ring's pass 2 and the sigmoid ring feed both products from it), a fused kernel recomputes S for
the second product instead of sharing one tile between programs (deterministic, no atomics): the InfoNCE ring is
5 C N d multiply-adds with the fused kernels against 4 with the torch tiles, the sigmoid ring 4 against 3. With W
in memory ("triton-mm") both products read the same W, as the torch tiles do: 4 and 3.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch

from distlab.streamed.precision import rounded
from distlab.streamed.sigmoid import BlockGrads, sigmoid_block
from distlab.streamed.torch_tiles import (
    Pairing,
    RowFold,
    lse_and_nll,
    ring_fold_tiles,
    ring_product_tiles,
    streamed_lse,
    streamed_lse_both,
    streamed_softmax_pair_product,
)
from distlab.streamed.wrappers import compute_dtype


@dataclass(frozen=True)
class TorchTiles:
    """The torch tiles: tiles of at most T x T, each made in memory and walked by torch ops."""

    t: int  # T
    precision: str = "float32"
    name = "torch"

    def prepare(self, z: torch.Tensor) -> torch.Tensor:
        """An embedding as these tiles read it: the compute dtype, rounded to bf16 under "bf16"."""
        return rounded(z.to(compute_dtype(z.dtype)), self.precision)

    def row_lse(self, q, k, scale: float, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        return streamed_lse(q, k, scale, self.t, offset)

    def both_lse(self, z_x, z_y, scale: float) -> tuple[torch.Tensor, ...]:
        return streamed_lse_both(z_x, z_y, scale, self.t)

    def pair_product(self, q, k, scale: float, pairing: Pairing) -> torch.Tensor:
        p = pairing
        return streamed_softmax_pair_product(q * scale, k, p.lse_q, p.lse_k, p.diag_coef, p.offset, self.t)

    def sigmoid_block(self, x, y, logits, starts: tuple[int, int], n: int, want: tuple[bool, bool]):
        return sigmoid_block(x, y, logits, starts, n, self.t, want)

    def ring_fold(self, x, y_j, scale: float, rows_fold: RowFold, own: bool) -> list:
        return ring_fold_tiles(x * scale, y_j, rows_fold, own, self.t)

    def ring_products(self, x, y_j, scale: float, pairing: Pairing, into_rows: torch.Tensor) -> torch.Tensor:
        return ring_product_tiles(x, y_j, scale, pairing, into_rows, self.t)


@dataclass(frozen=True)
class TritonTiles:
    """The Triton kernels: one launch per row fold or product, whatever N and T are (T is not used)."""

    precision: str = "float32"
    blocks: Any = None  # a `kernels.launch.Blocks`, or None: measured on CUDA (`kernels.tuning`), else the defaults
    w_in_memory: bool = False  # KERNELS "triton-mm": the products by `kernels.coefficients`
    w_budget: int | None = None  # "triton-mm", "triton-s": bytes of W (of S) alive at once (W_MEMORY_MIB)
    s_in_memory: bool = False  # KERNELS "triton-s": S by cuBLAS in chunks, then one Triton pass (`kernels.s_in_memory`)
    kept: Any = field(default=None, compare=False, repr=False)  # "triton-s": the ring's S kept from pass 1 to pass 2

    def __post_init__(self):
        if self.s_in_memory and self.kept is None:
            from distlab.streamed.kernels.s_in_memory import Kept

            object.__setattr__(self, "kept", Kept(self.w_budget))  # one store per step's ops (frozen otherwise)

    @property
    def name(self) -> str:
        return "triton-s" if self.s_in_memory else "triton-mm" if self.w_in_memory else "triton"

    def _mm(self, q, k, job, kept=None):
        """KERNELS "triton-mm" (or "triton-s": S in memory, `kept` its store): `coefficients.run` for a Job, W in
        chunks of this step's budget: (rows' product, columns' product or None, loss row sums, D row sums)."""
        if self.s_in_memory:
            from distlab.streamed.kernels.s_in_memory import run as run_s

            return run_s(q, k, job._replace(w_bytes=self.w_budget), self.precision, self.blocks, kept)
        from distlab.streamed.kernels.coefficients import run

        return run(q, k, job._replace(w_bytes=self.w_budget), self.precision, self.blocks)

    def _sigmoid_rows(self, q, k, pair, n: int, shift: int):
        """(D k, the loss's sum, D's sum) for q's rows against k, W in registers or in memory."""
        if self.w_in_memory or self.s_in_memory:
            from distlab.streamed.kernels.coefficients import sigmoid_job

            g, _, loss, d_sum = self._mm(q, k, sigmoid_job(q, pair, n, shift, False))
            return g, loss.sum(), d_sum.sum()
        from distlab.streamed.kernels.product import sigmoid_rows

        return sigmoid_rows(q, k, pair, n, shift, self.precision, self.blocks)

    def prepare(self, z: torch.Tensor) -> torch.Tensor:
        """The kernels read float32, bf16 and fp16 as they are (and float64): nothing to copy."""
        return z

    def _operands(self, *tensors: torch.Tensor) -> tuple:
        """The tiles' operands in the dtype their products take, converted once here rather than in every
        slice a kernel loads: bf16 under "bf16" (half the bytes to load), else float32 (a 16-bit operand
        widened exactly: the float32 kernels spill registers converting it on the fly). Float64 as it is."""
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        return tuple(t if t.dtype == torch.float64 else t.to(dtype) for t in tensors)

    def _fold(self, q, k, scale: float, offset: int | None, columns: bool, kept=None):
        """The rows' (and with `columns` the columns') fold: S in registers (`lse.row_lse`), or with
        s_in_memory made by cuBLAS and folded by one pass (`s_in_memory.row_lse`, `kept` its store)."""
        if self.s_in_memory:
            from distlab.streamed.kernels.s_in_memory import Chunking
            from distlab.streamed.kernels.s_in_memory import row_lse as row_lse_s

            chunking = Chunking(self.blocks, self.w_budget, kept)
            return row_lse_s(q, k, scale, offset, self.precision, columns, chunking)
        from distlab.streamed.kernels.lse import row_lse

        return row_lse(q, k, scale, offset, self.precision, columns=columns, blocks=self.blocks)

    def row_lse(self, q, k, scale: float, offset: int) -> tuple[torch.Tensor, torch.Tensor]:

        folded = self._fold(*self._operands(q, k), scale, offset, False)
        return lse_and_nll(folded.m, folded.l, folded.diag)

    def both_lse(self, z_x, z_y, scale: float) -> tuple[torch.Tensor, ...]:
        return (*self.row_lse(z_x, z_y, scale, 0), *self.row_lse(z_y, z_x, scale, 0))

    def pair_product(self, q, k, scale: float, pairing: Pairing) -> torch.Tensor:
        q, k = self._operands(q, k)
        if self.w_in_memory or self.s_in_memory:
            from distlab.streamed.kernels.coefficients import infonce_job

            return self._mm(q, k, infonce_job(scale, pairing, 1.0, False))[0]
        from distlab.streamed.kernels.product import pair_product

        return pair_product(q, k, scale, pairing, self.precision, blocks=self.blocks)

    def sigmoid_block(self, x, y, logits, starts: tuple[int, int], n: int, want: tuple[bool, bool]):
        """Rows against columns: D y for the rows (want[0]) and D^T x for the columns (want[1]), each its own
        launch (the second recomputes S with the roles swapped; S^T's positives are S's)."""
        pair, shift, (x, y) = (logits.s, logits.beta), starts[0] - starts[1], self._operands(x, y)
        d_y = d_x = None
        if (self.w_in_memory or self.s_in_memory) and all(want):  # one D for both products
            from distlab.streamed.kernels.coefficients import sigmoid_job

            d_y, d_x, loss, d_sum = self._mm(x, y, sigmoid_job(x, pair, n, shift, True))
            return BlockGrads(loss.sum(), d_y, d_x, d_sum.sum())
        if want[0] or not want[1]:  # (neither wanted: the loss alone, which this kernel makes beside D y)
            d_y, loss, d_sum = self._sigmoid_rows(x, y, pair, n, shift)
            d_y = d_y if want[0] else None
        if want[1]:
            d_x, loss, d_sum = self._sigmoid_rows(y, x, pair, n, -shift)
        return BlockGrads(loss, d_y, d_x, d_sum)

    def ring_fold(self, x, y_j, scale: float, rows_fold: RowFold, own: bool) -> list:
        from distlab.streamed.kernels.lse import merge

        kept = self._visit(x, y_j, start=own)
        x, y_j = self._operands(x, y_j)
        folded = self._fold(x, y_j, scale, 0 if own else None, True, kept)
        rows_fold.m, rows_fold.l = merge(torch.stack((rows_fold.m, folded.m)), torch.stack((rows_fold.l, folded.l)))
        if own:
            rows_fold.diag_rows, rows_fold.diag_cols = folded.diag, folded.diag
        return [folded.col_m, folded.col_l]

    def ring_products(self, x, y_j, scale: float, pairing: Pairing, into_rows: torch.Tensor) -> torch.Tensor:
        p = pairing
        if self.w_in_memory or self.s_in_memory:  # one W for both products
            from distlab.streamed.kernels.coefficients import infonce_job

            kept = self._visit(x, y_j, start=False)
            rows, cols = self._mm(*self._operands(x, y_j), infonce_job(scale, p, 1.0, True), kept)[:2]
            into_rows += rows
            return cols
        into_rows += self.pair_product(x, y_j, scale, p)
        return self.pair_product(y_j, x, scale, Pairing(p.lse_k, p.lse_q, p.diag_coef, p.offset))

    def _visit(self, x, y_j, start: bool):
        """ "triton-s": the store of S kept between the ring's passes, told which visit comes (x against as many
        columns as y_j; `start`: pass 1's first visit, which drops what an earlier step kept); else None."""
        if self.kept is None:
            return None
        if start:
            self.kept.start()
        self.kept.key = self.kept.mark(x, len(y_j))
        return self.kept


TileOps = TorchTiles | TritonTiles
TRITON_PATHS = ("triton", "triton-mm", "triton-s")  # the KERNELS values that run Triton kernels


def as_tile_ops(tiles: TorchTiles | TritonTiles | int) -> TorchTiles | TritonTiles:
    """A TileOps as it is; an int T: the torch tiles of at most T x T in float32."""
    return TorchTiles(tiles) if isinstance(tiles, int) else tiles


def triton_ready() -> str | None:
    """None when the Triton kernels can run on CPU tensors here (under the interpreter), else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install -r requirements.txt)"
    from distlab.streamed.kernels.launch import interpreted
    from distlab.streamed.kernels.lse import lse_kernel

    if not interpreted(lse_kernel):
        return "on CPU tensors the kernels need Triton's interpreter: TRITON_INTERPRET=1 before they are imported"
    return None


def kernels_problem(kernels: str, device: torch.device) -> str | None:
    """Why KERNELS cannot run on `device` (None: it can), in words naming the key."""
    if kernels not in TRITON_PATHS:
        return None
    if importlib.util.find_spec("triton") is None:
        return f"config['KERNELS'] = {kernels!r}, but triton is not installed (pip install -r requirements.txt)"
    if device.type not in ("cuda", "meta") and (why := triton_ready()) is not None:  # meta: counted, not run
        need = f"runs Triton kernels, which need CUDA tensors (got {device.type})"
        return f"config['KERNELS'] = {kernels!r} {need}; {why}"
    return None


def tile_ops(
    kernels: str,
    precision: str,
    t: int,
    device: torch.device,
    dtype: torch.dtype,
    d: int | None = None,
    w_budget: int | None = None,
):
    """The tile work for embeddings of `dtype` and width d on `device`, as KERNELS and MATMUL_PRECISION say;
    "triton-mm" keeps at most w_budget bytes of W alive (W_MEMORY_MIB; None: `kernels.coefficients`' default).
    "auto" takes `auto_choice`'s answer."""
    if (problem := kernels_problem(kernels, device)) is not None:
        raise ValueError(problem)
    if kernels in TRITON_PATHS and device.type == "cuda" and dtype == torch.float64:
        raise ValueError(
            f"config['KERNELS'] = {kernels!r} with float64 embeddings on CUDA: Triton's tl.dot has no float64 on "
            "GPUs; use KERNELS 'auto' or 'torch' (float64 runs on the torch tiles)"
        )
    if kernels == "auto":
        kernels = auto_choice(device, d, dtype, precision)[0]
    if kernels == "torch":
        return TorchTiles(t, precision)
    in_memory = dict(w_in_memory=kernels == "triton-mm", s_in_memory=kernels == "triton-s")
    return TritonTiles(precision, w_budget=w_budget, **in_memory)


def auto_choice(device: torch.device, d: int | None, dtype: torch.dtype, precision: str) -> tuple[str, str]:
    """KERNELS "auto": which path it takes for these embeddings, and why in a sentence
    (`kernels.tuning.auto_kernels`; the torch tiles wherever triton is not installed); on CUDA said once in the
    log (logger distlab.streamed.kernels.tuning, INFO)."""
    if device.type != "cuda":
        return "torch", f"{device.type} tensors: the torch tiles (the kernels need CUDA)"
    if importlib.util.find_spec("triton") is None:
        return "torch", "triton is not installed: the torch tiles"
    from distlab.streamed.kernels.tuning import auto_kernels, say_once

    kernels, why = auto_kernels(device, d, dtype, precision)
    say_once(f"KERNELS 'auto' at d = {d}, {dtype}, MATMUL_PRECISION {precision!r}: {kernels!r}: {why}")
    return kernels, why
