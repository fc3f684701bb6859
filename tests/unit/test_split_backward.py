"""The backward split into an input-gradient (I) and a weight-gradient (W) call, single process: both
together give the gradients of one backward, I computes no weight gradient, and a recomputed block's
forward runs once for both (``shared_checkpoint``), under every policy."""

import copy

import pytest
import torch

from lightning_parallel.blocks import apply_recompute
from lightning_parallel.memory import LiveTensorTracker
from lightning_parallel.pipeline.split_backward import backward_input
from lightning_parallel.recompute import POLICIES
from lightning_parallel.trunk import discover_trunk
from tests.unit.test_recompute import FLASH, TOL, _batch, _grads, _loss, _model


def _split_grads(model, name, batch, seed=0):
    """One backward as I (to the first block's input, made a leaf by a pre-hook) then W; returns the
    gradients, and which trunk parameters already had one after I."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    blocks = discover_trunk(model).blocks
    seen = {}

    def leaf_input(module, args):
        seen["input"] = args[0]
        seen["leaf"] = args[0].detach().requires_grad_(True)
        return (seen["leaf"], *args[1:])

    handle = blocks[0].register_forward_pre_hook(leaf_input)
    try:
        loss = _loss(model, name, batch)
    finally:
        handle.remove()
    (grad_in,), work = backward_input([loss], [None], [seen["leaf"]])
    early = [n for b in blocks for n, p in b.named_parameters() if p.grad is not None]
    work.then.append((seen["input"], grad_in))
    work.run()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, early


@pytest.mark.parametrize("name", ["gpt", "llama", "encoder"])
@pytest.mark.parametrize("policy", POLICIES)
def test_input_then_weight_gradients_equal_one_backward(name, policy):
    model, batch = _model(name), _batch(name)
    want = _grads(model, name, batch)
    wrapped = apply_recompute(copy.deepcopy(model), policy, every_n=2, split_backward=True)
    got, early = _split_grads(wrapped, name, batch)
    assert early == []  # the input-gradient call computed no weight gradient of the trunk
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m, n=n: f"{name} {policy}: {n}: {m}")


@pytest.mark.parametrize("policy,attention_runs", [("full", 8), ("no_attention", 4), ("selective", 4)])
def test_one_recomputation_serves_both_calls(policy, attention_runs):
    name, batch = "gpt", _batch("gpt")
    model = apply_recompute(_model(name), policy, split_backward=True)
    with LiveTensorTracker() as tracker:
        _split_grads(model, name, batch)
    # 4 blocks: the forward, plus one re-run per block under "full" (torch's checkpoint re-runs per call)
    assert tracker.counts[FLASH] == attention_runs
    plain = apply_recompute(_model(name), policy)
    with pytest.raises(Exception, match="already unpacked|unpacked once"):
        with torch.utils.checkpoint.GraphExecGroup():
            _split_grads(plain, name, batch)


class _Tied(torch.nn.Module):
    """A weight used twice on the input's path (a tied pair inside one chunk), each use with its own bias."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 6, dtype=torch.float64))
        self.b1 = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
        self.b2 = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))

    def forward(self, x):
        h = torch.relu(torch.nn.functional.linear(x, self.weight, self.b1))
        return torch.nn.functional.linear(h, self.weight.t(), self.b2) * x


def test_a_weight_used_twice_is_counted_once_whatever_the_grouping():
    # the grouping of weights follows set order (memory addresses): build afresh many times
    for seed in range(30):
        torch.manual_seed(seed)
        module, x = _Tied(), torch.randn(3, 6, dtype=torch.float64)
        leaf = x.clone().requires_grad_(True)
        module(leaf).sum().backward()
        want = [p.grad.clone() for p in module.parameters()] + [leaf.grad.clone()]
        module.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_(True)
        (grad_in,), work = backward_input([module(leaf).sum()], [None], [leaf])
        work.run()
        got = [p.grad for p in module.parameters()] + [grad_in]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL)


def test_weight_gradients_do_not_walk_the_input_path_again():
    # W starts from the gradients kept at each weight's node and reaches its own weights only: one product
    # per linear layer, and nothing of the input gradient's path between them (the GELU's backward)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).double()
    leaf = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    (grad_in,), work = backward_input([block(leaf).sum()], [None], [leaf])
    with Ops() as ops:
        work.run()
    assert "gelu_backward" not in ops.names
    assert sum(name in ("mm", "addmm", "bmm") for name in ops.names) == 2, ops.names
    want = torch.autograd.grad(block(leaf).sum(), [leaf, *block.parameters()])
    for g, w in zip([grad_in, *(p.grad for p in block.parameters())], want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
