"""lightning-parallel: pipeline, tensor and sequence parallelism for unchanged LightningModules.

Importing this package registers the strategy names (``Trainer(strategy="hybrid")``) with
Lightning's ``StrategyRegistry`` (Lightning has no entry-point discovery for strategies) and lets
Lightning's loaders read sharded checkpoint directories (:mod:`lightning_parallel._loading`), and
``ThroughputMonitor`` count data-parallel replicas (:mod:`lightning_parallel._throughput`), and Lightning's
``grad_norm`` refuses where it would see part of the model (:mod:`lightning_parallel._grad_norm`).
"""

from lightning_parallel import _grad_norm, _loading, _throughput
from lightning_parallel.mesh import AXES, ParallelDims
from lightning_parallel.pretrained import load_pretrained
from lightning_parallel.strategies import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy

_loading.install()
_throughput.install()
_grad_norm.install()

__all__ = [
    "AXES", "HelixParallelStrategy", "HybridParallelStrategy", "ParallelDims", "PipelineParallelStrategy",
    "load_pretrained",
]  # fmt: skip
__version__ = "0.1.0"
