"""What benchmarks/gpu_check.sh asks the interpreter before it runs anything: `probe` (torch's version, its CUDA,
whether a GPU is there, how many), `missing` (the packages the check needs that are not installed) and `api` (the
torch.distributed names the project calls that the installed torch lacks; 2.11's names go through
distlab.comm.compat). One line on stdout each; `probe` prints nothing when torch does not import.

    python benchmarks/gpu_check_env.py probe | missing | api
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


if __name__ == "__main__":
    print({"probe": probe, "missing": missing, "api": api}[sys.argv[1]]())
