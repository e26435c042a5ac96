"""Placeholder for the lesson `dualpipe` (being written; not landed)."""

raise SystemExit("lesson dualpipe: not written yet")
