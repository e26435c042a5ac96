"""The ring inside what real training wraps the step in: DDP over a subgroup (the ring's neighbours are
the subgroup's ranks, not the world's) and torch.compile of that DDP, for both losses, with dropout and
B < C (each micro-batch recomputed under its replayed random state). A world of 4 runs as two
subgroups {0, 1} and {2, 3}, each on its own batch; every rank's gradients must equal a deep copy
trained on its subgroup's whole batch in one process (plain autograd, float64, 1e-10)."""

import copy
import math

import torch
import torch.distributed as dist
from streamed_helpers import DROPOUT_SEED, SigTowers, Towers, full_batch, rank_streams
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare, grads_of
from distlab.proof.models import paired_data
from distributed_clip import distributed_backward

N, B, DROPOUT = 12, 4, 0.2  # C = 6 pairs per rank in a subgroup of 2, micro-batches of at most 4
CASES = {
    "infonce, DDP": (Towers, False),
    "sigmoid, DDP": (SigTowers, False),
    "sigmoid, compile(DDP)": (SigTowers, True),
}


def model_of(label: str):
    maker = CASES[label][0]
    return maker(scale_shape=(), dropout=DROPOUT) if maker is Towers else maker(dropout=DROPOUT)


def ring_in_subgroups(rt):
    group, _ = dist.new_subgroups(group_size=2)
    member = dist.get_rank(group)
    x, y = paired_data(N, seed=rt.rank // 2)  # one batch per subgroup
    rows = slice(member * N // 2, (member + 1) * N // 2)
    config = {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": B, "STREAM_CHUNK_SIZE": 4, "EXCHANGE": "ring"}
    out = {}
    for label, (_, compiled) in CASES.items():
        model = model_of(label)
        wrapped = DDP(model, process_group=group)
        if compiled:
            wrapped = torch.compile(wrapped, backend="aot_eager")
        torch.manual_seed(DROPOUT_SEED + member)  # this rank's dropout stream in its subgroup
        out[label] = (distributed_backward(wrapped, x[rows], y[rows], config), grads_of(model))
    return out


def reference(label: str, seed: int) -> tuple[float, dict]:
    """A deep copy on the subgroup's whole batch, each rank's dropout replayed in its micro-batches."""
    model = copy.deepcopy(model_of(label))
    loss = full_batch(model, *paired_data(N, seed=seed), 2, B, streams=rank_streams(2))
    loss.backward()
    return loss.item(), grads_of(model)


def test_the_ring_over_a_ddp_subgroup_and_under_compile_is_exact():
    results = spawn(ring_in_subgroups, 4, timeout_s=120)
    for label in CASES:
        for rank, r in enumerate(results):
            ref_loss, ref = reference(label, rank // 2)
            loss, grads = r[label]
            assert math.isclose(loss, ref_loss, rel_tol=1e-10), (label, rank, loss, ref_loss)
            rows = compare(ref, grads)
            assert all_ok(rows) and max(row.max_rel for row in rows) < 1e-10, (label, rank, rows)
