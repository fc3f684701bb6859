"""``loss_chunks=``: the LM head and its cross-entropy over chunks of tokens, never the whole logits
(:mod:`lightning_parallel.chunked_loss`), for an unchanged module on any strategy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from lightning_parallel import _collectives
from lightning_parallel.chunked_loss import lazy_heads
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.trunk import vocabulary_modules


class ChunkedHeads:
    """The heads of one module whose logits are computed chunk by chunk, while a step runs."""

    def __init__(self, chunks: int) -> None:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"loss_chunks must be a positive int (1: the whole logits, as the module computes them),"
                             f" got {chunks!r}")  # fmt: skip
        self.chunks = chunks
        self.heads: list[nn.Linear] = []
        self._checked = False

    @property
    def on(self) -> bool:
        return self.chunks > 1

    def find(self, module: nn.Module, blocks: list[nn.Module]) -> None:
        """The heads: every ``nn.Linear`` outside ``blocks`` of the vocabulary's width
        (:func:`lightning_parallel.trunk.vocabulary_modules`); refused where there is none, or where a head is
        gathered by its own module hooks (an FSDP unit)."""
        if not self.on:
            return
        from torch.distributed.fsdp import FSDPModule

        vocab, modules = vocabulary_modules(module, blocks)
        self.heads = [m for _, m in modules if isinstance(m, nn.Linear)]
        if not self.heads:
            found = f"the vocabulary is {vocab} (the token embedding's rows)" if vocab else "no nn.Embedding"
            raise ConfigurationError(
                f"loss_chunks={self.chunks} computes the LM head and its cross-entropy in chunks, but found no head:"
                f" an nn.Linear outside the trunk whose output width is the vocabulary ({found} outside the trunk);"
                " pass loss_chunks=1"
            )
        fsdp = [n for n, m in modules if isinstance(m, FSDPModule) and isinstance(m, nn.Linear)]
        if fsdp:
            raise ConfigurationError(
                f"loss_chunks={self.chunks} cannot run the head {fsdp[0]!r}: data_parallel_sharding='full' made it an"
                " FSDP unit, whose hooks gather its weight around its own forward; use data_parallel_sharding="
                "'optimizer', strategy='pipeline' (whose stages gather the head themselves), or loss_chunks=1"
            )

    @contextmanager
    def active(self, training: bool = True) -> Iterator[None]:
        """Around one step: the heads return uncomputed logits. After the first training step, a head no rank
        called (the step computed the logits another way, e.g. ``x @ wte.weight.T``) is refused on every rank."""
        if not self.on:
            yield
            return
        with lazy_heads(self.heads, self.chunks) as forwards:
            yield
        if training and not self._checked:
            self._checked = True
            if sum(_collectives.all_gather_object(sum(f.calls for f in forwards))) == 0:
                raise ConfigurationError(
                    f"loss_chunks={self.chunks}: the training step never called the LM head"
                    f" ({type(self.heads[0]).__name__} of output width {self.heads[0].out_features}), so its logits"
                    " cannot be computed in chunks (a step that uses the head's weight directly, e.g."
                    " `x @ wte.weight.T`, computes them whole); call the head module, or pass loss_chunks=1"
                )
