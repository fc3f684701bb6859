"""Tensor parallelism for unchanged blocks (Megatron-LM, Shoeybi et al., arXiv 1909.08053), on DTensor.

Per block of the trunk, with the block's anatomy (:mod:`lightning_parallel.anatomy`):

- **Plan**: the anatomy names the projections: q, k, v (or the fused q|k|v) and MLP-in column-wise,
  the attention output and MLP-out row-wise. A user plan (``{"glob over names in a block": style}``)
  replaces it. ``torch.distributed.tensor.parallel.parallelize_module`` applies ``ColwiseParallel`` /
  ``RowwiseParallel`` to ``nn.Linear``; Hugging Face's ``Conv1D`` (its weight is stored transposed,
  which DTensor's styles refuse) gets the same styles through subclasses that shard the
  other dimension; a bare fused parameter (``nn.MultiheadAttention.in_proj_weight``) is distributed
  directly.
- **Fused q|k|v** (``"colwise_qkv"``): the output rows are first permuted to a head-aligned order,
  ``[q_r | k_r | v_r]`` for rank r, so that a plain ``Shard(0)`` gives every rank whole heads of all
  three. DCP cannot store DTensor's ``_StridedShard`` (measured: "overlapping chunks"), so checkpoints
  hold the original order: ``TensorParallelLayout.to_full`` undoes the permutation, ``shard`` applies it.
- **Forward**: which code runs on the shards is the block anatomy's choice (:mod:`lightning_parallel.anatomy`):
  a hand-written adapter's shape-agnostic split forward, the block's own forward where it is
  shape-agnostic (Hugging Face families with a ``base_model_tp_plan``), or the block's traced graph
  with its head-count-dependent shapes localised. The block layer verifies the result against the
  block's own forward on the first real call (float64, outputs and every gradient; fail closed).
- **Sequence parallelism** (``sequence_parallel=True``; Korthikanti et al., arXiv 2205.05198): between
  the tensor-parallel regions (norms, residual adds, dropout) each rank holds 1/tp of the sequence. The
  column-parallel projections take a ``Shard(1)`` input (all-gather of the sequence), the row-parallel
  ones return ``Shard(1)`` (reduce-scatter instead of all-reduce). The block takes its slice of the
  replicated hidden state on entry and all-gathers its output on exit, so the trunk's interface and
  the user's code are unchanged. The norms' parameters then see 1/tp of the tokens on each rank: their
  gradients are summed over the tp group (``TensorParallelLayout.partial``).

Over 400 lines because every tensor-parallel style (transformers' plan styles and the ones this package adds)
is applied here on DTensor, with the vocabulary-parallel embedding and heads.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_parallel import _collectives
from lightning_parallel.block_protocol import ClassForward
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.expert_parallel import EP_AXIS
from lightning_parallel.trunk import vocabulary_modules

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


@dataclass
class TensorParallelLayout:
    """What was sharded and how: the fused projections' permutations (by full parameter name)."""

    mesh: DeviceMesh
    permuted: dict[str, tuple[int, Tensor]] = field(default_factory=dict)  # name -> (dim, permutation)
    partial: list[nn.Parameter] = field(default_factory=list)  # replicated, but see a sequence shard

    def to_full(self, name: str, value: Tensor) -> Tensor:
        """The whole tensor in the original (unpermuted) order; a collective for a DTensor (an expert sharded over
        expert parallelism's axis stays as it is: its gradient in a verification is compared rank by rank)."""
        if not isinstance(value, DTensor) or EP_AXIS in (value.device_mesh.mesh_dim_names or ()):
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


def expand_plan(block: nn.Module, user_plan: dict[str, str]) -> dict[str, str]:
    """The user's patterns (globs over module/parameter names inside a block) expanded to the block's names;
    errors name the class, the pattern or the style."""
    names = [n for n, _ in block.named_modules() if n] + [n for n, _ in block.named_parameters()]
    plan: dict[str, str] = {}
    for pattern, style in user_plan.items():
        if style not in STYLES:
            raise ConfigurationError(f"tp_plan[{pattern!r}] = {style!r}; choose one of {STYLES}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ConfigurationError(f"tp_plan pattern {pattern!r} matches nothing in {type(block).__name__}")
        plan.update(dict.fromkeys(hits, style))
    return plan


def check_heads(block: nn.Module, heads: tuple[int, int], tp: int) -> None:
    """Tensor parallelism splits whole heads: both head counts must divide by ``tp``."""
    for what, n in zip(("attention heads", "key/value heads"), heads):
        if n % tp:
            raise ConfigurationError(
                f"tensor_parallel_size={tp} must divide the number of {what} ({n}) of {type(block).__name__};"
                f" sizes that divide it: {[d for d in range(2, n + 1) if n % d == 0]}"
            )


def check_divisible(block: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Every sharded width divides by ``tp`` (3 x tp for a fused q|k|v); raise naming the numbers."""
    for name, style in plan.items():
        if style not in _SHARDED:
            continue
        target = _target(block, name)
        w = target if isinstance(target, Tensor) else target.weight
        conv = not isinstance(target, Tensor) and _is_conv1d(target)
        out_dim, in_dim = (1, 0) if conv else (w.dim() - 2, w.dim() - 1)
        dim, what = (in_dim, "input width") if style == "rowwise" else (out_dim, "output width")
        if style == "packed_rowwise":  # x @ W: the packed outputs on the last dim
            dim, what = w.dim() - 1, "packed output width"
        parts = {"colwise_qkv": 3, "packed_colwise": 2, "packed_rowwise": 2}.get(style, 1) * tp  # fused parts / tp
        if w.shape[dim] % parts:
            fused = f" = {parts // tp} fused parts" if parts > tp else ""
            raise ConfigurationError(
                f"tensor_parallel_size={tp} must divide the {what} ({w.shape[dim]}{fused}) of {name}"
                f" in {type(block).__name__}"
            )


# styles a block-level plan may use; the first three are the user-facing ones (``STYLES``)
_SHARDED = ("colwise", "rowwise", "colwise_qkv", "packed_colwise", "colwise_replicated_output",
            "rowwise_replicated_input", "packed_rowwise")  # fmt: skip
_ALL_STYLES = _SHARDED + ("replicated_partial_grad", "experts_partial_output", "replicated_tail_grad")
#: ``replicated_tail_grad:<n>``: a replicated projection whose last ``n`` outputs go to this rank's heads without
#: a column-parallel module between (latent attention's shared rope key, DeepSeek-V3's ``kv_a_proj_with_mqa``)
TAIL_GRAD = "replicated_tail_grad"


def shard_modules(
    block: nn.Module, prefix: str, plan: dict[str, str], mesh: DeviceMesh, layout: TensorParallelLayout,
    sequence_parallel: bool = False,
) -> None:  # fmt: skip
    """Shard ``block`` (whose full parameter names start with ``prefix``) over the 1-D ``mesh`` by module
    styles: ``parallelize_module``'s ``ColwiseParallel`` / ``RowwiseParallel`` on ``nn.Linear`` (and the
    ``Conv1D`` subclasses), bare fused parameters distributed directly. Records permutations and the
    replicated parameters whose gradients are partial in ``layout``. The column-parallel modules enter, the
    row-parallel ones leave this rank's dropout stream (:mod:`lightning_parallel.rng`, forward hooks). Experts
    sharded by expert parallelism stay whole over tp (each tp rank computes its ep group's rows for them)."""
    from lightning_parallel.expert_parallel import ExpertParallelForward

    expert = [n for n, m in block.named_modules() if isinstance(m.__dict__.get("forward"), ExpertParallelForward)]
    plan = {k: v for k, v in plan.items() if not any(k == e or k.startswith(f"{e}.") for e in expert)}
    enters, leaves = [], []
    for name, style in plan.items():
        if style.partition(":")[0] not in _ALL_STYLES:
            raise ValueError(f"tensor-parallel style {style!r} of {name!r} is not supported; known: {_ALL_STYLES}")
        target = _target(block, name)
        if style.startswith(f"{TAIL_GRAD}:"):
            target.register_forward_hook(_TailGrad(int(style.partition(":")[2]), mesh.get_group()))
            continue
        if style == "replicated_partial_grad":
            layout.partial += [target] if isinstance(target, nn.Parameter) else list(target.parameters())
            continue
        if style == "experts_partial_output":
            target.forward = _LocalCompute(target, mesh)
            continue
        if style in ("colwise_qkv", "packed_colwise", "packed_rowwise"):
            for pname, dim, perm in _permute_fused(
                block, name, target, tp=mesh.size(), parts=3 if style == "colwise_qkv" else 2,
                last=style == "packed_rowwise",
            ):  # fmt: skip
                layout.permuted[f"{prefix}{pname}"] = (dim, perm)
        rowwise = style in ("rowwise", "rowwise_replicated_input", "packed_rowwise")
        if rowwise or style != "colwise_replicated_output":
            (leaves if rowwise else enters).append(target)
        if isinstance(target, nn.Parameter):
            _distribute_parameters(block, name, mesh, rowwise)
            continue
        layouts: dict[str, Any] = {}
        if sequence_parallel:
            layouts = {"output_layouts": Shard(1)} if rowwise else {"input_layouts": Shard(1)}
        if style == "colwise_replicated_output":
            layouts["output_layouts"] = Replicate()
        if style == "rowwise_replicated_input":
            layouts["input_layouts"] = Replicate()
        if _is_conv1d(target):
            parallelize_module(target, mesh, (_Conv1DRowwise if rowwise else _Conv1DColwise)(**layouts))
        else:
            parallel = (RowwiseParallel if rowwise else ColwiseParallel)(**layouts)
            parallel.src_data_rank = None  # every rank holds the same full weights: slice locally
            parallelize_module(target, mesh, parallel)
        if rowwise and isinstance(target, nn.Module):
            target.register_forward_hook(_owned)
    _dropout_regions(enters, leaves)
    if sequence_parallel:
        layout.partial += [p for p in block.parameters() if not isinstance(p.data, DTensor)]


def _owned(module: nn.Module, args: Any, output: Any) -> Any:
    """A row-parallel module's output as a tensor of its own: DTensor's ``to_local`` returns a view made by a custom
    function, which autograd forbids writing into, and a model may add to it in place (Llama 4's MoE:
    ``out = self.shared_expert(h); out.add_(routed)``)."""
    return output.clone() if isinstance(output, Tensor) and output._is_view() else output


def _dropout_regions(enters: list[Any], leaves: list[Any]) -> None:
    """Between a column-parallel module's output and a row-parallel module's input the activations are
    sharded: dropout there draws from this rank's stream (:mod:`lightning_parallel.rng`; a no-op outside the
    block layer's scope). Only where every row-parallel target is a module, whose hook ends the region before
    its reduction (a bare row-parallel parameter could leave it open over replicated activations); an attention
    core behind a bare column-parallel parameter enters by itself (:func:`lightning_parallel.rng.sharded`)."""
    from lightning_parallel import rng

    if any(not isinstance(t, nn.Module) for t in leaves):
        return
    for module in leaves:
        module.register_forward_pre_hook(rng.leave_sharded)
    for module in enters:
        if isinstance(module, nn.Module):
            module.register_forward_hook(rng.enter_sharded)


def _target(block: nn.Module, name: str) -> nn.Module | nn.Parameter:
    owner, _, attr = name.rpartition(".")
    parent = block.get_submodule(owner) if owner else block
    value = getattr(parent, attr)
    if not isinstance(value, (nn.Module, nn.Parameter)):
        raise ValueError(f"tp_plan entry {name!r} of {type(block).__name__} is neither a module nor a parameter")
    return value


def _permute_fused(
    block: nn.Module, name: str, target: Any, tp: int, parts: int, last: bool = False
) -> list[tuple[str, int, Tensor]]:
    """Reorder a fused projection's outputs (``parts`` equal parts, e.g. q|k|v) rank-aligned, in place;
    returns (param name, dim, perm). ``last``: a bare weight applied as ``x @ W`` (its outputs on the last dim,
    a 3-D expert weight ``(experts, in, gate|up)``: transformers' ``packed_rowwise``)."""
    if isinstance(target, nn.Parameter):  # a bare in_proj_weight and its in_proj_bias, or a 3-d expert weight
        owner, _, attr = name.rpartition(".")
        parent = block.get_submodule(owner) if owner else block
        pairs = [(name, target, target.dim() - (1 if last else 2))]
        bias_name = attr.replace("weight", "bias")
        bias = getattr(parent, bias_name, None) if bias_name != attr else None
        if isinstance(bias, nn.Parameter):
            pairs.append((f"{owner}.{bias_name}" if owner else bias_name, bias, bias.dim() - 1))
    else:
        out_dim = 1 if _is_conv1d(target) else 0
        pairs = [(f"{name}.weight", target.weight, out_dim)]
        if getattr(target, "bias", None) is not None:
            pairs.append((f"{name}.bias", target.bias, 0))
    width = pairs[0][1].shape[pairs[0][2]]
    perm = rank_aligned([width // parts] * parts, tp)
    with torch.no_grad():
        for _, param, dim in pairs:
            param.copy_(param.index_select(dim, perm))
    return [(pname, dim, perm) for pname, _, dim in pairs]


def rank_aligned(parts: list[int], tp: int) -> Tensor:
    """Order of a fused dimension made of ``parts`` (sizes) that gives rank r, under a plain ``Shard``,
    its slice of every part: ``[p0_0 p1_0 p2_0 | p0_1 p1_1 p2_1 | ...]``."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    return torch.tensor(
        [s + r * (n // tp) + i for r in range(tp) for s, n in zip(starts, parts) for i in range(n // tp)]
    )


def _distribute_parameters(block: nn.Module, name: str, mesh: DeviceMesh, rowwise: bool) -> None:
    """A bare parameter (and its ``bias`` twin): column-wise on its output dim (-2; a bias on -1), row-wise
    on its input dim (-1; a row-wise bias stays whole)."""
    owner, _, attr = name.rpartition(".")
    parent = block.get_submodule(owner) if owner else block
    names = [attr] + ([attr.replace("weight", "bias")] if "weight" in attr else [])
    for pname in names:
        param = getattr(parent, pname, None)
        if not isinstance(param, nn.Parameter) or isinstance(param.data, DTensor):
            continue
        if param.dim() == 1:
            placement = Replicate() if rowwise else Shard(0)
        else:
            placement = Shard(param.dim() - 1) if rowwise else Shard(param.dim() - 2)
        dist = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
        setattr(parent, pname, nn.Parameter(dist, requires_grad=param.requires_grad))


class _TailGrad:
    """Forward hook of a replicated projection whose last ``n`` outputs reach this rank's heads directly (latent
    attention's rope key, shared by every head: ``split -> k_rot -> attention``): their gradient is this rank's
    heads' share, summed over the tensor-parallel group (identity forward, all-reduce backward). The other outputs
    reach a column-parallel module, whose input gradient is already the sum. So the projection's own gradient is
    whole on every rank, as transformers' ``MlaKvAProjParallel`` and Megatron's replicated layers give it."""

    def __init__(self, n: int, group: Any) -> None:
        self.n, self.group = n, group

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        head, tail = output.split([output.shape[-1] - self.n, self.n], dim=-1)
        return torch.cat([head, _collectives.copy_to_group(tail, self.group)], dim=-1)


class _LocalCompute:
    """A module's forward on the local parts of its sharded parameters (``torch.func.functional_call``),
    its partial output all-reduced over the tensor-parallel group (a mixture of experts whose experts'
    inner widths are sharded)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh) -> None:
        self.module, self.mesh = module, mesh

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        params = {f"module.{n}": p.to_local() for n, p in self.module.named_parameters() if isinstance(p, DTensor)}
        group = self.mesh.get_group()
        # every floating input's gradient (the hidden state, the routing weights) is summed over the ranks
        args = tuple(_collectives.copy_to_group(a, group) if _floating(a) else a for a in args)
        from lightning_parallel.rng import sharded

        with sharded():  # the experts' inner widths are sharded: their dropout draws from this rank's stream
            out = torch.func.functional_call(
                ClassForward(self.module), params, args, kwargs, strict=False, tie_weights=False
            )
        return _collectives.reduce_from_group(out, group)


def _floating(t: Any) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad


def shard_vocabulary(module: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh) -> list[str]:
    """Vocabulary parallelism outside the trunk (Megatron-LM's vocabulary-parallel embedding; Shoeybi et al.,
    arXiv 1909.08053, section 3): the token embedding and the LM head hold 1/tp of the vocabulary each.

    The vocabulary and its modules are :func:`lightning_parallel.trunk.vocabulary_modules`'s. The embedding is
    sharded row-wise (``RowwiseParallel``: each rank looks up the ids it holds, zeros elsewhere, one
    all-reduce); every ``nn.Linear`` outside ``blocks`` whose output width is the vocabulary is sharded
    column-wise with its logits all-gathered (``ColwiseParallel(output_layouts=Replicate())``), so the
    user's loss sees whole logits and any loss works (``loss_chunks=`` computes the loss from each rank's
    columns instead, :mod:`lightning_parallel.chunked_loss`). A weight tied between the two stays one parameter
    (both shard dim 0 of the (vocabulary, hidden) matrix). Shards are uneven where tp does not divide the
    vocabulary. An embedding with ``padding_idx``, ``max_norm`` or sparse gradients stays whole (the row
    offsets of a shard would change what they mean), and so does every module tied to it. Returns the
    names of the sharded modules."""
    vocab, chosen = vocabulary_modules(module, blocks)
    if vocab < mesh.size():
        return []
    holders: dict[int, list[nn.Module]] = {}  # parameter -> every module holding it (tied weights: several)
    for m in [*module.modules()]:
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), []).append(m)
    ok = {id(m) for _, m in chosen if _plain(m)}
    sharded: dict[int, nn.Parameter] = {}
    names = []
    for name, m in chosen:
        weight = id(m.weight)
        if weight not in sharded and not all(id(h) in ok for h in holders[weight]):
            continue  # tied to a module that must stay whole (or to one inside the trunk)
        if isinstance(m, nn.Embedding):
            style: Any = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        else:
            style = ColwiseParallel(output_layouts=Replicate())
        tied = sharded.get(weight)
        # tp rank 0's values (ranks that initialised differently), in place: no scatter buffer of the whole matrix;
        # then each rank slices its rows locally
        whole = [t.data for n, t in m.named_parameters(recurse=False) if not (tied is not None and n == "weight")]
        _collectives.broadcast_(whole, mesh.get_group())
        style.src_data_rank = None
        if tied is not None:  # the second module of a tied pair: no second shard of the full weight
            del m._parameters["weight"]
        parallelize_module(m, mesh, style)
        if tied is not None:
            m.register_parameter("weight", tied)
        else:
            sharded[weight] = m.weight
        names.append(name)
    return names


def _plain(m: nn.Module) -> bool:
    """A module whose vocabulary dimension can be sharded as it is."""
    if isinstance(m, nn.Embedding):
        return m.padding_idx is None and m.max_norm is None and not m.sparse
    return isinstance(m, nn.Linear)


def local(t: Tensor) -> Tensor:
    """This rank's part of a (possibly DTensor) tensor, sharing storage."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(t: Tensor, axis: str = "tp") -> bool:
    """Whether ``t`` is a DTensor cut along the mesh dimension named ``axis`` (a pipeline-sharded parameter
    outside the trunk is a DTensor too, replicated along tp)."""
    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return any(n == axis and not isinstance(p, Replicate) for n, p in zip(names, t.placements))
