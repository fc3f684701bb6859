"""``torch.nn.TransformerEncoderLayer`` (pre- or post-norm, batch-first or not): ``self_attn`` keeps q, k, v
in the bare ``in_proj_weight``; no masks (a masked call is refused by verification)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_parallel.block_protocol import PLAIN, QKV, AttentionCall, Call, State


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, call: Call) -> Tensor:
    """``F.linear``; with a column-sharded DTensor weight (tensor parallelism), the input enters as a
    replicated DTensor (its gradient is all-reduced; a sequence shard is all-gathered first) and this
    rank's output columns come back."""
    if not isinstance(weight, DTensor):
        return F.linear(x, weight, bias)
    layout = Shard(1) if call.sequence_sharded else Replicate()
    x = DTensor.from_local(x, weight.device_mesh, [layout], run_check=False).redistribute(placements=[Replicate()])
    return F.linear(x, weight, bias).to_local()


class TorchEncoderAdapter:
    name = "torch_encoder"

    def matches(self, block: nn.Module) -> bool:
        return isinstance(block, nn.TransformerEncoderLayer)

    def pre_modules(self, block: nn.Module) -> tuple[str, ...]:
        return ("self_attn.in_proj_weight", "self_attn.in_proj_bias") + (("norm1",) if block.norm_first else ())

    def attention_call(self, block: nn.Module, args: tuple, kwargs: dict) -> AttentionCall:
        return AttentionCall(False, None, block.self_attn.dropout if block.training else 0.0, None)

    def sequence_args(self, block: nn.Module, args: tuple, kwargs: dict, index: Tensor) -> tuple[tuple, dict]:
        return args, kwargs  # no argument of pre/post carries the sequence (a mask is used by attention only)

    def head_counts(self, block: nn.Module) -> tuple[int, int]:
        return block.self_attn.num_heads, block.self_attn.num_heads

    def tp_plan(self, block: nn.Module) -> dict[str, str]:
        return {"self_attn.in_proj_weight": "colwise_qkv", "self_attn.out_proj": "rowwise", "linear1": "colwise",
                "linear2": "rowwise"}  # fmt: skip

    def mlp(self, block: nn.Module) -> tuple[nn.Module, str, int] | None:
        return block, "_ff_block", 1 if block.self_attn.batch_first else 0

    def pre(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, call: Call = PLAIN) -> tuple[QKV, State]:
        if args or any(v is not None and v is not False for v in kwargs.values()):
            raise ValueError("the torch_encoder adapter supports unmasked calls only")
        mha = block.self_attn
        h = block.norm1(x) if block.norm_first else x
        if not mha.batch_first:
            h = h.transpose(0, 1)  # (B, T, E)
        head_dim = h.shape[-1] // mha.num_heads
        qkv = _linear(h, mha.in_proj_weight, mha.in_proj_bias, call)  # under TP: this rank's heads, whole sequence
        B, T, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)
        heads = lambda t: t.view(B, T, -1, head_dim).transpose(1, 2)  # noqa: E731
        return (heads(q), heads(k), heads(v)), (x,)

    def post(
        self, block: nn.Module, out: Tensor, state: State, args: tuple, kwargs: dict, call: Call = PLAIN
    ) -> Tensor:
        (residual,) = state
        mha = block.self_attn
        B, nh, T, hd = out.shape
        sa = mha.out_proj(out.transpose(1, 2).reshape(B, T, nh * hd))
        if not mha.batch_first:
            sa = sa.transpose(0, 1)
        sa = block.dropout1(sa)
        if block.norm_first:
            x = residual + sa
            return x + block._ff_block(block.norm2(x))
        x = block.norm1(residual + sa)
        return block.norm2(x + block._ff_block(x))
