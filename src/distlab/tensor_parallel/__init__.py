"""Tensor, sequence and 2-D parallelism of a transformer block (lesson 08)."""
