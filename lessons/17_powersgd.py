"""Placeholder for the lesson `powersgd` (being written; not landed)."""

raise SystemExit("lesson powersgd: not written yet")
