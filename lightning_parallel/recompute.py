"""Activation recomputation policies and chunked MLP over a model's trunk blocks.

Policies (applied per block by the block layer, :mod:`lightning_parallel.blocks`; without Lightning
``lightning_parallel.blocks.apply_recompute(module, policy)``), built on ``torch.utils.checkpoint`` (non-reentrant) and
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

Under a schedule that splits the backward (``zb_h1``, ``zbv``) a block's saved tensors are unpacked twice,
by the input-gradient and the weight-gradient action; torch's checkpoint recomputes per backward call and
refuses a second unpack under one ``GraphExecGroup``. Such blocks run under :func:`shared_checkpoint`:
the same policy contexts, one recomputation per forward, serving every unpack until the graph is freed.

Chunked MLP (``mlp_chunks=``) is :mod:`lightning_parallel.mlp_chunks`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _get_autocast_kwargs,
    _infer_device_type,
    checkpoint,
    create_selective_checkpoint_contexts,
    get_device_states,
    set_device_states,
)

from lightning_parallel.block_protocol import Shared

Policy = Literal["none", "full", "every_n", "selective", "no_attention"]
POLICIES: tuple[str, ...] = ("none", "full", "every_n", "selective", "no_attention")

aten = torch.ops.aten
#: torch's fused attention kernels (forward) that scaled_dot_product_attention dispatches to, as this build has them
SDPA_KERNELS = tuple(
    getattr(aten, n).default
    for n in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(aten, n)
)


def attention_ops() -> set[Any]:
    """The fused attention kernels (forward) a policy can keep."""
    ops = set(SDPA_KERNELS)
    # registered by the flash-attn packages on CUDA: flash-attn 2 ("flash_attn") and flash-attn 3, Hopper's
    # ("flash_attn_3"; its interface calls ``torch.ops.flash_attn_3.fwd`` or the ``_flash_attn_forward`` op); an op
    # that is not there is skipped, so this reads what is installed
    for namespace in ("flash_attn", "flash_attn_3"):
        flash = getattr(torch.ops, namespace, None)
        for name in ("_flash_attn_forward", "_flash_attn_varlen_forward", "fwd"):
            if flash is not None and hasattr(flash, name) and hasattr(getattr(flash, name), "default"):
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


def validate(policy: str, every_n: int, mlp_chunks: int, offload: bool = False) -> None:
    """Raise ``ValueError`` for an unknown policy or out-of-range sizes (before anything is wrapped)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; choose one of {list(POLICIES)}")
    if offload and policy in ("full", "every_n"):
        raise ValueError(
            f"recompute_offload=True moves what a policy keeps inside a block to host memory; recompute={policy!r}"
            " keeps nothing inside its recomputed blocks (only their inputs, the previous blocks' outputs): use"
            " 'no_attention', 'selective' or 'none'"
        )
    if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
        raise ValueError(f"recompute_every_n must be an int >= 1, got {every_n!r}")
    if isinstance(mlp_chunks, bool) or not isinstance(mlp_chunks, int) or mlp_chunks < 1:
        raise ValueError(f"mlp_chunks must be an int >= 1, got {mlp_chunks!r}")


class Recomputed(Shared):
    """A block's stack run under ``torch.utils.checkpoint`` (non-reentrant) with the policy's selective
    contexts. It holds no module (the stack gets the block at each call), so copies of a block share it."""

    def __init__(self, inner: Any, policy: str, block_name: str, extra: frozenset = frozenset(),
                 keep_communication: bool = False, shared: bool = False, offload: bool = False) -> None:  # fmt: skip
        self.inner, self.policy, self.block_name, self.offload = inner, policy, block_name, offload
        self._checkpoint = shared_checkpoint if shared else functools.partial(checkpoint, use_reentrant=False)
        self._communication = communication_ops() if keep_communication else set()
        self._attention = attention_ops()
        self.keep = set(self._communication)  # "full" with communication: recompute everything else
        if policy == "selective":
            self.keep |= attention_ops() | MATMUL_OPS | set(extra)
        elif policy == "no_attention":
            self.keep |= attention_ops() | MATH_ATTENTION_OPS | set(extra)
        self._checked = policy != "no_attention"
        self._saw_attention = False

    def _keeps(self, op: Any) -> bool:
        if op in self.keep:
            self._saw_attention = self._saw_attention or op not in self._communication or op in self._attention
            return True
        return False

    def _policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if self._keeps(op) else CheckpointPolicy.PREFER_RECOMPUTE

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        if self.policy == "full" and not self._communication:
            return self._checkpoint(self.inner, block, x, args, kwargs)
        if self.offload:  # the kept outputs wait in host memory (lightning_parallel.offload)
            from lightning_parallel.offload import offloading_contexts

            asynchronous = frozenset(self._communication - {torch.ops.lightning_parallel.ring_attention.default})
            context: Any = functools.partial(offloading_contexts, self._keeps, asynchronous)
        else:
            context = functools.partial(create_selective_checkpoint_contexts, self._policy)
        out = self._checkpoint(self.inner, block, x, args, kwargs, context_fn=context)
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


def shared_checkpoint(
    fn: Callable[..., Any], *args: Any, context_fn: Callable[[], tuple[Any, Any]] | None = None
) -> Any:
    """``fn(*args)`` keeping none of its activations: at the first unpack of any of them (in any backward
    call) the forward is run again once, with the RNG and autocast state of the original call and the
    policy's recompute context, and the tensors it saves serve that unpack and every later one. They are
    freed with the graph. This is torch's non-reentrant checkpoint without its one-unpack-per-backward
    rule, for a backward split into an input-gradient and a weight-gradient call (module docstring)."""
    forward_context, recompute_context = context_fn() if context_fn is not None else (contextlib.nullcontext(),) * 2
    device_type = _infer_device_type(*args)
    device_autocast, cpu_autocast = _get_autocast_kwargs(device_type)
    cpu_rng = torch.get_rng_state()
    devices, device_rng = get_device_states(*args) if device_type != "cpu" else ([], [])
    recomputed: list[Tensor] = []
    count = [0]

    def pack(x: Tensor) -> int:
        count[0] += 1
        return count[0] - 1

    def unpack(index: int) -> Tensor:
        if not recomputed:
            with torch.random.fork_rng(devices=devices, device_type=device_type):
                torch.set_rng_state(cpu_rng)
                if devices:
                    set_device_states(devices, device_rng, device_type=device_type)
                saving = torch.autograd.graph.saved_tensors_hooks(
                    lambda t: recomputed.append(t.detach() if t.requires_grad else t), _never
                )
                device_context = (
                    torch.autocast(device_type, **device_autocast)
                    if device_type != "cpu" and device_autocast is not None
                    else contextlib.nullcontext()
                )
                with torch.enable_grad(), device_context, torch.autocast("cpu", **cpu_autocast):
                    with recompute_context, saving:
                        fn(*args)
            if len(recomputed) != count[0]:
                raise RuntimeError(
                    f"recomputation saved {len(recomputed)} tensors where the forward saved {count[0]}: the block's"
                    " forward is not deterministic in what it computes (branching on grad mode or on random values)"
                )
        return recomputed[index]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), forward_context:
        return fn(*args)


def _never(_: Any) -> Tensor:
    raise RuntimeError("a tensor saved during recomputation was unpacked")


def resolve_op(name: str) -> Any:
    """``"aten::bmm"`` / ``"mylib::attn.default"`` -> the op overload (``.default`` when none is given)."""
    namespace, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError):
        raise ValueError(f"attention_kernels: no op named {name!r} is registered with torch.ops") from None
