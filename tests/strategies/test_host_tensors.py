"""No tensor the package makes on the host reaches a collective or a message (NCCL has no CPU backend): one parity
run per communication path under the host-tensor rule (``assert_parity(host_check=True)``: tests/helpers/comm_taint.py
marks what ``lightning_parallel/`` creates without a device, and every recorded op checks its tensors). The other
parity tests check NCCL's ordering rules only, for time."""

import pytest

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.parity import assert_parity

PATHS = {
    "1f1b pp2": ("llama", lambda: PipelineParallelStrategy(pipeline_parallel_size=2), 2, 1),
    "zbv pp2": ("llama", lambda: PipelineParallelStrategy(pipeline_parallel_size=2, schedule="zbv"), 2, 1),
    "helix p2": ("gpt", lambda: HelixParallelStrategy(pipeline_parallel_size=2), 2, 1),
    "tp2": ("llama", lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 2, 1),
    "sp2 ring": (
        "llama",
        lambda: HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2, sequence_parallel_mode="ring"),
        2,
        1,
    ),  # fmt: skip
    "dp2 buckets": ("gpt", lambda: HybridParallelStrategy(data_parallel_size=2, bucket_cap_mb=1e-4), 2, 2),
    "dp2 optimizer sharding": (
        "gpt",
        lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="optimizer"),
        2,
        2,
    ),  # fmt: skip
    "dp2 full sharding": (
        "gpt",
        lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="full"),
        2,
        2,
    ),  # fmt: skip
}


@pytest.mark.parametrize("path", list(PATHS))
def test_no_host_tensor_reaches_a_collective(path):
    model, strategy, world, dp = PATHS[path]
    assert_parity(model, strategy, world, data_parallel_size=dp, host_check=True)
