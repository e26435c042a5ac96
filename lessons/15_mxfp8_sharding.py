"""Lesson 15: MXFP8 and FP8 under sharding. Blocks of 32 values sharing a power-of-two scale (MX), outliers
under three granularities of scale, and sharded weights gathered in 8 bits with one global scale.

    torchrun --nproc-per-node 4 lessons/15_mxfp8_sharding.py     # any P; the weight is cut into P shards

MX (OCP Microscaling Formats v1.0, https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-
final-pdf): a row is cut into blocks of 32 along the inner dimension n; each block gets its own scale, a power
of two stored in 8 bits (e8m0: an exponent, no mantissa, bias 127, the byte 255 is NaN), and its values are cast
to e4m3. Two rules pick a block's scale 2^x from its amax (`--rule`, both as torchao 0.18 computes them):

    FLOOR (the spec's, section 6.3):  x = floor(log2 amax) - 8        (2^8: e4m3's largest power of two)
    RCEIL (NVIDIA's cuBLAS rule, torchao's MXFP8Linear default):  x = ceil(log2(amax / max_f)), the smallest
                                      2^x with amax / 2^x <= max_f
    T_q = cast_e4m3(clamp(T / 2^x, -max_f, max_f)),   T ~ T_q 2^x

FLOOR keeps amax's leading bits and lets the largest values saturate (amax 500: FLOOR 2^0, 500 -> 448; RCEIL 2^1,
500 -> 250); RCEIL never saturates and may spend one binade at the bottom. A block holding a NaN gets the byte
255 and comes back all NaN (the uint8 cast of a NaN would give 0, a scale of 2^-127 for the other 31 values).
Dividing by a power of two is exact, so the only rounding is the cast; an outlier spoils the range of its own
32 values, not of its row (rowwise scale) or of the whole tensor (tensorwise, lesson 14).

Under ZeRO-3 / FSDP (lesson 07) every rank holds Psi_P = ceil(Psi / P) elements of the flat weight and gathers
the rest before each use. Gathering it in FP8 instead of bf16 halves the bytes, but a tensorwise scale must be
the whole weight's, or rank r's cast differs from the cast one process would make: so the ranks agree on
amax first (each sends its local amax, every rank takes the max), then cast their shard with the global
scale rho = max_f / amax and all-gather the bytes. The result equals one process casting the whole weight,
bit for bit; each rank sends (P-1) Psi_P bytes plus (P-1) x 4 bytes of amax, against (P-1) 2 Psi_P in bf16.

Proven: MX by hand equals torchao's MXFP8Linear (emulated kernels: dequantize to the model's dtype, then a matmul
in it) bit for bit, forward and both gradients, under either rule, for float32 and bf16 models; the FP8 gather
equals one process's cast and torchao's FSDP2 float8 pre-all-gather cast of each shard. torchao's FSDP2 float8
all-gather itself does not run on the CPU: gloo has no float8 all-gather ("Invalid scalar type"); this lesson
gathers the same bytes viewed as uint8.
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
from distlab.proof.verdict import Verdict

# torchao is imported where it is compared (parts 3 and 5): the mechanism needs only torch, and its import
# warns of CUDA kernels a CPU cannot load, so those loggers are quietened first.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

E4M3 = torch.float8_e4m3fn
MAX_F = torch.finfo(E4M3).max  # 448
BIAS = 127  # e8m0's exponent bias: the byte 127 is 2^0
NAN_BYTE = 255  # e8m0's NaN
E4M3_EMAX = 8  # e4m3's largest power of two is 2^8 (448 = 1.75 x 2^8)
RULES = ("rceil", "floor")
EPS = 1e-12  # amax floor (torchao's)
TORCHAO_BLOCK = 32  # MXFP8Linear's block, fixed

# ---- MX by hand: blocks of 32, a power-of-two scale each -------------------------------------------------


def check_block(width: int, block: int, flag: str = "--block") -> None:
    """MX cuts each row into whole blocks: one line naming the flag when the width does not divide."""
    require(width % block == 0, flag, f"a block of {block} must divide the width {width} of every cast row")


def block_exponent(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """The e8m0 byte 127 + x of each block's scale 2^x under `rule` (the docstring's FLOOR or RCEIL)."""
    if rule == "floor":  # floor(log2 amax) is amax's float32 exponent field, read from its bits
        x = ((amax.view(torch.int32) >> 23) & 0xFF) - BIAS - E4M3_EMAX
    else:
        x = torch.ceil(torch.log2(amax / MAX_F))  # amax = 0: -inf, clamped to 2^-127
    biased = (x.clamp(-BIAS, BIAS) + BIAS).to(torch.uint8)
    return torch.where(amax.isnan(), NAN_BYTE, biased)  # a NaN would cast to the byte 0


def mx_cast(t: torch.Tensor, block: int, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """(T_q in e4m3, the e8m0 exponents as bytes, one per block of `block` along the last dimension)."""
    check_block(t.shape[-1], block)
    blocks = t.float().reshape(*t.shape[:-1], t.shape[-1] // block, block)
    biased = block_exponent(blocks.abs().amax(dim=-1, keepdim=True), rule)
    if rule == "floor":  # torchao divides by 2^x, at least 2^-126; NaN's 2^128 = inf sends the block to 0 and NaN
        inverse = 1 / torch.exp2(biased.float() - BIAS).clamp(min=2.0**-126)
    else:  # torchao multiplies by 2^-x, by 1 where x = -127, by NaN in a NaN block
        inverse = torch.where(biased == 0, 1.0, torch.exp2(BIAS - biased.float()))
        inverse = torch.where(biased == NAN_BYTE, torch.nan, inverse)
    return (blocks * inverse).clamp(-MAX_F, MAX_F).to(E4M3).reshape(t.shape), biased


def mx_dequantize(t_q: torch.Tensor, biased: torch.Tensor, block: int, dtype=torch.float32) -> torch.Tensor:
    """T_q 2^x in `dtype`, exactly (a power of two times an e4m3 number is a bf16 and a float32 number); the byte
    255 gives a NaN block."""
    blocks = t_q.to(dtype).reshape(*t_q.shape[:-1], t_q.shape[-1] // block, block)
    scale = torch.where(biased == NAN_BYTE, torch.nan, torch.exp2(biased.float() - BIAS)).to(dtype)
    return (blocks * scale).reshape(t_q.shape)


def mx_matmul(a: torch.Tensor, b: torch.Tensor, block: int, rule: str = "rceil") -> torch.Tensor:
    """a @ b with both operands in MX (blocks along the inner dimension n: a's rows, b's columns), emulated as
    torchao does without an MX kernel: dequantize to the operands' dtype, then one matmul in it."""
    a_hp = mx_dequantize(*mx_cast(a, block, rule), block, a.dtype)
    bt_hp = mx_dequantize(*mx_cast(b.t().contiguous(), block, rule), block, b.dtype)
    return a_hp @ bt_hp.t()


class MXLinear(torch.autograd.Function):
    """Y = X W^T, dX = dY W, dW = dY^T X, every operand in MX e4m3 (MXFP8's recipe: gradients in e4m3 too,
    their blocks running along each matmul's own inner dimension)."""

    @staticmethod
    def forward(ctx, x, weight, block, rule="rceil"):
        ctx.save_for_backward(x, weight)
        ctx.block, ctx.rule = block, rule
        return mx_matmul(x, weight.t(), block, rule)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = mx_matmul(dy, weight, ctx.block, ctx.rule)
        return dx, mx_matmul(dy.t().contiguous(), x, ctx.block, ctx.rule), None, None


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
    print0("\n[bold]1. One row in MX blocks: a power-of-two scale per block of 32, by either rule[/]")
    gen = torch.Generator().manual_seed(args.seed)
    row = torch.randn(1, 4 * args.block, generator=gen)
    row[0, 3] = 900.0  # an outlier in the first block
    row[0, 2 * args.block] = 500.0  # the third block's amax: 2^8.97, where the two rules part
    row[0, 3 * args.block + 1] = torch.nan  # the fourth block holds a NaN
    rows = []
    for rule in RULES:
        t_q, biased = mx_cast(row, args.block, rule)
        back = mx_dequantize(t_q, biased, args.block)
        for k in range(4):
            part = slice(k * args.block, (k + 1) * args.block)
            amax, byte = row[0, part].abs().max().item(), int(biased[0, k, 0])
            err = ((back[0, part] - row[0, part]).abs().max() / row[0, part].abs().max()).item()
            scale = "NaN" if byte == NAN_BYTE else f"2^{byte - BIAS}"
            rows.append((rule, str(k), f"{amax:.4g}", str(byte), scale, f"{err:.2e}"))
    print0(rows_table("", ("rule", "block", "amax", "e8m0 byte", "scale 2^x", "max rel. error"), rows))


def outlier_errors(t: torch.Tensor, ordinary: torch.Tensor, block: int, rule: str) -> dict[str, tuple[float, float]]:
    """Per scaling: the relative error ||T_hat - T|| / ||T|| over the ordinary values (the outliers
    themselves come through at e4m3's u in every scheme), and the fraction of them flushed to 0."""
    from_scale = {
        "tensorwise": lambda: _fp8_roundtrip(t, t.abs().max()),
        "rowwise": lambda: _fp8_roundtrip(t, t.abs().amax(dim=-1, keepdim=True)),
        f"MX, blocks of {block}": lambda: mx_dequantize(*mx_cast(t, block, rule), block),
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
        table[case] = outlier_errors(t, ~where, args.block, args.rule)
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
    info = torch.finfo(E4M3)  # the smallest subnormal is tiny x eps = 2^-9; normals start at tiny = 2^-6
    span, normal = math.log2(MAX_F / (info.tiny * info.eps)), math.log2(MAX_F / info.tiny)
    flushed = outlier_errors(torch.where(in_channels, base * 1e3, base), ~in_channels, args.block, args.rule)
    print0(
        f"e4m3 spans {span:.1f} binades (2^-9 .. 448), {normal:.1f} of them normal (2^-6 .. 448, all 3 mantissa "
        f"bits). Measured here: outlier channels 1,000 times larger flush {flushed['tensorwise'][1]:.1%} of the "
        f"others to 0 under one tensorwise scale ({flushed['rowwise'][1]:.1%} rowwise), and {args.outlier:g} times "
        "larger the share above. A block's scale is shared by 32 values only.",
        highlight=False,
    )
    verdict.figure("outlier_channels_1000", flushed)
    return table


def mx_linear_runs(x, weight, dy, rule: str) -> dict[str, dict[str, torch.Tensor]]:
    """Y, dX, dW of one linear layer in the dtype of x and weight, by hand (MXLinear) and by torchao's
    MXFP8Linear (emulated kernels) under the same scale rule."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    mode = ScaleCalculationMode.FLOOR if rule == "floor" else ScaleCalculationMode.RCEIL
    out_width, width = weight.shape
    theirs = MXFP8Linear(
        width, out_width, bias=False, dtype=weight.dtype, kernel_preference=KernelPreference.EMULATED,
        scale_calculation_mode=mode,
    )  # fmt: skip
    theirs.weight.data.copy_(weight)
    xt, xo, w_ours = x.clone().requires_grad_(), x.clone().requires_grad_(), weight.clone().requires_grad_()
    y_theirs, y_ours = theirs(xt), MXLinear.apply(xo, w_ours, TORCHAO_BLOCK, rule)
    y_theirs.backward(dy)
    y_ours.backward(dy)
    return {
        "torchao": {"Y": y_theirs.detach(), "dX": xt.grad, "dW": theirs.weight.grad},
        "by hand": {"Y": y_ours.detach(), "dX": xo.grad, "dW": w_ours.grad},
    }


def show_mx_equal_to_torchao(args, verdict: Verdict) -> None:
    print0("\n[bold]3. MX by hand against torchao's MXFP8Linear (emulated kernels), bit for bit[/]")
    gen = torch.Generator().manual_seed(args.seed + 2)
    x = torch.randn(args.rows, args.width, generator=gen)
    weight = torch.randn(args.out_width, args.width, generator=gen) / args.width**0.5
    dy = torch.randn(args.rows, args.out_width, generator=gen)
    rows, every = [], True
    for dtype in (torch.float32, torch.bfloat16):  # the model's dtype: torchao computes and returns in it
        for rule in RULES:
            runs = mx_linear_runs(x.to(dtype), weight.to(dtype), dy.to(dtype), rule)
            same = {k: torch.equal(runs["torchao"][k], runs["by hand"][k]) for k in ("Y", "dX", "dW")}
            every &= all(same.values()) and runs["by hand"]["Y"].dtype == runs["torchao"]["Y"].dtype == dtype
            rows.append(
                (str(dtype).removeprefix("torch."), rule, *("equal" if ok else "DIFFERENT" for ok in same.values()))
            )
    print0(f"X {args.rows} x {args.width}, W {args.out_width} x {args.width}", highlight=False)
    print0(rows_table("", ("model dtype", "rule", "Y", "dX", "dW"), rows))
    verdict.check("MX by hand = torchao MXFP8Linear (emulated), FLOOR and RCEIL, float32 and bf16: bit for bit", every)


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
    parser.add_argument("--rule", choices=RULES, default="rceil", help="MX scale rule of part 2 (part 3 runs both)")
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
