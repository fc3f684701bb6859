"""lightning-parallel: pipeline, tensor and sequence parallelism for unchanged LightningModules.

Importing this package registers the strategy names (``Trainer(strategy="hybrid")``) with Lightning's
``StrategyRegistry`` (Lightning has no entry-point discovery for strategies) and lets Lightning's loaders read
sharded checkpoint directories (:mod:`lightning_parallel.lightning_patches`; the other patches wait until one of
these strategies sets up). The names below are the public surface: the strategies, the callbacks, the errors
(:mod:`lightning_parallel.errors` states which is raised when) and the helpers a LightningModule calls.
"""

from lightning_parallel import lightning_patches
from lightning_parallel.blocks import apply_recompute
from lightning_parallel.callbacks import BubbleProfiler, MemoryProfiler
from lightning_parallel.errors import (
    AnatomyError,
    CheckpointError,
    ConfigurationError,
    TrunkCallError,
    VerificationError,
)
from lightning_parallel.mesh import AXES, ParallelDims
from lightning_parallel.pretrained import load_pretrained
from lightning_parallel.strategies import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy

lightning_patches.install_loading()

__all__ = [
    "AXES", "AnatomyError", "BubbleProfiler", "CheckpointError", "ConfigurationError", "HelixParallelStrategy",
    "HybridParallelStrategy", "MemoryProfiler", "ParallelDims", "PipelineParallelStrategy", "TrunkCallError",
    "VerificationError", "apply_recompute", "load_pretrained",
]  # fmt: skip
__version__ = "0.1.0"
