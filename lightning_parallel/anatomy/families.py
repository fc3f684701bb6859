"""Model-level preparation that running blocks one by one needs, by model family (the one place that knows
these families besides their anatomies):

- Hugging Face models keep a KV cache when ``config.use_cache`` is on: in training it keeps every layer's
  keys and values alive and passes a cache object between blocks; it is turned off.
- ``nn.TransformerEncoder`` may pack its input into nested tensors, which cannot cross stages or shards;
  it is turned off.
- ``nn.MultiheadAttention`` (and ``nn.TransformerEncoderLayer``) take a C++ fast path in inference that skips
  Python and passes nested tensors; it is turned off while blocks are driven (evaluation, capture).
"""

from __future__ import annotations

from collections.abc import Iterator
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
