"""A sequence classifier built on ``torch.nn.TransformerEncoder``; logs a torchmetrics accuracy."""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics


class EncoderClassifier(L.LightningModule):
    """``batch`` is ``(tokens, labels)``: tokens ``(B, T)`` int, labels ``(B,)`` int."""

    def __init__(
        self,
        vocab_size: int = 32,
        max_len: int = 32,
        num_classes: int = 4,
        d_model: int = 32,
        nhead: int = 4,
        num_layers: int = 4,
        dim_feedforward: int = 64,
        dropout: float = 0.0,
        lr: float = 1e-3,
        optimizer: Literal["adamw", "sgd"] = "adamw",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers)
        self.head = nn.Linear(d_model, num_classes)
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.size(1)]
        return self.head(self.encoder(x).mean(dim=1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits, labels)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, labels = batch
        logits = self(tokens)
        self.val_acc(logits, labels)
        self.log("val_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
