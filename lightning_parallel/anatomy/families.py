"""Model-level preparation that running blocks one by one needs, by model family (the one place that knows
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

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


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
