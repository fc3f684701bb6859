"""Llama-style blocks: ``input_layernorm``, ``self_attn.{q,k,v,o}_proj`` with grouped-query attention,
rotary embeddings passed in as ``(cos, sin)`` positionally or as Hugging Face's
``position_embeddings=(cos, sin)``, ``post_attention_layernorm``, ``mlp``; causal SDPA, or masked where
the caller passes ``attention_mask``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_parallel.block_protocol import PLAIN, QKV, AttentionCall, Call, State, argument


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAdapter:
    name = "llama"

    def matches(self, block: nn.Module) -> bool:
        attn = getattr(block, "self_attn", None)
        return all(hasattr(block, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")) and all(
            isinstance(getattr(attn, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        )

    def pre_modules(self, block: nn.Module) -> tuple[str, ...]:
        return ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

    def head_counts(self, block: nn.Module) -> tuple[int, int]:
        attn = block.self_attn
        return attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim

    def tp_plan(self, block: nn.Module) -> dict[str, str]:
        plan = {f"self_attn.{n}_proj": "colwise" for n in "qkv"} | {"self_attn.o_proj": "rowwise"}
        if all(hasattr(block.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return plan | {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
        raise ValueError(f"no gate_proj/up_proj/down_proj in the MLP of {type(block).__name__}; pass tp_plan=")

    def mlp(self, block: nn.Module) -> tuple[nn.Module, str, int] | None:
        return block.mlp, "forward", -2

    def attention_call(self, block: nn.Module, args: tuple, kwargs: dict) -> AttentionCall:
        mask = argument(block, args, kwargs, "attention_mask")
        dropout = getattr(block.self_attn, "attention_dropout", 0.0) if block.training else 0.0
        return AttentionCall(mask is None, getattr(block.self_attn, "scaling", None), dropout, mask)

    def sequence_args(self, block: nn.Module, args: tuple, kwargs: dict, index: Tensor) -> tuple[tuple, dict]:
        """The rotary tables at the local token positions ``index`` (the only arguments that carry T in
        ``pre``/``post``); masks are used by the attention core only, on the whole sequence."""
        if args:
            cos, sin = args[0], args[1]
            return (cos.index_select(-2, index), sin.index_select(-2, index), *args[2:]), kwargs
        cos, sin = kwargs["position_embeddings"]
        return args, {**kwargs, "position_embeddings": (cos.index_select(-2, index), sin.index_select(-2, index))}

    def pre(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, call: Call = PLAIN) -> tuple[QKV, State]:
        attn = block.self_attn
        cos, sin = (args[0], args[1]) if args else kwargs["position_embeddings"]
        if cos.dim() == 3:  # Hugging Face: (B, T, head_dim) -> broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        h = block.input_layernorm(x)
        heads = lambda t: t.view(*t.shape[:2], -1, attn.head_dim).transpose(1, 2)  # noqa: E731  (B, nh, T, hd)
        q, k, v = heads(attn.q_proj(h)), heads(attn.k_proj(h)), heads(attn.v_proj(h))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return (q, k, v), (x,)

    def post(
        self, block: nn.Module, out: Tensor, state: State, args: tuple, kwargs: dict, call: Call = PLAIN
    ) -> Tensor:
        (residual,) = state
        B, _, T, _ = out.shape
        x = residual + block.self_attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        return x + block.mlp(block.post_attention_layernorm(x))
