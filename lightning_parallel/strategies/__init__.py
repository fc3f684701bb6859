"""Lightning ``Strategy`` classes; importing this module registers their short names (and two aliases of the
hybrid strategy) with Lightning's ``StrategyRegistry``."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.strategies.helix import HelixParallelStrategy
from lightning_parallel.strategies.hybrid import HybridParallelStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy

__all__ = ["HelixParallelStrategy", "HybridParallelStrategy", "PipelineParallelStrategy"]

for _cls in (HybridParallelStrategy, PipelineParallelStrategy, HelixParallelStrategy):
    StrategyRegistry.register(_cls.strategy_name, _cls, description=_cls.strategy_description, override=True)
StrategyRegistry.register(
    "tensor_parallel",
    HybridParallelStrategy,
    description="lightning-parallel: tensor parallelism over all devices (Megatron-style, on DTensor)",
    override=True,
    data_parallel_size=1,
    tensor_parallel_size="auto",
)
StrategyRegistry.register(
    "sequence_parallel",
    HybridParallelStrategy,
    description="lightning-parallel: sequence (context) parallelism over all devices (Ulysses; or ring)",
    override=True,
    data_parallel_size=1,
    sequence_parallel_size="auto",
)
