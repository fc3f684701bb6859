"""The pieces of a mixture's balancing loss under a pipeline (lightning_parallel/pipeline/balancing.py): the family's
loss decomposed into per-call sums, the refusal of a family whose loss is another, and which schedules run every
forward before their first backward."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.anatomy import router_losses
from lightning_parallel.anatomy.router_losses import balancing_of, value
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.pipeline.schedules import build_schedule, forwards_first

transformers = pytest.importorskip("transformers")


def _mixtral(layers: int = 3) -> torch.nn.Module:
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, output_router_logits=True)  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def test_the_sums_of_every_call_give_the_familys_loss_in_any_grouping():
    """Three layers' logits, summed call by call and in two groups (two stages), equal the family's function on all
    of them, with and without a mask."""
    spec = balancing_of(_mixtral())
    assert spec is not None and spec.routers == 3 and spec.top_k == 2
    logits = tuple(torch.randn(10, 4, dtype=torch.float64) for _ in range(3))
    for mask in (None, (torch.arange(10) % 3 > 0).long().reshape(2, 5)):
        flat = None if mask is None else mask.reshape(-1)
        parts = [spec.sums(z, flat) for z in logits]
        stage = lambda ps: [sum(p[k] for p in ps) for k in range(3)]  # noqa: E731
        first, second = stage(parts[:2]), stage(parts[2:])
        got = value(*(a + b for a, b in zip(first, second)))
        want = spec.original(logits, 4, 2, mask)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_a_family_whose_loss_is_another_is_refused(monkeypatch):
    """A family function that is not the Switch form (here: squared) fails the comparison on random logits."""
    module = _mixtral()
    family = __import__(type(module).__module__, fromlist=["x"])
    original = family.load_balancing_loss_func
    monkeypatch.setattr(family, "load_balancing_loss_func", lambda *a, **k: original(*a, **k) ** 2)
    with pytest.raises(ConfigurationError, match="is not the Switch Transformer form"):
        router_losses.balancing_of(module)


@pytest.mark.parametrize(
    "name, microbatches, expected",
    [("gpipe", 4, True), ("1f1b", 1, True), ("1f1b", 2, False), ("interleaved_1f1b", 2, True),
     ("interleaved_1f1b", 4, False), ("zb_h1", 1, True), ("zb_h1", 4, False), ("zbv", 2, False)],
)  # fmt: skip
def test_which_schedules_run_every_forward_first(name, microbatches, expected):
    virtual = 2 if name in ("interleaved_1f1b", "zbv") else 1
    assert forwards_first(build_schedule(name, 2, microbatches, virtual)) is expected
