"""Lightning ``Strategy`` classes; importing this module registers their short names."""

from lightning_parallel.strategies.hybrid import HybridParallelStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy

__all__ = ["HybridParallelStrategy", "PipelineParallelStrategy"]

HybridParallelStrategy.register()
PipelineParallelStrategy.register()
