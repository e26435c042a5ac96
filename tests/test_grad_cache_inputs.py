"""GradCache in one process with dicts and VLM-style inputs (text queries, image documents whose patches
belong to their images): the gradients of the full batch, and the splitting that keeps each image's
patches with it. The reference is tests/grad_cache_helpers.reference (plain autograd on deep copies).
Float64 (rtol 1e-10, atol 1e-12).
"""

from collections import UserDict

import pytest
import torch
from grad_cache_helpers import SEED, N, ToyVLM, grads_of_models, image_batch, reference, rep_clip_loss, text_batch

from distlab.contrastive.grad_cache import GradCache
from distlab.pieces.split_inputs import split_inputs
from distlab.proof.compare import all_ok, compare

# --- dicts and VLM-style inputs -----------------------------------------------------------------------


def vlm_rows(batch, chunk):
    """The test's own VLM slicing: per-image patch blocks, regrouped by sample range."""
    per_image = list(batch["pixel_values"].split(batch["image_grid_thw"].prod(1).tolist()))
    out = []
    for a in range(0, len(batch["input_ids"]), chunk):
        b = a + chunk
        out.append(
            {
                "input_ids": batch["input_ids"][a:b],
                "attention_mask": batch["attention_mask"][a:b],
                "pixel_values": torch.cat(per_image[a:b]),
                "image_grid_thw": batch["image_grid_thw"][a:b],
            }
        )
    return out


def dict_rows(batch, chunk):
    return [{k: v[a : a + chunk] for k, v in batch.items()} for a in range(0, len(batch["input_ids"]), chunk)]


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("pooled", [True, False])
def test_one_vlm_for_text_queries_and_image_documents(dropout, pooled):
    """One model encodes text-only dict queries and VLM dict documents (a retrieval setup)."""
    vlm = ToyVLM(dropout=dropout, pooled=pooled)
    queries, docs = text_batch(N, seed=4), image_batch(N, seed=5)
    chunked = [dict_rows(queries, 4), vlm_rows(docs, 3)] if dropout else None
    ref_grads, ref_loss = reference([vlm, vlm], [queries, docs], rep_clip_loss, chunked)

    torch.manual_seed(SEED)
    loss = GradCache([vlm, vlm], [4, 3], rep_clip_loss)(queries, UserDict(docs))
    assert all_ok(compare(ref_grads, grads_of_models([vlm])))
    assert torch.allclose(loss, ref_loss, rtol=1e-10, atol=0)


def test_patches_given_to_the_wrong_samples_are_caught():
    """Guard for the test above: patches handed to the wrong samples change the gradients, so the
    VLM comparison can fail."""
    vlm = ToyVLM()
    queries, docs = text_batch(N, seed=4), image_batch(N, seed=5)
    ref_grads, _ = reference([vlm, vlm], [queries, docs], rep_clip_loss)

    def naive_split(batch, chunk):  # patches taken from the wrong offset: wrong, yet no error
        if "pixel_values" not in batch:
            return split_inputs(batch, chunk)
        counts = batch["image_grid_thw"].prod(1)
        parts = []
        for a in range(0, len(batch["input_ids"]), chunk):
            part = {k: v[a : a + chunk] for k, v in batch.items() if k != "pixel_values"}
            n_patches = int(counts[a : a + chunk].sum())  # the right count, from the wrong place
            part["pixel_values"] = batch["pixel_values"][a * 2 : a * 2 + n_patches]
            parts.append(part)
        return parts

    GradCache([vlm, vlm], [4, 3], rep_clip_loss, split_input_fn=naive_split)(queries, docs)
    assert not all_ok(compare(ref_grads, grads_of_models([vlm])))


def test_split_inputs_gives_each_chunk_its_own_images_patches():
    docs = image_batch(7, seed=1)
    per_image = docs["pixel_values"].split(docs["image_grid_thw"].prod(1).tolist())
    chunks = split_inputs(docs, 3)
    assert [len(c["input_ids"]) for c in chunks] == [3, 3, 1]
    for c, start in zip(chunks, (0, 3, 6)):
        assert torch.equal(c["pixel_values"], torch.cat(per_image[start : start + 3]))
        assert list(c) == list(docs)  # keys in the caller's order
    # A CLIP-style pixel_values [B, C, H, W] (no grid) is cut on dim 0; None rides along.
    clip = {"pixel_values": torch.zeros(5, 3, 2, 2), "attention_mask": None}
    assert [c["pixel_values"].shape[0] for c in split_inputs(clip, 2)] == [2, 2, 1]
    assert all(c["attention_mask"] is None for c in split_inputs(clip, 2))
