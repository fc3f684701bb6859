"""A model of about 1 B parameters trains one AdamW step on a 24 GiB, 2-core CPU machine: pipeline (pp=2)
and fully sharded data parallelism (dp=2, ``data_parallel_sharding="full"``), each built in
``configure_model`` on the meta device (deferred initialisation: each rank materialises only its share).

The model: the example GPT's blocks at H=2048 (16 heads), 16 blocks, V=32000, an untied head, context 64:
0.94 B parameters, 3.5 GiB in float32. AdamW holds, per parameter, 4 bytes of value, 4 of gradient and 8
of state (exp_avg, exp_avg_sq): 16 bytes, 14 GiB for a replica. Two ranks each building and training the
whole model (plain data parallelism, or any strategy that replicates) need 28 GiB, more than the machine
has: the arithmetic is printed, the run is not attempted.

Each layout runs in fresh processes launched by Lightning (``Trainer(devices=2)`` re-runs this script per
rank), one batch of 2 sequences. Per rank it prints the bytes of parameters, gradients and optimizer state
it holds, its peak RSS after set-up and after the step, the step's loss and wall time.

    .venv/bin/python benchmarks/one_billion.py [--layouts pp=2 "dp=2 full"]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory import _local_bytes, _peak  # noqa: E402  (the same byte and RSS counting)

V, H, N, HEADS, T = 32000, 2048, 16, 16, 64
LAYOUTS: dict[str, str] = {
    "pp=2": "PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2)",
    "dp=2 full": "HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding='full')",
}


def parameters() -> int:
    block = 12 * H * H + 13 * H  # qkv + proj + fc + proj with biases, two LayerNorms
    return V * H + T * H + N * block + 2 * H + V * H


def rank_main(layout: str, out_dir: str) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from examples.models.gpt import GPT, Block
    from lightning_parallel import HybridParallelStrategy, PipelineParallelStrategy  # noqa: F401  (in LAYOUTS)

    torch.set_num_threads(1)

    class BillionGPT(GPT):
        def __init__(self) -> None:
            L.LightningModule.__init__(self)
            self.save_hyperparameters(dict(optimizer="adamw", lr=1e-4, weight_decay=0.0))

        def configure_model(self) -> None:
            if hasattr(self, "lm_head"):
                return
            with torch.device("meta"):  # deferred: the strategy materialises each rank's share
                self.transformer = torch.nn.ModuleDict(
                    dict(
                        wte=torch.nn.Embedding(V, H), wpe=torch.nn.Embedding(T, H), drop=torch.nn.Dropout(0.0),
                        h=torch.nn.ModuleList([Block(H, HEADS, 0.0, True) for _ in range(N)]),
                        ln_f=torch.nn.LayerNorm(H),
                    )
                )  # fmt: skip
                self.lm_head = torch.nn.Linear(H, V, bias=False)

    record: dict[str, Any] = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            record["setup_peak"], record["rank"] = _peak(), trainer.global_rank

        def on_train_batch_start(self, *args: Any) -> None:
            record["start"] = time.perf_counter()

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
            record["grads"] = _local_bytes(p.grad for g in optimizer.param_groups for p in g["params"])

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *a: Any) -> None:
            record["seconds"] = time.perf_counter() - record["start"]
            record["loss"] = float(outputs["loss"])
            record["params"] = _local_bytes(pl_module.parameters())
            state = trainer.optimizers[0].state.values()
            record["optim"] = _local_bytes(v for s in state for v in s.values() if torch.is_tensor(v) and v.dim())
            record["train_peak"] = _peak()

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (2, T + 1), generator=g)
    dp = 2 if "dp=2" in layout else 1
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2 // dp)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=eval(LAYOUTS[layout]), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Probe()],
    )  # fmt: skip
    trainer.fit(BillionGPT(), train_dataloaders=loader)
    with open(os.path.join(out_dir, f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: run one layout here
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        rank_main(args.rank_of, args.out)
        return
    n = parameters()
    gib = 2**30
    with open("/proc/meminfo") as f:
        total_mem = int(f.readline().split()[1]) * 1024
    print(f"GPT H={H} x {N} blocks, V={V}, untied head: {n / 1e9:.3f} B parameters, {4 * n / gib:.2f} GiB float32")
    print(f"machine memory {total_mem / gib:.1f} GiB; AdamW needs 16 bytes per parameter held (value, gradient,"
          " two moments)")  # fmt: skip
    print(f"  whole model on each of 2 ranks: 2 x {16 * n / gib:.1f} = {32 * n / gib:.1f} GiB: does not fit, not run")
    # half the blocks and half of the embedding and of the head (stored in shards over the stages; whole during
    # the step on the stage that runs it)
    print(f"  pp=2, a stage with half the blocks, half the embedding and half the head: 2 x {16 * n / 2 / gib:.1f} GiB")
    print(f"  dp=2 full sharding: 2 x {16 * n / 2 / gib:.1f} GiB\n")
    print("| layout | rank | params GiB | grads GiB | AdamW state GiB | set-up peak RSS GiB | step peak RSS GiB |"
          " loss | step s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for layout in args.layouts:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, __file__, "--rank-of", layout, "--out", out]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                print(f"| {layout} | failed (exit {proc.returncode}) |\n{proc.stderr[-3000:]}")
                continue
            ranks = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
        for r in sorted(ranks, key=lambda r: r["rank"]):
            cells = [f"{r[k] / gib:.2f}" for k in ("params", "grads", "optim", "setup_peak", "train_peak")]
            print(f"| {layout} | {r['rank']} | " + " | ".join(cells) + f" | {r['loss']:.4f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
