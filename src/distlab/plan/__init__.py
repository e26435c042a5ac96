"""The planner, on the cost model: `python -m distlab.plan` prices one layout item by item (`--layout`), or
enumerates the splits of a model over a cluster (`search`), keeps those that fit in memory with the reserve,
ranks them by predicted step time (`distlab.cost.timing`), and prints them (`report`); `presets` holds the
published models and runs it is checked against; `flags` its own limits and the two flag types only it
takes, on the ground floor's parser and types (`distlab.processes.flags`; docs/planner.md)."""
