"""The trunk: the container of repeated blocks that carries the hidden state (docs/design.md, "The trunk"),
found once per set-up and passed to every feature that acts on blocks.

Discovery is static: the heaviest ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` holding two
or more children of one class, or the container named by ``trunk="dotted.path"``. The first training
step then verifies it (each block called once, in order, the hidden state flowing from one to the
next; see ``capture.py``).

Blocks of other stages keep their module objects (user code may read their attributes, e.g.
``nn.TransformerEncoder`` reads ``layers[0].self_attn``), but their parameters and buffers move to the
``meta`` device, so they cost no memory.

Running a model's blocks one by one also needs model-level preparation, by family (the one place that knows
these families besides their anatomies):

- Hugging Face models keep a KV cache when ``config.use_cache`` is on: in training it keeps every layer's
  keys and values alive and passes a cache object between blocks; it is turned off, under every strategy
  (data parallelism too, so that every layout trains the same model). That changes one thing beyond memory:
  transformers (5.x, ``masking_utils._preprocess_mask_arguments``) detects packed documents from
  ``position_ids`` only when no cache is passed, so a packed batch attends within its documents here and,
  with the cache on, across them on one device. :func:`packed_batch_note` says so when it meets one.
- ``nn.TransformerEncoder`` may pack its input into nested tensors, which cannot cross stages or shards;
  it is turned off.
- ``nn.MultiheadAttention`` (and ``nn.TransformerEncoderLayer``) take a C++ fast path in inference that skips
  Python and passes nested tensors; it is turned off while blocks are driven (evaluation, capture).
- Hugging Face models initialise their modules with their own ``_init_weights`` (their scheme, and the
  rotary tables no ``reset_parameters()`` computes): deferred initialisation runs it too
  (:func:`family_initializers`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass
class Trunk:
    path: str
    container: nn.Module
    blocks: list[nn.Module]
    hidden_name: str  # name of the block forward's first parameter (the hidden state)
    inner: str = ""  # between a container entry's name and its block's parameters ("_orig_mod." when compiled)
    wrappers: tuple[Any, ...] = ()  # per block, the user's torch.compile wrapper (OptimizedModule), when compiled

    @property
    def block_names(self) -> list[str]:
        return [f"{self.path}.{name}" for name, _ in self.container.named_children()]

    def __len__(self) -> int:
        return len(self.blocks)

    def materialised(self) -> list[tuple[str, nn.Module]]:
        """``(full name prefix, block)`` of the blocks this rank holds (a pipeline frees the others to meta)."""
        return [
            (f"{self.path}.{name}.", block)
            for name, block in self.container.named_children()
            if not any(p.is_meta for p in block.parameters())
        ]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _is_trunk(module: nn.Module) -> bool:
    children = list(module.children())
    return isinstance(module, CONTAINERS) and len(children) >= 2 and len({type(c) for c in children}) == 1


def discover_trunk(module: nn.Module, trunk: str | None = None) -> Trunk:
    """Find the trunk of ``module`` (or take the one named by ``trunk``); raise ``ValueError`` if none."""
    if trunk is not None:
        try:
            container = module.get_submodule(trunk)
        except AttributeError:
            raise ValueError(f"trunk={trunk!r}: {type(module).__name__} has no submodule of that name") from None
        if not _is_trunk(container):
            raise ValueError(
                f"trunk={trunk!r} is a {type(container).__name__} with children "
                f"{[type(c).__name__ for c in container.children()]}; it must be an nn.ModuleList, nn.Sequential"
                " or nn.ModuleDict of two or more blocks of one class"
            )
        path = trunk
    else:
        candidates = [(name, m) for name, m in module.named_modules() if name and _is_trunk(m)]
        if not candidates:
            inspected = [name for name, m in module.named_modules() if name and isinstance(m, CONTAINERS)]
            raise ValueError(
                f"no trunk found in {type(module).__name__}: inspected containers {inspected or 'none'}, none holds"
                " two or more blocks of one class; name it with trunk='dotted.path.to.blocks'"
            )
        path, container = max(candidates, key=lambda c: _numel(c[1]))
    blocks, inner, wrappers = _uncompiled(list(container.children()))
    params = list(inspect.signature(type(blocks[0]).forward).parameters.values())[1:]  # the class's, minus self
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ValueError(f"the blocks of trunk {path!r} ({type(blocks[0]).__name__}) take no hidden-state argument")
    return Trunk(path=path, container=container, blocks=blocks, hidden_name=params[0].name, inner=inner,
                 wrappers=wrappers)  # fmt: skip


def _uncompiled(children: list[nn.Module]) -> tuple[list[nn.Module], str, tuple[Any, ...]]:
    """The blocks behind ``torch.compile``'s wrappers (each block compiled in ``configure_model``, as torchtitan and
    Lightning's docs do), the wrappers' name for them (``"_orig_mod."``, in every parameter's name) and the
    wrappers themselves (the block layer makes a wrapper call its block's runner, and compiles the composed block
    again with the wrapper's backend and options where that is sound:
    :meth:`lightning_parallel.blocks.BlockLayer.install`). Not compiled: ``(children, "", ())``."""
    from torch._dynamo.eval_frame import OptimizedModule

    if not all(isinstance(c, OptimizedModule) for c in children):
        return children, "", ()
    return [wrapper._orig_mod for wrapper in children], "_orig_mod.", tuple(children)


def vocabulary_modules(module: nn.Module, blocks: list[nn.Module]) -> tuple[int, list[tuple[str, nn.Module]]]:
    """The vocabulary and the modules outside ``blocks`` of its width: every ``nn.Embedding`` of that many rows
    and every ``nn.Linear`` head of that output width, by name. The vocabulary is the row count of the token
    embedding: the largest ``nn.Embedding`` outside ``blocks`` with an ``nn.Linear`` of that output width outside
    them, or the largest where none has one (a character model's position table can be longer than its
    vocabulary). ``(0, [])`` without an embedding."""
    inside = {id(m) for b in blocks for m in b.modules()}
    outer = [(n, m) for n, m in module.named_modules() if id(m) not in inside]
    embeddings = [m for _, m in outer if isinstance(m, nn.Embedding) and not m.weight.is_meta]
    if not embeddings:
        return 0, []
    heads = {m.out_features for _, m in outer if isinstance(m, nn.Linear)}
    tokens = [m for m in embeddings if m.num_embeddings in heads] or embeddings  # with a head of its width, if any
    vocab = max(m.num_embeddings for m in tokens)
    return vocab, [
        (n, m)
        for n, m in outer
        if not getattr(m, "weight", torch.empty(0, device="meta")).is_meta
        and (
            isinstance(m, nn.Embedding)
            and m.num_embeddings == vocab
            or isinstance(m, nn.Linear)
            and m.out_features == vocab
        )
    ]


def free_blocks(blocks: list[nn.Module]) -> None:
    """Move the parameters and buffers of ``blocks`` to ``meta``: the modules stay, the memory goes."""
    for block in blocks:
        block.to(torch.device("meta"))


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of the materialised (non-meta) parameters of ``module`` this rank holds (a DTensor's local part),
    shared parameters counted once."""
    seen, total = set(), 0
    for p in module.parameters():
        if p.device.type != "meta" and id(p) not in seen:
            seen.add(id(p))
            t = p.to_local() if hasattr(p, "to_local") else p
            total += t.numel() * t.element_size()
    return total


def materialised_to(module: nn.Module, device: torch.device, skip: set[int] = frozenset()) -> nn.Module:  # type: ignore[assignment]
    """Move the materialised parameters and buffers of ``module`` to ``device`` (meta ones stay, and so do
    tensor-parallel DTensors, which live on their mesh's device, and the tensors whose ids are in ``skip``).
    The tensor objects stay (``.data`` is replaced): optimizers keep holding them."""
    from torch.distributed.tensor import DTensor

    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type != "meta" and not isinstance(t, DTensor) and id(t) not in skip:
            t.data = t.data.to(device)
    return module


def prepare_model(model: nn.Module) -> list[str]:
    """Prepare ``model`` (in place) for running its blocks one by one; returns the names of the modules whose
    Hugging Face config had ``use_cache`` on (now off)."""
    cached = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False
            cached.append(name or type(module).__name__)
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False
    return cached


def packed_batch_note(batch: Any, cached: list[str]) -> str | None:
    """What to tell a user whose batch packs documents (``position_ids`` restarting, in a mapping batch, as
    ``DataCollatorWithFlattening`` makes it) into a model whose cache :func:`prepare_model` turned off; else
    ``None``."""
    from lightning_parallel.packing import is_packed

    position_ids = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if not cached or not isinstance(position_ids, torch.Tensor) or not is_packed(position_ids):
        return None
    return (
        f"this batch packs several documents per row (position_ids restart at 0) and the config of"
        f" {', '.join(cached)} had use_cache=True, which lightning-parallel turns off for training (a KV cache"
        " cannot cross stages or shards). Without a cache, transformers builds a document mask from the"
        " position_ids, so every token attends only within its document; with the cache on, as on one device,"
        " transformers skips that detection and tokens attend across documents. Set use_cache=False in the"
        " model's config to train the same model on one device."
    )


@contextmanager
def no_fast_paths() -> Iterator[None]:
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def family_initializers(root: nn.Module) -> dict[int, Callable[[nn.Module], None]]:
    """id(module) -> how its family initialises it after the module's own ``reset_parameters()``: inside a
    Hugging Face ``PreTrainedModel`` (the innermost), that model's ``_init_weights`` (what ``from_config``
    runs). Empty without transformers."""
    import sys

    transformers = sys.modules.get("transformers")
    if transformers is None:
        return {}
    out: dict[int, Callable[[nn.Module], None]] = {}
    for m in root.modules():  # parents first: an inner model overwrites its parent's entries
        init = getattr(m, "_init_weights", None) if isinstance(m, transformers.PreTrainedModel) else None
        if callable(init):
            out.update({id(sub): init for sub in m.modules()})
    return out
