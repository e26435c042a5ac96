"""Launch configurations by measurement (`distlab.streamed.kernels.tuning`), W's memory budget, the column
splits in whole waves of SMs, and the column product accumulated in place, all without a GPU:

- the search keeps the fastest candidate by an injected timer (no real timing in a test), skips one that fails,
  writes its winner to the cache atomically, and a second use reads it without searching; a card and d on
  record take the committed table and never search;
- on a CPU the cache is never read or written: real kernels run under the interpreter with the cache pointed at
  a temporary folder, which stays empty, and the cache's readers and writers are never called;
- KERNELS "auto" says which path it took and why, per card and d;
- W_MEMORY_MIB reaches the chunks of W (counted on the meta device: twice the budget, half the launches);
- on CUDA (taken on the meta device) the rows' product is written with `out=` and the columns' added with
  `addmm(..., out=)`: no n_k x d temporary.
"""

import kernel_helpers  # noqa: F401 - sets TRITON_INTERPRET=1 before the kernels are imported
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.streamed.config import parse_config
from distlab.streamed.kernel_choice import TritonTiles, auto_choice
from distlab.streamed.kernels import coefficients, tuning
from distlab.streamed.kernels.launch import Blocks, whole_waves
from distlab.streamed.rank_work import count_rank, one_rank

FAST, SLOW = Blocks(64, 64, 32, 4, 2), Blocks(128, 128, 64, 8, 3)
NAME = tuning.key("Some GPU", 768, torch.bfloat16, "bf16", "infonce-mm")


@pytest.fixture(autouse=True)
def fresh_memory():
    tuning._MEMORY.clear()
    yield
    tuning._MEMORY.clear()


class FakeTimer:
    """Times a call by the configuration it runs (the run records it): SLOW 2 s, FAST 1 s, anything else 3 s."""

    def __init__(self):
        self.ran, self.calls = [], 0

    def run(self, blocks):
        if blocks.m == 32:
            raise RuntimeError("out of shared memory")  # a configuration the card cannot launch
        self.ran.append(blocks)

    def __call__(self, call):
        self.calls += 1
        call()
        return {SLOW: 2.0, FAST: 1.0}.get(self.ran[-1], 3.0)


def test_the_search_keeps_the_fastest_and_skips_what_fails():
    timer = FakeTimer()
    best, timed = tuning.search([SLOW, Blocks(32, 32, 32, 1, 1), FAST, Blocks(128, 256, 64, 8, 3)], timer.run, timer)
    assert best == FAST and timer.calls == 4  # the failing one was tried
    assert isinstance(timed[1][1], str) and "shared memory" in timed[1][1]
    assert tuning.search([SLOW, Blocks(128, 256, 64, 8, 3)], timer.run, timer)[0] == SLOW  # can name another
    with pytest.raises(RuntimeError, match="no launch configuration ran"):
        tuning.search([Blocks(32, 32, 32, 1, 1)], timer.run, timer)


def test_first_use_searches_then_the_cache_answers(tmp_path):
    path, timer = tmp_path / "sub" / "tiles.json", FakeTimer()
    first = tuning.choose_on(NAME, "infonce-mm", SLOW, timer.run, timer, path)
    assert first.source == "search" and timer.calls == len(tuning.candidates("infonce-mm", SLOW))
    assert tuning.read_cache(path) == {NAME: first.blocks.__dict__} and list(path.parent.iterdir()) == [path]
    tuning._MEMORY.clear()  # a new process: the file answers, nothing is timed
    again = tuning.choose_on(NAME, "infonce-mm", SLOW, timer.run, timer, path)
    assert (again.source, again.blocks, timer.calls) == (
        "cache",
        first.blocks,
        len(tuning.candidates("infonce-mm", SLOW)),
    )
    other = tuning.key("Some GPU", 768, torch.bfloat16, "bf16", "fold")  # a second key joins the same file
    tuning.choose_on(other, "fold", FAST, timer.run, timer, path)
    assert set(tuning.read_cache(path)) == {NAME, other}
    path.write_text("{not json")  # a damaged cache is no cache: searched again, rewritten whole
    tuning._MEMORY.clear()
    assert tuning.choose_on(NAME, "infonce-mm", SLOW, timer.run, timer, path).source == "search"
    assert set(tuning.read_cache(path)) == {NAME}


def test_a_card_on_record_takes_the_committed_table(tmp_path):
    timer = FakeTimer()
    for d, kind, want in (
        (1024, "ring-fold", (128, 128, 64)),
        (1024, "infonce-mm", (128, 256, 64)),
        (900, "fold", (128, 256, 64)),
    ):
        name = tuning.key(tuning.H200, d, torch.bfloat16, "bf16", kind)
        choice = tuning.choose_on(name, kind, SLOW, timer.run, timer, tmp_path / "tiles.json")
        assert choice.source == "table" and (choice.blocks.m, choice.blocks.n, choice.blocks.d) == want
    h100 = tuning.key(tuning.H100, 1024, torch.bfloat16, "bf16", "infonce")  # the fused kernels on the H100
    assert tuning.choose_on(h100, "infonce", SLOW, timer.run, timer, tmp_path / "tiles.json").blocks.n == 256
    assert timer.calls == 0 and not (tmp_path / "tiles.json").exists()
    tf32 = tuning.key(tuning.H200, 1024, torch.float32, "tf32", "infonce-mm")  # not on record: searched
    assert tuning.choose_on(tf32, "infonce-mm", SLOW, timer.run, timer, tmp_path / "tiles.json").source == "search"


def test_on_a_cpu_the_cache_is_never_read_or_written(tmp_path, monkeypatch):
    cache = tmp_path / "never" / "tiles.json"
    monkeypatch.setenv(tuning.ENV, str(cache))
    assert tuning.cache_path() == cache

    def touched(*args, **kwargs):
        raise AssertionError("the tile cache was touched on a CPU")

    for name in ("read_cache", "write_cache", "search", "cuda_timer"):
        monkeypatch.setattr(tuning, name, touched)
    keys = {"GLOBAL_BATCH_SIZE": 24, "MICRO_BATCH_SIZE": 12, "TAU": 0.1, "MATMUL_PRECISION": "float32"}
    gen = torch.Generator().manual_seed(0)
    z_x, z_y = (torch.randn(24, 8, generator=gen) for _ in range(2))
    for exchange, loss in (("gather", "infonce"), ("ring", "infonce"), ("ring", "sigmoid")):
        cfg = parse_config(keys | {"EXCHANGE": exchange, "KERNELS": "triton-mm"}, 2, 0)
        for w_in_memory in (True, False):  # the folds, both GEMMs, and the fused products
            one_rank(cfg, z_x, z_y, loss, TritonTiles("float32", w_in_memory=w_in_memory))
    assert not cache.parent.exists()
    assert tuning.choose("fold", z_x, "float32", SLOW, lambda b: None).source == "default"
    with pytest.raises(AssertionError, match="touched"):  # the check can fail: off the CPU gate the cache is read
        tuning.choose_on(NAME, "fold", SLOW, lambda b: None, touched, cache)


def test_auto_says_which_path_it_took_and_why(monkeypatch, caplog):
    cuda = torch.device("cuda")
    assert auto_choice(torch.device("cpu"), 1024, torch.bfloat16, "bf16")[0] == "torch"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: tuning.H200)
    with caplog.at_level("INFO", logger=tuning.__name__):
        kernels, why = auto_choice(cuda, 512, torch.bfloat16, "bf16")
        auto_choice(cuda, 512, torch.bfloat16, "bf16")  # said once
    assert kernels == "triton-mm" and "NVIDIA H200's measured winner" in why
    assert [r.getMessage() for r in caplog.records].count(
        f"KERNELS 'auto' at d = 512, {torch.bfloat16}, MATMUL_PRECISION 'bf16': 'triton-mm': {why}"
    ) == 1
    assert auto_choice(cuda, 512, torch.float32, "float32")[0] == "torch"  # IEEE float32: cuBLAS
    assert auto_choice(cuda, 512, torch.float64, "bf16")[0] == "torch"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    kernels, why = auto_choice(cuda, 512, torch.bfloat16, "bf16")
    assert kernels == "triton-mm" and "not on record" in why


def test_column_splits_fill_whole_waves_of_sms():
    """At least two programs per SM and a last wave at least 90% full where a count within twice the least
    allows it; the rule it replaced (about two per SM: 5 splits of 64 row blocks on 132 SMs) is rejected."""

    def fill(row_blocks, splits, sms):
        programs = row_blocks * splits
        return programs / (sms * -(-programs // sms))

    for row_blocks, sms in ((64, 132), (512, 132), (16, 132), (64, 114), (8, 78), (33, 132)):
        splits = whole_waves(row_blocks, sms)
        assert row_blocks * splits >= 2 * sms or splits >= 1 and row_blocks >= 2 * sms
        assert fill(row_blocks, splits, sms) >= 0.9, (row_blocks, sms, splits)
    assert whole_waves(64, 132) == 6 and fill(64, 5, 132) < 0.9  # the earlier choice, 5, left a wave 42% full


def test_w_memory_budget_sets_the_chunks_of_w():
    """W_MEMORY_MIB: 4,096 rows of bf16 W at N = 65,536 by default (512 MiB), 8,192 at 1,024 MiB, never more
    than the budget even where a configuration asks for more rows; counted on the meta device."""
    keys = {"GLOBAL_BATCH_SIZE": 65536, "MICRO_BATCH_SIZE": 8192, "TAU": 0.07, "KERNELS": "triton-mm"}
    keys |= {"MATMUL_PRECISION": "bf16", "STREAM_CHUNK_SIZE": 1024}
    meta, big = torch.device("meta"), Blocks(128, 256, 64, 8, 3, w_rows=16384)
    assert coefficients.chunk_rows(8192, 65536, 2, big, meta, None) == 4096
    assert coefficients.chunk_rows(8192, 65536, 2, big, meta, 1024 * 2**20) == 8192
    assert coefficients.chunk_rows(8192, 65536, 2, Blocks(128, 256, 64, 8, 3), meta, 256 * 2**20) == 2048
    default, twice = (
        count_rank(parse_config(keys | extra, 8, 0), "infonce", 1024, torch.bfloat16)
        for extra in ({}, {"W_MEMORY_MIB": 1024})
    )
    assert default.by_name["coefficient_kernel"] == 2 * twice.by_name["coefficient_kernel"]
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="W_MEMORY_MIB"):
            parse_config(keys | {"W_MEMORY_MIB": bad}, 8, 0)


class Ops(TorchDispatchMode):
    """The aten ops that run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__) + "." + func._overloadname)
        return func(*args, **(kwargs or {}))


def test_the_column_product_is_accumulated_in_place():
    """The CUDA branch (taken on the meta device): W k straight into G's rows (mm with out_dtype and out=) and
    W^T q added into the columns' product in place (addmm with out=), one of each per chunk; no product
    materialised and then added (no add), which the `g_cols += product(...)` form it replaced would show."""
    q, k = (torch.empty(8192, 64, dtype=torch.bfloat16, device="meta") for _ in range(2))
    pairing = coefficients.Pairing(*(torch.empty(8192, device="meta") for _ in range(3)), 0)
    job = coefficients.infonce_job(10.0, pairing, 1.0, True)._replace(w_bytes=32 * 2**20)  # 2 chunks of 2,048
    with Ops() as ops:
        coefficients.run(q, k, job, "bf16", Blocks(128, 256, 64, 8, 3))
    chunks = 8192 * 8192 * 2 // (32 * 2**20)
    assert ops.names.count("mm.dtype_out") == chunks and ops.names.count("addmm.dtype_out") == chunks
    assert not [name for name in ops.names if name.startswith("add.") or name.startswith("add_.")]
    with Ops() as old:  # the form it replaced: a product made, then added
        g_cols = torch.zeros(8192, 64, device="meta")
        g_cols += torch.mm(
            torch.empty(8192, 2048, dtype=torch.bfloat16, device="meta"), q[:2048], out_dtype=torch.float32
        )
    assert any(name.startswith("add_") for name in old.names)
