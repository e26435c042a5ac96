"""Placeholder for the lesson `diloco` (being written; not landed)."""

raise SystemExit("lesson diloco: not written yet")
