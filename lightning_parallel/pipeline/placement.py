"""Placement of the trunk's blocks on pipeline model chunks (consecutive, balanced by default)."""

from __future__ import annotations


def place_blocks(num_blocks: int, num_chunks: int, layers_per_chunk: list[int] | None = None) -> list[range]:
    """Consecutive block ranges, one per model chunk; balanced (earlier chunks take the remainder) by default."""
    if layers_per_chunk is not None:
        if len(layers_per_chunk) != num_chunks:
            raise ValueError(
                f"layers_per_stage has {len(layers_per_chunk)} entries, the pipeline has {num_chunks} chunks"
            )
        if any(not isinstance(n, int) or n < 1 for n in layers_per_chunk):
            raise ValueError(f"layers_per_stage={layers_per_chunk}: every stage needs at least one block")
        if sum(layers_per_chunk) != num_blocks:
            total = sum(layers_per_chunk)
            raise ValueError(
                f"layers_per_stage={layers_per_chunk} sums to {total}, but the trunk has {num_blocks} blocks"
            )
        counts = list(layers_per_chunk)
    else:
        if num_blocks < num_chunks:
            raise ValueError(
                f"{num_chunks} pipeline chunks need at least {num_chunks} blocks; the trunk has {num_blocks}"
            )
        q, r = divmod(num_blocks, num_chunks)
        counts = [q + (c < r) for c in range(num_chunks)]
    starts = [sum(counts[:c]) for c in range(num_chunks)]
    return [range(s, s + n) for s, n in zip(starts, counts)]
