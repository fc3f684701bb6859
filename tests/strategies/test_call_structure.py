"""A block's stack is verified on one call; a later call of another structure is refused, never run on the old
verdict. The case that made this necessary: an attention function registered with transformers that takes the
documents of a packed row from ``position_ids`` (flash-attention's variable-length path, emulated on CPU: no mask,
block-diagonal attention when the row's positions restart). A first row of one document verifies the hand-written
'llama' adapter (plain causal SDPA, which agrees there); before this check the later packed rows trained under
tp=2 and helix with attention across documents (losses 4.20013 / 4.17654 at steps 2-3 against 4.20120 / 4.17916
on one process). Now every rank stops with the structure that changed and the ways out."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.trainers import quick_fit

T, VOCAB = 32, 65


def _register() -> None:
    import torch.nn.functional as F
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from lightning_parallel.packing import document_mask

    def varlen(module, q, k, v, attention_mask, scaling=None, dropout=0.0, position_ids=None, **kwargs):  # type: ignore[no-untyped-def]
        B, n = q.shape[0], q.shape[2]
        packed = (
            attention_mask is None
            and position_ids is not None
            and B == 1
            and n > 1
            and bool((position_ids[..., 1:] != position_ids[..., :-1] + 1).any())
        )
        if attention_mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
        elif packed:  # flash_attn_varlen_func over the row's documents
            mask = document_mask(position_ids)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("varlen_emulated", varlen)
    AttentionMaskInterface.register("varlen_emulated", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def _rows() -> list[dict]:
    """A row of one document first, then rows of three documents each."""
    from lightning_parallel.packing import pack_documents
    from tests.helpers.packed import documents

    g = torch.Generator().manual_seed(7)
    first = pack_documents([torch.randint(0, VOCAB, (T,), generator=g)], T)[0]
    return [first, *pack_documents(documents(VOCAB, 8), T)[:7]]


class _Rows(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_rows(), batch_size=1, shuffle=False)


def _fit(rank: int, world: int, layout: str) -> None:
    from tests.helpers.packed import HFPackedLM

    _register()
    torch.manual_seed(0)
    module = HFPackedLM("llama", VOCAB, lr=1e-3, optimizer="adamw")
    module.model.config._attn_implementation = "varlen_emulated"
    strategy = {
        "tp2": lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        "helix2": lambda: HelixParallelStrategy(pipeline_parallel_size=2),
    }[layout]()
    quick_fit(module, _Rows(), strategy, world, steps=3, use_distributed_sampler=False)


@pytest.mark.parametrize("layout", ["tp2", "helix2"])
def test_a_packed_row_after_a_row_of_one_document_is_refused_under_a_varlen_attention(layout):
    with pytest.raises(RankFailed) as failed:
        run_distributed(_fit, 2, layout, init_process_group=False, timeout=120)
    message = str(failed.value)
    assert "StructureChanged" in message, message[-3000:]
    assert "position_ids restart (packed documents, no mask)" in message
    assert "position_ids do not restart" in message
