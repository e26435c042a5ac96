"""distlab: distributed training, built one runnable lesson at a time and proven by tests.

Modules: `runtime` (process groups, devices, `spawn`), `models` (toy models, the transformer block, data),
`training` (the one training loop and its record), `reference` (the one-process reference), `compare`
(reference vs distributed readout), `held` (what a step holds, counted by storage), `timeline` (who
computes when), `pipeline` (model and pipeline parallelism), `contrastive` (contrastive learning under
data parallelism).
"""

__version__ = "0.1.0"
