"""A block that writes into a fresh tensor (DeepSeek-V3's keys: ``new_empty``, then ``copy_`` into two slices of
the head dim): its trace is taken to functional form, so the writes are edges the cut can follow. Cut at its
attention call, its parts reproduce the block, output and gradients; without the functional form the writes
would land after attention (the keys read before they are written)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.anatomy.traced import program as traced_program
from lightning_parallel.anatomy.traced.analysis import analyse
from lightning_parallel.anatomy.traced.regions import split
from lightning_parallel.errors import Unsupported


class _WrittenKeys(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, nope: int = 6, rope: int = 2) -> None:
        super().__init__()
        self.heads, self.nope, self.rope = heads, nope, rope
        self.q = nn.Linear(dim, heads * (nope + rope))
        self.kv = nn.Linear(dim, heads * nope + rope)  # per-head key parts and one shared part
        self.v = nn.Linear(dim, heads * 8)
        self.o = nn.Linear(heads * 8, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, -1).transpose(1, 2)
        k_nope, k_rot = self.kv(x).split([self.heads * self.nope, self.rope], dim=-1)
        k_nope = k_nope.view(B, T, self.heads, self.nope).transpose(1, 2)
        k_rot = k_rot.view(B, 1, T, self.rope).expand(-1, self.heads, -1, -1)
        k = k_nope.new_empty(B, self.heads, T, self.nope + self.rope)
        k[..., : self.nope].copy_(k_nope)
        k[..., self.nope :].copy_(k_rot)
        v = self.v(x).view(B, T, self.heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(B, T, -1))


class _Config:
    mlp_chunks, mlp_module = 1, None


def _split(monkeypatch=None):
    torch.manual_seed(0)
    block = _WrittenKeys().double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    program = traced_program.trace(block, x, (), {})
    return block, x, program, split(program, analyse(program), _Config(), "_WrittenKeys")


def test_the_trace_of_a_write_into_a_fresh_tensor_is_functional_and_cut_exactly():
    block, x, program, parts = _split()
    assert not traced_program._writes_in_place(program.graph)
    xs = x.clone().requires_grad_(True)
    (q, k, v), state = parts.pre(block, xs, (), {})
    y = parts.post(block, parts.attention(block, q, k, v, (), {}), state, (), {})
    y = y if isinstance(y, torch.Tensor) else y[0]
    xr = x.clone().requires_grad_(True)
    want = block(xr)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    got = torch.autograd.grad(y, [xs, *block.parameters()], grad)
    ref = torch.autograd.grad(want, [xr, *block.parameters()], grad)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_without_the_functional_form_the_cut_is_refused(monkeypatch):
    monkeypatch.setattr(traced_program, "_writes_in_place", lambda graph: False)
    try:
        _split()
    except Unsupported as err:
        assert "after attention" in str(err)
    else:
        raise AssertionError("the cut of a graph with in-place writes was accepted")
