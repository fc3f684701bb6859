"""The models of the coverage matrix, each a plain LightningModule as a user writes it, random init from a
small config (no downloads): Hugging Face families, litgpt's GPT, timm's VisionTransformer, Lightning's own
demo Transformer, and two blocks written here whose attribute names share nothing with nanoGPT or Llama.

Dropout is 0 everywhere (parity is defined without random masks). timm imports torchvision, whose PyPI
wheel cannot load beside the CPU build of torch 2.13 ("operator torchvision::nms does not exist"), so timm
is imported with :mod:`tests.helpers.torchvision_stub` standing in for torchvision (its ViT never calls it).
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from examples.data import CharDataModule

H, VOCAB_SLACK = 32, 0


class _Optim:
    lr: float
    opt: str

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


# ------------------------------------------------------------------------------------ Hugging Face
def hf_config(family: str, vocab: int, layers: int):
    import transformers as tf

    common = dict(vocab_size=vocab, num_hidden_layers=layers, num_attention_heads=4)
    llama_like = dict(hidden_size=H, intermediate_size=64, num_key_value_heads=2, **common)
    drop = dict(attention_dropout=0.0)
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=H, n_layer=layers, n_head=4, n_positions=64,
                             attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)  # fmt: skip
    if family == "llama":
        return tf.LlamaConfig(**llama_like, **drop)
    if family == "qwen2":
        return tf.Qwen2Config(**llama_like, **drop)
    if family == "qwen3":
        return tf.Qwen3Config(**llama_like, head_dim=8, **drop)
    if family == "mistral":
        return tf.MistralConfig(**llama_like, sliding_window=8, **drop)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**llama_like, head_dim=8, sliding_window=8, query_pre_attn_scalar=8,
                                   layer_types=["sliding_attention", "full_attention"] * (layers // 2), **drop)  # fmt: skip
    if family == "phi3":
        return tf.Phi3Config(**llama_like, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, **drop)
    if family == "neox":
        return tf.GPTNeoXConfig(hidden_size=H, intermediate_size=64, rotary_pct=0.5, hidden_dropout=0.0,
                                attention_dropout=0.0, **common)  # fmt: skip
    if family == "opt":
        return tf.OPTConfig(hidden_size=H, ffn_dim=64, word_embed_proj_dim=H, max_position_embeddings=64, dropout=0.0,
                            **drop, **common)  # fmt: skip
    if family == "falcon":
        return tf.FalconConfig(hidden_size=H, new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True,
                               bias=False, alibi=False, hidden_dropout=0.0, **drop, **common)  # fmt: skip
    if family == "gptj":
        return tf.GPTJConfig(vocab_size=vocab, n_embd=H, n_layer=layers, n_head=4, rotary_dim=4, n_positions=64,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    if family == "smollm3":  # rotary off in every 4th layer (no_rope_layers [1, 1, 1, 0]): one odd layer of four
        return tf.SmolLM3Config(**llama_like, pad_token_id=None, bos_token_id=None, eos_token_id=None, **drop)
    if family == "mixtral":
        return tf.MixtralConfig(**llama_like, num_local_experts=4, num_experts_per_tok=2, **drop)
    no_ids = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if family == "gpt_oss":  # learned attention sinks, sliding and full layers, biased experts
        return tf.GptOssConfig(**llama_like, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"] * (layers // 2), **no_ids,
                               **drop)  # fmt: skip
    if family == "deepseek_v3":  # latent attention (low-rank q and kv, rope and non-rope parts, v head size 8)
        return tf.DeepseekV3Config(hidden_size=H, intermediate_size=64, moe_intermediate_size=16,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab,
                                   num_hidden_layers=layers, n_routed_experts=4, n_shared_experts=1,
                                   num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                   kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                   v_head_dim=8, **no_ids, **drop)  # fmt: skip
    if family == "llama4":  # every token through a shared expert and 3-D routed experts the tp plan shards
        return tf.Llama4TextConfig(**llama_like, head_dim=8, intermediate_size_mlp=64, num_local_experts=4,
                                   num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8,
                                   no_rope_layers=[1] * layers, **no_ids, **drop)  # fmt: skip
    if family == "qwen3_moe":  # routed top-k experts as 3-D weights
        return tf.Qwen3MoeConfig(**llama_like, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16, **drop)  # fmt: skip
    if family == "qwen3_next":  # gated DeltaNet and full attention layers alternating; MoE with a shared expert
        return tf.Qwen3NextConfig(**llama_like, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                                  layer_types=["linear_attention", "full_attention"] * (layers // 2),
                                  linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=16, **no_ids, **drop)  # fmt: skip
    if family == "falcon_h1":  # attention and a Mamba-2 mixer side by side in every layer
        return tf.FalconH1Config(**llama_like, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                                 mamba_d_conv=4, mamba_chunk_size=8, **no_ids, **drop)  # fmt: skip
    if family == "bert":
        return tf.BertConfig(hidden_size=H, intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, **common)  # fmt: skip
    raise KeyError(family)


class HFCausalLM(_Optim, L.LightningModule):
    """An unchanged Hugging Face causal LM: logits from ``self.model(input_ids=...)``, cross-entropy."""

    def __init__(self, family: str, vocab_size: int, num_layers: int = 2, lr: float = 0.05, optimizer: str = "sgd"):
        super().__init__()
        import transformers

        # "+mask": an attention mask padding the last quarter of the rows whose first token is even; "+aux": the
        # router's balancing loss
        family, self.masked = family.removesuffix("+mask"), family.endswith("+mask")
        family, aux = family.removesuffix("+aux"), family.endswith("+aux")
        family, _, experts = family.partition("@")  # "mixtral@batched_mm": transformers' experts implementation
        config = hf_config(family, vocab_size, num_layers)
        if experts:
            config._experts_implementation = experts
        if aux:  # its coefficient large enough that a wrong balancing loss shows in the parameters
            config.output_router_logits, config.router_aux_loss_coef = True, 0.5
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        self.lr, self.opt = lr, optimizer

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        if self.masked:  # rows padded on the right, chosen by their content (however the batch is split)
            mask = torch.ones_like(idx)
            mask[:, -idx.shape[1] // 4 :] = (idx[:, :1] % 2 == 1).to(mask.dtype)
            out = self.model(input_ids=idx, attention_mask=mask)
        else:
            out = self.model(input_ids=idx)
        logits = out.logits
        # at least float32, as transformers' own loss (float64 stays float64: the parity contract's dtype)
        loss = F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                               targets.flatten())  # fmt: skip
        if getattr(out, "aux_loss", None) is not None:  # the router's load-balancing loss, as transformers adds it
            loss = loss + self.model.config.router_aux_loss_coef * out.aux_loss
        self.log("train_loss", loss)
        return loss


class HFMaskedLM(_Optim, L.LightningModule):
    """BERT for masked language modelling: every fourth position is masked and predicted (the same count in
    every sequence, so the mean over masked tokens is the mean over samples, however the batch is split)."""

    def __init__(self, vocab_size: int, num_layers: int = 2, lr: float = 0.05, optimizer: str = "sgd"):
        super().__init__()
        import transformers

        self.model = transformers.BertForMaskedLM(hf_config("bert", vocab_size + 1, num_layers))
        self.mask_id, self.lr, self.opt = vocab_size, lr, optimizer

    def training_step(self, batch, batch_idx):
        idx, _ = batch
        positions = torch.arange(idx.shape[1], device=idx.device)
        masked = (positions % 4 == 1).expand_as(idx)
        inputs = torch.where(masked, torch.full_like(idx, self.mask_id), idx)
        labels = torch.where(masked, idx, torch.full_like(idx, -100))
        loss = self.model(input_ids=inputs, labels=labels).loss
        self.log("train_loss", loss)
        return loss


class HFT5Encoder(_Optim, L.LightningModule):
    """T5's encoder with a linear head predicting the next character: its first layer computes the relative
    position bias that every later layer takes as an argument (a block's second output)."""

    def __init__(self, vocab_size: int, num_layers: int = 2, lr: float = 0.05, optimizer: str = "sgd"):
        super().__init__()
        import transformers

        config = transformers.T5Config(vocab_size=vocab_size, d_model=H, d_kv=8, d_ff=64, num_layers=num_layers,
                                       num_heads=4, dropout_rate=0.0)  # fmt: skip
        self.model = transformers.T5EncoderModel(config)
        self.head = nn.Linear(H, vocab_size, bias=False)
        self.lr, self.opt = lr, optimizer

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        hidden = self.model(input_ids=idx).last_hidden_state
        loss = F.cross_entropy(self.head(hidden).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss


# -------------------------------------------------------------------------------- litgpt and timm
class LitGPT(_Optim, L.LightningModule):
    """litgpt's ``GPT`` (Llama-style config: RMSNorm, SwiGLU, grouped queries, RoPE)."""

    def __init__(self, vocab_size: int, lr: float = 0.05, optimizer: str = "sgd"):
        super().__init__()
        from litgpt.model import GPT, Config

        config = Config(n_layer=2, n_head=4, n_embd=H, block_size=64, vocab_size=vocab_size,
                        padded_vocab_size=vocab_size, n_query_groups=2, intermediate_size=64, bias=False,
                        mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", rotary_percentage=1.0,
                        parallel_residual=False)  # fmt: skip
        self.model = GPT(config)
        self.lr, self.opt = lr, optimizer

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = F.cross_entropy(self.model(idx).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss


class TimmViT(_Optim, L.LightningModule):
    """timm's VisionTransformer on 32x32 images: 16 patches, a class token and 3 register tokens (20 tokens)."""

    def __init__(self, lr: float = 0.05, optimizer: str = "sgd"):
        super().__init__()
        from tests.helpers.torchvision_stub import install

        install()
        from timm.models.vision_transformer import VisionTransformer

        self.model = VisionTransformer(img_size=32, patch_size=8, embed_dim=H, depth=2, num_heads=4, mlp_ratio=2.0,
                                       num_classes=10, reg_tokens=3)  # fmt: skip
        self.lr, self.opt = lr, optimizer

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss)
        return loss


class Images(L.LightningDataModule):
    def __init__(self, batch_size: int, n: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False)


# --------------------------------------------------------------------------------- Lightning demo
class LightningDemo(_Optim, L.LightningModule):
    """Lightning's own demo ``Transformer`` (``nn.Transformer``: an encoder-decoder), small and without dropout,
    trained as its ``LightningTransformer`` does (the target as decoder input, NLL of log-softmax)."""

    def __init__(self, vocab_size: int, lr: float = 0.05, optimizer: str = "sgd"):
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=vocab_size, ninp=H, nhead=4, nhid=64, nlayers=2, dropout=0.0)
        self.lr, self.opt = lr, optimizer

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        loss = F.nll_loss(self.model(inputs, target), target.view(-1))
        self.log("train_loss", loss)
        return loss


# ------------------------------------------------------------------------------ written here
class Mixer(nn.Module):
    """Attention with its rotary embedding computed inside, from the positions of its own input."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.wo = nn.Linear(width, width, bias=False)
        self.heads = heads
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, width // heads, 2).float() / (width // heads)))

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        T = t.shape[2]
        angles = torch.outer(torch.arange(T, device=t.device, dtype=self.inv_freq.dtype), self.inv_freq)
        cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
        a, b = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-b, a), dim=-1) * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, W = x.shape
        split = lambda t: t.view(B, T, self.heads, W // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
        y = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, W))


class RoPEBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm_a, self.norm_b = nn.RMSNorm(width), nn.RMSNorm(width)
        self.mix = Mixer(width, heads)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm_a(x))
        return x + self.ff(self.norm_b(x))


class FusedAttention(nn.Module):
    """Fused q|k|v projection; the head count lives in ``nh``."""

    def __init__(self, width: int, nh: int) -> None:
        super().__init__()
        self.in_proj, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.nh = nh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, W = x.shape
        q, k, v = self.in_proj(x).view(B, T, 3, self.nh, W // self.nh).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, W))


class FusedBlock(nn.Module):
    def __init__(self, width: int, nh: int) -> None:
        super().__init__()
        self.pre, self.post = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = FusedAttention(width, nh)
        self.feedforward = nn.ModuleDict({"fc": nn.Linear(width, 4 * width), "proj": nn.Linear(4 * width, width)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.pre(x))
        return x + self.feedforward["proj"](F.gelu(self.feedforward["fc"](self.post(x))))


class ALiBiBlock(nn.Module):
    """Hand-written attention with a bias of its own (Press et al., arXiv 2108.12409): scores ``q k^T / sqrt(d)``
    plus a per-head linear distance penalty (slopes a registered buffer), a causal mask buffer filled with
    ``-inf``, softmax, ``@ v``; no SDPA call."""

    def __init__(self, width: int, nh: int, max_len: int = 64) -> None:
        super().__init__()
        self.nh, self.hd = nh, width // nh
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (i + 1) / nh) for i in range(nh)]))
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, self.nh, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        pos = torch.arange(T, device=x.device)
        distance = (pos[None, :] - pos[:, None]).to(scores.dtype)  # key - query: <= 0 where attended
        scores = scores + self.slopes.view(1, -1, 1, 1) * distance
        scores = scores.masked_fill(~self.causal[:T, :T], float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.o(y)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class MoE(nn.Module):
    """A home-written mixture as users write one: top-2 of 4 experts by a softmax router, the chosen weights
    renormalised (Mixtral's rule), a loop over the experts that skips those no token chose."""

    def __init__(self, width: int, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList([Expert(width) for _ in range(experts)])
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if len(token) == 0:
                continue
            out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


class MoEBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm_a, self.norm_b = nn.RMSNorm(width), nn.RMSNorm(width)
        self.mix = Mixer(width, heads)
        self.moe = MoE(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm_a(x))
        return x + self.moe(self.norm_b(x))


class HomeLM(_Optim, L.LightningModule):
    """A home-written decoder over ``RoPEBlock``, ``FusedBlock`` (learned positions), ``ALiBiBlock`` or
    ``MoEBlock`` (a home-written mixture of experts)."""

    def __init__(self, kind: str, vocab_size: int, lr: float = 0.05, optimizer: str = "sgd"):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, H)
        self.where = nn.Embedding(64, H) if kind == "fused" else None
        make = {"fused": lambda: FusedBlock(H, 4), "rope": lambda: RoPEBlock(H, 4), "alibi": lambda: ALiBiBlock(H, 4),
                "moe": lambda: MoEBlock(H, 4)}[kind]  # fmt: skip
        self.stack = nn.ModuleList([make() for _ in range(2)])
        self.out = nn.Linear(H, vocab_size)
        self.lr, self.opt = lr, optimizer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx)
        if self.where is not None:
            h = h + self.where(torch.arange(idx.shape[1], device=idx.device))
        for block in self.stack:
            h = block(h)
        return self.out(h) / math.sqrt(H)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = F.cross_entropy(self(idx).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss


HF_FAMILIES = (
    "gpt2",
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3",
    "phi3",
    "neox",
    "opt",
    "falcon",
    "gptj",
    "mixtral",
)
ROWS = (*(f"hf:{f}" for f in HF_FAMILIES), "hf:qwen3_moe", "hf:falcon_h1", "hf:gpt_oss", "hf:deepseek_v3", "hf:llama4",
        "hf:bert",
        "litgpt", "timm:vit", "lightning:demo", "home:rope", "home:fused", "home:alibi")  # fmt: skip
# what the parity helper builds: the matrix's rows, and models tested on their own (tests/strategies/test_families_2026.py)
MODELS = (*ROWS, "hf:qwen3_next", "hf:t5_encoder", "home:moe")


def build(
    row: str, batch_size: int, optimizer: str, lr: float, seq_len: int
) -> tuple[L.LightningModule, L.LightningDataModule]:
    """The row's module and data (seeded by the caller)."""
    if row == "timm:vit":
        return TimmViT(lr=lr, optimizer=optimizer), Images(batch_size)
    data = CharDataModule(block_size=seq_len, batch_size=batch_size, shuffle=False)
    vocab = data.vocab_size
    if row == "hf:bert":
        return HFMaskedLM(vocab, lr=lr, optimizer=optimizer), data
    if row == "hf:t5_encoder":
        return HFT5Encoder(vocab, lr=lr, optimizer=optimizer), data
    if row.startswith("hf:"):  # "hf:mixtral@batched_mm+aux#4": four layers (two by default), the balancing loss
        family, _, layers = row[3:].partition("#")
        return HFCausalLM(family, vocab, int(layers or 2), lr=lr, optimizer=optimizer), data
    if row == "litgpt":
        return LitGPT(vocab, lr=lr, optimizer=optimizer), data
    if row == "lightning:demo":
        return LightningDemo(vocab, lr=lr, optimizer=optimizer), data
    if row in ("home:rope", "home:fused", "home:alibi", "home:moe"):
        return HomeLM(row[5:], vocab, lr=lr, optimizer=optimizer), data
    raise KeyError(row)
