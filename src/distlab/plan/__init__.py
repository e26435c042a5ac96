"""The planner: python -m distlab.plan (see distlab/plan/__main__.py)."""
