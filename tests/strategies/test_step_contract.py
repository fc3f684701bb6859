"""Lightning's step contract under pipeline and helix: a dict returned by ``training_step``
reaches ``on_train_batch_end`` with every key, each value what one device gives (scalars: the batch's mean over
the micro-batches; per-sample tensors: the batch's rows, in order), on every rank; a step that returns ``None``
(on one device Lightning skips that batch) is refused with an error that names it."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_parallel import HelixParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import RankFailed, run_distributed

STRATEGIES = {
    "1f1b": lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2),
    "helix": lambda: HelixParallelStrategy(pipeline_parallel_size=2, folds=1),
}


def _module(returns: str) -> L.LightningModule:
    from examples.models import GPT
    from tests.helpers.parity import MODEL_KWARGS

    class Extras(GPT):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            idx, targets = batch
            logits = self(idx)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            if returns == "none" and batch_idx == 1:
                return None
            first = logits[:, 0, :4].detach()  # per sample
            return {"loss": loss, "first_logits": first, "mean_logit": logits.detach().mean()}

    return Extras(vocab_size=65, block_size=16, **dict(MODEL_KWARGS["gpt"], n_layer=4, lr=0.05, optimizer="sgd"))


class Outputs(L.Callback):
    def __init__(self) -> None:
        self.outputs: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.outputs.append({k: v.detach().cpu().clone() for k, v in outputs.items()})


def _fit(strategy: object, devices: int, returns: str = "dict") -> list[dict]:
    from tests.helpers.zoo import CharDataModule

    torch.manual_seed(0)
    module, outputs = _module(returns), Outputs()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[outputs], use_distributed_sampler=False, precision="64-true")  # fmt: skip
    trainer.fit(module, datamodule=CharDataModule(block_size=16, batch_size=4, shuffle=False))
    return outputs.outputs


def _rank(rank: int, world: int, layout: str, returns: str) -> list[dict]:
    return _fit(STRATEGIES[layout](), world, returns)


@pytest.mark.parametrize("layout", list(STRATEGIES))
def test_every_key_of_a_returned_dict_reaches_on_train_batch_end(layout):
    want = _fit("auto", 1)
    for got in run_distributed(_rank, 2, layout, "dict", init_process_group=False, timeout=120):
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            assert g.keys() == w.keys() == {"loss", "first_logits", "mean_logit"}, g.keys()
            for key in w:
                torch.testing.assert_close(g[key], w[key], rtol=1e-9, atol=1e-12, msg=key)


@pytest.mark.parametrize("layout", list(STRATEGIES))
def test_a_step_that_returns_none_is_refused_naming_it(layout):
    with pytest.raises(RankFailed) as failed:
        run_distributed(_rank, 2, layout, "none", init_process_group=False, timeout=120)
    assert "training_step returned None" in str(failed.value), str(failed.value)[-2000:]
