"""Predict a layout's step before launch: the schedule the strategy would build, run on the simulator's
virtual clock with the model's measured (or published) costs and a link model.

A :class:`Layout` names what a strategy takes: dp, pp, tp, sp sizes, the schedule (``gpipe``, ``1f1b``,
``interleaved_1f1b``, ``zb_h1``, ``zbv``, or ``helix`` with 1 or 2 folds), the micro-batch count, the
recomputation policy, the data-parallel sharding (``"full"``: FSDP2) and, for a mixture of experts, the
expert-parallel size ep (over the dp x sp ranks). Per action (``Action.kind`` of the same schedules the runtime
executes):

- chunk actions: the chunk's blocks (``place_blocks``, the strategy's placement) times the per-block
  cost of the action (``F``, ``B``, ``I``, ``W`` under the policy, as measured) at the micro-batch's
  tokens, divided by tp x sp (sharded work), plus tp's two all-reduces per block and direction and sp's
  four all-to-alls (Ulysses); the last chunk adds the head, a stage's first chunk the capture;
- helix: ``FP``/``BP`` the post- and pre-attention parts around a layer boundary, ``FA``/``BA`` the
  attention core, recomputation of the param chunks (its ``no_attention``) in ``BP``, packing a message
  to another stage (a copy); under tp x sp each part's work divided by tp x sp, tp's all-reduces in the
  param chunks (attention has none), sp's all-to-alls in the attention actions, a message's q, k, v and
  attention output divided by tp x sp and its residual by sp;
- ep: each block's forward sends each token's rows to its experts' ranks and back (two all-to-alls of the
  rows, ``rows_per_token`` hidden states per token of this rank's micro-batch shard), its backward the same
  (in ``B``, ``I``; helix: in the post-attention parts, where the MLP runs); the experts' compute is the same per
  rank on average (``E/ep`` experts over ``ep`` ranks' tokens);
- ``"full"`` sharding: each block's parameters all-gathered over dp before its forward and its backward, its
  gradients reduce-scattered after its backward (FSDP2), instead of the step's gradient all-reduce;
- a message to another stage (hidden state; q, k, v and the residual for helix) costs the link's time
  for its bytes, to the receiving action under gloo's rendezvous (``Link.receiving``), as a delay before
  the consumer otherwise (``Link.arrival``); a dependency on the same stage costs nothing.

Step time = the simulated makespan + the gradient all-reduce over dp (after the schedule, as the
strategies run it; the experts' over the ``dp·sp/ep`` ranks holding the same experts). Memory per stage =
parameters, gradients and optimizer state of what the stage holds (blocks of its chunks by the real placement
functions, a block's experts 1/ep and whole over tp, the rest 1/tp; the pre/post-trunk parameters as 1/pp
shards plus, whole, where they run, or, vocabulary-parallel under tp, 1/tp on every stage; all of it 1/dp
under ``"full"``, except the vocabulary-parallel part under a pipeline, plus one block whole while it runs)
+ the simulated peak of what the step holds: each forward adds what
it keeps for its backward (the policy's saved tensors, a received input, the head's; helix: each part's)
and its backward frees it, ``I`` holds the weights' work until ``W``, a captured micro-batch lives from
the stage's first action of it to its last backward, a packed copy sent until the runtime completes it
(at the micro-batch's next message from another stage) + one block's activations being formed.

Over 400 lines because one cost model prices every layout (the pipeline schedules, HelixPipe, tp, sp, dp,
sharding, recomputation) against the same measured block costs.
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
from lightning_parallel.plan.costs import BlockCosts
from lightning_parallel.plan.hardware import Link

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
    sharding: str = "none"  # data_parallel_sharding: "none" or "full" (FSDP2 over dp)
    ep: int = 1  # expert_parallel_size (over the dp x sp ranks)

    @property
    def devices(self) -> int:
        return self.dp * self.pp * self.tp * self.sp

    @property
    def virtual(self) -> int:
        return 2 if self.schedule in ("interleaved_1f1b", "zbv") else 1

    def name(self) -> str:
        sched = f"helix f{self.folds}" if self.schedule == "helix" else self.schedule
        full = " full" if self.sharding == "full" else ""
        full += f" ep{self.ep}" if self.ep > 1 else ""
        return f"dp{self.dp}{full} pp{self.pp} tp{self.tp} sp{self.sp} {sched} m{self.microbatches} rc={self.recompute}"


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
    if layout.sharding == "full" and (layout.dp == 1 or layout.schedule in ("helix", "zb_h1", "zbv")):
        return "data_parallel_sharding='full' needs dp > 1 and neither helix nor a split backward (refused)"
    if layout.schedule == "helix":
        if problem.costs.helix is None:
            return f"no HelixPipe split of the block: {problem.costs.helix_refused}"
        if p < 2 or L % p or m % (p * layout.folds):
            return "helix needs pp >= 2, L % pp == 0 and m % (pp * folds) == 0"
    elif L < p * layout.virtual:
        return f"{L} blocks cannot fill {p * layout.virtual} chunks"
    elif layout.virtual > 1 and L % (p * layout.virtual):
        return "two chunks per stage need L % (2 pp) == 0"
    if layout.schedule == "interleaved_1f1b" and m % p:
        return "interleaved needs m % pp == 0"
    if layout.pp == 1 and layout.schedule != "1f1b":
        return "one stage: no schedule to choose"
    if layout.ep > 1:
        experts = problem.costs.experts
        if experts is None:
            return "expert parallelism needs a mixture of experts in the block (none found)"
        if (layout.dp * layout.sp) % layout.ep or experts.num_experts % layout.ep:
            return f"ep {layout.ep} must divide dp x sp = {layout.dp * layout.sp} and {experts.num_experts} experts"
        if layout.sharding != "none":
            return "the planner does not model expert parallelism with data_parallel_sharding yet"
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
    comm = tp_comm + sp_comm + (ep_comm := expert_exchange(problem, layout, hb))
    policy = c.policy(layout.recompute)
    per_block = lambda costs: samples * costs[policy](t) / shard  # noqa: E731
    gather = link.all_gather(block_bytes(problem, layout), layout.dp) if layout.sharding == "full" else 0.0
    f, b, i, w = (
        per_block(c.forward) + comm + gather,
        per_block(c.backward) + comm + 2 * gather,  # gathered again for the backward, then reduce-scattered
        per_block(c.input_grad) + comm + gather,
        per_block(c.weight_grad) + gather,
    )
    kept = c.kept_per_rank(samples * c.kept[policy](t), layout.tp, layout.sp)
    head_f, head_b = samples * c.head_forward(t) / layout.tp, samples * c.head_backward(t) / layout.tp
    if layout.schedule == "helix":
        return _predict_helix(problem, layout, samples, t, hb, (tp_comm, sp_comm, ep_comm), kept)
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
        if a.kind == "F":  # receives the previous chunk's output, sends its own on
            moved = remote(ch, ch - 1) * link.receiving(hb) + remote(ch, ch + 1) * link.sending(hb)
            return n * f + head * head_f + (ch in firsts) * capture + moved
        moved = remote(ch, ch + 1) * link.receiving(hb) + remote(ch, ch - 1) * link.sending(hb)  # gradients
        if a.kind == "B":
            return n * b + head * head_b + moved
        if a.kind == "I":
            return n * i + head * head_b + moved
        return n * w

    split = samples * c.split_bytes(t) / shard
    whole = c.kept_per_rank(samples * c.kept["none"](t), layout.tp, layout.sp)
    capture = samples * c.capture(t)
    firsts = {min(ch for ch in range(len(sizes)) if stages_of(ch) == s) for s in range(p)}
    head_kept = samples * c.head_kept(t) / layout.tp

    def kept_by(a: Action) -> float:
        """What chunk ``a.chunk``'s forward keeps for its backward: its blocks' saved tensors, a received
        input (a new buffer), the head's on the last chunk."""
        ch = a.chunk
        return sizes[ch] * kept + remote(ch, ch - 1) * hb / layout.sp + (ch == last) * head_kept

    def chunk_held(a: Action) -> float:
        # I recomputes what the policy did not keep and holds it, with the gradients at the weights, until W
        n, sign = sizes[a.chunk], {"F": 1, "B": -1, "I": -1, "W": 0}[a.kind]
        split_held = {"I": n * (whole + split), "W": -n * (whole + split)}.get(a.kind, 0.0)
        return sign * kept_by(Action("F", a.microbatch, a.chunk)) + split_held

    if p == 1:
        schedule: Schedule = {0: [Action("F", k, 0) for k in range(layout.microbatches)]
                              + [Action("B", k, 0) for k in range(layout.microbatches)]}  # fmt: skip
    else:
        schedule = build_schedule(layout.schedule, p, layout.microbatches, v)
    captured = _captures(schedule, lambda s: samples * c.capture_kept(t) if s == stages[0] else hb)
    held = lambda a: chunk_held(a) + captured(a)  # noqa: E731
    if p == 1:
        sim = simulate(schedule, 1, layout.microbatches, cost=cost, held=held)
    else:
        delay = lambda d, a: link.arrival(hb)  # noqa: E731
        sim = simulate(schedule, p * v, layout.microbatches, cost=cost, latency=delay, stages=stages, held=held)
    blocks_on = {s: sum(n for ch, n in enumerate(sizes) if stages[ch] == s) for s in range(p)}
    outer_on = {s: {stages[0], stages[-1]} for s in range(p)}
    return _finish(problem, layout, sim, schedule, cost, blocks_on, outer_on, samples, t, hb, comm, kept)


def _predict_helix(problem: Problem, layout: Layout, samples: float, t: int, hb: float,
                   comms: tuple[float, float], kept: float) -> Prediction:  # fmt: skip
    c, link, p, L = problem.costs, problem.link, layout.pp, problem.costs.num_blocks
    assert c.helix is not None, "check() refuses helix without a split"
    h = c.helix
    shard = layout.tp * layout.sp  # each part's work: heads over tp, tokens (or Ulysses' heads) over sp
    pre, post, att = (samples * fn(t) / shard for fn in (h.pre, h.post, h.attention))
    pre_g, post_g, att_g = (samples * fn(t) / shard for fn in (h.pre_grad, h.post_grad, h.attention_grad))
    recompute = layout.recompute != "none"
    head_f, head_b = samples * c.head_forward(t) / layout.tp, samples * c.head_backward(t) / layout.tp
    capture = samples * c.capture(t)
    tp_comm, sp_comm, ep_comm = comms  # tp's all-reduces in the param chunks, sp's all-to-alls around attention
    post_comm = ep_comm  # the experts' exchange, where the MLP runs
    # the two messages of a layer (and their gradients): q, k, v or the attention output on this rank's heads
    # and tokens, the residual (the state post needs, a hidden state) on its tokens
    qkv, out = (samples * fn(t) - hb for fn in (h.qkv_bytes, h.out_bytes))
    qkv, out = qkv / shard + hb / layout.sp, out / shard + hb / layout.sp

    def ends(a: Action) -> tuple[int, list[tuple[int, float]], list[tuple[int, float]]]:
        """The action's stage, and the (stage, bytes) of what it receives and of what it sends."""
        j, mb = a.chunk, a.microbatch
        if a.kind[1] == "A":  # FA takes q, k, v from P_{j-1} and gives its output to P_j; BA the reverse
            here = attention_stage(j, mb, p, layout.folds)
            pre_side, post_side = [((j - 1) % p, qkv)], [(j % p, out)]
            return (here, pre_side, post_side) if a.kind == "FA" else (here, post_side, pre_side)
        # FP takes A_j's output and gives q, k, v to A_{j+1}; BP the reverse
        before = [(attention_stage(j, mb, p, layout.folds), out)] if j > 0 else []
        after = [(attention_stage(j + 1, mb, p, layout.folds), qkv)] if j < L else []
        return (j % p, before, after) if a.kind == "FP" else (j % p, after, before)

    def moved(a: Action) -> float:
        """The action's remote receive and send (``Link.receiving``, ``Link.sending``), packing the send (a copy)."""
        here, received, sent = ends(a)
        receiving = sum(link.receiving(n) for stage, n in received if stage != here)
        return receiving + sum(link.sending(n) + c.pack(n) for stage, n in sent if stage != here)

    def cost(a: Action) -> float:
        j = a.chunk
        if a.kind == "FA":
            return att + sp_comm + moved(a)
        if a.kind == "BA":
            return att_g + sp_comm + moved(a)
        parts_f = (pre if j < L else 0.0) + (post + post_comm if j > 0 else 0.0) + (head_f if j == L else 0.0)
        if a.kind == "FP":  # the stage's first action of the micro-batch (j < p) captures it
            return parts_f + tp_comm + moved(a) + (capture if j < p else 0.0)
        parts_b = (pre_g if j < L else 0.0) + (post_g + post_comm if j > 0 else 0.0) + (head_b if j == L else 0.0)
        again = parts_f + tp_comm if recompute and j > 0 else 0.0  # the chunk's forward recomputed
        return parts_b + again + tp_comm + moved(a)

    nbytes = {"FA": qkv, "FP": out, "BA": out, "BP": qkv}
    pre_kept, post_kept = (c.kept_per_rank(samples * fn(t), layout.tp, layout.sp) for fn in (h.pre_kept, h.post_kept))
    att_kept = samples * h.attention_kept(t) / shard  # its output and statistics, on this rank's heads and tokens
    if layout.sp > 1:  # Ulysses' all-to-all gives the attention new q, k, v (whole sequence, 1/sp of the heads)
        att_kept += (samples * h.qkv_bytes(t) - hb) / shard
    head_kept = samples * c.head_kept(t)

    def kept_by(a: Action) -> float:
        """What a forward keeps until its backward: the part's saved tensors and outputs (a chunk run under
        recomputation: its outputs only, the loss chunk nothing), and what it received from another stage (a
        new buffer; a message handed over on the same stage shares the sender's)."""
        j = a.chunk
        here, received, _ = ends(a)
        inputs = sum(n for stage, n in received if stage != here)
        if a.kind == "FA":
            return att_kept + inputs
        if recompute and j > 0:
            return (qkv if j < L else 0.0) + inputs
        return (post_kept if j > 0 else 0.0) + (pre_kept if j < L else 0.0) + (head_kept if j == L else 0.0) + inputs

    pending: dict[tuple[int, int], float] = {}  # packed copies sent, per (stage, micro-batch), until complete

    def helix_held(a: Action) -> float:
        delta = (1 if a.kind[0] == "F" else -1) * kept_by(Action("F" + a.kind[1], a.microbatch, a.chunk))
        here, received, sent = ends(a)
        if any(stage != here for stage, _ in received):  # the runtime completes earlier sends here
            delta -= pending.pop((here, a.microbatch), 0.0)
        copies = sum(n for stage, n in sent if stage != here)
        pending[(here, a.microbatch)] = pending.get((here, a.microbatch), 0.0) + copies
        return delta + copies

    m, folds = layout.microbatches, layout.folds
    schedule = helix(p, L, m, folds)
    captured = _captures(schedule, lambda s: samples * c.capture_kept(t) if s == 0 else hb)
    held = lambda a: helix_held(a) + captured(a)  # noqa: E731
    sim = simulate_helix(schedule, L, m, folds, cost, latency=lambda d, a: link.arrival(nbytes[a.kind]), held=held)
    blocks_on = dict.fromkeys(range(p), L / p)  # each stage: the pre of some layers and the post of others
    outer_on = dict.fromkeys(range(p), {0})
    return _finish(problem, layout, sim, schedule, cost, blocks_on, outer_on, samples, t, hb, sum(comms), kept)


def block_bytes(problem: Problem, layout: Layout) -> float:
    """A block's parameter bytes on a rank (as stored: the profile's dtype scaled to ``parameter_bytes``), its
    tensor-parallel shard; of a mixture's experts a block's mean share (:class:`ExpertCosts`), 1/ep of it under ep
    (whole over tp), else 1/tp."""
    c, experts = problem.costs, problem.costs.experts
    scale = problem.parameter_bytes / c.dtype_bytes
    if experts is None:
        return c.block_parameter_bytes * scale / layout.tp
    rest = c.block_parameter_bytes * scale - (experts.parameter_bytes * scale if experts.in_profiled else 0.0)
    mean = expert_bytes(problem, layout) * layout.ep  # a block's mean share of the experts, whole
    return rest / layout.tp + (mean / layout.ep if layout.ep > 1 else mean / layout.tp)


def expert_bytes(problem: Problem, layout: Layout) -> float:
    """A block's mean share of the experts' parameter bytes on a rank under ep (as stored), 0 without a
    mixture."""
    experts = problem.costs.experts
    if experts is None:
        return 0.0
    whole = experts.parameter_bytes * problem.parameter_bytes / problem.costs.dtype_bytes
    return whole * experts.share / layout.ep


def expert_exchange(problem: Problem, layout: Layout, hb: float) -> float:
    """Seconds of one block's two all-to-alls (dispatch and combine) per direction under ep: this rank's rows,
    ``rows_per_token`` hidden states per token of its micro-batch shard (``hb``: the micro-batch's hidden state)."""
    experts = problem.costs.experts
    if layout.ep == 1 or experts is None:
        return 0.0
    return 2 * problem.link.all_to_all(experts.rows_per_token * hb / layout.sp, layout.ep) * experts.share


def _captures(schedule: Schedule, nbytes: Callable[[int], float]) -> Callable[[Action], float]:
    """What a captured micro-batch holds on a stage (``nbytes(stage)``), from the stage's first action of the
    micro-batch to its last backward action (the runtime drops the capture when the backwards are done)."""
    delta: dict[Action, float] = {}
    for s, actions in schedule.items():
        first: dict[int, Action] = {}
        last: dict[int, Action] = {}
        for a in actions:
            first.setdefault(a.microbatch, a)
            if a.kind in ("B", "W", "BP", "BA"):
                last[a.microbatch] = a
        for a in first.values():
            delta[a] = delta.get(a, 0.0) + nbytes(s)
        for a in last.values():
            delta[a] = delta.get(a, 0.0) - nbytes(s)
    return lambda a: delta.get(a, 0.0)


def _finish(problem: Problem, layout: Layout, sim: Simulation, schedule: Schedule, cost: Any, blocks_on: dict,
            outer_on: dict, samples: float, t: int, hb: float, comm: float, kept: float) -> Prediction:  # fmt: skip
    c, link, p = problem.costs, problem.link, layout.pp
    scale = problem.parameter_bytes / c.dtype_bytes  # the profile's parameter bytes at the stored width
    state = 1.0 + OPTIMIZER_STATE.get(problem.optimizer, 2.0)  # parameter + optimizer state (gradients: below)
    block = block_bytes(problem, layout)
    outer = c.outer_parameter_bytes * scale
    full = layout.sharding == "full"
    # the pre/post-trunk part: 1/pp shards over the stages, or vocabulary-parallel (1/tp, on every stage) under
    # tp; under full sharding 1/dp more (FSDP2's units without a pipeline, the stages' dp x pp storage with one)
    # except the vocabulary-parallel part under a pipeline
    outer_stored = outer / layout.tp if layout.tp > 1 else outer / p
    outer_stored /= layout.dp if full and (p == 1 or layout.tp == 1) else 1
    blocks_div = layout.dp if full else 1  # FSDP2's shards of the blocks
    peak, grads, during = {}, {}, {}
    # a block's backward temporaries (about its activations) on top of the other micro-batches' activations held
    # meanwhile; with one micro-batch the backward frees the activations it consumes as fast (measured: dp=2 full)
    transient = c.kept_per_rank(samples * c.kept["none"](t), layout.tp, layout.sp) if layout.microbatches > 1 else 0.0
    expert_grads = {}  # the experts' gradients: reduced over the ranks holding the same experts, not dp
    for s in range(p):
        expert_grads[s] = blocks_on[s] * expert_bytes(problem, layout) if layout.ep > 1 else 0.0
        whole = outer / layout.tp if s in outer_on[s] else 0.0  # gathered where it runs, with its gradient
        grads[s] = blocks_on[s] * block / blocks_div + whole
        gathered = 2 * block if full else 0.0  # one block whole (per tp) while it runs, and its gradient
        during[s] = grads[s] + max(sim.peak_in_flight[s], 0.0) + transient + gathered
        peak[s] = (blocks_on[s] * block / blocks_div + outer_stored) * state + whole + during[s]
    if full and (p == 1 or layout.tp == 1):
        # the blocks' gradients are reduce-scattered in their backward (in f, b, i, w); FSDP2's units outside the
        # trunk are gathered for the forward, again for the backward, and their gradients reduce-scattered
        allreduce = 3 * link.all_gather(outer / layout.tp, layout.dp)
    elif full:  # the vocabulary-parallel part stays whole over dp: its gradient is all-reduced
        allreduce = link.all_reduce(outer / layout.tp, layout.dp)
    else:
        replicas = layout.dp * layout.sp // layout.ep
        experts = (lambda s: link.all_reduce(expert_grads[s], replicas)) if layout.ep > 1 else (lambda s: 0.0)
        allreduce = max(link.all_reduce(g - expert_grads[s], layout.dp) + experts(s) for s, g in grads.items())
    m = layout.microbatches
    messages = 2 * m * hb * (layout.virtual if layout.schedule != "helix" else 6 * c.num_blocks / p)
    comm_bytes = messages + 2 * max(grads.values()) * (layout.dp > 1)
    if full:  # each block gathered twice and its gradient reduce-scattered
        comm_bytes += 3 * max(blocks_on.values()) * block * (layout.dp - 1) / layout.dp
    comm_bytes += m * c.num_blocks / p * 4 * hb * (layout.tp > 1) + m * c.num_blocks / p * 8 * hb * (layout.sp > 1)
    if layout.ep > 1 and c.experts is not None:  # four all-to-alls of the rows per block, their share to the others
        rows = c.experts.rows_per_token * hb / layout.sp * c.experts.share
        comm_bytes += m * c.num_blocks / p * 4 * rows * (layout.ep - 1) / layout.ep
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
                                for sharding in ("none", "full") if dp > 1 else ("none",):
                                    out.append(Layout(dp, pp, tp, sp, schedule, m, rc, fold, sharding))
                                for ep in _divisors(dp * sp)[1:] if problem.costs.experts is not None else ():
                                    out.append(Layout(dp, pp, tp, sp, schedule, m, rc, fold, "none", ep))
    return list(dict.fromkeys(out))
