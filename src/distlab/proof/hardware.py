"""What the time model needs to know about a machine: a device and the links between devices.

A `Device` has a dense peak FLOP/s per precision (the rate of its matrix units without 2:4 structured
sparsity: MFU divides by this one), the sparse figure where the datasheet headlines it (twice the dense
one: dividing by it halves every MFU, the mistake of NVIDIA/Megatron-LM#1565), its memory and its memory
bandwidth. A `Link` carries a collective at some bandwidth per device and direction, after a latency per
ring step. A `Cluster` is nodes of `gpus_per_node` devices, NVLink (or xGMI) inside a node, the network
between nodes (one NIC per GPU, as DGX and HGX systems are built).

The table below is copied from the vendors' datasheets, named with their addresses as text (nothing is
downloaded). Precision names follow `distlab.cost.inputs.PRECISIONS`: "float32" is the plain FP32 rate
(PyTorch does not use TF32 for float32 matmuls unless asked), "bf16" the BF16 tensor rate that mixed
precision trains at. A device's `memory` is what the driver reports it has (`nvidia-smi`'s total: an H100
80GB shows 81,559 MiB = 79.65 GiB, not 80), counted in GiB (2^30 bytes); of it, the planner keeps a reserve
(`DEFAULT_RESERVE_GIB`) for what is no tensor of the step. Link bandwidths in GB (10^9 bytes/s). `sms`: the
streaming multiprocessors (CUs on the MI300X) a product's tiles run on, in waves. Latencies
are not datasheet figures: they are typical NCCL ring-step latencies, stated as the planner's assumption.

The CPU this runs on has no datasheet here: lesson 13 measures its matmul rate per dtype, its memory
bandwidth and gloo's latency and bandwidth per collective at each P, and builds its `Device` and `Link` from
what it measured (`measured_device`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TERA, GB, GIB, MIB = 1e12, 10**9, 2**30, 2**20
DEFAULT_RESERVE_GIB = 4.0  # the CUDA context (~0.5 GiB), NCCL's buffers (~1-2 GiB), the caching allocator's
# fragmentation: what a training process cannot give to its tensors, the planner's stated default


@dataclass(frozen=True)
class Device:
    name: str
    peak: dict[str, float]  # dense FLOP/s by precision
    memory: int  # bytes
    bandwidth: float  # memory bytes/s
    source: str = ""
    sparse: dict[str, float] = field(default_factory=dict)  # the 2:4-sparsity FLOP/s datasheets headline
    sms: int = 0  # streaming multiprocessors (compute units): the waves a product's tiles run in; 0: unknown


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s one device sends, one direction
    latency: float  # seconds per ring step
    source: str = ""


@dataclass(frozen=True)
class Cluster:
    device: Device
    gpus_per_node: int
    intra: Link  # inside a node
    inter: Link  # between nodes

    def link(self, span: int) -> Link:
        """The link a group of consecutive ranks `span` wide rides: NVLink if it fits in a node."""
        return self.intra if span <= self.gpus_per_node else self.inter


def _tera(**figures: float) -> dict[str, float]:
    return {name: value * TERA for name, value in figures.items()}


H100_SHEET = (
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5): "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
H200_SHEET = (
    "NVIDIA H200 Tensor Core GPU datasheet (SXM): "
    "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446"
)
A100_SHEET = (
    "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): https://www.nvidia.com/content/dam/en-zz/Solutions/"
    "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
B200_SHEET = "NVIDIA HGX B200 specifications, per GPU of 8 (1000 W): https://www.nvidia.com/en-us/data-center/hgx/"
MI300X_SHEET = (
    "AMD Instinct MI300X data sheet: https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/"
    "data-sheets/amd-instinct-mi300x-data-sheet.pdf"
)
H800_SHEET = (
    "NVIDIA H800 SXM (H100's compute, NVLink at 400 GB/s): DeepSeek-V3 technical report, section 3.1, "
    "https://arxiv.org/abs/2412.19437"
)
DGX_NIC = "one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100/H200/B200 user guides: https://docs.nvidia.com/dgx/)"

DEVICES = {
    "h100": Device(
        "H100 SXM",
        _tera(float64=67, float32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9),
        81559 * MIB,
        3.35 * TERA,
        H100_SHEET,
        _tera(tf32=989.4, bf16=1978.9, fp16=1978.9, fp8=3957.8),
        132,
    ),
    "h800": Device(
        "H800 SXM",
        _tera(float64=1, float32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9),
        81559 * MIB,
        3.35 * TERA,
        H800_SHEET,
        _tera(tf32=989.4, bf16=1978.9, fp16=1978.9, fp8=3957.8),
        132,
    ),
    "h200": Device(
        "H200 SXM",
        _tera(float64=67, float32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9),
        143771 * MIB,
        4.8 * TERA,
        H200_SHEET,
        _tera(tf32=989.4, bf16=1978.9, fp16=1978.9, fp8=3957.8),
        132,
    ),
    "a100": Device(
        "A100 SXM 80GB",
        _tera(float64=19.5, float32=19.5, tf32=156, bf16=312, fp16=312),
        81920 * MIB,
        2.039 * TERA,
        A100_SHEET,
        _tera(tf32=312, bf16=624, fp16=624),
        108,
    ),
    "a100-40gb": Device(
        "A100 SXM 40GB",
        _tera(float64=19.5, float32=19.5, tf32=156, bf16=312, fp16=312),
        40960 * MIB,
        1.555 * TERA,
        A100_SHEET,
        _tera(tf32=312, bf16=624, fp16=624),
        108,
    ),
    "b200": Device(
        "B200 (HGX)",
        _tera(float64=40, float32=80, tf32=1100, bf16=2250, fp16=2250, fp8=4500),
        183359 * MIB,
        8 * TERA,
        B200_SHEET,
        _tera(tf32=2200, bf16=4500, fp16=4500, fp8=9000),
        148,
    ),
    "mi300x": Device(
        "MI300X",
        _tera(float64=163.4, float32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4, fp8=2614.9),
        192 * GIB,
        5.3 * TERA,
        MI300X_SHEET,
        _tera(tf32=1307.4, bf16=2614.9, fp16=2614.9, fp8=5229.8),
        304,
    ),
}

# (inside a node, between nodes) per device; bandwidth per direction
LINKS = {
    "h100": (
        Link("NVLink 4", 450 * GB, 2e-6, H100_SHEET + ": 900 GB/s both ways"),
        Link("400G", 50 * GB, 5e-6, DGX_NIC),
    ),
    "h200": (
        Link("NVLink 4", 450 * GB, 2e-6, H200_SHEET + ": 900 GB/s both ways"),
        Link("400G", 50 * GB, 5e-6, DGX_NIC),
    ),
    "h800": (
        Link("NVLink (H800)", 200 * GB, 2e-6, H800_SHEET + ": 400 GB/s both ways"),
        Link("400G", 50 * GB, 5e-6, "DeepSeek-V3 technical report, section 3.1: 400 Gb/s InfiniBand per GPU"),
    ),
    "a100": (
        Link("NVLink 3", 300 * GB, 2e-6, A100_SHEET + ": 600 GB/s both ways"),
        Link("200G", 25 * GB, 5e-6, "one 200 Gb/s ConnectX-6 NIC per GPU (DGX A100 user guide)"),
    ),
    "a100-40gb": (
        Link("NVLink 3", 300 * GB, 2e-6, A100_SHEET + ": 600 GB/s both ways"),
        Link("200G", 25 * GB, 5e-6, "one 200 Gb/s ConnectX-6 NIC per GPU (DGX A100 user guide)"),
    ),
    "b200": (
        Link("NVLink 5", 900 * GB, 2e-6, B200_SHEET + ": 1.8 TB/s both ways"),
        Link("400G", 50 * GB, 5e-6, DGX_NIC),
    ),
    "mi300x": (
        Link("xGMI", 448 * GB, 2e-6, MI300X_SHEET + ": 7 peer links of 64 GB/s each way"),
        Link("400G", 50 * GB, 5e-6, "one 400 Gb/s NIC per GPU"),
    ),
}


def cluster(gpu: str, gpus_per_node: int = 8, inter_node_gbps: float | None = None) -> Cluster:
    """A cluster of the named GPU, 8 to a node; `inter_node_gbps`: the network's Gb/s per GPU and direction
    instead of the GPU's NIC (a cluster of 200 Gb/s NICs, or of several per GPU)."""
    if gpu not in DEVICES:
        raise ValueError(f"--gpu: {gpu!r} is not one of {', '.join(DEVICES)}")
    intra, inter = LINKS[gpu]
    if inter_node_gbps is not None:
        inter = Link(f"{inter_node_gbps:g}G", inter_node_gbps * 1e9 / 8, inter.latency, "--inter-node-gbps")
    return Cluster(DEVICES[gpu], gpus_per_node, intra, inter)


def measured_device(name: str, peak: dict[str, float], bandwidth: float, memory: int) -> Device:
    """A device from measurements (lesson 13): the rates it reached at the sizes it was measured at."""
    return Device(name, dict(peak), memory, bandwidth, "measured here")
