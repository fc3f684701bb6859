"""Ring attention's per-pair functions off the CPU (``_math_forward`` / ``_math_backward``, what CUDA runs) against
torch's fused CPU flash-attention kernel and its backward, which the CPU path runs: the same outputs, log-sum-exp
and gradients, for causal diagonal pairs, off-diagonal pairs and additive masks; a row with nothing to attend
(a document mask off the diagonal) carries no weight into the ring's merge on either path."""

import pytest
import torch

from lightning_parallel.ring_attention import _flash, _flash_backward, _math_backward, _math_forward


def _inputs(dtype: torch.dtype, masked: bool, empty_row: bool):
    torch.manual_seed(0)
    B, H, c, d = 2, 3, 8, 16
    q, k, v, grad_out = (torch.randn(B, H, c, d, dtype=dtype) for _ in range(4))
    mask = None
    if masked:  # additive, as Hugging Face fills it (the dtype's minimum); every row keeps its diagonal
        drop = (torch.rand(B, 1, c, c) < 0.3) & ~torch.eye(c, dtype=torch.bool)
        mask = torch.zeros(B, 1, c, c, dtype=dtype).masked_fill(drop, torch.finfo(dtype).min)
        if empty_row:
            mask[:, :, 2, :] = torch.finfo(dtype).min
    return q, k, v, grad_out, mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_math_pair_matches_the_cpu_kernel(dtype, causal, masked):
    q, k, v, grad_out, mask = _inputs(dtype, masked, empty_row=False)
    scale = 0.3
    out, lse = _math_forward(q, k, v, causal, mask, scale)
    ref_out, ref_lse = _flash(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse.to(lse.dtype), **tol)
    grads = _math_backward(grad_out, q, k, v, ref_out, ref_lse, causal, mask, scale)
    refs = _flash_backward(grad_out, q, k, v, ref_out, ref_lse, 0.0, causal, attn_mask=mask, scale=scale)
    for got, want in zip(grads, refs):
        torch.testing.assert_close(got, want, **tol)


def test_a_row_with_nothing_to_attend_weighs_nothing_in_the_merge():
    q, k, v, _, mask = _inputs(torch.float64, masked=True, empty_row=True)
    out, lse = _math_forward(q, k, v, False, mask, 0.3)
    ref_out, ref_lse = _flash(q, k, v, 0.0, False, attn_mask=mask, scale=0.3)
    keep = torch.ones(8, dtype=torch.bool)
    keep[2] = False
    torch.testing.assert_close(out[:, :, keep], ref_out[:, :, keep], rtol=1e-9, atol=1e-12)
    # merged with any finite log-sum-exp, the row's weight exp(lse - total) is 0 on both paths
    for row_lse in (lse[:, :, 2], ref_lse[:, :, 2]):
        assert torch.exp(row_lse - torch.logaddexp(row_lse, torch.zeros_like(row_lse))).max() == 0
