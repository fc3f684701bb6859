"""Lightning callbacks that observe parallel training: the pipeline bubble and memory per stage."""

from lightning_parallel.callbacks.bubble import BubbleProfiler
from lightning_parallel.callbacks.memory_profiler import MemoryProfiler

__all__ = ["BubbleProfiler", "MemoryProfiler"]
