"""Random numbers under tensor and sequence parallelism: dropout as on one device, in distribution.

The rule (Megatron-LM's model-parallel RNG tracker, ``tensor_parallel.random.CudaRNGStatesTracker`` and
``get_cuda_rng_tracker().fork()``; Shoeybi et al., arXiv 1909.08053, section 3):

- a **replicated** activation (the hidden state after a row-parallel all-reduce: residual dropout, the
  embedding's dropout, the MLP output's dropout) is drawn from the default generator, which every rank of
  the tensor- or sequence-parallel group keeps in the same state, so the ranks draw the same mask and the
  replicated activation stays bitwise identical;
- a **sharded** activation (the attention core under tensor parallelism, whose heads are sharded; the hidden
  layer between a column- and a row-parallel projection; under Megatron sequence parallelism or
  sequence parallelism, every token shard) is drawn from a model-parallel stream of this rank: each rank's
  slice gets its own mask, as one device draws one mask for the whole tensor.

**The model-parallel stream** of a region is seeded, on entry, from one number drawn from the default
generator plus the rank's offset in its group (``seed + rank``, as Megatron seeds its tracker with
``seed + 2718 + tp_rank``); on exit the default generator is as it was after that draw, on every rank. Megatron
keeps one persistent state per rank instead; deriving the stream from the default generator at each entry
keeps the two in one state, so that everything that saves and restores the default generator serves both:
activation recomputation (``torch.utils.checkpoint`` and :mod:`lightning_parallel.recompute` restore it before
running a block again, which then draws the same seed and replays the same masks, also in HelixPipe's parts
and the pipeline runtimes), and checkpoints (:func:`states` / :func:`restore`: each rank's default
generators, saved per rank by :mod:`lightning_parallel.checkpoint`, so that resume is exact with dropout).

**Regions** (:class:`ModelParallelRNG`): the block layer opens one per call of a tensor-parallel block (or
HelixPipe part) in training with active dropout (:func:`tensor_parallel_rng`); inside it the stream is entered
after each column-parallel projection (a forward hook that :func:`lightning_parallel.tensor_parallel.shard_modules`
installs; Megatron's f in a traced graph) and left before each row-parallel one (Megatron's g), and entered for
the attention core (:func:`sharded`). Sequence shards (:func:`lightning_parallel.sequence_parallel.shard_dropout`)
and Megatron's sequence parallelism fork the whole block per rank with :func:`forked`.

What one device gives is reproduced **in distribution, not bitwise**: one device draws one mask for all heads
from one stream, the ranks draw their slices from different streams (a different split of random numbers).

**Devices**: the default generator is the CPU one (``torch.default_generator``) and, for a block on an
accelerator, that device's generator (``torch.cuda.default_generators[i]``; any backend with
``default_generators``), both saved, seeded and restored together; the seed is always drawn on the CPU (no
device synchronisation). Where it ran: on CPU, every layout on forked gloo ranks
(``tests/strategies/test_dropout_rng.py``) and the mechanics in one process (``tests/unit/test_rng.py``); on CUDA
(one H200, torch 2.11 + CUDA 13.0) the one-process mechanics, ``tests/unit/test_rng.py``'s ``gpu`` cases: two ranks'
streams (SDPA's memory-efficient and math kernels, ``nn.Dropout``) independent, the default generators in step
afterwards, the regions between column- and row-parallel modules, recomputation replaying the masks, the states
round trip. Ranks on several GPUs over NCCL were not run (one GPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn

#: float attributes that hold an attention core's dropout probability (SDPA's ``dropout_p``), by family
DROPOUT_ATTRIBUTES = ("dropout", "attention_dropout", "attn_dropout", "dropout_p", "attn_pdrop", "dropout_prob")


def has_dropout(block: nn.Module) -> bool:
    """Whether any dropout in ``block`` is active (in training): a dropout module with ``p > 0`` or an attention
    module's float dropout probability (nanoGPT's ``dropout``, Hugging Face's ``attention_dropout``) above 0."""
    for m in block.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for name in DROPOUT_ATTRIBUTES:
            value = getattr(m, name, None)
            if isinstance(value, float) and not isinstance(value, bool) and value > 0:
                return True
    return False


def generators(device: torch.device) -> list[torch.Generator]:
    """The default generators a computation on ``device`` draws from: the CPU one, and the device's own."""
    gens = [torch.default_generator]
    if device.type not in ("cpu", "meta"):
        module = torch.get_device_module(device.type)
        index = device.index if device.index is not None else module.current_device()
        gens.append(module.default_generators[index])
    return gens


@contextmanager
def forked(offset: int, device: torch.device) -> Iterator[None]:
    """Run the body on this rank's model-parallel stream: one seed drawn from the (replicated) default
    generator, plus ``offset`` (the rank in its group); the default generators are restored afterwards, so
    every rank of the group leaves in the same state whatever the body drew."""
    seed = int(torch.randint(0, 2**62, (1,)))
    gens = generators(device)
    saved = [g.get_state() for g in gens]
    try:
        for g in gens:
            g.manual_seed(seed + offset)
        yield
    finally:
        for g, state in zip(gens, saved):
            g.set_state(state)


class ModelParallelRNG:
    """The model-parallel stream of one block (or part) call on one rank (see the module docstring): entered
    and left as the computation passes the sharded regions; entering while inside is a no-op."""

    def __init__(self, offset: int, device: torch.device) -> None:
        self.offset, self.device = offset, device
        self._fork: Any = None

    @property
    def inside(self) -> bool:
        return self._fork is not None

    def enter(self) -> None:
        if self._fork is None:
            fork = forked(self.offset, self.device)
            fork.__enter__()
            self._fork = fork

    def leave(self) -> None:
        if self._fork is not None:
            fork, self._fork = self._fork, None
            fork.__exit__(None, None, None)


_REGION: ContextVar[ModelParallelRNG | None] = ContextVar("lightning_parallel_model_parallel_rng", default=None)


@contextmanager
def tensor_parallel_rng(block: nn.Module, mesh: Any, device: torch.device, inside: bool = False) -> Iterator[None]:
    """The scope of one call of ``block`` (or of a HelixPipe part: ``inside=True`` for a part that starts in a
    sharded region, the attention core and the part after it) on its tensor-parallel shards: the sharded
    regions in it draw from this rank's stream (offset: the rank in ``mesh``, the 1-D tensor-parallel mesh).
    Nothing happens outside training or without active dropout (no number drawn: dropout-free runs keep the
    default generator exactly as one device does)."""
    if not (block.training and has_dropout(block)):
        yield
        return
    region = ModelParallelRNG(mesh.get_local_rank(), device)
    token = _REGION.set(region)
    try:
        if inside:
            region.enter()
        yield
    finally:
        region.leave()
        _REGION.reset(token)


def enter_sharded(*_: Any) -> None:
    """A column-parallel projection's output: the sharded region begins (a forward hook; no-op outside a
    :func:`tensor_parallel_rng` scope)."""
    region = _REGION.get()
    if region is not None:
        region.enter()


def leave_sharded(*_: Any) -> None:
    """A row-parallel projection's input: the sharded region ends before the reduction (a forward pre-hook)."""
    region = _REGION.get()
    if region is not None:
        region.leave()


@contextmanager
def sharded() -> Iterator[None]:
    """The body (an attention core, whose heads are sharded) on this rank's stream inside a
    :func:`tensor_parallel_rng` scope; the region is as before afterwards. A no-op outside a scope."""
    region = _REGION.get()
    if region is None or region.inside:
        yield
        return
    region.enter()
    try:
        yield
    finally:
        region.leave()


def tensor_parallel_split(split: Any, mesh: Any) -> Any:
    """HelixPipe's parts of a block on its tensor-parallel shards (a
    :class:`~lightning_parallel.block_protocol.Split`), each part call a :func:`tensor_parallel_rng` scope: ``pre``
    starts replicated (its column-parallel projections enter this rank's stream), the attention core is sharded
    (its heads; on whichever stage runs it, the tp rank's heads), and ``post`` starts sharded, until its first
    row-parallel projection."""
    from dataclasses import replace

    def pre(block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        with tensor_parallel_rng(block, mesh, x.device):
            return split.pre(block, x, args, kwargs)

    def attention(
        block: nn.Module, q: Tensor, k: Tensor, v: Tensor, args: tuple, kwargs: dict, **carried: Any
    ) -> Tensor:
        with tensor_parallel_rng(block, mesh, q.device, inside=True):
            return split.attention(block, q, k, v, args, kwargs, **carried)

    def post(block: nn.Module, out: Tensor, state: Any, args: tuple, kwargs: dict) -> Any:
        with tensor_parallel_rng(block, mesh, out.device, inside=True):
            return split.post(block, out, state, args, kwargs)

    return replace(split, pre=pre, attention=attention, post=post)


def states(device: torch.device) -> dict[str, Tensor]:
    """This process's default generator states (CPU, and ``device``'s own) for a checkpoint."""
    out = {"cpu": torch.default_generator.get_state()}
    if device.type not in ("cpu", "meta"):
        out[device.type] = generators(device)[1].get_state()
    return out


def restore(saved: dict[str, Tensor], device: torch.device) -> None:
    """Set the default generators from :func:`states`' result (a device's entry only for that device type)."""
    if "cpu" in saved:
        torch.default_generator.set_state(saved["cpu"].to(torch.uint8).cpu())
    if device.type not in ("cpu", "meta") and device.type in saved:
        generators(device)[1].set_state(saved[device.type].to(torch.uint8).cpu())


__all__ = [
    "ModelParallelRNG",
    "enter_sharded",
    "forked",
    "has_dropout",
    "leave_sharded",
    "restore",
    "sharded",
    "states",
    "tensor_parallel_rng",
    "tensor_parallel_split",
]
