"""Tensor parallelism for unchanged blocks (Megatron-LM, Shoeybi et al., arXiv 1909.08053), on DTensor.

Per block of the trunk, with the block family's adapter (``lightning_parallel.adapters``):

- **Plan**: the adapter names the projections: q, k, v (or the fused q|k|v) and MLP-in column-wise,
  the attention output and MLP-out row-wise. A user plan (``{"glob over names in a block": style}``)
  replaces it. ``torch.distributed.tensor.parallel.parallelize_module`` applies ``ColwiseParallel`` /
  ``RowwiseParallel`` to ``nn.Linear``; Hugging Face's ``Conv1D`` (its weight is stored transposed,
  which DTensor's styles refuse, review [E19]) gets the same styles through subclasses that shard the
  other dimension; a bare fused parameter (``nn.MultiheadAttention.in_proj_weight``) is distributed
  directly.
- **Fused q|k|v** (``"colwise_qkv"``): the output rows are first permuted to a head-aligned order,
  ``[q_r | k_r | v_r]`` for rank r, so that a plain ``Shard(0)`` gives every rank whole heads of all
  three. DCP cannot store DTensor's ``_StridedShard`` (measured: "overlapping chunks"), so checkpoints
  hold the original order: ``TensorParallelLayout.to_full`` undoes the permutation, ``shard`` applies it
  (review M8).
- **Forward**: the block's forward becomes the adapter's ``post(attention(pre(x)))``, written without
  global head counts, so it runs on shards (nanoGPT's own forward derives shapes from the input width
  and cannot, review [E11]). The adapter is verified against the block's own forward on the first real
  call (an unsharded float64 copy, outputs and every gradient; fail closed).
- **Sequence parallelism** (``sequence_parallel=True``; Korthikanti et al., arXiv 2205.05198): between
  the tensor-parallel regions (norms, residual adds, dropout) each rank holds 1/tp of the sequence. The
  column-parallel projections take a ``Shard(1)`` input (all-gather of the sequence), the row-parallel
  ones return ``Shard(1)`` (reduce-scatter instead of all-reduce). The block takes its slice of the
  replicated hidden state on entry and all-gathers its output on exit, so the trunk's interface and
  the user's code are unchanged. The norms' parameters then see 1/tp of the tokens on each rank: their
  gradients are summed over the tp group (``TensorParallelLayout.partial``).
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_parallel.adapters import BlockAdapter, split_forward, verify_on_first_call

STYLES = ("colwise", "rowwise", "colwise_qkv")


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")  # transformers.pytorch_utils.Conv1D


class _Conv1DColwise(ColwiseParallel):
    """``ColwiseParallel`` for ``Conv1D`` (``y = x @ W + b`` with ``W`` of shape (in, out)): W Shard(1)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _distribute(self, module, device_mesh, {"weight": Shard(1), "bias": Shard(0)})


class _Conv1DRowwise(RowwiseParallel):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return _distribute(self, module, device_mesh, {"weight": Shard(0), "bias": Replicate()})


def _distribute(style: Any, module: nn.Module, mesh: DeviceMesh, placements: dict[str, Any]) -> nn.Module:
    from functools import partial

    from torch.distributed.tensor import distribute_module

    def partition(name: str, mod: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, param in list(mod.named_parameters(recurse=False)):
            dist = distribute_tensor(param, device_mesh, [placements[pname]], src_data_rank=None)
            mod.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    return distribute_module(
        module,
        mesh,
        partition,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


def head_aligned(width: int, tp: int) -> Tensor:
    """Row order of a fused [q | k | v] projection (``width`` = 3C rows) that puts rank r's heads of q, k
    and v together: ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``."""
    c, per = width // 3, width // 3 // tp
    return torch.tensor([part * c + r * per + i for r in range(tp) for part in range(3) for i in range(per)])


@dataclass
class TensorParallelLayout:
    """What was sharded and how: the fused projections' permutations (by full parameter name)."""

    mesh: DeviceMesh
    permuted: dict[str, tuple[int, Tensor]] = field(default_factory=dict)  # name -> (dim, permutation)
    partial: list[nn.Parameter] = field(default_factory=list)  # replicated, but see a sequence shard

    def to_full(self, name: str, value: Tensor) -> Tensor:
        """The whole tensor in the original (unpermuted) order; a collective for a DTensor."""
        if not isinstance(value, DTensor):
            return value
        full = value.full_tensor()
        if name in self.permuted:
            dim, perm = self.permuted[name]
            full = full.index_select(dim, torch.argsort(perm))
        return full

    def shard(self, name: str, full: Tensor, like: DTensor) -> DTensor:
        """``full`` (original order) as a DTensor placed like ``like``; local slicing, no communication."""
        if name in self.permuted:
            dim, perm = self.permuted[name]
            full = full.index_select(dim, perm)
        full = full.to(device=like.device, dtype=like.dtype)
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def resolve_plan(block: nn.Module, adapter: BlockAdapter | None, user_plan: dict[str, str] | None) -> dict[str, str]:
    """The plan for one block: the user's patterns expanded to the block's module/parameter names, or the
    adapter's; errors name the class, the pattern or the argument."""
    if user_plan is None:
        if adapter is None:
            raise ValueError(
                f"tensor parallelism does not know the anatomy of {type(block).__name__}: no block-family adapter"
                " matches it; pass tp_plan={'pattern': 'colwise' | 'rowwise' | 'colwise_qkv'} (names inside a block)"
            )
        return adapter.tp_plan(block)
    names = [n for n, _ in block.named_modules() if n] + [n for n, _ in block.named_parameters()]
    plan: dict[str, str] = {}
    for pattern, style in user_plan.items():
        if style not in STYLES:
            raise ValueError(f"tp_plan[{pattern!r}] = {style!r}; choose one of {STYLES}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"tp_plan pattern {pattern!r} matches nothing in {type(block).__name__}")
        plan.update(dict.fromkeys(hits, style))
    return plan


def check_divisible(block: nn.Module, adapter: BlockAdapter | None, plan: dict[str, str], tp: int) -> None:
    """Every sharded width and head count divides by ``tp``; raise naming the numbers and the argument."""
    where = f"tensor_parallel_size={tp}"
    if adapter is not None:
        heads, kv_heads = adapter.head_counts(block)
        for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
            if n % tp:
                raise ValueError(f"{where} must divide the number of {what} ({n}) of {type(block).__name__}")
    for name, style in plan.items():
        target = _target(block, name)
        w = target if isinstance(target, Tensor) else target.weight
        conv = not isinstance(target, Tensor) and _is_conv1d(target)
        out_dim, in_dim = (1, 0) if conv else (0, 1)
        dim, what = (in_dim, "input width") if style == "rowwise" else (out_dim, "output width")
        parts = 3 * tp if style == "colwise_qkv" else tp  # q, k and v each split into tp whole parts
        if w.shape[dim] % parts:
            raise ValueError(
                f"{where} must divide the {what} ({w.shape[dim]}{' = 3 x q|k|v' if parts > tp else ''}) of {name}"
                f" in {type(block).__name__}"
            )


def _target(block: nn.Module, name: str) -> nn.Module | nn.Parameter:
    owner, _, attr = name.rpartition(".")
    parent = block.get_submodule(owner) if owner else block
    value = getattr(parent, attr)
    if not isinstance(value, (nn.Module, nn.Parameter)):
        raise ValueError(f"tp_plan entry {name!r} of {type(block).__name__} is neither a module nor a parameter")
    return value


def parallelize_blocks(
    blocks: Iterable[tuple[str, nn.Module]],
    adapter: BlockAdapter | None,
    mesh: DeviceMesh,
    user_plan: dict[str, str] | None = None,
    sequence_parallel: bool = False,
) -> TensorParallelLayout:
    """Shard each ``(full name prefix, block)`` over the 1-D ``mesh``; returns the layout for checkpoints."""
    tp = mesh.size()
    layout = TensorParallelLayout(mesh)
    if sequence_parallel and adapter is None:
        raise ValueError("tp_sequence_parallel=True needs a block-family adapter (the block's forward is replaced)")
    for i, (prefix, block) in enumerate(blocks):
        plan = resolve_plan(block, adapter, user_plan)
        check_divisible(block, adapter, plan, tp)
        if adapter is not None:  # one block verifies the family
            _TensorParallelForward.install(block, adapter, verify=i == 0, sequence_parallel=sequence_parallel)
        for name, style in plan.items():
            target = _target(block, name)
            if style == "colwise_qkv":
                for pname, dim, perm in _permute_fused(block, name, target, tp):
                    layout.permuted[f"{prefix}{pname}"] = (dim, perm)
            rowwise = style == "rowwise"
            layouts = {"output_layouts": Shard(1)} if rowwise else {"input_layouts": Shard(1)}
            layouts = layouts if sequence_parallel else {}
            if isinstance(target, nn.Parameter):
                _distribute_parameters(block, name, mesh, Shard(1) if sequence_parallel else None)
            elif _is_conv1d(target):
                parallelize_module(target, mesh, (_Conv1DRowwise if rowwise else _Conv1DColwise)(**layouts))
            else:
                parallel = (RowwiseParallel if rowwise else ColwiseParallel)(**layouts)
                parallel.src_data_rank = None  # every rank holds the same full weights: slice locally
                parallelize_module(target, mesh, parallel)
        if sequence_parallel:
            layout.partial += [p for p in block.parameters() if not isinstance(p.data, DTensor)]
    return layout


def _permute_fused(block: nn.Module, name: str, target: Any, tp: int) -> list[tuple[str, int, Tensor]]:
    """Reorder a fused q|k|v projection's outputs head-aligned, in place; returns (param name, dim, perm)."""
    if isinstance(target, nn.Parameter):  # a bare in_proj_weight and its in_proj_bias
        owner, _, attr = name.rpartition(".")
        parent = block.get_submodule(owner) if owner else block
        pairs = [(name, target, 0)]
        bias_name = attr.replace("weight", "bias")
        bias = getattr(parent, bias_name, None) if bias_name != attr else None
        if isinstance(bias, nn.Parameter):
            pairs.append((f"{owner}.{bias_name}" if owner else bias_name, bias, 0))
    else:
        out_dim = 1 if _is_conv1d(target) else 0
        pairs = [(f"{name}.weight", target.weight, out_dim)]
        if getattr(target, "bias", None) is not None:
            pairs.append((f"{name}.bias", target.bias, 0))
    perm = head_aligned(pairs[0][1].shape[pairs[0][2]], tp)
    with torch.no_grad():
        for _, param, dim in pairs:
            param.copy_(param.index_select(dim, perm))
    return [(pname, dim, perm) for pname, _, dim in pairs]


def _distribute_parameters(block: nn.Module, name: str, mesh: DeviceMesh, input_layout: Any) -> None:
    owner, _, attr = name.rpartition(".")
    parent = block.get_submodule(owner) if owner else block
    names = [attr] + ([attr.replace("weight", "bias")] if "weight" in attr else [])
    for pname in names:
        param = getattr(parent, pname, None)
        if isinstance(param, nn.Parameter) and not isinstance(param.data, DTensor):
            dist = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
            new = nn.Parameter(dist, requires_grad=param.requires_grad)
            new._lp_input_layout = input_layout  # read by the adapter that applies it (a Shard(1) input: SP)
            setattr(parent, pname, new)


class _TensorParallelForward:
    """The block's forward under tensor parallelism: the adapter's split forward. On the first call with
    gradients it verifies the adapter on the real input against an unsharded copy of the block."""

    def __init__(
        self, block: nn.Module, adapter: BlockAdapter, reference: nn.Module | None, sequence_parallel: bool
    ) -> None:
        self.block, self.adapter, self.reference, self.sequence_parallel = block, adapter, reference, sequence_parallel

    @classmethod
    def install(cls, block: nn.Module, adapter: BlockAdapter, verify: bool, sequence_parallel: bool) -> None:
        block.forward = cls(block, adapter, copy.deepcopy(block) if verify else None, sequence_parallel)
        if verify:  # a pre-hook runs outside any recomputation, and only once per call
            block.register_forward_pre_hook(verify_on_first_call, with_kwargs=True)

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.sequence_parallel:
            return split_forward(self.adapter, self.block, x, args, kwargs)
        mesh = _mesh_of(self.block)
        tp, T = mesh.size(), x.shape[1]
        if T % tp:
            raise ValueError(
                f"tp_sequence_parallel=True needs the sequence length ({T}) to be divisible by"
                f" tensor_parallel_size ({tp}); pad the batch or turn tp_sequence_parallel off"
            )
        mine = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
        out = split_forward(self.adapter, self.block, mine.to_local(), args, kwargs)
        whole = DTensor.from_local(out, mesh, [Shard(1)], run_check=False).redistribute(placements=[Replicate()])
        return whole.to_local()


def _mesh_of(block: nn.Module) -> DeviceMesh:
    return next(p for p in block.parameters() if isinstance(p.data, DTensor)).device_mesh


def local(t: Tensor) -> Tensor:
    """This rank's part of a (possibly DTensor) tensor, sharing storage."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(t: Tensor) -> bool:
    return isinstance(t, DTensor) and any(not isinstance(p, Replicate) for p in t.placements)
