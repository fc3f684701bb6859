"""Point-to-point messages between pipeline stages (and LASP's ranks): the two lanes of each pair of stages, a
tensor sent with its header (its shape, dtype and the producer's send time), a timed send, and several tensors
packed into one message. The group collectives are :mod:`lightning_parallel._collectives`.

NCCL's rules, which gloo does not enforce (tests/helpers/comm_check.py checks them on gloo): tags are
ignored, so the i-th send from A to B meets the i-th receive B posts from A, whatever either tag says; and
unbatched sends and receives between two ranks share one in-order stream per communicator, so two ranks
that each send before receiving wait on each other once a message exceeds NCCL's buffering. Hence:
messages to a higher rank travel on one process group and to a lower rank on another (:class:`Lanes`: each
direction its own stream), and within one direction the runtime sends in the receiver's order
(``pipeline.messages``). Tags stay (gloo matches by them). Never poll ``is_completed()`` on gloo p2p (it
never turns true).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel._collectives import ProcessGroup, _on


@dataclass(frozen=True)
class Lanes:
    """Point-to-point between the ranks of one pipeline group over two process groups with its members:
    a message to a higher global rank on ``up``, to a lower one on ``down``. Each is its own NCCL communicator,
    so each direction between two ranks has its own stream: a stage's send can never queue behind its own
    receive of the peer's send (the cross-send deadlock of 1F1B's steady state and of helix). ``group`` is the
    pipeline group itself (collectives)."""

    group: ProcessGroup
    up: ProcessGroup
    down: ProcessGroup

    def to(self, dst: int) -> ProcessGroup:
        """The group a message to global rank ``dst`` travels on."""
        return self.up if dst > dist.get_rank() else self.down

    def source(self, src: int) -> ProcessGroup:
        """The group a message from global rank ``src`` arrives on."""
        return self.up if src < dist.get_rank() else self.down


def make_lanes(rank_lists: list[list[int]], group: ProcessGroup) -> Lanes:
    """This rank's :class:`Lanes` in its pipeline group ``group``; ``rank_lists`` are every pipeline group's
    global ranks, the same list on every rank (each lane is created by every rank, in the same order, as
    ``new_group`` requires)."""
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        up, down = dist.new_group(ranks), dist.new_group(ranks)
        if me in ranks:
            mine = Lanes(group, up, down)
    if mine is None:
        raise ValueError(f"rank {me} is in none of the pipeline groups {rank_lists}")
    return mine


_DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
]
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS + 1  # ndim, dtype, shape..., producer wall time in microseconds


def _header(tensor: Tensor | None) -> list[int]:
    if tensor is None:
        return [0] * _HEADER
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"cannot send a {tensor.dim()}-d tensor; at most {_MAX_DIMS} dims")
    shape = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
    return [tensor.dim(), _DTYPES.index(tensor.dtype), *shape, int(time.time() * 1e6)]


def isend_with_header(tensor: Tensor, dst: int, tag: int, group: ProcessGroup) -> list[tuple[dist.Work, Tensor]]:
    """Send shape, dtype and the send time (a header on the tensor's device), then the data; returns the works
    and buffers to keep alive."""
    header = _on(_header(tensor), torch.int64, tensor.device)
    data = tensor.detach().contiguous()
    return [
        (dist.isend(header, dst, group=group, tag=2 * tag), header),
        (dist.isend(data, dst, group=group, tag=2 * tag + 1), data),
    ]


def recv_with_header(src: int, tag: int, group: ProcessGroup, device: torch.device) -> tuple[Tensor, float]:
    """Receive a tensor sent by ``isend_with_header``; returns it and the producer's send time (s). Reading the
    header waits for it on the host (a device header: one copy back per message)."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.irecv(header, src, group=group, tag=2 * tag).wait()
    values = header.tolist()
    ndim, dtype = values[0], _DTYPES[values[1]]
    out = torch.empty(values[2 : 2 + ndim], dtype=dtype, device=device)
    dist.irecv(out, src, group=group, tag=2 * tag + 1).wait()
    return out, values[-1] / 1e6


def isend(tensor: Tensor, dst: int, tag: int, group: ProcessGroup) -> tuple[dist.Work, Tensor]:
    data = tensor.detach().contiguous()
    return dist.isend(data, dst, group=group, tag=2 * tag + 1), data


def isend_timed(tensor: Tensor, dst: int, tag: int, group: ProcessGroup) -> list[tuple[dist.Work, Tensor]]:
    """``isend`` preceded by the producer's wall time (one float64), for the timeline's bubble analysis."""
    stamp = _on([time.time()], torch.float64, tensor.device)
    return [(dist.isend(stamp, dst, group=group, tag=2 * tag), stamp), isend(tensor, dst, tag, group)]


def recv_into_timed(out: Tensor, src: int, tag: int, group: ProcessGroup) -> tuple[Tensor, float]:
    """Receive what ``isend_timed`` sent into ``out``; returns it and the producer's send time (s)."""
    stamp = torch.empty(1, dtype=torch.float64, device=out.device)
    works = [dist.irecv(stamp, src, group=group, tag=2 * tag), dist.irecv(out, src, group=group, tag=2 * tag + 1)]
    for work in works:
        work.wait()
    return out, float(stamp[0])


def broadcast_with_header(tensor: Tensor | None, src: int, group: ProcessGroup, device: torch.device) -> Tensor:
    """Broadcast a tensor whose shape only ``src`` (a global rank) knows."""
    header = _on(_header(tensor), torch.int64, device)
    dist.broadcast(header, src, group=group)
    values = header.tolist()
    ndim, dtype = values[0], _DTYPES[values[1]]
    out = (
        tensor.detach().contiguous()
        if tensor is not None
        else torch.empty(values[2 : 2 + ndim], dtype=dtype, device=device)
    )
    dist.broadcast(out, src, group=group)
    return out


_MAX_PACKED = 8
_PACKED_HEADER = 1 + _MAX_PACKED * (2 + _MAX_DIMS) + 2  # count, (ndim, dtype, shape) each, wide dtype, time


Spec = tuple[list[tuple[list[int], torch.dtype]], torch.dtype]  # each tensor's (shape, dtype), the payload's dtype


def pack(tensors: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Several tensors as one header (count, each one's ndim, dtype and shape, the payload's dtype, the wall
    time in microseconds) and one flat payload in their promoted dtype (``isend_packed``'s message); each
    tensor is copied into its slice of the payload once (strided views and casts included)."""
    if not 0 < len(tensors) <= _MAX_PACKED:
        raise ValueError(f"isend_packed takes 1 to {_MAX_PACKED} tensors, got {len(tensors)}")
    values = [0] * _PACKED_HEADER
    values[0] = len(tensors)
    wide = tensors[0].dtype
    for i, t in enumerate(tensors):
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"cannot send a {t.dim()}-d tensor; at most {_MAX_DIMS} dims")
        base = 1 + i * (2 + _MAX_DIMS)
        values[base], values[base + 1] = t.dim(), _DTYPES.index(t.dtype)
        values[base + 2 : base + 2 + t.dim()] = list(t.shape)
        wide = torch.promote_types(wide, t.dtype)
    values[-2] = _DTYPES.index(wide)
    values[-1] = int(time.time() * 1e6)
    header = _on(values, torch.int64, tensors[0].device)
    payload = torch.empty(sum(t.numel() for t in tensors), dtype=wide, device=tensors[0].device)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            payload[offset : offset + t.numel()].view(t.shape).copy_(t)
            offset += t.numel()
    return header, payload


def isend_packed(tensors: list[Tensor], dst: int, tag: int, group: ProcessGroup) -> list[tuple[dist.Work, Tensor]]:
    """Send several tensors as one header + one flat payload (``pack``: 2 p2p ops instead of 2 per tensor).
    Mixed dtypes (bf16 activations beside an fp32 residual under autocast) travel in the promoted dtype and
    are cast back on receipt, which is exact."""
    header, payload = pack(tensors)
    return [
        (dist.isend(header, dst, group=group, tag=2 * tag), header),
        (dist.isend(payload, dst, group=group, tag=2 * tag + 1), payload),
    ]


def _spec_of(header: list[int]) -> Spec:
    specs = []
    for i in range(header[0]):
        base = 1 + i * (2 + _MAX_DIMS)
        specs.append((header[base + 2 : base + 2 + header[base]], _DTYPES[header[base + 1]]))
    return specs, _DTYPES[header[-2]]


def post_recv_packed(src: int, tag: int, group: ProcessGroup, device: torch.device, expect: Spec) -> Any:
    """Post the receives of a packed message whose spec the caller knows (header and payload at once: one round
    trip; its bytes may move while this process computes); :func:`complete_recv_packed` waits for them."""
    header = torch.empty(_PACKED_HEADER, dtype=torch.int64, device=device)
    payload = torch.empty(sum(int(torch.Size(s).numel()) for s, _ in expect[0]), dtype=expect[1], device=device)
    works = [dist.irecv(header, src, group=group, tag=2 * tag)]
    works.append(dist.irecv(payload, src, group=group, tag=2 * tag + 1))
    return works, header, payload, expect, src, tag


def complete_recv_packed(posted: Any) -> tuple[list[Tensor], float, Spec]:
    """Wait for receives posted by :func:`post_recv_packed`: the tensors, the send time (s), the spec; a message
    of another spec than the one expected is an error."""
    works, header, payload, expect, src, tag = posted
    for work in works:
        work.wait()
    values = header.tolist()  # the one wait on the host per message
    spec = _spec_of(values)
    if spec != expect:
        raise RuntimeError(f"a packed message from rank {src} (tag {tag}) is {spec}; its receiver expected {expect}")
    return _unpack(values, payload, spec)


def recv_packed(
    src: int, tag: int, group: ProcessGroup, device: torch.device, expect: Spec | None = None
) -> tuple[list[Tensor], float, Spec]:
    """Receive what ``isend_packed`` sent: each tensor in its own dtype and shape, the send time (s), and the
    message's spec. With ``expect`` (the spec the caller knows the message has) the payload's receive is posted
    together with the header's: one round trip instead of two."""
    if expect is not None:
        return complete_recv_packed(post_recv_packed(src, tag, group, device, expect))
    header = torch.empty(_PACKED_HEADER, dtype=torch.int64, device=device)
    dist.irecv(header, src, group=group, tag=2 * tag).wait()
    values = header.tolist()
    spec = _spec_of(values)
    payload = torch.empty(sum(int(torch.Size(s).numel()) for s, _ in spec[0]), dtype=spec[1], device=device)
    dist.irecv(payload, src, group=group, tag=2 * tag + 1).wait()
    return _unpack(values, payload, spec)


def _unpack(header: list[int], payload: Tensor, spec: Spec) -> tuple[list[Tensor], float, Spec]:
    sizes = [int(torch.Size(shape).numel()) for shape, _ in spec[0]]
    parts = [part.view(shape).to(dtype) for part, (shape, dtype) in zip(payload.split(sizes), spec[0])]
    return parts, header[-1] / 1e6, spec
