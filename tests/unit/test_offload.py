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
