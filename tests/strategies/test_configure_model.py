"""What ``configure_model`` on the meta device (the default of every strategy here) refuses, because set-up would
lose it: weights loaded there (``from_pretrained``, ``load_state_dict``) and a model's own initialisation written
there outside ``reset_parameters()``; and ``configure_model_on_meta=False``, which keeps both as on one device
(docs/design.md, "Deferred initialisation")."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_parallel import PipelineParallelStrategy
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.models import DeferredGPT


class _LoadsInConfigureModel(L.LightningModule):
    """A Hugging Face model loaded in ``configure_model``, as users write it: ``from_pretrained`` or a
    ``load_state_dict`` of saved weights into a model built there."""

    def __init__(self, directory: str, how: str) -> None:
        super().__init__()
        self.directory, self.how = directory, how

    def configure_model(self) -> None:
        import transformers

        if hasattr(self, "model"):
            return
        if self.how == "from_pretrained":
            self.model = transformers.AutoModelForCausalLM.from_pretrained(self.directory)
        else:
            from safetensors.torch import load_file

            config = transformers.AutoConfig.from_pretrained(self.directory)
            self.model = transformers.AutoModelForCausalLM.from_config(config)
            self.model.load_state_dict(load_file(f"{self.directory}/model.safetensors"), strict=False)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.model(input_ids=idx).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_loading(rank, world_size, directory, how, on_meta):
    from examples.data import CharDataModule
    from tests.helpers.trainers import quick_fit

    module = _LoadsInConfigureModel(directory, how)
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, configure_model_on_meta=on_meta)
    trainer = quick_fit(module, CharDataModule(block_size=16, batch_size=4, shuffle=False), strategy, world_size)
    state = trainer.strategy.full_state_dict()  # on every rank; rank 0 gets the whole model
    return state["model.model.embed_tokens.weight"].clone() if rank == 0 else None


@pytest.fixture
def saved_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=65, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    return str(tmp_path), model


@pytest.mark.parametrize("how", ["from_pretrained", "load_state_dict"])
def test_weights_loaded_in_configure_model_are_refused_naming_load_pretrained(saved_llama, how):
    directory, _ = saved_llama
    with pytest.raises(RankFailed, match=r"would be lost\. Build the model there without weights .*load_pretrained"):
        run_distributed(_fit_loading, 2, directory, how, True, init_process_group=False)


def test_configure_model_on_meta_false_builds_and_loads_as_on_one_device(saved_llama):
    directory, model = saved_llama
    first = run_distributed(_fit_loading, 2, directory, "from_pretrained", False, init_process_group=False)[0]
    # the loaded weights trained one step (SGD): they moved, from the saved ones, not from a fresh init
    saved = model.model.embed_tokens.weight.detach()
    assert not torch.equal(first, saved) and (first - saved).abs().max() < 0.1


class _InitialisesInConfigureModel(DeferredGPT):
    """nanoGPT's way: the modules built, then the model's own initialisation applied to them."""

    def configure_model(self) -> None:
        if not hasattr(self, "lm_head"):
            self._build()
            self.apply(self._init_weights)


def _fit_initialising(rank, world_size, on_meta):
    from examples.data import CharDataModule
    from tests.helpers.trainers import quick_fit

    torch.manual_seed(0)
    module = _InitialisesInConfigureModel(n_layer=2)
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, configure_model_on_meta=on_meta)
    trainer = quick_fit(module, CharDataModule(block_size=16, batch_size=4, shuffle=False), strategy, world_size)
    state = trainer.strategy.full_state_dict()  # on every rank; rank 0 gets the whole model
    return float(state["transformer.wpe.weight"].std()) if rank == 0 else None


def test_a_models_own_initialisation_in_configure_model_is_refused_on_meta_never_lost():
    """On meta, ``self.apply(self._init_weights)`` writes nothing and set-up would initialise with
    ``reset_parameters()`` instead: refused on every rank, naming the line and the ways that keep it."""
    with pytest.raises(RankFailed) as failed:
        run_distributed(_fit_initialising, 2, True, init_process_group=False)
    text = str(failed.value)
    assert "wrote initial values into parameters that set-up will not write again" in text
    assert "gpt.py" in text and "_init_weights" in text, text[:2000]
    assert "reset_parameters()" in text and "configure_model_on_meta=False" in text
    # configure_model_on_meta=False keeps the model's own initialisation (nanoGPT's std 0.02 for wpe, not N(0, 1))
    std = run_distributed(_fit_initialising, 2, False, init_process_group=False)[0]
    assert 0.015 < std < 0.025, std


class _WritesThroughData(DeferredGPT):
    """An initialisation written through ``.data`` (the old idiom): a plain tensor by then, which the watch of
    parameters did not see, so the values were lost silently (the run trained from reset_parameters()'s)."""

    def configure_model(self) -> None:
        if not hasattr(self, "lm_head"):
            self._build()
            for p in self.parameters():
                p.data.normal_(0.0, 0.02)


def _fit_writing_data(rank, world_size):
    from examples.data import CharDataModule
    from tests.helpers.trainers import quick_fit

    torch.manual_seed(0)
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2)
    quick_fit(_WritesThroughData(n_layer=2), CharDataModule(block_size=16, batch_size=4, shuffle=False), strategy,
              world_size)  # fmt: skip


def test_an_initialisation_through_data_is_refused_too():
    with pytest.raises(RankFailed) as failed:
        run_distributed(_fit_writing_data, 2, init_process_group=False)
    text = str(failed.value)
    assert "wrote initial values into parameters that set-up will not write again" in text, text[-2000:]
    assert "test_configure_model.py" in text and "normal_" in text
