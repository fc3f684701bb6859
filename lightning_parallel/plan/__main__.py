"""``python -m lightning_parallel.plan``: predict every layout and schedule of a LightningCLI job, choose one.

    python -m lightning_parallel.plan --config examples/configs/demo.yaml --cli examples.train:CLI \\
        --devices 2 --memory 20GiB --link cpu --seq-len 1024 --out plan.yaml

The model and a batch come from the config, built as the user's CLI builds them (``--cli``, default
Lightning's ``LightningCLI``; arguments after ``--`` go to it, e.g. ``-- --data.init_args.block_size=4096``).
The model's costs are measured here (``plan.profile``) at ``--profile-lens`` and fitted, or taken from a
published GPU (``--gpu h20 --hidden 4096 --layers 32 --heads 32 --vocab 32000``: no model is built).
It prints the ranked table, writes the chosen plan's YAML (the user's config with ``trainer.devices``
and ``trainer.strategy`` replaced), and draws the predicted timeline and the candidates' chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import warnings
from pathlib import Path
from typing import Any

from lightning_parallel.plan.hardware import GPUS, LINKS, published_costs
from lightning_parallel.plan.output import draw_candidates, draw_timeline, table, write_yaml
from lightning_parallel.plan.predict import Problem, candidates
from lightning_parallel.plan.profile import profile

UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "GB": 1e9, "MB": 1e6}


def parse_bytes(text: str) -> float:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text)


def load_job(config: str, cli: str | None, extra: list[str]) -> tuple[Any, Any, dict[str, Any]]:
    """(LightningModule, one training batch, the config as a dict), built by the user's CLI class."""
    import lightning as L
    import yaml
    from lightning.pytorch.cli import LightningCLI

    cls: Any = LightningCLI
    if cli:
        module, _, name = cli.partition(":")
        cls = getattr(importlib.import_module(module), name)
    args = ["--config", config, "--trainer.devices=1", "--trainer.strategy=auto", *extra]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job = cls(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                  run=False, args=args, save_config_callback=None)  # fmt: skip
    dm = job.datamodule
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    return job.model, batch, yaml.safe_load(Path(config).read_text())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m lightning_parallel.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="the job's LightningCLI YAML")
    ap.add_argument("--cli", help="the job's CLI class, module:Class (default: lightning's LightningCLI)")
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--memory", default=None, help="per-device memory, e.g. 80GiB (default: no limit)")
    ap.add_argument("--link", choices=sorted(LINKS), default="cpu")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence to plan for (default: the batch's)")
    ap.add_argument("--profile-lens", type=int, nargs="+", help="lengths measured and fitted (default: T/4 T/2 T)")
    ap.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: the batch's)")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "sgd_momentum"])
    ap.add_argument("--max-microbatches", type=int, default=32)
    ap.add_argument("--gpu", choices=sorted(GPUS), help="published GPU cost model instead of measuring")
    ap.add_argument("--mfu", type=float, default=None, help="with --gpu: sustained fraction of the peak")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default="plan.yaml", help="the chosen plan's LightningCLI YAML (needs --config)")
    ap.add_argument("--timeline", default="plan_timeline.png")
    ap.add_argument("--chart", default="plan_candidates.png")
    args = ap.parse_args(argv)
    config: dict[str, Any] | None = None
    heads = args.heads
    if args.gpu:
        if not (args.hidden and args.layers and args.heads and args.seq_len and args.global_batch):
            ap.error("--gpu needs --hidden, --layers, --heads, --seq-len and --global-batch")
        gpu = GPUS[args.gpu] if args.mfu is None else dataclasses.replace(GPUS[args.gpu], mfu=args.mfu)
        costs = published_costs(args.hidden, args.layers, args.heads, args.vocab, gpu)
        seq_len, global_batch = args.seq_len, args.global_batch
    else:
        if not args.config:
            ap.error("give --config (a LightningCLI YAML) or --gpu with the model's shape")
        lm, batch, config = load_job(args.config, args.cli, extra)
        sizes = [t.shape for t in (batch if isinstance(batch, (tuple, list)) else [batch]) if hasattr(t, "shape")]
        seq_len = args.seq_len or int(sizes[0][1])
        global_batch = args.global_batch or int(sizes[0][0])
        lens = args.profile_lens or sorted({max(seq_len // 4, 8), max(seq_len // 2, 16), seq_len})
        costs = profile(lm, batch, lens)
        heads = (
            heads or getattr(lm, "n_head", None) or getattr(getattr(lm, "config", None), "num_attention_heads", None)
        )
    problem = Problem(costs, seq_len, global_batch, LINKS[args.link], args.optimizer)
    memory = parse_bytes(args.memory) if args.memory else None
    ranked = candidates(problem, args.devices, memory, args.max_microbatches, heads=heads)
    if not ranked:
        print(f"no layout of {args.devices} devices fits {args.memory} per device", file=sys.stderr)
        return 1
    print(f"costs: {costs.source}; T={seq_len}, {global_batch} sequences per step, link {args.link}, "
          f"{len(ranked)} layouts fit\n")  # fmt: skip
    print(table(ranked, args.top))
    best = ranked[0]
    if config is not None and args.out:
        header = f"written by python -m lightning_parallel.plan: {best.layout.name()}\n"
        header += f"predicted step {best.step_time:.4g} s at T={seq_len} ({costs.source}, link {args.link})"
        write_yaml(config, best.layout, Path(args.out), header)
        print(f"\nplan: {args.out}")
    if args.timeline:
        draw_timeline(best, Path(args.timeline))
    if args.chart:
        draw_candidates(ranked, Path(args.chart), best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
