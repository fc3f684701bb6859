"""Record, inside each forked gloo rank, every communication op in issue order, so that NCCL's rules can be
checked on CPU (the rules themselves: ``tests/helpers/comm_rules.py``).

gloo forgives what NCCL does not: it matches point-to-point messages by tag, lets a receive overtake a send,
and serves host tensors. NCCL ignores tags (the i-th send from A to B meets the i-th receive B posted from A),
runs unbatched sends and receives between two ranks on one in-order stream per pair of ranks (both
directions alike: torch's ``ProcessGroupNCCL::pointToPoint`` keys its streams by the sorted pair of ranks),
blocks a large send until its receive runs, and has no CPU backend at all. This module records what those
rules need; :func:`tests.helpers.comm_rules.check` applies them.

What is recorded, per op (a JSON-able dict): ``kind`` (``send``/``recv``, or the collective normalised:
``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``, ``reduce``, ``gather``,
``scatter``, ``barrier``, or the object collective's name), ``api`` (the function called), ``group`` (the
process group's ``group_name``; its global ranks in the log's ``groups``), ``peer`` (p2p: the peer's global
rank), ``tag``, ``bytes`` (p2p: the buffer; collectives: the size every member must agree on, ``None`` where
members legitimately differ: object collectives, ``all_to_all``), ``dtype``, ``batch`` (the ordinal of the
``batch_isend_irecv`` it was issued in), ``site`` (the first ``lightning_parallel/`` frame that issued it,
else the first frame outside torch) and ``host`` (where a host tensor it carries was created, see below).

Wrapped: ``torch.distributed``'s ``isend``, ``irecv``, ``send``, ``recv``, ``batch_isend_irecv`` (``P2POp``),
its tensor collectives, ``barrier``/``monitored_barrier`` and the object collectives (by name, no tensor
check: they are host-side bookkeeping, which NCCL serves on the current device); and the functional
collectives called from Python (``torch.distributed._functional_collectives``: ``all_reduce``,
``all_gather_*``, ``reduce_scatter_*``, ``all_to_all_single[_autograd]``, ``broadcast``), which DTensor's
redistribution and the package's tensor/sequence parallelism use. Only the outermost wrapped call is
recorded (``send`` calls ``isend`` inside, funcol functions call each other).

NOT covered: a functional collective issued by the autograd engine in a backward pass (the backward of
``all_to_all_single_autograd``, DTensor's ``Partial`` gradients), which runs in C++; anything calling
``torch.ops._c10d_functional`` or ``ProcessGroup`` methods directly; functions imported by name before the
recorder was installed (``from torch.distributed import isend``); ``send_object_list``/``recv_object_list``;
``all_gather_inplace``; threads other than the rank's main thread (the host-tensor mode is thread-local);
host synchronisation (``.item()``, ``.tolist()``) that on a GPU would order a rank's streams.

Host tensors (NCCL has no CPU backend): ``tests/helpers/comm_taint.py`` marks the tensors that
``lightning_parallel/`` makes on the host; every recorded op checks its tensors against those marks.
"""

from __future__ import annotations

import glob
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.distributed.distributed_c10d as c10d
from torch import Tensor

from tests.helpers import comm_taint
from tests.helpers.comm_rules import check, collective_order, cyclic_waits, host_tensors, p2p_matching  # noqa: F401
from tests.helpers.comm_taint import TAINT, HostTaint, tensors, where

ENV_LOG_DIR = "LP_COMM_LOG_DIR"  # a rank of run_distributed writes its log there (raw recording, no check)
ENV_CHECK = "LP_COMM_CHECK"  # "1": every run_distributed checks; "0": assert_parity does not

_HERE = os.path.abspath(__file__)

# collective api -> (normalised kind, parameter giving the agreed size, its multiplier "world" or None, tensors)
_C10D: dict[str, tuple[str, str | None, str | None, tuple[str, ...]]] = {
    "all_reduce": ("all_reduce", "tensor", None, ("tensor",)),
    "all_reduce_coalesced": ("all_reduce", "tensors", None, ("tensors",)),
    "broadcast": ("broadcast", "tensor", None, ("tensor",)),
    "reduce": ("reduce", "tensor", None, ("tensor",)),
    "all_gather_into_tensor": ("all_gather", "output_tensor", None, ("output_tensor", "input_tensor")),
    "all_gather_single": ("all_gather", "output_tensor", None, ("output_tensor", "input_tensor")),
    "_all_gather_base": ("all_gather", "output_tensor", None, ("output_tensor", "input_tensor")),
    "all_gather": ("all_gather", "tensor", "world", ("tensor_list", "tensor")),
    "reduce_scatter_tensor": ("reduce_scatter", "input", None, ("output", "input")),
    "reduce_scatter_single": ("reduce_scatter", "input", None, ("output", "input")),
    "_reduce_scatter_base": ("reduce_scatter", "input", None, ("output", "input")),
    "reduce_scatter": ("reduce_scatter", "input_list", None, ("output", "input_list")),
    "all_to_all_single": ("all_to_all", None, None, ("output", "input")),
    "all_to_all": ("all_to_all", None, None, ("output_tensor_list", "input_tensor_list")),
    "gather": ("gather", "tensor", None, ("tensor", "gather_list")),
    "scatter": ("scatter", "tensor", None, ("tensor", "scatter_list")),
    "barrier": ("barrier", None, None, ()),
    "monitored_barrier": ("barrier", None, None, ()),
    "all_gather_object": ("all_gather_object", None, None, ()),
    "broadcast_object_list": ("broadcast_object_list", None, None, ()),
    "gather_object": ("gather_object", None, None, ()),
    "scatter_object_list": ("scatter_object_list", None, None, ()),
}
_FUNCOL: dict[str, tuple[str, str | None, str | None, tuple[str, ...]]] = {
    "all_reduce": ("all_reduce", "self", None, ("self",)),
    "all_reduce_coalesced": ("all_reduce", "self", None, ("self",)),
    "broadcast": ("broadcast", "self", None, ("self",)),
    **{
        n: ("all_gather", "self", "world", ("self",))
        for n in ("all_gather_single", "all_gather_single_autograd", "all_gather_tensor", "all_gather_tensor_autograd")
    },
    **{
        n: ("reduce_scatter", "self", None, ("self",))
        for n in (
            "reduce_scatter_single",
            "reduce_scatter_single_autograd",
            "reduce_scatter_tensor",
            "reduce_scatter_tensor_autograd",
        )
    },
    "all_to_all_single": ("all_to_all", None, None, ("self",)),
    "all_to_all_single_autograd": ("all_to_all", None, None, ("self",)),
}
_P2P = {"isend": "send", "send": "send", "irecv": "recv", "recv": "recv"}


class _State(threading.local):
    depth = 0


_STATE = _State()
_LOG: Log | None = None
_ORIGINAL: dict[tuple[Any, str], Any] = {}
_WRAPPERS: dict[Any, Any] = {}  # wrapper -> the function it wraps


class Log:
    """One rank's record: its ops in issue order, the groups they used, and what the run expects."""

    def __init__(self, rank: int) -> None:
        self.rank, self.ops, self.groups = rank, [], {}
        self.meta: dict[str, Any] = {}
        self.batches = 0

    def to_json(self) -> dict[str, Any]:
        ops = [{k: v for k, v in op.items() if v is not None} for op in self.ops]
        return {"rank": self.rank, "groups": self.groups, "meta": self.meta, "ops": ops}


def _site() -> str:
    """The first frame in ``lightning_parallel/`` above this call, else the first one outside torch and here."""
    frame, fallback = sys._getframe(1), None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(comm_taint.package_dir):
            return where(frame)
        if fallback is None and path != _HERE and not path.startswith(comm_taint.TORCH_DIR):
            fallback = frame
        frame = frame.f_back
    return where(fallback) if fallback is not None else "?"


def _group_info(group: Any) -> tuple[str, list[int]] | None:
    """The group's name and global ranks; ``None`` where this rank is not a member (nothing is issued)."""
    if isinstance(group, c10d.ProcessGroup) or group is None:
        pg = group if group is not None else c10d._get_default_group()
    else:
        pg = c10d._resolve_process_group(fc._resolve_group_name(group, ""))
    if c10d._rank_not_in_group(pg):
        return None
    return str(pg.group_name), dist.get_process_group_ranks(pg)


def _record(kind: str, api: str, group: Any, checked: list[Tensor], **fields: Any) -> None:
    assert _LOG is not None
    info = _group_info(group)
    if info is None:
        return
    name, ranks = info
    _LOG.groups[name] = ranks
    host = next((TAINT[t] for t in checked if t in TAINT), None)
    _LOG.ops.append(dict(kind=kind, api=api, group=name, **fields, site=_site(), host=host))


def _nbytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _wrap(orig: Callable[..., Any], record: Callable[[dict[str, Any]], None]) -> Callable[..., Any]:
    sig = inspect.signature(orig)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _LOG is None or _STATE.depth:
            return orig(*args, **kwargs)
        try:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            record(bound.arguments)
        except Exception as exc:  # never break the run: the check reports it (a bad call raises below anyway)
            _recorder_error(orig.__name__, exc)
        _STATE.depth += 1
        try:
            return orig(*args, **kwargs)
        finally:
            _STATE.depth -= 1

    wrapper.__name__, wrapper.__doc__, wrapper.__wrapped__ = orig.__name__, orig.__doc__, orig  # type: ignore
    _WRAPPERS[wrapper] = orig
    return wrapper


def _recorder_error(api: str, exc: Exception) -> None:
    if _LOG is not None:
        _LOG.meta.setdefault("errors", []).append(f"{api}: {exc!r}")


def _p2p_recorder(api: str) -> Callable[[dict[str, Any]], None]:
    kind = _P2P[api]

    def record(a: dict[str, Any]) -> None:
        group = c10d._group_or_default_group(a["group"])
        peer = a["dst" if kind == "send" else "src"]
        group_peer = a["group_dst" if kind == "send" else "group_src"]
        if peer is None and group_peer is not None:
            peer = dist.get_global_rank(group, group_peer)
        _record_p2p(kind, api, group, a["tensor"], peer, a["tag"], None)

    return record


def _record_p2p(kind: str, api: str, group: Any, t: Tensor, peer: int | None, tag: int, batch: int | None) -> None:
    try:
        dtype = str(t.dtype).removeprefix("torch.")
        fields = dict(peer=peer, tag=tag, bytes=_nbytes([t]), dtype=dtype, device=str(t.device), batch=batch)
        _record(kind, api, group, [t], **fields)
    except Exception as exc:
        _recorder_error(api, exc)


def _collective_recorder(api: str, spec: tuple[str, str | None, str | None, tuple[str, ...]]) -> Callable:
    kind, size_key, times, checked_keys = spec

    def record(a: dict[str, Any]) -> None:
        sized = tensors(a.get(size_key)) if size_key else []
        nbytes = _nbytes(sized) if sized else None
        if nbytes is not None and times == "world":
            info = _group_info(a.get("group"))
            nbytes *= len(info[1]) if info else 1
        checked = [t for key in checked_keys for t in tensors(a.get(key))]
        first = (sized or checked or [None])[0]
        dtype = str(first.dtype).removeprefix("torch.") if first is not None else None
        _record(kind, api, a.get("group"), checked, bytes=nbytes, dtype=dtype)

    return record


def _batch(orig: Callable[..., Any]) -> Callable[..., Any]:
    def batch_isend_irecv(p2p_op_list: list[Any]) -> Any:
        if _LOG is None or _STATE.depth:
            return orig(p2p_op_list)
        _LOG.batches += 1
        for op in p2p_op_list:
            send, t = _WRAPPERS.get(op.op, op.op) is c10d.isend, op.tensor
            _record_p2p("send" if send else "recv", "batch_isend_irecv", op.group, t, op.peer, op.tag, _LOG.batches)
        saved = [op.op for op in p2p_op_list]
        for op in p2p_op_list:  # the original tells sends from receives by identity with c10d.isend
            op.op = _WRAPPERS.get(op.op, op.op)
        _STATE.depth += 1
        try:
            return orig(p2p_op_list)
        finally:
            _STATE.depth -= 1
            for op, fn in zip(p2p_op_list, saved):
                op.op = fn

    return batch_isend_irecv


def _patch(module: Any, name: str, make: Callable[[Any], Any]) -> None:
    if not hasattr(module, name) or (module, name) in _ORIGINAL:
        return
    _ORIGINAL[(module, name)] = getattr(module, name)
    setattr(module, name, make(_ORIGINAL[(module, name)]))


def install() -> None:
    """Wrap the ``torch.distributed`` and functional-collective functions (idempotent; recording starts with
    :func:`start`). ``P2POp`` accepts the wrappers: its op check sees the originals."""
    for api in _P2P:
        _patch(dist, api, lambda f, api=api: _wrap(f, _p2p_recorder(api)))
    for api, spec in _C10D.items():
        _patch(dist, api, lambda f, api=api, spec=spec: _wrap(f, _collective_recorder(api, spec)))
    for api, spec in _FUNCOL.items():
        _patch(fc, api, lambda f, api=api, spec=spec: _wrap(f, _collective_recorder(api, spec)))
    _patch(dist, "batch_isend_irecv", _batch)
    _patch(c10d, "_check_op", lambda f: lambda op: f(_WRAPPERS.get(op, op)))


def uninstall() -> None:
    for (module, name), fn in reversed(list(_ORIGINAL.items())):
        setattr(module, name, fn)
    _ORIGINAL.clear()
    _WRAPPERS.clear()


# ------------------------------------------------------------------------------------ in a rank, in the parent
def start(rank: int, host: bool = True) -> Log:
    """Begin recording in this (forked) rank: wrap the functions and (``host``) enter the host-tensor mode, which
    costs about a sixth of a parity run's time (``assert_parity`` runs it where asked: ``host_check=True``)."""
    global _LOG
    install()
    _LOG = Log(rank)
    if host:
        HostTaint().__enter__()  # left on until the process exits (ranks end with os._exit)
    return _LOG


def expect_p2p(expected: bool = True) -> None:
    """Declare, in a rank, that the run must issue point-to-point ops (checked by :func:`verify`)."""
    if _LOG is not None:
        _LOG.meta["expect_p2p"] = _LOG.meta.get("expect_p2p", False) or expected


def mark(label: str) -> None:
    """Put a marker (e.g. a training step's start) into this rank's log; the rules skip it (see ``trim``)."""
    if _LOG is not None:
        _LOG.ops.append({"kind": "mark", "label": label})


def finish(directory: str) -> None:
    """Write this rank's log to ``directory/rank<r>.json``."""
    assert _LOG is not None
    with open(os.path.join(directory, f"rank{_LOG.rank}.json"), "w") as f:
        json.dump(_LOG.to_json(), f)


def load(directory: str) -> list[dict[str, Any]]:
    """The logs written by :func:`finish`, in rank order."""
    logs = []
    for path in glob.glob(os.path.join(directory, "rank*.json")):
        with open(path) as f:
            logs.append(json.load(f))
    return sorted(logs, key=lambda log: log["rank"])


def verify(logs: list[dict[str, Any]], world_size: int) -> dict[str, int]:
    """Raise ``AssertionError`` listing every violation of :func:`check`, a rank without a log, or a run that
    declared p2p (:func:`expect_p2p`) and recorded none; return the counts checked."""
    ops = [op for log in logs for op in log["ops"] if op["kind"] != "mark"]
    counts = {"ranks": len(logs), "p2p": sum(op["kind"] in ("send", "recv") for op in ops)}
    counts["collectives"] = len(ops) - counts["p2p"]
    problems = [] if len(logs) == world_size else [f"{world_size - len(logs)} of {world_size} ranks wrote no log"]
    problems += [
        f"the recorder failed on rank {log['rank']}: {e}" for log in logs for e in log["meta"].get("errors", [])
    ]
    if any(log["meta"].get("expect_p2p") for log in logs) and not counts["p2p"]:
        problems.append("the run declared point-to-point traffic but the recorder saw no p2p op")
    if not counts["collectives"] and not counts["p2p"]:
        problems.append("the recorder saw no communication at all (is it installed?)")
    problems += check(logs)
    print(f"comm_check: {counts['p2p']} p2p ops and {counts['collectives']} collectives on {len(logs)} ranks")
    if problems:
        raise AssertionError(
            f"NCCL communication check ({counts}): {len(problems)} violation(s):\n" + "\n".join(problems)
        )
    return counts
