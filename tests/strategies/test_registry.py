"""Strategy names resolve after ``import lightning_parallel``; bad input raises clear errors."""

import subprocess
import sys

import lightning as L
import pytest

from lightning_parallel import HybridParallelStrategy


def test_hybrid_name_resolves_to_the_strategy():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="hybrid", logger=False)
    assert isinstance(trainer.strategy, HybridParallelStrategy)


@pytest.mark.slow  # (time: 7 s, a fresh interpreter)
def test_name_is_unknown_until_the_package_is_imported():
    code = (
        "import lightning as L\n"
        "try:\n    L.Trainer(accelerator='cpu', strategy='hybrid')\nexcept ValueError as e:\n    print('before:', e)\n"
        "import lightning_parallel\n"
        "print('after:', type(L.Trainer(accelerator='cpu', strategy='hybrid', logger=False).strategy).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "before: You selected an invalid strategy name: `strategy='hybrid'`" in out
    assert "after: HybridParallelStrategy" in out


def test_unknown_strategy_name():
    with pytest.raises(ValueError, match="invalid strategy name: `strategy='hybrd'`"):
        L.Trainer(accelerator="cpu", strategy="hybrd")


def test_world_size_mismatch_fails_when_the_trainer_is_built():
    with pytest.raises(ValueError, match="data_parallel_size=4 does not divide world size 2"):
        L.Trainer(accelerator="cpu", devices=2, strategy=HybridParallelStrategy(data_parallel_size=4))
    with pytest.raises(ValueError, match=r"data_parallel_size=2 \* .* = 2, but the world size is 4"):
        L.Trainer(accelerator="cpu", devices=4, strategy=HybridParallelStrategy(data_parallel_size=2))


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5])
def test_invalid_size_fails_at_construction(bad):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive int or 'auto'"):
        HybridParallelStrategy(data_parallel_size=bad)


def test_sampler_ranks_follow_the_data_parallel_coordinate():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="hybrid", logger=False)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
