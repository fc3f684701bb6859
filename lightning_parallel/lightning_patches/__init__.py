"""The patches to Lightning that importing lightning-parallel installs, each where a Lightning idiom would
otherwise fail or be silently partial under these strategies:

- :mod:`.loading`: ``load_from_checkpoint`` and Lightning's own strategies read a sharded checkpoint directory;
- :mod:`.throughput`: ``ThroughputMonitor`` counts data-parallel replicas, not every model-parallel rank;
- :mod:`.grad_norm`: Lightning's ``grad_norm`` refuses where it would see one stage's part of the model.
"""

from lightning_parallel.lightning_patches import grad_norm, loading, throughput


def install() -> None:
    """Install every patch (idempotent)."""
    loading.install()
    throughput.install()
    grad_norm.install()


__all__ = ["install"]
