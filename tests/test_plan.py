"""The planner, `python -m distlab.plan`: for a fixed input its output is the same every time; every
configuration it prints fits the memory it claims, by the cost model, on every rank, with the reserve; one
given layout is priced item by item; the published runs land in the band docs/planner.md states; bad input
is refused in one line naming the flag (exit 2), at parse time; an input nothing fits says by how much (exit 1)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
from helpers import ROOT

from distlab.cost.inputs import Batch
from distlab.cost.stacks import MEGATRON_DEEPSPEED_EFFICIENCY, STACKS
from distlab.cost.step import step_cost
from distlab.cost.timing import Assumptions, predict
from distlab.plan import report
from distlab.plan.cli import main
from distlab.plan.presets import MODELS
from distlab.plan.search import Choices, search
from distlab.processes.console import console
from distlab.proof.hardware import DEFAULT_RESERVE_GIB, DEVICES, GIB, cluster
from distlab.proof.sizes import Transformer

ARGS = ["--model", "llama3-8b", "--gpus", "16", "--nodes", "2", "--global-batch", "64", "--seq-len", "4096"]
BAND = (0.8, 1.25)  # predicted / reported throughput, every published run, fitted or held out (docs/planner.md)
LLAMA_BAND = (0.85, 1.15)  # Llama 3 405B's three rows of Table 4: the band issue 36 aims for


@functools.cache
def published() -> list[dict]:
    """The published runs as `--published` prices them, once for the tests that read them."""
    return report.published_rows()


def printed(argv: list[str]) -> tuple[int, str]:
    with console.capture() as captured:
        code = main(argv)
    return code, captured.get()


def test_every_printed_configuration_fits_the_memory_it_claims(tmp_path):
    """...and the same input gives the same plan: the command's and a second search's, row by row."""
    path = tmp_path / "plan.json"
    code, out = printed([*ARGS, "--json", str(path), "--plot", str(tmp_path / "plan.png")])
    assert "The 10 fastest of" in out and "matrix products at 80% of the dense peak" in out
    rows = json.loads(path.read_text())
    found = search(MODELS["llama3-8b"], Batch(64, 4096), 16, cluster("h100"))
    assert code == 0 and len(rows) == len(found) > 10 and (tmp_path / "plan.png").stat().st_size > 10_000
    steps = [c.time.step for c in found]
    assert steps == sorted(steps)  # fastest first
    reserve = DEFAULT_RESERVE_GIB * GIB
    for row, candidate in zip(rows, found):
        again = step_cost(candidate.cost.model, candidate.cost.batch, candidate.parallel, "bf16", "cuda")
        assert again.peak_held == candidate.memory <= DEVICES["h100"].memory - reserve  # every rank, not only one
        assert row["memory_gib"] == pytest.approx((candidate.memory + reserve) / GIB, rel=1e-12)
        assert row["layout"] == candidate.parallel.label() and row["fits"]


def test_the_published_runs_land_in_the_band():
    """Every published run, those its stack's profile was fitted on and those held out (MT-NLG at 2,800 and
    3,360 GPUs, BLOOM, torchtitan's), within 0.8-1.25 of its reported throughput; every Llama 3 405B row of
    Table 4 within 0.85-1.15; the two 16,384-GPU rows fit the H100; the 8,192-GPU row at M = 32 interleaved does
    not by the cost model (docs/planner.md says so)."""
    rows = published()
    assert len(rows) == 9 and sum(not row["fitted"] for row in rows) == 5
    for row in rows:
        assert BAND[0] <= row["ratio"] <= BAND[1], row
    llama = [row for row in rows if row["name"].startswith("Llama 3 405B")]
    assert len(llama) == 3 and all(LLAMA_BAND[0] <= row["ratio"] <= LLAMA_BAND[1] for row in llama), llama
    assert [row["fits"] for row in llama] == [False, True, True]


def test_the_published_band_can_fail():
    """The same runs under a wrong time model (every collective exposed, products at a third of the peak)
    leave the band: the check is not one any prediction passes."""
    wrong = report.published_rows(dict(matmul_efficiency=0.3, overlap=()))
    assert any(not LLAMA_BAND[0] <= row["ratio"] <= LLAMA_BAND[1] for row in wrong)
    assert all(row["ratio"] < BAND[0] for row in wrong if row["name"].startswith("MT-NLG"))


def test_the_megatron_deepspeed_profile_is_the_fit_to_mt_nlg_and_the_tuned_one_is_not():
    """Refit: the one figure of the megatron-deepspeed profile is where MT-NLG on 2,240 A100 predicts its 60.1 s
    (bisection); the tuned profile, fitted on Llama 3, prices that run 1.4x too fast: the stack matters."""
    from distlab.plan.presets import PUBLISHED

    run = next(r for r in PUBLISHED if r.fitted and r.stack == "megatron-deepspeed")
    cost = step_cost(MODELS[run.model], run.batch, run.parallel, "bf16", "cuda")
    lo, hi = 0.2, 0.9
    for _ in range(30):
        mid = (lo + hi) / 2
        fit = dict(matmul_efficiency=mid, attention_efficiency=mid)
        assumptions = Assumptions(**fit, attention_share=1.0)
        lo, hi = (mid, hi) if predict(cost, cluster("a100"), assumptions).step > run.reported_step_s else (lo, mid)
    assert mid == pytest.approx(MEGATRON_DEEPSPEED_EFFICIENCY, abs=1e-3)
    tuned = predict(cost, cluster("a100"), STACKS["megatron-lm"].assumptions).step
    assert run.reported_step_s / tuned > 1.3


def test_a_plan_outside_its_profile_s_regime_says_so():
    code, out = printed([*ARGS, "--layout", "dp=16"])
    flat = " ".join(out.split())
    assert "warning: outside the fitted regime: the megatron-lm profile was fitted on models of 405 B" in flat
    assert "405 B parameters, not 8.03 B" in flat
    code, out = printed([*ARGS, "--layout", "dp=16", "--stack", "megatron-deepspeed"])
    assert "warning: outside the fitted regime: the megatron-deepspeed profile was fitted on a100 runs" in out
    for stack, run in (("megatron-lm", "llama3-405b"), ("megatron-deepspeed", "mt-nlg-530b")):  # its own: inside
        gpu = STACKS[stack].gpus[0]
        assert STACKS[stack].outside(gpu, MODELS[run].parameters) is None  # 405.9 B and 529.6 B, as papers round


def test_the_datasheet_table_names_every_source():
    code, out = printed(["--devices"])
    flat = out.replace("\n", "")
    assert code == 0 and all(d.name in out for d in DEVICES.values())
    assert "resources.nvidia.com" in flat and "amd-instinct-mi300x-data-sheet" in flat


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--gpus", "12", "--nodes", "8"], "--nodes: 12 GPUs do not spread evenly over 8 nodes"),
        (["--gpus", "32", "--nodes", "2"], "--nodes: 16 GPUs per node"),
        (["--layers", "4", "--dim", "64"], "--heads: a model of your own needs --layers, --dim, --heads"),
        (["--layers", "4", "--dim", "64", "--heads", "6", "--ffn-width", "256"], "--heads: h = 6 does not divide"),
        (["--vocab", "1000"], "--vocab: belongs to a model of your own"),
        (["--layout", "dp=4,tp=4"], "--layout: dp x pp x tp x cp = 16 ranks, but --gpus 8"),
        (["--layout", "dp=8,xp=2"], "--layout: 'xp=2' is not one of dp=, pp=, tp=, cp=, ep="),
        (["--layout", "dp=8,ep=2"], "--layout: ep: expert parallelism needs a mixture-of-experts model"),
        (["--layout", "dp=8", "--micro-batch", "3"], "--micro-batch: N = 64 does not cut into dp = 8"),
        (["--layout", "dp=4,pp=2", "--stages-per-rank", "2"], "--stages-per-rank: 1F1B runs one stage per rank"),
        (["--overlap", "dp,xx"], "--overlap: 'xx' is not one of"),
        (
            ["--layers", "4", "--dim", "64", "--heads", "4", "--ffn-width", "256", "--dense-layers", "1"],
            "--dense-layers: ",
        ),
        (["--gpu", "a100", "--precision", "fp8"], "--precision: the A100 SXM 80GB has no fp8 rate"),
        (["--reserve-gib", "80"], "--reserve-gib: 80.0 GiB is all of the H100 SXM's memory"),
        (["--layout", ""], "--layout: '' is not one of dp=, pp=, tp=, cp=, ep="),
        (["--model", "gpt2-124m", "--layers", "12"], "--model: gpt2-124m is a preset, --layers a model of your own"),
        (["--layout", "tp=8", "--zero", "3"], "--zero: ZeRO-3 shards over the dp ranks; --layout gives dp = 1"),
        (["--stages-per-rank", "2"], "--stages-per-rank: 1F1B runs one stage per rank"),
    ],
)
def test_impossible_input_is_refused_naming_the_flag(argv, words):
    with pytest.raises(ValueError) as err:
        main(argv)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--gpus", "0"], "argument --gpus: expected a positive integer, got '0'"),
        (["--gpu", "v100"], "invalid choice"),
        (["--matmul-efficiency", "0"], "argument --matmul-efficiency: expected a share 0 < x <= 1, got '0'"),
        (["--link-efficiency", "0"], "argument --link-efficiency: expected a share 0 < x <= 1, got '0'"),
        (["--attention-efficiency", "1.5"], "argument --attention-efficiency: expected a share 0 < x <= 1"),
        (["--json", "/tmp"], "argument --json: '/tmp' is a directory; give a file name"),
        (["--json", "/no/such/dir/x.json"], "argument --json: the directory of '/no/such/dir/x.json'"),
        (["--plot", "/tmp"], "argument --plot: '/tmp' is a directory"),
        (["--plot", "x.txt"], "argument --plot: 'x.txt': the plot is a PNG; give a name ending in .png"),
        (["--seq-len", str(1 << 25)], "argument --seq-len: at most 16,777,216 (tokens per sequence"),
        (["--reserve-gib", "-1"], "argument --reserve-gib: expected a finite number >= 0"),
        (["--zero", "4"], "argument --zero: invalid choice"),
        (["--reserve-gib", "1e300"], "argument --reserve-gib: at most 1,024 (GiB kept off the tensors"),
        (["--inter-node-gbps", "0"], "argument --inter-node-gbps: expected a positive finite number"),
        (["--sp", "maybe"], "argument --sp: invalid choice"),
    ],
)
def test_a_bad_value_is_refused_by_the_parser_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(lines) == 1 and words in lines[0]


def test_the_command_prints_one_line_and_exits_2():
    """The whole path a user takes: `python -m distlab.plan` turns the ValueError into one line, exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "distlab.plan", "--gpus", "12", "--nodes", "8"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and lines == ["error: --nodes: 12 GPUs do not spread evenly over 8 nodes"]


def test_when_nothing_fits_it_says_by_how_much():
    code, out = printed(["--model", "llama3-405b", "--gpus", "2", "--global-batch", "8"])  # 2: few splits to try
    flat = " ".join(out.split())
    assert code == 1 and flat.startswith("llama3-405b: 405.9 B parameters")
    assert "nothing fits: the best layout needs" in flat and "GiB more than the H100 SXM holds (79.65 GiB)" in flat
    need = float(flat.split("needs ")[1].split(" GiB")[0])
    more = float(flat.split("the reserve), ")[1].split(" GiB more")[0])
    assert need - more == pytest.approx(79.65, abs=0.1)  # X - Y is what the device holds


def test_the_published_table_in_the_docs_is_what_the_planner_prints():
    """docs/planner.md's table holds the figures `--published` prints (predicted GiB, MFU, ratio), so the page
    cannot go stale behind the model."""
    lines = (ROOT / "docs" / "planner.md").read_text().splitlines()
    rows = published()
    names = {row["name"] for row in rows}
    table = {cells[1].strip(): cells[2:-1] for cells in (line.split("|") for line in lines if line.startswith("| "))}
    table = {name: cells for name, cells in table.items() if name in names}
    assert len(table) == len(rows) == 9
    for row in rows:
        cells = table[row["name"]]
        gib, _, predicted, reported, ratio = (c.strip() for c in cells[1:])
        assert gib == f"{row['memory_gib']:.1f}" and ratio == f"{row['ratio']:.2f}", (row["name"], cells)
        assert predicted == row["predicted"] and reported == row["reported"]


def test_a_mixture_of_experts_is_searched_with_expert_parallelism():
    from distlab.proof.sizes import Transformer

    model = Transformer(8, 1024, 8, 4096, 32000, gated=True, bias=False, rms_norm=True, experts=8, top_k=2,
                        expert_ffn=2048)  # fmt: skip
    found = search(model, Batch(32, 4096), 16, cluster("h100"))
    assert found and max(c.parallel.ep for c in found) > 1
    assert all(c.memory <= DEVICES["h100"].memory - DEFAULT_RESERVE_GIB * GIB for c in found)
    assert all(c.cost.ranks[0].traffic.sent["ep", "all_to_all"] > 0 for c in found if c.parallel.ep > 1)


def test_the_planner_takes_no_lesson_memory_limit():
    """GPT-2 small's vocabulary (50,304) is above the lessons' --vocab limit (a width^2 float64 matrix a lesson
    would build); the planner builds no tensor, so its parser is `FlagParser` with the planner's own limits
    (`distlab.plan.flags.LIMITS`), not the lessons'."""
    from distlab.plan.cli import parse_args
    from distlab.plan.flags import LIMITS as PLAN_LIMITS
    from distlab.proof.cli import LIMITS

    flags = ["--layers", "12", "--dim", "768", "--heads", "12", "--ffn-width", "3072", "--vocab", "50304"]
    assert 50304 > LIMITS["--vocab"][0]  # a lesson would refuse it
    assert 50304 <= PLAN_LIMITS["--vocab"][0]  # the planner's typo guard takes it
    args = parse_args([*flags, "--gpu", "a100", "--gpus", "8", "--global-batch", "480", "--seq-len", "1024"])
    assert args.vocab == 50304 and args.global_batch == 480


SMALL = Transformer(4, 512, 8, 2048, 32000, gated=True, bias=False, rms_norm=True)  # a quick search: 8 GPUs


@functools.cache
def small_search(choices: Choices | None = None) -> list:
    return search(SMALL, Batch(16, 1024), 8, cluster("h100"), choices or Choices())


@pytest.mark.parametrize(
    "fixed, holds",
    [
        (dict(zero="ZeRO-3"), lambda c: c.parallel.zero == "ZeRO-3" and c.parallel.dp > 1),
        (dict(zero="DDP"), lambda c: c.parallel.zero == "DDP"),
        (dict(recompute="full"), lambda c: c.parallel.recompute),
        (dict(recompute="selective"), lambda c: c.parallel.selective and not c.parallel.recompute),
        (dict(micro_batch=2), lambda c: c.cost.batch.micro_batches * 2 * c.parallel.dp == 16),
        (dict(schedule="zb-h1"), lambda c: c.parallel.pp == 1 or c.parallel.schedule == "zb-h1"),
        (dict(schedule="interleaved-1f1b", stages_per_rank=2), lambda c: c.parallel.stages_per_rank == 2),
        (dict(grad_bytes=4), lambda c: c.parallel.grad_bytes == 4),
        (dict(sp=False), lambda c: not c.parallel.sp),
    ],
)
def test_every_strategy_flag_narrows_the_search(fixed, holds):
    """What the user fixes, the search keeps: every configuration found has it (none is silently dropped), and
    the plain search finds some that do not (the flag changed the search)."""
    narrowed = small_search(Choices(**fixed))
    assert narrowed and all(holds(c) for c in narrowed), fixed
    assert not all(holds(c) for c in small_search()), fixed


def test_the_flags_reach_the_search_and_the_network_bandwidth_the_links(tmp_path):
    """The command line's strategy flags arrive as the search's `Choices`; --inter-node-gbps sets the network
    link; TFLOP/s a GPU is the model's FLOPs over time and GPUs, printed and in --json; an efficiency of one is
    allowed."""
    path = tmp_path / "plan.json"
    argv = [*ARGS, "--zero", "2", "--recompute", "full", "--top", "2", "--json", str(path)]
    code, out = printed([*argv, "--inter-node-gbps", "200", "--matmul-efficiency", "1", "--link-efficiency", "1"])
    rows = json.loads(path.read_text())
    assert code == 0 and all("ZeRO-2" in r["layout"] and "recompute" in r["layout"] for r in rows)
    assert "matrix products at 100% of the dense peak" in out  # an efficiency of one is allowed
    assert "200G across nodes" in out and "TF/GPU" in out
    for row in rows:
        assert row["tflops_per_gpu"] == pytest.approx(row["mfu"] * DEVICES["h100"].peak["bf16"] / 1e12, rel=1e-9)
    assert cluster("h100", 8, 200).inter.bandwidth == 25e9 and cluster("h100").inter.bandwidth == 50e9
