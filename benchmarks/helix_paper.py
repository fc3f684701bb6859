"""HelixPipe's reported trend, predicted by the planner with the paper's shapes and a published-GPU cost model.

    .venv/bin/python benchmarks/helix_paper.py

Model: 7B-like (H=4096, 32 layers, 32 heads, vocabulary 32000, BF16), one sequence per micro-batch, 16
micro-batches per step; T from 16k to 128k. Costs: ``plan.hardware.published_costs`` on an NVIDIA H20
(148 TFLOP/s dense BF16 at MFU 0.5; NVLink 450 GB/s one way; the sources are in that module's docstring).
Layouts: 8 GPUs as pp=8, and 64 GPUs as pp=8 x dp=8 (the blocks cannot fill 64 stages: 32 layers; a
HelixPipe stage count must divide them). Baselines: 1F1B and ZB-H1, each with its faster of no
recomputation and full recomputation; HelixPipe with its own recomputation without attention, both
fold counts. Printed: predicted step seconds, helix's gain over the best baseline, and peak memory per
stage (min / max over the stages) against the H20's 96 GB. The paper reports +26 % at 128k on 64 H20
(arXiv 2507.00394, abstract); its own layout, batch and cost breakdown are not known to us
(docs/benchmarks.md says where the prediction and the paper differ).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_parallel.plan import GPUS, LINKS, Layout, Problem, predict, published_costs  # noqa: E402

GB = 1e9


def memory(p) -> str:  # type: ignore[no-untyped-def]
    return f"{min(p.peak_memory.values()) / GB:.0f}-{max(p.peak_memory.values()) / GB:.0f}"


def name(p) -> str:  # type: ignore[no-untyped-def]
    folds = f" f{p.layout.folds}" if p.layout.schedule == "helix" else ""
    return f"{p.layout.schedule} rc={p.layout.recompute}{folds}"


def main() -> None:
    gpu = GPUS["h20"]
    costs = published_costs(4096, 32, 32, 32000, gpu)
    print(f"costs: {costs.source}; link nvlink (dp all-reduce and p2p)\n")
    cols = ["GPUs", "T", "best baseline", "baseline s", "helix", "helix s", "helix gain", "paper",
            "baseline GB/stage min-max", "helix GB/stage min-max"]  # fmt: skip
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for dp in (1, 8):
        for seq_len in (16384, 32768, 65536, 131072):
            problem = Problem(costs, seq_len, global_batch=16 * dp, link=LINKS["nvlink"])
            base = [predict(problem, Layout(dp=dp, pp=8, schedule=s, microbatches=16, recompute=r))
                    for s in ("1f1b", "zb_h1") for r in ("none", "full")]  # fmt: skip
            helix = [predict(problem, Layout(dp=dp, pp=8, schedule="helix", microbatches=16, folds=f,
                                             recompute="no_attention")) for f in (1, 2)]  # fmt: skip
            b, h = min(base, key=lambda p: p.step_time), min(helix, key=lambda p: p.step_time)
            paper = "+26 %" if dp == 8 and seq_len == 131072 else ""
            print(f"| {8 * dp} | {seq_len // 1024}k | {name(b)} | {b.step_time:.1f} | {name(h)} | {h.step_time:.1f} | "
                  f"{b.step_time / h.step_time - 1:+.0%} | {paper} | {memory(b)} | {memory(h)} |")  # fmt: skip


if __name__ == "__main__":
    main()
