"""Expert parallelism against data and tensor parallelism on one mixture of experts, side by side in one run:
Hugging Face's Mixtral (random init, ``--dim`` wide, ``--experts`` experts, top-2, ``--layers`` layers), real
Trainers on 2 gloo processes, AdamW, float32. Layouts: ``dp=2`` (every rank holds every expert), ``dp=2, ep=2``
(each rank holds half the experts; tokens travel by all-to-all) and ``tp=2`` (every expert's hidden size split).

Prints per layout: tokens/s (the global batch's tokens over the mean step time after ``--warmup`` steps, the
slowest rank's), the all-to-all's time per step under ep (the dispatch and combine exchanges, forward and backward:
each timed from the call to its result, and in the backward from the gradient's arrival at the exchange to its
departure), and per rank the bytes of the experts' parameters, gradients and AdamW state against one process's
divided by ep (the issue's bound: at most 1.05x). Then the planner's view of the same three layouts (its profile of
this Mixtral, one process, and the link measured here by 2 processes: point-to-point, all-reduce, all-gather and
all-to-all): the predicted tokens/s against dp=2 beside the measured, its ranking, its all-to-all time per step
under ep=2 and its experts' bytes per rank, each beside the measured.

    python benchmarks/expert_parallel.py [--dim 256] [--experts 8] [--layers 4] [--seq-len 256] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_parallel import HybridParallelStrategy  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

LAYOUTS = {
    "dp=2": lambda: HybridParallelStrategy(data_parallel_size=2),
    "dp=2, ep=2": lambda: HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=2),
    "tp=2": lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
}


class Mixtral(L.LightningModule):
    def __init__(self, dim: int, experts: int, layers: int, vocab: int) -> None:
        super().__init__()
        import transformers

        config = transformers.MixtralConfig(
            vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=4, num_local_experts=experts, num_experts_per_tok=2,
            max_position_embeddings=4096, attention_dropout=0.0,
        )  # fmt: skip
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        return F.cross_entropy(self.model(input_ids=idx).logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _Clock(L.Callback):
    """Each step's wall time and the all-to-all time in it; the experts' bytes after the last step."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.exchanges: list[float] = []
        self.bytes: dict[str, int] = {}
        self._t = 0.0

    def on_train_batch_start(self, *args: object) -> None:
        _Timed.seconds = 0.0
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        self.steps.append(time.perf_counter() - self._t)
        self.exchanges.append(_Timed.seconds)
        optimizer = trainer.optimizers[0]
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        size = lambda ts: sum(local(t).numel() * t.element_size() for t in ts)  # noqa: E731
        experts = [p for n, p in module.named_parameters() if ".experts." in n and not p.is_meta]
        state = [v for p in experts for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.dim()]
        self.bytes = {"parameters": size(experts), "gradients": size([p.grad for p in experts if p.grad is not None]),
                      "AdamW state": size(state)}  # fmt: skip


class _Timed:
    """The ep exchanges' time: each call to its result, and in the backward from the gradient's arrival to its
    departure (identity functions on both sides of the exchange mark them)."""

    seconds = 0.0

    start = 0.0

    class _Mark(torch.autograd.Function):
        """Identity; in the backward, ``arrive`` starts the clock (the gradient reaches the exchange), else it
        stops it (the gradient leaves)."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, arrive: bool) -> torch.Tensor:
            ctx.arrive = arrive
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            if ctx.arrive:
                _Timed.start = time.perf_counter()
            else:
                _Timed.seconds += time.perf_counter() - _Timed.start
            return grad, None

    @classmethod
    def install(cls) -> None:
        from lightning_parallel import expert_parallel

        rows, counts = expert_parallel._collectives.all_to_all_rows, expert_parallel._collectives.all_to_all_counts

        def all_to_all_rows(x, send, recv, group):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = cls._Mark.apply(rows(cls._Mark.apply(x, False), send, recv, group), True)
            cls.seconds += time.perf_counter() - t0
            return out

        def all_to_all_counts(c, group):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = counts(c, group)
            cls.seconds += time.perf_counter() - t0
            return out

        expert_parallel._collectives.all_to_all_rows = all_to_all_rows  # type: ignore[attr-defined]
        expert_parallel._collectives.all_to_all_counts = all_to_all_counts  # type: ignore[attr-defined]


def _rank(rank: int, world: int, layout: str, args: argparse.Namespace) -> tuple[list[float], list[float], dict]:
    from examples.data import CharDataModule

    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = CharDataModule(block_size=args.seq_len, batch_size=args.batch // (1 if layout == "tp=2" else 2))
    module = Mixtral(args.dim, args.experts, args.layers, data.vocab_size)
    clock = _Clock()
    if "ep" in layout:
        _Timed.install()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=LAYOUTS[layout](), max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[clock])  # fmt: skip
    trainer.fit(module, datamodule=data)
    return clock.steps, clock.exchanges, clock.bytes


def _link(rank: int, world: int) -> tuple[list[float], dict]:
    """The link between the two processes as the planner measures it (each busy computing meanwhile)."""
    from lightning_parallel.plan.hardware import LINK_SIZES, measure_collectives
    from lightning_parallel.plan.links import receive_time

    torch.set_num_threads(1)
    return [receive_time(rank ^ 1, n, 5) for n in LINK_SIZES], measure_collectives(None)


def _planned(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's predictions of the three layouts (module docstring)."""
    from dataclasses import replace

    from examples.data import CharDataModule
    from lightning_parallel.plan import Layout, Problem, predict, profile
    from lightning_parallel.plan.hardware import LINK_SIZES, link_from_times

    measured = run_distributed(_link, 2)
    times = [max(column) for column in zip(*(r[0] for r in measured))]
    link = replace(link_from_times(LINK_SIZES, times), **measured[0][1])

    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = CharDataModule(block_size=args.seq_len, batch_size=1)
    data.setup("fit")
    module = Mixtral(args.dim, args.experts, args.layers, data.vocab_size)
    batch = next(iter(data.train_dataloader()))
    lens = [args.seq_len // 4, args.seq_len // 2, args.seq_len]
    problem = Problem(profile(module, batch, lens), args.seq_len, args.batch, link, "adamw")
    layouts = {"dp=2": Layout(dp=2, pp=1, microbatches=1), "dp=2, ep=2": Layout(dp=2, pp=1, microbatches=1, ep=2),
               "tp=2": Layout(dp=1, pp=1, tp=2, microbatches=1)}  # fmt: skip
    return {"problem": problem, **{k: predict(problem, v) for k, v in layouts.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="the global batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(f"Mixtral dim={args.dim}, {args.experts} experts (top-2), {args.layers} layers; global batch {args.batch} x"
          f" {args.seq_len} tokens; 2 processes x 1 thread, gloo, float32, AdamW", flush=True)  # fmt: skip
    tokens = args.batch * args.seq_len
    rates, held, exchanges = {}, {}, {}
    for layout in LAYOUTS:
        results = run_distributed(_rank, 2, layout, args, timeout=1800, init_process_group=False)
        step = max(sum(s[args.warmup :]) / len(s[args.warmup :]) for s, _, _ in results)
        exchange = max(sum(e[args.warmup :]) / len(e[args.warmup :]) for _, e, _ in results)
        rates[layout], held[layout], exchanges[layout] = tokens / step, results[0][2], exchange
        line = f"{layout}: {tokens / step:.0f} tokens/s (step {step * 1e3:.0f} ms)"
        if "ep" in layout:
            line += f"; all-to-all {exchange * 1e3:.0f} ms per step ({100 * exchange / step:.0f} % of the step)"
        print(line, flush=True)
    base = rates["dp=2"]
    print("against dp=2: " + ", ".join(f"{k} {v / base:.2f}x" for k, v in rates.items() if k != "dp=2"))
    whole = held["dp=2"]  # every expert on every rank: one process's experts
    for what, nbytes in held["dp=2, ep=2"].items():
        print(
            f"ep=2, rank 0, experts' {what}: {nbytes / 2**20:.2f} MiB = {nbytes / (whole[what] / 2):.3f}x one"
            f" process's / ep ({whole[what] / 2**20:.2f} MiB / 2)"
        )
    from lightning_parallel.plan.predict import expert_bytes, expert_exchange

    planned = _planned(args)
    problem, predicted = planned.pop("problem"), {k: tokens / p.step_time for k, p in planned.items()}
    print("planner, against dp=2: " + ", ".join(
        f"{k} {v / predicted['dp=2']:.2f}x (measured {rates[k] / base:.2f}x)" for k, v in predicted.items() if k != "dp=2"
    ))  # fmt: skip
    ranked = lambda r: " > ".join(sorted(r, key=r.__getitem__, reverse=True))  # noqa: E731
    print(f"planner's ranking: {ranked(predicted)}; measured: {ranked(rates)}")
    layout = planned["dp=2, ep=2"].layout
    hb = problem.costs.hidden_bytes(args.seq_len) * args.batch / 2  # one rank's micro-batch (one per step)
    exchange = 2 * problem.costs.num_blocks * expert_exchange(problem, layout, hb)  # forward and backward
    print(
        f"planner, ep=2, all-to-all per step: {exchange * 1e3:.0f} ms (measured {exchanges['dp=2, ep=2'] * 1e3:.0f} ms)"
    )
    mine = problem.costs.num_blocks * expert_bytes(problem, layout)
    print(f"planner, ep=2, experts' parameters per rank: {mine / 2**20:.2f} MiB (measured"
          f" {held['dp=2, ep=2']['parameters'] / 2**20:.2f} MiB)")  # fmt: skip


if __name__ == "__main__":
    main()
