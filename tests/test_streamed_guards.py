"""Bad input to the streamed step is one clear ValueError on every rank, and nothing hangs.

Each case is a bad call made on every rank of one `spawn` (P = 2); some are bad on one rank only
(its batch, its TAU, its N, its logit scale, its forward), which is where a rank raising alone would
leave the others waiting in a collective: the all-gather, or DDP's forward itself, which broadcasts
the module's buffers (here BatchNorm's running statistics, in eval mode). After all of them, one good
step on the same DDP model must still equal the single-process reference: no refused call leaves
state behind.
"""

import contextlib
import math

import torch
from streamed_helpers import STREAMED_N as N
from streamed_helpers import Towers, full_batch, local_rows
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare, grads_of
from distlab.proof.models import paired_data
from distributed_clip import distributed_backward, distributed_train_step


class RawScale(Towers):
    """Returns logit_scale itself as s, so a test can make s zero or negative."""

    def forward(self, x, y):
        z_x, z_y, _ = super().forward(x, y)
        return z_x, z_y, self.logit_scale


class FloatScale(Towers):
    """Returns the logit scale as a Python number."""

    def forward(self, x, y):
        z_x, z_y, s = super().forward(x, y)
        return z_x, z_y, s.item()


class DictOut(Towers):
    """Returns a dict, but not under open_clip's keys."""

    def forward(self, x, y):
        z_x, z_y, s = super().forward(x, y)
        return {"z_x": z_x, "z_y": z_y, "s": s}


def good(b=N // 2, **changes):
    return {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": b, "STREAM_CHUNK_SIZE": 7} | changes


def bad_calls(rt):
    """label -> (model, local_x, local_y, config): each call is wrong in one way."""
    rows, other = local_rows(rt), rt.rank == rt.world_size - 1
    x, y = paired_data(N)
    lx, ly = x[rows], y[rows]
    learn, fixed = DDP(Towers(scale_shape=())), DDP(Towers())
    bn = DDP(Towers(scale_shape=(), batchnorm=True))
    frozen = DDP(Towers(scale_shape=()))  # (DDP refuses to wrap a model with nothing to train)
    frozen.module.requires_grad_(False)  # frozen after wrapping: no parameter trains, the scale included
    buffered = DDP(Towers(scale_shape=(), batchnorm=True).eval())  # its DDP forward communicates
    inf_scale, negative, drifted = (DDP(cls(scale_shape=())) for cls in (Towers, RawScale, Towers))
    with torch.no_grad():
        inf_scale.module.logit_scale.fill_(float("inf"))
        negative.module.logit_scale.fill_(0.5 if not other else -0.5)  # s <= 0 on one rank only
        drifted.module.logit_scale.add_(1e-9 * rt.rank)  # replicas out of sync after DDP's broadcast
    return {
        "TAU with a returned scale": (learn, lx, ly, good(TAU=0.1)),
        "no TAU and no returned scale": (fixed, lx, ly, good()),
        "TAU differs across ranks": (fixed, lx, ly, good(TAU=0.1 + 0.1 * rt.rank)),
        "N differs across ranks": (
            learn,
            x[:13] if other else lx,
            y[:13] if other else ly,
            good(GLOBAL_BATCH_SIZE=26 if other else N),
        ),
        "N differs, DDP's forward broadcasts buffers": (
            buffered,
            x[:13] if other else lx,
            y[:13] if other else ly,
            good(GLOBAL_BATCH_SIZE=26 if other else N),
        ),
        "one rank's forward raises": (buffered, x[rows, :-1] if other else lx, ly, good()),
        "B differs across ranks": (learn, lx, ly, good(b=11 if other else 12)),
        "TAU is None": (learn, lx, ly, good(TAU=None)),
        "one rank's batch is short": (learn, lx[:-1] if other else lx, ly[:-1] if other else ly, good()),
        "BatchNorm in training mode with B < C": (bn, lx, ly, good(b=5)),
        "nothing trainable": (frozen, lx, ly, good()),
        "static-graph DDP with B < C": (DDP(Towers(scale_shape=()), static_graph=True), lx, ly, good(b=5)),
        "non-finite scale": (inf_scale, lx, ly, good()),
        "non-positive scale on one rank": (negative, lx, ly, good()),
        "scale differs across ranks": (drifted, lx, ly, good()),
        "missing key": (learn, lx, ly, {"GLOBAL_BATCH_SIZE": N, "STREAM_CHUNK_SIZE": 4}),
        "misspelt key": (learn, lx, ly, good() | {"STREAM_CHUNK": 3}),
        "N not divisible by P": (learn, lx, ly, good(GLOBAL_BATCH_SIZE=N + 1)),
        "bad NORMALISERS on one rank": (learn, lx, ly, good(NORMALISERS="both" if other else "sharded")),
        "not a supported wrapper": (Towers(scale_shape=()), lx, ly, good()),
        "scale returned as a float": (DDP(FloatScale(scale_shape=())), lx, ly, good()),
        "forward returns one tensor": (DDP(nn.Bilinear(12, 10, 8, dtype=torch.float64)), lx, ly, good()),
        "a dict without open_clip's keys": (DDP(DictOut(scale_shape=())), lx, ly, good()),
        "x and y sizes differ": (learn, lx, ly[:-1], good()),
        "called under no_grad": (learn, lx, ly, good()),
    }


EXPECTED = {  # label -> what the one message, the same on every rank, must say
    "TAU with a returned scale": "leave TAU out of the config",
    "no TAU and no returned scale": "config has no TAU and the model returns no logit scale",
    "TAU differs across ranks": "config differs across ranks, TAU: rank 0: 0.1, rank 1: 0.2",
    "N differs across ranks": "config differs across ranks, GLOBAL_BATCH_SIZE N: rank 0: 24, rank 1: 26",
    "N differs, DDP's forward broadcasts buffers": "config differs across ranks, GLOBAL_BATCH_SIZE N",
    "one rank's forward raises": "rank 1: model(x, y) raised RuntimeError: mat1 and mat2 shapes cannot be multiplied",
    "B differs across ranks": "config differs across ranks, MICRO_BATCH_SIZE B: rank 0: 12, rank 1: 11",
    "TAU is None": "for a learned scale leave TAU out of the config",
    "one rank's batch is short": "every rank must hold N / P = 24 / 2 = 12 pairs, but rank 0: 12, rank 1: 11",
    "BatchNorm in training mode with B < C": "B >= C (one forward, exactly plain DDP)",
    "nothing trainable": "no parameter of Towers requires grad: there is nothing for the step to train",
    "static-graph DDP with B < C": "Use B >= C (one forward) or DDP without static_graph",
    "non-finite scale": "must be finite and > 0 on every rank: rank 0: inf, rank 1: inf",
    "non-positive scale on one rank": "must be finite and > 0 on every rank: rank 0: 0.5, rank 1: -0.5",
    "scale differs across ranks": "the logit scale s differs across ranks",
    "missing key": "config is missing ['MICRO_BATCH_SIZE']",
    "misspelt key": "did you mean 'STREAM_CHUNK_SIZE'?",
    "N not divisible by P": "not divisible by the world size P=2",
    "bad NORMALISERS on one rank": "rank 1: config['NORMALISERS'] must be one of ('sharded', 'replicated'), got 'both'",
    "not a supported wrapper": "model must be wrapped in DistributedDataParallel",
    "scale returned as a float": "dict of them, got a tuple of 3: (Tensor, Tensor, float)",
    "forward returns one tensor": "or open_clip's dict of them, got Tensor",
    "a dict without open_clip's keys": "the step reads open_clip's output_dict",
    "x and y sizes differ": "same number of pairs",
    "called under no_grad": "called with gradients disabled",
}


def refused_then_good(rt):
    messages = {}
    for label, (model, lx, ly, config) in bad_calls(rt).items():
        try:
            with torch.no_grad() if label == "called under no_grad" else contextlib.nullcontext():
                distributed_backward(model, lx, ly, config)
            messages[label] = "no error"
        except (ValueError, RuntimeError) as err:  # RuntimeError: only where the model's forward raised
            messages[label] = f"{type(err).__name__}: {err}"
    # The same DDP model, refused above after its one forward ran: a good step is still exact.
    model = Towers(scale_shape=())
    ddp = DDP(model)
    x, y = paired_data(N)
    rows = local_rows(rt)
    for config in (good(TAU=0.1), good(b=5, TAU=0.1)):
        try:
            distributed_backward(ddp, x[rows], y[rows], config)
        except ValueError:
            pass
    ddp.zero_grad()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    loss = distributed_train_step(ddp, opt, x[rows], y[rows], good())
    return messages, loss, grads_of(model)


def test_every_bad_input_is_one_clear_error_on_every_rank():
    results = spawn(refused_then_good, 2, timeout_s=30)
    for label, expected in EXPECTED.items():
        per_rank = [messages[label] for messages, _, _ in results]
        kind = "RuntimeError" if "forward raises" in label else "ValueError"
        assert len(set(per_rank)) == 1 and per_rank[0].startswith(kind) and expected in per_rank[0], (label, per_rank)
    model = Towers(scale_shape=())
    x, y = paired_data(N)
    loss = full_batch(model, x, y, 2, N // 2)
    loss.backward()
    for _, got_loss, grads in results:
        assert math.isclose(got_loss, loss.item(), rel_tol=1e-10)
        assert all_ok(compare(grads_of(model), grads))
