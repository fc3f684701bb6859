"""Measure a model's own costs on the local device, per action the runtime executes, fitted in the sequence
length so they extrapolate.

For each length T of a short list (the user's batch cropped along dim 1), one micro-batch is captured
through the user's own ``training_step`` (``pipeline.capture``: the trunk input and each block's
arguments), and trunk block 0 runs, by wall clock (medians after a warm-up), exactly the calls the
runtime makes of it:

- per recomputation policy (the block wrapped as the strategies wrap it): its forward (``F``), the fused
  backward with the recomputation (``B``), and the split backward of the zero-bubble schedules: the
  input-gradient call (``I``) and the weight-gradient call (``W``) of ``pipeline.split_backward``, with
  the bytes the block keeps for its backward (``memory.kept_for_backward``) and what ``I`` holds for ``W``;
- HelixPipe's parts, with the block's verified split (``blocks.BlockLayer.commit``, the one
  ``HelixParallelStrategy`` uses): pre-attention, attention and post-attention, each forward and each
  backward on its own graph from detached inputs, as the helix runtime calls them, and the packing of
  its two messages (``_p2p.pack``, what ``isend_packed`` sends).

The post-trunk code and loss (head) is timed forward and backward with the trunk output substituted, the
capture (the user's step up to the trunk) per micro-batch. A block's mixture of experts (those expert
parallelism shards: :mod:`lightning_parallel.anatomy.experts`) is counted: its experts'
parameter bytes, their number, and the rows each token sends to them in one forward (top-k).

Wall clock, not a sum of op times: the runtime pays each call's Python, autograd and allocator overheads too,
and an action that runs a part of a block (helix) pays them per part.

The samples are fitted in the length by ``plan.costs``.
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_parallel import _p2p
from lightning_parallel.anatomy.experts import find_expert_lists, find_experts
from lightning_parallel.block_protocol import Split
from lightning_parallel.blocks import BlockConfig, BlockLayer, apply_recompute
from lightning_parallel.errors import AnatomyError
from lightning_parallel.expert_parallel import stacked
from lightning_parallel.memory import kept_at_width, kept_for_backward
from lightning_parallel.pipeline.capture import (
    Capture,
    capture,
    loss_of,
    substitute,
    unwrap_output,
)
from lightning_parallel.pipeline.split_backward import backward_input
from lightning_parallel.plan.costs import (
    HELIX_PARTS,
    PLANNED_POLICIES,
    BlockCosts,
    ExpertCosts,
    Sample,
    fitted,
    median,
)
from lightning_parallel.trunk import Trunk, discover_trunk, prepare_model


def crop(batch: Any, seq_len: int) -> Any:
    """Every tensor of ``batch`` with at least two dims cut to ``seq_len`` along dim 1 (a [B, T, ...]
    batch; labels shifted by one are cut alike)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t[:, :seq_len].contiguous() if isinstance(t, Tensor) and t.dim() >= 2 else t, batch)


def _capture(trunk: Trunk, step: Callable[[], Any]) -> tuple[Capture, Any]:
    return capture(trunk, step, None, lambda: copy.deepcopy(trunk.blocks[0]).to("meta"))


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _wrap(block: Any, policy: str, split_backward: bool) -> Callable[[], None]:
    """Run ``block`` under ``policy`` as the strategies wrap trunk blocks; returns how to unwrap it."""
    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([block, copy.deepcopy(block)])  # a trunk has two blocks or more
    apply_recompute(holder, policy, every_n=1, split_backward=split_backward)
    return lambda: apply_recompute(holder, "none")


def _chunk_passes(block: Any, x: Tensor, args: tuple, kwargs: dict, policy: str, repeats: int) -> dict[str, Any]:
    """F, B, I and W of ``block`` under ``policy``: medians of ``repeats`` after a warm-up; kept bytes."""
    forward = lambda leaf: unwrap_output(block(leaf, *args, **kwargs), block)  # noqa: E731
    runs: dict[str, list[float]] = {"forward": [], "backward": [], "input_grad": [], "weight_grad": []}
    out: dict[str, Any] = {}
    unwrap = _wrap(block, policy, split_backward=False)
    try:
        for r in range(repeats + 1):
            leaf = x.detach().requires_grad_(True)
            tf, y = _timed(lambda leaf=leaf: forward(leaf))
            grad = torch.randn_like(y)
            tb, _ = _timed(lambda y=y, grad=grad: torch.autograd.backward(y, grad))
            if r:
                runs["forward"].append(tf)
                runs["backward"].append(tb)
        leaf = x.detach().requires_grad_(True)
        out["kept"], out["kept_hidden"] = kept_at_width(lambda: forward(leaf), x.shape[-1])
    finally:
        unwrap()
    unwrap = _wrap(block, policy, split_backward=True)
    try:
        for r in range(repeats + 1):
            leaf = x.detach().requires_grad_(True)
            y = forward(leaf)
            grad = torch.randn_like(y)
            ti, (_, work) = _timed(lambda y=y, grad=grad, leaf=leaf: backward_input([y], [grad], [leaf]))
            out["split_bytes"] = sum(g.numel() * g.element_size() for group in work.groups
                                     for grads in group["grads"] if grads for g in grads if g is not None)  # fmt: skip
            tw, _ = _timed(work.run)
            if r:
                runs["input_grad"].append(ti)
                runs["weight_grad"].append(tw)
    finally:
        unwrap()
    block.zero_grad(set_to_none=True)
    return {**{k: median(v) for k, v in runs.items()}, **out}


def _helix_passes(split: Split, block: Any, x: Tensor, args: tuple, kwargs: dict, repeats: int) -> dict[str, Any]:
    """The helix runtime's calls of one layer's parts, each on its own graph from detached inputs."""

    def leaves(tensors: list[Tensor]) -> list[Tensor]:
        return [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]

    def backward(outputs: list[Tensor], grads: list[Tensor]) -> None:
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    runs: dict[str, list[float]] = {k: [] for k in HELIX_PARTS}
    sizes: tuple[int, int] = (0, 0)
    packs: list[tuple[float, float]] = []
    for r in range(repeats + 1):
        (leaf,) = leaves([x])
        t_pre, (inputs, state) = _timed(lambda leaf=leaf: split.pre(block, leaf, args, kwargs))
        qkv = [*inputs, *state]
        ins = leaves(list(inputs))
        t_att, out = _timed(lambda ins=ins: split.attend(block, tuple(ins), args, kwargs))
        outl, *statel = leaves([out, *state])
        t_post, y = _timed(lambda outl=outl, statel=statel: split.post(block, outl, tuple(statel), args, kwargs))
        y = y if isinstance(y, Tensor) else y[0]
        t_post_g, _ = _timed(lambda y=y: backward([y], [torch.randn_like(y)]))
        grad_out = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (outl, *statel)]
        t_att_g, _ = _timed(lambda out=out, g=grad_out[0]: backward([out], [g]))
        grad_qkv = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ins] + grad_out[1:]
        t_pre_g, _ = _timed(lambda qkv=qkv, g=grad_qkv: backward(qkv, g))
        t_pack_qkv, _ = _timed(lambda qkv=qkv: _p2p.pack(qkv))
        t_pack_out, _ = _timed(lambda out=out, state=state: _p2p.pack([out, *state]))
        sizes = (
            sum(t.numel() * t.element_size() for t in qkv),
            sum(t.numel() * t.element_size() for t in (out, *state)),
        )
        if r:
            for name, t in zip(HELIX_PARTS, (t_pre, t_att, t_post, t_pre_g, t_att_g, t_post_g)):
                runs[name].append(t)
            packs.append((t_pack_qkv, t_pack_out))
    (leaf,) = leaves([x])
    pre_kept, (inputs, state) = kept_for_backward(lambda: split.pre(block, leaf, args, kwargs))
    ins = leaves(list(inputs))
    attention_kept, out = kept_for_backward(lambda: split.attend(block, tuple(ins), args, kwargs))
    outl, *statel = leaves([out, *state])
    post_kept, _ = kept_for_backward(lambda: split.post(block, outl, tuple(statel), args, kwargs))
    block.zero_grad(set_to_none=True)
    return {"parts": {k: median(v) for k, v in runs.items()}, "bytes": sizes,
            "pack": tuple(median(list(column)) for column in zip(*packs)),
            "kept": (pre_kept, attention_kept, post_kept)}  # fmt: skip


def _sample(lm: Any, trunk: Trunk, batch: Any, seq_len: int, repeats: int, split: Split | None) -> Sample:
    cropped = crop(batch, seq_len)
    cap, like = _capture(trunk, lambda: lm.training_step(cropped, 0))
    x, (args, kwargs) = cap.trunk_input.detach(), cap.block_args[0]
    block = trunk.blocks[0]
    chunk = {policy: _chunk_passes(block, x, args, kwargs, policy, repeats) for policy in PLANNED_POLICIES}
    helix = _helix_passes(split, block, x, args, kwargs, repeats) if split is not None else None
    captures = [_timed(lambda: _capture(trunk, lambda: lm.training_step(cropped, 0)))[0] for _ in range(repeats)]
    capture_kept, _ = kept_for_backward(lambda: _capture(trunk, lambda: lm.training_step(cropped, 0)))
    y = x.detach().requires_grad_(True)
    trunk_output = y if like is None else (y, *like[1:])

    def head() -> Tensor:
        return loss_of(substitute(trunk, lambda: lm.training_step(cropped, 0), trunk_output))

    head_forward, loss = _timed(head)
    head_backward, _ = _timed(loss.backward)
    head_kept, loss = kept_for_backward(head)
    del loss
    lm.zero_grad(set_to_none=True)
    per = lambda key: {p: chunk[p][key] for p in PLANNED_POLICIES}  # noqa: E731
    return Sample(
        seq_len=seq_len,
        forward=per("forward"),
        backward=per("backward"),
        input_grad=per("input_grad"),
        weight_grad=per("weight_grad"),
        kept=per("kept"),
        split_bytes=chunk["none"]["split_bytes"],
        helix=helix["parts"] if helix else None,
        helix_bytes=helix["bytes"] if helix else (0, 0),
        helix_kept=helix["kept"] if helix else (0, 0, 0),
        helix_pack=helix["pack"] if helix else (0.0, 0.0),
        head_forward=head_forward,
        head_backward=head_backward,
        head_kept=head_kept,
        capture_kept=capture_kept,
        message=x.numel() * x.element_size(),
        dtype_bytes=x.element_size(),
        capture=median(captures),
        replicated=chunk["none"]["kept_hidden"] / max(chunk["none"]["kept"], 1),
    )


def _split(lm: Any, trunk: Trunk, batch: Any, seq_len: int) -> tuple[Split | None, str]:
    """Block 0's HelixPipe split, verified as ``HelixParallelStrategy`` verifies it, or why there is none."""
    cropped = crop(batch, seq_len)
    cap, _ = _capture(trunk, lambda: lm.training_step(cropped, 0))
    try:
        runner = BlockLayer(None, BlockConfig(split=True)).commit(0, trunk.blocks[0], cap.trunk_input.detach(),
                                                                   *cap.block_args[0])  # fmt: skip
    except AnatomyError as err:
        return None, str(err)
    return runner.stack, ""


def _experts(lm: Any, trunk: Trunk, batch: Any, seq_len: int) -> ExpertCosts | None:
    """The first mixture block's experts (module docstring; the share of the blocks with one): one forward of
    that block counts the rows its experts receive."""
    mixtures = [i for i, b in enumerate(trunk.blocks) if find_experts(b) or find_expert_lists(b)]
    if not mixtures:
        return None
    index = mixtures[0]
    block = trunk.blocks[index]
    routed, lists = find_experts(block), find_expert_lists(block)
    count: dict[str, float] = {"rows": 0.0, "tokens": 0.0}

    def on_routed(module: Any, args: tuple, kwargs: dict) -> None:
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
        values = list(bound.arguments.values())[1:]
        rows = values[0].shape[0]  # dense experts: every expert's block of the tokens
        count["rows"] += values[1].numel() if len(values) >= 3 else rows
        count["tokens"] += rows if len(values) >= 3 else rows / module.num_experts

    def on_mixture(module: Any, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else next(iter(kwargs.values()))
        count["tokens"] += x.numel() / x.shape[-1]

    def on_expert(module: Any, args: tuple) -> None:
        count["rows"] += args[0].numel() / args[0].shape[-1]

    cap, _ = _capture(trunk, lambda: lm.training_step(crop(batch, seq_len), 0))
    hooks = [m.register_forward_pre_hook(on_routed, with_kwargs=True) for _, m in routed]
    hooks += [m.register_forward_pre_hook(on_mixture, with_kwargs=True) for _, m, _ in lists]
    hooks += [e.register_forward_pre_hook(on_expert) for _, _, experts in lists for e in experts]
    try:
        with torch.no_grad():
            block(cap.trunk_input.detach(), *cap.block_args[index][0], **cap.block_args[index][1])
    finally:
        for h in hooks:
            h.remove()
    params = [getattr(m, n) for _, m in routed for n in stacked(m, m.num_experts)]
    params += [p for _, _, experts in lists for p in experts.parameters()]
    counts = [m.num_experts for _, m in routed] + [len(experts) for _, _, experts in lists]
    return ExpertCosts(sum(p.numel() * p.element_size() for p in params), min(counts),
                       count["rows"] / max(count["tokens"], 1.0), len(mixtures) / len(trunk), index == 0)  # fmt: skip


def profile(lm: Any, batch: Any, seq_lens: list[int], micro_batch: int = 1, repeats: int = 3) -> BlockCosts:
    """Measure ``lm``'s block and head costs at ``seq_lens`` on ``micro_batch`` samples of ``batch``."""
    if len(seq_lens) < 2:
        raise ValueError(f"profile needs at least two sequence lengths to fit, got {seq_lens}")
    from torch.utils._pytree import tree_map

    batch = tree_map(lambda t: t[:micro_batch] if isinstance(t, Tensor) and t.dim() >= 1 else t, batch)
    prepare_model(lm)  # (a KV cache off, as the strategies run it)
    trunk = discover_trunk(lm)
    lm.train()
    lens = sorted(seq_lens)
    split, refused = _split(lm, trunk, batch, lens[0])
    samples = [_sample(lm, trunk, batch, t, repeats, split) for t in lens]
    in_blocks = {id(p) for b in trunk.blocks for p in b.parameters()}
    return fitted(
        samples,
        num_blocks=len(trunk),
        block_parameter_bytes=sum(p.numel() * p.element_size() for p in trunk.blocks[0].parameters()),
        outer_parameter_bytes=sum(p.numel() * p.element_size() for p in lm.parameters() if id(p) not in in_blocks),
        helix_refused=refused,
        micro_batch=micro_batch,
        experts=_experts(lm, trunk, batch, lens[0]),
    )
