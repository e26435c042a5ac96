"""Lesson 15: MXFP8 and FP8 under sharding. Blocks of 32 values sharing a power-of-two scale (MX), outliers
under three granularities of scale, and sharded weights gathered in 8 bits with one global scale.

    torchrun --nproc-per-node 4 lessons/15_mxfp8_sharding.py     # any P; the weight is cut into P shards

MX (OCP Microscaling Formats v1.0, https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-
final-pdf): a row is cut into blocks of 32 along the inner dimension n; each block gets its own scale, a power
of two stored in 8 bits (e8m0: an exponent, no mantissa, bias 127), and its values are cast to e4m3. The scale
of a block (NVIDIA's and torchao's RCEIL rule) is the smallest power of two 2^x with amax / 2^x <= max_f:

    x = ceil(log2(amax / max_f)),   T_q = cast_e4m3(clamp(T / 2^x, -max_f, max_f)),   T ~ T_q 2^x

Dividing by a power of two is exact, so the only rounding is the cast; an outlier spoils the range of its own
32 values, not of its row (rowwise scale) or of the whole tensor (tensorwise, lesson 14).

Under ZeRO-3 / FSDP (lesson 07) every rank holds Psi_P = ceil(Psi / P) elements of the flat weight and gathers
the rest before each use. Gathering it in FP8 instead of bf16 halves the bytes, but a tensorwise scale must be
the whole weight's, or rank r's cast differs from the cast one process would make: so the ranks agree on
amax first (each sends its local amax, every rank takes the max), then cast their shard with the global
scale rho = max_f / amax and all-gather the bytes. The result equals one process casting the whole weight,
bit for bit; each rank sends (P-1) Psi_P bytes plus (P-1) x 4 bytes of amax, against (P-1) 2 Psi_P in bf16.

Proven: MX by hand equals torchao's MXFP8Linear (emulated kernels: dequantize, then a float32 matmul) bit for
bit, forward and both gradients; the FP8 gather equals one process's cast and torchao's FSDP2 float8
pre-all-gather cast of each shard. torchao's FSDP2 float8 all-gather itself does not run on the CPU: gloo has no
float8 all-gather ("Invalid scalar type"); this lesson gathers the same bytes viewed as uint8.
"""

from __future__ import annotations

import copy
import logging
import math

import torch
import torch.distributed as dist

from distlab.comm.watch import CollectiveWatch
from distlab.processes.console import print0, rows_table
from distlab.processes.flags import check_flags_against_world, positive_float, positive_int, require
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import lesson_parser
from distlab.proof.compare import all_ok, compare, comparison_table
from distlab.proof.verdict import Verdict

# torchao is imported where it is compared (parts 3 and 5): the mechanism needs only torch, and its import
# warns of CUDA kernels a CPU cannot load, so those loggers are quietened first.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

E4M3 = torch.float8_e4m3fn
MAX_F = torch.finfo(E4M3).max  # 448
BIAS = 127  # e8m0's exponent bias: the byte 127 is 2^0
EPS = 1e-12  # amax floor (torchao's)
TORCHAO_BLOCK = 32  # MXFP8Linear's block, fixed

# ---- MX by hand: blocks of 32, a power-of-two scale each -------------------------------------------------


def check_block(width: int, block: int, flag: str = "--block") -> None:
    """MX cuts each row into whole blocks: one line naming the flag when the width does not divide."""
    require(width % block == 0, flag, f"a block of {block} must divide the width {width} of every cast row")


def mx_cast(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T_q in e4m3, the e8m0 exponents as bytes, one per block of `block` along the last dimension)."""
    check_block(t.shape[-1], block)
    blocks = t.float().reshape(*t.shape[:-1], t.shape[-1] // block, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    x = torch.ceil(torch.log2(amax / MAX_F)).clamp(-BIAS, BIAS)  # amax = 0: -inf, clamped to 2^-127
    biased = (x + BIAS).to(torch.uint8)
    inverse = torch.where(biased == 0, 1.0, torch.exp2(BIAS - biased.float()))  # 2^-x; a zero block stays 0
    return (blocks * inverse).clamp(-MAX_F, MAX_F).to(E4M3).reshape(t.shape), biased


def mx_dequantize(t_q: torch.Tensor, biased: torch.Tensor, block: int) -> torch.Tensor:
    """T_q 2^x, exactly (a power of two times an e4m3 number is a float32 number)."""
    blocks = t_q.float().reshape(*t_q.shape[:-1], t_q.shape[-1] // block, block)
    return (blocks * torch.exp2(biased.float() - BIAS)).reshape(t_q.shape)


def mx_matmul(a: torch.Tensor, b: torch.Tensor, block: int) -> torch.Tensor:
    """a @ b with both operands in MX (blocks along the inner dimension n: a's rows, b's columns), emulated as
    torchao does without an MX kernel: dequantize, then one float32 matmul."""
    a_hp = mx_dequantize(*mx_cast(a, block), block)
    bt_hp = mx_dequantize(*mx_cast(b.t().contiguous(), block), block)
    return a_hp @ bt_hp.t()


class MXLinear(torch.autograd.Function):
    """Y = X W^T, dX = dY W, dW = dY^T X, every operand in MX e4m3 (MXFP8's recipe: gradients in e4m3 too,
    their blocks running along each matmul's own inner dimension)."""

    @staticmethod
    def forward(ctx, x, weight, block):
        ctx.save_for_backward(x, weight)
        ctx.block = block
        return mx_matmul(x, weight.t(), block)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        return mx_matmul(dy, weight, ctx.block), mx_matmul(dy.t().contiguous(), x, ctx.block), None


# ---- FP8 all-gather of sharded weights -------------------------------------------------------------------


def shard_of(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Lesson 07's ZeRO-3 shard: the flat weight padded with zeros to P Psi_P, rank r's Psi_P of it."""
    psi_p = math.ceil(flat.numel() / world)
    padded = torch.cat([flat, flat.new_zeros(world * psi_p - flat.numel())])
    return padded[rank * psi_p : (rank + 1) * psi_p]


def fp8_all_gather(shard: torch.Tensor, fmt: torch.dtype, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole flat weight in fmt, padded to P Psi_P; rho): amax agreed first, so every rank casts with
    the global scale; then the 8-bit shards all-gathered, as bytes (gloo has no float8 all-gather)."""
    world = dist.get_world_size(group)
    amaxes = shard.new_empty(world)
    dist.all_gather_single(amaxes, shard.abs().max().reshape(1).float(), group=group)
    rho = (torch.finfo(fmt).max / amaxes.max().double().clamp(min=EPS)).float()  # lesson 14's scale_of
    top = torch.finfo(fmt).max
    mine = (shard.float() * rho).clamp(-top, top).to(fmt)
    whole = torch.empty(world * shard.numel(), dtype=torch.uint8, device=shard.device)
    dist.all_gather_single(whole, mine.view(torch.uint8), group=group)
    return whole.view(fmt), rho


def gather_bytes(psi_p: int, world: int, itemsize: int, scale_bytes: int) -> int:
    """What one rank sends: (P-1) Psi_P elements of the gathered shards, and (P-1) scales of the agreement."""
    return (world - 1) * (psi_p * itemsize + scale_bytes)


# ---- the chapter, part by part ---------------------------------------------------------------------------


def show_mx_cast(args) -> None:
    print0("\n[bold]1. One row in MX blocks: a power-of-two scale per block of 32[/]")
    gen = torch.Generator().manual_seed(args.seed)
    row = torch.randn(1, 2 * args.block, generator=gen)
    row[0, 3] = 900.0  # an outlier in the first block
    t_q, biased = mx_cast(row, args.block)
    back = mx_dequantize(t_q, biased, args.block)
    rows = []
    for k in range(2):
        part = slice(k * args.block, (k + 1) * args.block)
        amax = row[0, part].abs().max().item()
        err = ((back[0, part] - row[0, part]).abs().max() / row[0, part].abs().max()).item()
        rows.append(
            (str(k), f"{amax:.4g}", f"{int(biased[0, k, 0])}", f"2^{int(biased[0, k, 0]) - BIAS}", f"{err:.2e}")
        )
    print0(rows_table("", ("block", "amax", "e8m0 byte", "scale 2^x", "max rel. error"), rows))


def outlier_errors(t: torch.Tensor, ordinary: torch.Tensor, block: int) -> dict[str, tuple[float, float]]:
    """Per scaling: the relative error ||T_hat - T|| / ||T|| over the ordinary values (the outliers
    themselves come through at e4m3's u in every scheme), and the fraction of them flushed to 0."""
    from_scale = {
        "tensorwise": lambda: _fp8_roundtrip(t, t.abs().max()),
        "rowwise": lambda: _fp8_roundtrip(t, t.abs().amax(dim=-1, keepdim=True)),
        f"MX, blocks of {block}": lambda: mx_dequantize(*mx_cast(t, block), block),
    }
    out = {}
    for name, make in from_scale.items():
        back, mine = make()[ordinary], t[ordinary]
        out[name] = ((back - mine).norm() / mine.norm()).item(), ((back == 0) & (mine != 0)).float().mean().item()
    return out


def _fp8_roundtrip(t: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    rho = (MAX_F / amax.double().clamp(min=EPS)).float()
    return (t * rho).clamp(-MAX_F, MAX_F).to(E4M3).float() / rho


def show_outliers(args, verdict: Verdict) -> dict:
    print0("\n[bold]2. Outliers under tensorwise, rowwise and block scaling (e4m3)[/]")
    gen = torch.Generator().manual_seed(args.seed + 1)
    base = torch.randn(args.rows, args.width, generator=gen)
    in_channels, in_tokens = torch.zeros_like(base, dtype=torch.bool), torch.zeros_like(base, dtype=torch.bool)
    in_channels[:, :3] = True  # three outlier channels, side by side (LLM.int8()'s observation): every row has them
    in_tokens[:3] = True  # three outlier rows (tokens)
    table, rows = {}, []
    for case, where in (("outlier channels", in_channels), ("outlier tokens", in_tokens)):
        t = torch.where(where, base * args.outlier, base)
        table[case] = outlier_errors(t, ~where, args.block)
        rows += [(case, name, f"{e:.2e}", f"{z:.1%}") for name, (e, z) in table[case].items()]
    print0(f"{args.rows} x {args.width}, outliers {args.outlier:g} times larger", highlight=False)
    print0(rows_table("", ("input", "scaling", "error, others", "others flushed to 0"), rows))
    mx = f"MX, blocks of {args.block}"
    chan, tok = table["outlier channels"], table["outlier tokens"]  # (error, flushed) per scaling
    verdict.check(
        "outlier channels: MX flushes fewer other values than rowwise, rowwise fewer than tensorwise",
        chan[mx][1] < chan["rowwise"][1] < chan["tensorwise"][1],
    )
    verdict.check(
        "outlier tokens: rowwise and MX flush none of the other rows' values, tensorwise does",
        tok["rowwise"][1] == tok[mx][1] == 0 < tok["tensorwise"][1],
    )
    print0(
        "e4m3 spans about 15 binades (2^-9 .. 448): outliers 1,000 times larger still leave the others in range; "
        "at 10^4 a shared scale pushes them under 2^-9. A block's scale is shared by 32 values only.",
        highlight=False,
    )
    return table


def show_mx_equal_to_torchao(args, verdict: Verdict) -> None:
    print0("\n[bold]3. MX by hand against torchao's MXFP8Linear (emulated kernels), bit for bit[/]")
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    gen = torch.Generator().manual_seed(args.seed + 2)
    x = torch.randn(args.rows, args.width, generator=gen)
    weight = torch.randn(args.out_width, args.width, generator=gen) / args.width**0.5
    dy = torch.randn(args.rows, args.out_width, generator=gen)
    theirs = MXFP8Linear(args.width, args.out_width, bias=False, kernel_preference=KernelPreference.EMULATED)
    theirs.weight.data.copy_(weight)
    xt, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    w_ours = weight.clone().requires_grad_()
    y_theirs, y_ours = theirs(xt), MXLinear.apply(xo, w_ours, TORCHAO_BLOCK)
    y_theirs.backward(dy)
    y_ours.backward(dy)
    ref = {"Y": y_theirs.detach(), "dX": xt.grad, "dW": theirs.weight.grad}
    rows = compare(ref, {"Y": y_ours.detach(), "dX": xo.grad, "dW": w_ours.grad}, rtol=0.0, atol=0.0)
    print0(comparison_table(rows, f"X {args.rows} x {args.width}, W {args.out_width} x {args.width}, float32"))
    verdict.check("MX by hand = torchao MXFP8Linear (emulated): Y, dX, dW bit for bit", all_ok(rows))


def show_fp8_gather(rt: Runtime, args, verdict: Verdict) -> dict:
    print0("\n[bold]4. Sharded weights gathered in FP8 with the global amax[/]")
    gen = torch.Generator().manual_seed(args.seed + 3)
    weight = torch.randn(args.out_width, args.width, generator=gen) / args.width**0.5
    flat = weight.flatten()
    psi_p = math.ceil(flat.numel() / rt.world_size)
    flat[-psi_p:] *= 4.0  # the largest values lie on the last rank's shard only
    with CollectiveWatch({"world": dist.group.WORLD}) as watch:
        gathered, rho = fp8_all_gather(shard_of(flat, rt.rank, rt.world_size).to(rt.device), E4M3)
    one = _cast_whole(flat)  # one process casting the whole weight
    same = torch.equal(gathered[: flat.numel()].cpu().view(torch.uint8), one.view(torch.uint8))
    verdict.check("FP8 all-gather with the amax agreed first = one process casting the whole weight, bit for bit", same)
    local = _cast_whole(shard_of(flat, rt.rank, rt.world_size))  # the mistake: the shard's own amax
    sent = watch.ledgers["world"].sent
    formula = gather_bytes(psi_p, rt.world_size, 1, 4)
    verdict.check("bytes sent = (P-1) (Psi_P x 1 byte + 4 bytes of amax)", sent == formula)
    bf16 = gather_bytes(psi_p, rt.world_size, 2, 0)
    rows = [("FP8 + amax (counted)", f"{sent:,}"), ("formula", f"{formula:,}"), ("bf16 (formula)", f"{bf16:,}")]
    print0(f"Psi = {flat.numel():,} elements, Psi_P = {psi_p:,}, P = {rt.world_size}", highlight=False)
    print0(rows_table("", ("bytes each rank sends", "bytes"), rows))
    differs = not torch.equal(local.view(torch.uint8), one.view(torch.uint8)[_rows_of(rt, psi_p, flat.numel())])
    print0(f"Each rank casting with its own shard's amax instead: differs from one process: {differs}", highlight=False)
    return {"sent": sent, "formula": formula, "bf16": bf16, "psi_p": psi_p, "rho": rho.item()}


def _cast_whole(t: torch.Tensor) -> torch.Tensor:
    rho = (MAX_F / t.abs().max().double().clamp(min=EPS)).float()
    return (t.float() * rho).clamp(-MAX_F, MAX_F).to(E4M3)


def _rows_of(rt: Runtime, psi_p: int, psi: int) -> slice:
    return slice(rt.rank * psi_p, min((rt.rank + 1) * psi_p, psi))


def show_torchao_fsdp(rt: Runtime, args, verdict: Verdict) -> None:
    print0("\n[bold]5. torchao's FSDP2 float8 all-gather: its cast of each shard[/]")
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    gen = torch.Generator().manual_seed(args.seed + 4)
    plain = torch.nn.Sequential(torch.nn.Linear(args.width, args.out_width, bias=False))
    plain[0].weight.data.copy_(torch.randn(args.out_width, args.width, generator=gen))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    model = fully_shard(convert_to_float8_training(copy.deepcopy(plain), config=config))
    param = model[0].weight  # a DTensor of rows: FSDP2 shards dim 0
    (theirs,), (scale,) = param._local_tensor.fsdp_pre_all_gather(param.device_mesh)
    ours = _cast_whole(plain[0].weight.detach())  # the global cast, rows of this rank
    rows_here = param.to_local().shape[0]
    start = rt.rank * math.ceil(args.out_width / rt.world_size)
    same = torch.equal(theirs.view(torch.uint8), ours[start : start + rows_here].view(torch.uint8))
    verdict.check("torchao's FSDP2 float8 pre-all-gather cast = our global-amax cast of the shard", same)
    print0(
        'Its all-gather itself needs a float8 collective, which gloo lacks ("Invalid scalar type"): on the CPU '
        "the lesson proves the cast it would gather, and gathers the same bytes as uint8 (part 4).",
        highlight=False,
    )


def parse_args():
    parser = lesson_parser(__doc__)
    parser.add_argument("--rows", type=positive_int, default=64, help="rows of X (a multiple of --block)")
    parser.add_argument("--width", type=positive_int, default=128, help="input width (a multiple of --block)")
    parser.add_argument("--out-width", type=positive_int, default=64, help="output width (a multiple of --block)")
    parser.add_argument("--block", type=positive_int, default=TORCHAO_BLOCK, help="MX block size (32 in the MX spec)")
    parser.add_argument("--outlier", type=positive_float, default=1e4, help="how much larger the outliers are")
    return parser.parse_args()


def world_rules(args, world: int) -> None:
    """Each width a whole number of blocks; the error names the flag the user changed (--block, unless it is
    at its default) and the other one with its value."""
    for flag in ("--width", "--rows", "--out-width"):
        width = getattr(args, flag[2:].replace("-", "_"))
        at_fault = "--block" if args.block != TORCHAO_BLOCK else flag
        require(width % args.block == 0, at_fault, f"a block of {args.block} must divide {flag} = {width}")


def main() -> int:
    args = check_flags_against_world(parse_args(), world_rules)
    with distributed(args.device) as rt:
        verdict = Verdict(rt)
        print0(f"[bold]Lesson 15: MXFP8 and FP8 under sharding[/] - P = {rt.world_size}, e4m3, blocks of {args.block}")
        show_mx_cast(args)
        verdict.figure("outliers", show_outliers(args, verdict))
        show_mx_equal_to_torchao(args, verdict)
        verdict.figure("gather", show_fp8_gather(rt, args, verdict))
        show_torchao_fsdp(rt, args, verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
