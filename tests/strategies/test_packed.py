"""Packed batches (several documents per row, ``position_ids`` restarting at each) under the strategies.

The packed rows of the coverage matrix (tests/strategies/test_coverage.py) show every strategy reproducing one
process on them. That alone would not catch a one-process run that attends across documents, so the first
tests here check the references themselves: a token's output does not depend on other documents. The rest:
ring attention with documents across its chunk boundaries (and the pairs it skips and balances), Hugging Face's
own ``DataCollatorWithFlattening``, the KV cache that makes transformers skip the document mask on one device,
and the refusal where a document mask cannot be honoured.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_parallel import HybridParallelStrategy, PipelineParallelStrategy
from lightning_parallel.packing import document_mask
from tests.helpers import packed
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_parity
from tests.helpers.trainers import quick_fit

pytest.importorskip("transformers")


def _logits(module, batch) -> torch.Tensor:
    if hasattr(module, "model"):  # Hugging Face
        return module.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    return module(batch["input_ids"], batch["position_ids"])


@pytest.mark.parametrize("model", [*packed.MODELS, "hf:gpt2"])
def test_the_one_process_reference_attends_within_each_document(model):
    torch.manual_seed(0)
    module, data = packed.build(model, 2, "sgd", 0.05)
    batch = next(iter(data.train_dataloader()))
    first = packed.LAYOUTS[0][0]  # row 0: documents of 5, 14 and 13 tokens
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, :first] = (changed["input_ids"][0, :first] + 1) % data.vocab_size
    with torch.no_grad():
        a, b = _logits(module, batch), _logits(module, changed)
    assert not torch.allclose(a[0, :first], b[0, :first]), "the change must reach its own document"
    torch.testing.assert_close(a[0, first:], b[0, first:], rtol=0, atol=0)  # the other documents: untouched
    torch.testing.assert_close(a[1:], b[1:], rtol=0, atol=0)


def test_with_its_kv_cache_on_a_hugging_face_model_attends_across_documents_on_one_device():
    """transformers 5.x builds the document mask only when no cache is passed (``_preprocess_mask_arguments``):
    with ``use_cache=True`` (the configs' default) a packed batch attends across documents on one device. Every
    strategy turns the cache off (trunk.py). If transformers changes this, docs/guide.md changes."""
    torch.manual_seed(0)
    module, data = packed.build("hf:llama", 2, "sgd", 0.05)
    module.model.config.use_cache = True
    batch = next(iter(data.train_dataloader()))
    first = packed.LAYOUTS[0][0]
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, :first] = (changed["input_ids"][0, :first] + 1) % data.vocab_size
    module.train()
    with torch.no_grad():
        a, b = _logits(module, batch), _logits(module, changed)
    assert not torch.allclose(a[0, first:], b[0, first:])


def _fit_with_cache(rank, world_size):
    torch.manual_seed(0)
    module, data = packed.build("hf:llama", 4, "sgd", 0.05)
    module.model.config.use_cache = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quick_fit(module, data, HybridParallelStrategy(data_parallel_size=2), world_size, steps=1)
    return module.model.config.use_cache, [
        str(w.message) for w in caught if "packs several documents" in str(w.message)
    ]


def test_data_parallelism_turns_the_cache_off_and_says_what_that_changes_for_packed_batches():
    (cache0, said0), (cache1, said1) = run_distributed(_fit_with_cache, 2, init_process_group=False)
    assert cache0 is False and cache1 is False  # every layout trains the same (document-masked) model
    assert len(said0) == 1 and not said1, (said0, said1)  # rank 0, once
    assert "Set use_cache=False in the model's config to train the same model on one device" in said0[0]


@pytest.mark.parametrize("sp", [2, 4])
def test_ring_with_documents_across_its_chunk_boundaries_matches_one_process(sp):
    """Rows of 32 tokens: at sp=4 a chunk holds 4 tokens, and documents of 14, 20, 26 and 30 tokens span up to
    eight chunks; documents of one token sit inside one. float64, AdamW."""
    strategy = lambda: HybridParallelStrategy(sequence_parallel_size=sp, sequence_parallel_mode="ring")  # noqa: E731
    assert_parity("packed:llama", strategy, sp, data_parallel_size=1)


def _ring_against_sdpa(rank, world_size, lengths):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_parallel import ring_attention
    from lightning_parallel.block_protocol import AttentionCall
    from lightning_parallel.sequence_parallel import SequenceShard, attend, balanced_chunks

    g = torch.Generator().manual_seed(0)
    T = sum(lengths)
    q, k, v = (torch.randn(1, 2, T, 8, dtype=torch.float64, generator=g) for _ in range(3))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    mask = document_mask(positions)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("sp",))
    shard = SequenceShard.of(mesh, "ring", T, q.device, mask)
    local = [t.index_select(2, shard.index).requires_grad_() for t in (q, k, v)]
    ring_attention.WORK.clear()
    out = attend(shard, *local, lambda *a: None, lambda: AttentionCall(False, None, 0.0, mask))
    out.sum().backward()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*whole, attn_mask=mask).sum().backward()
    torch.testing.assert_close(out, want.index_select(2, shard.index), rtol=1e-10, atol=1e-12)
    for got, ref in zip(local, whole):
        torch.testing.assert_close(got.grad, ref.grad.index_select(2, shard.index), rtol=1e-10, atol=1e-12)
    dist.barrier()
    return sum(ring_attention.WORK.values()), shard.chunks, balanced_chunks(None, world_size)


def test_ring_skips_the_chunk_pairs_documents_leave_empty_and_pairs_its_chunks_by_their_work():
    # 8 chunks of 4 tokens, documents of 3, 3, 1 and 1 chunks: the query chunks attend to 1, 2, 3, 1, 2, 3, 1, 1
    # key chunks. The zig-zag (rank r: chunks r and 7-r) would give the ranks 2, 3, 6 and 3 pairs to compute;
    # paired by their work, the chunks give 4, 4, 3 and 3
    results = run_distributed(_ring_against_sdpa, 4, (12, 12, 4, 4))
    work = [w for w, _, _ in results]
    chunks, zigzag = results[0][1], results[0][2]
    assert zigzag == (0, 7, 1, 6, 2, 5, 3, 4)
    assert chunks == (2, 7, 5, 6, 1, 3, 0, 4) and all(r[1] == chunks for r in results)  # the same on every rank
    c = 4 * 4  # the scores of one pair
    assert sorted(work) == [3 * c, 3 * c, 4 * c, 4 * c], work  # of 2 x 8 pairs each without skipping


class _Flattened(L.LightningDataModule):
    """Documents batched by Hugging Face's own ``DataCollatorWithFlattening``: one row of every document of the
    batch, shape (1, total tokens); four documents per batch. Every length is a multiple of 4, so a batch's row
    divides into 2 x sp chunks however the sampler shuffles them."""

    LENGTHS = ((4, 16, 12, 4), (8, 28, 4, 8), (20, 4, 12, 4), (12, 8, 16, 4))

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.vocab_size, self.batch_size = 65, batch_size
        lengths = [n for row in self.LENGTHS * 4 for n in row]
        self.docs = [{"input_ids": torch.randint(0, 65, (n,), generator=g).tolist()} for n in lengths]

    def train_dataloader(self) -> DataLoader:
        from transformers import DataCollatorWithFlattening

        return DataLoader(self.docs, batch_size=self.batch_size, shuffle=False, collate_fn=DataCollatorWithFlattening())


def _flattened_build(model, batch_size, optimizer, seed=0):
    torch.manual_seed(seed)
    data = _Flattened(batch_size)
    return packed.HFPackedLM("llama", data.vocab_size, lr=0.05 if optimizer == "sgd" else 1e-3,
                             optimizer=optimizer), data  # fmt: skip


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(lambda: HybridParallelStrategy(sequence_parallel_size=2), id="ulysses"),
        pytest.param(
            lambda: HybridParallelStrategy(sequence_parallel_size=2, sequence_parallel_mode="ring"), id="ring"
        ),
        pytest.param(lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2), id="pipeline"),
    ],
)
def test_hugging_face_data_collator_with_flattening_matches_one_process(strategy, monkeypatch):
    """The issue's own set-up: an unchanged Hugging Face Llama, batches flattened by transformers'
    ``DataCollatorWithFlattening`` (one row per batch, so the pipeline runs one micro-batch and a padding one)."""
    from tests.helpers import parity

    monkeypatch.setattr(parity, "build", _flattened_build)
    assert_parity("flattened", strategy, 2, data_parallel_size=1, dtype="float32", global_batch=4)


def test_flash_attention_documents_are_refused_under_ring_attention():
    """flash-attn's variable-length path takes the documents from ``position_ids`` or ``cu_seq_lens_*`` and
    builds no mask; the ring's chunk pairs would attend across documents, so ring mode refuses it. Ulysses gives
    the function whole rows (and their positions): accepted (trained in tests/strategies/test_flash_attention.py)."""
    import transformers

    from lightning_parallel.anatomy.hugging_face import HuggingFaceAnatomy
    from lightning_parallel.errors import ConfigurationError

    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    block = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
    packed_positions = torch.cat([torch.arange(5), torch.arange(11)])[None]
    for implementation, kwargs, refused in [
        ("flash_attention_2", {"position_ids": packed_positions}, True),
        (
            "flash_attention_2",
            {"position_ids": torch.arange(16)[None], "cu_seq_lens_q": torch.tensor([0, 5, 16])},
            True,
        ),
        ("flash_attention_2", {"position_ids": torch.arange(16)[None]}, False),  # one document per row
        (
            "flash_attention_2",
            {"position_ids": packed_positions, "attention_mask": document_mask(packed_positions)},
            False,
        ),  # fmt: skip
        ("sdpa", {"position_ids": packed_positions, "cu_seq_lens_q": torch.tensor([0, 5, 16])}, False),
    ]:
        config._attn_implementation = implementation
        sample = (torch.zeros(1, 16, 32), (), kwargs)
        ulysses = HuggingFaceAnatomy(config, sample, family_level=True)
        ulysses.sequence_args(block, (), kwargs, torch.arange(8))
        ring = HuggingFaceAnatomy(config, sample, family_level=True, ring=True)
        if refused:
            with pytest.raises(ConfigurationError, match="use sequence_parallel_mode='ulysses'"):
                ring.sequence_args(block, (), kwargs, torch.arange(8))
        else:
            ring.sequence_args(block, (), kwargs, torch.arange(8))
