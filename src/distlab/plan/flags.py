"""The planner's own limits. A planner builds no tensor, so the lessons' memory limits (`distlab.proof.cli`:
a width^2 float64 matrix is 2 GiB) do not apply here; each limit below is a typo guard, with its reason, far
above every published run. The parser and every flag type (positive numbers, a share of a peak, a file or a
PNG to write) are the ground floor's, `distlab.processes.flags`; the planner never imports the lessons' parser.

A bad value is refused by the parser in one line naming the flag (`FlagParser(limits=LIMITS)`, exit 2),
before any search: a path to write (--json, --plot) is checked when parsed, not after the search.
"""

from __future__ import annotations

# flag: (the most it takes, why)
LIMITS: dict[str, tuple[int, str]] = {
    "--layers": (4096, "blocks; the largest published models have 126 (Llama 3 405B)"),
    "--dim": (1 << 18, "width d; published models stay under 32,768"),
    "--heads": (1 << 14, "heads; published models have at most 128"),
    "--kv-heads": (1 << 14, "key/value heads, at most --heads"),
    "--head-dim": (1 << 12, "d_h; published models use 64-256"),
    "--ffn-width": (1 << 20, "d_ff; published dense models stay under 65,536"),
    "--vocab": (1 << 24, "vocabulary; published tokenizers hold at most 262,144 tokens"),
    "--experts": (1 << 16, "routed experts; published mixtures have at most 256"),
    "--top-k": (1 << 10, "experts per token"),
    "--expert-ffn-width": (1 << 20, "an expert's width"),
    "--shared-experts": (1 << 10, "always-on experts"),
    "--dense-layers": (4096, "dense blocks before the experts, at most --layers"),
    "--q-rank": (1 << 18, "MLA's query latent"),
    "--kv-rank": (1 << 18, "MLA's key/value latent"),
    "--rope-dim": (1 << 12, "MLA's rotary part per head"),
    "--gpus": (1 << 22, "GPUs; the largest published runs use tens of thousands"),
    "--nodes": (1 << 19, "nodes"),
    "--global-batch": (1 << 26, "sequences per step"),
    "--seq-len": (1 << 24, "tokens per sequence (16 M; published contexts reach 1 M)"),
    "--micro-batch": (1 << 16, "sequences per micro-batch"),
    "--stages-per-rank": (64, "pipeline stages per rank, v"),
    "--top": (10_000, "configurations shown"),
    "--reserve-gib": (1024, "GiB kept off the tensors; no GPU holds a TiB"),
    "--inter-node-gbps": (100_000, "Gb/s a GPU sends across nodes; today's NICs carry 400-800"),
}
