"""lightning-parallel: pipeline, tensor and sequence parallelism for unchanged LightningModules.

Importing this package registers the strategy names (``Trainer(strategy="hybrid")``) with
Lightning's ``StrategyRegistry`` (Lightning has no entry-point discovery for strategies) and installs the
patches of :mod:`lightning_parallel.lightning_patches`: Lightning's loaders read sharded checkpoint
directories, ``ThroughputMonitor`` counts data-parallel replicas, and Lightning's ``grad_norm`` refuses where
it would see part of the model.
"""

from lightning_parallel import lightning_patches
from lightning_parallel.blocks import apply_recompute
from lightning_parallel.mesh import AXES, ParallelDims
from lightning_parallel.pretrained import load_pretrained
from lightning_parallel.strategies import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy

lightning_patches.install()

__all__ = [
    "AXES", "HelixParallelStrategy", "HybridParallelStrategy", "ParallelDims", "PipelineParallelStrategy",
    "apply_recompute", "load_pretrained",
]  # fmt: skip
__version__ = "0.1.0"
