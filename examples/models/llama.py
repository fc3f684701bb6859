"""A Llama-style decoder: RMSNorm, rotary embeddings computed once and passed to every block,
separate q/k/v/o projections with grouped-query attention, SwiGLU MLP, untied head. Packed rows
(``position_ids`` restarting at each document) take each token's rotary angle from its position in its
document and attend within their documents through a block-diagonal causal mask."""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.models.documents import IGNORE_INDEX, document_mask


def rope_tables(head_dim: int, seq_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin  # x: (B, nh, T, hd), cos/sin: (T, hd) or (B, 1, T, hd)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, attention_mask, is_causal=attention_mask is None, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.self_attn = Attention(dim, n_heads, n_kv_heads)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.mlp = SwiGLU(dim, hidden)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(L.LightningModule):
    """Character-level Llama; ``batch`` is ``(idx, targets)`` of shape ``(B, T)``, or packed rows
    ``{"input_ids", "position_ids", "labels"}`` (as the example GPT takes them)."""

    def __init__(
        self,
        vocab_size: int = 65,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_kv_head: int = 2,
        dim: int = 64,
        mlp_hidden: int = 176,
        eps: float = 1e-5,
        lr: float = 3e-3,
        optimizer: Literal["adamw", "sgd"] = "adamw",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([DecoderLayer(dim, n_head, n_kv_head, mlp_hidden, eps) for _ in range(n_layer)])
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        cos, sin = rope_tables(dim // n_head, block_size)
        self.register_buffer("rope_cos", cos.float(), persistent=False)
        self.register_buffer("rope_sin", sin.float(), persistent=False)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.size(1)
        extra = {}
        if position_ids is None:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        else:  # each token's angle from its own position: (B, 1, T, head_dim), broadcast over the heads
            cos, sin = self.rope_cos[position_ids].unsqueeze(1), self.rope_sin[position_ids].unsqueeze(1)
            mask = document_mask(position_ids)
            if mask is not None:
                extra["attention_mask"] = mask
        h = self.embed_tokens(idx)
        for layer in self.layers:
            h = layer(h, cos, sin, **extra)
        return self.lm_head(self.norm(h))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]) -> torch.Tensor:
        if isinstance(batch, dict):  # packed rows: predict each next token of the same document
            logits = self(batch["input_ids"], batch.get("position_ids"))[:, :-1]
            targets = batch["labels"][:, 1:]
        else:
            idx, targets = batch
            logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
