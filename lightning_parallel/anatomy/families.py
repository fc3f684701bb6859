"""Model-level preparation that running blocks one by one needs, by model family (the one place that knows
these families besides their anatomies):

- Hugging Face models keep a KV cache when ``config.use_cache`` is on: in training it keeps every layer's
  keys and values alive and passes a cache object between blocks; it is turned off.
- ``nn.TransformerEncoder`` may pack its input into nested tensors, which cannot cross stages or shards;
  it is turned off.
- ``nn.MultiheadAttention`` (and ``nn.TransformerEncoderLayer``) take a C++ fast path in inference that skips
  Python and passes nested tensors; it is turned off while blocks are driven (evaluation, capture).
- Hugging Face models initialise their modules with their own ``_init_weights`` (their scheme, and the
  rotary tables no ``reset_parameters()`` computes): deferred initialisation runs it too
  (:func:`family_initializers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


def prepare_model(model: nn.Module) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False


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
