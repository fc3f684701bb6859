"""lightning-parallel: pipeline, tensor and sequence parallelism for unchanged LightningModules.

Importing this package registers the strategy names (``Trainer(strategy="hybrid")``) with
Lightning's ``StrategyRegistry``; Lightning has no entry-point discovery for strategies.
"""

from lightning_parallel.mesh import AXES, ParallelDims
from lightning_parallel.strategies import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy

__all__ = ["AXES", "HelixParallelStrategy", "HybridParallelStrategy", "ParallelDims", "PipelineParallelStrategy"]
__version__ = "0.1.0"
