"""``configure_model`` on the meta device (the default of every strategy here): a model's own initialisation written
there is replayed per tensor as one process's (``lightning_parallel.init_replay``), or refused where it cannot be;
weights loaded there (``from_pretrained``, ``load_state_dict``) are refused, and ``configure_model_on_meta=False``
keeps them as on one device (docs/design.md, "Deferred initialisation")."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.models import DeferredGPT
from tests.helpers.parity import assert_parity


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


OWN_INIT_LAYOUTS = {
    "pipeline pp=2": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), 2, 1),
    "helix p=2": (lambda: HelixParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), 2, 1),
    "tensor_parallel tp=2": (lambda: HybridParallelStrategy(tensor_parallel_size=2, data_parallel_size=1), 2, 1),
    "sequence_parallel sp=2": (lambda: HybridParallelStrategy(sequence_parallel_size=2, data_parallel_size=1), 2, 1),
    "hybrid dp=2 full": (lambda: HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding="full"), 2, 2),
}


@pytest.mark.parametrize("layout", list(OWN_INIT_LAYOUTS))
def test_a_models_own_initialisation_in_configure_model_is_one_processs(layout):
    """nanoGPT's ``self.apply(self._init_weights)``, ``nn.init`` on named parameters, ``trunc_normal_``,
    ``orthogonal_``, ``.data`` and item writes in ``configure_model`` (tests/helpers/models.py, OwnInitGPT) run on
    meta and are replayed per tensor: the initial parameters equal one process's eager build (float64, compared by
    the parity helper before any step), and training follows."""
    strategy, world, dp = OWN_INIT_LAYOUTS[layout]
    assert_parity("gpt-own-init", strategy, world, data_parallel_size=dp)


class _DrawsFromItsOwnGenerator(DeferredGPT):
    """An initialisation drawing from a generator of its own: replaying it would draw from it a second time."""

    def configure_model(self) -> None:
        if not hasattr(self, "lm_head"):
            self._build()
            g = torch.Generator().manual_seed(5)
            torch.nn.init.normal_(self.transformer.h[0].mlp.c_fc.weight, std=0.02, generator=g)


def _fit_own_generator(rank, world_size):
    from examples.data import CharDataModule
    from tests.helpers.trainers import quick_fit

    torch.manual_seed(0)
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2)
    quick_fit(_DrawsFromItsOwnGenerator(n_layer=2), CharDataModule(block_size=16, batch_size=4, shuffle=False),
              strategy, world_size)  # fmt: skip


def test_an_initialisation_that_cannot_be_replayed_is_refused_naming_the_line():
    """A call the tape cannot replay exactly is refused, naming the user's line and the ways that work (here on
    rank 0, the stage holding block 0)."""
    with pytest.raises(RankFailed) as failed:
        run_distributed(_fit_own_generator, 2, init_process_group=False)
    text = str(failed.value)
    assert "explicit generator=" in text and "test_configure_model.py" in text, text[-2000:]
    assert "configure_model_on_meta=False" in text
