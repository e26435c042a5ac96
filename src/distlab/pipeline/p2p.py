"""Point-to-point transfer of activations (forward) and their gradients (backward) between stages.

A tensor that crosses a process boundary leaves its autograd graph behind: the receiver gets plain
numbers. Stage s+1 therefore marks the received activation `requires_grad_()` so that its backward
produces d loss / d input, and sends that gradient back; stage s resumes backpropagation from its
output with `output.backward(received_grad)`. That is the chain rule across the cut:
    dL/dW_s = (dL/dA_s) (dA_s/dW_s),  with dL/dA_s computed on rank s+1.

The receiver allocates the buffer, so it must know the shape: callers pass the shape derived by
`partition.boundary_shapes` (no shape is ever sent or hard-coded).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def send(tensor: torch.Tensor, dst: int) -> None:
    """Blocking send of the numbers of `tensor` (never its graph)."""
    dist.send(tensor.detach().contiguous(), dst=dst)


def recv(shape: torch.Size, dtype: torch.dtype, device: torch.device, src: int,
         requires_grad: bool = False) -> torch.Tensor:
    """Blocking receive into a fresh buffer; `requires_grad=True` makes it a leaf that collects
    d loss / d (this tensor) during this stage's backward."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, src=src)
    return buffer.requires_grad_(requires_grad)
