"""A model's input of any structure, cut along its sample axis: GradCache's chunks and the streamed
step's micro-batches both cut here, so the two cut alike.

What counts as the sample axis depends on the input:

- a tensor `[n, ...]`, or a list / tuple of them: dim 0 of each.
- a dict of tensors (a tokenizer's `input_ids` and `attention_mask`, a processor's `pixel_values
  [n, C, H, W]`): dim 0 of every value. `None` values (a text-only batch's missing images) are passed
  to every part unchanged.
- a VLM-style dict (Qwen2-VL / Qwen3-VL) with `pixel_values` AND `image_grid_thw`: the images'
  patches are flattened into `pixel_values [total_patches, ...]`, so dim 0 is *not* n. Image i owns
  t_i * h_i * w_i consecutive rows, where (t_i, h_i, w_i) = image_grid_thw[i]; the samples [a, b)
  own the rows from sum_{i<a} t_i h_i w_i to sum_{i<b} t_i h_i w_i. One image per sample
  (image_grid_thw has n rows). Cutting `pixel_values` on dim 0 like the other values would hand the
  images' patches to the wrong samples, or fail deep inside the vision tower.

`samples_in` checks a structure before anything runs and returns its n: the values of one dict must
agree on n, the patch count must equal the grid's total, and anything else (a string, a set, a nested
dict, a list inside a dict) is refused with a ValueError that names the key and the type. `take_rows`
cuts samples [a, b) out of a checked input, keeping its structure and its keys' order; `split_inputs`
cuts it into consecutive chunks of at most B samples (GradCache's). Tensors are compared with `is
None`, never with `or`: a tensor of more than one element has no truth value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from distlab.pieces.chunks import chunks

PIXELS, GRID = "pixel_values", "image_grid_thw"
STRUCTURES = (
    "a tensor, a list or tuple of tensors, or a dict of tensors (None values allowed; "
    "VLM dicts with pixel_values and image_grid_thw too)"
)


def check_chunk_size(chunk_size: Any) -> int:
    # bool is an int in Python; True as a chunk size is a bug, not 1.
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"a chunk size must be a positive int, got {chunk_size!r}")
    return chunk_size


def _unsplittable(value: Any, what: str, key: Any = None) -> ValueError:
    """The error for a structure that cannot be cut: `what` names the input, `key` the offending part."""
    part = what if key is None else f"{what}[{key!r}]"
    return ValueError(f"cannot cut {what} into samples: {part} is of type {type(value).__name__}; pass {STRUCTURES}")


def _rows(tensor: Tensor, where: str) -> int:
    if tensor.dim() == 0:
        raise ValueError(f"{where} is a 0-d tensor: it has no sample axis to cut")
    return tensor.shape[0]


def _common_batch(named: dict[str, Tensor], what: str) -> int:
    """The one dim-0 length of `named`'s tensors (keys as the caller wrote them), or a ValueError naming
    each key's length."""
    sizes = {name: _rows(t, f"{what}[{name!r}]") for name, t in named.items()}
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


def _is_vlm(model_input: Mapping) -> bool:
    return model_input.get(PIXELS) is not None and model_input.get(GRID) is not None


def _vlm_batch(model_input: Mapping, what: str) -> int:
    pixels, grid = model_input[PIXELS], model_input[GRID]
    per_image = patches_per_image(grid)
    others = {k: v for k, v in model_input.items() if k not in (PIXELS, GRID) and v is not None}
    batch = _common_batch(others, what) if others else len(grid)
    if len(grid) != batch:
        raise ValueError(f"image_grid_thw has {len(grid)} rows for {batch} samples: one image per sample is supported")
    if _rows(pixels, f"{what}[{PIXELS!r}]") != int(per_image.sum()):
        raise ValueError(
            f"pixel_values has {pixels.shape[0]} patch rows but image_grid_thw describes "
            f"{int(per_image.sum())} (sum of t*h*w over {len(per_image)} images)"
        )
    return batch


def samples_in(model_input: Any, what: str = "the input") -> int:
    """n, the samples `model_input` holds, after checking its structure (`what`: its name in errors,
    e.g. "local_x")."""
    if isinstance(model_input, Tensor):
        if _rows(model_input, what) == 0:
            raise ValueError(f"{what} holds an empty batch")
        return model_input.shape[0]
    if isinstance(model_input, Mapping):
        for key, value in model_input.items():
            if value is not None and not isinstance(value, Tensor):
                raise _unsplittable(value, what, key)
        if _is_vlm(model_input):
            return _vlm_batch(model_input, what)
        tensors = {k: v for k, v in model_input.items() if v is not None}
        if not tensors:
            raise ValueError(f"{what} is a dict that holds no tensor")
        return _common_batch(tensors, what)
    if isinstance(model_input, (list, tuple)):
        for i, item in enumerate(model_input):
            if not isinstance(item, Tensor):
                raise _unsplittable(item, what, i)
        if not model_input:
            raise ValueError(f"{what} is an empty {type(model_input).__name__}")
        return _common_batch(dict(enumerate(model_input)), what)
    raise _unsplittable(model_input, what)


def take_rows(model_input: Any, rows: slice) -> Any:
    """Samples rows.start ... rows.stop - 1 of a checked input (`samples_in`), in its own structure:
    a tensor's rows, a list's or tuple's items' rows, a dict's values' rows under the same keys in the
    same order (None stays None; a VLM dict's patches follow their images)."""
    if isinstance(model_input, Tensor):
        return model_input[rows]
    if isinstance(model_input, Mapping):
        part = {k: (v if v is None else v[rows]) for k, v in model_input.items()}
        if _is_vlm(model_input):
            # offsets[i] = first patch row of image i; offsets[n] = total patches.
            offsets = [0, *torch.cumsum(patches_per_image(model_input[GRID]), 0).tolist()]
            part[PIXELS] = model_input[PIXELS][offsets[rows.start] : offsets[rows.stop]]
        return part
    items = [t[rows] for t in model_input]
    if isinstance(model_input, list):
        return items
    return type(model_input)(*items) if hasattr(model_input, "_fields") else tuple(items)  # a namedtuple keeps its type


def split_inputs(model_input: Any, chunk_size: int) -> list:
    """A list of chunks of at most `chunk_size` samples, in order; the last may be smaller."""
    check_chunk_size(chunk_size)
    n = samples_in(model_input, "the model input")
    return [take_rows(model_input, rows) for rows in chunks(n, chunk_size)]
