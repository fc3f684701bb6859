"""The NCCL communication checker (``tests/helpers/comm_rules.py``, ``comm_check.py``, ``comm_taint.py``): each rule
on small hand-made logs (failing and passing), on logs recorded from the package at 94be0c3 (``tests/fixtures/comm``,
``record.py`` there re-records them), and the host-tensor mode, in process. The recorder on forked gloo ranks:
``tests/distributed/test_comm_recorder.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import comm_check, comm_taint
from tests.helpers.comm_rules import check, collective_order, cyclic_waits, host_tensors, p2p_matching

pytestmark = pytest.mark.timeout(60)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "comm"


def _fixture(name: str) -> list[dict[str, Any]]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _op(
    kind: str,
    peer: int | None = None,
    tag: int = 0,
    nbytes: int | None = 8,
    group: str = "0",
    dtype: str | None = "float64",
    **kw: Any,
) -> dict:
    return dict(kind=kind, group=group, peer=peer, tag=tag, bytes=nbytes, dtype=dtype, site="here", **kw)


def _logs(*ops_by_rank: list[dict], groups: dict[str, list[int]] | None = None) -> list[dict[str, Any]]:
    groups = groups or {"0": list(range(len(ops_by_rank)))}
    return [dict(rank=r, groups=groups, meta={}, ops=ops) for r, ops in enumerate(ops_by_rank)]


# ------------------------------------------------------------------------------ the old code (94be0c3)
def test_zbv_sends_an_activation_into_a_gradient_receive_of_the_same_size():
    problems = p2p_matching(_fixture("zbv_pp2"))
    swaps = [p for p in problems if p.startswith("silent swap")]
    assert len(swaps) == 2, problems
    assert all(p.count("8192 B float64") == 2 for p in swaps), swaps
    assert "rank 0 send->1 tag 145 8192 B" in swaps[0] and "rank 1 recv<-0 tag 35 8192 B" in swaps[0]
    assert any(p.startswith("size mismatch") and "88 B int64" in p and "8 B float64" in p for p in problems)


def test_helix_folds1_receives_ahead_out_of_order_and_in_cycles():
    logs = _fixture("helix_pp2_folds1")
    mismatches = [p for p in p2p_matching(logs) if p.startswith("size mismatch")]
    assert len(mismatches) == 2, mismatches
    assert "send->1 tag 177 32768 B" in mismatches[0] and "recv<-0 tag 53 49152 B" in mismatches[0]
    for eager in (False, True):  # the receives posted ahead wait on each other at any message size
        (cycle,) = cyclic_waits(logs, eager=eager)
        assert cycle.startswith("cyclic wait") and "post_recv_packed" in cycle, cycle


def test_1f1b_both_stages_send_before_receiving():
    logs = _fixture("1f1b_pp2")
    assert p2p_matching(logs) == [] and collective_order(logs) == []
    (cycle,) = cyclic_waits(logs)
    assert cycle.startswith("cyclic wait (rendezvous model") and "pair stream 0<->1 of group 0" in cycle, cycle
    assert "rank 0 send->1" in cycle and "rank 1 send->0" in cycle
    assert cyclic_waits(logs, eager=True) == []  # small messages are buffered: only large ones hang


def test_old_headers_and_flags_are_host_tensors():
    found = host_tensors(_fixture("host_1f1b_pp2"))
    made_at = {p.split("created on the host at ")[1].split(" (NCCL")[0] for p in found}
    assert "lightning_parallel/_collectives.py:111 (isend_with_header)" in made_at, found
    assert "lightning_parallel/_collectives.py:343 (any_over_group)" in made_at, found
    assert any(p.startswith("host tensor: all_reduce at lightning_parallel/_collectives.py:345") for p in found)


# ------------------------------------------------------------------------------------ each rule by hand
def test_matching_ignores_tags_and_compares_sizes_and_counts():
    sends = [_op("send", 1, tag=1, nbytes=8), _op("send", 1, tag=2, nbytes=8), _op("send", 1, tag=3, nbytes=16)]
    recvs = [_op("recv", 0, tag=2, nbytes=8), _op("recv", 0, tag=1, nbytes=8), _op("recv", 0, tag=3, nbytes=32)]
    problems = p2p_matching(_logs(sends, recvs))
    assert [p.split(":")[0] for p in problems] == ["silent swap", "silent swap", "size mismatch"], problems
    assert p2p_matching(_logs(sends, recvs[:2]))[0].startswith("count mismatch: group 0, rank 0 -> rank 1: 3 sends")


def test_unbatched_cross_sends_wait_on_each_other_only_for_large_messages():
    logs = _logs([_op("send", 1), _op("recv", 1)], [_op("send", 0), _op("recv", 0)])
    assert cyclic_waits(logs)[0].startswith("cyclic wait (rendezvous")
    assert cyclic_waits(logs, eager=True) == []


def test_receives_posted_before_sends_wait_at_any_size():
    logs = _logs([_op("recv", 1), _op("send", 1)], [_op("recv", 0), _op("send", 0)])
    assert cyclic_waits(logs, eager=True)[0].startswith("cyclic wait (eager")


def test_a_batch_runs_its_sends_and_receives_together():
    logs = _logs([_op("send", 1, batch=1), _op("recv", 1, batch=1)], [_op("send", 0, batch=1), _op("recv", 0, batch=1)])
    assert check(logs) == []


def test_a_batch_queues_behind_its_groups_collectives():
    reduce = _op("all_reduce", nbytes=8)
    logs = _logs([_op("send", 1, batch=1), reduce], [reduce, _op("recv", 0, batch=1)])
    (cycle,) = cyclic_waits(logs)
    assert "group 0's stream" in cycle and "(batch 1)" in cycle, cycle
    assert cyclic_waits(logs, eager=True) == []  # a small send is buffered, the collective goes on


def test_directions_on_two_groups_with_the_same_members_never_wait():
    """Messages to the higher rank on group 1, to the lower on group 2: two communicators, two streams, so both
    ranks may send first. This is the layout that passes."""
    groups = {"0": [0, 1], "1": [0, 1], "2": [0, 1]}
    rank0 = [_op("send", 1, group="1"), _op("send", 1, group="1"), _op("recv", 1, group="2"), _op("all_reduce")]
    rank1 = [_op("send", 0, group="2"), _op("recv", 0, group="1"), _op("recv", 0, group="1"), _op("all_reduce")]
    logs = _logs(rank0, rank1, groups=groups)
    assert check(logs) == [] and cyclic_waits(logs, eager=True) == []
    same_group = _logs([dict(op, group="0") for op in rank0], [dict(op, group="0") for op in rank1], groups=groups)
    assert cyclic_waits(same_group)  # on one communicator the same order waits


def test_collective_order_compares_kind_size_and_dtype_but_not_object_payloads():
    bookkeeping = [_op("all_gather_object", nbytes=None, dtype=None), _op("barrier", nbytes=None)]
    a = [*bookkeeping, _op("all_reduce", nbytes=8), _op("broadcast", nbytes=88)]
    assert check(_logs(a, [dict(op) for op in a])) == []
    problems = collective_order(_logs(a, [*bookkeeping, _op("broadcast", nbytes=88), _op("all_reduce", nbytes=8)]))
    assert problems and problems[0].startswith("collective order: group 0 [0, 1], collective #2"), problems
    assert collective_order(_logs(a, a[:3]))[-1].endswith("rank 0 issues 4 collectives, rank 1 3")


def test_host_rule_reports_each_place_once():
    op = _op("all_reduce", host="lightning_parallel/x.py:3 (f)")
    (line,) = host_tensors(_logs([op, op], [op, op]))
    assert "created on the host at lightning_parallel/x.py:3 (f)" in line and "4 op(s), ranks [0, 1]" in line


def test_verify_fails_a_run_that_recorded_nothing_it_expected():
    silent = _logs([_op("all_reduce")], [_op("all_reduce")])
    silent[0]["meta"]["expect_p2p"] = True
    with pytest.raises(AssertionError, match="declared point-to-point traffic but the recorder saw no p2p op"):
        comm_check.verify(silent, 2)
    with pytest.raises(AssertionError, match="no communication at all"):
        comm_check.verify(_logs([], []), 2)
    with pytest.raises(AssertionError, match="1 of 2 ranks wrote no log"):
        comm_check.verify(_logs([_op("barrier", nbytes=None)]), 2)
    broken = _logs([_op("barrier", nbytes=None)], [_op("barrier", nbytes=None)])
    broken[1]["meta"]["errors"] = ["isend: KeyError('group')"]
    with pytest.raises(AssertionError, match=r"the recorder failed on rank 1: isend: KeyError\('group'\)"):
        comm_check.verify(broken, 2)


# ------------------------------------------------------------------------------ the host-tensor mode
def test_host_taint_follows_factories_of_the_package_only(monkeypatch):
    monkeypatch.setattr(comm_taint, "package_dir", str(Path(__file__).parent) + os.sep)  # this file is "the package"
    taint, device = comm_taint.TAINT, torch.ones(4)
    with comm_taint.HostTaint():
        host = torch.zeros(4, dtype=torch.int64)
        assert host in taint and "test_comm_check.py" in taint[host]
        assert host.double()[1:] in taint and host.reshape(2, 2) in taint and device + host in taint
        assert torch.zeros(4, device=device.device) not in taint and torch.zeros_like(device) not in taint
        assert torch.zeros(4, device=None) in taint and ~host in taint and host.new_zeros(2, device="cpu") not in taint
        assert device.cpu() in taint  # .cpu() from the package
        assert device * torch.tensor(2.0) not in taint  # a CPU scalar meets a device tensor: a device result
        target = torch.empty(4, device=device.device)
        target.copy_(host.double())  # an in-place copy keeps the target's device
        assert target not in taint and torch.as_tensor(device) not in taint
        assert host.double().to(device.device) not in taint and host.double().to(device) not in taint
        assert host.double().to(torch.float32) in taint  # a cast alone stays on the host
    assert torch.zeros(3) not in taint  # the mode is off
