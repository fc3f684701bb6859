"""HelixPipe's two-fold first-in-last-out schedule as data (Zhang et al., arXiv 2507.00394, §3).

Units of work, per micro-batch ``b`` (layers 1-indexed, stages 0..p-1):

- ``P_j`` (param chunk j): post-attention of layer j + pre-attention of layer j+1; ``P_0`` is the
  pre-trunk + pre-attention(1), ``P_L`` is post-attention(L) + post-trunk and loss. ``P_j`` runs on stage
  ``j mod p`` (``P_L`` on stage 0: L is a multiple of p).
- ``A_k`` (attention of layer k): runs on stage ``(k + d) mod p`` where ``d`` is the micro-batch's offset
  within its group of p, so the attentions of one group's micro-batches run on p different stages at once.

Micro-batches go in repeats of ``p * folds``: ``b = R*p*F + d*F + f``. The innermost loop is always over
the folds, so two independent micro-batches travel together and one fold's messages overlap the other
fold's compute. Every stage runs all its forwards first, then the same list in exact reverse (FILO), so
each stage holds the same number of micro-batches at the turn.

``simulate_helix`` runs the schedule on a virtual clock (op costs given, a consumer starting at
max(own clock, producer's finish + latency)); its result is comparable with ``schedules.simulate`` of
1F1B on the same costs.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_parallel.pipeline.schedules import Action, Schedule, Simulation, simulate_dag

# Actions are the runtime's one ``Action`` type: kind ``FP``/``BP`` (param chunk P_j, ``chunk`` = j) or
# ``FA``/``BA`` (attention of layer k, ``chunk`` = k), the phase first.
HelixSchedule = Schedule


def attention_stage(layer: int, microbatch: int, num_stages: int, folds: int) -> int:
    """The stage that runs the attention of ``layer`` (1-indexed) for ``microbatch``: (k + d) mod p."""
    offset = (microbatch // folds) % num_stages
    return (layer + offset) % num_stages


def check_sizes(num_stages: int, num_layers: int, num_microbatches: int, folds: int) -> None:
    if folds not in (1, 2):
        raise ValueError(f"folds must be 1 or 2, got {folds}")
    if num_stages < 2:
        raise ValueError(f"HelixPipe needs at least 2 pipeline stages, got {num_stages}")
    if num_layers % num_stages:
        raise ValueError(
            f"HelixPipe needs the number of blocks ({num_layers}) to be a multiple of the number of pipeline"
            f" stages ({num_stages})"
        )
    if num_microbatches % (num_stages * folds):
        raise ValueError(
            f"HelixPipe needs num_microbatches ({num_microbatches}) to be a multiple of pipeline stages x folds"
            f" ({num_stages} x {folds} = {num_stages * folds})"
        )


def helix(num_stages: int, num_layers: int, num_microbatches: int, folds: int = 2) -> HelixSchedule:
    """Each stage's ordered actions: its forward list, then the same list reversed as backwards."""
    check_sizes(num_stages, num_layers, num_microbatches, folds)
    p, L, F = num_stages, num_layers, folds
    repeats, chunks = num_microbatches // (p * F), L // p
    forward: dict[int, list[tuple[str, int, int]]] = {r: [] for r in range(p)}

    def run(stage: int, op: str, index: int, repeat: int, offset: int) -> None:
        forward[stage].extend((op, index, repeat * p * F + offset * F + f) for f in range(F))

    run(0, "P", 0, 0, 0)  # prologue: the first micro-batches enter the pipeline
    for R in range(repeats):
        for r in range(p):
            _warmup(run, r, R, p, L)
            for c in range(1, chunks):
                _steady(run, r, R, p, c)
            _cooldown(run, r, R, p, L, repeats)
    for d in range(1, p):  # epilogue: the last repeat's loss chunks
        run(0, "P", L, repeats - 1, d)
    return {
        s: [Action("F" + op, b, i) for op, i, b in actions]  # type: ignore[misc]
        + [Action("B" + op, b, i) for op, i, b in reversed(actions)]  # type: ignore[misc]
        for s, actions in forward.items()
    }


def _warmup(run: Callable, r: int, R: int, p: int, L: int) -> None:
    for d in range(r - 1, -1, -1):  # attention part: the attentions this stage serves for earlier offsets
        run(r, "A", r - d, R, d)
    if r > 0:
        run(r, "P", r, R, 0)
    for d in range(1, p):  # param part
        if r == 0 and R > 0:
            run(0, "P", L, R - 1, d)
        run(r, "P", r, R, d)
        if d == p - 1:
            run(r, "A", r + 1, R, d)  # offset p-1: the next layer's attention is local


def _steady(run: Callable, r: int, R: int, p: int, c: int) -> None:
    j = c * p + r
    for d in range(p - 2, -1, -1):
        run(r, "A", j - d, R, d)
    run(r, "P", j, R, 0)
    for d in range(1, p):
        run(r, "P", j, R, d)
        if d == p - 1:
            run(r, "A", j + 1, R, d)


def _cooldown(run: Callable, r: int, R: int, p: int, L: int, repeats: int) -> None:
    for d in range(p - 2, r - 1, -1):
        run(r, "A", L + r - d, R, d)
    if r == 0:
        run(0, "P", L, R, 0)
        if R + 1 < repeats:
            run(0, "P", 0, R + 1, 0)


def helix_dependencies(a: Action, num_layers: int) -> list[tuple]:
    """Keys of the actions whose results ``a`` consumes (across stages or on the same one)."""
    key = lambda kind, i: (kind, a.microbatch, i)  # noqa: E731
    if a.kind == "FA":
        return [key("FP", a.chunk - 1)]
    if a.kind == "FP":
        return [key("FA", a.chunk)] if a.chunk > 0 else []
    if a.kind == "BA":
        return [key("BP", a.chunk)]
    return [key("FP", a.chunk)] + ([key("BA", a.chunk + 1)] if a.chunk < num_layers else [])


def simulate_helix(
    schedule: HelixSchedule,
    num_layers: int,
    num_microbatches: int,
    folds: int,
    cost: Callable[[Action], float],
    latency: float | Callable[[tuple, Action], float] = 0.0,
    held: Callable[[Action], float] | None = None,
) -> Simulation:
    """Validate placement and completeness, then run on a virtual clock (raises on deadlock); ``held`` as
    for ``schedules.simulate`` (default: a micro-batch's action counts from its forward to its backward)."""
    p = len(schedule)
    want = {(ph + "P", b, j) for ph in "FB" for j in range(num_layers + 1) for b in range(num_microbatches)}
    want |= {(ph + "A", b, k) for ph in "FB" for k in range(1, num_layers + 1) for b in range(num_microbatches)}
    seen = set()
    for s, actions in schedule.items():
        for a in actions:
            where = attention_stage(a.chunk, a.microbatch, p, folds) if a.kind[1] == "A" else a.chunk % p
            if where != s:
                raise ValueError(f"{a} runs on stage {s}, the placement rule gives stage {where}")
            if tuple(a) in seen:
                raise ValueError(f"{a} appears twice")
            seen.add(tuple(a))
        half = len(actions) // 2
        if [(x.kind[1], x.chunk, x.microbatch) for x in actions[half:]] != [
            (x.kind[1], x.chunk, x.microbatch) for x in reversed(actions[:half])
        ]:
            raise ValueError(f"stage {s}: the backward order is not the forward order reversed")
    if seen != want:
        raise ValueError(f"the schedule misses {sorted(want - seen)[:5]} and has extra {sorted(seen - want)[:5]}")
    return simulate_dag(
        schedule,
        lambda a: helix_dependencies(a, num_layers),
        cost,
        latency,
        held=held or (lambda a: 1 if a.kind[0] == "F" else -1),
    )
