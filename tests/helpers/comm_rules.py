"""NCCL's rules, applied to the communication logs that ``tests/helpers/comm_check.py`` records on gloo.

A log is one rank's ``{"rank", "groups": {name: global ranks}, "meta", "ops": [op, ...]}`` in issue order
(op fields: see ``comm_check``). Each rule returns a list of violations (strings); :func:`check` runs them all:

(a) :func:`p2p_matching`: NCCL ignores tags. Per communicator (``group``) and ordered pair of ranks, the i-th
    send from A to B meets the i-th receive B posted from A. Their byte sizes and dtypes must agree and the
    counts must be equal. Same size under different tags: ``silent swap`` (each buffer gets the other's
    data); different size: ``size mismatch`` (an NCCL error or a hang); ``dtype mismatch``; ``count mismatch``.
(b) :func:`cyclic_waits`: NCCL's streams, in the rendezvous model (messages above NCCL's internal buffering,
    a few MiB: a send waits for its receive). An unbatched send or receive runs on one in-order stream per
    communicator and pair of ranks, both directions alike (torch's ``ProcessGroupNCCL::pointToPoint`` keeps
    one stream per pair of ranks, keyed by the sorted pair, for sends and receives). The ops of one
    ``batch_isend_irecv`` run together as one unit on the communicator's own stream, which its collectives
    share. An op at the head of its stream completes when its partner is at the head of the partner's stream;
    a collective when every member has it at the head. A simulation that stops with ops left is a ``cyclic
    wait`` (or an ``unmatched`` op). ``eager=True`` is the small-message model (sends never wait; a receive
    waits for its send to have started), for diagnosis: a cycle there hangs at any size. Not modelled: host
    synchronisation (a GPU rank's ``.item()`` waits for its streams), NCCL's limits on concurrent
    communicators.
(c) :func:`collective_order`: every member issues a communicator's collectives in the same order, kind, size
    and dtype (sizes and dtypes that members may legitimately differ in are recorded as ``None``).
(host) :func:`host_tensors`: a tensor made on the host by ``lightning_parallel/`` reached an op: NCCL has no CPU
    backend ("No backend type associated with device type cpu").
Process groups with the same members are different communicators, hence different streams.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

Log = dict[str, Any]
_P2P = ("send", "recv")
_LIMIT = 12  # violations listed per rule


def _ops(log: Log) -> list[dict[str, Any]]:
    return [op for op in log["ops"] if op["kind"] != "mark"]


def describe(rank: int, op: dict[str, Any]) -> str:
    """``rank 0 send->1 tag 13 8192 B float64 (batch 2) [group 0] at file:line (function)``."""
    kind = op["kind"]
    if kind in _P2P:
        what = f"{kind}{'->' if kind == 'send' else '<-'}{op.get('peer')} tag {op.get('tag')}"
    else:
        what = kind
    size = f" {op['bytes']} B" if op.get("bytes") is not None else ""
    dtype = f" {op['dtype']}" if op.get("dtype") else ""
    batch = f" (batch {op['batch']})" if op.get("batch") is not None else ""
    return f"rank {rank} {what}{size}{dtype}{batch} [group {op['group']}] at {op.get('site', '?')}"


def _capped(problems: list[str]) -> list[str]:
    extra = len(problems) - _LIMIT
    return problems[:_LIMIT] + ([f"... and {extra} more of the same rule"] if extra > 0 else [])


def _p2p_lists(logs: list[Log]) -> dict[tuple[str, int, int], tuple[list, list]]:
    """(group, sender, receiver) -> (sender's sends, receiver's receives), each [(rank, op index, op)]."""
    lists: dict[tuple[str, int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    for log in logs:
        me = log["rank"]
        for i, op in enumerate(_ops(log)):
            if op["kind"] == "send":
                lists[(op["group"], me, op["peer"])][0].append((me, i, op))
            elif op["kind"] == "recv":
                lists[(op["group"], op.get("peer"), me)][1].append((me, i, op))
    return lists


def p2p_matching(logs: list[Log]) -> list[str]:
    """Rule (a): the i-th send from A to B on a communicator meets the i-th receive B posted from A."""
    present = {log["rank"] for log in logs}
    problems = []
    for (group, a, b), (sends, recvs) in sorted(_p2p_lists(logs).items(), key=str):
        if a not in present or b not in present:
            continue
        if len(sends) != len(recvs):
            problems.append(
                f"count mismatch: group {group}, rank {a} -> rank {b}: {len(sends)} sends but {len(recvs)} receives"
            )
        for k, ((_, _, s), (_, _, r)) in enumerate(zip(sends, recvs)):
            if s["bytes"] != r["bytes"]:
                rule = "size mismatch"
            elif s["dtype"] != r["dtype"]:
                rule = "dtype mismatch"
            elif s.get("tag") != r.get("tag"):
                rule = "silent swap"
            else:
                continue
            problems.append(f"{rule}: message #{k} from rank {a} to rank {b}: {describe(a, s)} meets {describe(b, r)}")
    return _capped(problems)


def _partners(logs: list[Log]) -> tuple[dict, dict]:
    """p2p op -> its partner op (or None); collective op -> every member's instance (or None if one lacks it).
    Ops are named (rank, index among the log's ops)."""
    p2p: dict[tuple[int, int], tuple[int, int] | None] = {}
    for sends, recvs in _p2p_lists(logs).values():
        for k, (rank, i, _) in enumerate(sends):
            p2p[(rank, i)] = recvs[k][:2] if k < len(recvs) else None
        for k, (rank, i, _) in enumerate(recvs):
            p2p[(rank, i)] = sends[k][:2] if k < len(sends) else None
    present = {log["rank"] for log in logs}
    seq: dict[tuple[str, int], list[int]] = defaultdict(list)
    groups: dict[str, list[int]] = {}
    for log in logs:
        groups.update(log["groups"])
        for i, op in enumerate(_ops(log)):
            if op["kind"] not in _P2P:
                seq[(op["group"], log["rank"])].append(i)
    coll: dict[tuple[int, int], list[tuple[int, int]] | None] = {}
    for (group, rank), indices in seq.items():
        members = [m for m in groups[group] if m in present]
        for k, i in enumerate(indices):
            ok = all(k < len(seq.get((group, m), [])) for m in members)
            coll[(rank, i)] = [(m, seq[(group, m)][k]) for m in members] if ok else None
    return p2p, coll


def _streams(log: Log) -> dict[tuple, list[list[int]]]:
    """This rank's streams, each a list of units (op indices): see rule (b)."""
    streams: dict[tuple, list[list[int]]] = defaultdict(list)
    batch_unit: dict[int, list[int]] = {}
    me = log["rank"]
    for i, op in enumerate(_ops(log)):
        if op["kind"] in _P2P and op.get("batch") is None:
            peer = op.get("peer")
            peer = me if peer is None else peer
            streams[("pair", op["group"], min(me, peer), max(me, peer))].append([i])
        elif op["kind"] in _P2P:
            if op["batch"] not in batch_unit:
                batch_unit[op["batch"]] = []
                streams[("group", op["group"])].append(batch_unit[op["batch"]])
            batch_unit[op["batch"]].append(i)
        else:
            streams[("group", op["group"])].append([i])
    return streams


def _stream_name(key: tuple) -> str:
    return f"pair stream {key[2]}<->{key[3]} of group {key[1]}" if key[0] == "pair" else f"group {key[1]}'s stream"


def cyclic_waits(logs: list[Log], eager: bool = False) -> list[str]:
    """Rule (b): simulate every rank's NCCL streams; ops left when nothing can progress are reported."""
    ops = {(log["rank"], i): op for log in logs for i, op in enumerate(_ops(log))}
    p2p, coll = _partners(logs)
    streams = {
        (log["rank"], key): [[(log["rank"], i) for i in unit] for unit in units]
        for log in logs
        for key, units in _streams(log).items()
    }
    where = {
        op: (rank, key, u) for (rank, key), units in streams.items() for u, unit in enumerate(units) for op in unit
    }
    pos = dict.fromkeys(streams, 0)
    done: set[tuple[int, int]] = set()

    def active(op: tuple[int, int]) -> bool:
        rank, key, u = where[op]
        return pos[(rank, key)] == u

    progress = True
    while progress:
        progress = False
        for sid, units in streams.items():
            while pos[sid] < len(units):
                for op in units[pos[sid]]:
                    if op in done:
                        continue
                    if ops[op]["kind"] in _P2P:
                        peer = p2p.get(op)
                        if eager and ops[op]["kind"] == "send":
                            done.add(op)
                        elif peer is not None and (active(peer) or (eager and peer in done)):
                            done.update((op, peer) if not eager else (op,))
                    else:
                        members = coll.get(op)
                        if members is not None and all(active(m) for m in members):
                            done.update(members)
                    progress = progress or op in done
                if all(op in done for op in units[pos[sid]]):
                    pos[sid] += 1
                    progress = True
                else:
                    break
    stuck = [(sid, units) for sid, units in streams.items() if pos[sid] < len(units)]
    if not stuck:
        return []
    left = sum(len(unit) for sid, units in stuck for unit in units[pos[sid] :])
    lines, unmatched = [], False
    for (rank, key), units in sorted(stuck, key=str):
        for op in units[pos[(rank, key)]]:
            if op in done:
                continue
            line = f"  {describe(rank, ops[op])} on its {_stream_name(key)}"
            partners = [p2p.get(op)] if ops[op]["kind"] in _P2P else (coll.get(op) or [None])
            for partner in partners:
                if partner is None:
                    unmatched = True
                    line += ": has no partner op"
                elif partner != op and not active(partner):
                    prank, pkey, u = where[partner]
                    head = streams[(prank, pkey)][pos[(prank, pkey)]][0]
                    line += (
                        f"; waits for rank {prank}'s {ops[partner]['kind']} #{partner[1]}, queued "
                        f"{u - pos[(prank, pkey)]} behind its {_stream_name(pkey)} head "
                        f"{describe(prank, ops[head])}"
                    )
            lines.append(line)
    model = "eager model, any message size" if eager else "rendezvous model, messages above NCCL's buffering"
    rule = "unmatched op" if unmatched else "cyclic wait"
    return [f"{rule} ({model}): {left} op(s) never complete; stuck stream heads:\n" + "\n".join(lines[:16])]


def collective_order(logs: list[Log]) -> list[str]:
    """Rule (c): each communicator's collectives in the same order, kind, size and dtype on every member."""
    present = {log["rank"] for log in logs}
    seq: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(dict)
    groups: dict[str, list[int]] = {}
    for log in logs:
        groups.update(log["groups"])
        for op in _ops(log):
            if op["kind"] not in _P2P:
                seq[op["group"]].setdefault(log["rank"], []).append(op)
    problems = []
    for group, by_rank in sorted(seq.items()):
        members = [m for m in groups[group] if m in present]
        first = members[0]
        mine = by_rank.get(first, [])
        for m in members[1:]:
            theirs = by_rank.get(m, [])
            for k, (x, y) in enumerate(zip(mine, theirs)):
                if (x["kind"], x.get("bytes"), x.get("dtype")) != (y["kind"], y.get("bytes"), y.get("dtype")):
                    problems.append(
                        f"collective order: group {group} {groups[group]}, collective #{k}: "
                        f"{describe(first, x)} but {describe(m, y)}"
                    )
                    break
            if len(mine) != len(theirs):
                problems.append(
                    f"collective order: group {group} {groups[group]}: rank {first} issues "
                    f"{len(mine)} collectives, rank {m} {len(theirs)}"
                )
    return _capped(problems)


def host_tensors(logs: list[Log]) -> list[str]:
    """Rule (host): ops that carried a host tensor made in ``lightning_parallel/``, one line per place."""
    seen: Counter = Counter()
    ranks: dict[tuple, set[int]] = defaultdict(set)
    for log in logs:
        for op in _ops(log):
            if op.get("host"):
                key = (op["kind"], op.get("api"), op.get("site"), op["host"])
                seen[key] += 1
                ranks[key].add(log["rank"])
    return _capped(
        [
            f"host tensor: {api or kind} at {site} passed a tensor created on the host at {host} "
            f"(NCCL has no CPU backend; {n} op(s), ranks {sorted(ranks[(kind, api, site, host)])})"
            for (kind, api, site, host), n in seen.items()
        ]
    )


def check(logs: list[Log]) -> list[str]:
    """Every violation of rules (a), (b) in the rendezvous model, (c) and the host rule."""
    return p2p_matching(logs) + cyclic_waits(logs) + collective_order(logs) + host_tensors(logs)


def trim(logs: list[Log], first: int, last: int, kinds: tuple[str, ...] | None = None) -> list[Log]:
    """The ops between the ``first``-th and the ``last``-th marks (1-based, inclusive: a training step each when
    the run marked its steps), optionally only those of ``kinds``; for small fixtures. Fields the rules do not
    read (``device``, ``api`` of p2p) are dropped."""
    out = []
    for log in logs:
        ops, n = [], 0
        for op in log["ops"]:
            if op["kind"] == "mark":
                n += 1
                continue
            if first <= n <= last and (kinds is None or op["kind"] in kinds):
                op = {k: v for k, v in op.items() if k != "device" and not (k == "api" and op["kind"] in _P2P)}
                ops.append(op)
        used = {op["group"] for op in ops}
        out.append(dict(log, ops=ops, groups={g: r for g, r in log["groups"].items() if g in used}))
    return out
