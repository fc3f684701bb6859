"""``data_parallel_sharding="full"``: parameters, gradients and optimizer state split over the dp ranks
(ZeRO stage 3 of Rajbhandari et al., 2020, arXiv 1910.02054), by torch's FSDP2 ``fully_shard`` (Zhao et
al., 2023, "PyTorch FSDP", arXiv 2304.11277).

Units, each a ``fully_shard`` call on the dp mesh (every parameter is cut in dim 0 over the dp ranks):

- every trunk block this rank runs. Its parameters are all-gathered when it is called, freed after its
  forward, gathered again when its backward starts, and its gradients are reduce-scattered (averaged
  over dp) as soon as that backward is done, while autograd goes on with the earlier blocks: the
  reduction overlaps the backward;
- every module outside the trunk that holds parameters itself (the embeddings, the norms, the head);
  modules that share a parameter (a tied embedding and head) form one unit;
- a root that only ties the units together (a module holding them, owning nothing). Lightning
  never calls the LightningModule's ``forward``, and FSDP2 would make the first unit called its root,
  so the root is initialised at set-up; every unit then gathers on its own call. A parameter the
  LightningModule owns directly stays whole on every rank and is averaged at the step as without
  sharding.

Between FSDP2 and the rest of the strategy: the pipeline's capture and substitution passes call the
blocks as recorders, so the blocks' module hooks are suspended there (``capture._forwards``); the
global gradient norm sums over the dp group (each rank holds a slice of every gradient). A module's
parameter used without calling that module (``x @ self.wte.weight.T``) is a slice at that moment;
torch raises a mixed ``DTensor`` error, it never computes on the slice.

With tensor or sequence parallelism the order is torchtitan's: tensor parallelism first, FSDP2 over its
DTensor shards on the dp dimension of the same mesh (each parameter a DTensor over (dp, tp)). The blocks'
stacks shard them at their commit, which verifies each stack on a copy of the block (FSDP2's modules
cannot be copied), so set-up shards nothing under this layout and the strategy commits every block before
the first step or evaluation runs, then calls :func:`fully_shard_model`.

With expert parallelism the experts are sharded by expert over the ep ranks already (1/ep per rank), and FSDP2
cannot shard a DTensor of that mesh over dp (the meshes overlap). Each experts module is its own unit over the
ranks holding the same experts (the ``dp·sp/ep`` replicas of an ep group; torchtitan's expert FSDP over
``dp_shard_mod_ep``), whose reduce-scatter sums their gradients and divides by dp (``set_gradient_divide_factor``:
each replica's gradient is its ep group's tokens' sum, and the step's is their mean over dp); with a single
replica, and for a home-written mixture's experts, they are left out of the units (``ignored_params``), their
gradients reduced by :mod:`lightning_parallel.strategies.gradients`. FSDP2 shards the rest over dp.

Refused: helix (its runtime calls the parts of a block cut at its attention call, where FSDP2's hooks need
whole module calls); ``data_parallel_sharding="optimizer"`` composes with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def fully_shard_model(
    module: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    before: Optional[Callable[[list[nn.Module]], None]] = None,
    exclude: list[nn.Module] = (),  # type: ignore[assignment]
    outer: bool = True,
    ignored: Callable[[], set[nn.Parameter]] = set,
    inner: Optional[Callable[[list[nn.Module]], None]] = None,
) -> list[nn.Module]:
    """Apply ``fully_shard`` to ``blocks`` and to the modules of ``module`` outside them that hold
    parameters, tie them under an initialised root; return the root (keep a reference). ``before(unit)``
    runs just before a unit is sharded: deferred initialisation materialises it there, so a rank holds its
    shards plus one unit whole, never the whole model. ``exclude``: modules another stage holds (freed).
    ``outer=False``: no units outside the blocks (under pipeline parallelism the stages shard those
    themselves, over dp x pp: :mod:`lightning_parallel.strategies._stage_local`). ``ignored()``: parameters FSDP2
    leaves as they are (expert parallelism's experts, sharded by expert over the ep ranks: each rank holds other
    experts), asked after ``before(unit)`` (a unit materialised there has its experts sharded then). ``inner(unit)``
    runs after ``before(unit)``: it shards modules inside the unit on their own axis first (expert parallelism's
    experts over the ranks holding the same experts), which the unit then leaves to them."""
    from torch.distributed.fsdp import fully_shard

    inside = {id(m) for b in [*blocks, *exclude] for m in b.modules()}
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units: list[list[nn.Module]] = []
    unit_of: dict[int, int] = {}  # parameter -> index of the unit holding it
    root_owned = {id(p) for p in module.parameters(recurse=False)}
    # a module whose forward reads its children's parameters without calling them is one unit with them (torch's
    # nn.MultiheadAttention reads out_proj.weight): a child unit would hand it a shard
    whole = {id(d) for m in module.modules() if isinstance(m, nn.MultiheadAttention) for d in m.modules() if d is not m}
    for m in reversed(list(module.modules())):  # children before parents: a parent unit takes what is left
        if m is module or id(m) in inside or id(m) in whole or not outer:
            continue
        own = list(m.parameters(recurse=False))
        if not own:
            continue
        if any(id(p) in root_owned for p in own):
            raise ValueError(
                f"{type(m).__name__} shares a parameter with {type(module).__name__} itself; data_parallel_sharding="
                "'full' needs each parameter in one unit; use data_parallel_sharding='optimizer'"
            )
        if any(id(p) in in_blocks for p in own):
            raise ValueError(
                f"{type(m).__name__} outside the trunk shares a parameter with a trunk block; data_parallel_sharding="
                "'full' needs each parameter in one unit; use data_parallel_sharding='optimizer'"
            )
        hits = sorted({unit_of[id(p)] for p in own if id(p) in unit_of})
        if hits:  # tied to an earlier unit: merge every unit it touches into the first
            first = hits[0]
            for other in reversed(hits[1:]):
                units[first] += units[other]
                units[other] = []
            units[first].append(m)
        else:
            first = len(units)
            units.append([m])
        for u in units[first]:
            for p in u.parameters(recurse=False):
                unit_of[id(p)] = first
    # children before parents: FSDP2 takes into a unit every parameter below its modules that no unit holds yet,
    # so a unit holding an ancestor (a tied bias owned by a head and its decoder) is sharded after the units below it
    depth = {id(m): name.count(".") + (name != "") for name, m in module.named_modules(remove_duplicate=False)}
    outer_units = sorted((u for u in units if u), key=lambda u: -min(depth[id(m)] for m in u))
    for unit in [*([b] for b in blocks), *outer_units]:
        if before is not None:
            before(unit)
        if inner is not None:
            inner(unit)
        mine = {id(p) for m in unit for p in m.parameters()}
        skip = {p for p in ignored() if id(p) in mine}
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, ignored_params=skip or None)
    members = [*blocks, *(m for u in units for m in u)]
    # only the units' top modules under the root: FSDP2 manages a unit's module that lies inside another of its
    # modules (a decoder inside the head that shares its bias) through that one, and the root would take it again
    inside = {id(d) for m in members for d in m.modules() if d is not m}
    root = _Root([m for m in members if id(m) not in inside])
    fully_shard(root, mesh=mesh, ignored_params=ignored() or None)
    root._get_fsdp_state()._lazy_init()  # type: ignore[operator]
    return [root]


def fully_shard_experts(unit: list[nn.Module], mesh: DeviceMesh, dp: int) -> None:
    """Each experts module of ``unit`` (sharded by ep already) its own FSDP2 unit over ``mesh``, the ranks holding
    the same experts, whose reduce-scatter sums their gradients and divides by ``dp`` (module docstring)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from lightning_parallel.anatomy.experts import find_experts

    for module in unit:
        for _, experts in find_experts(module):
            if not isinstance(experts, FSDPModule) and not any(p.is_meta for p in experts.parameters()):
                fully_shard(experts, mesh=mesh)
                experts.set_gradient_divide_factor(float(dp))  # type: ignore[operator]


class _Root(nn.Module):
    """The units under one FSDP2 root; never called (each unit gathers on its own call)."""

    def __init__(self, units: list[nn.Module]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self) -> None:
        raise RuntimeError("the full-sharding root is never called")


def check_full(strategy_name: str, helix: bool) -> None:
    """Refuse the layouts ``"full"`` does not compose with, naming the alternative."""
    if helix:
        raise ValueError(
            f"data_parallel_sharding='full' with {strategy_name!r} is not supported: helix runs each block cut at its"
            " attention call, so FSDP's per-module gathering never fires; use data_parallel_sharding='optimizer'"
            " (optimizer state and gradients sharded, parameters whole)"
        )


def is_fully_sharded(p: Any) -> bool:
    """A tensor stored in shards over the dp ranks: FSDP2's (a DTensor over dp, or over (dp, tp) above tensor
    parallelism), or the pipeline's parameters outside the trunk under full sharding (over dp x pp)."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor) and any("dp" in n.split("_") for n in p.device_mesh.mesh_dim_names or ())
