"""Placeholder for the lesson `mxfp8_sharding` (being written; not landed)."""

raise SystemExit("lesson mxfp8_sharding: not written yet")
