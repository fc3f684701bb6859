"""Ring attention (Liu et al., arXiv 2310.01889) with zig-zag chunks, as one custom op.

Each rank holds the queries, keys and values of two of the 2·sp sequence chunks, ``chunks[2r]`` and
``chunks[2r+1]`` (:func:`lightning_parallel.sequence_parallel.balanced_chunks`: r and 2sp-1-r for causal
attention, so every rank does the same causal work; under a document mask the chunks whose queries have the
most pairs to compute paired with those that have the fewest). Forward: sp steps; at each, every (q chunk,
kv chunk) pair that is not entirely in the future runs the fused CPU flash-attention kernel, which returns
the log-sum-exp, and the partial outputs are merged with it; k and v then move one rank along the ring.
Backward: the same steps with the kernel's backward, given the *final* output and log-sum-exp (FlashAttention-2's
recurrence, so each pair's gradient is exact); the k/v gradients travel with their k/v and arrive home
after sp shifts.

An explicit mask (boolean, ``True`` to attend, or additive; in the original token order, e.g. a packed batch's
block-diagonal document mask) is sliced per pair: rows of the q chunk, columns of the kv chunk (zig-zag chunks
are contiguous ranges of the original sequence), and made additive per pair, so nothing of the whole
sequence's size is allocated. A pair with nothing to attend (its slice masks every score: a kv chunk in the
q chunk's future, or of other documents only) is skipped, forward and backward alike; a pair on the
diagonal (q and kv the same chunk) never is, so every query gets an output.

Learned attention sinks (GPT-OSS: a logit per head in the softmax's denominator, with no value) enter the merged
log-sum-exp once per head after the ring, ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``: a
sink is one more key whose value is 0. The backward's pairs take ``out'`` and ``lse'``, so their gradients stay
exact, and the sink's gradient is ``-sum(exp(sink - lse') * D)`` over the rows, ``D = rowsum(dO * out')`` (the
softmax gradient of a key with value 0).

Per pair, on CPU torch's fused CPU flash-attention kernel and its backward (it takes a mask and returns the
log-sum-exp); elsewhere (CUDA), and where the values' head size differs from the queries' (latent attention,
DeepSeek-V3, which the CPU kernel refuses), the same two functions written out (:func:`_math_forward`,
:func:`_math_backward`: scores, log-sum-exp and FlashAttention-2's backward in at least float32, a pair's c x c
scores at a time), since CUDA's flash kernel takes no mask.

Being one operator (``lightning_parallel::ring_attention``), activation recomputation keeps its output
instead of running the ring again (``recompute.communication_ops``). ``WORK`` counts the attention scores
each process computed (a load-balance measurement; a masked pair computes all of its scores, a skipped
pair none).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor

from lightning_parallel import _collectives

WORK: Counter = Counter()  # group name -> unmasked (query, key) pairs computed by this process, forward only
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _scores(q: Tensor, k: Tensor, causal: bool, mask: Tensor | None, scale: float) -> Tensor:
    """One pair's attention scores q k^T * scale + mask (the future masked with -inf), in at least float32."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(wide) @ k.to(wide).transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores + mask.to(wide)
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _probabilities(scores: Tensor, lse: Tensor) -> Tensor:
    """exp(scores - lse); a row with nothing to attend (lse -inf) gives zeros."""
    return torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))


def _math_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """One pair's (output, log-sum-exp), computed in at least float32: softmax(q k^T * scale + mask) v. A row with
    nothing to attend gets output 0 and log-sum-exp -inf, as the CPU kernel gives."""
    scores = _scores(q, k, causal, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return (_probabilities(scores, lse) @ v.to(scores.dtype)).to(q.dtype), lse


def _math_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One pair's (dq, dk, dv) given the *final* output and log-sum-exp of its queries (FlashAttention-2's
    backward, Dao 2023, arXiv 2307.08691, Algorithm 2): P = exp(S - lse), dV = P^T dO, dS = P * (dO V^T - D) with
    D = rowsum(dO * O), dQ = dS K * scale, dK = dS^T Q * scale."""
    scores = _scores(q, k, causal, mask, scale)
    wide = scores.dtype
    qw, kw, vw, gw = q.to(wide), k.to(wide), v.to(wide), grad_out.to(wide)
    probs = _probabilities(scores, lse.to(wide))
    delta = (gw * out.to(wide)).sum(-1, keepdim=True)
    dscores = probs * (gw @ vw.transpose(-2, -1) - delta)
    dq, dk, dv = (dscores @ kw) * scale, (dscores.transpose(-2, -1) @ qw) * scale, probs.transpose(-2, -1) @ gw
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fused(q: Tensor, v: Tensor) -> bool:
    """Whether torch's fused CPU kernel serves this pair (on CPU, values as wide as the queries)."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def _pair_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    if _fused(q, v):
        return _flash(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return _math_forward(q, k, v, causal, mask, scale)


def _pair_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    if _fused(q, v):
        return _flash_backward(grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    return _math_backward(grad_out, q, k, v, out, lse, causal, mask, scale)


def _pairs(rank: int, source: int, chunks: list[int], causal: bool) -> list[tuple[int, int, bool]]:
    """(q half, kv half, diagonal) of the chunk pairs rank ``rank`` computes against ``source``'s k/v."""
    q_chunks, kv_chunks = chunks[2 * rank : 2 * rank + 2], chunks[2 * source : 2 * source + 2]
    return [
        (i, j, causal and kc == qc)
        for i, qc in enumerate(q_chunks)
        for j, kc in enumerate(kv_chunks)
        if not (causal and kc > qc)
    ]


def _computed(
    mask: Tensor | None, rank: int, source: int, chunks: list[int], causal: bool, c: int, dtype: torch.dtype
) -> list[tuple[int, int, bool, Tensor | None]]:
    """(q half, kv half, diagonal, additive pair mask) of the pairs rank ``rank`` computes against ``source``'s
    k/v: :func:`_pairs`, with an explicit mask sliced to each pair and the pairs it masks entirely dropped."""
    out = []
    for i, j, diagonal in _pairs(rank, source, chunks, causal):
        if mask is None:
            out.append((i, j, diagonal, None))
            continue
        qc, kc = chunks[2 * rank + i], chunks[2 * source + j]
        pair = mask[..., qc * c : (qc + 1) * c, kc * c : (kc + 1) * c]
        if pair.dtype == torch.bool:
            attends = pair
            pair = torch.zeros(pair.shape, dtype=dtype, device=pair.device).masked_fill(~pair, torch.finfo(dtype).min)
        else:
            attends = pair > torch.finfo(pair.dtype).min  # Hugging Face fills with the dtype's minimum
            pair = pair.to(dtype)
        if qc == kc or bool(attends.any()):
            out.append((i, j, diagonal, pair.contiguous()))
    return out


@torch.library.custom_op("lightning_parallel::ring_attention", mutates_args=())
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group_name: str,
    causal: bool,
    scale: float,
    chunks: list[int],
    mask: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(B, H, 2c, d) local queries/keys (equal head counts; values (B, H, 2c, dv)) of the chunks ``chunks[2r],
    chunks[2r+1]``, and ``sinks`` (H,) a learned logit per head -> (output, log-sum-exp, the sinks' included)."""
    group = _collectives.resolve_group(group_name)
    rank, sp = _collectives.group_rank(group), _collectives.group_size(group)
    outs: list[Tensor | None] = [None, None]
    lses: list[Tensor | None] = [None, None]
    qs = q.chunk(2, dim=2)
    c = qs[0].shape[2]
    for step in range(sp):
        ks, vs = k.chunk(2, dim=2), v.chunk(2, dim=2)
        source = (rank - step) % sp
        for i, j, diagonal, pair_mask in _computed(mask, rank, source, chunks, causal, c, q.dtype):
            o, lse = _pair_forward(qs[i], ks[j], vs[j], diagonal, pair_mask, scale)
            WORK[group_name] += c * (c + 1) / 2 if diagonal else c * c
            if outs[i] is None:
                outs[i], lses[i] = o, lse
            else:
                total = torch.logaddexp(lses[i], lse)
                outs[i] = outs[i] * torch.exp(lses[i] - total).unsqueeze(-1) + o * torch.exp(lse - total).unsqueeze(-1)
                lses[i] = total
        if step < sp - 1:
            k, v = _collectives.ring_shift(k, group), _collectives.ring_shift(v, group)
    out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # type: ignore[arg-type]  # merged wide
    if sinks is not None:  # one more key per head, value 0: the denominator grows, once
        total = torch.logaddexp(lse, sinks.to(lse.dtype).reshape(1, -1, 1))
        out, lse = out * torch.exp(lse - total).unsqueeze(-1), total
    return out.to(q.dtype), lse


@ring_attention.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group_name: str,
    causal: bool,
    scale: float,
    chunks: list[int],
    mask: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1])


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, group_name, causal, scale, chunks, mask, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.group_name, ctx.causal, ctx.scale, ctx.chunks, ctx.mask = group_name, causal, scale, chunks, mask


def _backward(ctx, grad_out: Tensor, grad_lse: Tensor):  # type: ignore[no-untyped-def]
    q, k, v, out, lse, sinks = ctx.saved_tensors
    group = _collectives.resolve_group(ctx.group_name)
    rank, sp = _collectives.group_rank(group), _collectives.group_size(group)
    qs, gos, os_, ls = q.chunk(2, dim=2), grad_out.chunk(2, dim=2), out.chunk(2, dim=2), lse.chunk(2, dim=2)
    dq = [torch.zeros_like(t) for t in qs]
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for step in range(sp):
        ks, vs = k.chunk(2, dim=2), v.chunk(2, dim=2)
        dks, dvs = dk.chunk(2, dim=2), dv.chunk(2, dim=2)  # views: accumulate in place
        source = (rank - step) % sp
        for i, j, diagonal, pair_mask in _computed(
            ctx.mask, rank, source, ctx.chunks, ctx.causal, qs[0].shape[2], q.dtype
        ):
            gq, gk, gv = _pair_backward(
                gos[i].contiguous(), qs[i], ks[j], vs[j], os_[i], ls[i], diagonal, pair_mask, ctx.scale
            )
            dq[i] += gq
            dks[j].add_(gk)
            dvs[j].add_(gv)
        if step < sp - 1:
            k, v = _collectives.ring_shift(k, group), _collectives.ring_shift(v, group)
        # the k/v gradients travel with their k/v and are home after sp shifts
        dk, dv = _collectives.ring_shift(dk, group), _collectives.ring_shift(dv, group)
    return torch.cat(dq, dim=2), dk, dv, None, None, None, None, None, _sinks_grad(grad_out, out, lse, sinks)


def _sinks_grad(grad_out: Tensor, out: Tensor, lse: Tensor, sinks: Tensor | None) -> Tensor | None:
    """A sink's gradient: the softmax gradient of a key with value 0, ``-sum over rows of p_sink * D``, with
    ``p_sink = exp(sink - lse)`` and ``D = rowsum(dO * out)`` (this rank's rows; the sequence-parallel sum of
    block gradients adds the other ranks')."""
    if sinks is None:
        return None
    wide = lse.dtype
    delta = (grad_out.to(wide) * out.to(wide)).sum(-1)
    p_sink = torch.exp(sinks.to(wide).reshape(1, -1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)


ring_attention.register_autograd(_backward, setup_context=_setup_context)
