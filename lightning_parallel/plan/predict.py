"""Predict a layout's step before launch: the schedule the strategy would build, run on the simulator's
virtual clock with the model's measured (or published) costs and a link model.

A :class:`Layout` names what a strategy takes: dp, pp, tp, sp sizes, the schedule (``gpipe``, ``1f1b``,
``interleaved_1f1b``, ``zb_h1``, ``zbv``, or ``helix`` with 1 or 2 folds), the micro-batch count and the
recomputation policy. Per action (``Action.kind`` of the same schedules the runtime executes):

- chunk actions: the chunk's blocks (``place_blocks``, the strategy's placement) times the per-block
  cost at the micro-batch's tokens, divided by tp x sp (sharded work), plus tp's two all-reduces per
  block and direction and sp's four all-to-alls (Ulysses); the last chunk adds the head; ``B`` = I + W +
  the policy's recomputed forward; ``I`` carries the recomputation, ``W`` the weight gradients;
- helix: ``FP``/``BP`` the post- and pre-attention parts around a layer boundary, ``FA``/``BA`` the
  attention core, recomputation of the param chunks (its ``no_attention``) in ``BP``;
- a message to another stage costs the link's p2p time for its bytes (hidden state; q, k, v and the
  residual for helix), a dependency on the same stage nothing.

Step time = the simulated makespan + the gradient all-reduce over dp (after the schedule, as the
strategies run it). Memory per stage = parameters, gradients and optimizer state of what the stage
holds (blocks of its chunks by the real placement functions; the pre/post-trunk parameters as 1/pp
shards plus, whole, where they run) + the simulated peak of kept activations (each forward adds what
its policy keeps, its ``B`` or ``W`` frees it) + one block's activations being formed (the transient).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_parallel.pipeline.helix_schedule import attention_stage, helix, simulate_helix
from lightning_parallel.pipeline.placement import place_blocks
from lightning_parallel.pipeline.schedules import (
    Action,
    Schedule,
    Simulation,
    build_schedule,
    chunk_stages,
    placement_style,
    simulate,
)
from lightning_parallel.plan.hardware import Link
from lightning_parallel.plan.profile import BlockCosts

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "helix")
OPTIMIZER_STATE = {"adamw": 2.0, "adam": 2.0, "sgd": 0.0, "sgd_momentum": 1.0}  # state bytes per parameter byte


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 2
    tp: int = 1
    sp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 4
    recompute: str = "none"
    folds: int = 1  # helix only

    @property
    def devices(self) -> int:
        return self.dp * self.pp * self.tp * self.sp

    @property
    def virtual(self) -> int:
        return 2 if self.schedule in ("interleaved_1f1b", "zbv") else 1

    def name(self) -> str:
        sched = f"helix f{self.folds}" if self.schedule == "helix" else self.schedule
        return f"dp{self.dp} pp{self.pp} tp{self.tp} sp{self.sp} {sched} m{self.microbatches} rc={self.recompute}"


@dataclass
class Prediction:
    layout: Layout
    step_time: float
    bubble: dict[int, float]
    peak_memory: dict[int, float]  # bytes per stage: what it holds plus its peak during the step
    step_memory: dict[int, float]  # bytes per stage allocated during the step: gradients, activations
    comm_bytes: float  # bytes each rank sends per step (p2p, tp, sp and dp collectives)
    simulation: Simulation
    schedule: Schedule
    cost: Callable[[Action], float] = field(repr=False, default=lambda a: 0.0)


@dataclass
class Problem:
    """What does not change between layouts: the model's costs, the batch, the link, the optimizer."""

    costs: BlockCosts
    seq_len: int
    global_batch: int  # sequences per optimizer step
    link: Link
    optimizer: str = "adamw"
    parameter_bytes: int = 4  # bytes per parameter as stored (fp32 master weights)


def _blocks_per_chunk(layout: Layout, num_blocks: int) -> list[int]:
    chunks = layout.pp * layout.virtual
    return [len(r) for r in place_blocks(num_blocks, chunks)]


def check(problem: Problem, layout: Layout) -> str | None:
    """Why ``layout`` cannot run this problem, or ``None``."""
    L, p, m = problem.costs.num_blocks, layout.pp, layout.microbatches
    if problem.global_batch % (layout.dp * m):
        return f"global batch {problem.global_batch} does not split into dp {layout.dp} x m {m}"
    if layout.schedule == "helix":
        if p < 2 or L % p or m % (p * layout.folds):
            return "helix needs pp >= 2, L % pp == 0 and m % (pp * folds) == 0"
        if layout.sp > 1 or layout.tp > 1:
            return "helix does not compose with tp or sp (HelixParallelStrategy refuses them)"
    elif L < p * layout.virtual:
        return f"{L} blocks cannot fill {p * layout.virtual} chunks"
    elif layout.virtual > 1 and L % (p * layout.virtual):
        return "two chunks per stage need L % (2 pp) == 0"
    if layout.schedule == "interleaved_1f1b" and m % p:
        return "interleaved needs m % pp == 0"
    if layout.pp == 1 and layout.schedule != "1f1b":
        return "one stage: no schedule to choose"
    return None


def predict(problem: Problem, layout: Layout) -> Prediction:
    """The step of ``layout`` on ``problem`` (module docstring); raises ``ValueError`` if it cannot run."""
    why = check(problem, layout)
    if why:
        raise ValueError(why)
    c, link = problem.costs, problem.link
    samples, t = problem.global_batch / (layout.dp * layout.microbatches) / c.micro_batch, problem.seq_len
    shard = layout.tp * layout.sp
    hb = c.hidden_bytes(t) * samples  # one micro-batch's hidden state, whole sequence
    tp_comm = 2 * link.all_reduce(hb / layout.sp, layout.tp)  # two per block and direction (Megatron)
    sp_comm = 4 * link.all_gather(hb / layout.tp, layout.sp)  # q, k, v and the output (Ulysses)
    comm = tp_comm + sp_comm
    f = samples * c.forward(t) / shard + comm
    i = samples * c.input_grad(t) / shard + comm
    w = samples * c.weight_grad(t) / shard
    rc = samples * c.recompute.get(layout.recompute, c.recompute["none"])(t) / shard
    kept = samples * c.kept.get(layout.recompute, c.kept["none"])(t) / shard
    head_f, head_b = samples * c.head_forward(t) / layout.tp, samples * c.head_backward(t) / layout.tp
    if layout.schedule == "helix":
        return _predict_helix(problem, layout, samples, t, hb, comm, rc, kept)
    p, v = layout.pp, layout.virtual
    sizes = _blocks_per_chunk(layout, c.num_blocks) if p > 1 else [c.num_blocks]
    last = len(sizes) - 1
    stages = chunk_stages(p, v, placement_style(layout.schedule)) if p > 1 else [0]
    stages_of = stages.__getitem__

    def remote(x: int, y: int) -> bool:
        return 0 <= y <= last and stages_of(x) != stages_of(y)

    def cost(a: Action) -> float:
        n, ch = sizes[a.chunk], a.chunk
        head = ch == last
        if a.kind == "F":
            moved = (remote(ch, ch - 1) + remote(ch, ch + 1)) * link.occupancy(hb)
            return n * f + head * head_f + (ch in firsts) * capture + moved
        moved = (remote(ch, ch + 1) + remote(ch, ch - 1)) * link.occupancy(hb)
        if a.kind == "B":
            return n * (i + w + rc) + head * head_b + moved
        if a.kind == "I":
            return n * (i + rc) + head * head_b + moved
        return n * w

    split = samples * c.split_bytes(t) / shard
    whole = samples * c.kept["none"](t) / shard
    capture = samples * c.capture(t)
    firsts = {min(ch for ch in range(len(sizes)) if stages_of(ch) == s) for s in range(p)}

    def held(a: Action) -> float:
        n = sizes[a.chunk]
        # I recomputes what the policy did not keep and holds it, with the gradients at the weights, until W
        return {"F": n * kept, "B": -n * kept, "I": n * (whole - kept + split), "W": -n * (whole + split)}[a.kind]

    if p == 1:
        schedule: Schedule = {0: [Action("F", k, 0) for k in range(layout.microbatches)]
                              + [Action("B", k, 0) for k in range(layout.microbatches)]}  # fmt: skip
        sim = simulate(schedule, 1, layout.microbatches, cost=cost, held=held)
    else:
        schedule = build_schedule(layout.schedule, p, layout.microbatches, v)
        delay = lambda d, a: link.p2p(hb)  # noqa: E731
        sim = simulate(schedule, p * v, layout.microbatches, cost=cost, latency=delay, stages=stages, held=held)
    blocks_on = {s: sum(n for ch, n in enumerate(sizes) if stages[ch] == s) for s in range(p)}
    outer_on = {s: {stages[0], stages[-1]} for s in range(p)}
    return _finish(problem, layout, sim, schedule, cost, blocks_on, outer_on, samples, t, hb, comm, kept)


def _predict_helix(problem: Problem, layout: Layout, samples: float, t: int, hb: float, comm: float, rc: float,
                   kept: float) -> Prediction:  # fmt: skip
    c, link, p, L = problem.costs, problem.link, layout.pp, problem.costs.num_blocks
    shard = layout.tp
    pre, post, att = (samples * fn(t) / shard for fn in (c.pre, c.post, c.attention))
    pre_g, post_g, att_g = (samples * fn(t) / shard for fn in (c.pre_grad, c.post_grad, c.attention_grad))
    w = samples * c.weight_grad(t) / shard
    w_pre = w * pre / max(pre + post, 1e-12)
    recompute = layout.recompute != "none"
    head_f, head_b = samples * c.head_forward(t) / layout.tp, samples * c.head_backward(t) / layout.tp

    capture = samples * c.capture(t)
    qkv, out = 4 * hb, 2 * hb  # q, k, v and the residual; the attention output and the residual

    def moved(a: Action) -> float:
        """The endpoint time of the action's remote receive and send (``Link.occupies``)."""
        j, mb = a.chunk, a.microbatch
        here = attention_stage(j, mb, p, layout.folds) if a.kind[1] == "A" else j % p
        if a.kind == "FA":
            pairs = [((j - 1) % p, qkv), (j % p, out)]
        elif a.kind == "BA":
            pairs = [(j % p, out), ((j - 1) % p, qkv)]
        else:
            before = [(attention_stage(j, mb, p, layout.folds), out)] if j > 0 else []
            after = [(attention_stage(j + 1, mb, p, layout.folds), qkv)] if j < L else []
            pairs = before + after
        return sum(link.occupancy(n) for stage, n in pairs if stage != here)

    def cost(a: Action) -> float:
        j = a.chunk
        if a.kind == "FA":
            return att + comm / 2 + moved(a)
        if a.kind == "BA":
            return att_g + comm / 2 + moved(a)
        parts_f = (pre if j < L else 0.0) + (post if j > 0 else 0.0) + (head_f if j == L else 0.0)
        if a.kind == "FP":  # the stage's first action of the micro-batch (j < p) captures it
            return parts_f + comm / 2 + moved(a) + (capture if j < p else 0.0)
        parts_b = (pre_g + w_pre if j < L else 0.0) + (post_g + w - w_pre if j > 0 else 0.0) + (head_b if j == L else 0)
        return parts_b + (parts_f if recompute and j > 0 else 0.0) + comm / 2 + moved(a)

    nbytes = {"FA": qkv, "FP": out, "BA": out, "BP": qkv}
    # the attention stage keeps what it received (q, k, v, the residual) and its output; a param chunk
    # keeps its outputs (q, k, v, the residual) for its backward and what its policy keeps inside
    attention_kept = (qkv + out / 2) / layout.tp
    inside = 2 * hb if recompute else max(samples * c.kept["none"](t) / shard - attention_kept, 0.0)
    chunk_kept = inside + qkv / layout.tp

    def held(a: Action) -> float:
        sign = 1 if a.kind[0] == "F" else -1
        edge = 0.5 if a.chunk in (0, L) else 1.0  # P_0 is a pre-attention part only, P_L a post-attention one
        return sign * (attention_kept if a.kind[1] == "A" else edge * chunk_kept)

    m, folds = layout.microbatches, layout.folds
    schedule = helix(p, L, m, folds)
    sim = simulate_helix(schedule, L, m, folds, cost, latency=lambda d, a: link.p2p(nbytes[a.kind]), held=held)
    blocks_on = dict.fromkeys(range(p), L / p)  # each stage: the pre of some layers and the post of others
    outer_on = dict.fromkeys(range(p), {0})
    return _finish(problem, layout, sim, schedule, cost, blocks_on, outer_on, samples, t, hb, comm, kept)


def _finish(problem: Problem, layout: Layout, sim: Simulation, schedule: Schedule, cost: Any, blocks_on: dict,
            outer_on: dict, samples: float, t: int, hb: float, comm: float, kept: float) -> Prediction:  # fmt: skip
    c, link, p = problem.costs, problem.link, layout.pp
    scale = problem.parameter_bytes / c.dtype_bytes  # the profile's parameter bytes at the stored width
    state = 1.0 + OPTIMIZER_STATE.get(problem.optimizer, 2.0)  # parameter + optimizer state (gradients: below)
    block = c.block_parameter_bytes * scale / layout.tp
    outer = c.outer_parameter_bytes * scale
    peak, grads, during = {}, {}, {}
    transient = samples * c.kept["none"](t) / (layout.tp * layout.sp)
    for s in range(p):
        stored = blocks_on[s] * block + outer / (p * layout.tp)  # the pre/post-trunk part as 1/pp shards
        whole = outer / layout.tp if s in outer_on[s] else 0.0  # gathered where it runs, with its gradient
        grads[s] = blocks_on[s] * block + whole
        during[s] = grads[s] + max(sim.peak_in_flight[s], 0.0) + transient
        peak[s] = stored * state + whole + during[s]
    allreduce = max(link.all_reduce(g, layout.dp) for g in grads.values())
    m = layout.microbatches
    messages = 2 * m * hb * (layout.virtual if layout.schedule != "helix" else 6 * c.num_blocks / p)
    comm_bytes = messages + 2 * max(grads.values()) * (layout.dp > 1)
    comm_bytes += m * c.num_blocks / p * 4 * hb * (layout.tp > 1) + m * c.num_blocks / p * 8 * hb * (layout.sp > 1)
    bubble = {s: sim.bubble(s) for s in range(p)}
    return Prediction(layout, sim.makespan + allreduce, bubble, peak, during, comm_bytes, sim, schedule, cost)


def candidates(problem: Problem, devices: int, memory: float | None = None, max_microbatches: int = 64,
               policies: tuple[str, ...] = ("none", "selective", "no_attention", "full"),
               heads: int | None = None) -> list[Prediction]:  # fmt: skip
    """Every layout of ``devices`` that runs this problem (and fits ``memory`` bytes per device), ranked by
    predicted step time."""
    out = []
    for layout in _layouts(problem, devices, max_microbatches, policies, heads):
        if check(problem, layout) is not None:
            continue
        pred = predict(problem, layout)
        if memory is None or max(pred.peak_memory.values()) <= memory:
            out.append(pred)
    return sorted(out, key=lambda pr: pr.step_time)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(problem: Problem, devices: int, max_m: int, policies: tuple[str, ...], heads: int | None) -> list[Layout]:
    out = []
    for dp in _divisors(devices):
        for pp in _divisors(devices // dp):
            for tp in _divisors(devices // (dp * pp)):
                sp = devices // (dp * pp * tp)
                if heads is not None and (heads % (tp * sp)):
                    continue
                ms = [m for m in (1, 2, 4, 8, 16, 32, 64, 128) if m <= max_m and m >= min(pp, max_m)]
                for m in ms:
                    for schedule in SCHEDULES if pp > 1 else ("1f1b",):
                        for policy in policies:
                            folds = (1, 2) if schedule == "helix" else (1,)
                            for fold in folds:
                                rc = policy if schedule != "helix" else ("no_attention" if policy != "none" else "none")
                                out.append(Layout(dp, pp, tp, sp, schedule, m, rc, fold))
    return list(dict.fromkeys(out))
