"""Data parallelism's gradient average overlapped with the backward (``bucket_cap_mb``) against one average after
it (``bucket_cap_mb=0``), side by side in one run: dp=2 on gloo, the example Llama, real Trainers; alone
(``dp2``, 2 processes) or under a 1F1B pipeline or tensor parallelism (``pp2xdp2``, ``tp2xdp2``: 4 processes).
Prints per mode the mean step time and the mean time the optimizer step spent in the gradient sync (the buckets'
wait and whatever is reduced after the backward: what the backward did not hide), over the steps after the first
two (buckets are made at the first step's sync).

    python benchmarks/overlap.py [--layout dp2] [--dim 512] [--layers 8] [--steps 8] [--caps 25,0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_parallel import HybridParallelStrategy, PipelineParallelStrategy  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402


class _Clock(L.Callback):
    def __init__(self) -> None:
        self.steps: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *args: object) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args: object) -> None:
        self.steps.append(time.perf_counter() - self._t)


LAYOUTS = {
    "dp2": (2, lambda cap: HybridParallelStrategy(data_parallel_size=2, bucket_cap_mb=cap)),
    "pp2xdp2": (4, lambda cap: PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2,
                                                        num_microbatches=4, bucket_cap_mb=cap)),
    "tp2xdp2": (4, lambda cap: HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, bucket_cap_mb=cap)),
}  # fmt: skip


def _rank(
    rank: int, world: int, layout: str, cap: float, dim: int, layers: int, steps: int
) -> tuple[list[float], list[float]]:
    from examples.data import CharDataModule
    from examples.models import Llama

    torch.manual_seed(0)
    data = CharDataModule(block_size=128, batch_size=8, shuffle=False)
    model = Llama(vocab_size=data.vocab_size, block_size=128, n_layer=layers, n_head=8, n_kv_head=4, dim=dim,
                  mlp_hidden=4 * dim, optimizer="sgd", lr=0.01)  # fmt: skip
    strategy = LAYOUTS[layout][1](cap)
    syncs: list[float] = []
    sync = strategy.sync_gradients

    def timed(optimizer):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        sync(optimizer)
        syncs.append(time.perf_counter() - t0)

    strategy.sync_gradients = timed  # type: ignore[method-assign]
    clock = _Clock()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[clock])  # fmt: skip
    trainer.fit(model, datamodule=data)
    return clock.steps, syncs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="dp2")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--caps", default="25,0")
    args = parser.parse_args()
    rows = {}
    for cap in [float(c) for c in args.caps.split(",")]:
        world = LAYOUTS[args.layout][0]
        results = run_distributed(_rank, world, args.layout, cap, args.dim, args.layers, args.steps, timeout=900,
                                  init_process_group=False)  # fmt: skip
        step = max(sum(r[0][2:]) / len(r[0][2:]) for r in results)
        sync = max(sum(r[1][2:]) / len(r[1][2:]) for r in results)
        rows[cap] = (step, sync)
        print(
            f"{args.layout} bucket_cap_mb={cap:g}: step {step * 1e3:.1f} ms, gradient sync at the optimizer step"
            f" {sync * 1e3:.1f} ms",
            flush=True,
        )
    if 0.0 in rows and len(rows) > 1:
        plain_step, plain_sync = rows[0.0]
        for cap, (step, sync) in rows.items():
            if cap:
                print(
                    f"{args.layout} bucket_cap_mb={cap:g} against 0: step {plain_step / step:.2f}x faster; "
                    f"{100 * (1 - sync / plain_sync):.0f} % of the sync's time hidden behind the backward"
                )


if __name__ == "__main__":
    main()
