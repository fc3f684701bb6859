"""Trunk discovery, block placement and micro-batching, without a process group."""

import pytest
import torch
from torch import nn

from examples.models import GPT, EncoderClassifier, Llama
from lightning_parallel.pipeline.placement import place_blocks
from lightning_parallel.strategies.microbatches import split_microbatches
from lightning_parallel.trunk import discover_trunk, free_blocks, parameter_bytes
from tests.helpers.models import HFStyleDecoder


@pytest.mark.parametrize(
    "model,path,hidden",
    [
        (GPT(n_layer=3), "transformer.h", "x"),
        (Llama(n_layer=3), "layers", "x"),
        (EncoderClassifier(num_layers=3), "encoder.layers", "src"),
        (HFStyleDecoder(num_layers=3), "model.layers", "hidden_states"),
    ],
)
def test_discovers_the_trunk_of_each_family(model, path, hidden):
    trunk = discover_trunk(model)
    assert (trunk.path, len(trunk), trunk.hidden_name) == (path, 3, hidden)
    assert trunk.block_names == [f"{path}.{i}" for i in range(3)]


def test_heaviest_container_wins_and_override():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
            self.big = nn.Sequential(*[nn.Linear(16, 16) for _ in range(2)])

    assert discover_trunk(Two()).path == "big"
    assert discover_trunk(Two(), trunk="small").path == "small"


def test_no_trunk_names_what_was_inspected_and_the_override():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])

    with pytest.raises(
        ValueError, match=r"no trunk found in Flat: inspected containers \['parts'\].*trunk='dotted.path.to.blocks'"
    ):
        discover_trunk(Flat())
    with pytest.raises(ValueError, match="trunk='nope': Flat has no submodule of that name"):
        discover_trunk(Flat(), trunk="nope")
    with pytest.raises(ValueError, match="trunk='parts' is a ModuleList with children \\['Linear', 'ReLU'\\]"):
        discover_trunk(Flat(), trunk="parts")


def test_placement_balanced_and_explicit():
    assert place_blocks(8, 2) == [range(0, 4), range(4, 8)]
    assert place_blocks(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert place_blocks(8, 2, [3, 5]) == [range(0, 3), range(3, 8)]
    with pytest.raises(ValueError, match="4 pipeline chunks need at least 4 blocks; the trunk has 3"):
        place_blocks(3, 4)
    with pytest.raises(ValueError, match=r"layers_per_stage=\[3, 4\] sums to 7, but the trunk has 8 blocks"):
        place_blocks(8, 2, [3, 4])
    with pytest.raises(ValueError, match="layers_per_stage has 3 entries, the pipeline has 2 chunks"):
        place_blocks(8, 2, [3, 3, 2])
    with pytest.raises(ValueError, match="every stage needs at least one block"):
        place_blocks(8, 2, [0, 8])


def test_freed_blocks_keep_their_modules_but_not_their_memory():
    model = GPT(n_layer=4)
    before = parameter_bytes(model)
    block_bytes = parameter_bytes(model.transformer.h[0])
    free_blocks(list(model.transformer.h[:2]))
    assert parameter_bytes(model) == before - 2 * block_bytes
    assert model.transformer.h[0].attn.n_head == 4  # attributes stay readable


def test_microbatches_split_unevenly_with_shares():
    x, y = torch.arange(16).view(8, 2), torch.arange(8)
    micro, shares = split_microbatches((x, {"y": y, "tag": "t"}), 3)
    assert [m[0].shape[0] for m in micro] == [3, 3, 2]
    assert shares == [3 / 8, 3 / 8, 2 / 8]
    assert torch.equal(torch.cat([m[1]["y"] for m in micro]), y) and micro[2][1]["tag"] == "t"


def test_a_batch_shorter_than_the_microbatch_count_is_padded_with_share_zero():
    x = torch.arange(6.0).view(3, 2)
    micro, shares = split_microbatches(x, 5)
    assert [m.shape[0] for m in micro] == [1, 1, 1, 1, 1]
    assert shares == [1 / 3, 1 / 3, 1 / 3, 0.0, 0.0]
    assert torch.equal(torch.cat(micro[:3]), x) and all(torch.equal(m, x[2:]) for m in micro[3:])


def test_microbatch_errors():
    with pytest.raises(ValueError, match="the batch is empty"):
        split_microbatches(torch.zeros(0, 2), 4)
    with pytest.raises(ValueError, match=r"different sizes along dim 0: \[3, 4\]"):
        split_microbatches((torch.zeros(3), torch.zeros(4)), 2)
    with pytest.raises(ValueError, match="holds no tensor"):
        split_microbatches({"a": 1}, 2)


def test_padding_is_refused_where_running_statistics_would_see_it():
    from torch import nn

    from lightning_parallel.strategies.microbatches import check_padding

    with pytest.raises(ValueError, match=r"a batch of 3 samples .* running statistics of \['1'\]"):
        check_padding(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), 3, 4)
    with pytest.warns(UserWarning, match="filled with 1 padding micro-batch"):
        check_padding(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), 3, 4)
