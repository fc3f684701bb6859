"""Expert parallelism's dispatch and combine (lightning_parallel/expert_parallel.py) against one process: a
transformers mixture's own MoE block, its experts split over 2 gloo ranks, each rank with its own tokens, in float64.
Every rank's output and input gradient, the router's gradient from its tokens, and each expert's gradient summed
over both ranks' tokens must be one process's (float64 at rtol 1e-9, the parity contract of docs/design.md)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from lightning_parallel.anatomy.experts import find_experts
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.expert_parallel import check_experts, shard_experts
from tests.helpers.distributed import run_distributed
from tests.helpers.zoo import hf_config

FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "llama4"]  # (Llama 4: dense experts, every token to each)


def _moe_block(family: str, experts: str) -> torch.nn.Module:
    """The last layer's MoE block of a two-layer model (DeepSeek-V3's first layer is dense), its experts run by
    transformers' ``experts`` implementation (float64: not ``grouped_mm``, which takes no float64 on CPU)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = hf_config(family, 64, 2)
    config._experts_implementation = experts
    model = AutoModelForCausalLM.from_config(config).double()
    layer = model.model.layers[-1]
    block = layer.feed_forward if family == "llama4" else layer.mlp
    for p in block.parameters():  # transformers' init leaves some MoE tensors at zero: every path must be seen
        torch.nn.init.normal_(p, std=0.2)
    return block


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(2, 5 + 2 * rank, 32, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64)


def _run(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weight).sum().backward()
    return out.detach(), x.grad


def _rank(rank: int, world: int, family: str, experts: str) -> None:
    block = _moe_block(family, experts)
    reference = _moe_block(family, experts)  # the same values: one process runs every rank's tokens
    expected = [_run(reference, _tokens(r)) for r in range(world)]
    expected_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    reference.zero_grad()
    mine_only = _run(reference, _tokens(rank))
    router_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}

    experts = block.get_submodule("experts")
    total = experts.num_experts
    assert find_experts(block) == [("experts", experts)]
    names = shard_experts(experts, init_device_mesh("cpu", (world,), mesh_dim_names=("dp_ep",)))
    assert (
        names and experts.num_experts == total // world and find_experts(block) == [("experts", experts)]
    )  # (sharded: still found)
    out, grad = _run(block, _tokens(rank))
    torch.testing.assert_close(out, expected[rank][0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, expected[rank][1], rtol=1e-9, atol=1e-12)
    assert torch.equal(mine_only[0], expected[rank][0])
    per = total // world
    for name, p in block.named_parameters():
        grad = p.grad
        if name.startswith("experts.") and name.split(".")[-1] in names:  # this rank's experts, every rank's tokens
            grad, want = grad.to_local(), expected_grads[name][rank * per : (rank + 1) * per]
        else:  # the router and any shared expert: this rank's tokens only
            want = router_grads[name]
        torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("experts", [pytest.param("eager", marks=pytest.mark.slow), "batched_mm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_split_over_two_ranks_compute_what_one_process_does(family, experts):
    pytest.importorskip("transformers")
    run_distributed(_rank, 2, family, experts, timeout=120)


def test_experts_that_do_not_divide_are_refused_naming_the_numbers():
    with pytest.raises(ConfigurationError, match=r"MixtralExperts has 6 experts, which expert_parallel_size=4 does"):
        check_experts(6, 4, "MixtralExperts")


def _one_sided(rank: int, world: int, experts_impl: str) -> None:
    """Every (token, choice) pair of both ranks goes to experts 0 and 1 (rank 0's): rank 1's experts get no row,
    and its experts' code returns zeros without history; both ranks must still run the reverse all-to-alls."""
    import copy

    experts = _moe_block("mixtral", experts_impl).get_submodule("experts")
    reference = copy.deepcopy(experts)
    x = _tokens(rank).reshape(-1, 32)
    index = torch.stack([torch.zeros(len(x), dtype=torch.long), torch.ones(len(x), dtype=torch.long)], 1)
    weights = torch.rand(len(x), 2, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    want = _run(lambda h: reference(h, index, weights), x)
    shard_experts(experts, init_device_mesh("cpu", (world,), mesh_dim_names=("dp_ep",)))
    got = _run(lambda h: experts(h, index, weights), x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("experts", ["eager", "batched_mm"])
def test_a_rank_whose_experts_get_no_row_still_joins_the_backward(experts):
    """(A hang otherwise: the peers wait in the reverse all-to-all the empty rank never runs.)"""
    pytest.importorskip("transformers")
    run_distributed(_one_sided, 2, experts, timeout=60)
