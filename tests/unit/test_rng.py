"""lightning_parallel.rng without a process group, on CPU and (marked ``gpu``) on CUDA: two tensor-parallel ranks are
played in one process from the same generator state (a rank is only its offset), so that what the ranks would
draw can be compared. The multi-process tests are tests/strategies/test_dropout_rng.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_parallel import rng
from lightning_parallel.tensor_parallel import _dropout_regions

P = 0.1
INDEPENDENT = (1 - P) ** 2 + P**2
TOL = 0.03
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class _Mesh:
    """A tensor-parallel mesh as the regions see it: this rank's place in it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def get_local_rank(self) -> int:
        return self.rank


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def _attention_mask(device: str) -> torch.Tensor:
    """The keep mask SDPA's dropout draws (whatever kernel runs): uniform scores, v the identity, so that each
    output element is its probability's mask over T(1-p)."""
    T = 64
    q = torch.zeros(4, 4, T, T, device=device)
    v = torch.eye(T, device=device).expand(4, 4, T, T)
    return F.scaled_dot_product_attention(q, q, v, dropout_p=P) != 0


def _as_ranks(device: str, run) -> list:
    """``run(rank)`` for ranks 0 and 1, each from the same generator states (as every rank of a group starts)."""
    start = rng.states(torch.device(device))
    out = []
    for rank in (0, 1):
        rng.restore(start, torch.device(device))
        out.append(run(rank))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_forked_streams_are_independent_per_rank_and_leave_the_ranks_in_step(device):
    def run(rank):
        with rng.forked(rank, torch.device(device)):
            drawn = (F.dropout(torch.ones(64, 1024, device=device), P) != 0, _attention_mask(device))
        return drawn, torch.rand(8), torch.rand(8, device=device)

    start = rng.states(torch.device(device))
    ((dropout0, attention0), cpu0, dev0), ((dropout1, attention1), cpu1, dev1) = _as_ranks(device, run)
    for a, b in ((dropout0, dropout1), (attention0, attention1)):
        assert abs(_agreement(a, b) - INDEPENDENT) < TOL, _agreement(a, b)
    assert torch.equal(cpu0, cpu1) and torch.equal(dev0, dev1)  # the default generators: in step afterwards
    rng.restore(start, torch.device(device))
    ((again, _), _, _), _ = _as_ranks(device, run)
    assert torch.equal(again, dropout0)  # the same seed, the same masks


def _column_row(device: str) -> nn.Module:
    """Column-parallel -> dropout -> row-parallel -> dropout, with the hooks tensor_parallel.shard_modules installs."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 256), nn.Dropout(P), nn.Linear(256, 32), nn.Dropout(P)).to(device)
    _dropout_regions([block[0]], [block[2]])
    return block


def _run_block(block: nn.Module, rank: int, device: str) -> tuple:
    seen = []
    handles = [block[i].register_forward_hook(lambda m, a, out: seen.append(out != 0)) for i in (1, 3)]
    x = torch.randn(16, 64, 32, device=device)
    with rng.tensor_parallel_rng(block, _Mesh(rank), torch.device(device)):
        with rng.sharded():  # an attention core inside the same scope: heads sharded
            attention = _attention_mask(device)
        y = block(x)
    for h in handles:
        h.remove()
    return seen[0], seen[1], attention, y, torch.rand(8, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_regions_draw_per_rank_and_replicated_ones_alike(device):
    block = _column_row(device).train()
    assert rng.has_dropout(block)
    (hidden0, out0, attention0, y0, after0), (hidden1, out1, attention1, y1, after1) = _as_ranks(
        device, lambda rank: _run_block(block, rank, device)
    )
    for a, b in ((hidden0, hidden1), (attention0, attention1)):
        assert abs(_agreement(a, b) - INDEPENDENT) < TOL, _agreement(a, b)
    assert torch.equal(out0, out1)  # after the row-parallel projection: replicated, the same mask
    assert torch.equal(after0, after1)
    block.eval()  # outside training no region opens and nothing is drawn
    before = rng.states(torch.device(device))
    with rng.tensor_parallel_rng(block, _Mesh(0), torch.device(device), inside=True):
        assert rng._REGION.get() is None
    assert all(torch.equal(before[k], rng.states(torch.device(device))[k]) for k in before)


@pytest.mark.parametrize("device", DEVICES)
def test_recomputation_replays_each_ranks_masks(device):
    block = _column_row(device).train()
    x = torch.randn(16, 64, 32, device=device, requires_grad=True)

    def forward(x, rank):
        with rng.tensor_parallel_rng(block, _Mesh(rank), torch.device(device)):
            return block(x)

    for rank in (0, 1):
        start = rng.states(torch.device(device))
        forward(x, rank).square().sum().backward()
        direct, x.grad = x.grad, None
        rng.restore(start, torch.device(device))
        checkpoint(forward, x, rank, use_reentrant=False).square().sum().backward()
        torch.testing.assert_close(x.grad, direct, rtol=0, atol=0)
        x.grad = None


@pytest.mark.parametrize("device", DEVICES)
def test_states_round_trip(device):
    saved = rng.states(torch.device(device))
    assert set(saved) == ({"cpu"} if device == "cpu" else {"cpu", device})
    first = torch.rand(4), torch.rand(4, device=device)
    rng.restore(saved, torch.device(device))
    second = torch.rand(4), torch.rand(4, device=device)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
