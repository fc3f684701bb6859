"""Blocks compiled in the model (``torch.compile`` per layer, torchtitan's practice and Lightning's docs for
ModelParallelStrategy) train under every strategy, with parity to the compiled one-process run, and their
parameters keep the compiled model's names. Where the layout keeps a block whole and local (pipeline, full
sharding, no recomputation) the composed block is compiled again with the user's compile (backend and options);
under tensor or sequence parallelism and HelixPipe it runs eagerly (said once). Compiled with ``backend="eager"``
here (dynamo's capture without code generation: the same graphs and guards, and a CPU test does not wait for a
compiler), through a backend that counts the calls of its graphs on each rank. They were refused with "the blocks of trunk ...
(OptimizedModule) take no hidden-state argument"."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.parity import assert_parity

_CALLS: list[int] = []  # calls of graphs the user's backend compiled, in this process


def _counting_eager(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """``backend="eager"`` (the captured graph run as it is) that counts the calls of the graphs it returns (a
    forked rank may reuse the reference run's compiled graphs: calls, not compilations, show they run)."""

    def run(*args: Any) -> Any:
        _CALLS.append(len(gm.graph.nodes))
        return gm.forward(*args)

    return run


def _build(model, batch_size, optimizer, seed=0):  # type: ignore[no-untyped-def]
    from examples.data import CharDataModule
    from examples.models import GPT
    from tests.helpers.parity import MODEL_KWARGS, SEQ_LEN

    torch.manual_seed(seed)
    data = CharDataModule(block_size=SEQ_LEN, batch_size=batch_size, shuffle=False)
    module = GPT(vocab_size=data.vocab_size, block_size=SEQ_LEN,
                 **dict(MODEL_KWARGS["gpt"], n_layer=4, optimizer=optimizer, lr=1e-3))  # fmt: skip
    blocks = module.transformer.h
    for i in range(len(blocks)):
        blocks[i] = torch.compile(blocks[i], backend=_counting_eager)
    return module, data


LAYOUTS = {  # (strategy, dp, whether the blocks run compiled)
    "pipeline": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2), 1, True),
    "dp2 full": (lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="full"), 2, True),
    "helix": (lambda: HelixParallelStrategy(pipeline_parallel_size=2), 1, False),
    "tp2": (lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 1, False),
    "ulysses2": (lambda: HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2), 1, False),
}


class _CountGraphs(L.Callback):
    """On each rank: compiled graphs ran in training (the composed blocks compiled again) or none did (eager)."""

    def __init__(self, compiled: bool) -> None:
        self.compiled, self.before = compiled, 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.before = len(_CALLS)  # (a forked rank inherits the reference run's count)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        made = _CALLS[self.before :]
        assert bool(made) == self.compiled, (made, self.compiled)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_blocks_train_with_parity_to_the_compiled_run(layout, monkeypatch):
    from tests.helpers import parity

    monkeypatch.setattr(parity, "build", _build)
    make, dp, compiled = LAYOUTS[layout]
    per_rank = assert_parity("gpt-compiled-blocks", make, 2, data_parallel_size=dp, steps=2,
                             callbacks=lambda: [_CountGraphs(compiled)])  # fmt: skip
    assert any("_orig_mod." in name for name in per_rank[0].params[-1]), list(per_rank[0].params[-1])[:5]
