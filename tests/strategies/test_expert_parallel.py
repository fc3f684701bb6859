"""Expert parallelism (``expert_parallel_size=``) under real Lightning Trainers: parity with one process for
transformers' mixtures, the experts each rank holds, and the refusals (lightning_parallel/expert_parallel.py,
strategies/_experts.py). float64: the experts run by transformers' ``batched_mm`` (``grouped_mm`` takes no float64 on
CPU), as in one process."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_parallel import HybridParallelStrategy
from lightning_parallel.errors import ConfigurationError
from tests.helpers.parity import assert_parity

pytest.importorskip("transformers")


def _ep2(dp: int = 2) -> object:
    return lambda: HybridParallelStrategy(data_parallel_size=dp, expert_parallel_size=2)


class _HoldsItsExperts(L.Callback):
    """Each rank holds num_experts / ep of every experts module, as DTensors sharded by expert."""

    def on_train_start(self, trainer, pl_module):
        sharded = [p for n, p in pl_module.named_parameters() if ".experts." in n and isinstance(p, DTensor)]
        assert sharded, "no expert was sharded"
        for p in sharded:
            assert p.to_local().shape[0] * 2 == p.shape[0], (tuple(p.to_local().shape), tuple(p.shape))


@pytest.mark.parametrize(
    ("row", "dtype"),
    [("hf:mixtral@batched_mm", "float64"), ("hf:qwen3_moe@batched_mm", "float64"), ("hf:gpt_oss@eager", "float64"),
     # DeepSeek-V3's router computes its logits in float32 whatever the model's dtype (F.linear on .float()
     # copies), so no layout that splits its batch matches one process at float64's 1e-9, plain dp included:
     # the contract's float32 tier (SGD, 1e-5), with transformers' default grouped_mm experts
     ("hf:deepseek_v3", "float32")],
)  # fmt: skip
def test_ep2_trains_as_one_process(row, dtype):
    assert_parity(row, _ep2(), 2, data_parallel_size=2, dtype=dtype, callbacks=lambda: [_HoldsItsExperts()])


def test_ep2_over_four_replicas_with_clipping_trains_as_one_process():
    """dp=4 = 2 replicas of an ep group of 2: an expert's gradient is its group's, averaged over the replicas;
    clipping counts every expert once."""
    assert_parity("hf:mixtral@batched_mm", _ep2(4), 4, data_parallel_size=4, optimizer="sgd", gradient_clip_val=0.05)


def test_ep_must_divide_the_data_parallel_ranks():
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 must divide data_parallel_size=3"):
        L.Trainer(accelerator="cpu", devices=3, strategy=HybridParallelStrategy(expert_parallel_size=2))


def test_ep_with_tensor_parallelism_is_refused_for_now():
    strategy = HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=2)
    with pytest.raises(ConfigurationError, match=r"expert_parallel_size=2 and tensor_parallel_size=2 is not supported"):
        L.Trainer(accelerator="cpu", devices=4, strategy=strategy)


def test_a_model_without_experts_is_refused_on_every_rank():
    with pytest.raises(Exception, match=r"expert_parallel_size=2 found no experts in GPT"):
        assert_parity("gpt", _ep2(), 2, data_parallel_size=2, steps=1)


def test_a_bad_size_is_refused_when_the_strategy_is_built():
    with pytest.raises(ValueError, match=r"expert_parallel_size must be a positive int, got 0"):
        HybridParallelStrategy(expert_parallel_size=0)


# ------------------------------------------------------------------------------------------ checkpoints
MOE = "hf:qwen3_moe@batched_mm"


def test_a_checkpoint_holds_each_expert_whole_and_loads_at_any_ep(tmp_path):
    """Saved at ep=2, the checkpoint equals one saved at plain dp=2 (each expert once, whole, in order, with its
    AdamW state); it loads into one process, and dp=2's loads at ep=2."""
    from lightning_parallel.checkpoint import load_sharded
    from tests.strategies.test_checkpoints import _assert_close, _run

    ep2, dp2 = str(tmp_path / "ep2.ckpt"), str(tmp_path / "dp2.ckpt")
    _run("dp2ep2", 2, ckpt_out=ep2, model=MOE)
    _run("dp2", 2, ckpt_out=dp2, model=MOE)
    saved, reference = load_sharded(ep2), load_sharded(dp2)
    experts = [k for k in reference["state_dict"] if k.endswith("experts.gate_up_proj")]
    assert experts and all(saved["state_dict"][k].shape == reference["state_dict"][k].shape for k in experts)
    _assert_close(saved["state_dict"], reference["state_dict"], "ep=2 checkpoint vs dp=2")
    _assert_close(saved["optimizer_states"][0]["state"], reference["optimizer_states"][0]["state"], "AdamW state")
    for source, target in ((ep2, "one"), (dp2, "dp2ep2")):
        _, _, params, optimizer = _run(target, 3, ckpt_in=source, model=MOE)
        _assert_close(params, {k: v for k, v in reference["state_dict"].items() if k in params}, target)
        _assert_close(optimizer, reference["optimizer_states"][0]["state"], f"{target}: AdamW state")


def test_resume_at_ep2_continues_the_straight_run_exactly(tmp_path):
    from tests.strategies.test_checkpoints import _assert_close, _run

    kw = dict(model=MOE, epoch_end=True)
    straight, final, _, _ = _run("dp2ep2", 8, ckpt_out=str(tmp_path / "straight.ckpt"), **kw)
    ckpt = str(tmp_path / "epoch.ckpt")
    first, _, _, _ = _run("dp2ep2", 4, ckpt_out=ckpt, **kw)
    second, resumed, _, _ = _run("dp2ep2", 8, ckpt_in=ckpt, ckpt_out=str(tmp_path / "resumed.ckpt"), **kw)
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight), rtol=1e-9, atol=1e-12)
    _assert_close(resumed, final, "parameters after step 8")


# ------------------------------------------------------------------------------------------ grad_norm
def _norms(rank, world, ep, norm_type):
    from tests.helpers.parity import PRECISION, _OneReplicaSampler, build
    from tests.strategies.test_grad_norm import Norms

    module, data = build(MOE, 8 // world, "sgd")
    norms = Norms(norm_type)
    strategy = HybridParallelStrategy(data_parallel_size=world, expert_parallel_size=ep) if ep else "auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=2, precision=PRECISION["float64"],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[norms] + ([] if ep else [_OneReplicaSampler()]),
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return norms.seen


@pytest.mark.parametrize("norm_type", [2, "inf"])
def test_grad_norm_counts_every_expert_once(norm_type):
    """``strategy.grad_norm`` at ep=2 is one device's ``grad_norm``: each expert module's norm combines its ranks'
    experts, the total counts each once."""
    from tests.helpers.distributed import run_distributed

    want = _norms(0, 1, 0, norm_type)
    for got in run_distributed(_norms, 2, 2, norm_type, init_process_group=False):
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            assert g.keys() == w.keys() and any("experts" in k for k in w)
            for k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-9, abs=1e-12), k
