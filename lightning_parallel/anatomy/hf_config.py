"""What a Hugging Face block's own config says, for the anatomy modules that read it (hugging_face.py, flash.py,
adapters.py) and set-up's early checks: the configs on the block, the attention implementation they name, and
their head counts. Nothing here imports transformers unless the model did."""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

PREFIX = "lightning_parallel_"  # of the attention functions this package registers around a model's own


def configs_of(block: nn.Module) -> list[Any]:
    from transformers import PretrainedConfig

    seen: dict[int, Any] = {}
    for module in block.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            seen[id(config)] = config
    return list(seen.values())


def implementations_of(block: nn.Module) -> set[str]:
    """The attention implementations ``block``'s configs name (as the model has them, without this package's
    registered wrapper's prefix); empty for a block that is not a Hugging Face block."""
    if "transformers" not in sys.modules:
        return set()
    names = set()
    for config in configs_of(block):
        name = getattr(config, "_attn_implementation", None) or "eager"
        names.add(name[len(PREFIX) :] if name.startswith(PREFIX) else name)
    return names


def stated_heads(block: nn.Module) -> tuple[int, int] | None:
    """``(attention heads, key/value heads)`` as ``block``'s first Hugging Face config states them, or ``None``
    (not a Hugging Face block, or a config without ``num_attention_heads``)."""
    if "transformers" not in sys.modules:
        return None
    for config in configs_of(block)[:1]:
        heads = getattr(config, "num_attention_heads", None)
        if isinstance(heads, int):
            return heads, getattr(config, "num_key_value_heads", None) or heads
    return None
