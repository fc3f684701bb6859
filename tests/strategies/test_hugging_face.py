"""Unchanged Hugging Face models (LlamaForCausalLM, GPT2LMHeadModel; small configs, no download) under
the pipeline and HelixPipe strategies, against single-process training."""

import pytest
import torch

from lightning_parallel import HelixParallelStrategy, PipelineParallelStrategy
from lightning_parallel.anatomy import adapter_split
from lightning_parallel.anatomy.adapters import matching_adapters
from lightning_parallel.anatomy.verify import verify_split
from tests.helpers.parity import assert_parity

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("model", ["hf-llama", "hf-gpt2"])
def test_pipeline_1f1b_pp2(model):
    assert_parity(
        model, lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), 2, data_parallel_size=1
    )


@pytest.mark.parametrize("model", ["hf-llama", "hf-gpt2"])
def test_helix_p2(model):
    assert_parity(model, lambda: HelixParallelStrategy(pipeline_parallel_size=2), 2, data_parallel_size=1)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf-llama", "hf-gpt2"])
@pytest.mark.parametrize("folds,recompute", [(1, "none"), (2, "no_attention")])
def test_helix_p4(model, folds, recompute):
    assert_parity(
        model,
        lambda: HelixParallelStrategy(pipeline_parallel_size=4, folds=folds, recompute=recompute),
        4,
        data_parallel_size=1,
    )


def test_adapters_verify_on_real_hf_blocks():
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=40,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    x = torch.randn(2, 8, 32)
    position_ids = torch.arange(8)[None].expand(2, 8)
    cos_sin = llama.model.rotary_emb(x, position_ids)
    block = llama.model.layers[0]
    (adapter,) = matching_adapters(block)
    verify_split(adapter_split(adapter, block), block, x, (), {"position_embeddings": cos_sin, "attention_mask": None})
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0)
    )
    block = gpt2.transformer.h[0]
    (adapter,) = matching_adapters(block)
    assert adapter.name == "nanogpt"
    verify_split(adapter_split(adapter, block), block, x, (), {"attention_mask": None})
