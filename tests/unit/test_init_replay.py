"""The tape of ``configure_model`` on meta (``lightning_parallel.init_replay``): every tensor it covers replays to
exactly the value an eager build gives, alone (its slice of the program), and the generator ends where the eager
build leaves it; a draw that depends on values is refused, not replayed differently."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_parallel.errors import ConfigurationError
from lightning_parallel.init_replay import InitTape

CPU = torch.device("cpu")


class _Idioms(nn.Module):
    """Initialisation idioms in one model: constructors' resets, ``apply``, ``nn.init`` by name, ``trunc_normal_``
    and ``orthogonal_`` (which return at once on meta), ``.data``, item writes, a tie, a computed buffer, a
    parameter made from ``torch.randn``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 16)
        self.h = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
                               for _ in range(2))  # fmt: skip
        self.head = nn.Linear(16, 50, bias=False)
        self.wte.weight = self.head.weight
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), persistent=False)
        self.pos = nn.Parameter(torch.randn(1, 8, 16) * 0.02)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("3.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(4))
        nn.init.trunc_normal_(self.h[0][1].weight, std=0.02)
        nn.init.orthogonal_(self.h[1][1].weight)
        self.h[1][3].weight.data.normal_(0, 0.5)
        with torch.no_grad():
            self.h[1][3].bias[:4] = 1.0

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0, 0.02)


def _recorded(build) -> tuple[nn.Module, InitTape, torch.Tensor]:
    torch.manual_seed(3)
    start = torch.get_rng_state()
    with torch.device("meta"), InitTape() as tape:
        meta = build()
    return meta, tape, start


def test_every_tensor_replays_to_the_eager_value_and_the_generator_ends_where_eager_leaves_it():
    torch.manual_seed(3)
    eager = _Idioms()
    after_eager = torch.get_rng_state()
    meta, tape, start = _recorded(_Idioms)
    tape.close(CPU, start)
    assert torch.equal(torch.get_rng_state(), after_eager)
    torch.manual_seed(99)  # a value does not depend on the generator's state when it is asked for
    want = eager.state_dict(keep_vars=True)
    for name, t in meta.state_dict(keep_vars=True).items():
        assert tape.covers(t), name
        assert torch.equal(tape.value(t, CPU), want[name].detach()), name


def test_a_tensor_replays_its_own_slice_only():
    """One linear layer's weight replays the calls on its storage (its allocation, its reset, the model's init),
    not the other tensors' (the whole program has many times as many calls)."""
    meta, tape, start = _recorded(_Idioms)
    tape.close(CPU, start)
    weight = meta.h[0][3].weight
    calls = tape._slice(weight.untyped_storage()._cdata)
    assert 2 <= len(calls) <= 8 < len(tape.calls) // 4, (len(calls), len(tape.calls))


class _PoissonInit(nn.Module):
    """Poisson draws: how many numbers they take from the generator depends on the rates, which the tape's
    throw-away run does not have (it runs on zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        with torch.no_grad():
            self.weight.copy_(torch.poisson(torch.full((4, 4), 30.0)))


def test_a_draw_that_depends_on_values_is_refused():
    meta, tape, start = _recorded(_PoissonInit)
    tape.close(CPU, start)
    with pytest.raises(ConfigurationError, match="depend on the values it reads"):
        tape.value(meta.weight, CPU)


def test_a_tensor_made_outside_the_tape_is_refused():
    outside = torch.ones(4, device="meta")

    def build() -> nn.Module:
        m = nn.Module()
        m.weight = nn.Parameter(torch.empty(4))
        with torch.no_grad():
            m.weight.copy_(outside * 2)
        return m

    meta, tape, start = _recorded(build)
    tape.close(CPU, start)
    with pytest.raises(ConfigurationError, match="made outside configure_model"):
        tape.value(meta.weight, CPU)


class _Reseeds(nn.Module):
    """``torch.manual_seed`` in the build: before any draw (exact: the state it sets is the eager build's), or after
    one (the state the eager build draws from next includes draws meta skipped)."""

    def __init__(self, after_a_draw: bool) -> None:
        super().__init__()
        if not after_a_draw:
            torch.manual_seed(7)
        self.a = nn.Linear(4, 4)
        if after_a_draw:
            torch.manual_seed(7)
        self.b = nn.Linear(4, 4)


def test_a_reseed_before_any_draw_is_replayed_after_one_refused():
    torch.manual_seed(3)
    eager = _Reseeds(after_a_draw=False)
    meta, tape, start = _recorded(lambda: _Reseeds(after_a_draw=False))
    tape.close(CPU, start)
    for name, t in meta.state_dict(keep_vars=True).items():
        assert torch.equal(tape.value(t, CPU), eager.state_dict()[name]), name
    meta, tape, start = _recorded(lambda: _Reseeds(after_a_draw=True))
    tape.close(CPU, start)
    with pytest.raises(ConfigurationError, match="changes torch's generator at .*test_init_replay.py"):
        tape.value(meta.b.weight, CPU)
