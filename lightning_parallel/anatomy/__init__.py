"""Block anatomy: what features that must see inside a transformer block get from it, and where it comes
from (:mod:`lightning_parallel.anatomy.resolve`): an explicit ``adapter=``, the hand-written adapters,
Hugging Face metadata, the block's own forward with the user's plan, or the block's traced graph. Every
source is verified against the block's own forward and gradients before use (fail closed)."""

from lightning_parallel.anatomy.adapters import ADAPTERS, AdapterAnatomy, BlockAdapter, adapter_split, split_forward
from lightning_parallel.block_protocol import AttentionCall, Call, Split
from lightning_parallel.errors import AnatomyError, Unsupported, VerificationError

__all__ = [
    "ADAPTERS",
    "AdapterAnatomy",
    "AnatomyError",
    "AttentionCall",
    "BlockAdapter",
    "Call",
    "Split",
    "Unsupported",
    "VerificationError",
    "adapter_split",
    "split_forward",
]
