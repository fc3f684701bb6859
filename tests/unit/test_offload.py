"""Activation offload (lightning_parallel/offload.py): what a policy keeps waits in host memory, the backward is
exact, and the kept ops are not run again. On CPU the copies go to (and come back from) the same memory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_parallel import offload
from lightning_parallel.blocks import BlockConfig, BlockLayer
from lightning_parallel.memory import LiveTensorTracker
from lightning_parallel.recompute import attention_ops, validate
from lightning_parallel.trunk import discover_trunk
from tests.helpers.parity import build


def _counted(monkeypatch) -> list[int]:
    made = [0]
    init = offload.HostCopy.__init__

    def counting(self, tensor, stream):
        made[0] += 1
        init(self, tensor, stream)

    monkeypatch.setattr(offload.HostCopy, "__init__", counting)
    return made


@pytest.mark.parametrize("policy", ["none", "selective", "no_attention"])
def test_offloaded_activations_give_the_same_gradients_and_go_to_the_host(policy, monkeypatch):
    torch.manual_seed(0)
    module, data = build("llama", 4, "sgd")
    module = module.double()
    idx, targets = next(iter(data.train_dataloader()))
    reference = copy.deepcopy(module)
    found = discover_trunk(module)
    BlockLayer(found, BlockConfig(recompute=policy, offload=True)).install(enumerate(found.blocks))
    made = _counted(monkeypatch)
    with LiveTensorTracker() as tracker:
        F.cross_entropy(module(idx).flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(reference(idx).flatten(0, 1), targets.flatten()).backward()
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)
    layers = len(found.blocks)
    assert made[0] >= layers, made  # every block kept something, in host memory
    attention = sum(n for op, n in tracker.counts.items() if op in attention_ops())
    assert attention == layers, attention  # kept (offloaded) attention is never run again, under any policy


def test_full_recomputation_has_nothing_to_offload():
    with pytest.raises(ValueError, match="recompute_offload=True moves what a policy keeps"):
        validate("full", 2, 1, offload=True)


def test_a_dtensor_goes_to_the_host_as_its_shard_and_comes_back_as_the_same_dtensor():
    """Tensor-parallel activations that autograd saves are DTensors: the host copy holds the local shard (on
    CUDA a pinned buffer takes it: a DTensor would not copy into a plain tensor) and returns the DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_parallel.offload import HostCopy
    from tests.helpers.distributed import run_distributed

    def rank(r: int, world: int) -> bool:
        mesh = init_device_mesh("cpu", (world,))
        x = DTensor.from_local(torch.arange(6.0).view(2, 3) + 10 * r, mesh, [Shard(0)], run_check=False)
        copy = HostCopy(x, None)
        assert not isinstance(copy.host, DTensor) and copy.host.shape == (2, 3)
        back = copy.back()
        assert isinstance(back, DTensor) and back.placements == x.placements and back.shape == x.shape == (4, 3)
        return torch.equal(back.to_local(), x.to_local()) and back.to_local().data_ptr() != x.to_local().data_ptr()

    assert run_distributed(rank, 2) == [True, True]


def test_parameters_and_their_views_are_not_copied():
    from lightning_parallel.offload import saved_to_host

    w = torch.nn.Parameter(torch.randn(3, 4))
    x = torch.randn(2, 3, requires_grad=True)
    packed = []
    hooks = saved_to_host()
    pack = hooks.pack_hook

    def spy(t):
        packed.append(pack(t))
        return packed[-1]

    with torch.autograd.graph.saved_tensors_hooks(spy, hooks.unpack_hook):
        y = x @ w  # saves x and w
        z = (x @ w.t().t()).sum()  # a view of the parameter
    (y.sum() + z).backward()
    assert any(p is w for p in packed) and not any(isinstance(p, torch.Tensor) and p is x for p in packed)
    views = [p for p in packed if isinstance(p, torch.Tensor) and p is not w]
    assert views and all(v._base is w for v in views)
