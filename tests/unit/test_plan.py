"""The planner: a profile of a tiny model, every layout predicted and ranked, the published-GPU cost model's
trend, and the command line end to end (its YAML trains as it is under LightningCLI)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from examples.models import GPT
from lightning_parallel.plan import GPUS, LINKS, Layout, Problem, candidates, combine, predict, profile, published_costs

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
    h = costs.helix
    assert h is not None and costs.helix_refused == ""  # GPT's block has a verified split
    for part in (h.pre, h.attention, h.post, h.pre_grad, h.attention_grad, h.post_grad):
        assert part(128) > 0
    assert h.qkv_bytes(128) == pytest.approx(4 * 128 * 32 * 4)  # q, k, v and the residual
    assert h.out_bytes(128) == pytest.approx(2 * 128 * 32 * 4)  # the attention output and the residual
    for policy in ("none", "selective", "no_attention", "full"):
        for action in (costs.forward, costs.backward, costs.input_grad, costs.weight_grad):
            assert action[policy](128) > 0
    assert costs.pack(h.qkv_bytes(128)) > 0
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


def test_helix_with_tp_or_sp_and_full_sharding_are_ranked(costs):
    """Helix with tensor and sequence parallelism and full sharding are planned: helix x tp and x sp (messages and work divided), full
    sharding (blocks' parameters, gradients and state divided by dp, FSDP2's gathers in the actions)."""
    problem = Problem(costs, 128, global_batch=8, link=LINKS["cpu"], optimizer="adamw")
    ranked = candidates(problem, 4, policies=("none",), heads=2)
    names = {pr.layout.name() for pr in ranked}
    assert {"dp1 pp2 tp2 sp1 helix f1 m4 rc=none", "dp1 pp2 tp1 sp2 helix f1 m4 rc=none"} <= names
    assert "dp2 full pp1 tp2 sp1 1f1b m4 rc=none" in names
    assert not any(pr.layout.sharding == "full" and pr.layout.schedule in ("helix", "zb_h1", "zbv") for pr in ranked)
    helix = predict(problem, Layout(pp=2, schedule="helix", microbatches=4))
    helix_tp = predict(problem, Layout(pp=2, tp=2, schedule="helix", microbatches=4))
    assert max(helix_tp.peak_memory.values()) < max(helix.peak_memory.values())
    plain = predict(problem, Layout(dp=2, pp=1, tp=2, microbatches=4))
    full = predict(problem, Layout(dp=2, pp=1, tp=2, microbatches=4, sharding="full"))
    assert max(full.peak_memory.values()) < max(plain.peak_memory.values())
    with pytest.raises(ValueError, match="data_parallel_sharding='full' needs dp > 1 and neither helix"):
        predict(problem, Layout(dp=2, pp=2, schedule="helix", microbatches=4, sharding="full"))


def test_published_costs_give_helix_a_gain_that_grows_with_the_sequence():
    gpu = GPUS["h20"]
    gains = []
    for seq_len in (16384, 65536, 131072):
        problem = Problem(published_costs(4096, 32, 32, 32000, gpu), seq_len, global_batch=16, link=LINKS["nvlink"])
        layouts = [
            Layout(pp=8, schedule=s, microbatches=16, recompute=r) for s in ("1f1b", "zb_h1") for r in ("none", "full")
        ]
        baselines = [predict(problem, lay) for lay in layouts]
        helix = predict(problem, Layout(pp=8, schedule="helix", microbatches=16, folds=2, recompute="no_attention"))
        gains.append(min(b.step_time for b in baselines) / helix.step_time - 1)
        spread = lambda pr: max(pr.step_memory.values()) / min(pr.step_memory.values())  # noqa: E731
        # flat across stages: within 10 % (stages 1..p-1 hold, at the turn, the packed copy of their last message
        # of each micro-batch, of one size or the other), where 1F1B's first stage holds p micro-batches
        assert spread(helix) < 1.10 and spread(helix) < spread(baselines[0]) - 0.1, (
            spread(helix),
            spread(baselines[0]),
        )
    assert gains == sorted(gains) and gains[-1] > 0, gains


@pytest.mark.slow  # (time: 19 s) the planner's functions are tested fast above; this runs its command line
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


def test_fit_keeps_every_coefficient_non_negative():
    from lightning_parallel.plan.costs import fit

    concave = fit([256, 512, 1024], [1.0, 1.8, 3.0], 2)  # a least-squares quadratic would bend down
    assert all(c >= 0 for c in concave.coef) and len(concave.coef) == 2  # the quadratic term dropped
    assert concave(4096) > concave(1024)  # and so never predicts less work for a longer sequence
    exact = fit([1, 2, 3], [1.0 + 2 + 3, 1.0 + 4 + 12, 1.0 + 6 + 27], 2)
    assert exact.coef == pytest.approx([1.0, 2.0, 3.0])


def test_combine_takes_the_median_of_every_measurement(costs):
    import copy
    import dataclasses

    slow, fast = copy.deepcopy(costs), copy.deepcopy(costs)
    for run, factor in ((slow, 3.0), (fast, 0.5)):
        run.samples = [
            dataclasses.replace(s, forward={p: v * factor for p, v in s.forward.items()}) for s in run.samples
        ]
    combined = combine([slow, costs, fast])
    for t in (32, 64, 128):
        assert combined.forward["none"](t) == pytest.approx(costs.forward["none"](t))
    assert combined.helix is not None and combined.kept["full"](128) == pytest.approx(costs.kept["full"](128))


def _link(rank, world_size):
    import torch.distributed as dist

    from lightning_parallel.plan.hardware import measure_collectives, measure_link

    link = measure_link(1 - rank, repeats=4)
    return link.bandwidth, link.latency, link.rendezvous, measure_collectives(dist.group.WORLD, repeats=3)


def test_measure_link_times_the_runtimes_messages_between_two_ranks():
    from tests.helpers.distributed import run_distributed

    results = run_distributed(_link, 2)
    for bandwidth, latency, rendezvous, collectives in results:
        assert 1e7 < bandwidth < 1e12 and 0.0 <= latency < 0.1 and rendezvous
        for ring_bandwidth, ring_latency in collectives.values():
            assert 1e7 < ring_bandwidth < 1e12 and 0.0 <= ring_latency < 0.1
    for name, fitted in results[0][3].items():  # the slowest rank's times: both ranks fit the same
        assert fitted == pytest.approx(results[1][3][name], rel=1e-9)


def test_measure_link_fits_every_size_and_never_returns_an_absurd_bandwidth(monkeypatch):
    from lightning_parallel.plan import links
    from lightning_parallel.plan.hardware import measure_link

    linear = {256: 4e-4 + 256 / 2e9, 1 << 20: 4e-4 + (1 << 20) / 2e9, 1 << 22: 4e-4 + (1 << 22) / 2e9}
    monkeypatch.setattr(links, "receive_time", lambda peer, n, repeats, group: linear[n])
    link = measure_link(1)
    assert link.bandwidth == pytest.approx(2e9) and link.latency == pytest.approx(4e-4)
    noisy = {256: 3e-3, 1 << 20: 2e-3, 1 << 22: 2.5e-3}  # the large message faster than the small one
    monkeypatch.setattr(links, "receive_time", lambda peer, n, repeats, group: noisy[n])
    link = measure_link(1)
    assert link.bandwidth == pytest.approx((1 << 22) / 3e-3) and link.latency == 0.0


def test_measure_collectives_fits_the_all_reduce_and_the_all_gather_apart(monkeypatch):
    """gloo's all-gather moves fewer bytes per second than its all-reduce: the two are fitted apart, and a link
    carrying both prices the reduce-scatter and all-gather of full sharding by the all-gather's fit."""
    from lightning_parallel.plan import links
    from lightning_parallel.plan.hardware import Link, measure_collectives

    truth = {"collective": Link(1e9, 2e-4), "gather": Link(2e8, 5e-4), "exchange": Link(3e8, 7e-4)}  # a step each
    times = {"all_reduce": truth["collective"].all_reduce, "all_gather": truth["gather"].all_gather,
             "all_to_all": truth["exchange"].all_to_all}  # fmt: skip
    monkeypatch.setattr(links, "collective_time", lambda kind, n, repeats, group: times[kind](n, 2))
    fits = measure_collectives(None)
    for name, link in truth.items():
        assert fits[name] == pytest.approx((link.bandwidth, link.latency))
    link = Link(5e9, 1e-5, **fits)
    assert link.all_reduce(1 << 22, 4) == pytest.approx(truth["collective"].all_reduce(1 << 22, 4))
    assert link.all_gather(1 << 22, 4) == pytest.approx(truth["gather"].all_gather(1 << 22, 4))
    assert link.all_to_all(1 << 22, 4) == pytest.approx(truth["exchange"].all_to_all(1 << 22, 4))
    assert Link(5e9, 1e-5, collective=fits["collective"]).all_gather(1 << 22, 4) < link.all_gather(1 << 22, 4)


# ------------------------------------------------------------------------------ a mixture of experts
@pytest.fixture(scope="module")
def moe_costs():
    from tests.helpers.zoo import HomeLM

    torch.manual_seed(0)
    model = HomeLM("moe", vocab_size=32)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 32, (2, 65), generator=g)
    return model, profile(model, (data[:, :-1], data[:, 1:]), [16, 32, 64], repeats=1)


def test_expert_parallel_layouts_are_ranked_with_their_memory_and_exchange(moe_costs):
    """A home-written mixture (4 experts, top-2): the profile counts its experts' bytes, their number and the rows
    each token sends; ep layouts are ranked, hold 1/ep of the experts' parameters, gradients and AdamW state, and
    pay two all-to-alls of the rows per block and direction."""
    from lightning_parallel.plan.output import strategy_config
    from lightning_parallel.plan.predict import expert_exchange

    model, costs = moe_costs
    experts = costs.experts
    block = model.stack[0]
    assert experts is not None and experts.num_experts == 4 and experts.rows_per_token == pytest.approx(2.0)
    assert experts.parameter_bytes == sum(p.numel() * 4 for p in block.moe.experts.parameters())
    problem = Problem(costs, 64, global_batch=8, link=LINKS["cpu"], optimizer="adamw")
    ranked = candidates(problem, 4, policies=("none",), heads=4)
    assert {pr.layout.ep for pr in ranked} == {1, 2, 4}
    assert any(pr.layout.ep == 2 and pr.layout.sp == 2 for pr in ranked)  # ep over the sequence shards too
    dp, ep = (predict(problem, Layout(dp=2, pp=1, microbatches=1, ep=e)) for e in (1, 2))
    # parameters, gradients and AdamW's two moments: (1 + 1 + 2) x half the experts' bytes per block, fewer
    saved = costs.num_blocks * experts.parameter_bytes / 2 * (1 + 1 + 2)
    assert max(dp.peak_memory.values()) - max(ep.peak_memory.values()) == pytest.approx(saved)
    exchange = expert_exchange(problem, Layout(dp=2, pp=1, microbatches=1, ep=2), costs.hidden_bytes(64) * 4)
    assert exchange > 0 and ep.comm_bytes > dp.comm_bytes
    forward = lambda pr: pr.cost(pr.schedule[0][0])  # noqa: E731  (the one stage's first action: F)
    assert forward(ep) - forward(dp) == pytest.approx(costs.num_blocks * exchange)
    assert strategy_config(ep.layout)["init_args"]["expert_parallel_size"] == 2
    with pytest.raises(ValueError, match=r"ep 4 must divide dp x sp = 2 and 4 experts"):
        predict(problem, Layout(dp=2, pp=1, microbatches=1, ep=4))
    with pytest.raises(ValueError, match=r"needs a mixture of experts in the block"):
        predict(Problem(_gpt_costs(), 64, global_batch=8, link=LINKS["cpu"]), Layout(dp=2, pp=1, microbatches=1, ep=2))


def _gpt_costs():
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=64, n_layer=2, n_head=2, n_embd=32)
    data = torch.randint(0, 32, (2, 65), generator=torch.Generator().manual_seed(1))
    return profile(model, (data[:, :-1], data[:, 1:]), [16, 32], repeats=1)


@pytest.mark.parametrize(
    ("row", "rows"),
    [("hf:mixtral@batched_mm", 2.0), pytest.param("hf:llama4", 4.0, marks=pytest.mark.slow),
     pytest.param("hf:deepseek_v3", 2.0, marks=pytest.mark.slow)],
)  # fmt: skip
def test_the_profile_counts_a_transformers_mixtures_experts_and_rows(row, rows):
    """Mixtral routes each token to 2 of its 4 experts; Llama 4's dense experts take every token (4 rows);
    DeepSeek-V3's first block is dense (first_k_dense_replace=1): the experts are its next block's, in a share of
    the blocks."""
    import importlib

    from lightning_parallel.trunk import discover_trunk, prepare_model
    from tests.helpers.parity import build

    pytest.importorskip("transformers")
    module, data = build(row, 2, "sgd")
    prepare_model(module)  # (as profile() does: the KV cache off)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    trunk = discover_trunk(module)
    experts = importlib.import_module("lightning_parallel.plan.profile")._experts(module, trunk, batch, 8)
    dense = [i for i, b in enumerate(trunk.blocks) if not any(".experts." in n for n, _ in b.named_parameters())]
    block = trunk.blocks[len(dense)]
    stacked = [p for n, p in block.named_parameters() if ".experts." in n and p.shape[0] == 4 and p.dim() == 3]
    assert experts is not None and experts.num_experts == 4 and experts.rows_per_token == pytest.approx(rows)
    assert experts.parameter_bytes == sum(p.numel() * p.element_size() for p in stacked) > 0
    assert experts.share == pytest.approx(1 - len(dense) / len(trunk)) and experts.in_profiled == (not dense)
    assert dense == ([0] if row == "hf:deepseek_v3" else [])
