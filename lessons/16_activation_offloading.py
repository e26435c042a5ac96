"""Lesson 16: activation offloading, by hand with saved-tensor hooks: what autograd saves for backward goes to a
host pool during forward and comes back, one layer ahead, during backward; proven equal to no offloading and to
torch's `save_on_cpu`, its bytes and its device peak counted.

    torchrun --nproc-per-node 1 lessons/16_activation_offloading.py     # one process: it splits no work

Backward needs what forward saved: for an MLP the input of every Linear and the output of every tanh, and the
loss's input and target; lesson 07 counts them, e N (w_0 + sum of the hidden widths + 2 w_out) bytes for N rows
(`distlab.data_split.sharding.accounting.mlp_activations`). Offloading keeps them off the device between the two passes.
`torch.autograd.graph.saved_tensors_hooks(pack, unpack)` hands every tensor autograd saves to `pack`, which
returns anything (here a handle), and hands that back to `unpack` when backward needs the tensor:

    pack(t):   a parameter stays (it is on the device anyway); else copy t to the host pool on the copy
               thread and return a handle. A storage saved twice (a tanh's output is the next Linear's
               input) is copied once. Forward keeps at most two groups on the device: before group k's
               first tensor, group k-2's copies are waited for and their device copies freed (on a GPU, an
               event wait on the copy stream), so the bound holds however slow the link is.
    unpack(h): the first time backward touches layer k's group, fetch it (or wait for its prefetch) and
               start fetching group k-1 on the copy thread: it travels while layer k computes.

What "device" means here. This machine has one kind of memory, so the device is the emulated one of lessons 05-06
(`distlab/proof/emulate.py`): each layer's forward costs --emulate-ms of wall time and its backward twice that, slept
with the real math inside; a copy between device and host costs --link-ms-per-mib per MiB on the copy thread.
The "device" tensors are the ones autograd holds; the "host pool" is a separate set of CPU tensors; the device
bytes are counted by the offloader, storage by storage, not measured by an allocator. Copies are exact, so
gradients equal those without offloading bit for bit; only time and the device peak change:

    device peak of saved activations = max over consecutive groups (H_k + H_{k-1}): the group whose backward
    runs and the one being prefetched (H_0 = e N (w_0 + w_1), H_k = e N w_{k+1}, the loss's H = 2 e N w_out);
    without prefetch max_k H_k, at the price of waiting for every fetch; without offloading all of them.

Recomputation (lesson 02's checkpointing) also cuts what stays on the device, by computing the forward again
instead of moving it: in two segments, the first keeps only its input (per layer it would cut nothing: what a
Linear + tanh layer saves are the checkpoints themselves). The table puts the two side by side in time and
activation bytes on the same emulated device.
"""

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.utils.checkpoint import checkpoint_sequential

from distlab.data_split.sharding.accounting import mlp_activations
from distlab.processes.console import print0, rows_table
from distlab.processes.flags import nonnegative_float, positive_int
from distlab.processes.runtime import distributed, run_main
from distlab.proof import emulate
from distlab.proof.cli import add_emulate_args, lesson_parser
from distlab.proof.held import SavedActivations, storage_bytes
from distlab.proof.memory import MIB
from distlab.proof.models import layered_mlp, regression_batch
from distlab.proof.timeline import Timeline, render
from distlab.proof.verdict import Verdict

IN_FEATURES, OUT_FEATURES = 16, 8

# ---- the mechanism: pack to the host pool, unpack with a prefetch one group ahead ---------------------------


class Offloader:
    """with Offloader(model.parameters(), link_ms_per_mib, prefetch): loss = forward(); loss.backward()

    `group` is set by the caller before each layer's forward (a forward pre-hook): what a layer saves is one
    group, fetched back together. Counts: `sent` and `received` (bytes to the host and back), `device_bytes`
    and its `peak` (saved activations resident on the device), `on_demand` (groups fetched only when backward
    asked for them), `copies` (the copy thread's timeline)."""

    def __init__(self, parameters, link_ms_per_mib: float, prefetch: bool = True):
        self.skip = {p.untyped_storage().data_ptr() for p in parameters}
        self.link_ms_per_mib, self.prefetch = link_ms_per_mib, prefetch
        self.copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy")  # one link, in order
        self.copies = Timeline(1)  # row 1 of the timeline: the copy thread
        self.group, self.groups, self.touched = 0, {}, set()  # group -> its handles, in pack order
        self.alive: dict[tuple, int] = {}  # (address, offset, shape, stride) of a live saved tensor -> its handle
        self.host: dict[int, Future] = {}  # handle -> the host copy (a future while it travels)
        self.landing: list[tuple[int, int, int]] = []  # (group, handle, bytes): device copies not yet freed
        self.device: dict[int, Future] = {}  # handle -> the device copy fetched back
        self.users: dict[int, int] = {}  # handle -> unpacks still to come (a tensor saved twice: two)
        self.sent = self.received = self.device_bytes = self.peak = self.on_demand = 0

    def _copy(self, t: torch.Tensor, label: str) -> torch.Tensor:
        """On the copy thread: t copied, the copy taking its bytes' time on the emulated link."""
        nbytes = t.numel() * t.element_size()
        with self.copies.span(label), emulate.EmulatedDevice(self.link_ms_per_mib * nbytes / MIB).pad(1):
            return t.detach().clone()  # a new storage: the "other side" of the link

    def _resident(self, nbytes: int) -> None:
        self.device_bytes += nbytes
        self.peak = max(self.peak, self.device_bytes)

    def _land(self, before: float) -> None:
        """Wait for the copies to the host of every group before `before`; free their device copies."""
        landed = [(handle, nbytes) for group, handle, nbytes in self.landing if group < before]
        for handle, nbytes in landed:
            self.host[handle].result()
            self._resident(-nbytes)
        self.landing = [row for row in self.landing if row[0] >= before]

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() in self.skip:
            return t  # a parameter: on the device anyway, never moved
        if self.group not in self.groups:  # forward enters a new group: at most two stay on the device
            self._land(before=self.group - 1)
        key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key in self.alive:  # saved before and still alive (a tanh output the next Linear saves): one copy
            handle = self.alive[key]
            self.users[handle] += 1
            return handle
        # A new handle, never the address: once a storage dies its address is reused by the next tensor, and a
        # pool keyed by addresses hands backward another tensor's values (silently wrong gradients).
        handle, nbytes = len(self.host), t.numel() * t.element_size()
        self.alive[key] = handle
        weakref.finalize(storage, self.alive.pop, key, None)  # the address is free again: forget it
        self.users[handle] = 1
        self.groups.setdefault(self.group, []).append(handle)
        self.sent += nbytes
        self._resident(nbytes)
        self.host[handle] = self.copier.submit(self._copy, t, "H to host")  # t lives until the copy is done
        self.landing.append((self.group, handle, nbytes))
        if not self.prefetch:
            self._land(before=self.group + 1)  # serialised: forward waits for every copy
        return handle

    def _fetch(self, group: int) -> None:
        for key in self.groups.get(group, []):
            if key not in self.device:
                host = self.host[key].result()
                self.received += host.numel() * host.element_size()
                self._resident(host.numel() * host.element_size())
                self.device[key] = self.copier.submit(self._copy, host, "D to device")

    def unpack(self, handle) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle  # a parameter
        group = next(g for g, keys in self.groups.items() if handle in keys)
        if group not in self.touched:  # backward reaches this group: prefetch the one before it
            self.touched.add(group)
            if handle not in self.device:  # not prefetched (the first group backward needs): wait for it
                self.on_demand += 1
                self._fetch(group)
            order = list(self.groups)  # the groups in pack order; backward walks them backwards
            if self.prefetch and order.index(group) > 0:
                self._fetch(order[order.index(group) - 1])
        t = self.device[handle].result()
        self.users[handle] -= 1
        if self.users[handle] == 0:  # its last user: the device copy goes once autograd lets it go
            self._resident(-t.numel() * t.element_size())
            del self.device[handle]
        return t

    def __enter__(self):
        self._hooks = saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def drain(self) -> None:
        """Wait for every copy to the host: the end of forward on the device's copy stream."""
        self._land(before=float("inf"))

    def close(self) -> None:
        self.copier.shutdown(wait=True)


# ---- the runs -----------------------------------------------------------------------------------------------


def make_problem(args):
    widths = (IN_FEATURES, *[args.width] * args.layers, OUT_FEATURES)
    model = layered_mlp(widths, seed=args.seed)
    x, y = regression_batch(args.global_batch, IN_FEATURES, OUT_FEATURES, seed=args.seed + 1)
    return model, x, y, widths


def step(args, how: str) -> dict:
    """One forward and backward of a fresh model on the emulated device: `how` is "plain", "offload" (with
    prefetch), "serialised" (no prefetch, every copy waited for), "save_on_cpu" (torch's) or "recompute"
    (`forward_recomputing`: two checkpointed segments). Returns its gradients, seconds, counts and spans."""
    model, x, y, widths = make_problem(args)
    slowed = emulate.slow_layers(model, emulate.EmulatedDevice(args.emulate_ms))
    compute, offloader = Timeline(0), None
    start = time.perf_counter()
    if how in ("offload", "serialised"):
        offloader = Offloader(model.parameters(), args.link_ms_per_mib, prefetch=how == "offload")
        for k, layer in enumerate(model):
            layer.register_forward_pre_hook(lambda _, __, k=k: setattr(offloader, "group", k))
        with offloader:
            with compute.span("F forward"):
                out = model(x)
                offloader.group = len(model)  # the loss's saved input and target: a group of their own
                loss = F.mse_loss(out, y)
            offloader.drain()
        with compute.span("I backward"):
            loss.backward()
        offloader.close()
    else:
        held = SavedActivations(exclude=model.parameters())  # what stays on the device between the passes
        with save_on_cpu() if how == "save_on_cpu" else held:
            with compute.span("F forward"):
                out = forward_recomputing(model, x) if how == "recompute" else model(x)
                loss = F.mse_loss(out, y)
        with compute.span("I backward"):
            loss.backward()
    seconds = time.perf_counter() - start
    for handle in slowed:
        handle.remove()
    spans = compute.spans + (offloader.copies.spans if offloader else [])
    return {
        "grads": [p.grad for p in model.parameters()],
        "seconds": seconds,
        "offloader": offloader,
        "spans": sorted(spans, key=lambda s: s.start),
        "params": storage_bytes(list(model.parameters())),
        "held": offloader.peak if offloader else held.nbytes,
        "widths": widths,
    }


def forward_recomputing(model, x: torch.Tensor) -> torch.Tensor:
    """Lesson 02's checkpointing (`checkpoint_sequential`) in two segments: the first keeps only its input, and
    backward computes it again; the last runs plainly (torch's rule). Per layer it would keep everything: what a
    Linear + tanh layer saves is its input and its output, the next layer's input, the checkpoints themselves."""
    return checkpoint_sequential(model, 2, x, use_reentrant=False)


def group_bytes(widths: tuple[int, ...], rows: int, e: int) -> list[int]:
    """H_k by formula, in pack order: the first layer's input and tanh output, each later tanh's output, the
    loss's input and target."""
    hidden = widths[1:-1]
    return [e * rows * (widths[0] + hidden[0])] + [e * rows * w for w in hidden[1:]] + [e * rows * 2 * widths[-1]]


# ---- the chapter, part by part --------------------------------------------------------------------------------


def show_exactness(args, runs: dict, verdict: Verdict) -> None:
    print0("\n[bold]1. Gradients: offloaded against no offloading and torch's save_on_cpu[/]")
    rows = []
    for how in ("offload", "serialised"):
        for against in ("plain", "save_on_cpu"):
            same = all(torch.equal(a, b) for a, b in zip(runs[how]["grads"], runs[against]["grads"]))
            verdict.check(f"{how} = {against}, bit for bit", same)
            rows.append((how, against, "bit for bit" if same else "DIFFERENT"))
    recomputed = all(
        torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(runs["recompute"]["grads"], runs["plain"]["grads"])
    )
    verdict.check("recompute = plain, to 1e-12", recomputed)
    rows.append(("recompute", "plain", "to 1e-12" if recomputed else "DIFFERENT"))
    print0(rows_table("", ("by hand", "against", "gradients"), rows))


def show_bytes(args, runs: dict, verdict: Verdict) -> None:
    print0("\n[bold]2. Bytes moved each way and the device peak, counted against the formulas[/]")
    run = runs["offload"]
    e, widths = run["grads"][0].element_size(), run["widths"]
    formula = mlp_activations(args.global_batch, widths, e)
    off = run["offloader"]
    verdict.check("bytes to the host = lesson 07's formula", off.sent == formula, f"{off.sent:,} B")
    verdict.check("bytes back to the device = the same", off.received == formula, f"{off.received:,} B")
    groups = group_bytes(widths, args.global_batch, e)
    pairs = max(a + b for a, b in zip(groups, groups[1:]))
    serial = runs["serialised"]["offloader"]
    verdict.check("device peak with prefetch = parameters + max (H_k + H_(k-1))", off.peak == pairs)
    verdict.check("device peak without prefetch = parameters + max H_k", serial.peak == max(groups))
    rows = [
        ("moved to the host", f"{off.sent:,}", f"{formula:,}"),
        ("moved back", f"{off.received:,}", f"{formula:,}"),
        ("peak, prefetch", f"{run['params'] + off.peak:,}", f"{run['params'] + pairs:,}"),
        ("peak, no prefetch", f"{run['params'] + serial.peak:,}", f"{run['params'] + max(groups):,}"),
        ("peak, no offloading", "", f"{run['params'] + formula:,}"),
    ]
    print0(f"device bytes (peaks: the parameters, {run['params']:,} B, plus the saved activations resident)")
    print0(rows_table("", ("", "counted", "formula"), rows))
    verdict.figure("bytes", {"sent": off.sent, "formula": formula, "groups": groups, "peak": off.peak})


def show_time(args, runs: dict, verdict: Verdict) -> None:
    print0(f"\n[bold]3. On the emulated device ({args.emulate_ms} ms a layer-pass, {args.link_ms_per_mib} ms/MiB)[/]")
    for how in ("serialised", "offload"):
        print0(f"{how}: the step (F, I: forward, backward) and the copy thread (H out, D back)")
        print0(render(runs[how]["spans"], 2, width=60, labels=["step", "copies"]))
    rows = []
    for how in ("plain", "serialised", "offload", "recompute"):
        rows.append((how, f"{runs[how]['seconds'] * 1e3:.0f}", f"{runs[how]['held']:,}"))
    print0("activation bytes on the device: kept between the passes, or (offloaded) the peak")
    print0(rows_table("", ("step", "ms", "activation bytes"), rows))
    groups = len(runs["offload"]["offloader"].groups)
    on_demand = {how: runs[how]["offloader"].on_demand for how in ("offload", "serialised")}
    verdict.check(
        "with prefetch only the first group is fetched on demand, without it every group",
        on_demand == {"offload": 1, "serialised": groups},
        f"{on_demand['offload']} and {on_demand['serialised']} of {groups}",
    )
    verdict.figure("seconds", {how: run["seconds"] for how, run in runs.items()})
    verdict.figure("spans", {how: [s.__dict__ for s in runs[how]["spans"]] for how in ("serialised", "offload")})


def parse_args():
    parser = lesson_parser(__doc__)
    parser.add_argument("--width", type=positive_int, default=256, help="hidden width of the MLP")
    parser.add_argument("--layers", type=positive_int, default=6, help="hidden layers of the MLP")
    parser.add_argument("--global-batch", type=positive_int, default=512, help="rows, N")
    add_emulate_args(parser, ms_per_layer=20.0)
    parser.add_argument(
        "--link-ms-per-mib", type=nonnegative_float, default=10.0, help="emulated link: ms per MiB copied"
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    with distributed("cpu" if args.device == "auto" else args.device) as rt:
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 16: activation offloading[/] - N = {args.global_batch}, width {args.width}, "
            f"{args.layers} hidden layers, float64, the emulated device"
        )
        step(args, "plain")  # a warm-up: the first step pays one-off costs (threads, the allocator's first pages)
        runs = {how: step(args, how) for how in ("plain", "save_on_cpu", "serialised", "offload", "recompute")}
        show_exactness(args, runs, verdict)
        show_bytes(args, runs, verdict)
        show_time(args, runs, verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
