"""A mixture's load-balancing loss (transformers' ``load_balancing_loss_func``, Switch Transformer's
``E · Σ_e f_e · P_e``: a product of two means over the batch's tokens) under every layout that splits the batch's
tokens over ranks: each rank computes it over every rank's router logits (lightning_parallel/anatomy/router_losses.py), as
one process does (Mixtral, ``output_router_logits=True``, coefficient 0.5 so that a wrong loss shows)."""

from __future__ import annotations

import pytest

from lightning_parallel import HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.parity import assert_parity

pytest.importorskip("transformers")

ROW = "hf:mixtral@batched_mm+aux"


@pytest.mark.parametrize("ep", [1, 2])
def test_over_data_parallel_replicas_with_and_without_expert_parallelism(ep):
    """dp=2 (ep=1 and 2), float64: SGD, because transformers sums the router probabilities in float32 whatever the
    model's dtype and the replicas' tokens come in another order than one process's, so the loss agrees to
    float32's rounding: Adam turns that into updates 1e-8 off, SGD keeps the contract's 1e-9."""
    strategy = lambda: HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=ep)  # noqa: E731
    assert_parity(ROW, strategy, 2, data_parallel_size=2, optimizer="sgd")


@pytest.mark.parametrize(
    "kwargs",
    [dict(sequence_parallel_size=2), dict(tensor_parallel_size=2),
     pytest.param(dict(sequence_parallel_size=2, data_parallel_size=2), marks=pytest.mark.slow),
     pytest.param(dict(sequence_parallel_size=2, data_parallel_size=2, expert_parallel_size=4), marks=pytest.mark.slow)],
)  # fmt: skip
def test_over_sequence_shards_and_under_tensor_parallelism(kwargs):
    """Sequence shards (their gradients summed: a shard's logits count once; also with ep over replicas and shards)
    and tensor parallelism (the blocks' verification copies no longer add their router logits to the model's): float32, SGD (Mixtral's norms compute in
    float32, so these layouts are float32-exact without the loss too)."""
    world = 4 if kwargs.get("data_parallel_size") else 2
    dp = kwargs.get("data_parallel_size", 1)
    assert_parity(ROW, lambda: HybridParallelStrategy(**kwargs), world, data_parallel_size=dp, dtype="float32")


def test_under_a_pipeline_it_is_refused():
    """Each stage's layers run on their own ranks, so the last stage cannot read every layer's router logits."""
    with pytest.raises(Exception, match=r"has output_router_logits=True: its load-balancing loss reads every layer's"):
        assert_parity(ROW, lambda: PipelineParallelStrategy(pipeline_parallel_size=2), 2, data_parallel_size=1)
