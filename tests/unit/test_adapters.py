"""Block-family adapters reproduce each block's own forward and gradients, and unknown variants are refused."""

import pytest
import torch
from torch import nn

from examples.models.gpt import Block
from examples.models.llama import DecoderLayer, rope_tables
from lightning_parallel.adapters import find_adapter, split_forward, verify_adapter


def _cases():
    torch.manual_seed(0)
    cos, sin = rope_tables(8, 16)
    return {
        "gpt": (Block(32, 4, 0.0, True), (), "nanogpt"),
        "llama": (DecoderLayer(32, 4, 2, 64, 1e-5), (cos.float(), sin.float()), "llama"),
        "encoder-post-norm": (nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=True), (), "torch_encoder"),
        "encoder-pre-norm": (
            nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=True, norm_first=True),
            (),
            "torch_encoder",
        ),
        "encoder-seq-first": (nn.TransformerEncoderLayer(32, 4, 64, 0.0), (), "torch_encoder"),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_adapter_is_found_and_verified(case):
    block, args, name = _cases()[case]
    adapter = find_adapter(block)
    assert adapter.name == name
    x = torch.randn(2, 16, 32) if "seq-first" not in case else torch.randn(16, 2, 32)
    verify_adapter(adapter, block, x, args)
    torch.testing.assert_close(split_forward(adapter, block, x, args, {}), block(x, *args))


def test_a_variant_the_adapter_does_not_know_is_refused():
    class NonCausalBlock(Block):  # same anatomy, different attention: the nanogpt adapter would train it wrong
        def forward(self, x):
            a = self.attn
            B, T, C = x.shape
            q, k, v = a.c_attn(self.ln_1(x)).split(C, 2)
            q, k, v = (t.view(B, T, a.n_head, C // a.n_head).transpose(1, 2) for t in (q, k, v))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
            x = x + a.c_proj(y)
            return x + self.mlp(self.ln_2(x))

    block = NonCausalBlock(32, 4, 0.0, True)
    adapter = find_adapter(block)
    with pytest.raises(
        ValueError, match=r"adapter 'nanogpt' does not reproduce NonCausalBlock: output, input gradient.*pass adapter="
    ):
        verify_adapter(adapter, block, torch.randn(2, 16, 32))


def test_unknown_family_and_unknown_name():
    with pytest.raises(
        ValueError,
        match=r"no adapter knows the anatomy of Linear; known adapters: \['llama', 'nanogpt', 'torch_encoder'\]",
    ):
        find_adapter(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="adapter='gpt2' is unknown"):
        find_adapter(nn.Linear(2, 2), "gpt2")
