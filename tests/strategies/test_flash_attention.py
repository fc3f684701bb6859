"""flash-attention served, on CPU with an attention function that behaves as flash-attn's does
through transformers: registered in transformers' ``AttentionInterface`` with flash's mask function, its kernel
takes bfloat16 / float16 only (flash's error otherwise), float32 queries are cast to bfloat16 and back (as
transformers' ``flash_attention_forward`` casts to its target dtype), and a single row without a mask whose
``position_ids`` restart is attended document by document (flash-attn's variable-length path,
``_is_packed_sequence``).

The block cannot be verified in float64 or float32 itself: it is verified in float64 through flash-attention's
semantics (lightning_parallel/anatomy/flash.py), each call cross-checked against the function in bfloat16, and
trains with the function. The first batch is a row of one document, the next ones rows of three: each block is
verified again on the first packed row (a new call structure) and trains on it with parity to one process
running the same function. Parity is float32 with SGD (DESIGN 6): both runs round the same q, k, v to bfloat16."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.parity import assert_parity

T, VOCAB, NAME = 32, 65, "flash_emulated"


def _kernel(q, k, v, scale, documents):  # type: ignore[no-untyped-def]
    """flash-attn's kernel: (B, T, H, D) in, half precision only, causal, within documents when given."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    dtype = q.dtype
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    n = q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    if documents is not None:
        mask = mask & (documents[:, None] == documents[None, :])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).to(dtype)


def flash_emulated(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None,
                   **kwargs):  # type: ignore[no-untyped-def]  # fmt: skip
    dtype = query.dtype
    if dtype == torch.float32:  # transformers' target dtype (autocast's, or the quantised model's)
        query, key, value = (t.to(torch.bfloat16) for t in (query, key, value))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    documents = None
    if attention_mask is None and position_ids is not None and q.shape[0] == 1 and q.shape[1] > 1:
        flat = position_ids.reshape(-1)
        if bool((flat[1:] != flat[:-1] + 1).any()):
            documents = torch.cumsum((flat == flat.min()).long(), 0)
    out = _kernel(q, k, v, scaling, documents)
    return out.to(dtype), None


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, flash_emulated)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def rows(shuffled: bool = False) -> list[dict]:
    """A row of one document, then rows of three documents each. ``shuffled``: the row of one document where the
    training sampler Lightning installs (``DistributedSampler(shuffle=True, seed=0)``, one replica) takes its first
    sample, so that it is the first batch of size 1 there too."""
    from lightning_parallel.packing import pack_documents
    from tests.helpers.packed import documents

    g = torch.Generator().manual_seed(7)
    first = pack_documents([torch.randint(0, VOCAB, (T,), generator=g)], T)[0]
    packed = pack_documents(documents(VOCAB, 8), T)[:7]
    if not shuffled:
        return [first, *packed]
    at = int(torch.randperm(len(packed) + 1, generator=torch.Generator().manual_seed(0))[0])
    return [*packed[:at], first, *packed[at:]]


class Rows(L.LightningDataModule):
    def __init__(self, batch_size: int = 1, shuffled: bool = False) -> None:
        super().__init__()
        self.batch_size, self.shuffled = batch_size, shuffled

    def train_dataloader(self) -> DataLoader:
        return DataLoader(rows(self.shuffled), batch_size=self.batch_size, shuffle=False)


def flash_module(lr: float = 0.05, optimizer: str = "sgd") -> L.LightningModule:
    from tests.helpers.packed import HFPackedLM

    _register()
    module = HFPackedLM("llama", VOCAB, lr=lr, optimizer=optimizer)
    module.model.config._attn_implementation = NAME
    return module


def _build(model, batch_size, optimizer, seed=0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    return flash_module(optimizer=optimizer), Rows(batch_size, shuffled=True)


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), id="tp2"),
        pytest.param(lambda: HelixParallelStrategy(pipeline_parallel_size=2, folds=1), id="helix2"),
        pytest.param(lambda: HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2), id="ulysses2"),
    ],
)
def test_a_flash_like_attention_trains_on_packed_rows_after_an_unpacked_one(strategy, monkeypatch):
    from tests.helpers import parity

    monkeypatch.setattr(parity, "build", _build)
    records = assert_parity(NAME, strategy, 2, data_parallel_size=1, dtype="float32", global_batch=1, steps=4)
    assert all(name == "hugging_face" for name in records[0].anatomy), records[0].anatomy


def test_the_stand_in_matches_flash_semantics_and_a_function_of_other_semantics_is_refused():
    """The float64 stand-in agrees with the function in bfloat16 on packed and unpacked rows; a function
    registered as flash-like that ignores the documents is refused on the packed row, naming the difference."""
    import transformers

    from lightning_parallel.anatomy.flash import CROSS_CHECK, reference_attention, stand_in
    from lightning_parallel.errors import ConfigurationError
    from tests.helpers.zoo import hf_config

    _register()
    config = hf_config("llama", VOCAB, 1)
    config._attn_implementation = NAME
    block = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0).double()
    attention = block.self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, T, 16, generator=g, dtype=torch.float64) for _ in range(3))
    packed = rows()[1]["position_ids"][None]
    for positions in (torch.arange(T)[None], packed):
        want = flash_emulated(attention, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, position_ids=positions)[0]
        got = reference_attention(attention, q, k, v, None, position_ids=positions)
        assert (got - want.double()).abs().max() < CROSS_CHECK * v.abs().max() / 10
    causal = reference_attention(attention, q, k, v, None, position_ids=torch.arange(T)[None])
    within = reference_attention(attention, q, k, v, None, position_ids=packed)
    assert (causal - within).abs().max() > CROSS_CHECK * v.abs().max() * 5  # what the cross-check must see

    from transformers import AttentionInterface

    def ignores_documents(module, query, key, value, attention_mask, position_ids=None, **kwargs):  # type: ignore[no-untyped-def]
        return flash_emulated(module, query, key, value, attention_mask, position_ids=None, **kwargs)

    AttentionInterface.register("flash_ignoring_documents", ignores_documents)
    config._attn_implementation = "flash_ignoring_documents"
    with stand_in(block) as swapped:
        assert swapped
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS["flash_ignoring_documents"](
            attention, q, k, v, None, position_ids=torch.arange(T)[None]
        )
        with pytest.raises(ConfigurationError, match="differs from them by"):
            ALL_ATTENTION_FUNCTIONS["flash_ignoring_documents"](attention, q, k, v, None, position_ids=packed)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS["flash_ignoring_documents"] is ignores_documents  # the registry restored


def _fit_with_the_llama_adapter(rank: int, world: int) -> None:
    from tests.helpers.trainers import quick_fit

    torch.manual_seed(0)
    module = flash_module(lr=1e-3, optimizer="adamw")
    strategy = HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, adapter="llama")
    quick_fit(module, Rows(), strategy, world, steps=3, use_distributed_sampler=False)


def test_a_stack_that_does_not_reproduce_a_later_structure_is_refused():
    """The hand-written 'llama' adapter computes plain causal SDPA: named explicitly, it verifies on the row of
    one document, and the first packed row (documents from ``position_ids``, no mask) is verified again and
    refused on every rank, naming both structures, instead of training across documents."""
    with pytest.raises(RankFailed) as failed:
        run_distributed(_fit_with_the_llama_adapter, 2, init_process_group=False, timeout=120)
    message = str(failed.value)
    assert "StructureChanged" in message, message[-3000:]
    assert "position_ids restart (packed documents, no mask)" in message
    assert "position_ids do not restart" in message
    assert "does not reproduce" in message
