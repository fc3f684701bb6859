"""The patches to Lightning under lightning-parallel, each where a Lightning idiom would otherwise fail or be
silently partial:

- :mod:`.loading`: ``load_from_checkpoint`` and Lightning's own strategies read a sharded checkpoint directory.
  Installed when the package is imported: a process that loads a checkpoint may never set up one of this
  package's strategies, and Lightning has no hook for its loaders;
- :mod:`.throughput`: ``ThroughputMonitor`` counts data-parallel replicas, not every model-parallel rank;
- :mod:`.grad_norm`: Lightning's ``grad_norm`` refuses where it would see one stage's part of the model.
  These two are installed by :func:`install` when one of this package's strategies sets up its processes
  (``setup_environment``, before Lightning calls the callbacks' ``setup``): a run without them is unchanged.
"""

from lightning_parallel.lightning_patches import grad_norm, loading, throughput


def install() -> None:
    """Install every patch (idempotent)."""
    loading.install()
    throughput.install()
    grad_norm.install()


__all__ = ["install", "loading"]
