"""nanoGPT / GPT-2-style blocks: ``ln_1``, ``attn.c_attn`` (fused q|k|v; ``nn.Linear`` or Hugging Face's
``Conv1D``), ``attn.c_proj``, ``ln_2``, ``mlp``; causal SDPA, or masked where the caller passes
``attention_mask`` (Hugging Face GPT-2, which also carries its own ``scaling`` and ``attn_dropout``)."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_parallel.block_protocol import PLAIN, QKV, AttentionCall, Call, State, argument


class NanoGPTAdapter:
    name = "nanogpt"

    def matches(self, block: nn.Module) -> bool:
        attn = getattr(block, "attn", None)
        return all(hasattr(block, n) for n in ("ln_1", "ln_2", "mlp")) and all(
            isinstance(getattr(attn, n, None), nn.Module) for n in ("c_attn", "c_proj")
        )

    def pre_modules(self, block: nn.Module) -> tuple[str, ...]:
        return ("ln_1", "attn.c_attn")

    def attention_call(self, block: nn.Module, args: tuple, kwargs: dict) -> AttentionCall:
        attn = block.attn
        dropout = attn.attn_dropout.p if hasattr(attn, "attn_dropout") else attn.dropout
        mask = argument(block, args, kwargs, "attention_mask")
        return AttentionCall(mask is None, getattr(attn, "scaling", None), dropout if block.training else 0.0, mask)

    def sequence_args(self, block: nn.Module, args: tuple, kwargs: dict, index: Tensor) -> tuple[tuple, dict]:
        return args, kwargs  # no argument of pre/post carries the sequence (a mask is used by attention only)

    def head_counts(self, block: nn.Module) -> tuple[int, int]:
        attn = block.attn
        heads = getattr(attn, "n_head", None) or attn.num_heads
        return heads, heads

    def tp_plan(self, block: nn.Module) -> dict[str, str]:
        if not (hasattr(block.mlp, "c_fc") and hasattr(block.mlp, "c_proj")):
            raise ValueError(f"no c_fc/c_proj in the MLP of {type(block).__name__}; pass tp_plan=")
        return {"attn.c_attn": "colwise_qkv", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}

    def mlp(self, block: nn.Module) -> tuple[nn.Module, str, int] | None:
        return block.mlp, "forward", -2

    def pre(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, call: Call = PLAIN) -> tuple[QKV, State]:
        head_dim = x.shape[-1] // self.head_counts(block)[0]
        # under tensor parallelism: this rank's heads [q_r | k_r | v_r], over the whole sequence
        qkv = block.attn.c_attn(block.ln_1(x))
        B, T, width = qkv.shape
        q, k, v = qkv.split(width // 3, dim=2)
        heads = lambda t: t.view(B, T, -1, head_dim).transpose(1, 2)  # noqa: E731  (B, nh, T, hs)
        return (heads(q), heads(k), heads(v)), (x,)

    def post(
        self, block: nn.Module, out: Tensor, state: State, args: tuple, kwargs: dict, call: Call = PLAIN
    ) -> Tensor:
        (residual,) = state
        B, nh, T, hs = out.shape
        y = out.transpose(1, 2).contiguous().view(B, T, nh * hs)
        x = residual + block.attn.resid_dropout(block.attn.c_proj(y))
        return x + block.mlp(block.ln_2(x))
