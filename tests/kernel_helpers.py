"""What the kernel tests share: Triton's CPU interpreter, turned on before any kernel is imported.

`TRITON_INTERPRET=1` is read when `@triton.jit` decorates a kernel, that is when `distlab.streamed.kernels`
is first imported; distlab imports those modules only when the Triton path is chosen, so setting it here,
at the top of every test module that runs a kernel (before anything runs), is early enough. Ranks started by
`distlab.spawn` inherit it (its server process starts at the first spawn, after collection). The interpreter
runs the kernels' own code with numpy, one program after another: the same arithmetic, checked on a CPU.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from distlab.streamed.kernels.launch import Blocks  # noqa: E402

SMALL_BLOCKS = Blocks(16, 16, 16, 1, 1, splits=3)  # every block edge crossed, and three column ranges merged


def relative(got: torch.Tensor, truth: torch.Tensor) -> float:
    """||got - truth|| / ||truth||, in float64."""
    return ((got.double() - truth.double()).norm() / truth.double().norm()).item()
