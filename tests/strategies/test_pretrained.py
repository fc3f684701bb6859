"""Loading a Hugging Face ``save_pretrained`` directory into a placed, deferred model: every layout ends with
exactly the saved values, each rank reading only what it holds."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy, load_pretrained
from lightning_parallel.errors import ConfigurationError
from tests.helpers.distributed import run_distributed
from tests.helpers.models import DeferredHFCausalLM
from tests.helpers.parity import build

LAYOUTS = {
    "one": (lambda: "auto", 1),
    "pp2": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=2), 2),
    "helix2": (lambda: HelixParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), 2),
    "tp2": (lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 2),
    "dp2full": (lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="full"), 2),
}


def _saved(family: str, directory: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    model = DeferredHFCausalLM(family, vocab_size=build("gpt", 4, "adamw")[1].vocab_size)._make()
    model.save_pretrained(directory)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Loading(DeferredHFCausalLM):
    def __init__(self, family: str, vocab_size: int, directory: str) -> None:
        super().__init__(family, vocab_size=vocab_size)
        self.directory, self.loaded = directory, None

    def on_fit_start(self) -> None:
        self.unused = load_pretrained(self.model, self.directory, self.trainer)
        deferred = getattr(self.trainer.strategy, "_deferred", None)  # ours: blocks awaiting their first call
        pending = deferred.blocks if deferred is not None else []  # (read then)
        self.pending = (len(pending), all(t.is_meta for b in pending for t in b.state_dict().values()))

    def on_train_start(self) -> None:  # before any step: what the load left, gathered whole by name
        strategy = self.trainer.strategy
        if hasattr(strategy, "gather_named_parameters"):
            self.loaded = strategy.gather_named_parameters()
        else:
            self.loaded = {n: p.detach().clone() for n, p in self.named_parameters()}


def _counting_reads() -> list[str]:
    """Record the keys ``load_pretrained`` reads (``safetensors.safe_open(...).get_tensor``) in this process."""
    import safetensors

    real, reads = safetensors.safe_open, []

    class Counting:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            reads.append(key)
            return self.inner.get_tensor(key)

    safetensors.safe_open = Counting
    return reads


def _fit(rank, world_size, layout, family, directory):
    reads = _counting_reads()
    make, _ = LAYOUTS[layout]
    data = build("gpt", 4, "adamw")[1]
    module = _Loading(family, data.vocab_size, directory)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=make(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return module.loaded, module.unused, list(reads), module.pending


@pytest.mark.parametrize(  # GPT-2 beyond one process and pp2: slow tier (time); Llama loads into every layout fast
    "layout,family",
    [pytest.param(k, f, marks=pytest.mark.slow) if f == "gpt2" and k not in ("one", "pp2") else (k, f)
     for f in ("llama", "gpt2") for k in LAYOUTS],
)  # fmt: skip
def test_a_save_pretrained_directory_loads_into_every_layout(layout, family, tmp_path):
    want = _saved(family, str(tmp_path))
    world = LAYOUTS[layout][1]
    if world == 1:
        ranks = [_fit(0, 1, layout, family, str(tmp_path))]
    else:
        ranks = run_distributed(_fit, world, layout, family, str(tmp_path), init_process_group=False)
    loaded, unused, _, _ = ranks[0]
    assert unused == []
    for _, _, reads, (pending, on_meta) in ranks:
        assert len(reads) == len(set(reads))  # each tensor read once
        if layout in ("tp2", "helix2"):  # the blocks stay on meta through the load, each reads its keys later
            assert pending == 8 and on_meta, (pending, on_meta)  # all 8 layers
        if layout == "pp2":  # a stage reads its own blocks only (and the tensors outside the trunk)
            assert len({k.split(".")[2] for k in reads if ".layers." in k or ".h." in k}) == 4, sorted(reads)
    names = {n.removeprefix("model.") for n in loaded}
    assert names <= set(want) and len(names) == len(loaded)
    for name, value in loaded.items():
        key = name.removeprefix("model.")
        torch.testing.assert_close(
            value.to(want[key].dtype), want[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}"
        )


def test_a_directory_without_a_tensor_of_the_model_or_with_another_shape_is_refused(tmp_path):
    _saved("llama", str(tmp_path))
    vocab = build("gpt", 4, "adamw")[1].vocab_size
    model = DeferredHFCausalLM("llama", vocab_size=vocab)._make()
    model.model.norm.weight2 = torch.nn.Parameter(torch.ones(3))  # a tensor the directory lacks
    with pytest.raises(ConfigurationError, match=r"lacks 1 tensor.*model\.norm\.weight2"):
        load_pretrained(model, str(tmp_path))
    other = DeferredHFCausalLM("llama", vocab_size=vocab + 8)._make()
    with pytest.raises(ConfigurationError, match=r"'lm_head.weight' has shape \(\d+, 32\), the model's"):
        load_pretrained(other, str(tmp_path))


def test_a_model_still_on_meta_or_a_tied_pair_stored_twice_with_two_values_is_refused(tmp_path):
    _saved("llama", str(tmp_path))
    vocab = build("gpt", 4, "adamw")[1].vocab_size
    with torch.device("meta"):
        early = DeferredHFCausalLM("llama", vocab_size=vocab)._make()
    with pytest.raises(ConfigurationError, match="on the meta device.*not placed yet.*on_fit_start"):
        load_pretrained(early, str(tmp_path))  # e.g. called in configure_model
    tied = DeferredHFCausalLM("llama", vocab_size=vocab)._make()
    tied.lm_head.weight = tied.model.embed_tokens.weight  # the directory holds two different matrices
    with pytest.raises(ConfigurationError, match="one \\(tied\\) parameter of the model but hold different values"):
        load_pretrained(tied, str(tmp_path))


def _load_mid_step(rank, world_size, directory):
    data = build("gpt", 4, "adamw")[1]

    class LoadsLate(_Loading):
        def on_fit_start(self) -> None:
            pass

        def on_train_batch_start(self, batch, batch_idx) -> None:
            if batch_idx == 1:  # the second of two accumulated batches: the step's whole copies are in the module
                load_pretrained(self.model, self.directory, self.trainer)

    module = LoadsLate("llama", data.vocab_size, directory)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=LAYOUTS["pp2"][0](), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, accumulate_grad_batches=2,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)


def test_loading_during_a_pipeline_step_is_refused(tmp_path):
    from tests.helpers.distributed import RankFailed

    _saved("llama", str(tmp_path))
    with pytest.raises(RankFailed, match="during a pipeline training step or evaluation loop"):
        run_distributed(_load_mid_step, 2, str(tmp_path), init_process_group=False, timeout=60)
