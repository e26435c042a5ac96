"""What benchmarks/gpu_check.sh asks the interpreter before it runs anything: `probe` (torch's version, its CUDA,
whether a GPU is there, how many), `missing` (the packages the check needs that are not installed), `api` (the
torch.distributed names the project calls that the installed torch lacks; 2.11's names go through
distlab.comm.compat) and `lesson FILE DEVICE` (how step (c) runs a lesson: ranks, device, extra flags). One
line on stdout each; `probe` prints nothing when torch does not import.

    python benchmarks/gpu_check_env.py probe | missing | api | lesson lessons/NN_<slug>.py cuda
"""

import importlib
import importlib.util
import sys


def probe() -> str:
    import torch

    return f"{torch.__version__} {torch.version.cuda} {torch.cuda.is_available()} {torch.cuda.device_count()}"


def missing() -> str:
    needed = ("rich", "numpy", "pytest", "pytest_timeout", "sklearn", "matplotlib")
    return " ".join(m for m in needed if importlib.util.find_spec(m) is None)


NAMES = (  # the torch.distributed names the project calls
    "all_reduce get_world_size get_rank isend ReduceOp irecv batch_isend_irecv barrier group all_gather_object "
    "all_gather recv get_process_group_ranks send is_initialized init_process_group get_global_rank "
    "destroy_process_group Work reduce_scatter is_available broadcast_object_list broadcast TCPStore Store "
    "ProcessGroup PrefixStore HashStore GroupMember GradBucket DistError"
).split()
RENAMED = (("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor"))
MODULES = (
    ("torch.distributed.fsdp", "fully_shard"),
    ("torch.distributed.fsdp", "FSDPModule"),
    ("torch.distributed.pipelining", "ScheduleZBVZeroBubble"),
    ("torch.distributed.checkpoint", "save"),
)


def api() -> str:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    missing = [n for n in NAMES if not hasattr(dist, n)]
    missing += [f"{n} (distlab.comm.compat: {old})" for n, old in RENAMED if not hasattr(dist, n)]
    if not hasattr(funcol, "all_gather_single_autograd"):
        missing.append(
            "_functional_collectives.all_gather_single_autograd (distlab.comm.compat: all_gather_tensor_autograd)"
        )
    for mod, attr in MODULES:
        try:
            if not hasattr(importlib.import_module(mod), attr):
                missing.append(f"{mod}.{attr}")
        except Exception as err:
            missing.append(f"{mod} ({type(err).__name__})")
    return "; ".join(missing)


# Step (c) runs every lesson at P = 1 on the device; these differ (slug -> ranks, device or None for the check's,
# extra flags, why). One GPU holds one rank (NCCL puts one rank per GPU), so a lesson that needs an even P runs at
# P = 2 on the CPU (gloo) beside the others, and docs/gpu.md says so.
LESSON_RUNS = {
    "composed_mesh": (1, None, "--dp 1 --pp 1 --tp 1 --cp 1", "its default mesh is 2 x 2 x 2 x 1, 8 ranks"),
    "interleaved_zero_bubble": (1, None, "--emulate-ms 2.5", "at P = 1 it sleeps for all 16 layers: P = 4's tick"),
    "dualpipe": (2, "cpu", "", "DualPipe mirrors rank pairs: P even (P = 1 refused)"),
    "diloco": (2, "cpu", "", "two islands of P/2 ranks: P even (P = 1 refused)"),
}


def lesson(path: str, device: str) -> str:
    """`P DEVICE FLAGS...` for step (c)'s run of the lesson at `path` (read by `read -r LP LDEV LFLAGS`)."""
    slug = path.rsplit("/", 1)[-1].removesuffix(".py").split("_", 1)[1]
    world, own_device, flags, _ = LESSON_RUNS.get(slug, (1, None, "", ""))
    return f"{world} {own_device or device} {flags}".rstrip()


if __name__ == "__main__":
    questions = {"probe": probe, "missing": missing, "api": api, "lesson": lesson}
    print(questions[sys.argv[1]](*sys.argv[2:]))
