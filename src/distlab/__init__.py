"""distlab: distributed training, built one runnable lesson at a time and proven by tests.

Modules: `runtime` (process groups, devices, `spawn`), `models` (toy models and data), `compare`
(reference vs distributed readout), `timeline` (who computes when), `pipeline` (model and pipeline
parallelism), `contrastive` (contrastive learning under data parallelism).
"""

__version__ = "0.1.0"
