"""Lightning ``Strategy`` classes; importing this module registers their short names."""

from lightning_parallel.strategies.helix import HelixParallelStrategy
from lightning_parallel.strategies.hybrid import HybridParallelStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy

__all__ = ["HelixParallelStrategy", "HybridParallelStrategy", "PipelineParallelStrategy"]

HybridParallelStrategy.register()
HybridParallelStrategy.register_alias(
    "tensor_parallel",
    "lightning-parallel: tensor parallelism over all devices (Megatron-style, on DTensor)",
    data_parallel_size=1,
    tensor_parallel_size="auto",
)
HybridParallelStrategy.register_alias(
    "sequence_parallel",
    "lightning-parallel: sequence (context) parallelism over all devices (Ulysses; or ring)",
    data_parallel_size=1,
    sequence_parallel_size="auto",
)
PipelineParallelStrategy.register()
HelixParallelStrategy.register()
