"""Activation bytes kept for backward, per block per micro-batch, and time overhead, per recomputation policy.

    .venv/bin/python benchmarks/recompute.py --seq-lens 1024 4096

One block of each example family (GPT: H=128, 4 heads, GELU 4H MLP; Llama: dim 128, 4 heads / 2 KV heads,
SwiGLU 352; nn.TransformerEncoderLayer: d_model 128, 4 heads, FFN 512), B=1, fp32, 1 thread. "kept" is
what ``lightning_parallel.memory.kept_for_backward`` counts: storages allocated in the forward and alive
when it returns (output included), each counted once, in units of B*T*H elements. "largest MLP tensor"
is the largest single tensor allocated by the block's MLP alone during its forward + backward, in the
same units (it shrinks with ``mlp_chunks`` until it reaches the H-wide output). Time: median of 3 forward+backward runs after one warm-up, relative to "none" in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models.gpt import Block  # noqa: E402
from examples.models.llama import DecoderLayer, rope_tables  # noqa: E402
from lightning_parallel.blocks import apply_recompute  # noqa: E402
from lightning_parallel.memory import LiveTensorTracker, kept_for_backward, time_forward_backward  # noqa: E402

H = 128
VARIANTS = [("none", 1), ("selective", 1), ("no_attention", 1), ("full", 1), ("none", 4), ("no_attention", 4)]


def family(name: str, seq_len: int):
    """The blocks, how to call one, and how to call its MLP alone."""
    torch.manual_seed(0)
    holder = nn.Module()
    if name == "gpt":
        holder.blocks = nn.ModuleList([Block(H, 4, 0.0, True) for _ in range(2)])
        return holder, lambda b, x: b(x), lambda b, x: b.mlp(x)
    if name == "llama":
        holder.blocks = nn.ModuleList([DecoderLayer(H, 4, 2, 352, 1e-5) for _ in range(2)])
        cos, sin = (t.float() for t in rope_tables(H // 4, seq_len))
        return holder, lambda b, x: b(x, cos, sin), lambda b, x: b.mlp(x)
    holder.blocks = nn.ModuleList([nn.TransformerEncoderLayer(H, 4, 4 * H, 0.0, batch_first=True) for _ in range(2)])
    return holder, lambda b, x: b(x), lambda b, x: b._ff_block(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, B=1, H={H}, fp32\n")
    print(
        "| block | T | policy | mlp_chunks | kept (x B*T*H) | kept MiB | largest MLP tensor (x B*T*H) | fwd+bwd s | time vs none |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("gpt", "llama", "encoder"):
        for seq_len in args.seq_lens:
            unit = seq_len * H * 4
            base_time = None
            for policy, chunks in VARIANTS:
                holder, call, mlp = family(name, seq_len)
                apply_recompute(holder, policy, every_n=1, mlp_chunks=chunks)
                block = holder.blocks[0]
                x = torch.randn(1, seq_len, H, requires_grad=True)
                call(block, x)  # the first call composes the block (and verifies the MLP it chunks)
                kept, out = kept_for_backward(lambda c=call, b=block, x=x: c(b, x))
                del out
                with LiveTensorTracker() as tracker:
                    mlp(block, x).sum().backward()
                largest = tracker.largest
                seconds = time_forward_backward(lambda c=call, b=block, x=x: c(b, x))
                base_time = base_time or seconds
                print(
                    f"| {name} | {seq_len} | {policy} | {chunks} | {kept / unit:.2f} | {kept / 2**20:.1f} |"
                    f" {largest / unit:.2f} | {seconds:.3f} | {seconds / base_time:.2f}x |"
                )


if __name__ == "__main__":
    main()
