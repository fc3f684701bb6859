"""What the planner knows of a model: its costs per trunk block and per micro-batch sequence, measured at a
few lengths (:class:`Sample`, by ``plan.profile``) or published (``plan.hardware``), and fitted in the
sequence length so they extrapolate: a cost that contains attention ``a + b T + c T^2`` (its work is
quadratic in T), every other cost and all bytes ``a + b T``, least squares with non-negative
coefficients."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

PLANNED_POLICIES = ("none", "selective", "no_attention", "full")
HELIX_PARTS = ("pre", "attention", "post", "pre_grad", "attention_grad", "post_grad")


@dataclass
class Sample:
    """One length's measurements for one block (seconds; bytes)."""

    seq_len: int
    forward: dict[str, float]  # per policy: F
    backward: dict[str, float]  # per policy: B (the fused backward, recomputation included)
    input_grad: dict[str, float]  # per policy: I
    weight_grad: dict[str, float]  # per policy: W
    kept: dict[str, int]  # per policy: bytes kept for backward
    split_bytes: int  # what I keeps for W beyond the forward's saved tensors (gradients at the intermediates)
    helix: dict[str, float] | None  # HELIX_PARTS, seconds; None: the block has no verified split
    helix_bytes: tuple[int, int]  # the two helix messages: (q, k, v, state) and (attention output, state)
    helix_kept: tuple[int, int, int]  # bytes each part keeps for its backward (outputs included): pre, attention, post
    helix_pack: tuple[float, float]  # seconds to pack each of the two messages (``_p2p.pack``)
    head_forward: float
    head_backward: float
    head_kept: int  # bytes the post-trunk code and loss keep for their backward
    capture_kept: int  # bytes a captured micro-batch holds (trunk input, block arguments, the pre-trunk graph)
    message: int  # bytes of the hidden state between blocks
    dtype_bytes: int
    capture: float  # seconds to capture one micro-batch (the user's step up to the trunk)
    replicated: float = 0.0  # of what a block keeps (no recomputation), the share at the hidden width


@dataclass
class Fit:
    """``value(T) = sum(coef[i] * T**i)``, fitted by least squares."""

    coef: list[float]

    def __call__(self, seq_len: float) -> float:
        return max(0.0, sum(c * seq_len**i for i, c in enumerate(self.coef)))


def fit(xs: list[int], ys: list[float], degree: int) -> Fit:
    """Least squares with non-negative coefficients (a cost does not shrink with T): terms whose coefficient
    comes out negative are dropped and the rest refitted."""
    terms = list(range(min(degree, len(xs) - 1) + 1))
    b = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    while True:
        a = torch.tensor([[float(x) ** i for i in terms] for x in xs], dtype=torch.float64)
        sol = torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()
        negative = [i for i, c in zip(terms, sol) if c < 0]
        if not negative or len(terms) == 1:
            coef = [0.0] * (max(terms) + 1)
            for i, c in zip(terms, sol):
                coef[i] = max(c, 0.0)
            return Fit(coef)
        terms.remove(negative[-1])


@dataclass
class HelixCosts:
    """HelixPipe's parts of one block, seconds per micro-batch sequence; message bytes."""

    pre: Fit
    attention: Fit
    post: Fit
    pre_grad: Fit  # each backward on its own graph, the weights' gradients included
    attention_grad: Fit
    post_grad: Fit
    qkv_bytes: Fit  # the message to the attention stage: q, k, v and the state post needs
    out_bytes: Fit  # the message back: the attention output and that state
    pre_kept: Fit  # bytes each part keeps for its backward, its outputs included (not its inputs)
    attention_kept: Fit
    post_kept: Fit


@dataclass(frozen=True)
class ExpertCosts:
    """A block's mixture of experts: what expert parallelism shards and what its all-to-alls move."""

    parameter_bytes: int  # one mixture block's routed experts' parameters, at the profile's dtype
    num_experts: int
    rows_per_token: float  # rows each token sends to experts (top-k; dense experts: every expert)
    share: float = (
        1.0  # of the trunk's blocks, those with a mixture (DeepSeek-V3's first are dense, Llama 4 interleaves)
    )
    in_profiled: bool = True  # whether the profiled block (block 0) is one of them (its bytes include the experts)


@dataclass
class BlockCosts:
    """A model's fitted costs per trunk block and per micro-batch sequence (``profile``'s result)."""

    num_blocks: int
    hidden_bytes: Fit  # the message between blocks, bytes
    forward: dict[str, Fit]  # per policy, seconds: F, B, I, W
    backward: dict[str, Fit]
    input_grad: dict[str, Fit]
    weight_grad: dict[str, Fit]
    kept: dict[str, Fit]  # bytes kept for backward per block, per policy
    split_bytes: Fit  # bytes held from I to W beyond the forward's kept tensors, per block
    helix: HelixCosts | None  # None: no verified split (``helix_refused`` says why)
    head_forward: Fit
    head_backward: Fit
    head_kept: Fit
    capture: Fit  # seconds per micro-batch and stage
    capture_kept: Fit  # bytes per captured micro-batch on the stage that runs the pre-trunk code
    block_parameter_bytes: int
    outer_parameter_bytes: int
    dtype_bytes: int
    pack: Fit = field(default_factory=lambda: Fit([0.0]))  # seconds to pack a helix message, in its bytes
    helix_refused: str = ""
    micro_batch: int = 1  # samples per profiled micro-batch (costs scale linearly in samples)
    samples: list[Sample] = field(default_factory=list)
    source: str = "measured"
    replicated: float = 0.0
    """Of the activations a block keeps, the share in tensors of the hidden width (norms' outputs, residuals):
    tensor parallelism keeps those whole on every rank and divides the rest (heads, the MLP's width)."""
    experts: ExpertCosts | None = None  # a mixture of experts in the block (expert parallelism's layouts)

    def kept_per_rank(self, nbytes: float, tp: int, sp: int) -> float:
        """A block's (or part's) kept bytes on one rank of ``tp`` x ``sp``: the hidden-width share whole over tp."""
        return nbytes * ((1.0 - self.replicated) / tp + self.replicated) / sp

    def policy(self, name: str) -> str:
        """The measured policy closest to ``name`` (``every_n`` is planned as ``full``)."""
        return name if name in self.forward else "full"


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def combine(runs: list[BlockCosts]) -> BlockCosts:
    """Profiles of one model taken at different times or on different processes, as one: every measurement
    the median over the runs, fitted again (on a machine whose speed drifts, profile rounds interleaved with
    the runs they predict)."""
    first = runs[0]
    samples = [_median_sample([run.samples[i] for run in runs]) for i in range(len(first.samples))]
    return fitted(samples, num_blocks=first.num_blocks, block_parameter_bytes=first.block_parameter_bytes,
                   outer_parameter_bytes=first.outer_parameter_bytes, helix_refused=first.helix_refused,
                   micro_batch=first.micro_batch, experts=first.experts)  # fmt: skip


def _median_sample(samples: list[Sample]) -> Sample:
    def of(values: list[Any]) -> Any:
        if values[0] is None:
            return None
        if isinstance(values[0], dict):
            return {k: median([v[k] for v in values]) for k in values[0]}
        if isinstance(values[0], tuple):
            return tuple(median(list(column)) for column in zip(*values))
        return median(values)

    return Sample(**{f.name: of([getattr(s, f.name) for s in samples]) for f in fields(Sample)})


def fitted(samples: list[Sample], **static: Any) -> BlockCosts:
    xs = [s.seq_len for s in samples]
    linear = lambda key: fit(xs, [key(s) for s in samples], 1)  # noqa: E731
    quadratic = lambda key: fit(xs, [key(s) for s in samples], 2)  # noqa: E731
    per = lambda name, make: {p: make(lambda s, p=p: getattr(s, name)[p]) for p in PLANNED_POLICIES}  # noqa: E731
    helix = None
    if samples[0].helix is not None:
        part = lambda name: (quadratic if "attention" in name else linear)(lambda s: s.helix[name])  # noqa: E731
        helix = HelixCosts(
            *(part(name) for name in HELIX_PARTS),
            *(linear(lambda s, i=i: s.helix_bytes[i]) for i in range(2)),
            *(linear(lambda s, i=i: s.helix_kept[i]) for i in range(3)),
        )
    return BlockCosts(
        hidden_bytes=linear(lambda s: s.message),
        forward=per("forward", quadratic),
        backward=per("backward", quadratic),
        input_grad=per("input_grad", quadratic),
        weight_grad=per("weight_grad", linear),
        kept=per("kept", linear),
        split_bytes=linear(lambda s: s.split_bytes),
        helix=helix,
        head_forward=linear(lambda s: s.head_forward),
        head_backward=linear(lambda s: s.head_backward),
        head_kept=linear(lambda s: s.head_kept),
        capture=linear(lambda s: s.capture),
        capture_kept=linear(lambda s: s.capture_kept),
        dtype_bytes=samples[0].dtype_bytes,
        pack=fit([n for s in samples for n in s.helix_bytes], [t for s in samples for t in s.helix_pack], 1),
        samples=samples,
        replicated=median([s.replicated for s in samples]),
        **static,
    )
