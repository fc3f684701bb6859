"""Every block verified as itself: blocks of one class that differ in a per-layer setting are
verified per distinct layer. The case that made this necessary: SmolLM3 turns rotary embeddings off in every
fourth layer (``config.no_rope_layers``, read into ``self_attn.use_rope``); the hand-written 'llama' adapter
matches every layer by its attribute names and computes rotary in all of them, and it was verified on the first
layer only, so under tp, helix and sequence parallelism the fourth layer trained with rotary, silently
(``pipeline``, which runs the blocks unchanged, was exact). Now the fourth layer's fingerprint differs, it is
verified on its own, the adapter fails there and the Hugging Face anatomy (the model's own forward) serves it.
Float64 parity with AdamW, so a 1e-5 difference cannot hide."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy
from tests.helpers.parity import assert_parity
from tests.helpers.zoo import HFCausalLM


class _LM(HFCausalLM):
    """The zoo's causal LM with its loss in the model's dtype (the zoo's casts logits to float32, whose rounding
    would bound a float64 comparison at 1e-7)."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        idx, targets = batch
        loss = F.cross_entropy(self.model(input_ids=idx).logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss


def _build(model, batch_size, optimizer, seed=0):  # type: ignore[no-untyped-def]
    from tests.helpers.zoo import CharDataModule

    torch.manual_seed(seed)
    data = CharDataModule(block_size=16, batch_size=batch_size, shuffle=False)
    return _LM(model, data.vocab_size, num_layers=4, lr=1e-3, optimizer=optimizer), data


STRATEGIES = {
    "tp2": lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
    "helix2": lambda: HelixParallelStrategy(pipeline_parallel_size=2),
    "ulysses2": lambda: HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2),
    "ring2": lambda: HybridParallelStrategy(
        data_parallel_size=1, sequence_parallel_size=2, sequence_parallel_mode="ring"
    ),
}


@pytest.mark.parametrize("layout", list(STRATEGIES))
def test_a_layer_without_rotary_among_layers_with_it_trains_as_itself(layout, monkeypatch):
    from tests.helpers import parity

    monkeypatch.setattr(parity, "build", _build)
    records = assert_parity("smollm3", STRATEGIES[layout], 2, data_parallel_size=1, global_batch=4, steps=2)
    anatomy = records[0].anatomy
    assert "hugging_face" in anatomy, anatomy  # the fourth layer (at least) is not served by the adapter
