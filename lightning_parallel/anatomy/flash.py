"""Verifying blocks whose attention is flash-attention, which runs only in float16 / bfloat16.

A block is verified in float64 (:mod:`lightning_parallel.anatomy.verify`). flash-attn (2 and 3, dense and
variable-length) refuses float64 and float32, so for a Hugging Face block whose attention implementation has
flash-attention's interface (``"flash_attention_2"``, ``"flash_attention_3"``, or any function registered with
transformers' ``AttentionInterface`` together with flash's mask function) verification swaps, for its duration,
the registered function for :func:`reference_attention`: flash-attention's semantics written out in any dtype.

- **What flash computes** (transformers' ``_flash_attention_forward``): causal unless the module says otherwise
  (bottom-right aligned), a 2-D padding mask (``(B, T)``, 1 = token), documents of a packed row from
  ``cu_seq_lens_q/k`` or, for one row without a mask, from ``position_ids`` (a document starts at each
  position equal to the row's smallest), a sliding window of ``w`` keys (flash's ``window_size=(w-1, w-1)``),
  soft-capped scores, learned sinks (``s_aux``: one logit per head in the softmax's denominator), grouped
  key/value heads, and a value head size of its own.
- **Checked, not assumed**: every call of the stand-in during verification also runs the real function on the
  same inputs in bfloat16 (or float16) and compares, within bfloat16's rounding: ``atol = 5e-2 x max|v|``. A
  function whose semantics differ (attention across documents instead of within, a window of another size)
  differs by the size of ``v`` itself and is refused with the call it failed on. A function that cannot run
  here at all (flash-attn not installed, a CPU tensor) is refused too: the block would not run either.

The block's stack (tensor-parallel shards, HelixPipe's split, Ulysses) is then verified exactly in float64
against the block's own forward, both with the stand-in; training runs the real function.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes

from lightning_parallel.anatomy.hf_config import implementations_of
from lightning_parallel.errors import ConfigurationError

#: bfloat16 rounds each input to 2^-9 relative; through the scores and the weighted sum of ``v`` that stays far
#: below this share of ``max|v|``, which any difference of semantics (another set of keys) exceeds
CROSS_CHECK = 5e-2


def flash_like(implementation: str) -> bool:
    """Whether attention ``implementation`` (a name in transformers' registry) has flash-attention's interface:
    its own name says so, or it was registered with flash-attention's mask function."""
    if "flash" in implementation:
        return True
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    return ALL_MASK_ATTENTION_FUNCTIONS.get(implementation) is flash_attention_mask


@contextmanager
def stand_in(block: nn.Module) -> Iterator[bool]:
    """While open, every flash-like attention implementation ``block``'s configs name runs
    :func:`reference_attention`, each call cross-checked against the real function; yields whether there was
    one (``False``: the block's attention is not flash-attention, nothing is swapped)."""
    if "transformers" not in sys.modules:
        yield False
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = sorted(
        n for n in implementations_of(block) if n != "eager" and flash_like(n) and n in ALL_ATTENTION_FUNCTIONS
    )
    saved = {n: ALL_ATTENTION_FUNCTIONS._local_mapping.get(n) for n in names}
    try:
        for n in names:
            ALL_ATTENTION_FUNCTIONS[n] = _checked(n, ALL_ATTENTION_FUNCTIONS[n])
        yield bool(names)
    finally:
        for n, fn in saved.items():
            if fn is None:
                del ALL_ATTENTION_FUNCTIONS[n]
            else:
                ALL_ATTENTION_FUNCTIONS[n] = fn


def _checked(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  **kwargs: Any) -> tuple[Tensor, None]:  # fmt: skip
        out = reference_attention(module, query, key, value, attention_mask, **kwargs)
        _cross_check(name, real, module, (query, key, value, attention_mask), kwargs, out.detach())
        return out, None

    return attention


def _cross_check(name: str, real: Callable[..., Any], module: nn.Module, qkvm: tuple, kwargs: dict,
                 expected: Tensor) -> None:  # fmt: skip
    errors = []
    for dtype in (torch.bfloat16, torch.float16):
        cast = [t.detach().to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in qkvm]
        low = {k: v.detach().to(dtype) if isinstance(v, Tensor) and v.is_floating_point() else v
               for k, v in kwargs.items()}  # fmt: skip
        try:  # outside verification's dispatch modes (its probe for low-precision ops)
            with torch.no_grad(), _disable_current_modes():
                got = real(module, *cast, **low)[0]
        except Exception as err:  # noqa: BLE001  (the function refuses this dtype or cannot run here)
            errors.append(f"{dtype}: {type(err).__name__}: {err}")
            continue
        scale = float(qkvm[2].detach().abs().max()) or 1.0
        difference = float((got.to(expected.dtype) - expected).abs().max()) if got.shape == expected.shape else math.inf
        if difference > CROSS_CHECK * scale:
            raise ConfigurationError(
                f"attention implementation {name!r} is verified in float64 through flash-attention's semantics"
                f" (it runs in no wider dtype), but on this call (kwargs {sorted(kwargs)}) it differs from them by"
                f" {difference:.3g} (max|v| = {scale:.3g}; bfloat16 rounding stays below {CROSS_CHECK} x max|v|):"
                " register it with a mask function of its own semantics, or use attn_implementation='sdpa'"
            )
        return
    raise ConfigurationError(
        f"attention implementation {name!r} runs in neither float64 nor float32, and not here in bfloat16 or"
        f" float16 either ({'; '.join(errors)}), so the block cannot be verified: run on a device flash-attention"
        " supports, or use attn_implementation='sdpa'"
    )


def reference_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                        *, dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                        softcap: float | None = None, is_causal: bool | None = None, s_aux: Tensor | None = None,
                        position_ids: Tensor | None = None, cu_seq_lens_q: Tensor | None = None,
                        cu_seq_lens_k: Tensor | None = None, **_: Any) -> Tensor:  # fmt: skip
    """flash-attention's result, as transformers calls it, in the inputs' dtype: ``query (B, H, Tq, D)``,
    ``key``/``value`` ``(B, Hkv, Tk, D[v])``; returns ``(B, Tq, H, Dv)`` (rows without a key: zeros, as flash's
    padding)."""
    if dropout:
        raise ConfigurationError(
            "a flash-attention block is verified through its semantics without dropout; this call has dropout="
            f"{dropout}: verification runs the block in eval mode, so this is a block that passes dropout in eval"
        )
    B, H, Tq, D = query.shape
    Tk = key.shape[2]
    if key.shape[1] != H:
        key, value = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (key, value))
    scores = (query @ key.transpose(-1, -2)) * (scaling if scaling is not None else 1 / math.sqrt(D))
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = _allowed(module, B, Tq, Tk, query.device, attention_mask, sliding_window, is_causal, position_ids,
                       cu_seq_lens_q, cu_seq_lens_k)  # fmt: skip
    scores = scores.masked_fill(~allowed, -math.inf)
    if s_aux is not None:  # a sink per head: a logit in the denominator, no value
        sink = s_aux.to(scores.dtype).reshape(1, H, 1, 1).expand(B, H, Tq, 1)
        scores = torch.cat([scores, sink], dim=-1)
    top = scores.amax(-1, keepdim=True).detach().clamp_min(torch.finfo(scores.dtype).min)
    weights = torch.exp(scores - top)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    if s_aux is not None:
        weights = weights[..., :-1]
    return (weights @ value).transpose(1, 2).contiguous()


def _allowed(module: nn.Module, B: int, Tq: int, Tk: int, device: torch.device, mask: Tensor | None,
             window: int | None, is_causal: bool | None, position_ids: Tensor | None, cu_q: Tensor | None,
             cu_k: Tensor | None) -> Tensor:  # fmt: skip
    """``(B, 1, Tq, Tk)``: which key each query sees."""
    i = torch.arange(Tq, device=device).view(Tq, 1) + (Tk - Tq)  # bottom-right aligned, as flash >= 2.1
    j = torch.arange(Tk, device=device).view(1, Tk)
    allowed = torch.ones(B, 1, Tq, Tk, dtype=torch.bool, device=device)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None and Tk > window:
        allowed = allowed & ((i - j).abs() <= window - 1)
    if mask is not None:
        if mask.dim() != 2:
            raise ConfigurationError(f"flash-attention takes a (batch, length) padding mask, not {tuple(mask.shape)}")
        keep = mask.bool()
        allowed = allowed & keep[:, None, None, -Tk:] & keep[:, None, -Tq:, None]
    elif cu_q is not None and cu_k is not None:
        allowed = allowed & _same_document(_documents(cu_q, B * Tq), _documents(cu_k, B * Tk), B, Tq, Tk)
    elif position_ids is not None and B == 1 and Tq == Tk and Tq > 1:
        flat = position_ids.reshape(-1)
        starts = torch.cumsum((flat == flat.min()).long(), 0)
        allowed = allowed & _same_document(starts, starts, B, Tq, Tk)
    return allowed


def _documents(cu: Tensor, n: int) -> Tensor:
    """Document index of each of ``n`` flattened tokens, from cumulative lengths ``cu``."""
    return torch.bucketize(torch.arange(n, device=cu.device), cu.to(torch.long)[1:], right=True)


def _same_document(dq: Tensor, dk: Tensor, B: int, Tq: int, Tk: int) -> Tensor:
    return (dq.view(B, Tq, 1) == dk.view(B, 1, Tk)).unsqueeze(1)
