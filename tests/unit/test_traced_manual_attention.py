"""Attention written by hand (``q @ k^T``, a scale, an ALiBi bias, a causal mask buffer, softmax, ``@ v``) is recognised
in the traced graph as one SDPA call with the bias and mask as its additive mask (traced/manual.py); what the
pattern does not describe exactly is left alone (and then no attention is found). The coverage matrix's
``home:alibi`` row trains it under every strategy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.anatomy.traced import program as traced_program
from lightning_parallel.anatomy.traced.analysis import SDPA, analyse, attention_nodes
from lightning_parallel.anatomy.traced.manual import attention_bias
from lightning_parallel.errors import Unsupported
from tests.helpers.zoo import ALiBiBlock


def _trace(block: nn.Module):
    torch.manual_seed(0)
    block = block.double()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    return block, x, traced_program.trace(block, x, (), {})


def test_alibi_attention_becomes_one_sdpa_call_with_its_bias_and_mask():
    block, x, program = _trace(ALiBiBlock(32, 4))
    (sdpa,) = attention_nodes(program.graph)
    assert sdpa.target == SDPA and sdpa.kwargs["scale"] == pytest.approx(1 / math.sqrt(8))
    assert sdpa.args[3].target is attention_bias  # the slopes' bias and the causal mask, one additive mask
    assert analyse(program).heads == 4
    got, want = program(block, x, (), {}), block(x)
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class _LearnedBias(ALiBiBlock):
    """A bias that is a parameter (a learned relative-position table): HelixPipe's attention stage would need it."""

    def __init__(self, width: int, nh: int) -> None:
        super().__init__(width, nh)
        self.table = nn.Parameter(torch.zeros(nh, 64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, self.nh, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.hd) + self.table[:, :T, :T]
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        return x + self.o(y)


class _ScaledAfterTheBias(ALiBiBlock):
    """``(q k^T + bias) / c``: the scale also divides the bias, which SDPA's ``q k^T * c + mask`` would not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, self.nh, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        pos = torch.arange(T, device=x.device)
        bias = self.slopes.view(1, -1, 1, 1) * (pos[None, :] - pos[:, None]).to(x.dtype)
        scores = (q @ k.transpose(-2, -1) + bias) / math.sqrt(self.hd)
        y = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        return x + self.o(y)


@pytest.mark.parametrize("block", [_LearnedBias, _ScaledAfterTheBias])
def test_what_the_pattern_does_not_describe_is_left_alone(block):
    _, _, program = _trace(block(32, 4))
    assert not attention_nodes(program.graph)
    with pytest.raises(Unsupported, match="no attention call in its graph"):
        analyse(program)
