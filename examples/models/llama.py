"""A Llama-style decoder: RMSNorm, rotary embeddings computed once and passed to every block,
separate q/k/v/o projections with grouped-query attention, SwiGLU MLP, untied head."""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F


def rope_tables(head_dim: int, seq_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin  # x: (B, nh, T, hd), cos/sin: (T, hd)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(L.LightningModule):
    """Character-level Llama; ``batch`` is ``(idx, targets)`` of shape ``(B, T)``."""

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

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.embed_tokens(idx)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        idx, targets = batch
        self.log("val_loss", F.cross_entropy(self(idx).flatten(0, 1), targets.flatten()), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
