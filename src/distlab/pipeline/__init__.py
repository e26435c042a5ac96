"""Model and pipeline parallelism: stages, point-to-point transfers, schedules and their runner."""
