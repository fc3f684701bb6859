"""LASP (lightning_parallel/lasp.py) on 2 gloo ranks against one process: a recurrent mixer's own forward on each
rank's piece of the sequence, its convolution inputs and recurrent state passed from the piece before, reproduces
the mixer on the whole sequence, output and gradients (input, every parameter summed over the ranks). Ulysses
pieces (rank r: chunk r) and ring pieces (rank r: chunks r and 3 - r, so the state goes 0 -> 1 -> 1 -> 0).
Falcon-H1's Mamba-2 mixer and Qwen3-Next's gated DeltaNet (both compute partly in float32 on their own: compared
at 1e-5 of each tensor's largest element)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("transformers")


class _Shard:
    def __init__(self, mode: str, mesh, chunks: tuple[int, ...]) -> None:
        self.mode, self.mesh, self.chunks = mode, mesh, chunks


def _mixer(family: str):
    import transformers

    from lightning_parallel.lasp import recurrent_mixers
    from tests.helpers import zoo

    torch.manual_seed(0)
    config = zoo.hf_config(family, 64, 4)
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    layers = [layer for layer in model.model.layers if recurrent_mixers(layer)]
    return recurrent_mixers(layers[0])[0], config.hidden_size


def _compare(rank, world_size, family, mode):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_parallel.lasp import Chained
    from lightning_parallel.sequence_parallel import balanced_chunks

    mixer, width = _mixer(family)
    T = 16
    x = torch.randn(2, T, width, dtype=torch.float64)
    grad = torch.randn(2, T, width, dtype=torch.float64)
    params = [p for p in mixer.parameters() if p.requires_grad]
    whole = x.clone().requires_grad_(True)
    want = type(mixer).forward(mixer, whole)
    want_grads = torch.autograd.grad(want, [whole, *params], grad)

    chunks = balanced_chunks(None, world_size) if mode == "ring" else ()
    pieces = list(chunks[2 * rank : 2 * rank + 2]) if mode == "ring" else [rank]
    c = T // (2 * world_size if mode == "ring" else world_size)

    def local(t):
        return torch.cat([t[:, i * c : (i + 1) * c] for i in pieces], dim=1)

    mine = local(x).requires_grad_(True)
    shard = _Shard(mode, init_device_mesh("cpu", (world_size,)), chunks)
    out = Chained(mixer, lambda: shard)(mine)
    got = torch.autograd.grad(out, [mine, *params], local(grad))

    def close(a, b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))

    close(out, local(want))
    close(got[0], local(want_grads[0]))
    for g, w in zip(got[1:], want_grads[1:]):
        g = g.clone()
        torch.distributed.all_reduce(g)  # each rank's tokens' share
        close(g, w)
    return True


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_next"])
def test_the_chained_mixer_matches_the_whole_sequence(family, mode):
    assert run_distributed(_compare, 2, family, mode, timeout=120) == [True, True]


def test_a_copied_block_chains_its_own_copy_of_the_mixer():
    """Verification's reference is a deep copy of a block that may already hold a chained mixer: the copy's chain
    must run the copy's parameters (float64), not the original's."""
    import copy

    from lightning_parallel.lasp import Chained

    mixer, _ = _mixer("falcon_h1")
    mixer.forward = Chained(mixer, lambda: None)
    twin = copy.deepcopy(mixer)
    assert twin.forward.module is twin and twin is not mixer
