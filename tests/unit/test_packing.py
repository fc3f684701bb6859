"""Packed rows (lightning_parallel/packing.py) and the ring's split of them, without processes."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.packing import IGNORE_INDEX, document_ids, document_mask, is_packed, pack_documents
from lightning_parallel.sequence_parallel import balanced_chunks


def test_documents_are_where_transformers_finds_them():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [3, 4, 5, 6, 7, 8, 9, 10]])
    assert document_ids(positions).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]
    torch.testing.assert_close(document_ids(positions)[:1], masking_utils.find_packed_sequence_indices(positions[:1]))
    assert is_packed(positions) and not is_packed(positions[1:])


def test_the_document_mask_is_causal_within_each_document():
    mask = document_mask(torch.tensor([[0, 1, 2, 0, 1]]))
    want = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool
    )
    assert mask.shape == (1, 1, 5, 5) and torch.equal(mask[0, 0], want)
    assert torch.equal(document_mask(torch.tensor([[0, 1, 0]]), causal=False)[0, 0].int(),
                       torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 1]]))  # fmt: skip


def test_documents_are_packed_into_rows_as_the_flattening_collator_lays_them_out():
    rows = pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [12]], seq_len=4)
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert [r["position_ids"].tolist() for r in rows] == [[0, 1, 2, 0], [0, 0, 1, 2], [0, 1, 2, 0]]
    x = IGNORE_INDEX  # at each document's first token, and where a cut document goes on in the next row
    assert [r["labels"].tolist() for r in rows] == [[x, 2, 3, x], [x, x, 7, 8], [x, 10, 11, x]]
    with pytest.raises(ValueError, match="seq_len must be positive"):
        pack_documents([[1]], 0)


@pytest.mark.parametrize("sp", [1, 2, 3, 4, 8])
def test_without_a_mask_the_ring_splits_its_chunks_in_the_zigzag(sp):
    assert balanced_chunks(None, sp) == tuple(c for r in range(sp) for c in (r, 2 * sp - 1 - r))
    causal = torch.ones(8 * sp, 8 * sp, dtype=torch.bool).tril()
    assert balanced_chunks(causal, sp) == balanced_chunks(None, sp)


def test_under_documents_the_ring_pairs_its_busiest_chunks_with_its_idlest():
    mask = document_mask(torch.cat([torch.arange(n) for n in (12, 12, 4, 4)])[None])  # 8 chunks of 4
    chunks = balanced_chunks(mask, 4)
    loads = {0: 1, 1: 2, 2: 3, 3: 1, 4: 2, 5: 3, 6: 1, 7: 1}  # key chunks each query chunk attends to
    per_rank = [loads[chunks[2 * r]] + loads[chunks[2 * r + 1]] for r in range(4)]
    assert sorted(per_rank) == [3, 3, 4, 4], (chunks, per_rank)  # the zig-zag: 2, 3, 6, 3
    additive = torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, torch.finfo(torch.float32).min)
    assert balanced_chunks(additive, 4) == chunks


def test_padding_a_flattened_row_changes_neither_the_loss_nor_the_gradients():
    """A row of 37 tokens (three documents, DataCollatorWithFlattening's layout) padded to 40 for sp=4: the padding
    is a document of its own without labels, so the Hugging Face Llama's loss and every gradient are unchanged."""
    import transformers

    from lightning_parallel.packing import pad_to_multiple_of
    from tests.helpers.zoo import hf_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config("llama", 65, 2)).double()
    g = torch.Generator().manual_seed(0)
    row = pack_documents([torch.randint(0, 65, (n,), generator=g) for n in (10, 20, 7)], 37)[0]
    row = {k: v[None] for k, v in row.items()}
    padded = pad_to_multiple_of(row, 8)
    assert padded["input_ids"].shape == (1, 40) and padded["labels"][0, 37:].eq(-100).all()
    assert padded["position_ids"][0, 37:].tolist() == [0, 1, 2]
    results = []
    for batch in (row, padded):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)  # the model's loss upcasts logits to float32
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-9, msg=name)
    assert pad_to_multiple_of(padded, 8)["input_ids"].shape == (1, 40)  # already a multiple: unchanged
