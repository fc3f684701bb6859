"""The planner's predictions against measurements on this machine (2 processes x 1 thread).

    .venv/bin/python benchmarks/planner.py --seq-lens 1024 2048 4096 --m 8 --reps 9 --actions

For each T, every schedule runs at pp=2 (our runtime, outside the Trainer, as ``benchmarks/pipeline.py``
measures it: medians of the interleaved rounds, SGD step included, peak live tensor bytes per stage of one
more step), and the planner predicts the same layouts from a profile alone: the example GPT of
``benchmarks/pipeline.py`` (H=128, 8 blocks, 4 heads, micro-batch = 1 sequence) profiled with
``lightning_parallel.plan.profile`` at T/4, T/2 and T, and the link timed as ``measure_link`` times it. This
machine's speed drifts by tens of per cent over seconds (a shared host), so the profile is taken in the
same rounds as the runs it predicts: at the start of each round both ranks profile at once (as both cores
are busy in a run) and time the link's receives (``plan.links.receive_time``, what ``measure_link``
fits), and the prediction uses every measurement's median over the rounds and the two ranks
(``plan.combine``, ``link_from_times``). Printed: predicted and measured step time and their error, predicted
and measured peak live MiB per stage (what a ``LiveTensorTracker`` opened at the step's start sees:
gradients and activations), predicted busy seconds per stage (computing or transferring: the cost model,
apart from the schedule's waits) and those of the last timed round, and both rankings. A schedule's rounds
spread by more than the chunked schedules differ, so a ranking is compared on the pairs of schedules that
the rounds themselves order: a sign test over the paired rounds (each round runs every schedule back to
back), two-sided, below ``--alpha`` (not corrected for the 21 pairs tested per T: about one pair in twenty
passes by chance). ``--allocator default`` leaves glibc as it is (``pipeline.keep_freed_memory``). ``--actions``
also prints, per schedule, stage and action kind, the predicted seconds against the measured ones (medians
of the rounds; receives apart), to find where a prediction misses.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline as bench  # noqa: E402  (benchmarks/pipeline.py: the model, the runners, the 2-process harness)

from lightning_parallel.plan import Layout, Problem, combine, predict, profile  # noqa: E402
from lightning_parallel.plan.hardware import LINK_SIZES, link_from_times  # noqa: E402
from lightning_parallel.plan.links import receive_time  # noqa: E402

SCHEDULES = {  # benchmark row -> the planner's layout (pp=2, no recomputation)
    "ours gpipe": ("gpipe", 1),
    "ours 1f1b": ("1f1b", 1),
    "ours interleaved": ("interleaved_1f1b", 1),
    "ours zb_h1": ("zb_h1", 1),
    "ours zbv": ("zbv", 1),
    "ours helix f1": ("helix", 1),
    "ours helix": ("helix", 2),
}
bench.CONFIGS["planner"] = list(SCHEDULES)


class _Profiled(bench.GPT):
    """The benchmark's GPT with a Lightning-style ``training_step`` for the profiler."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self._loss(batch)


def _profile_round(profiles: list, links: list, model: _Profiled, data: tuple, lens: list[int], rep: int) -> None:
    if rep:  # round 0 warms up
        profiles.append(profile(model, data, lens, repeats=1))
        links.append([receive_time(1 - dist.get_rank(), n, 5) for n in LINK_SIZES])


def worker(rank: int, port: int, args: argparse.Namespace, out) -> None:  # type: ignore[no-untyped-def]
    if args.allocator == "keep":
        bench.keep_freed_memory()
    bench.init_worker(rank, port, minutes=60)
    rows = []
    for seq_len in args.seq_lens:
        torch.manual_seed(0)
        model = _Profiled(vocab_size=bench.VOCAB, block_size=seq_len, n_layer=bench.LAYERS, n_head=bench.HEADS,
                          n_embd=bench.H)  # fmt: skip
        lens, data = [seq_len // 4, seq_len // 2, seq_len], bench.batch(seq_len, 1)
        for m in args.m:
            profiles: list = []
            links: list = []
            profile_round = functools.partial(_profile_round, profiles, links, model, data, lens)
            measured = bench.measure(rank, seq_len, m, args, before_round=profile_round)
            rows.append((seq_len, m, profiles, links, measured))
    out.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def sign_test(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of the sign test over paired rounds: how likely ``a`` beats ``b`` this often (or
    loses this often) in rounds run back to back if neither is faster."""
    wins = sum(x < y for x, y in zip(a, b))
    n = sum(x != y for x, y in zip(a, b))
    k = max(wins, n - wins)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n) if n else 1.0


def ranking(predicted: dict[str, float], rounds: dict[str, list[float]], alpha: float) -> tuple[str, str, list[str]]:
    """The orders by predicted and measured (median) step time, and each pair of schedules that the rounds
    order (sign test below ``alpha``) with whether the prediction orders it the same way."""
    order = lambda d: " < ".join(n[5:] for n in sorted(d, key=d.get))  # noqa: E731
    measured = {n: statistics.median(r) for n, r in rounds.items()}
    pairs = []
    for x, y in itertools.combinations(rounds, 2):
        p = sign_test(rounds[x], rounds[y])
        if p < alpha:
            fast, slow = (x, y) if measured[x] < measured[y] else (y, x)
            same = predicted[fast] < predicted[slow]
            pairs.append(f"{fast[5:]} < {slow[5:]} (p={p:.3f}): {'same' if same else 'NOT the same'}")
    return order(predicted), order(measured), pairs


def print_actions(breakdown: list) -> None:
    """Seconds per action kind and stage: predicted (the cost model summed over the stage's actions, receives
    included) and measured (``kind_seconds``: blocked receives apart, as ``wait`` and ``transfer``, with the
    number of ``receives``; ``other``: outside the actions)."""
    print("\n| T | schedule | stage | kind | predicted s | measured s |\n|---|---|---|---|---|---|")
    for seq_len, name, pr, *measured in breakdown:
        for stage, kinds in enumerate(measured):
            pred: dict[str, float] = {}
            for a in pr.schedule[stage]:
                pred[a.kind] = pred.get(a.kind, 0.0) + pr.cost(a)
            for kind in sorted(set(pred) | set(kinds)):
                p = f"{pred[kind]:.3f}" if kind in pred else ""
                q = f"{kinds[kind]:.{0 if kind == 'receives' else 3}f}" if kind in kinds else ""
                print(f"| {seq_len} | {name[5:]} | {stage} | {kind} | {p} | {q} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--m", type=int, nargs="+", default=[8])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--alpha", type=float, default=0.05, help="sign test level for 'the rounds order a pair'")
    ap.add_argument(
        "--actions",
        action="store_true",
        help="also print seconds per action kind and stage, predicted and measured (medians of the rounds)",
    )
    ap.add_argument("--allocator", choices=["keep", "default"], default="keep",
                    help="keep: glibc keeps freed memory between steps (keep_freed_memory); default: glibc's own")  # fmt: skip
    args = ap.parse_args()
    args.configs = "planner"
    results = bench.run_two(worker, args)
    rows0, rows1 = results[0], results[1]
    print(f"torch {torch.__version__}, 2 processes x 1 thread, allocator {args.allocator}, medians of {args.reps} interleaved"
          " rounds\n")  # fmt: skip
    cols = ["T", "m", "schedule", "predicted s", "measured s", "rounds min-max s", "error", "pred. live MiB s0 / s1",
            "meas. live MiB s0 / s1", "live error s0 / s1", "pred. busy s s0 / s1", "meas. busy s s0 / s1"]  # fmt: skip
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    orders, breakdown = [], []
    links = []
    for (seq_len, m, profiles0, links0, measured0), (_, _, profiles1, links1, measured1) in zip(rows0, rows1):
        costs = combine(profiles0 + profiles1)
        link = link_from_times(LINK_SIZES, [statistics.median(column) for column in zip(*links0, *links1)])
        links.append(f"T={seq_len}: {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us")
        problem = Problem(costs, seq_len, global_batch=m, link=link, optimizer="sgd")
        predicted, rounds = {}, {}
        for (_, _, name, _, info0), (_, _, _, _, info1) in zip(measured0, measured1):
            schedule, folds = SCHEDULES[name]
            pr = predict(problem, Layout(pp=2, schedule=schedule, microbatches=m, folds=folds))
            rounds[name] = [max(a, b) for a, b in zip(info0["rounds"], info1["rounds"])]
            t = statistics.median(rounds[name])
            live = [info0["live"], info1["live"]]
            plive = [pr.step_memory[0], pr.step_memory[1]]
            busy = [i["times"].compute + i["times"].transfer for i in (info0, info1)]
            predicted[name] = pr.step_time
            breakdown.append((seq_len, name, pr, info0.get("kinds", {}), info1.get("kinds", {})))
            err = [f"{(p - q) / q:+.0%}" for p, q in zip(plive, live)]
            spread = f"{min(rounds[name]):.3f}-{max(rounds[name]):.3f}"
            print(f"| {seq_len} | {m} | {name[5:]} | {pr.step_time:.3f} | {t:.3f} | {spread} | {(pr.step_time - t) / t:+.1%} | "
                  f"{plive[0] / 2**20:.0f} / {plive[1] / 2**20:.0f} | {live[0] / 2**20:.0f} / {live[1] / 2**20:.0f} | "
                  f"{' / '.join(err)} | {pr.simulation.busy[0]:.3f} / {pr.simulation.busy[1]:.3f} | "
                  f"{busy[0]:.3f} / {busy[1]:.3f} |")  # fmt: skip
        orders.append((seq_len, m, *ranking(predicted, rounds, args.alpha)))
    print(f"\nlink (measure_link's receives, medians of the rounds and ranks): {'; '.join(links)}")
    if args.actions:
        print_actions(breakdown)
    for seq_len, m, pred, meas, pairs in orders:
        same = sum(p.endswith(": same") for p in pairs)
        print(f"\nT={seq_len}, m={m}: predicted {pred}\n             measured  {meas}\n  pairs the rounds order"
              f" (sign test, p < {args.alpha}): {same} of {len(pairs)} ordered the same by the prediction")  # fmt: skip
        for p in pairs:
            print(f"  - {p}")


if __name__ == "__main__":
    main()
