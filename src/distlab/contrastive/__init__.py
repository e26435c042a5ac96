"""Contrastive (CLIP) learning under data parallelism (lessons 21-27): losses, gathers, the DDP step,
GradCache, costs and the CLIP on digits. The streamed step is its own package, `distlab.streamed`."""
