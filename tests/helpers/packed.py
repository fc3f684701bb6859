"""Packed batches for the parity tests: rows of several documents, as Hugging Face's
``DataCollatorWithFlattening`` lays them out (``input_ids``, ``position_ids`` restarting at 0 at each document,
``labels`` with -100 at each document's first token), made by :func:`lightning_parallel.packing.pack_documents`.

The document lengths differ from row to row: some are longer than a ring chunk (T / 2sp) and cross chunk
boundaries, some are a single token, and one fills a whole row. Every row holds the same number of documents,
so every row has the same number of predicted tokens: a token-mean loss over a micro-batch or a replica is
then the same mean as over the whole batch, and parity is defined (docs/guide.md, "Packed sequences", says
what varying counts need).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from lightning_parallel.packing import pack_documents

SEQ_LEN = 32
DOCS_PER_ROW = 3
#: document lengths of each row (sum SEQ_LEN, DOCS_PER_ROW documents); cycled over the rows
LAYOUTS = (
    (5, 14, 13),
    (1, 30, 1),
    (20, 2, 10),
    (9, 9, 14),
    (30, 1, 1),
    (3, 3, 26),
    (12, 12, 8),
    (2, 17, 13),
)


def documents(vocab_size: int, rows: int, seed: int = 0) -> list[torch.Tensor]:
    """``rows`` rows' worth of random documents, in the lengths of :data:`LAYOUTS`."""
    g = torch.Generator().manual_seed(seed)
    lengths = [n for r in range(rows) for n in LAYOUTS[r % len(LAYOUTS)]]
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]


class PackedData(L.LightningDataModule):
    """Packed rows of random documents (deterministic), batched by the default collate."""

    def __init__(self, vocab_size: int = 65, batch_size: int = 8, rows: int = 64, seq_len: int = SEQ_LEN) -> None:
        super().__init__()
        self.vocab_size, self.batch_size = vocab_size, batch_size
        self.rows = pack_documents(documents(vocab_size, rows), seq_len)
        assert len(self.rows) == rows

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.rows, batch_size=self.batch_size, shuffle=False)


class HFPackedLM(L.LightningModule):
    """An unchanged Hugging Face causal LM trained on packed rows the Hugging Face way: ``self.model(**batch)``
    computes the loss from ``labels=``, and the model builds the document mask from ``position_ids``.
    ``use_cache=False``: with a cache, transformers builds no document mask (docs/guide.md)."""

    def __init__(self, family: str, vocab_size: int, num_layers: int = 2, lr: float = 0.05, optimizer: str = "sgd"):
        super().__init__()
        import transformers

        from tests.helpers.zoo import hf_config

        config = hf_config(family, vocab_size, num_layers)
        config.use_cache = False
        self.model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)
        self.lr, self.opt = lr, optimizer

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


#: the models of the packed parity tests: the two example decoders and Hugging Face families
MODELS = ("gpt", "llama", "hf:llama", "hf:qwen2")


def build(model: str, batch_size: int, optimizer: str, lr: float) -> tuple[L.LightningModule, L.LightningDataModule]:
    """``model`` (one of :data:`MODELS`, or any ``hf:<family>`` of the zoo) and its packed data."""
    from examples.models import GPT, Llama
    from tests.helpers.parity import MODEL_KWARGS

    data = PackedData(batch_size=batch_size)
    if model.startswith("hf:"):
        return HFPackedLM(model[3:], data.vocab_size, lr=lr, optimizer=optimizer), data
    cls = {"gpt": GPT, "llama": Llama}[model]
    kwargs = dict(MODEL_KWARGS[model], n_layer=4, optimizer=optimizer, lr=lr)
    return cls(vocab_size=data.vocab_size, block_size=SEQ_LEN, **kwargs), data
