"""What the kernel tests share: Triton's CPU interpreter, turned on before any kernel is imported.

`TRITON_INTERPRET=1` is read when `@triton.jit` decorates a function, Triton's own `tl.zeros` included, that
is when triton is first imported; conftest.py sets it before anything is collected, and setting it here again
keeps a module that imports this one right on its own. Ranks started by `distlab.processes.spawn` inherit it.
The interpreter runs the kernels' own code with numpy, one program after another: the same arithmetic, checked on a CPU.
It needs Triton >= 3.9 (requirements.txt); with an older one the kernel tests are skipped, saying why.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9):  # e.g. the GPU image's 3.6
    pytest.skip(
        f"Triton {triton.__version__}'s interpreter cannot run these kernels (a program id is a 1-element array "
        "there, which numpy 2 will not turn into a loop bound); they compile for GPUs: kernels_compile_check.py",
        allow_module_level=True,
    )

from distlab.streamed.kernels.launch import Blocks  # noqa: E402

# Every block edge crossed: for the fused kernels three column ranges merged, for the coefficient kernel
# (KERNELS "triton-mm") W made 5 rows at a time (chunks that cut through a block of rows).
SMALL_BLOCKS = Blocks(16, 16, 16, 1, 1, splits=3, w_rows=5)
# (dtype, blocks) of the one-kernel tests: every edge crossed in both dtypes, and the default blocks (None: one
# range under the interpreter) in float64, whose tolerance is the stricter (float32 there added nothing more).
CASES = [(torch.float64, SMALL_BLOCKS), (torch.float32, SMALL_BLOCKS), (torch.float64, None)]
IDS = ["f64-small-blocks", "f32-small-blocks", "f64-default"]


def relative(got: torch.Tensor, truth: torch.Tensor) -> float:
    """||got - truth|| / ||truth||, in float64."""
    return ((got.double() - truth.double()).norm() / truth.double().norm()).item()
