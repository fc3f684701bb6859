"""The planner: a profile of a tiny model, every layout predicted and ranked, the published-GPU cost model's
trend, and the command line end to end (its YAML trains as it is under LightningCLI)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from examples.models import GPT
from lightning_parallel.plan import GPUS, LINKS, Layout, Problem, candidates, predict, profile, published_costs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def costs():
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=128, n_layer=4, n_head=2, n_embd=32)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 32, (2, 129), generator=g)
    return profile(model, (data[:, :-1], data[:, 1:]), [32, 64, 128], repeats=1)


def test_profile_measures_each_part_and_fits_in_the_length(costs):
    assert costs.num_blocks == 4 and costs.dtype_bytes == 4
    assert costs.hidden_bytes(128) == pytest.approx(128 * 32 * 4)  # one sequence's hidden state, fp32
    for part in (costs.pre, costs.attention, costs.post, costs.pre_grad, costs.attention_grad, costs.weight_grad):
        assert part(128) > 0
    kept = {p: costs.kept[p](128) for p in ("none", "selective", "no_attention", "full")}
    assert kept["none"] > kept["selective"] > kept["no_attention"] > kept["full"] > 0, kept
    assert costs.block_parameter_bytes == sum(
        p.numel() * 4 for p in GPT(32, 128, 4, 2, 32).transformer.h[0].parameters()
    )


def test_every_layout_is_predicted_ranked_and_checked(costs):
    problem = Problem(costs, 128, global_batch=8, link=LINKS["cpu"], optimizer="sgd")
    ranked = candidates(problem, 4, policies=("none", "full"), heads=2)
    times = [pr.step_time for pr in ranked]
    assert times == sorted(times) and times[0] > 0
    assert {pr.layout.schedule for pr in ranked} == {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "helix"}
    assert {pr.layout.dp for pr in ranked} == {1, 2, 4} and {pr.layout.tp for pr in ranked} >= {1, 2}
    for pr in ranked:
        assert pr.layout.devices == 4
        assert all(0.0 <= b <= 1.0 for b in pr.bubble.values())
        assert all(pr.peak_memory[s] > pr.step_memory[s] > 0 for s in pr.bubble)
    one = predict(problem, Layout(pp=2, schedule="1f1b", microbatches=4))
    full = predict(problem, Layout(pp=2, schedule="1f1b", microbatches=4, recompute="full"))
    assert max(full.step_memory.values()) < max(one.step_memory.values())  # recomputation keeps less
    with pytest.raises(ValueError, match="m % \\(pp \\* folds\\) == 0"):
        predict(problem, Layout(pp=2, schedule="helix", microbatches=2, folds=2))
    with pytest.raises(ValueError, match="does not split into dp 2 x m 3"):
        predict(problem, Layout(dp=2, pp=2, schedule="1f1b", microbatches=3))
    few = candidates(problem, 2, memory=max(one.peak_memory.values()) * 0.9)
    assert all(max(pr.peak_memory.values()) <= max(one.peak_memory.values()) * 0.9 for pr in few)


def test_published_costs_give_helix_a_gain_that_grows_with_the_sequence():
    gpu = GPUS["h20"]
    gains = []
    for seq_len in (16384, 65536, 131072):
        problem = Problem(published_costs(4096, 32, 32, 32000, gpu), seq_len, global_batch=16, link=LINKS["nvlink"])
        layouts = [
            Layout(pp=8, schedule=s, microbatches=16, recompute=r) for s in ("1f1b", "zb_h1") for r in ("none", "full")
        ]
        best_baseline = min(predict(problem, lay).step_time for lay in layouts)
        helix = predict(problem, Layout(pp=8, schedule="helix", microbatches=16, folds=2, recompute="no_attention"))
        gains.append(best_baseline / helix.step_time - 1)
        memory = list(helix.step_memory.values())
        assert max(memory) / min(memory) < 1.05  # flat across stages
    assert gains == sorted(gains) and gains[-1] > 0, gains


def test_command_line_writes_a_plan_that_trains(tmp_path):
    out, timeline, chart = tmp_path / "plan.yaml", tmp_path / "timeline.png", tmp_path / "chart.png"
    cmd = [sys.executable, "-m", "lightning_parallel.plan", "--config", "examples/configs/demo.yaml",
           "--cli", "examples.train:CLI", "--devices", "2", "--memory", "4GiB", "--top", "5",
           "--out", str(out), "--timeline", str(timeline), "--chart", str(chart)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| 1 | " in run.stdout and timeline.stat().st_size > 0 and chart.stat().st_size > 0
    plan = yaml.safe_load(out.read_text())
    assert plan["trainer"]["devices"] == 2
    assert plan["trainer"]["strategy"]["class_path"].startswith("lightning_parallel.")
    assert plan["model"] == yaml.safe_load((ROOT / "examples/configs/demo.yaml").read_text())["model"]
    train = [sys.executable, "-m", "examples.train", "fit", "--config", str(out), "--trainer.max_steps=3",
             f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_val_batches=0"]  # fmt: skip
    run = subprocess.run(train, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
