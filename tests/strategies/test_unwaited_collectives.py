"""No asynchronous collective is left unwaited: a Hugging Face model's tensor-parallel plan makes DTensor redistribute
module outputs with ``async_op=True``, and a pipeline stage recomputes and drops the trunk's input (its capture,
its substitute passes), so nothing used those outputs and their collectives stayed registered, each holding its
output, until the process ended: torch warned "there are still N unwaited collective calls" (25 on stage 0 and
13 on stage 1 after 3 steps of HelixPipe x tp=2, growing every step). The pipeline waits on what it drops
(``pipeline.capture.settled``); c10d's registry of works is empty after training on every rank."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel import HelixParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import run_distributed

LAYOUTS = {
    "helix p=2 x tp=2": lambda: HelixParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2),
    "pipeline pp=2 x tp=2": lambda: PipelineParallelStrategy(
        pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2
    ),  # fmt: skip
}


def _registered_after_fit(rank: int, world_size: int, layout: str) -> int:
    from examples.data import CharDataModule
    from tests.helpers.models import HFCausalLM
    from tests.helpers.trainers import quick_fit

    torch.manual_seed(0)
    data = CharDataModule(block_size=16, batch_size=4, shuffle=False)
    quick_fit(HFCausalLM("llama", vocab_size=data.vocab_size, num_layers=4), data, LAYOUTS[layout](), world_size,
              steps=3)  # fmt: skip
    return int(torch._C._distributed_c10d._get_work_registry_size())


@pytest.mark.parametrize("layout", ["helix p=2 x tp=2", pytest.param("pipeline pp=2 x tp=2", marks=pytest.mark.slow)])
def test_no_collective_is_left_unwaited(layout):
    registered = run_distributed(_registered_after_fit, 4, layout, init_process_group=False, timeout=240)
    assert registered == [0, 0, 0, 0], registered
