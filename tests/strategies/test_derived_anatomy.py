"""With the hand-written adapters switched off, the example models train exactly under every strategy
through the derived anatomy alone (the traced graph), and the anatomy that served is the traced one."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.parity import assert_parity

COLUMNS = {
    "pipeline": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), 1),
    "helix": (lambda: HelixParallelStrategy(pipeline_parallel_size=2), 1),
    "tensor_parallel": (lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 1),
    "ulysses": (lambda: HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2), 1),
    "ring": (
        lambda: HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2, sequence_parallel_mode="ring"),
        1,
    ),
    "hybrid": (lambda: HybridParallelStrategy(data_parallel_size=2, recompute="no_attention", mlp_chunks=2), 2),
}


class ServedBy(L.Callback):
    """Fails the run unless every composed block (or helix split) came from ``expected``."""

    def __init__(self, expected: str) -> None:
        self.expected = expected

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        names = [s.name for s in getattr(strategy, "_splits", [])]
        blocks = getattr(strategy, "_blocks", None)
        names += [r.anatomy_name for r in blocks.runners.values()] if blocks is not None else []
        names = [n for n in names if n is not None]
        if names and set(names) != {self.expected}:
            raise AssertionError(f"blocks were served by {sorted(set(names))}, not {self.expected!r}")


def _without_adapters(make):
    def factory():
        from lightning_parallel.anatomy import resolve

        resolve.SOURCES = tuple(s for s in resolve.SOURCES if s != "adapters")  # this rank only (forked)
        return make()

    return factory


@pytest.mark.parametrize("column", list(COLUMNS))
@pytest.mark.parametrize(
    "model", ["gpt", pytest.param("llama", marks=pytest.mark.slow), pytest.param("encoder", marks=pytest.mark.slow)]
)
def test_example_models_through_the_traced_graph_alone(model, column):
    make, dp = COLUMNS[column]
    assert_parity(model, _without_adapters(make), 2, data_parallel_size=dp,
                  callbacks=lambda: [ServedBy("the traced graph")])  # fmt: skip
