"""The chunked MLP joins its slices' outputs as the whole sequence's (lightning_parallel/mlp_chunks.py): the
hidden state along the sequence, a mixture of experts' router scores flattened batch-first (GPT-OSS's MLP
returns both), None as None; an output that is not one value per token is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.mlp_chunks import chunk_mlp, unchunk_mlps


class _Routed(nn.Module):
    """A token-wise MLP returning (hidden, router scores of shape (B*T, E)) as GPT-OSS's does."""

    def __init__(self, extra: str = "scores") -> None:
        super().__init__()
        self.router, self.proj, self.extra = nn.Linear(8, 3), nn.Linear(8, 8), extra

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        scores = self.router(flat).softmax(-1)
        out = self.proj(x) * scores.max(-1).values.reshape(*x.shape[:-1], 1)
        if self.extra == "scores":
            return out, scores
        if self.extra == "none":
            return out, None
        return out, x.mean()  # one value for the whole input: not per token


class _Owner(nn.Module):
    def __init__(self, extra: str) -> None:
        super().__init__()
        self.mlp = _Routed(extra)


@pytest.mark.parametrize("extra", ["scores", "none"])
def test_the_slices_outputs_join_as_the_whole_sequences(extra):
    torch.manual_seed(0)
    owner, x = _Owner(extra), torch.randn(3, 10, 8)
    whole = owner.mlp(x)
    chunk_mlp(owner.mlp, "forward", 3, 1, "Owner")
    try:
        joined = owner.mlp(x)
    finally:
        unchunk_mlps(owner)
    torch.testing.assert_close(joined[0], whole[0], rtol=0, atol=1e-6)
    if extra == "scores":
        assert joined[1].shape == whole[1].shape == (30, 3)
        torch.testing.assert_close(joined[1], whole[1], rtol=0, atol=1e-6)
    else:
        assert joined[1] is None


def test_an_output_that_is_not_per_token_is_refused():
    owner = _Owner("mean")
    chunk_mlp(owner.mlp, "forward", 2, 1, "Owner")
    with pytest.raises(ValueError, match="not one value per token"):
        owner.mlp(torch.randn(2, 6, 8))
