"""Memory per rank from the first line: what each rank holds at the end of ``configure_model``, at the start of
fit and after the first optimizer step, against one process's figure divided by the number of ranks.

A GPT with a real vocabulary (V=50257, H=256, 8 blocks, 4 heads, tied embedding and head; about 19 M
parameters), built in ``configure_model()`` with no device context, as a user writes it (the strategies of
this package run ``configure_model`` on the meta device and materialise each rank's share; the rows marked
``configure_model_on_meta=False`` are the old behaviour, building the whole model first), AdamW, 2 steps of
batch 4 x 128 tokens, float32, on CPU. Each layout runs in a fresh set of processes launched by Lightning
itself (``Trainer(devices=N)`` re-runs this script per rank), so every process's peak RSS is its own. Per
rank, "x ideal" is the bytes divided by the one-process total over the number of ranks (what a layout that
splits everything, like FSDP, holds):

- ``configure_model``: the parameter bytes materialised when it returns, and the growth of the process's
  peak RSS over its RSS before the call (an upper bound on what the call allocated);
- ``start of fit``: the parameter bytes at ``on_train_start`` (a deferred block still on meta holds none);
- ``after step 1``: parameters, gradients (just before the optimizer step, after the strategy's gradient
  reduction: sharded data parallelism's reduced chunks) and optimizer state;
- ``peak RSS``: the process's peak at the end (torch's own libraries are about 300-400 MiB of it);
- ``loss``: the largest relative difference of the two steps' losses from the one-process run with the same
  initial values (:func:`reference`: deferred initialisation's, or an eager build's).

Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` per block and on the root, in
``configure_model``) is the anchor; it runs ``configure_model`` without a meta device.

    .venv/bin/python benchmarks/memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: name -> (devices, strategy source)
LAYOUTS: dict[str, tuple[int, str]] = {
    "single": (1, "'auto'"),
    "one process, deferred": (1, "HybridParallelStrategy(data_parallel_size=1)"),
    "dp=2": (2, "HybridParallelStrategy(data_parallel_size=2)"),
    "dp=2 sharded": (
        2, "HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding='optimizer')"
    ),
    "dp=2 full": (2, "HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding='full')"),
    "pp=2": (2, "PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4)"),
    "helix p=2": (2, "HelixParallelStrategy(pipeline_parallel_size=2, num_microbatches=4)"),
    "tp=2": (2, "HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)"),
    "sp=2 (Ulysses)": (2, "HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2)"),
    "pp=2, configure_model_on_meta=False": (
        2, "PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4, configure_model_on_meta=False)"
    ),
    "tp=2, configure_model_on_meta=False": (
        2, "HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, configure_model_on_meta=False)"
    ),
    "pp=2 x dp=2 sharded": (
        4,
        "PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=4,"
        " data_parallel_sharding='optimizer')",
    ),
    "pp=2 x dp=2 full": (
        4,
        "PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=4,"
        " data_parallel_sharding='full')",
    ),
    "dp=2 x tp=2 full": (
        4, "HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, data_parallel_sharding='full')"
    ),
    "dp=2 x sp=2 full": (
        4, "HybridParallelStrategy(data_parallel_size=2, sequence_parallel_size=2, data_parallel_sharding='full')"
    ),
    "pp=2 x dp=2 x tp=2 full": (
        8,
        "PipelineParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, tensor_parallel_size=2,"
        " num_microbatches=4, data_parallel_sharding='full')",
    ),
    "helix p=2 x tp=2": (4, "HelixParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2)"),
    "Lightning ModelParallelStrategy (FSDP2) dp=2": (
        2, "ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)"
    ),
}  # fmt: skip


def reference(layout: str) -> str:
    """The one-process run a layout's losses are compared with: the same initial values. Our strategies build
    on meta and initialise each module from (seed, its name) (lightning_parallel/materialize.py), which one
    process under our strategy reproduces; an eager build draws from the global generator, as 'auto' does."""
    source = LAYOUTS[layout][1]
    ours = source.startswith(("Hybrid", "Pipeline", "Helix"))
    return "one process, deferred" if ours and "configure_model_on_meta=False" not in source else "single"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def rank_main(layout: str, out_dir: str) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: F401  (named in LAYOUTS)
    from torch.utils.data import DataLoader, TensorDataset

    from examples.models.gpt import GPT, Block
    from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy  # noqa: F401

    torch.set_num_threads(1)
    V, H, N, T = 50257, 256, 8, 128

    class BigVocabGPT(GPT):
        def __init__(self) -> None:
            L.LightningModule.__init__(self)
            self.save_hyperparameters(dict(optimizer="adamw", lr=1e-3, weight_decay=0.0))

        def configure_model(self) -> None:
            if hasattr(self, "lm_head"):
                return
            record["base"] = _rss()
            self._build()  # no device context: what a user writes
            if isinstance(self.trainer.strategy, ModelParallelStrategy):
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for block in self.transformer.h:
                    fully_shard(block, mesh=mesh)
                fully_shard(self, mesh=mesh)
            record["configure_model"] = _local_bytes(self.parameters())
            record["configure_model_growth"] = max(_peak() - record["base"], 0)

        def _build(self) -> None:
            self.transformer = torch.nn.ModuleDict(
                dict(
                    wte=torch.nn.Embedding(V, H), wpe=torch.nn.Embedding(T, H), drop=torch.nn.Dropout(0.0),
                    h=torch.nn.ModuleList([Block(H, 4, 0.0, True) for _ in range(N)]), ln_f=torch.nn.LayerNorm(H),
                )
            )  # fmt: skip
            self.lm_head = torch.nn.Linear(H, V, bias=False)
            self.transformer.wte.weight = self.lm_head.weight

    record: dict[str, Any] = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            record["fit_start"] = _local_bytes(pl_module.parameters())
            record["rank"] = trainer.global_rank
            record["losses"] = []

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
            # what the optimizer steps on (sharded data parallelism: this rank's reduced chunks)
            if "grads" not in record:
                record["grads"] = _local_bytes(p.grad for g in optimizer.param_groups for p in g["params"])

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            record["losses"].append(float(trainer.callback_metrics["train_loss"]))
            if "params" in record:
                return
            # after the first step: helix places its stages at the first step, so parameters are counted here
            record["params"] = _local_bytes(pl_module.parameters())
            state = trainer.optimizers[0].state.values()
            record["optim"] = _local_bytes(v for s in state for v in s.values() if torch.is_tensor(v) and v.dim())

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            record["train_peak"] = _peak()

    devices, strategy = LAYOUTS[layout]
    L.seed_everything(0, verbose=False)  # every layout's initial values from the same seed
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (32, T + 1), generator=g)
    # use_distributed_sampler=False: every rank reads the same batches in order, so every layout's losses compare
    # with one process's (Lightning's distributed sampler shuffles a training set under any distributed strategy,
    # and under dp the copies then see the same batch: the mean of equal gradients)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=eval(strategy), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Probe()],
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(BigVocabGPT(), train_dataloaders=loader)
    with open(os.path.join(out_dir, f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)


def total_bytes() -> int:
    V, H, N, T = 50257, 256, 8, 128
    block = 4 * H * H + 4 * H + 2 * (4 * H * H) + 4 * H + H + 4 * H  # qkv+proj, fc+proj (with biases), 2 norms
    return 4 * (V * H + T * H + N * (block + 2 * H) + 2 * H)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: run one layout here
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        rank_main(args.rank_of, args.out)
        return
    rows = []
    for layout in args.layouts:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, __file__, "--rank-of", layout, "--out", out]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                print(f"{layout}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            ranks = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
        rows.append((layout, ranks))
    total = total_bytes()
    losses = {name: r[0]["losses"] for name, r in rows}
    print(f"GPT V=50257 H=256 x 8 blocks, {total / 2**20:.1f} MiB of float32 parameters, AdamW, CPU\n")
    print("| layout | rank | configure_model: params MiB (x ideal) | its peak RSS growth MiB |"
          " start of fit: params MiB (x ideal) | after step 1: params | grads | AdamW state | peak RSS MiB |"
          " loss vs one process |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layout, ranks in rows:
        devices = LAYOUTS[layout][0]

        def cell(value: int, scale: int = 1, devices: int = devices) -> str:
            return f"{value / 2**20:.1f} ({value / (scale * total / devices):.2f}x)"

        for r in sorted(ranks, key=lambda r: r["rank"]):
            loss, ref = "-", losses.get(reference(layout))
            if ref is not None and len(r["losses"]) == len(ref):
                loss = f"{max(abs(a - b) / abs(b) for a, b in zip(r['losses'], ref)):.1e} ({reference(layout)})"
            cells = [
                cell(r["configure_model"]), f"{r['configure_model_growth'] / 2**20:.1f}", cell(r["fit_start"]),
                cell(r["params"]), cell(r["grads"]), cell(r["optim"], 2), f"{r['train_peak'] / 2**20:.0f}", loss,
            ]  # fmt: skip
            print(f"| {layout} | {r['rank']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
