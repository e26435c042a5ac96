"""Who does the tile work, how precisely, in what tiles, and how many launches it takes.

- Launches per step, counted on the meta device (count, don't compute) at one rank's shape of P = 8,
  d = 1,024: the Triton path's are the same at N = 4,096 and N = 65,536; the torch tiles' grow with N / T;
  "triton-mm"'s with the chunks of W its memory budget cuts.
- MATMUL_PRECISION is the step's, never an ambient flag: under a caller's allow_tf32 = True and
  set_float32_matmul_precision("medium") (cuBLAS in TF32, this CPU's oneDNN in bf16), every matmul of a
  "float32" step runs in IEEE float32, gives the same bits as without them, and the caller's settings are
  back afterwards.
- The config keys: a bad KERNELS or MATMUL_PRECISION is named; "triton" on CPU tensors without the
  interpreter is refused naming the key.
- T left out: rows up to C, columns from the budget; a launch-heavy T on CUDA is warned about once, from a
  constant of launches per tile that the step, counted again here, holds it to.
"""

import os
import subprocess
import sys
import warnings

import pytest  # noqa: E402
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.streamed import chunk_size, kernel_choice
from distlab.streamed.config import parse_config
from distlab.streamed.kernel_choice import tile_ops
from distlab.streamed.precision import BACKENDS, matmul_settings
from distlab.streamed.rank_work import count_rank, one_rank


def config(n, exchange="gather", kernels="triton", t=1024, **extra):
    keys = {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": n // 8, "TAU": 0.07, "EXCHANGE": exchange, "KERNELS": kernels}
    return parse_config(keys | ({"STREAM_CHUNK_SIZE": t} if t else {}) | extra, 8, 0)


@pytest.mark.parametrize("exchange", ["gather", "ring"])
@pytest.mark.parametrize("loss", ["infonce", "sigmoid"])
def test_fused_launches_per_step_do_not_grow_with_n(loss, exchange):
    small, large = (count_rank(config(n, exchange), loss, 1024, torch.bfloat16) for n in (4096, 65536))
    assert small.launches == large.launches, (small.by_name, large.by_name)
    assert large.moved_bytes > small.moved_bytes  # the embeddings themselves grow with N
    torch_small, torch_large = (
        count_rank(config(n, exchange, "torch", 256), loss, 1, torch.float32) for n in (4096, 8192)
    )
    assert torch_large.launches > 1.5 * torch_small.launches  # the check can fail: the torch tiles' count grows


@pytest.mark.parametrize("loss", ["infonce", "sigmoid"])
def test_w_in_memory_launches_grow_with_the_chunks_of_w_only(loss):
    """KERNELS "triton-mm": where the fused path launches one product kernel, one coefficient kernel (and a
    matmul) per chunk of W of at most W_BUDGET bytes: 2 chunks of a bf16 C x N at N = 65,536, P = 8; one at
    N = 4,096."""
    from distlab.streamed.kernels.coefficients import W_BUDGET

    runs = ((65536, "triton"), (4096, "triton-mm"), (65536, "triton-mm"))
    bf16 = {"MATMUL_PRECISION": "bf16"}  # W in bf16: 2 bytes an element
    fused, small, large = (count_rank(config(n, kernels=k, **bf16), loss, 1024, torch.bfloat16) for n, k in runs)
    products = fused.by_name["product_kernel"]
    assert "product_kernel" not in large.by_name and large.by_name["coefficient_kernel"] > products
    c, n = 65536 // 8, 65536
    chunks = -(-c * n * 2 // W_BUDGET)  # bf16 W: each product's C x N in chunks of W_BUDGET
    assert large.by_name["coefficient_kernel"] == products * chunks
    assert small.by_name["coefficient_kernel"] == products


class MatmulSettings(TorchDispatchMode):
    """Records torch's float32 matmul settings at every matrix product that runs inside it."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[1] in ("mm", "addmm", "bmm", "matmul"):
            self.seen.add(matmul_settings())
        return func(*args, **(kwargs or {}))


def test_an_ambient_tf32_flag_does_not_change_a_float32_step():
    cfg = config(64, kernels="torch", t=16)
    gen = torch.Generator().manual_seed(0)
    z_x, z_y = (torch.randn(64, 20, generator=gen) for _ in range(2))
    ops = tile_ops("torch", "float32", 16, z_x.device, torch.float32)
    plain = one_rank(cfg, z_x, z_y, "infonce", ops)
    before = matmul_settings()
    try:
        torch.set_float32_matmul_precision("medium")  # oneDNN (this CPU's matmuls) in bf16
        torch.backends.cuda.matmul.allow_tf32 = True  # open_clip's training entry point does this on GPUs
        ambient_settings = matmul_settings()
        with MatmulSettings() as settings:
            ambient = one_rank(cfg, z_x, z_y, "infonce", ops)
        assert settings.seen == {("ieee", "ieee")} and ambient_settings == ("tf32", "bf16")
        assert matmul_settings() == ambient_settings  # the caller's, given back
        with MatmulSettings() as unpinned:  # without the pin the tiles would have run under the caller's flags
            torch.mm(z_x, z_y.T)
        assert unpinned.seen == {("tf32", "bf16")}
    finally:
        for backend, value in zip(BACKENDS, before):
            backend.fp32_precision = value
    assert all(torch.equal(a, b) for a, b in zip(plain, ambient))


def test_the_new_keys_are_checked():
    for bad, match in (({"KERNELS": "cuda"}, "KERNELS"), ({"MATMUL_PRECISION": "fp16"}, "MATMUL_PRECISION")):
        with pytest.raises(ValueError, match=match):
            config(64, **bad)
    assert config(64, t=None).t is None  # STREAM_CHUNK_SIZE is optional
    for kernels in ("triton", "triton-mm"):
        with pytest.raises(ValueError, match=f"'{kernels}' with float64"):  # no float64 tl.dot on GPUs: refused
            tile_ops(kernels, "float32", 8, torch.device("cuda"), torch.float64)
    assert tile_ops("triton-mm", "bf16", 8, torch.device("cuda"), torch.float32).name == "triton-mm"
    assert tile_ops("auto", "float32", 8, torch.device("cuda"), torch.float64).name == "torch"
    assert tile_ops("auto", "bf16", 8, torch.device("cuda"), torch.float32).name == "triton-mm"  # W in memory
    assert tile_ops("auto", "tf32", 8, torch.device("cuda"), torch.float32).name == "triton-mm"
    assert tile_ops("auto", "float32", 8, torch.device("cuda"), torch.float32).name == "torch"  # IEEE: cuBLAS
    assert tile_ops("auto", "bf16", 8, torch.device("cpu"), torch.float32).name == "torch"
    code = (
        "import torch; from distlab.streamed.kernel_choice import tile_ops\n"
        "for kernels in ('triton', 'triton-mm'):\n"
        "    try:\n        tile_ops(kernels, 'float32', 8, torch.device('cpu'), torch.float32)\n"
        "    except ValueError as err:\n        print(err)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    for kernels in ("triton", "triton-mm"):
        assert f"config['KERNELS'] = '{kernels}' runs" in said and "TRITON_INTERPRET=1" in said, said


def test_default_tiles_rows_up_to_c_columns_from_the_budget():
    two_gib = 2 * 2**30
    t = chunk_size.default_chunk(8192, 65536, two_gib, 4)  # an H100's budget, one rank of P = 8
    assert t >= 8192 and t % 64 == 0 and 8192 * t * 4 * chunk_size.ALIVE <= two_gib
    assert 8192 * (t + 64) * 4 * chunk_size.ALIVE > two_gib  # the largest that fits
    square = chunk_size.default_chunk(65536, 65536, two_gib, 4)  # P = 1: C x C does not fit, square tiles
    assert square < 65536 and square * square * 4 * chunk_size.ALIVE <= two_gib
    assert chunk_size.default_chunk(12, 24, chunk_size.CPU_BUDGET, 8) == 24  # small C: the whole batch at once


def test_a_launch_heavy_t_on_cuda_is_warned_about_once(monkeypatch):
    monkeypatch.setattr(chunk_size, "budget_bytes", lambda device: 2 * 2**30)
    monkeypatch.setattr(chunk_size, "_warned", set())
    cfg, cuda = config(65536, kernels="torch", t=128), torch.device("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chunk_size.warn_if_many_launches(cfg, 128, cuda, torch.float32)
        chunk_size.warn_if_many_launches(cfg, 128, cuda, torch.float32)
        chunk_size.warn_if_many_launches(cfg, 21824, cuda, torch.float32)  # the default: few launches
    assert len(caught) == 1 and "T = 128" in str(caught[0].message) and "T = 21824" in str(caught[0].message)


@pytest.mark.parametrize("exchange", ["gather", "ring"])
def test_the_warning_s_launches_per_tile_are_the_counted_ones(exchange, monkeypatch):
    """`chunk_size.LAUNCHES_PER_TILE` is a constant, so the warning imports nothing of the step it warns about;
    here one rank's torch-tile step is counted on the meta device at the shape it names, and it must be what
    that step launches per tile. Shown able to fail: torch tiles that launch one op more count differently."""
    cfg = parse_config(chunk_size.COUNTED_AT | {"EXCHANGE": exchange}, chunk_size.COUNTED_WORLD, 0)

    def counted() -> tuple[int, int]:
        return count_rank(cfg, "infonce", 1, torch.float32).launches, chunk_size.tiles_per_step(cfg, cfg.t)

    launches, tiles = counted()
    assert launches / tiles == chunk_size.LAUNCHES_PER_TILE[exchange], (
        f"the torch tiles now launch {launches} kernels over {tiles} tiles: set chunk_size.LAUNCHES_PER_TILE"
        f"[{exchange!r}] to {launches} / {tiles}"
    )
    for name in ("streamed_softmax_pair_product", "ring_product_tiles"):  # the wrong twin: one op more a product
        product = getattr(kernel_choice, name)
        monkeypatch.setattr(kernel_choice, name, lambda *args, product=product: product(*args).clone())
    twin, _ = counted()
    assert twin > launches and twin / tiles != chunk_size.LAUNCHES_PER_TILE[exchange]
