"""Parallel topology: the sizes of the four mesh axes and the named ``DeviceMesh`` built from them.

Axes, outer to inner: ``dp`` (data), ``pp`` (pipeline), ``sp`` (sequence / context), ``tp`` (tensor).
Inner axes vary fastest over global ranks, so the ranks of one tensor-parallel group are adjacent
(on a GPU node they share the fastest links), as in Megatron-LM and torchtitan.

``ParallelDims`` is frozen: ``"auto"`` is resolved once, against the world size, in ``resolve``.
Every rule raises ``ValueError`` naming the argument and every number involved, and runs before any
collective, so a bad layout fails on every rank identically instead of hanging.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Mesh axis names, outer to inner. The only place these strings are spelled.
DP, PP, SP, TP = "dp", "pp", "sp", "tp"
AXES: tuple[str, ...] = (DP, PP, SP, TP)

#: The user-facing argument name of each axis (Lightning's ``*_parallel_size`` convention).
ARGUMENT_NAMES: dict[str, str] = {
    DP: "data_parallel_size",
    PP: "pipeline_parallel_size",
    SP: "sequence_parallel_size",
    TP: "tensor_parallel_size",
}

Size = Union[int, Literal["auto"]]


@dataclass(frozen=True)
class ParallelDims:
    """Resolved sizes of the ``dp, pp, sp, tp`` axes; their product is the world size."""

    dp: int
    pp: int
    sp: int
    tp: int

    @classmethod
    def resolve(cls, world_size: int, *, dp: Size = "auto", pp: Size = 1, sp: Size = 1, tp: Size = 1) -> ParallelDims:
        """Fill in at most one ``"auto"`` axis so the product equals ``world_size``, and validate.

        Raises:
            ValueError: a size that is not a positive int or ``"auto"``; more than one ``"auto"``; a
                size (or product of sizes) that does not divide the world size; a product that differs
                from the world size when nothing is ``"auto"``.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size must be a positive int, got {world_size!r}")
        given = {DP: dp, PP: pp, SP: sp, TP: tp}
        for axis, size in given.items():
            check_size(axis, size)
        auto = [axis for axis, size in given.items() if size == "auto"]
        if len(auto) > 1:
            names = ", ".join(f"{ARGUMENT_NAMES[a]}='auto'" for a in auto)
            raise ValueError(f"at most one parallel size may be 'auto', got {names}")
        fixed = {axis: size for axis, size in given.items() if size != "auto"}
        for axis, size in fixed.items():
            if world_size % size:
                raise ValueError(f"{ARGUMENT_NAMES[axis]}={size} does not divide world size {world_size}")
        product = math.prod(fixed.values())
        described = " * ".join(f"{ARGUMENT_NAMES[a]}={s}" for a, s in fixed.items())
        if world_size % product:
            raise ValueError(
                f"{described} = {product} does not divide world size {world_size} (devices x num_nodes); use a"
                f" multiple of {product} processes (devices={product} on one node), or other sizes"
            )
        if auto:
            fixed[auto[0]] = world_size // product
        elif product != world_size:
            raise ValueError(
                f"{described} = {product}, but the world size is {world_size} (devices x num_nodes); pass"
                f" devices={product} (on one node), set one size to 'auto', or make the product match"
            )
        return cls(**fixed)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.sp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dp, self.pp, self.sp, self.tp)

    def coordinate(self, global_rank: int) -> dict[str, int]:
        """The (dp, pp, sp, tp) coordinate of a global rank under the row-major mesh layout."""
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"global rank {global_rank} is outside world size {self.world_size}")
        coords: dict[str, int] = {}
        rest = global_rank
        for axis, size in reversed(list(zip(AXES, self.shape))):
            coords[axis] = rest % size
            rest //= size
        return {axis: coords[axis] for axis in AXES}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A ``DeviceMesh`` of shape ``(dp, pp, sp, tp)`` named by ``AXES`` on ``"cpu"`` or ``"cuda"``.

        Requires an initialized default process group of exactly ``world_size`` ranks.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
        if not dist.is_initialized():
            raise RuntimeError("build_mesh needs an initialized default process group")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"the mesh {dict(zip(AXES, self.shape))} needs {self.world_size} ranks,"
                f" but the process group has {dist.get_world_size()}"
            )
        return init_device_mesh(device_type, self.shape, mesh_dim_names=AXES)


def check_size(axis: str, size: Size) -> Size:
    """``size``; a ``ValueError`` unless it is a positive int or ``"auto"``."""
    if size == "auto":
        return size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{ARGUMENT_NAMES[axis]} must be a positive int or 'auto', got {size!r}")
    return size
