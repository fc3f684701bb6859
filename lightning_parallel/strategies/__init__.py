"""Lightning ``Strategy`` classes; importing this module registers their short names."""

from lightning_parallel.strategies.hybrid import HybridParallelStrategy

__all__ = ["HybridParallelStrategy"]

HybridParallelStrategy.register()
