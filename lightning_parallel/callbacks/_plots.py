"""PNG pictures for the profilers (matplotlib, the ``plots`` extra; headless Agg backend)."""

from __future__ import annotations

from pathlib import Path

from lightning_parallel.callbacks.timeline import legend_labels, split_receive
from lightning_parallel.pipeline.context import TimelineEvent

_COLORS = {"F": "#8fb8de", "B": "#2e6fab", "I": "#2e6fab", "W": "#70ad47", "FP": "#8fb8de", "BP": "#2e6fab",
           "FA": "#f4b183", "BA": "#c55a11"}  # fmt: skip


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - the plots extra is part of dev
        raise ImportError("the profilers' PNG files need matplotlib: pip install 'lightning-parallel[plots]'") from err
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(
    events_by_rank: dict[int, list[TimelineEvent]], stage_of: dict[int, int], path: Path, title: str
) -> None:
    """Stages as rows, one bar per action colored by kind, labeled with its micro-batch; hatched grey where
    the action waited for its producer, red where it was transferring."""
    plt = _pyplot()
    starts = [e.start for events in events_by_rank.values() for e in events]
    t0 = min(starts)
    ranks = sorted(events_by_rank, key=lambda r: (stage_of[r], r))
    span = max(e.end for events in events_by_rank.values() for e in events) - t0
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.7 * len(ranks)), dpi=110)
    for row, rank in enumerate(ranks):
        for e in events_by_rank[rank]:
            left, width = (e.start - t0) * 1e3, (e.end - e.start) * 1e3
            ax.barh(row, width, left=left, height=0.8, color=_COLORS.get(e.kind, "#999999"), edgecolor="white", lw=0.4)
            wait, transfer = split_receive(e)
            if e.recv_start is not None and wait > 0:
                ax.barh(row, wait * 1e3, left=(e.recv_start - t0) * 1e3, height=0.8, color="#dddddd", hatch="//",
                        edgecolor="#999999", lw=0)  # fmt: skip
            if e.recv_start is not None and transfer > 0:
                ax.barh(row, transfer * 1e3, left=(e.recv_start + wait - t0) * 1e3, height=0.8, color="#d62728", lw=0)
            if width > span * 1e3 / 90:
                ax.text(left + width / 2, row, str(e.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)), [f"stage {stage_of[r]} (rank {r})" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began (the number in a bar is its micro-batch)")
    ax.set_title(title, fontsize=10)
    kinds = sorted({e.kind for events in events_by_rank.values() for e in events})
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS.get(k, "#999999")) for k in kinds]
    handles += [plt.Rectangle((0, 0), 1, 1, facecolor="#dddddd", hatch="//", edgecolor="#999999"),
                plt.Rectangle((0, 0), 1, 1, color="#d62728")]  # fmt: skip
    labels = [*legend_labels(kinds), "waiting for producer", "transfer"]
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def plot_memory(series: dict[int, list[tuple[float, int]]], label_of: dict[int, str], path: Path, title: str) -> None:
    """Live bytes over one step, one line per rank (``[(seconds since step start, bytes)]``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4), dpi=110)
    for rank in sorted(series):
        points = series[rank]
        if not points:
            continue
        xs, ys = zip(*points)
        line = ax.step([x * 1e3 for x in xs], [y / 2**20 for y in ys], where="post", label=label_of[rank], lw=1.2)
        ax.axhline(max(ys) / 2**20, color=line[0].get_color(), ls=":", lw=0.8)
    ax.set_xlabel("ms since the step began")
    ax.set_ylabel("live MiB")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
