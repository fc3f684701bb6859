"""Recomputation policies and chunked MLP, single process: gradients, kept bytes, kernel counts, errors."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.models import GPT, EncoderClassifier, Llama
from lightning_parallel.blocks import apply_recompute
from lightning_parallel.memory import LiveTensorTracker, kept_for_backward
from lightning_parallel.recompute import POLICIES

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
TOL = dict(rtol=1e-9, atol=1e-12)


def _model(name, **kw):
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(vocab_size=32, block_size=32, n_layer=4, n_head=4, n_embd=32, **kw).double()
    if name == "llama":
        return Llama(vocab_size=32, block_size=32, n_layer=4, n_head=4, n_kv_head=2, dim=32, mlp_hidden=64).double()
    return EncoderClassifier(
        vocab_size=32, max_len=32, d_model=32, nhead=4, num_layers=4, dim_feedforward=64, **kw
    ).double()


def _batch(name):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 32, (3, 32), generator=g)
    y = torch.randint(0, 4 if name == "encoder" else 32, (3,) if name == "encoder" else (3, 32), generator=g)
    return x, y


def _loss(model, name, batch):
    x, y = batch
    out = model(x)
    return F.cross_entropy(out, y) if name == "encoder" else F.cross_entropy(out.flatten(0, 1), y.flatten())


def _grads(model, name, batch, seed=0):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    _loss(model, name, batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["gpt", "llama", "encoder"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mlp_chunks", [1, 4])
def test_gradients_equal_no_recomputation(name, policy, mlp_chunks):
    model, batch = _model(name), _batch(name)
    want = _grads(model, name, batch)
    wrapped = apply_recompute(copy.deepcopy(model), policy, every_n=2, mlp_chunks=mlp_chunks)
    got = _grads(wrapped, name, batch)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m, n=n: f"{name} {policy}: {n}: {m}")


def _kept_per_block(block_fn, policy, shape=(2, 256, 64)):
    """Bytes a single block keeps for backward, in units of B*T*H elements (fp32)."""
    torch.manual_seed(0)
    holder = nn.Module()
    holder.blocks = nn.ModuleList([block_fn(), block_fn()])
    apply_recompute(holder, policy, every_n=1)
    block = holder.blocks[0]
    x = torch.randn(*shape, requires_grad=True)
    kept, _ = kept_for_backward(lambda: block(x))
    B, T, H = shape
    return kept / (B * T * H * 4)


BLOCKS = {
    "gpt": lambda: __import__("examples.models.gpt", fromlist=["Block"]).Block(64, 4, 0.0, True),
    "encoder": lambda: nn.TransformerEncoderLayer(64, 4, 256, 0.0, batch_first=True),
}


@pytest.mark.parametrize("family", BLOCKS)
def test_kept_bytes_order_and_no_attention_bound(family):
    kept = {p: _kept_per_block(BLOCKS[family], p) for p in ("none", "selective", "no_attention", "full")}
    assert kept["none"] > kept["selective"] > kept["no_attention"] > kept["full"], kept
    # output + attention output (B*T*H each) + log-sum-exp (B*heads*T fp32 = 4/64 of B*T*H here)
    assert kept["no_attention"] <= 4 + 4 / 64, kept
    assert kept["full"] == pytest.approx(1.0, abs=0.01), kept  # only the output


def test_llama_block_kept_bytes():
    from examples.models.llama import DecoderLayer, rope_tables

    torch.manual_seed(0)
    holder = nn.Module()
    holder.layers = nn.ModuleList([DecoderLayer(64, 4, 2, 176, 1e-5) for _ in range(2)])
    cos, sin = rope_tables(16, 256)
    cos, sin = cos.float(), sin.float()
    x = torch.randn(2, 256, 64, requires_grad=True)
    kept = {}
    for policy in ("none", "selective", "no_attention", "full"):
        apply_recompute(holder, policy, every_n=1)
        kept[policy] = kept_for_backward(lambda: holder.layers[0](x, cos, sin))[0] / (2 * 256 * 64 * 4)
    assert kept["none"] > kept["selective"] > kept["no_attention"] > kept["full"], kept
    assert kept["no_attention"] <= 4 + 4 / 64, kept


def test_no_attention_runs_each_attention_kernel_once_per_block():
    name = "gpt"
    model, batch = apply_recompute(_model(name), "no_attention"), _batch(name)
    with LiveTensorTracker() as tracker:
        _loss(model, name, batch).backward()
    assert tracker.counts[FLASH] == 4  # L blocks, one batch: never re-run in backward
    full = apply_recompute(_model(name), "full")
    with LiveTensorTracker() as tracker:
        _loss(full, name, batch).backward()
    assert tracker.counts[FLASH] == 8  # while full recomputation runs it twice


def test_attention_dropout_takes_the_math_path_and_is_not_rerun():
    """CPU SDPA with dropout runs batched matmuls + softmax instead of the flash kernel.
    no_attention then keeps the scores, the probabilities and the output (O(T^2)) and recomputes only the
    dropout from them, with the same mask: gradients equal, attention matmuls not re-run."""
    name = "gpt"
    base = _model(name, dropout=0.1)
    batch = _batch(name)
    want = _grads(base, name, batch, seed=7)
    with LiveTensorTracker() as plain:
        _grads(base, name, batch, seed=7)
    wrapped = apply_recompute(copy.deepcopy(base), "no_attention")
    got = _grads(wrapped, name, batch, seed=7)
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL)
    with LiveTensorTracker() as kept:
        _grads(wrapped, name, batch, seed=7)
    assert plain.counts[FLASH] == 0 and plain.counts[aten.bmm.default] > 0
    assert kept.counts[aten.bmm.default] == plain.counts[aten.bmm.default]  # no attention matmul re-run
    assert kept.counts[aten.addmm.default] > plain.counts[aten.addmm.default]  # the projections are recomputed


@pytest.mark.parametrize("family,k", [("gpt", 4), ("llama", 2), ("encoder", 2)])
def test_mlp_chunks_shrink_the_largest_mlp_tensor_by_k(family, k):
    # the wide intermediate (4H for GPT, 2H for these Llama and encoder configurations) shrinks by k until it
    # reaches the H-wide output; T=256 so that activations, not weight gradients, are the largest tensors
    model = _model(family).float()
    block = (model.transformer.h if family == "gpt" else model.layers if family == "llama" else model.encoder.layers)[0]
    run_mlp = (lambda b, x: b._ff_block(x)) if family == "encoder" else (lambda b, x: b.mlp(x))
    x = torch.randn(2, 256, 32, requires_grad=True)
    largest = {}
    for chunks in (1, k):
        apply_recompute(model, "none", mlp_chunks=chunks)
        _loss(model, family, _batch(family))  # the first call locates (and verifies) the MLP to chunk
        with LiveTensorTracker() as tracker:
            run_mlp(block, x).sum().backward()
        largest[chunks] = tracker.largest
    assert largest[1] / largest[k] == pytest.approx(k, rel=0.05), largest


def test_every_n_wraps_every_nth_block_and_reapplying_replaces():
    from lightning_parallel.recompute import Recomputed

    model = apply_recompute(_model("gpt"), "every_n", every_n=2)
    _loss(model, "gpt", _batch("gpt"))
    wrapped = [isinstance(b.forward.stack, Recomputed) for b in model.transformer.h]
    assert wrapped == [True, False, True, False]
    apply_recompute(model, "none")
    _loss(model, "gpt", _batch("gpt"))
    assert not any(isinstance(b.forward.stack, Recomputed) for b in model.transformer.h)


def test_bad_input():
    with pytest.raises(ValueError, match=r"unknown recompute policy 'most'; choose one of \['none', 'full'"):
        apply_recompute(_model("gpt"), "most")
    with pytest.raises(ValueError, match="recompute_every_n must be an int >= 1, got 0"):
        apply_recompute(_model("gpt"), "every_n", every_n=0)
    model = apply_recompute(_model("gpt"), "none", mlp_chunks=64)
    with pytest.raises(
        ValueError,
        match=r"mlp_chunks=64 is larger than the sequence: the MLP input \(3, 32, 32\) of Block has 32 tokens",
    ):
        _loss(model, "gpt", _batch("gpt"))

    class NoMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x)

    holder = nn.Module()
    holder.blocks = nn.ModuleList([NoMLP(), NoMLP()])
    apply_recompute(holder, "none", mlp_chunks=2)
    with pytest.raises(
        ValueError,
        match=r"(?s)no anatomy of NoMLP serves a chunked MLP \(mlp_chunks=2\); tried:.*mlp_module='path.in.block'",
    ):
        holder.blocks[0](torch.randn(2, 4, 8))
    apply_recompute(holder, "none", mlp_chunks=2, mlp_module="proj")  # the argument the error names fixes it
    holder.blocks[0](torch.randn(2, 4, 8))
    apply_recompute(holder, "no_attention")
    with pytest.raises(
        ValueError, match=r"recompute='no_attention': no attention kernel ran inside NoMLP.*attention_kernels="
    ):
        holder.blocks[0](torch.randn(2, 4, 8, requires_grad=True))
    # naming the block's own "attention" kernel (here its matmul, for the test) is the fix the error names
    apply_recompute(holder, "no_attention", attention_kernels=("aten::addmm",))
    holder.blocks[0](torch.randn(2, 4, 8, requires_grad=True)).sum().backward()
    with pytest.raises(ValueError, match="attention_kernels: no op named 'aten::no_such_op' is registered"):
        apply_recompute(holder, "no_attention", attention_kernels=("aten::no_such_op",))


@pytest.mark.parametrize("policy,chunks", [("no_attention", 1), ("none", 4), ("full", 2)])
def test_a_deep_copy_of_a_wrapped_model_runs_the_copy(policy, chunks):
    # adapter verification deep-copies blocks: the copy must not run (or send gradients to) the original
    model = apply_recompute(_model("gpt"), policy, mlp_chunks=chunks)
    clone = copy.deepcopy(model).float()
    _loss(clone, "gpt", _batch("gpt")).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in clone.transformer.h.parameters())
