"""A mixture of experts as a user writes it: Hugging Face's Mixtral built from a small config (random init, no
download), trained as on one device (the logits, cross-entropy). Nothing here knows about parallelism."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F


class Mixtral(L.LightningModule):
    def __init__(
        self,
        vocab_size: int = 65,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        num_experts: int = 4,
        experts_per_token: int = 2,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        import transformers

        config = transformers.MixtralConfig(
            vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=2 * n_embd, num_hidden_layers=n_layer,
            num_attention_heads=n_head, num_key_value_heads=n_head, max_position_embeddings=block_size,
            num_local_experts=num_experts, num_experts_per_tok=experts_per_token, use_cache=False,
        )  # fmt: skip
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        self.lr = lr

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch
        logits = self.model(input_ids=idx).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
