"""The streamed step takes a tokenizer's and a processor's dicts (and lists, tuples) as they come.

A model written here with Hugging Face's call convention (`HFLike`: keyword inputs `input_ids`,
`pixel_values`, `attention_mask`; an output object with unit-norm `image_embeds`, `text_embeds`; a
`logit_scale` parameter, and SigLIP's `logit_bias`; dropout in both towers, a masked mean over the tokens)
runs through docs/distributed_clip.md's recipe (its `ForTheStep` adapter, executed as printed) under DDP at P = 2 and 3
with B < C, so every micro-batch is a dict cut to its rows and recomputed under its replayed dropout.
The reference is plain autograd on the whole batch in one process (`clip_loss`, `sigmoid_loss`), each
rank's micro-batches cut by hand and run from that rank's random stream; float64, rtol 1e-10. A
structure the step cannot cut is one error on every rank that names the key.
"""

import math
import re
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import ROOT
from streamed_helpers import DROPOUT_SEED, rank_streams
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.losses import clip_loss, sigmoid_loss
from distlab.pieces.chunks import balanced_chunks
from distlab.pieces.split_inputs import samples_in, split_inputs, take_rows
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare
from distlab.streamed.safeguards.exit_hint import HINT
from distributed_clip import distributed_backward

PAGE = ROOT / "docs" / "distributed_clip.md"
HEADING = "## A Hugging Face CLIPModel or SiglipModel"
VOCAB, LENGTH, N = 11, 6, 12


@dataclass
class HFOutput:
    """The fields of transformers' CLIPOutput / SiglipOutput that the recipe reads, and the logits."""

    logits_per_image: torch.Tensor
    logits_per_text: torch.Tensor
    text_embeds: torch.Tensor
    image_embeds: torch.Tensor


class HFLike(nn.Module):
    """CLIPModel's (or, with `siglip`, SiglipModel's) call convention, small and float64: the logit scale
    0-dim as CLIPModel's, SigLIP's scale and bias of shape [1] as SiglipModel's."""

    def __init__(self, siglip=False, dropout=0.2, seed=0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.vision = nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.Tanh(), nn.Dropout(dropout))
            self.visual_projection = nn.Linear(16, 8, bias=False)
            self.token_embedding = nn.Embedding(VOCAB, 16)
            self.text_dropout = nn.Dropout(dropout)
            self.text_projection = nn.Linear(16, 8, bias=False)
            if siglip:
                self.logit_scale = nn.Parameter(torch.tensor([math.log(10.0)]))
                self.logit_bias = nn.Parameter(torch.tensor([-10.0]))
            else:
                self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.double()

    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, return_loss=None):
        image_embeds = F.normalize(self.visual_projection(self.vision(pixel_values)), dim=-1)
        tokens = self.text_dropout(self.token_embedding(input_ids))
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * mask).sum(1) / mask.sum(1)  # the padding must not count: the mask matters
        text_embeds = F.normalize(self.text_projection(torch.tanh(pooled)), dim=-1)
        logits_per_text = text_embeds @ image_embeds.T * self.logit_scale.exp()
        if hasattr(self, "logit_bias"):
            logits_per_text = logits_per_text + self.logit_bias
        return HFOutput(logits_per_text.T, logits_per_text, text_embeds, image_embeds)


class Positional(nn.Module):
    """The same model fed a list and a tuple: x = [pixel_values], y = (input_ids, attention_mask)."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, images, texts):
        (pixels,), (ids, mask) = images, texts
        out = self.hf(input_ids=ids, pixel_values=pixels, attention_mask=mask)
        return out.image_embeds, out.text_embeds, self.hf.logit_scale.exp()


def hf_batch(n, seed=0):
    """(the processor's dict, the tokenizer's dict) for n pairs: padded token ids and their mask."""
    gen = torch.Generator().manual_seed(seed)
    images = {"pixel_values": torch.randn(n, 3, 4, 4, generator=gen, dtype=torch.float64)}
    lengths = torch.randint(1, LENGTH + 1, (n,), generator=gen)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    texts = {"input_ids": torch.randint(1, VOCAB, (n, LENGTH), generator=gen) * mask, "attention_mask": mask}
    return images, texts


def cut(batch, rows):
    """The test's own cutting: every value's rows (a list or tuple keeps its type)."""
    if isinstance(batch, dict):
        return {k: v[rows] for k, v in batch.items()}
    return type(batch)(v[rows] for v in batch)


def recipe():
    """docs/distributed_clip.md's Hugging Face block, as printed, executed: its names."""
    text = PAGE.read_text()
    section = text[text.index(HEADING) :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {"__name__": "readme_hf_recipe"}
    exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102 - the page's own code
    return namespace


def config(b, n=N):
    return {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": b, "STREAM_CHUNK_SIZE": 5}


def grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def error_of(call, *args):
    try:
        call(*args)
    except ValueError as err:
        return str(err)
    return "no error"


CASES = {  # label -> (model factory, as the step is given its inputs: dicts, or a list and a tuple)
    "clip, dicts": (lambda ns: ns["ForTheStep"](HFLike()), lambda x, y: (x, y)),
    "siglip, dicts": (lambda ns: ns["ForTheStep"](HFLike(siglip=True)), lambda x, y: (x, y)),
    "clip, a list and a tuple": (
        lambda ns: Positional(HFLike()),
        lambda x, y: ([x["pixel_values"]], (y["input_ids"], y["attention_mask"])),
    ),
}


def structured(rt, b):
    ns = recipe()
    c = N // rt.world_size
    rows = slice(rt.rank * c, (rt.rank + 1) * c)
    images, texts = hf_batch(N)
    out = {}
    for label, (make, shape) in CASES.items():
        model = make(ns)
        torch.manual_seed(DROPOUT_SEED + rt.rank)  # rank r's dropout stream, as the reference replays it
        loss = distributed_backward(DDP(model), *shape(cut(images, rows), cut(texts, rows)), config(b))
        out[label] = (loss, grads(model))
    ddp, x, y = DDP(ns["ForTheStep"](HFLike())), cut(images, rows), cut(texts, rows)
    bad = {
        "a list among rank 1's values": (x, y | ({"labels": ["a"] * c} if rt.rank == 1 else {})),
        "values of different lengths": (x, y | {"attention_mask": y["attention_mask"][:-1]}),
        "a dict inside the dict": ({"pixel_values": x}, y),
    }
    out["refused"] = {label: error_of(distributed_backward, ddp, *xy, config(b)) for label, xy in bad.items()}

    def batches():
        while True:
            yield x, y

    out["train_hf"] = ns["train_hf"](HFLike(), batches(), N, b, 3)  # the recipe's loop, its last line included
    out["released"] = not dist.is_initialized()
    return out


def reference(model, shape, world, b, streams):
    """(loss, gradients) of the whole batch in one process: rank r's micro-batches (cut by hand, as the
    step cuts them: `balanced_chunks`) from rank r's random stream, one loss over all N pairs."""
    images, texts = hf_batch(N)
    c = N // world
    outs = []
    for r in range(world):
        with streams.stream(r, torch.device("cpu")):
            for rows in balanced_chunks(c, min(b, c)):
                glob = slice(r * c + rows.start, r * c + rows.stop)
                outs.append(model(*shape(cut(images, glob), cut(texts, glob))))
    z_x, z_y = (torch.cat([out[i] for out in outs]) for i in (0, 1))
    loss = sigmoid_loss(z_x, z_y, *outs[0][2:]) if len(outs[0]) == 4 else clip_loss(z_x, z_y, outs[0][2])
    loss.backward()
    return loss.item(), grads(model)


@pytest.mark.parametrize("world, b", [(2, 4), (3, 3)], ids=["P=2, C=6, B=4", "P=3, C=4, B=3"])
def test_dict_list_and_tuple_inputs_with_b_below_c_and_dropout_are_exact(world, b):
    results = spawn(structured, world, b, timeout_s=60)
    ns = recipe()
    for label, (make, shape) in CASES.items():
        ref_loss, ref = reference(make(ns), shape, world, b, rank_streams(world))
        assert "logit_scale" in " ".join(ref) and ("siglip" not in label or "hf.logit_bias" in ref), sorted(ref)
        for r in results:
            loss, got = r[label]
            assert math.isclose(loss, ref_loss, rel_tol=1e-10), (label, loss, ref_loss)
            assert all_ok(compare(ref, got)), label
    # Teeth: the same whole-batch reference with other dropout masks is another gradient.
    _, other = reference(CASES["clip, dicts"][0](ns), CASES["clip, dicts"][1], world, b, rank_streams(world, 7))
    assert not all_ok(compare(other, results[0]["clip, dicts"][1]))
    expected = {
        "a list among rank 1's values": "rank 1: cannot cut local_y into samples: local_y['labels'] is of type list",
        "values of different lengths": f"local_y disagree on the batch size (dim 0): {{'input_ids': {N // world}, "
        f"'attention_mask': {N // world - 1}}}",
        "a dict inside the dict": "local_x['pixel_values'] is of type dict",
    }
    for label, words in expected.items():
        messages = {r["refused"][label] for r in results}
        assert len(messages) == 1 and words in next(iter(messages)), (label, messages)
        assert next(iter(messages)).endswith(HINT), messages  # how to exit cleanly, once, at the end
    assert all(r["train_hf"] == results[0]["train_hf"] and r["released"] for r in results)
    assert all(math.isfinite(v) for v in results[0]["train_hf"])


def test_cutting_keeps_the_structure_and_names_what_it_refuses():
    images, texts = hf_batch(5)
    part = take_rows(texts | {"token_type_ids": None}, slice(1, 3))
    assert list(part) == ["input_ids", "attention_mask", "token_type_ids"] and part["token_type_ids"] is None
    assert torch.equal(part["attention_mask"], texts["attention_mask"][1:3])
    pair = namedtuple("Pair", "ids mask")(texts["input_ids"], texts["attention_mask"])
    assert type(take_rows(pair, slice(0, 2))).__name__ == "Pair" and isinstance(take_rows((pair[0],), slice(1)), tuple)
    assert [samples_in(x) for x in (images, list(pair), pair, texts["input_ids"])] == [5, 5, 5, 5]
    assert [len(chunk["input_ids"]) for chunk in split_inputs(texts, 2)] == [2, 2, 1]
    refusals = {
        "a string": ("abc", "the input is of type str"),
        "a set inside a list": ([texts["input_ids"], {1}], "the input[1] is of type set"),
        "a 0-d value": ({"ids": torch.tensor(3)}, "the input['ids'] is a 0-d tensor"),
        "no tensor at all": ({"ids": None}, "holds no tensor"),
    }
    for value, words in refusals.values():
        with pytest.raises(ValueError, match=re.escape(words)):
            samples_in(value)
