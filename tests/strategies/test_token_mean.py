"""Token-exact objectives: a loss that averages over a number of tokens that varies between
micro-batches and data-parallel replicas reproduces one device's whole-batch token mean under every strategy, and
the logged ``train_loss`` is one device's value on every rank (lightning_parallel/token_mean.py).

Two kinds of batches whose counts vary: packed rows of 1 to 4 documents (the first token of each document has no
label), trained by the example GPT in float64 with AdamW; and supervised fine-tuning rows whose prompts (2 to 24
tokens) carry -100, trained by an unchanged Hugging Face Llama from ``labels=`` (its loss upcasts logits to
float32: float32 with SGD). Before, micro-batches and replicas were weighted by samples: the GPT under 1F1B and
helix ended with parameters up to 5.5e-3 off."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.parity import assert_parity

T, VOCAB = 32, 65
#: documents per packed row, cycled: 1 to 4, so rows predict 31, 30, 29 or 28 tokens
DOCUMENTS = ((32,), (5, 27), (3, 3, 26), (10, 10, 6, 6), (1, 1, 1, 29), (20, 12), (16,) * 2, (7, 9, 16))


def packed_rows(n: int = 32) -> list[dict]:
    from lightning_parallel.packing import pack_documents

    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, VOCAB, (k,), generator=g) for r in range(n) for k in DOCUMENTS[r % len(DOCUMENTS)]]
    rows = pack_documents(docs, T)
    assert len(rows) == n
    return rows


def prompt_rows(n: int = 32) -> list[dict]:
    """Supervised fine-tuning rows: a prompt of 2 to 24 tokens without labels, then the answer's."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (T,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(2, 25, (), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


class Rows(L.LightningDataModule):
    def __init__(self, rows: list[dict], batch_size: int) -> None:
        super().__init__()
        self.rows, self.batch_size = rows, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.rows, batch_size=self.batch_size, shuffle=False)


def _build(model, batch_size, optimizer, seed=0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    if model == "gpt:packed-varying":
        from examples.models import GPT
        from tests.helpers.parity import MODEL_KWARGS

        kwargs = dict(MODEL_KWARGS["gpt"], n_layer=4, optimizer=optimizer, lr=1e-3)
        return GPT(vocab_size=VOCAB, block_size=T, **kwargs), Rows(packed_rows(), batch_size)
    from tests.helpers.packed import HFPackedLM

    return HFPackedLM("llama", VOCAB, num_layers=4, lr=0.05, optimizer=optimizer), Rows(prompt_rows(), batch_size)


LAYOUTS = {
    "dp2": (lambda: HybridParallelStrategy(data_parallel_size=2), 2, 2),
    "1f1b": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2), 1, 2),
    "helix": (lambda: HelixParallelStrategy(pipeline_parallel_size=2, folds=1), 1, 2),
    "tp2": (lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 1, 2),
    "dp2xpp2": (
        lambda: PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2),
        2,
        4,
    ),
}
FAST = {("gpt:packed-varying", "dp2"), ("gpt:packed-varying", "1f1b"), ("hf:sft", "helix")}


@pytest.mark.parametrize(
    "model,layout",
    [
        pytest.param(m, layout, marks=() if (m, layout) in FAST else pytest.mark.slow)
        for m in ("gpt:packed-varying", "hf:sft")
        for layout in LAYOUTS
    ],
)
def test_a_token_mean_over_varying_counts_is_one_devices(model, layout, monkeypatch):
    from tests.helpers import parity

    monkeypatch.setattr(parity, "build", _build)
    make, dp, world = LAYOUTS[layout]
    dtype = "float64" if model.startswith("gpt") else "float32"
    assert_parity(model, make, world, data_parallel_size=dp, dtype=dtype, global_batch=4, steps=3, logged_loss=True)


def test_the_counts_differ_between_the_halves_of_a_batch():
    """Not vacuous: within each batch of 4 rows the two halves (micro-batches, replicas) predict different numbers
    of tokens, in both kinds of data."""
    for rows in (packed_rows(), prompt_rows()):
        counts = [int((r["labels"][1:] != -100).sum()) for r in rows]
        halves = [(sum(counts[b : b + 2]), sum(counts[b + 2 : b + 4])) for b in range(0, 12, 4)]
        assert any(a != b for a, b in halves), halves


def test_a_loss_that_is_not_a_token_mean_is_weighted_by_samples_and_said_once():
    from lightning_parallel.token_mean import CrossEntropyCalls

    logits, target = torch.randn(6, 5), torch.tensor([1, -100, 2, 3, -100, 0])
    with CrossEntropyCalls() as calls:
        ce = torch.nn.functional.cross_entropy(logits, target)
        summed = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
        other = ce + 0.0
    assert int(calls.count_of(ce)) == 4
    assert calls.count_of(summed) is None and calls.count_of(other) is None
    weights = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0])
    with CrossEntropyCalls() as calls:
        weighted = torch.nn.functional.cross_entropy(logits, target, weight=weights)
    assert torch.isclose(calls.count_of(weighted), weights[target[target != -100]].sum().double())
