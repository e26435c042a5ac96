"""Placeholder for the lesson `fp8_linear` (being written; not landed)."""

raise SystemExit("lesson fp8_linear: not written yet")
