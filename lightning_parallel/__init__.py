"""lightning-parallel: pipeline, tensor and sequence parallelism for unchanged LightningModules.

Importing this package registers the strategy names (``Trainer(strategy="hybrid")``) with
Lightning's ``StrategyRegistry`` (Lightning has no entry-point discovery for strategies) and lets
Lightning's loaders read sharded checkpoint directories (:mod:`lightning_parallel._loading`).
"""

from lightning_parallel import _loading
from lightning_parallel.mesh import AXES, ParallelDims
from lightning_parallel.strategies import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy

_loading.install()

__all__ = ["AXES", "HelixParallelStrategy", "HybridParallelStrategy", "ParallelDims", "PipelineParallelStrategy"]
__version__ = "0.1.0"
