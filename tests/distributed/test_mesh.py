"""ParallelDims.build_mesh on real gloo ranks: groups match the coordinates ParallelDims computes."""

import torch
import torch.distributed as dist

from lightning_parallel.mesh import AXES, ParallelDims
from tests.helpers.distributed import run_distributed


def _mesh_groups(rank, world_size):
    dims = ParallelDims.resolve(world_size, pp=2)
    mesh = dims.build_mesh("cpu")
    out = {"coord": {a: mesh.get_local_rank(a) for a in AXES}, "groups": {}}
    for axis in AXES:
        group = mesh.get_group(axis)
        members = torch.zeros(world_size, dtype=torch.long)
        members[rank] = 1
        dist.all_reduce(members, group=group)
        out["groups"][axis] = members.nonzero().flatten().tolist()
    return out


def test_mesh_on_four_ranks():
    results = run_distributed(_mesh_groups, 4)
    dims = ParallelDims.resolve(4, pp=2)
    for rank, got in enumerate(results):
        assert got["coord"] == dims.coordinate(rank)
    assert results[0]["groups"]["dp"] == [0, 2] and results[0]["groups"]["pp"] == [0, 1]
    assert results[3]["groups"]["dp"] == [1, 3] and results[3]["groups"]["pp"] == [2, 3]
    assert results[1]["groups"]["tp"] == [1]


def _wrong_world(rank, world_size):
    ParallelDims.resolve(2).build_mesh("cpu")


def test_mesh_size_mismatch_raises_before_any_collective():
    import pytest

    from tests.helpers.distributed import RankFailed

    with pytest.raises(RankFailed, match="needs 2 ranks, but the process group has 4"):
        run_distributed(_wrong_world, 4)
