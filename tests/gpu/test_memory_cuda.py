"""CUDA peak memory of the chunked loss and of the recomputation policies, each against its plain form on the
same inputs (the same gradients; less memory where the policy keeps less). The measured numbers are printed
(``pytest -s``) and, with ``LP_GPU_REPORT=<file>``, appended to that file as JSON lines. Skipped without a GPU."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

from examples.models.gpt import Block
from lightning_parallel.blocks import apply_recompute
from lightning_parallel.chunked_loss import lazy_heads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _report(row: dict) -> None:
    print(json.dumps(row))
    path = os.environ.get("LP_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _peak(fn) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start) / 2**20, out


def test_chunked_loss_on_cuda_matches_cross_entropy_with_a_fraction_of_the_memory():
    torch.manual_seed(0)
    T, H, V = 8192, 1024, 50257
    head = torch.nn.Linear(H, V, bias=False, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, V, (1, T), device="cuda")
    target[0, : T // 4] = -100

    def run(chunks: int):  # type: ignore[no-untyped-def]
        head.weight.grad, h.grad = None, None

        def step():  # type: ignore[no-untyped-def]
            if chunks == 1:
                loss = F.cross_entropy(head(h).float().flatten(0, 1), target.flatten())
            else:
                with lazy_heads([head], chunks):
                    loss = F.cross_entropy(head(h).float().flatten(0, 1), target.flatten())
            loss.backward()
            return loss.detach(), head.weight.grad.clone(), h.grad.clone()

        return _peak(step)

    whole_mib, (loss, gw, gh) = run(1)
    chunked_mib, (closs, cgw, cgh) = run(16)
    _report(dict(check="chunked_loss", T=T, V=V, dtype="bf16", whole_peak_mib=round(whole_mib, 1),
                 chunked16_peak_mib=round(chunked_mib, 1), loss=float(loss), chunked_loss=float(closs)))  # fmt: skip
    torch.testing.assert_close(closs, loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cgw.float(), gw.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cgh.float(), gh.float(), rtol=2e-2, atol=2e-2)
    assert chunked_mib < 0.5 * whole_mib, (chunked_mib, whole_mib)


@pytest.mark.parametrize("policy", ["full", "selective", "no_attention"])
def test_recompute_policies_on_cuda_keep_less_and_give_the_same_gradients(policy):
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([Block(1024, 16, 0.0, True) for _ in range(4)]).cuda().bfloat16()
    plain = copy.deepcopy(holder)
    apply_recompute(holder, policy, every_n=1)
    x = torch.randn(2, 4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def run(model):  # type: ignore[no-untyped-def]
        def step():  # type: ignore[no-untyped-def]
            h = x
            for block in model.blocks:
                h = block(h)
            h.float().square().mean().backward()
            return [p.grad.clone() for p in model.parameters()]

        return _peak(step)

    plain_mib, want = run(plain)
    got_mib, got = run(holder)
    _report(dict(check="recompute", policy=policy, blocks=4, T=4096, hidden=1024, dtype="bf16",
                 plain_peak_mib=round(plain_mib, 1), policy_peak_mib=round(got_mib, 1)))  # fmt: skip
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)
    assert got_mib < plain_mib, (got_mib, plain_mib)


def test_one_device_strategies_on_nccl_and_ring_attention_on_cuda():
    """``tests/gpu/one_device_fit.py`` in a fresh interpreter: each strategy's set-up and three steps on NCCL
    (world size 1) against a plain Trainer, and ring attention's op on CUDA against SDPA."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.one_device_fit", "--accelerator", "cuda"], cwd=root,
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        _report(row)
    assert rows and all(row["ok"] for row in rows), proc.stdout[-4000:] + proc.stderr[-4000:]
    assert any(row.get("backend") == "nccl" for row in rows), rows
