"""Cutting one model input into micro-batches of B = `chunk_size` samples, whatever shape it has.

GradCache runs a model on a batch of n samples as ceil(n / B) smaller calls, so it must cut the
model's input along the sample axis. What counts as the sample axis depends on the input:

- a tensor `[n, ...]`, or a list / tuple of them (the model is called `model(*chunk)`): dim 0.
- a dict of tensors (`model(**chunk)`, e.g. `input_ids`, `attention_mask`, CLIP's `pixel_values
  [n, C, H, W]`): dim 0 of every value. `None` values (a text-only batch's missing images) are passed
  to every chunk unchanged.
- a VLM-style dict (Qwen2-VL / Qwen3-VL) with `pixel_values` AND `image_grid_thw`: the images'
  patches are flattened into `pixel_values [total_patches, ...]`, so dim 0 is *not* n. Image i owns
  t_i * h_i * w_i consecutive rows, where (t_i, h_i, w_i) = image_grid_thw[i]; the samples [a, b)
  own the rows from sum_{i<a} t_i h_i w_i to sum_{i<b} t_i h_i w_i. One image per sample
  (image_grid_thw has n rows). Cutting `pixel_values` on dim 0 like the other values would hand the
  images' patches to the wrong samples, or fail deep inside the vision tower.

Everything is checked before a single forward: values of one dict must agree on n, the patch count
must equal the grid's total, and anything else (a string, a set, a nested dict) is refused with a
ValueError that names the type. Tensors are compared with `is None`, never with `or`: a tensor of
more than one element has no truth value, so `out.pooler_output or out.last_hidden_state` raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from distlab.chunks import chunks

PIXELS, GRID = "pixel_values", "image_grid_thw"


def check_chunk_size(chunk_size: Any) -> int:
    # bool is an int in Python; True as a chunk size is a bug, not 1.
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"a chunk size must be a positive int, got {chunk_size!r}")
    return chunk_size


def _unsplittable(model_input: Any, where: str = "") -> ValueError:
    return ValueError(
        f"cannot split a model input of type {type(model_input).__name__}{where}: pass a tensor, a list "
        "or tuple of tensors, a dict of tensors (VLM dicts with pixel_values and image_grid_thw too), "
        "or give GradCache a split_input_fn"
    )


def _rows(tensor: Tensor, name: str) -> int:
    if tensor.dim() == 0:
        raise ValueError(f"{name} is a 0-d tensor: it has no sample axis to split")
    return tensor.shape[0]


def _common_batch(named: dict[str, Tensor], what: str) -> int:
    sizes = {name: _rows(t, name) for name, t in named.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"the tensors of {what} disagree on the batch size (dim 0): {sizes}")
    batch = next(iter(sizes.values()))
    if batch == 0:
        raise ValueError(f"{what} holds an empty batch")
    return batch


def patches_per_image(image_grid_thw: Tensor) -> Tensor:
    """t * h * w for every image: the rows of `pixel_values` that belong to it."""
    if image_grid_thw.dim() != 2 or image_grid_thw.shape[1] != 3:
        raise ValueError(f"image_grid_thw must be [num_images, 3], got {list(image_grid_thw.shape)}")
    return image_grid_thw.prod(dim=1)


def _split_vlm(model_input: Mapping, chunk_size: int) -> list[dict]:
    pixels, grid = model_input[PIXELS], model_input[GRID]
    per_image = patches_per_image(grid)
    others = {k: v for k, v in model_input.items() if k not in (PIXELS, GRID) and v is not None}
    batch = _common_batch(others, "the VLM input") if others else len(grid)
    if len(grid) != batch:
        raise ValueError(
            f"image_grid_thw has {len(grid)} rows for {batch} samples: one image per sample "
            "is supported (give GradCache a split_input_fn for several)"
        )
    if _rows(pixels, PIXELS) != int(per_image.sum()):
        raise ValueError(
            f"pixel_values has {pixels.shape[0]} patch rows but image_grid_thw describes "
            f"{int(per_image.sum())} (sum of t*h*w over {len(per_image)} images)"
        )
    # offsets[i] = first patch row of image i; offsets[B] = total patches.
    offsets = [0, *torch.cumsum(per_image, 0).tolist()]
    out = []
    for rows in chunks(batch, chunk_size):
        chunk = {k: (v if v is None else v[rows]) for k, v in model_input.items() if k != PIXELS}
        chunk[PIXELS] = pixels[offsets[rows.start] : offsets[rows.stop]]
        out.append({k: chunk[k] for k in model_input})  # the caller's key order
    return out


def _split_dict(model_input: Mapping, chunk_size: int) -> list[dict]:
    for key, value in model_input.items():
        if value is not None and not isinstance(value, Tensor):
            raise _unsplittable(value, f" (the value of key {key!r})")
    if model_input.get(PIXELS) is not None and model_input.get(GRID) is not None:
        return _split_vlm(model_input, chunk_size)
    tensors = {k: v for k, v in model_input.items() if v is not None}
    if not tensors:
        raise ValueError("the dict input holds no tensor to split")
    batch = _common_batch(tensors, "the dict input")
    return [{k: (v if v is None else v[rows]) for k, v in model_input.items()} for rows in chunks(batch, chunk_size)]


def split_inputs(model_input: Any, chunk_size: int) -> list:
    """A list of chunks of at most `chunk_size` samples, in order; the last may be smaller."""
    check_chunk_size(chunk_size)
    if isinstance(model_input, Tensor):
        batch = _common_batch({"the tensor input": model_input}, "the tensor input")
        return [model_input[rows] for rows in chunks(batch, chunk_size)]
    if isinstance(model_input, Mapping):
        return _split_dict(model_input, chunk_size)
    if isinstance(model_input, (list, tuple)):
        if not model_input or not all(isinstance(t, Tensor) for t in model_input):
            raise _unsplittable(model_input, " (a list or tuple must hold tensors only)")
        batch = _common_batch({f"item {i}": t for i, t in enumerate(model_input)}, "the list input")
        return [[t[rows] for t in model_input] for rows in chunks(batch, chunk_size)]
    raise _unsplittable(model_input)
