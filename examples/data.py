"""Data for the examples: a character-level corpus shipped in the repo, and a synthetic
sequence-classification task. Both are deterministic (no download, no randomness in the data)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

CORPUS = Path(__file__).parent / "data" / "sonnets.txt"


class CharWindows(Dataset):
    """``(x, y)`` windows of ``block_size`` characters, ``y`` shifted by one, starting every ``stride``."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int) -> None:
        self.data, self.block_size = data, block_size
        self.starts = list(range(0, len(data) - block_size - 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        chunk = self.data[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(L.LightningDataModule):
    """Character-level language modelling on a text file; ``vocab_size`` is known at construction."""

    def __init__(
        self,
        path: str = str(CORPUS),
        block_size: int = 64,
        batch_size: int = 16,
        stride: int = 0,
        val_fraction: float = 0.1,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        text = Path(path).read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.block_size, self.batch_size = block_size, batch_size
        self.stride = stride or block_size
        self.n_val = int(len(self.data) * val_fraction)
        self.shuffle = shuffle

    def train_dataloader(self) -> DataLoader:
        train = CharWindows(self.data[: len(self.data) - self.n_val], self.block_size, self.stride)
        return DataLoader(train, batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        val = CharWindows(self.data[len(self.data) - self.n_val :], self.block_size, self.block_size)
        return DataLoader(val, batch_size=self.batch_size)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


class ClassificationDataModule(L.LightningDataModule):
    """Token sequences labelled by which of ``num_classes`` token ranges is most frequent."""

    def __init__(
        self,
        num_samples: int = 512,
        vocab_size: int = 32,
        seq_len: int = 32,
        num_classes: int = 4,
        batch_size: int = 16,
        seed: int = 1234,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)
        bucket = tokens * num_classes // vocab_size
        labels = torch.stack([(bucket == c).sum(1) for c in range(num_classes)], 1).argmax(1)
        n_val = num_samples // 8
        self.train = TensorDataset(tokens[n_val:], labels[n_val:])
        self.val = TensorDataset(tokens[:n_val], labels[:n_val])
        self.batch_size, self.shuffle = batch_size, shuffle

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)
