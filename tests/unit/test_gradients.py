"""The gradient recipe's norm rule (lightning_parallel.strategies.gradients.counts_in_norm): each element of the
model is counted on exactly one rank. The sync itself is checked by every parity test."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from lightning_parallel.mesh import ParallelDims
from lightning_parallel.strategies._stage_local import OuterShards
from lightning_parallel.strategies.gradients import GradientPlan, counts_in_norm


def _plan(dp: int = 1, tp: int = 1, pp: int = 1, at: dict | None = None, mode: str = "replicate", outer=None):
    coordinate = {"dp": 0, "pp": 0, "sp": 0, "tp": 0, **(at or {})}
    return GradientPlan(ParallelDims(dp=dp, pp=pp, sp=1, tp=tp), coordinate, {}, mode, None, outer)


def test_a_replicated_parameter_counts_on_tp_rank_0_only():
    p = nn.Parameter(torch.ones(3))
    assert counts_in_norm(_plan(tp=2), p)
    assert not counts_in_norm(_plan(tp=2, at={"tp": 1}), p)


def test_what_fsdp2_does_not_hold_counts_on_dp_rank_0_only():
    p = nn.Parameter(torch.ones(3))  # a plain parameter: FSDP2 did not shard it
    assert counts_in_norm(_plan(dp=2, mode="full"), p)
    assert not counts_in_norm(_plan(dp=2, mode="full", at={"dp": 1}), p)
    assert counts_in_norm(_plan(dp=2, at={"dp": 1}), p)  # replicated gradients: the norm does not sum over dp


def test_a_whole_parameter_inside_a_zero_window_counts_on_dp_rank_0_only():
    scalar = nn.Parameter(torch.ones(()))
    window = SimpleNamespace(open=True, is_whole=lambda t: t is scalar)
    assert not counts_in_norm(_plan(dp=2, mode="optimizer", at={"dp": 1}), scalar, [window])
    assert counts_in_norm(_plan(dp=2, mode="optimizer"), scalar, [window])
    closed = SimpleNamespace(open=False, is_whole=lambda t: True)
    assert counts_in_norm(_plan(dp=2, mode="optimizer", at={"dp": 1}), scalar, [closed])


def test_a_pre_or_post_trunk_parameter_counts_where_its_stages_say():
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 3))  # the embedding outside the trunk, a block inside
    embedding, block = model[0].weight, model[1].weight
    outer = OuterShards()
    outer.attach(model, frozenset({"0.weight"}), stage=1, loss_stage=1)  # nothing sharded: whole on every stage
    assert outer.counted_here(block) is None and outer.whole() == [embedding]
    assert not counts_in_norm(_plan(pp=2, outer=outer), embedding)  # counted on the first stage, not this one
    assert counts_in_norm(_plan(pp=2, outer=outer), block)  # not an outer parameter: the tp rule alone
    outer.attach(model, frozenset({"0.weight"}), stage=0, loss_stage=1)
    assert counts_in_norm(_plan(pp=2, outer=outer), embedding)
    assert not counts_in_norm(_plan(pp=2, tp=2, outer=outer, at={"tp": 1}), embedding)
