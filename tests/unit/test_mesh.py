"""ParallelDims: every resolution and validation rule, without a process group."""

import pytest

from lightning_parallel.mesh import AXES, ParallelDims


def test_auto_dp_takes_the_rest():
    assert ParallelDims.resolve(8, pp=2, tp=2) == ParallelDims(dp=2, pp=2, sp=1, tp=2)
    assert ParallelDims.resolve(4) == ParallelDims(dp=4, pp=1, sp=1, tp=1)


def test_any_single_axis_may_be_auto():
    assert ParallelDims.resolve(8, dp=2, pp="auto", sp=2) == ParallelDims(dp=2, pp=2, sp=2, tp=1)
    assert ParallelDims.resolve(6, dp=3, tp="auto") == ParallelDims(dp=3, pp=1, sp=1, tp=2)


def test_explicit_sizes_must_multiply_to_world_size():
    assert ParallelDims.resolve(4, dp=2, pp=2).world_size == 4
    with pytest.raises(
        ValueError, match=r"data_parallel_size=1 \* pipeline_parallel_size=2.* = 2, but the world size is 4"
    ):
        ParallelDims.resolve(4, dp=1, pp=2)
    with pytest.raises(ValueError, match=r"pass devices=2 \(on one node\)"):  # the devices= that fits
        ParallelDims.resolve(4, dp=1, pp=2)


def test_size_that_does_not_divide_world_size():
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 does not divide world size 4"):
        ParallelDims.resolve(4, pp=3)


def test_product_that_does_not_divide_world_size():
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size=2 \* .*tensor_parallel_size=4 = 8 does not divide world size 4"
    ):
        ParallelDims.resolve(4, pp=2, tp=4)
    with pytest.raises(ValueError, match=r"= 4 does not divide world size 6.*devices=4 on one node"):
        ParallelDims.resolve(6, pp=2, sp=2)


def test_the_log_line_names_the_sizes_and_the_sequence_parallel_mode():
    from lightning_parallel import HybridParallelStrategy

    for mode, named in (("ulysses", "Ulysses (all-to-all"), ("ring", "ring attention")):
        strategy = HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2, sequence_parallel_mode=mode)
        line = strategy._layout_line(ParallelDims(dp=1, pp=1, sp=2, tp=1))
        assert "dp=1 pp=1 sp=2 tp=1 on 2 processes" in line and named in line, line


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_invalid_sizes(bad):
    with pytest.raises(ValueError, match=r"sequence_parallel_size must be a positive int or 'auto'"):
        ParallelDims.resolve(4, sp=bad)


def test_at_most_one_auto():
    with pytest.raises(
        ValueError,
        match=r"at most one parallel size may be 'auto'.*data_parallel_size='auto', tensor_parallel_size='auto'",
    ):
        ParallelDims.resolve(4, tp="auto")


@pytest.mark.parametrize("world_size", [0, -2, 2.0])
def test_invalid_world_size(world_size):
    with pytest.raises(ValueError, match="world size must be a positive int"):
        ParallelDims.resolve(world_size)


def test_coordinates_are_row_major_with_tp_innermost():
    dims = ParallelDims(dp=2, pp=2, sp=1, tp=2)
    coords = [dims.coordinate(r) for r in range(8)]
    assert coords[0] == dict(dp=0, pp=0, sp=0, tp=0)
    assert coords[1] == dict(dp=0, pp=0, sp=0, tp=1)
    assert coords[2] == dict(dp=0, pp=1, sp=0, tp=0)
    assert coords[7] == dict(dp=1, pp=1, sp=0, tp=1)
    assert len({tuple(c.values()) for c in coords}) == 8
    with pytest.raises(ValueError, match="global rank 8 is outside world size 8"):
        dims.coordinate(8)


def test_shape():
    dims = ParallelDims.resolve(8, pp=2, sp=2)
    assert dims.shape == (2, 2, 2, 1) and AXES == ("dp", "pp", "sp", "tp")


def test_build_mesh_rejects_bad_device_type():
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda', got 'tpu'"):
        ParallelDims.resolve(1).build_mesh("tpu")
