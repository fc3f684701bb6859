"""Packed rows for the example decoders: a row holds several documents, its ``position_ids`` restart at 0 at
each (Hugging Face's ``DataCollatorWithFlattening`` layout), and a token attends only within its document."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # the label of a document's first token: nothing before it in its document predicts it


def document_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``(B, 1, T, T)`` boolean SDPA mask, causal within each document of the rows; ``None`` when every row
    holds one document (plain causal attention then)."""
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1) != 1
    if not bool(starts[:, 1:].any()):
        return None
    docs = starts.cumsum(-1)
    T = docs.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return ((docs.unsqueeze(-1) == docs.unsqueeze(-2)) & causal).unsqueeze(1)
