"""Expert parallelism (``expert_parallel_size=``) under real Lightning Trainers: parity with one process for
transformers' mixtures, the experts each rank holds, and the refusals (lightning_parallel/expert_parallel.py,
strategies/_experts.py). float64: the experts run by transformers' ``batched_mm`` (``grouped_mm`` takes no float64 on
CPU), as in one process."""

from __future__ import annotations

import lightning as L
import pytest
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
