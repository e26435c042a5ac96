"""distlab: distributed training, built one runnable lesson at a time and proven by tests.

The ground floor: the top-level modules (`runtime`: process groups and devices, `models`: toy models and
data, `compare`: reference vs distributed readout, `console`, ...) and `comm` (collectives, the one
point-to-point exchange, the byte ledger). On it, one package per way to split training (`pipeline`,
`data_parallel`, `sharding`, `tensor_parallel`, `context_parallel`) and the contrastive ones (`contrastive`,
`streamed`), which import the ground floor and never each other. The README's Layout lists every module.
"""

__version__ = "0.1.0"
