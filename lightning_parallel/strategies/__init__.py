"""Lightning ``Strategy`` classes; importing this module registers their short names."""

from lightning_parallel.strategies.helix import HelixParallelStrategy
from lightning_parallel.strategies.hybrid import HybridParallelStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy

__all__ = ["HelixParallelStrategy", "HybridParallelStrategy", "PipelineParallelStrategy"]

HybridParallelStrategy.register()
PipelineParallelStrategy.register()
HelixParallelStrategy.register()
