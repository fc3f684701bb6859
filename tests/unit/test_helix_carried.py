"""HelixPipe's cut of a block whose attention call reads a parameter (GPT-OSS's learned sinks, a logit per head):
the parameter is read before attention and carried to it with q, k, v (``Split.carried``), so the attention
stage holds no parameters. On one process, the parts reproduce the layer, output and every gradient (the
sinks' included, through the carried tensor); tests/strategies/test_families_2026.py trains it under helix."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import zoo

transformers = pytest.importorskip("transformers")


def _layer_and_call():
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    config = zoo.hf_config("gpt_oss", 64, 2)
    model = GptOssForCausalLM(config)  # float32: its experts' grouped GEMM takes no float64
    layer, seen = model.model.layers[1], {}  # a full-attention layer
    handle = layer.register_forward_pre_hook(lambda m, a, kw: seen.update(args=a, kwargs=kw), with_kwargs=True)
    model(torch.randint(0, 64, (2, 8)), use_cache=False)
    handle.remove()
    x, *args = seen["args"]
    return config, layer, x.detach(), tuple(args), seen["kwargs"]


def test_the_sinks_are_carried_to_the_attention_and_their_gradient_comes_back():
    from dataclasses import dataclass

    from lightning_parallel.anatomy.hugging_face import HuggingFaceAnatomy
    from lightning_parallel.anatomy.traced.analysis import analyse
    from lightning_parallel.anatomy.traced.regions import split

    config, layer, x, args, kwargs = _layer_and_call()
    program = HuggingFaceAnatomy(config, (x, args, kwargs), family_level=True).routed_trace(layer, x, args, kwargs)

    @dataclass
    class _Config:
        mlp_chunks: int = 1
        mlp_module: str | None = None

    parts = split(program, analyse(program), _Config(), "GptOssDecoderLayer")
    assert parts.carried == 1 and "self_attn.sinks" in parts.pre_parameters
    xs = x.clone().requires_grad_(True)
    inputs, state = parts.pre(layer, xs, args, kwargs)
    sent = [t.detach().requires_grad_(True) for t in inputs]  # what the attention stage receives
    assert sent[3].shape == layer.self_attn.sinks.shape
    sinks = layer.self_attn.sinks  # the attention stage holds no parameters: the sinks it reads are the carried
    layer.self_attn.sinks = torch.nn.Parameter(torch.empty(sinks.shape, device="meta"))
    out = parts.attend(layer, tuple(sent), args, kwargs)
    layer.self_attn.sinks = sinks
    y = parts.post(layer, out, state, args, kwargs)
    y = y if isinstance(y, torch.Tensor) else y[0]
    grad = torch.randn_like(y)
    y.backward(grad)
    torch.autograd.backward(list(inputs), [t.grad for t in sent])  # the gradients sent back, on the pre stage
    got = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    xr = x.clone().requires_grad_(True)
    want = layer(xr, *args, **kwargs)
    want = want if isinstance(want, torch.Tensor) else want[0]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    want.backward(grad)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-6)
    assert got["self_attn.sinks"].abs().sum() > 0
    for name, p in layer.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
