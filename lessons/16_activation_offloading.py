"""Placeholder for the lesson `activation_offloading` (being written; not landed)."""

raise SystemExit("lesson activation_offloading: not written yet")
