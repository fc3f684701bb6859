"""The ``hybrid`` strategy (data parallelism) against single-process training, and its Lightning plumbing."""

import pytest

from lightning_parallel import HybridParallelStrategy
from tests.helpers.parity import assert_parity

MODELS = ["gpt", "llama", "encoder"]


def _dp2() -> HybridParallelStrategy:
    return HybridParallelStrategy(data_parallel_size=2)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_dp2_parity(model, dtype):
    assert_parity(model, _dp2, 2, data_parallel_size=2, dtype=dtype)


@pytest.mark.parametrize("model", MODELS)
def test_dp2_parity_with_accumulation_and_clipping(model):
    assert_parity(model, _dp2, 2, data_parallel_size=2, steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05)


def test_dp2_by_registered_name():
    assert_parity("gpt", lambda: "hybrid", 2, data_parallel_size=2)
