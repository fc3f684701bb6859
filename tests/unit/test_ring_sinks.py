"""Ring attention's op on 2 gloo ranks against one process's eager softmax: learned sinks (a logit per head in the
denominator, GPT-OSS: the eager function's ``cat([scores, sink])``, softmax, sink column dropped) and values whose
head size differs from the queries' (latent attention, DeepSeek-V3: the math pair kernel serves them), with and
without a causal mask. Output, and the gradients of q, k, v and the sinks, in float64 at 1e-9."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

B, H, T, D = 2, 3, 8, 6


def _reference(q, k, v, sinks, causal, scale):
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(B, H, T, 1)], dim=-1)
    probs = scores.softmax(-1)
    return (probs[..., :T] if sinks is not None else probs) @ v


def _compare(rank, world_size, dv, with_sinks, causal):
    import torch.distributed as dist

    from lightning_parallel.ring_attention import ring_attention
    from lightning_parallel.sequence_parallel import balanced_chunks

    torch.manual_seed(0)
    q, k = torch.randn(B, H, T, D, dtype=torch.float64), torch.randn(B, H, T, D, dtype=torch.float64)
    v, grad = torch.randn(B, H, T, dv, dtype=torch.float64), torch.randn(B, H, T, dv, dtype=torch.float64)
    sinks = torch.randn(H, dtype=torch.float64) if with_sinks else None
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    want = _reference(q, k, v, sinks, causal, 0.4)
    want_grads = torch.autograd.grad(want, leaves, grad)

    chunks = balanced_chunks(None, world_size) if causal else tuple(range(2 * world_size))
    c = T // (2 * world_size)
    mine = chunks[2 * rank : 2 * rank + 2]

    def local(t):
        return torch.cat([t[:, :, i * c : (i + 1) * c] for i in mine], dim=2).detach().requires_grad_(True)

    lq, lk, lv = local(q), local(k), local(v)
    ls = sinks.detach().clone().requires_grad_(True) if with_sinks else None
    out, _ = ring_attention(lq, lk, lv, dist.group.WORLD.group_name, causal, 0.4, list(chunks), None, ls)
    out.backward(local(grad))
    torch.testing.assert_close(out, local(want), rtol=1e-9, atol=1e-12)
    for got, full in zip((lq, lk, lv), want_grads):
        torch.testing.assert_close(got.grad, local(full), rtol=1e-9, atol=1e-12)
    if with_sinks:  # each rank's rows' share; their sum is the sink's gradient
        dist.all_reduce(ls.grad)
        torch.testing.assert_close(ls.grad, want_grads[3], rtol=1e-9, atol=1e-12)
    return True


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("dv", "with_sinks"), [(D, True), (4, False), (4, True)])
def test_ring_op_matches_one_process(dv, with_sinks, causal):
    assert run_distributed(_compare, 2, dv, with_sinks, causal, timeout=60) == [True, True]
