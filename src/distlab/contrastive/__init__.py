"""Contrastive (CLIP) learning under data parallelism: losses, gathers, GradCache, the streamed step."""
