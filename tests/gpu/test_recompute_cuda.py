"""CUDA paths of the recomputation policies: SDPA's CUDA kernels and flash-attn. Skipped without a GPU."""

import copy

import pytest
import torch

from examples.models.gpt import Block
from lightning_parallel.blocks import apply_recompute
from lightning_parallel.memory import LiveTensorTracker
from lightning_parallel.recompute import attention_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_no_attention_keeps_the_cuda_attention_kernel():
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([Block(128, 4, 0.0, True) for _ in range(2)]).cuda().bfloat16()
    reference = copy.deepcopy(holder)
    apply_recompute(holder, "no_attention", every_n=1)
    x = torch.randn(2, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with LiveTensorTracker() as tracker:
        holder.blocks[0](x).float().sum().backward()
    ran = {op for op in tracker.counts if op in attention_ops()}
    assert ran and all(tracker.counts[op] == 1 for op in ran), tracker.counts  # forward once, never re-run
    reference.blocks[0](x).float().sum().backward()
    for a, b in zip(holder.blocks[0].parameters(), reference.blocks[0].parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_flash_attn_ops_are_recognised_when_installed():
    pytest.importorskip("flash_attn")
    names = {str(op) for op in attention_ops()}
    assert any("flash_attn" in n for n in names), names
