"""Block anatomy from the hand-written adapters: each reproduces its block's own forward and gradients,
an unknown variant is refused by verification, and a block no source serves gets an error that names
every source tried."""

import pytest
import torch
from torch import nn

from examples.models.gpt import Block
from examples.models.llama import DecoderLayer, rope_tables
from lightning_parallel.anatomy import adapter_split
from lightning_parallel.anatomy.adapters import matching_adapters, named_adapter
from lightning_parallel.anatomy.verify import verify_split
from lightning_parallel.blocks import BlockConfig, parallelize
from lightning_parallel.errors import AnatomyError, VerificationError


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
    (adapter,) = matching_adapters(block)
    assert adapter.name == name
    x = torch.randn(2, 16, 32) if "seq-first" not in case else torch.randn(16, 2, 32)
    split = adapter_split(adapter, block)
    verify_split(split, block, x, args)
    torch.testing.assert_close(split(block, x, args, {}), block(x, *args))


class NonCausalBlock(Block):  # same anatomy, different attention: the nanogpt adapter would train it wrong
    def forward(self, x):
        a = self.attn
        B, T, C = x.shape
        q, k, v = a.c_attn(self.ln_1(x)).split(C, 2)
        q, k, v = (t.view(B, T, a.n_head, C // a.n_head).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + a.c_proj(y)
        return x + self.mlp(self.ln_2(x))


def test_a_variant_the_adapter_does_not_know_is_refused():
    block = NonCausalBlock(32, 4, 0.0, True)
    (adapter,) = matching_adapters(block)
    with pytest.raises(
        VerificationError, match=r"adapter 'nanogpt' does not reproduce NonCausalBlock: output, input gradient"
    ):
        verify_split(adapter_split(adapter, block), block, torch.randn(2, 16, 32))


def test_chunked_mlp_alone_runs_the_blocks_own_forward():
    # the adapter's split is not needed to chunk the MLP: a variant it does not know still trains exactly
    torch.manual_seed(0)
    holder = nn.Module()
    holder.h = nn.ModuleList([NonCausalBlock(32, 4, 0.0, True) for _ in range(2)])
    want = holder.h[0](x := torch.randn(2, 16, 32))
    layer = parallelize(holder, BlockConfig(mlp_chunks=2, adapter="nanogpt"))
    torch.testing.assert_close(holder.h[0](x), want, rtol=1e-6, atol=1e-6)
    assert layer.runners[0].anatomy_name == "adapter 'nanogpt'"


def test_unknown_adapter_name():
    with pytest.raises(ValueError, match="adapter='gpt2' is unknown; known adapters:"):
        named_adapter("gpt2")


def test_a_block_no_source_serves_names_every_source():
    class Opaque(nn.Module):  # no attention and no MLP anywhere: nothing to chunk
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x).tanh()

    holder = nn.Module()
    holder.blocks = nn.ModuleList([Opaque(), Opaque()])
    parallelize(holder, BlockConfig(mlp_chunks=2))
    with pytest.raises(
        AnatomyError,
        match=r"(?s)no anatomy of Opaque serves a chunked MLP \(mlp_chunks=2\); tried:.*\nname the MLP with mlp_module='path.in.block', or pass adapter=",
    ):
        holder.blocks[0](torch.randn(2, 4, 8))


@pytest.mark.slow  # (time: 8 s, a fresh interpreter; tests/unit/test_repository.py checks the imports fast)
def test_the_core_imports_no_model_library():
    """transformers, litgpt and timm are test dependencies only: importing the library and running a plain
    model through its Hugging Face and traced sources imports none of them (Lightning itself may, through
    torchmetrics, which is imported first here)."""
    import subprocess
    import sys

    code = (
        "import sys, torch, lightning.pytorch, torchmetrics\n"
        "before = set(sys.modules)\n"
        "import lightning_parallel\n"
        "from lightning_parallel.blocks import BlockConfig, parallelize\n"
        "from examples.models.gpt import GPT\n"
        "m = GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16)\n"
        "layer = parallelize(m, BlockConfig(mlp_chunks=2, sources=('hugging_face', 'traced')))\n"
        "m(torch.randint(0, 16, (2, 8)))\n"
        "new = {n.split('.')[0] for n in set(sys.modules) - before}\n"
        "print(layer.runners[0].anatomy_name, sorted(new & {'transformers', 'litgpt', 'timm'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "the traced graph []", out.stdout + out.stderr
