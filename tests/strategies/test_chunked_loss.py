"""``loss_chunks=``: the LM head and the step's cross-entropy over chunks of tokens under every strategy, for
unchanged modules (a ``training_step`` calling ``F.cross_entropy`` on the head's output, and a Hugging Face
model computing its loss from ``labels=``); vocabulary-parallel under tensor parallelism. Parity with one
process, which computes the whole logits; refused where there is no head to chunk."""

from __future__ import annotations

import pytest

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.parity import assert_parity, build
from tests.helpers.trainers import quick_fit

STRATEGIES = {
    "tensor_parallel": (lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, loss_chunks=3), 1),
    "pipeline": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4, loss_chunks=3), 1),
    "helix": (lambda: HelixParallelStrategy(pipeline_parallel_size=2, loss_chunks=3), 1),
    "ring": (
        lambda: HybridParallelStrategy(sequence_parallel_size=2, sequence_parallel_mode="ring", loss_chunks=3),
        1,
    ),
    "hybrid": (lambda: HybridParallelStrategy(data_parallel_size=2, loss_chunks=3), 2),
}
FAST = {("gpt", "tensor_parallel"), ("gpt", "pipeline"), ("packed:hf:llama", "tensor_parallel")}


@pytest.mark.parametrize(
    "model, column",
    [
        pytest.param(m, c, marks=() if (m, c) in FAST else pytest.mark.slow)
        for m in ("gpt", "packed:hf:llama")
        for c in STRATEGIES
    ],
)
def test_the_chunked_head_and_loss_match_one_process(model, column):
    if model.startswith("packed:hf"):
        pytest.importorskip("transformers")
    make, dp = STRATEGIES[column]
    # the example GPT in float64 with AdamW; Hugging Face computes its loss in float32 (``logits.float()``)
    dtype = "float32" if model.startswith("packed:hf") else "float64"
    assert_parity(model, make, 2, data_parallel_size=dp, dtype=dtype)


def _fit(rank, world_size, model, strategy):
    module, data = build(model, 8, "sgd")
    quick_fit(module, data, strategy(), world_size, steps=1)


@pytest.mark.parametrize(
    "model, strategy, message",
    [
        ("encoder", lambda: HybridParallelStrategy(data_parallel_size=2, loss_chunks=2), "found no head"),
        (
            "gpt-direct-head",
            lambda: PipelineParallelStrategy(pipeline_parallel_size=2, loss_chunks=2),
            "the training step never called the LM head",
        ),  # fmt: skip
        (
            "gpt",
            lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="full", loss_chunks=2),
            "made it an FSDP unit",
        ),  # fmt: skip
    ],
)
def test_a_head_that_cannot_be_chunked_is_refused_on_every_rank(model, strategy, message):
    with pytest.raises(RankFailed, match=message):
        run_distributed(_fit, 2, model, strategy, init_process_group=False)


def test_loss_chunks_must_be_a_positive_int():
    with pytest.raises(ValueError, match="loss_chunks must be a positive int"):
        HybridParallelStrategy(loss_chunks=0)
