"""Exercise 16: activation offloading with saved-tensor hooks (read lessons/16_activation_offloading.py first;
check your answer with `pytest --exercises -k 16`; add `--hint-level 1`, 2 or 3 for help).

Write the class `Offloader`, used as

    offloader = Offloader(model.parameters(), link_ms_per_mib, prefetch=True)
    (before each layer k's forward: offloader.group = k; before the loss: offloader.group = len(model))
    with offloader:                      # installs torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        loss = F.mse_loss(model(x), y)
        offloader.drain()                # every copy to the host finished
    loss.backward()
    offloader.close()

`pack(t)` gets every tensor autograd saves in forward: return a parameter as it is (never moved); copy any
other to a host pool on one copy thread (concurrent.futures.ThreadPoolExecutor(max_workers=1)) and return a
handle; a tensor saved twice (a tanh output the next Linear saves again) is copied once. `unpack(handle)`
returns the tensor backward needs; the first time backward touches a group, fetch that group back (unless it
was prefetched) and, with `prefetch`, start fetching the group packed before it. Never key the pool by a
storage's address alone: a freed storage's address is reused by the next tensor.

Count, as integers: `sent` and `received` (bytes copied to the host and back), `peak` (the most bytes of saved
activations resident on the device at once: a tensor is resident from its pack until forward packs the first
tensor of the group two after its own (wait there for its copy to the host: at most two groups stay on the
device), and from its fetch until its last unpack), `on_demand` (groups fetched only when backward asked), and
keep `groups` (a dict from group to its handles, in pack order). `_copy(t, label)` may use
`distlab.proof.emulate.EmulatedDevice(link_ms_per_mib * bytes / distlab.proof.memory.MIB).pad(1)` to make a
copy take the link's time; `copies` is a `distlab.proof.timeline.Timeline(1)` for the copy thread's spans.

The judge (one process, an MLP 16 -> 48 -> 48 -> 48 -> 8, N = 32, float64) checks the gradients against no
offloading, bit for bit, the bytes each way against lesson 07's formula, and the peak against
max (H_k + H_(k-1)) over consecutive groups; then, on Linear 16 -> 12, h[:, :6] * h[:, 6:] (a layer whose backward
saves two views of one storage), Linear 6 -> 8, that each view comes back with its own values, once copied each.
"""

from __future__ import annotations

from distlab.proof.timeline import Timeline


class Offloader:
    """Saved tensors to a host pool on a copy thread, and back one group ahead."""

    def __init__(self, parameters, link_ms_per_mib: float, prefetch: bool = True):
        self.copies = Timeline(1)
        raise NotImplementedError("not written yet: Offloader (pack, unpack, drain, close, the counts)")
