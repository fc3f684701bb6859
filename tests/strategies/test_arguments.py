"""Every strategy accepts only what it honours: an argument that would be ignored in the
resolved layout is refused when the Trainer is built, naming the argument and what would make it count."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy


@pytest.mark.parametrize(
    "kwargs,ignored",
    [
        (dict(schedule="interleaved_1f1b"), "schedule"),
        (dict(virtual_stages=2), "virtual_stages"),
        (dict(layers_per_stage=[1, 3]), "layers_per_stage"),
        (dict(schedule="interleaved_1f1b", virtual_stages=2, layers_per_stage=[1, 3]), "schedule, virtual_stages"),
    ],
)
def test_helix_refuses_pipeline_only_arguments(kwargs, ignored):
    with pytest.raises(ValueError, match=rf"helix does not take {ignored}.*strategy='pipeline'"):
        HelixParallelStrategy(pipeline_parallel_size=2, **kwargs)


@pytest.mark.parametrize(
    "kwargs,arg,size_arg",
    [
        (dict(tp_plan={"attn.c_attn": "colwise_qkv"}), "tp_plan", "tensor_parallel_size"),
        (dict(tp_sequence_parallel=True), "tp_sequence_parallel", "tensor_parallel_size"),
        (dict(sequence_parallel_mode="ring"), "sequence_parallel_mode", "sequence_parallel_size"),
        (
            dict(data_parallel_sharding="optimizer", data_parallel_size=1, tensor_parallel_size=2),
            "data_parallel_sharding",
            "data_parallel_size",
        ),
    ],
)
def test_arguments_without_effect_in_the_layout_are_refused(kwargs, arg, size_arg):
    kwargs.setdefault("data_parallel_size", 2)
    with pytest.raises(ValueError, match=rf"{arg} was given, but {size_arg} resolves to 1 .*set {size_arg} > 1"):
        L.Trainer(accelerator="cpu", devices=2, strategy=HybridParallelStrategy(**kwargs), logger=False)


def test_recompute_every_n_needs_every_n():
    with pytest.raises(ValueError, match=r"recompute_every_n=3 applies to recompute='every_n' only"):
        HybridParallelStrategy(recompute="full", recompute_every_n=3)


@pytest.mark.slow  # (time: 8 s, a LightningCLI process; the README demo runs helix from YAML fast)
def test_helix_config_offers_no_pipeline_schedule_arguments():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "examples.train", "fit", "--config", "examples/configs/helix.yaml", "--print_config"]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "class_path: lightning_parallel.HelixParallelStrategy" in out.stdout
    for arg in ("schedule:", "virtual_stages:", "layers_per_stage:"):
        assert arg not in out.stdout, arg
