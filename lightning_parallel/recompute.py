"""Activation recomputation policies and chunked MLP over a model's trunk blocks.

Policies (``apply_recompute(module, policy)``), built on ``torch.utils.checkpoint`` (non-reentrant) and
its selective-checkpoint contexts (``create_selective_checkpoint_contexts``):

- ``"none"``; ``"full"``: every block is checkpointed (only its inputs are kept, all of it is re-run);
  ``"every_n"``: blocks 0, n, 2n, ... are checkpointed (Chen et al., 2016, sqrt-style trade-offs);
- ``"selective"``: keep the outputs of matrix products and attention, recompute the cheap element-wise and
  normalisation work in between (in the spirit of Korthikanti et al., 2022, at op granularity);
- ``"no_attention"``: keep the attention output and its softmax statistics (log-sum-exp), recompute
  everything else in the block; the attention forward is never re-run. HelixPipe's insight (Zhang et al.,
  arXiv 2507.00394, §4): at long sequences attention dominates the block's time, so recomputing the rest
  costs about one extra forward of the dense GEMMs and nothing for attention.

Attention kernels recognised: CPU's flash kernel, CUDA's flash / memory-efficient / cuDNN SDPA kernels,
and flash-attn's ops when installed. With attention dropout on CPU, SDPA takes the math path (plain
batched matmuls and a softmax); ``no_attention`` then keeps the two batched matmuls' outputs (the scores
and the output, O(T^2) memory, which any policy that does not re-run attention must keep) and the
softmax, and recomputes the dropout from them (checkpointing restores the RNG state, so the mask is the
same).

Chunked MLP (``mlp_chunks=k``): the block's token-wise MLP runs over k slices of the sequence, so its
wide intermediate (4H, or the SwiGLU gate and up projections) exists for T/k tokens at a time, in
forward and backward (autograd keeps one 1/k-sized tensor per slice).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_parallel.pipeline.trunk import discover_trunk

Policy = Literal["none", "full", "every_n", "selective", "no_attention"]
POLICIES: tuple[str, ...] = ("none", "full", "every_n", "selective", "no_attention")

aten = torch.ops.aten


def attention_ops() -> set[Any]:
    """The fused attention kernels (forward) a policy can keep."""
    ops = {aten._scaled_dot_product_flash_attention_for_cpu.default}
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    flash = getattr(torch.ops, "flash_attn", None)  # registered by the flash-attn package on CUDA
    for name in ("_flash_attn_forward", "_flash_attn_varlen_forward"):
        if flash is not None and hasattr(flash, name):
            ops.add(getattr(flash, name).default)
    import lightning_parallel.ring_attention  # noqa: F401  (registers lightning_parallel::ring_attention)

    return ops | {torch.ops.lightning_parallel.ring_attention.default}  # sequence parallelism's ring mode


MATH_ATTENTION_OPS = {aten.bmm.default, aten._softmax.default}  # SDPA's math path (attention dropout on CPU)


def communication_ops() -> set[Any]:
    """Functional collectives (sequence parallelism's all-to-alls and ring shifts, DTensor's
    redistributions): every policy keeps their outputs, so recomputation never re-runs communication."""
    c10d = torch.ops._c10d_functional
    names = ("all_to_all_single", "wait_tensor", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
    ring = torch.ops.lightning_parallel.ring_attention.default  # attention and communication in one op
    return {getattr(c10d, n).default for n in names if hasattr(c10d, n)} | {ring}


MATMUL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def validate(policy: str, every_n: int, mlp_chunks: int) -> None:
    """Raise ``ValueError`` for an unknown policy or out-of-range sizes (before anything is wrapped)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; choose one of {list(POLICIES)}")
    if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
        raise ValueError(f"recompute_every_n must be an int >= 1, got {every_n!r}")
    if isinstance(mlp_chunks, bool) or not isinstance(mlp_chunks, int) or mlp_chunks < 1:
        raise ValueError(f"mlp_chunks must be an int >= 1, got {mlp_chunks!r}")


def apply_recompute(
    module: nn.Module,
    policy: Policy = "full",
    *,
    every_n: int = 2,
    mlp_chunks: int = 1,
    trunk: str | None = None,
    mlp_module: str | None = None,
    attention_kernels: tuple[str, ...] = (),
    keep_communication: bool = False,
) -> nn.Module:
    """Wrap each trunk block of ``module`` in the recomputation ``policy`` (and chunk its MLP); in place.

    ``attention_kernels`` names further ops (``"namespace::op"`` or ``"namespace::op.overload"``) that
    ``no_attention`` and ``selective`` must keep, for blocks whose attention runs a custom kernel.
    ``keep_communication`` (set by the strategies under tensor or sequence parallelism) makes every
    policy keep the outputs of the blocks' collectives, so recomputation never runs them again.
    Works without Lightning. Re-applying replaces the previous wrapping. Returns ``module``.
    """
    validate(policy, every_n, mlp_chunks)
    extra = {_resolve_op(name) for name in attention_kernels}
    for j, block in enumerate(discover_trunk(module, trunk).blocks):
        _restore(block)
        if mlp_chunks > 1:
            _chunk_mlp(block, mlp_chunks, mlp_module)
        if policy == "none" or (policy == "every_n" and j % every_n):
            continue
        block._lp_original_forward = block.__dict__.get("forward")
        block.forward = _Recomputed(block, "full" if policy == "every_n" else policy, extra, keep_communication)
    return module


def _restore(block: nn.Module) -> None:
    if hasattr(block, "_lp_original_forward"):
        previous = block.__dict__.pop("_lp_original_forward")
        if previous is None:
            block.__dict__.pop("forward", None)
        else:
            block.forward = previous
    for owner, name in block.__dict__.pop("_lp_chunked", []):
        owner.__dict__.pop(name, None)


class _Recomputed:
    """A block forward run under ``torch.utils.checkpoint`` with the policy's selective contexts.

    It holds the block itself (not a bound method), so a ``copy.deepcopy`` of the block gets a wrapper
    that runs the copy."""

    def __init__(
        self, block: nn.Module, policy: str, extra: set[Any] = frozenset(), keep_communication: bool = False
    ) -> None:
        self.block, self.policy, self.block_name = block, policy, type(block).__name__
        self._inner = block.__dict__.get("_lp_original_forward")  # an instance forward that was there before
        self._communication = communication_ops() if keep_communication else set()
        self._attention = attention_ops()
        self.keep = set(self._communication)  # "full" with communication: recompute everything else
        if policy == "selective":
            self.keep |= attention_ops() | MATMUL_OPS | set(extra)
        elif policy == "no_attention":
            self.keep |= attention_ops() | MATH_ATTENTION_OPS | set(extra)
        self._checked = policy != "no_attention"
        self._saw_attention = False

    def _policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in self.keep:
            self._saw_attention = self._saw_attention or op not in self._communication or op in self._attention
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._inner is not None:
            return self._inner(*args, **kwargs)
        return type(self.block).forward(self.block, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.policy == "full" and not self._communication:
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        context = functools.partial(create_selective_checkpoint_contexts, self._policy)
        out = checkpoint(self.forward, *args, use_reentrant=False, context_fn=context, **kwargs)
        if not self._checked and torch.is_grad_enabled():
            self._checked = True
            if not self._saw_attention:
                raise ValueError(
                    f"recompute='no_attention': no attention kernel ran inside {self.block_name} (looked for"
                    " torch's scaled_dot_product_attention kernels and flash-attn); its attention cannot be kept."
                    " Name its attention kernel with attention_kernels=['namespace::op'], or use recompute='selective'"
                    " or 'full' for this block family"
                )
        return out


def _resolve_op(name: str) -> Any:
    """``"aten::bmm"`` / ``"mylib::attn.default"`` -> the op overload (``.default`` when none is given)."""
    namespace, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError):
        raise ValueError(f"attention_kernels: no op named {name!r} is registered with torch.ops") from None


# ---------------------------------------------------------------------------------- chunked MLP
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "ff")


def _chunk_mlp(block: nn.Module, chunks: int, mlp_module: str | None) -> None:
    owner, name, dim = _locate_mlp(block, chunks, mlp_module)
    setattr(owner, name, _ChunkedMLP(owner, name, chunks, dim, type(block).__name__))
    block.__dict__.setdefault("_lp_chunked", []).append((owner, name))


class _ChunkedMLP:
    """``owner.<name>`` run over ``chunks`` slices of the sequence; holds ``owner`` itself so that a deep
    copy of the block runs the copy's MLP."""

    def __init__(self, owner: nn.Module, name: str, chunks: int, dim: int, block_name: str) -> None:
        self.owner, self.name, self.chunks, self.dim, self.block_name = owner, name, chunks, dim, block_name

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        length = x.shape[self.dim]
        if self.chunks > length:
            raise ValueError(
                f"mlp_chunks={self.chunks} is larger than the sequence: the MLP input {tuple(x.shape)} of"
                f" {self.block_name} has {length} tokens along dim {self.dim}"
            )
        original = getattr(type(self.owner), self.name)
        # contiguous: a slice along the sequence of a (B, T, H) batch is not, and some MLPs .view() their input
        parts = [part.contiguous() for part in torch.tensor_split(x, self.chunks, dim=self.dim)]
        return torch.cat([original(self.owner, part, *args, **kwargs) for part in parts], dim=self.dim)


def _locate_mlp(block: nn.Module, chunks: int, mlp_module: str | None) -> tuple[nn.Module, str, int]:
    """(object, attribute of the callable to chunk, sequence dim of its input)."""
    if mlp_module is not None:
        try:
            return block.get_submodule(mlp_module), "forward", -2
        except AttributeError:
            raise ValueError(f"mlp_module={mlp_module!r}: {type(block).__name__} has no such submodule") from None
    if isinstance(block, nn.TransformerEncoderLayer):
        return block, "_ff_block", 1 if block.self_attn.batch_first else 0
    for name in _MLP_NAMES:
        child = getattr(block, name, None)
        if isinstance(child, nn.Module):
            return child, "forward", -2
    raise ValueError(
        f"mlp_chunks={chunks}: cannot locate the MLP of {type(block).__name__} (looked for a child named"
        f" {', '.join(_MLP_NAMES)} and for nn.TransformerEncoderLayer); name it with mlp_module='path.in.block'"
    )
