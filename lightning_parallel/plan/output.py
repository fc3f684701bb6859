"""A plan's outputs: the ranked table, the LightningCLI YAML of the chosen layout, and two pictures (the
predicted timeline, drawn by the profilers' renderer, and step time against peak memory of all
candidates)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from lightning_parallel.callbacks._plots import _pyplot, plot_timeline
from lightning_parallel.pipeline.context import TimelineEvent
from lightning_parallel.plan.predict import Layout, Prediction

MIB = 2**20


def table(predictions: list[Prediction], top: int = 20) -> str:
    """Markdown: rank, layout, predicted step, bubble per stage, peak memory per stage, bytes sent per rank."""
    rows = [
        "| # | layout | step s | bubble per stage | peak MiB per stage | sent MiB/rank |",
        "|---|---|---|---|---|---|",
    ]
    for k, pr in enumerate(predictions[:top], 1):
        stages = sorted(pr.bubble)
        bubble = " / ".join(f"{pr.bubble[s]:.2f}" for s in stages[:8]) + (" ..." if len(stages) > 8 else "")
        memory = " / ".join(f"{pr.peak_memory[s] / MIB:.0f}" for s in stages[:8]) + (" ..." if len(stages) > 8 else "")
        rows.append(
            f"| {k} | {pr.layout.name()} | {pr.step_time:.4g} | {bubble} | {memory} | {pr.comm_bytes / MIB:.1f} |"
        )
    return "\n".join(rows)


def strategy_config(layout: Layout) -> dict[str, Any]:
    """The ``trainer.strategy`` entry (class_path, init_args) that runs ``layout``."""
    if layout.schedule == "helix":
        # mlp_chunks: the profile measures the block's parts as they are, MLP unchunked
        args: dict[str, Any] = {"pipeline_parallel_size": layout.pp, "folds": layout.folds,
                                "num_microbatches": layout.microbatches, "recompute": layout.recompute,
                                "mlp_chunks": 1}  # fmt: skip
        cls = "HelixParallelStrategy"
    elif layout.pp > 1:
        args = {"pipeline_parallel_size": layout.pp, "schedule": layout.schedule,
                "num_microbatches": layout.microbatches, "recompute": layout.recompute}  # fmt: skip
        cls = "PipelineParallelStrategy"
    else:
        args, cls = {"recompute": layout.recompute}, "HybridParallelStrategy"
    for name, size in (("data_parallel_size", layout.dp), ("tensor_parallel_size", layout.tp),
                       ("sequence_parallel_size", layout.sp), ("expert_parallel_size", layout.ep)):  # fmt: skip
        if size > 1:
            args[name] = size
    if layout.sharding != "none":
        args["data_parallel_sharding"] = layout.sharding
    return {"class_path": f"lightning_parallel.{cls}", "init_args": args}


def write_yaml(config: dict[str, Any], layout: Layout, path: Path, header: str) -> None:
    """The user's config with ``trainer.devices`` and ``trainer.strategy`` set to the plan."""
    import yaml

    out = copy.deepcopy(config)
    trainer = out.setdefault("trainer", {})
    trainer["devices"] = layout.devices
    trainer["strategy"] = strategy_config(layout)
    text = "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(out, sort_keys=False)
    Path(path).write_text(text)


def predicted_events(pr: Prediction) -> dict[int, list[TimelineEvent]]:
    """The simulation as timeline events (seconds from 0), one list per stage, for ``plot_timeline``."""
    events: dict[int, list[TimelineEvent]] = {s: [] for s in pr.schedule}
    for (stage, action), start in pr.simulation.start.items():
        duration = pr.cost(action)
        events[stage].append(
            TimelineEvent(stage, action.kind, action.microbatch, action.chunk, start, start + duration)
        )
    return {s: sorted(e, key=lambda x: x.start) for s, e in events.items()}


def draw_timeline(pr: Prediction, path: Path) -> None:
    events = predicted_events(pr)
    plot_timeline(events, {s: s for s in events}, Path(path),
                  f"predicted: {pr.layout.name()}, step {pr.step_time:.4g} s")  # fmt: skip


def draw_candidates(predictions: list[Prediction], path: Path, chosen: Prediction) -> None:
    """Step time against the largest stage's peak memory, one point per candidate, by schedule."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    by_schedule: dict[str, list[Prediction]] = {}
    for pr in predictions:
        key = f"helix f{pr.layout.folds}" if pr.layout.schedule == "helix" else pr.layout.schedule
        by_schedule.setdefault(key, []).append(pr)
    for key, prs in sorted(by_schedule.items()):
        ax.scatter([max(p.peak_memory.values()) / MIB for p in prs], [p.step_time for p in prs], s=14, label=key)
    ax.scatter([max(chosen.peak_memory.values()) / MIB], [chosen.step_time], s=120, facecolors="none",
               edgecolors="black", label="chosen")  # fmt: skip
    ax.set_xlabel("peak memory of the fullest stage (MiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_yscale("log")
    ax.set_title(f"{len(predictions)} candidate layouts", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
