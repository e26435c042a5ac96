"""python -m distlab.plan: the planner's command line (distlab/plan/cli.py)."""

from distlab.plan.cli import main
from distlab.processes.runtime import run_main

run_main(main)
