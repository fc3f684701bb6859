"""Data parallelism's gradient buckets, issued during the backward (``strategies/_overlap.py``): parity with one
process whatever the bucket size (one bucket per parameter, or everything in one), with accumulation and with a
parameter the backward never reaches; and the buckets really go during the backward."""

import pytest
import torch

from lightning_parallel import HybridParallelStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_parity, build
from tests.helpers.trainers import quick_fit


@pytest.mark.parametrize("cap", [1e-4, 25.0])
def test_buckets_give_one_process_training(cap):
    assert_parity("llama", lambda: HybridParallelStrategy(data_parallel_size=2, bucket_cap_mb=cap), 2,
                  data_parallel_size=2, optimizer="adamw", steps=3)  # fmt: skip


def test_buckets_with_accumulation_and_clipping():
    assert_parity("gpt", lambda: HybridParallelStrategy(data_parallel_size=2, bucket_cap_mb=1e-4), 2,
                  data_parallel_size=2, steps=2, accumulate_grad_batches=2, gradient_clip_val=0.05)  # fmt: skip


def _issued(rank: int, world: int, cap: float, unused: bool) -> tuple[int, int, list[float]]:
    torch.set_default_dtype(torch.float64)
    module, data = build("gpt", 4, "sgd")
    if unused:  # a parameter in the middle of the model that no step reaches: its bucket never completes during
        # the backward, so every bucket after it waits for the optimizer step
        module.transformer.h[3].register_parameter("unused", torch.nn.Parameter(torch.ones(3)))
    strategy = HybridParallelStrategy(data_parallel_size=2, bucket_cap_mb=cap)
    quick_fit(module, data, strategy, world, steps=3, use_distributed_sampler=False)
    buckets = strategy._buckets
    params = [p.detach().sum().item() for p in module.parameters()]
    return buckets.issued_in_backward, len(buckets.buckets), params


def test_buckets_are_issued_during_the_backward():
    (issued, n, params0), (issued1, _, params1) = run_distributed(_issued, 2, 1e-4, False, init_process_group=False)
    assert n > 10 and issued == issued1 == 2 * n  # steps 2 and 3 (buckets are made at the first step's average)
    assert params0 == params1  # the replicas stayed equal


def test_a_parameter_the_backward_never_reaches_holds_the_later_buckets_back():
    (issued, n, params0), (_, _, params1) = run_distributed(_issued, 2, 1e-4, True, init_process_group=False)
    assert 0 < issued < 2 * n  # the buckets before the unused parameter's went during the backward
    assert params0 == params1
