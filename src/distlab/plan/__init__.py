"""The planner, on the cost model: `python -m distlab.plan` enumerates the splits of a model over a cluster
(`search`), keeps those that fit in memory, ranks them by predicted step time (`distlab.cost.timing`), and
prints them (`report`); `presets` holds the published models and runs it is checked against."""
