"""Blocks compiled in the model (``torch.compile`` per layer, torchtitan's practice and Lightning's docs for
ModelParallelStrategy) train under the strategies that split or shard blocks, with parity to the compiled
one-process run: the strategy runs the blocks behind the wrappers eagerly (said once), and their parameters keep
the compiled model's names. Compiled with ``backend="eager"`` here (dynamo's capture without code generation: the
wrapper is the same ``OptimizedModule``, and a CPU test does not wait for a compiler). They were refused with "the
blocks of trunk ... (OptimizedModule) take no hidden-state argument"."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.parity import assert_parity


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
        blocks[i] = torch.compile(blocks[i], backend="eager")
    return module, data


LAYOUTS = {
    "pipeline": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2), 1),
    "helix": (lambda: HelixParallelStrategy(pipeline_parallel_size=2), 1),
    "tp2": (lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 1),
    "ulysses2": (lambda: HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2), 1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_blocks_train_with_parity_to_the_compiled_run(layout, monkeypatch):
    from tests.helpers import parity

    monkeypatch.setattr(parity, "build", _build)
    make, dp = LAYOUTS[layout]
    per_rank = assert_parity("gpt-compiled-blocks", make, 2, data_parallel_size=dp, steps=2)
    assert any("_orig_mod." in name for name in per_rank[0].params[-1]), list(per_rank[0].params[-1])[:5]
