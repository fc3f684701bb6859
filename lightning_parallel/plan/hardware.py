"""Link models, and a cost model of a published GPU for shapes this machine cannot run.

A link moves ``n`` bytes in ``latency + n / bandwidth`` seconds (point to point); a ring all-reduce over
``k`` ranks moves ``2 (k-1)/k n`` bytes per rank, an all-gather or reduce-scatter ``(k-1)/k n``, an
all-to-all ``(k-1)/k n`` (Thakur et al., 2005, "Optimization of collective communication operations in
MPICH"). Presets:

- ``nvlink``: 450 GB/s one way per GPU (NVLink 4, 900 GB/s bidirectional, NVIDIA H100/H20 datasheets), 3 us;
- ``infiniband``: 50 GB/s (one 400 Gb/s NDR port per GPU), 5 us;
- ``cpu``: gloo on loopback between two processes of the project's 2-core machine, 1.1 GB/s and 650 us
  as ``measure_link`` measured it there with both processes computing (medians of 9 rounds in
  ``benchmarks/planner.py``'s run of 2026-12-02, three sequence lengths: 0.92-1.25 GB/s, 640-1580 us;
  between idle processes the same receives measured 2.2-2.8 GB/s and 380-500 us that morning, which a run
  does not meet); a transfer is charged to the receiving action and the sender's cores (``rendezvous``).
  ``benchmarks/planner.py`` measures its own.

``published_costs`` builds :class:`~lightning_parallel.plan.costs.BlockCosts` from FLOP counts of a
Llama-style block (Narayanan et al., SC'21, appendix: 24 B T H^2 GEMM FLOPs per layer forward for the
QKV, output and a 4H MLP; attention 4 B T^2 H) divided by a sustained rate: the GPU's dense BF16 peak
times a model FLOPs utilisation (MFU, an assumption: 0.5 by default). H20: 148 TFLOP/s dense BF16, 96 GB
(NVIDIA H20 datasheet); the HelixPipe paper (arXiv 2507.00394) reports its results on H20s.
Backward: input gradient = forward for the GEMMs (one GEMM each), weight gradient = forward; attention
backward 2.5x its forward (five matmuls against the forward's two: Dao, 2023, "FlashAttention-2", §3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_parallel.plan import links
from lightning_parallel.plan.costs import BlockCosts, Fit, HelixCosts, fit


@dataclass(frozen=True)
class Link:
    """Point-to-point bandwidth (bytes/s, one way) and latency (s) between two devices. ``rendezvous``: gloo
    between CPU processes: a message moves only once its receive is posted, the receiving process is blocked
    while it moves, and the sending process's I/O thread copies it out on the cores that compute; so a
    receive costs the receiving action the whole transfer, a send costs the sending stage the bytes' time,
    and nothing arrives ahead of its receive. Otherwise (NCCL, copy engines) the transfer overlaps compute
    and delays its consumer."""

    bandwidth: float
    latency: float
    rendezvous: bool = False
    collective: tuple[float, float] | None = None
    """``(bandwidth, latency)`` of one ring step of the all-reduce where it was timed (:func:`measure_collectives`:
    gloo's all-reduce on CPU costs several times its bytes over the point-to-point link); ``None``: the
    point-to-point link's, the textbook ring."""
    gather: tuple[float, float] | None = None
    """The same for the all-gather and the reduce-scatter: gloo's all-gather on CPU moves several times fewer
    bytes per second than its all-reduce (measured: 70 ms to gather 25 MB over 2 processes, 20 ms to all-reduce
    them); ``None``: the all-reduce's."""
    exchange: tuple[float, float] | None = None
    """The same for the all-to-all (expert parallelism's dispatch and combine); ``None``: the all-gather's."""

    def p2p(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def receiving(self, nbytes: float) -> float:
        """Seconds of the receiving action spent moving a message of ``nbytes``."""
        return self.p2p(nbytes) if self.rendezvous else 0.0

    def sending(self, nbytes: float) -> float:
        """Seconds of the sending stage's compute a message of ``nbytes`` takes."""
        return nbytes / self.bandwidth if self.rendezvous else 0.0

    def arrival(self, nbytes: float) -> float:
        """Seconds from the producer's end until a message of ``nbytes`` can be consumed."""
        return 0.0 if self.rendezvous else self.p2p(nbytes)

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        bandwidth, latency = self.collective or (self.bandwidth, self.latency)
        return 0.0 if ranks <= 1 else 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth

    def all_gather(self, nbytes: float, ranks: int) -> float:
        """Also reduce-scatter: ``nbytes`` is the whole tensor."""
        bandwidth, latency = self.gather or self.collective or (self.bandwidth, self.latency)
        return 0.0 if ranks <= 1 else (ranks - 1) * latency + (ranks - 1) / ranks * nbytes / bandwidth

    def all_to_all(self, nbytes: float, ranks: int) -> float:
        """Each rank's buffer of ``nbytes`` exchanged: ``(ranks - 1) / ranks`` of it to the others."""
        bandwidth, latency = self.exchange or self.gather or self.collective or (self.bandwidth, self.latency)
        return 0.0 if ranks <= 1 else (ranks - 1) * latency + (ranks - 1) / ranks * nbytes / bandwidth


LINK_SIZES = (256, 1 << 20, 1 << 22)  # bytes of the messages ``measure_link`` times


def measure_link(peer: int, group: Any = None, sizes: tuple[int, ...] = LINK_SIZES, repeats: int = 10) -> Link:
    """The gloo link to ``peer`` (a global rank) as a pipeline's consumer meets it: how long a receive of a
    message of each size blocks once the send was posted, both processes computing
    (``links.receive_time``), fitted by :func:`link_from_times`. Both ranks call it, each naming the
    other."""
    return link_from_times(sizes, [links.receive_time(peer, n, repeats, group) for n in sizes])


def link_from_times(sizes: Sequence[int], times: Sequence[float]) -> Link:
    """``latency + bytes / bandwidth`` fitted to receive times of messages of ``sizes`` bytes with non-negative
    coefficients (two sizes alone can come out in the wrong order on a noisy machine). Where the fit finds no
    per-byte cost, the slowest receive's whole time is taken as the largest message's: never an absurd
    bandwidth."""
    latency, per_byte = (fit(list(sizes), list(times), 1).coef + [0.0])[:2]
    if per_byte <= 0:
        return Link(max(sizes) / max(times), 0.0, rendezvous=True)
    return Link(1.0 / per_byte, latency, rendezvous=True)


def measure_collectives(
    group: Any, sizes: tuple[int, ...] = LINK_SIZES, repeats: int = 5
) -> dict[str, tuple[float, float]]:
    """``Link``'s ``collective``, ``gather`` and ``exchange``: ``(bandwidth, latency)`` of one ring step of the
    all-reduce, the all-gather and the all-to-all, each from the median times over the 2-rank ``group`` at each
    size (:meth:`Link.all_reduce` at two ranks: ``2 latency + bytes / bandwidth``; :meth:`Link.all_gather` and
    :meth:`Link.all_to_all`: ``latency + bytes / 2 bandwidth``), fitted with non-negative coefficients. Every rank
    of ``group`` calls it."""
    out = {}
    kinds = (("collective", "all_reduce", 2, 1.0), ("gather", "all_gather", 1, 0.5), ("exchange", "all_to_all", 1, 0.5))
    for field, kind, steps, share in kinds:
        times = [links.collective_time(kind, n, repeats, group) for n in sizes]
        intercept, per_byte = (fit(list(sizes), times, 1).coef + [0.0])[:2]
        if per_byte <= 0:
            out[field] = (share * max(sizes) / max(times), 0.0)
        else:
            out[field] = (share / per_byte, intercept / steps)
    return out


LINKS = {
    "nvlink": Link(450e9, 3e-6),
    "infiniband": Link(50e9, 5e-6),
    "cpu": Link(1.1e9, 650e-6, rendezvous=True),
}


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float  # dense peak, FLOP/s
    memory: float  # bytes
    mfu: float = 0.5  # sustained fraction of the peak on the block's GEMMs and attention


GPUS = {"h20": Gpu("NVIDIA H20", 148e12, 96e9), "h100": Gpu("NVIDIA H100 SXM", 989e12, 80e9)}


def published_costs(hidden: int, layers: int, heads: int, vocab: int, gpu: Gpu, micro_batch: int = 1) -> BlockCosts:
    """``BlockCosts`` of a Llama-like model (MLP 4H, BF16) on ``gpu`` from FLOP counts (module docstring)."""
    rate, b, h = gpu.bf16_flops * gpu.mfu, micro_batch, hidden
    qkv = 2 * b * h * 3 * h / rate  # per token: the QKV projection, 3H^2 multiply-adds
    out_mlp = 2 * b * h * (h + 8 * h) / rate  # per token: the output projection H^2 and the MLP 8H^2
    gemms = qkv + out_mlp
    att = 4 * b * h / rate / 2  # per token^2: causal, half of 4 B T^2 H
    att_grad = 2.5 * att
    # what each policy recomputes in the backward: a tenth of the GEMMs' time for "selective" (its element-wise
    # work, an estimate), the GEMMs for "no_attention", everything for "full"
    redo = {"none": Fit([0.0]), "selective": Fit([0.0, 0.1 * gemms]), "no_attention": Fit([0.0, gemms]),
            "full": Fit([0.0, gemms, att])}  # fmt: skip
    add = lambda f, g: Fit([x + y for x, y in zip(f.coef + [0.0] * 3, g.coef + [0.0] * 3)])  # noqa: E731
    forward, input_grad, weight_grad = Fit([0.0, gemms, att]), Fit([0.0, gemms, att_grad]), Fit([0.0, gemms])
    bytes_ = 2
    return BlockCosts(
        num_blocks=layers,
        hidden_bytes=Fit([0.0, b * h * bytes_]),
        forward={p: forward for p in redo},
        backward={p: add(add(input_grad, weight_grad), redo[p]) for p in redo},
        input_grad={p: add(input_grad, redo[p]) for p in redo},
        weight_grad={p: weight_grad for p in redo},
        # kept bytes per token (BF16): 34 B T H without recomputation (Korthikanti et al., 2022, Table 2, less
        # the attention scores flash attention never stores); the input only under "full"; attention's
        # output and statistics plus the input under "no_attention"; under "selective" (GEMM and attention
        # outputs kept) 22 B T H, this project's estimate, not a published figure
        kept={
            "none": Fit([0.0, 34 * b * h]),
            "selective": Fit([0.0, 22 * b * h]),
            "no_attention": Fit([0.0, 4 * b * h + 4 * b * heads]),
            "full": Fit([0.0, 2 * b * h]),
        },  # fmt: skip
        split_bytes=Fit([0.0, 10 * b * h]),  # the output gradients of the four GEMMs (H, H, 4H, H wide), BF16
        helix=HelixCosts(
            pre=Fit([0.0, qkv]),
            attention=Fit([0.0, 0.0, att]),
            post=Fit([0.0, out_mlp]),
            pre_grad=Fit([0.0, 2 * qkv]),  # input gradient = forward for the GEMMs, weight gradient = forward
            attention_grad=Fit([0.0, 0.0, att_grad]),
            post_grad=Fit([0.0, 2 * out_mlp]),
            qkv_bytes=Fit([0.0, 4 * b * h * bytes_]),  # q, k, v and the residual
            out_bytes=Fit([0.0, 2 * b * h * bytes_]),  # the attention output and the residual
            # the 34 B T H above by part (Korthikanti et al.'s per-tensor counts; an estimate): pre keeps the
            # norm's output and q, k, v; attention its output; post the rest (residual, norm, MLP, output)
            pre_kept=Fit([0.0, 8 * b * h]),
            attention_kept=Fit([0.0, 2 * b * h]),
            post_kept=Fit([0.0, 24 * b * h]),
        ),
        head_forward=Fit([0.0, 2 * b * h * vocab / rate]),
        head_backward=Fit([0.0, 4 * b * h * vocab / rate]),
        head_kept=Fit([0.0, 4 * b * vocab]),  # the logits' softmax in FP32 (an estimate)
        capture=Fit([0.0]),
        capture_kept=Fit([0.0, b * h * bytes_]),  # the trunk input
        block_parameter_bytes=12 * h * h * bytes_,
        outer_parameter_bytes=2 * vocab * h * bytes_,
        dtype_bytes=bytes_,
        source=f"{gpu.name}: {gpu.bf16_flops / 1e12:.0f} TFLOP/s dense BF16 x MFU {gpu.mfu}",
    )
