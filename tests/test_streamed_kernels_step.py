"""`distributed_backward` with KERNELS "triton" (Triton's CPU interpreter) equals plain autograd on the whole
batch, and the torch tiles.

{InfoNCE, sigmoid} x {gather, ring} x {B >= C, B < C with dropout} under `spawn`, every combination at P = 2
and a spread of them at P = 1, 3 and 4 (KERNELS "triton-mm", W in memory: four at P = 2, one at P = 3);
d = 7 (not a power of two) and a learned logit scale (and bias).
Float64 to 1e-10 against a deep copy of the model run on the whole batch in one process, plain autograd,
each rank's dropout replayed (`streamed_helpers.full_batch`); float32 at P = 2 to 1e-5 against the same
reference, and the Triton path against the torch tiles on the same ranks. Several cases per spawn: the
interpreter runs each kernel's numpy program by program (about 0.1 s a launch here).
"""

import copy

import kernel_helpers  # noqa: F401 - sets TRITON_INTERPRET=1 before the kernels are imported (ranks inherit it)
import pytest
import torch
from kernel_helpers import relative
from streamed_helpers import STREAMED_N as N
from streamed_helpers import SigTowers, Towers, full_batch, local_rows, rank_streams
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.spawn import spawn
from distlab.proof.models import paired_data
from distributed_clip import distributed_backward

D = 7
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def model_of(case):
    kwargs = dict(scale_shape=(), dropout=case["dropout"], dtype=case["dtype"], width=D)
    return SigTowers(**kwargs) if case["loss"] == "sigmoid" else Towers(**kwargs)


def step(rt, case, kernels):
    """This rank's distributed_backward on its share: (loss, gradients by name)."""
    model = model_of(case)
    torch.manual_seed(100 + rt.rank)  # rank r's dropout stream (`rank_streams`)
    x, y = paired_data(N, dtype=case["dtype"])
    config = {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": case["b"], "EXCHANGE": case["exchange"]}
    config |= {"KERNELS": kernels, "NORMALISERS": case.get("normalisers", "sharded")}
    loss = distributed_backward(DDP(model), x[local_rows(rt)], y[local_rows(rt)], config)
    return loss, {name: p.grad.clone() for name, p in model.named_parameters()}


def run_cases(rt, cases):
    triton = [step(rt, case, case.get("kernels", "triton")) for case in cases]
    return [(run, step(rt, case, "torch") if case.get("vs_torch") else None) for run, case in zip(triton, cases)]


def reference(case, world):
    model = copy.deepcopy(model_of(case))
    x, y = paired_data(N, dtype=case["dtype"])
    loss = full_batch(model, x, y, world, case["b"], None, rank_streams(world) if case["dropout"] else None)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def cases(world):
    c = N // world
    every = [
        dict(loss=loss, exchange=ex, b=b, dropout=drop, dtype=torch.float64)
        for loss in ("infonce", "sigmoid")
        for ex in ("gather", "ring")
        for b, drop in ((c, 0.0), (max(2, c // 2), 0.3))
    ]
    if world == 2:
        every += [
            dict(loss="infonce", exchange="gather", b=c, dropout=0.0, dtype=torch.float64, normalisers="replicated"),
            dict(loss="infonce", exchange="gather", b=c // 2, dropout=0.3, dtype=torch.float32, vs_torch=True),
            dict(loss="sigmoid", exchange="ring", b=c, dropout=0.0, dtype=torch.float32, vs_torch=True),
        ]
        # W in memory: InfoNCE gather (B < C, dropout) and ring, sigmoid gather, the float32 sigmoid ring
        return every + [every[i] | {"kernels": "triton-mm"} for i in (1, 2, 5, 10)]
    spread = every[1::3] if world == 1 else every[world - 3 :: 2]  # P = 1: 3 cases, P = 3: 4, P = 4: 4
    return spread + ([spread[0] | {"kernels": "triton-mm"}] if world == 3 else [])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_triton_step_equals_the_whole_batch_and_the_torch_tiles(world):
    runs = spawn(run_cases, world, cases(world), timeout_s=240, limit_s=600)
    for k, case in enumerate(cases(world)):
        ref_loss, ref = reference(case, world)
        tol = TOL[case["dtype"]]
        for rank_runs in runs:
            (loss, grads), torch_run = rank_runs[k]
            assert abs(loss - ref_loss) <= tol * abs(ref_loss), (case, loss, ref_loss)
            worst = max(relative(grads[name], ref[name]) for name in ref)
            assert worst <= tol, (case, worst)
            if torch_run is not None:
                assert abs(loss - torch_run[0]) <= tol * abs(loss), case
                assert max(relative(grads[name], torch_run[1][name]) for name in ref) <= tol, case
