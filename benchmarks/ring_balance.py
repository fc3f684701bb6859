"""Ring attention's load balance under packed documents: the chunk pairs each rank computes.

For one row of ``--seq-len`` tokens packed from documents of random lengths (exponential, mean ``--mean``), the
document mask gives each query chunk the key chunks it attends to (ring attention skips the others,
``lightning_parallel.ring_attention``). Per sp, over ``--draws`` rows: the busiest rank's pair count over the
mean, with the zig-zag split (rank r: chunks r and 2sp-1-r) and with ``balanced_chunks`` (the chunks paired by
their work), as the mean and the worst over the draws. Counting only: no process group.

    .venv/bin/python benchmarks/ring_balance.py --seq-len 16384 --draws 50
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_parallel.packing import document_mask  # noqa: E402
from lightning_parallel.sequence_parallel import balanced_chunks  # noqa: E402


def row(seq_len: int, mean: float, g: torch.Generator) -> torch.Tensor:
    lengths: list[int] = []
    while sum(lengths) < seq_len:
        lengths.append(max(1, int(torch.empty(1).exponential_(1 / mean, generator=g))))
    lengths[-1] -= sum(lengths) - seq_len
    return torch.cat([torch.arange(n) for n in lengths])[None]


def imbalance(mask: torch.Tensor, chunks: tuple[int, ...], sp: int) -> float:
    n, T = 2 * sp, mask.shape[-1]
    pairs = mask[0, 0].view(n, T // n, n, T // n).any(3).any(1) | torch.eye(n, dtype=torch.bool)
    loads = pairs.sum(1)
    per_rank = [int(loads[chunks[2 * r]] + loads[chunks[2 * r + 1]]) for r in range(sp)]
    return max(per_rank) / (sum(per_rank) / sp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--draws", type=int, default=50)
    parser.add_argument("--means", type=int, nargs="+", default=[512, 2048, 8192])
    args = parser.parse_args()
    print(f"T={args.seq_len}, {args.draws} rows per cell; busiest rank's pairs / mean: mean (worst)\n")
    print("| sp | mean document | zig-zag | paired by work |\n|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for sp in (2, 4, 8):
        for mean in args.means:
            zig, paired = [], []
            for _ in range(args.draws):
                mask = document_mask(row(args.seq_len, mean, g))
                zig.append(imbalance(mask, balanced_chunks(None, sp), sp))
                paired.append(imbalance(mask, balanced_chunks(mask, sp), sp))
            cells = [f"{sum(v) / len(v):.2f} ({max(v):.2f})" for v in (zig, paired)]
            print(f"| {sp} | {mean} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
