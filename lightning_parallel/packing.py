"""Packed sequences: several documents concatenated into one row, each attending only within itself.

The format is Hugging Face's (``DataCollatorWithFlattening``) and torchtitan's: ``position_ids`` restart at
0 at each document's first token, ``labels`` hold -100 there (no token is predicted across a boundary), and
no attention mask is passed; the model derives the documents from the positions. Hugging Face models do it
in ``transformers.masking_utils`` (``find_packed_sequence_indices``: a new document wherever a position is
not its predecessor plus one) and build a block-diagonal causal mask, or call flash-attn's variable-length
kernel; a home-written model does the same with :func:`document_mask`.

Nothing here is parallel: the strategies run the model's own mask through every layout (the pipeline's
captured block arguments, tensor parallelism's local heads, Ulysses' whole-sequence attention, ring
attention's chunk pairs, HelixPipe's attention stage). :func:`pack_documents` is a plain way to make such
rows without ``DataCollatorWithFlattening``, in rows of one length, so micro-batches and sequence shards
split them like any other batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

IGNORE_INDEX = -100


def document_ids(position_ids: Tensor) -> Tensor:
    """``(B, T)`` document index of every token, counted from 0 in each row: a document starts wherever a
    position is not its predecessor plus one (the rule of transformers' ``find_packed_sequence_indices``)."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def document_mask(position_ids: Tensor, causal: bool = True) -> Tensor:
    """``(B, 1, T, T)`` boolean attention mask (``True``: attend) of the packed rows ``position_ids``: each token
    attends to the tokens of its own document (and, if ``causal``, only to those not after it), the mask
    ``F.scaled_dot_product_attention(attn_mask=...)`` takes."""
    docs = document_ids(position_ids)
    mask = docs.unsqueeze(-1) == docs.unsqueeze(-2)
    if causal:
        T = docs.shape[-1]
        mask = mask & torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return mask.unsqueeze(1)


def is_packed(position_ids: Tensor) -> bool:
    """Whether any row of ``position_ids`` holds more than one document."""
    return bool((document_ids(position_ids)[:, -1] > 0).any())


def pack_documents(documents: Iterable[Sequence[int] | Tensor], seq_len: int) -> list[dict[str, Tensor]]:
    """Pack ``documents`` (token sequences) in order into rows of exactly ``seq_len`` tokens.

    Each row is ``{"input_ids", "position_ids", "labels"}`` of shape ``(seq_len,)``, as
    ``DataCollatorWithFlattening`` lays out one row: positions restart at 0 at each document, ``labels`` equal
    ``input_ids`` with -100 at each document's first token (a Hugging Face causal LM shifts them itself). A
    document that does not fit in the rest of a row is cut there; its rest starts the next row as a document
    of its own (positions from 0 again, so they stay below ``seq_len``, which a learned position table
    needs). The last row is dropped if incomplete. Rows can be batched with the default collate
    (``DataLoader(rows, batch_size=...)``).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    rows: list[dict[str, Tensor]] = []
    ids: list[int] = []
    pos: list[int] = []
    labels: list[int] = []
    for document in documents:
        tokens = document.tolist() if isinstance(document, Tensor) else list(document)
        p = 0  # the token's position in its document (in this row)
        for token in tokens:
            ids.append(int(token))
            pos.append(p)
            labels.append(IGNORE_INDEX if p == 0 else int(token))
            p += 1
            if len(ids) == seq_len:
                rows.append(_row(ids, pos, labels))
                ids, pos, labels, p = [], [], [], 0
    return rows


def _row(ids: list[int], pos: list[int], labels: list[int]) -> dict[str, Tensor]:
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "position_ids": torch.tensor(pos, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
    }


def pad_to_multiple_of(batch: dict[str, Tensor], multiple: int, pad_id: int = 0) -> dict[str, Tensor]:
    """``batch`` (one packed row or a batch of rows) padded along the token dim (the last) to a multiple of
    ``multiple`` tokens, so that sequence parallelism can split rows of any length (sp divides the length, 2 x sp
    in ring mode), e.g. ``DataCollatorWithFlattening``'s::

        collate = lambda docs: pad_to_multiple_of(DataCollatorWithFlattening()(docs), 2 * sp)

    The padding is one document of its own: ``input_ids`` ``pad_id``, ``position_ids`` 0, 1, ... (a new document,
    so no real token attends to it, under a document mask or flash-attention's variable-length path, and causal
    attention keeps it out anyway at the end of a row), ``labels`` -100 (no loss: a token-mean loss is unchanged),
    ``attention_mask`` 0; any other tensor with the tokens' length is padded with 0."""
    if multiple < 1:
        raise ValueError(f"multiple must be positive, got {multiple}")
    length = batch["input_ids"].shape[-1]
    extra = -length % multiple
    if extra == 0:
        return dict(batch)
    fill = {"input_ids": pad_id, "labels": IGNORE_INDEX, "attention_mask": 0}
    out = {}
    for key, value in batch.items():
        if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[-1] != length:
            out[key] = value
        elif key == "position_ids":
            tail = torch.arange(extra, dtype=value.dtype, device=value.device).expand(*value.shape[:-1], extra)
            out[key] = torch.cat([value, tail], dim=-1)
        else:
            tail = value.new_full((*value.shape[:-1], extra), fill.get(key, 0))
            out[key] = torch.cat([value, tail], dim=-1)
    return out


__all__ = ["IGNORE_INDEX", "document_ids", "document_mask", "is_packed", "pack_documents", "pad_to_multiple_of"]
