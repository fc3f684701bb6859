"""The LM head and its cross-entropy in chunks (lightning_parallel/chunked_loss.py), on one process: exact
against the whole logits for the ways unchanged modules compute their loss, and never holding them whole."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_parallel.chunked_loss import LazyLogits, lazy_heads
from lightning_parallel.memory import LiveTensorTracker
from tests.helpers import packed


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _head(module: nn.Module) -> nn.Linear:
    return module.lm_head if hasattr(module, "lm_head") else module.model.lm_head


@pytest.mark.parametrize("model", ["gpt", "llama", "hf:llama", "hf:gpt2"])
@pytest.mark.parametrize("chunks", [1, 3, 64])
def test_the_chunked_loss_and_its_gradients_equal_the_whole_logits(model, chunks):
    torch.manual_seed(0)
    module, data = packed.build(model, 4, "sgd", 0.05)
    module = module.double()
    batch = next(iter(data.train_dataloader()))
    loss_of = (lambda m: m.model(**batch).loss) if model.startswith("hf:") else (lambda m: m._loss(batch))
    chunked = copy.deepcopy(module)
    want = loss_of(module)
    want.backward()
    with lazy_heads([_head(chunked)], chunks) as forwards:
        got = loss_of(chunked)
    got.backward()
    assert forwards[0].calls == 1
    # Hugging Face computes its loss in float32 (``logits.float()``) however the model's dtype: float32 tolerances
    tol = dict(rtol=1e-5, atol=1e-6) if model.startswith("hf:") else dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got, want, **tol)
    want_grads, got_grads = _grads(module), _grads(chunked)
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **tol, msg=name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reshapes_casts_slices_ignore_index_and_reductions_follow_the_rows(reduction):
    torch.manual_seed(0)
    head = nn.Linear(8, 11, bias=True).double()
    h = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (2, 4))
    target[0, 1] = target[1, 3] = -1  # ignored

    def loss(logits):  # Hugging Face's shift, a cast, and a view
        return F.cross_entropy(logits[:, :-1].float().contiguous().view(-1, 11), target.view(-1), ignore_index=-1,
                               reduction=reduction)  # fmt: skip

    want = loss(head(h))
    (want_h,) = torch.autograd.grad(want, h)
    with lazy_heads([head], 3):
        logits = head(h)
        assert isinstance(logits, LazyLogits) and logits.shape == (2, 5, 11) and logits.dtype == torch.float64
        got = loss(logits)
    (got_h,) = torch.autograd.grad(got, h)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_h, want_h)


def test_any_other_use_of_the_logits_computes_them_whole_and_says_so():
    torch.manual_seed(0)
    head = nn.Linear(8, 11)
    h = torch.randn(3, 8)
    with lazy_heads([head], 2):
        logits = head(h)
        with pytest.warns(UserWarning, match="uses the LM head's whole logits"):
            top = logits.argmax(-1)
        with pytest.warns(UserWarning, match="whole logits"):  # class weights: not chunked
            weighted = F.cross_entropy(logits, torch.tensor([1, 2, 3]), weight=torch.ones(11))
    assert torch.equal(top, head(h).argmax(-1))
    torch.testing.assert_close(weighted, F.cross_entropy(head(h), torch.tensor([1, 2, 3])))


def test_the_head_and_loss_of_16k_tokens_never_hold_one_whole_logits_tensor():
    torch.manual_seed(0)
    tokens, hidden, vocab = 16384, 32, 2048
    head = nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(1, tokens, hidden, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    whole = tokens * vocab * 4  # one float32 logits tensor: 128 MiB
    with LiveTensorTracker() as tracker, lazy_heads([head], 16):
        F.cross_entropy(head(h).view(-1, vocab), target).backward()
    assert tracker.peak < whole / 2, (tracker.peak, whole)  # a few slices' logits at a time (of 16)
    with LiveTensorTracker() as baseline:
        F.cross_entropy(head(h).view(-1, vocab), target).backward()
    assert baseline.peak >= 2 * whole  # unchunked: the logits and their gradient (at least)


def test_under_autocast_the_statistics_stay_in_float32_as_cross_entropys_do():
    """bfloat16 autocast: the head gives bfloat16 logits, ``F.cross_entropy`` takes them to float32 and returns
    float32; the chunked loss rounds the logits the same way and keeps its statistics in float32."""
    torch.manual_seed(0)
    head = nn.Linear(64, 1000, bias=False)
    h = torch.randn(4096, 64)
    target = torch.randint(0, 1000, (4096,))
    chunked = copy.deepcopy(head)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(head(h), target)
    want.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16), lazy_heads([chunked], 8):
        got = F.cross_entropy(chunked(h), target)
    got.backward()
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.weight.grad, head.weight.grad, rtol=2e-2, atol=1e-5)
