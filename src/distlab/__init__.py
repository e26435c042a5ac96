"""distlab: distributed training, built one runnable lesson at a time and proven by tests.

The ground floor: the top-level modules (`runtime`: process groups, devices, `spawn`; `models`: toy models,
the transformer block, data; `training`: the one training loop and its record; `reference`: the one-process
reference; `compare`: reference vs distributed readout; `held`: what a step holds, counted by storage;
`timeline`: who computes when; `console`, ...) and `comm` (collectives, the one point-to-point exchange, the
byte ledger). On it, one package per way to split training (`pipeline`, `data_parallel`, `sharding`,
`tensor_parallel`, `context_parallel`) and the contrastive ones (`contrastive`, `streamed`), which import the
ground floor and never each other. The README's Layout lists every module.
"""

__version__ = "0.1.0"
