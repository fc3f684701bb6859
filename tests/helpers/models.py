"""Test-only models and data that stress what the example models do not.

- ``HFStyleDecoder``: Hugging Face-style decoder layers called as
  ``layer(hidden_states, attention_mask=..., position_ids=...)[0]`` that return a tuple, a 4-D additive
  mask and position ids built before the trunk, and a ``config.use_cache`` flag (pipelining must turn it off).
- ``VarLenCharData``: character batches whose sequence length changes from batch to batch.
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from examples.data import CharDataModule, CharWindows


class HFStyleLayer(nn.Module):
    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.norm = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.o = nn.Linear(h, h)
        self.pos_scale = nn.Parameter(torch.ones(1))
        self.mlp = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
        self.n_heads = config.num_attention_heads

    def forward(self, hidden_states, attention_mask=None, position_ids=None, output_attentions=False):
        B, T, H = hidden_states.shape
        x = self.norm(hidden_states)
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, H // self.n_heads).permute(2, 0, 3, 1, 4)
        q = q + self.pos_scale * position_ids[:, None, :, None].to(q.dtype) / T
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        hidden_states = hidden_states + self.o(y.transpose(1, 2).reshape(B, T, H))
        hidden_states = hidden_states + self.mlp(hidden_states)
        return (hidden_states, None)


class HFStyleModel(nn.Module):
    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([HFStyleLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids):
        B, T = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        causal = torch.full((T, T), float("-inf"), dtype=hidden_states.dtype).triu(1)
        attention_mask = causal[None, None].expand(B, 1, T, T)
        position_ids = torch.arange(T)[None].expand(B, T)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids)[0]
        return self.norm(hidden_states)


class HFStyleDecoder(L.LightningModule):
    def __init__(
        self,
        vocab_size: int = 65,
        hidden_size: int = 32,
        num_layers: int = 8,
        lr: float = 1e-3,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=4, use_cache=True,
        )  # fmt: skip
        self.model = HFStyleModel(self.config)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.lr, self.opt = lr, optimizer

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.lm_head(self.model(idx))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        # "adamw-foreach": torch's multi-tensor kernels, its default on CUDA
        return torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=self.opt == "adamw-foreach" or None)


def _truncating_collate(samples):
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    length = 6 + int(x[0, 0]) % 10  # a different sequence length from batch to batch
    return x[:, :length].contiguous(), y[:, :length].contiguous()


class VarLenCharData(CharDataModule):
    def train_dataloader(self) -> DataLoader:
        train = CharWindows(self.data[: len(self.data) - self.n_val], self.block_size, self.stride)
        return DataLoader(train, batch_size=self.batch_size, shuffle=self.shuffle, collate_fn=_truncating_collate)


from torch.utils.checkpoint import checkpoint  # noqa: E402

from examples.models.gpt import GPT, Block  # noqa: E402
from examples.models.llama import DecoderLayer, Llama  # noqa: E402


class _CheckpointedDecoderLayer(DecoderLayer):
    """A block that runs its own activation checkpointing, as users do."""

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + checkpoint(self.mlp, self.post_attention_layernorm(x), use_reentrant=False)


class CheckpointedLlama(Llama):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for layer in self.layers:
            layer.__class__ = _CheckpointedDecoderLayer


class SkipHeadLlama(Llama):
    """The head also sees the token embedding, detached (a skip around the trunk that carries no gradient):
    the loss depends on a pre-trunk value after the trunk, so the loss stage must hold the embedding too."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = emb = self.embed_tokens(idx)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h) + emb.detach())


class LearnedRopeLlama(Llama):
    """A frozen scale of the rotary tables, a parameter outside the trunk, in every block's arguments: a
    block argument computed from a parameter, without gradient (every stage needs its value)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rope_scale = nn.Parameter(torch.ones(()), requires_grad=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        cos, sin = self.rope_cos[:T] * self.rope_scale, self.rope_sin[:T] * self.rope_scale
        h = self.embed_tokens(idx)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


class DirectHeadGPT(GPT):
    """The tied head computed from the embedding's weight directly (``F.linear(x, wte.weight)``), not by
    calling a module: a sharded weight is then used outside its module's forward."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return F.linear(self.transformer.ln_f(x), self.transformer.wte.weight)


class SumLossGPT(GPT):
    """A GPT whose loss is summed over tokens (``loss_reduction="sum"`` under pipelining)."""

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self(idx)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="sum")
        self.log("train_loss", loss, reduce_fx="sum")
        return loss


class TwoPassGPT(GPT):
    """Calls the trunk twice per training step (two views), which pipelined training does not support."""

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        a, b = self(idx), self(idx.flip(1))
        return F.cross_entropy(a.flatten(0, 1), targets.flatten()) + F.cross_entropy(b.flatten(0, 1), targets.flatten())


class HFCausalLM(L.LightningModule):
    """An unchanged Hugging Face causal LM (``LlamaForCausalLM`` or ``GPT2LMHeadModel``, small config, no
    download) trained the ordinary way: logits from ``self.model(input_ids=...)``, cross-entropy."""

    def __init__(
        self,
        family: str = "llama",
        vocab_size: int = 65,
        num_layers: int = 8,
        lr: float = 1e-3,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.family, self.vocab_size, self.num_layers = family, vocab_size, num_layers
        self.model = self._make()
        self.lr, self.opt = lr, optimizer

    def _make(self) -> nn.Module:
        import transformers

        if self.family == "llama":
            config = transformers.LlamaConfig(
                vocab_size=self.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=self.num_layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            )  # fmt: skip
            return transformers.LlamaForCausalLM(config)
        if self.family == "mixtral":  # the zoo's mixture, its experts run by batched_mm (float64 on CPU)
            from tests.helpers.zoo import hf_config

            config = hf_config("mixtral", self.vocab_size, self.num_layers)
            config._experts_implementation = "batched_mm"
            return transformers.AutoModelForCausalLM.from_config(config)
        config = transformers.GPT2Config(
            vocab_size=self.vocab_size, n_embd=32, n_layer=self.num_layers, n_head=4, n_positions=64,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.model(input_ids=idx).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class _NormBlock(nn.Module):
    """A block with no attention call and a projection whose output is normalised over its whole width:
    nothing in it can be split by heads, sequence or columns."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return x + self.norm(self.proj(x))


class NoAttentionLM(L.LightningModule):
    def __init__(self, vocab_size: int = 65, width: int = 32, lr: float = 0.05) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList([_NormBlock(width) for _ in range(2)])
        self.head = nn.Linear(width, vocab_size)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class DeferredHFCausalLM(HFCausalLM):
    """The Hugging Face model built in ``configure_model`` with no device context, as on one device: the
    lightning-parallel strategies run it on the meta device and replay what it computes (its ``_init_weights``,
    its rotary tables) per tensor at set-up: one device's values."""

    def __init__(self, family: str = "llama", vocab_size: int = 65, num_layers: int = 8, lr: float = 1e-3,
                 optimizer: str = "adamw") -> None:  # fmt: skip
        L.LightningModule.__init__(self)
        self.family, self.vocab_size, self.num_layers = family, vocab_size, num_layers
        self.lr, self.opt = lr, optimizer

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = self._make()


class DeferredGPT(GPT):
    """The example GPT built in ``configure_model`` (Lightning's large-model path) with no device context: the
    lightning-parallel strategies run it on the meta device, one device eagerly. ``init_module``: build in
    ``__init__`` instead (for ``Trainer.init_module(empty_init=True)``)."""

    def __init__(
        self, vocab_size: int = 65, block_size: int = 64, n_layer: int = 4, n_head: int = 4, n_embd: int = 64,
        lr: float = 3e-3, optimizer: str = "adamw", weight_decay: float = 0.0, init_module: bool = False,
    ) -> None:  # fmt: skip
        L.LightningModule.__init__(self)
        self.save_hyperparameters(
            dict(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                 lr=lr, optimizer=optimizer, weight_decay=weight_decay)
        )  # fmt: skip
        if init_module:
            self._build()

    def _build(self) -> None:
        h = self.hparams
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(h.vocab_size, h.n_embd),
                wpe=nn.Embedding(h.block_size, h.n_embd),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList([Block(h.n_embd, h.n_head, 0.0, True) for _ in range(h.n_layer)]),
                ln_f=nn.LayerNorm(h.n_embd),
            )
        )
        self.lm_head = nn.Linear(h.n_embd, h.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def configure_model(self) -> None:
        if not hasattr(self, "lm_head"):  # on meta under the strategies, which materialise each rank's share
            self._build()


class OwnInitGPT(DeferredGPT):
    """The example GPT built in ``configure_model`` with the model's own initialisation applied there, in the
    idioms people write: nanoGPT's ``self.apply(self._init_weights)`` and its scaled residual projections by
    ``nn.init`` on named parameters, timm's ``trunc_normal_`` (which returns at once on a meta tensor),
    ``orthogonal_``, a write through ``.data`` and an item assignment. Under the strategies all of it runs on
    meta and is replayed per tensor; one process runs it eagerly: the initial parameters must be equal."""

    def configure_model(self) -> None:
        if hasattr(self, "lm_head"):
            return
        self._build()
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * self.hparams.n_layer) ** 0.5)
        nn.init.trunc_normal_(self.transformer.wpe.weight, std=0.02)
        nn.init.orthogonal_(self.transformer.h[1].attn.c_attn.weight)
        self.transformer.h[-1].mlp.c_fc.weight.data.uniform_(-0.05, 0.05)
        with torch.no_grad():
            self.transformer.ln_f.weight[::2] = 0.5
