"""Collectives and data parallelism (lesson 06)."""
