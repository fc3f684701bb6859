"""Lightning's ``ThroughputMonitor`` under model parallelism: its global samples, batches, items and FLOPs per
second multiply one device's by ``trainer.world_size``, which counts every pipeline, tensor- and
sequence-parallel rank as a replica (x2 at pp=2: every rank of a replica sees the same batch). A strategy of
this package, as it sets up its processes (before the callbacks' ``setup``), wraps ``ThroughputMonitor.setup``
(a method of the class, so every instance, however imported) so that under these strategies its counters
multiply by the number of data-parallel replicas; with one replica it reports, like one device, the device
values only."""

from __future__ import annotations

from typing import Any


def install() -> None:
    from lightning.pytorch.callbacks import ThroughputMonitor

    original = ThroughputMonitor.setup
    if getattr(original, "wrapped", None) is not None:
        return

    def setup(self: Any, trainer: Any, pl_module: Any, stage: str) -> None:
        original(self, trainer, pl_module, stage)
        dims = getattr(trainer.strategy, "parallel_dims", None)
        if dims is not None:
            for throughput in self._throughputs.values():
                throughput.world_size = dims.dp  # replicas: each one's samples are counted once

    setup.wrapped = original  # type: ignore[attr-defined]
    ThroughputMonitor.setup = setup  # type: ignore[method-assign]
