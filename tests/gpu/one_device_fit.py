"""Fit the example Llama for a few steps through a strategy's whole set-up on ONE device, against a plain
``Trainer`` on the same device; print one JSON line per strategy. On CUDA the process group is Lightning's
default there, NCCL, so every tensor the strategy hands to a collective must live on the GPU: this is the
one NCCL check a single GPU allows (world size 1: NCCL's kernels run, no second rank exists).

Run in a fresh interpreter (``tests/gpu/test_one_device.py`` does): the pytest process holds no process group.

    python -m tests.gpu.one_device_fit [--accelerator cuda] [strategy ...]
"""

from __future__ import annotations

import argparse
import json
import sys

import lightning as L
import torch

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel import _collectives

STRATEGIES = {
    "hybrid": dict(),
    "tensor_parallel": dict(tensor_parallel_size=1),
    "sequence_parallel": dict(sequence_parallel_size=1),
    # a mixed group serves host tensors on gloo, on purpose: comm_device says "cpu" there
    "hybrid_mixed_backend": dict(process_group_backend="cpu:gloo,cuda:nccl"),
}


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.backend = ""
        self.comm_device = ""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(outputs["loss"]))
        if torch.distributed.is_initialized() and not self.backend:
            self.backend = str(torch.distributed.get_backend())
            self.comm_device = str(_collectives.comm_device(None))


def _fit(strategy: object, accelerator: str, steps: int) -> _Losses:
    from examples.data import CharDataModule
    from examples.models import Llama

    torch.manual_seed(0)
    data = CharDataModule(block_size=64, batch_size=4, shuffle=False)
    model = Llama(vocab_size=data.vocab_size, block_size=64, n_layer=4, n_head=4, n_kv_head=2, dim=64,
                  mlp_hidden=128, optimizer="sgd", lr=0.05)  # fmt: skip
    losses = _Losses()
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[losses], precision="32-true", use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    return losses


def ring_op_check(device: str) -> list[dict]:
    """Ring attention's op on one rank of the device's default backend (NCCL on CUDA): its two zig-zag chunks
    still merge (chunk 1's queries against chunks 0 and 1) and its k/v gradients still take the ring's shift;
    forward and gradients against SDPA on the whole sequence, causal and with a packed document mask."""
    import os

    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_parallel.ring_attention import ring_attention

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
    rows = []
    try:
        group_name = dist.group.WORLD.group_name
        for dtype in (torch.float64, torch.float32) + ((torch.bfloat16,) if device == "cuda" else ()):
            for masked in (False, True):
                torch.manual_seed(0)
                B, H, T, d = 2, 4, 256, 32
                q, k, v = (torch.randn(B, H, T, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
                mask = None
                if masked:  # two documents per row, causal inside each
                    doc = (torch.arange(T, device=device) >= T // 3).long()
                    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
                    mask = (causal & (doc[:, None] == doc[None, :]))[None, None].expand(B, 1, T, T).contiguous()
                out, _ = ring_attention(q, k, v, group_name, mask is None, d**-0.5, [0, 1], mask)
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
                grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
                refs = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
                err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in
                          zip((out, *grads), (ref, *refs)))  # fmt: skip
                bound = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
                rows.append(dict(check="ring_op", device=device, backend=dist.get_backend(), dtype=str(dtype),
                                 masked=masked, max_rel_err=err, ok=err <= bound))  # fmt: skip
    finally:
        dist.destroy_process_group()
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("strategies", nargs="*", default=list(STRATEGIES))
    args = parser.parse_args(argv)
    if args.accelerator == "cuda":  # as one device computes it: no TF32 in the comparison
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    reference = _fit("auto", args.accelerator, args.steps).losses
    failed = 0
    for name in args.strategies:
        if "mixed" in name and args.accelerator != "cuda":
            continue  # NCCL exists only on CUDA builds
        from lightning_parallel import HybridParallelStrategy

        row: dict = {"strategy": name}
        try:
            got = _fit(HybridParallelStrategy(**STRATEGIES[name]), args.accelerator, args.steps)
            diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got.losses, reference))
            row.update(backend=got.backend, comm_device=got.comm_device, losses=got.losses, reference=reference,
                       max_rel_diff=diff, ok=len(got.losses) == len(reference) and diff <= 1e-5)  # fmt: skip
            if "mixed" in name:  # host tensors go through gloo there, on purpose
                row["ok"] = row["ok"] and got.comm_device == "cpu"
        except Exception as e:  # report and go on: one line per strategy
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        failed += not row["ok"]
        print(json.dumps(row), flush=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    try:
        ring_rows = ring_op_check(args.accelerator)
    except Exception as e:
        ring_rows = [dict(check="ring_op", ok=False, error=f"{type(e).__name__}: {e}"[:2000])]
    for row in ring_rows:
        failed += not row["ok"]
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
