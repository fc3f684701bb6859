"""Expert parallelism: a mixture's experts sharded over the ranks of an expert-parallel group, each token sent to
its experts' ranks and back by all-to-all with variable splits (GShard, Lepikhin et al., arXiv 2006.16668, §2;
dropless as MegaBlocks, Gale et al., arXiv 2211.15841: no capacity factor, no token dropped). Which modules are
experts is the anatomy's knowledge (:mod:`lightning_parallel.anatomy.experts`); this module is the mechanism.

The cut is the experts module's call ``experts(hidden (N, H), top_k_index (N, k), top_k_weights (N, k))``
(transformers 5's mixtures: Mixtral, Qwen2/3-MoE, DeepSeek-V3, GPT-OSS), made after the model's own router has
chosen each token's experts, once, on the token's rank. With ``E`` experts over ``ep`` ranks, rank r holds experts
``r·E/ep .. (r+1)·E/ep - 1``. Per call:

1. dispatch (:func:`route`, :func:`dispatch`): the ``N·k`` (token, choice) pairs sorted by expert (stable); an
   all-to-all of the ``E`` counts tells each rank how many rows every peer sends to each of its experts; then
   the rows travel;
2. the module's own (class) forward runs on the received rows with its local experts (the local parts of its
   expert parameters, DTensors sharded by expert over the ep mesh: a checkpoint holds each expert once), each row
   routed to one local expert with weight 1, so a row's output is exactly ``expert(row)`` as the model's code
   computes it (its gate, biases, activation and weight layout alike);
3. combine (:func:`combine`): the rows go back by the reverse all-to-all, are put back in pair order, and each
   token's output is ``Σ_j weight_j · y_j`` over its k choices, on the token's rank.

The backward of each all-to-all is the reverse one (:func:`lightning_parallel._collectives.all_to_all_rows`): an
expert's weight gradient on its rank sums every peer's tokens routed to it, each token's gradient returns to its
rank, and the routing weights' gradient is computed where the router ran.

A home-written mixture (an ``nn.ModuleList`` of ``E`` alike experts and a router ``nn.Linear(_, E)`` beside it,
its own loop calling ``experts[e](rows)``) is cut at its experts' calls (:class:`ListExperts`): its forward runs
twice, first recording each call's rows (the calls answered with zeros; the random state restored after), then
one dispatch of every call's rows as above, each received row computed by its expert on its rank, one combine;
the second run gets each call's rows computed. One all-to-all pair per mixture call, whatever the order of the
calls and the experts the loop skips, so the backward's reverse pair is one chain, the same on every rank. The
other ranks' experts are on meta (each rank holds and saves ``E/ep`` of them, as a pipeline stage its blocks).

Over 400 lines because the three kinds of experts (routed, dense, a home-written list) share one route, dispatch
and combine, and the cut by tracing (one op per call) serves the first two.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_parallel import _collectives
from lightning_parallel.block_protocol import ClassForward, Shared
from lightning_parallel.errors import ConfigurationError, Unsupported


@dataclass(frozen=True)
class Routing:
    """One call's traffic: ``order`` sorts the ``N·k`` pairs by expert; ``send[j]`` / ``recv[j]`` rows go to / come
    from ep rank j; ``local[m]`` is the local expert of received row m."""

    order: Tensor
    send: list[int]
    recv: list[int]
    local: Tensor


def route(top_k_index: Tensor, num_experts: int, group: Any) -> Routing:
    """Where each of this rank's (token, choice) pairs goes (step 1 of the module docstring): one all-to-all of
    the per-expert counts."""
    ep = _collectives.group_size(group)
    per_rank = num_experts // ep
    flat = top_k_index.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    received = _collectives.all_to_all_counts(counts, group)  # [source rank][local expert]
    local = torch.arange(per_rank, device=flat.device).repeat(ep).repeat_interleave(received)
    send = counts.view(ep, per_rank).sum(1).tolist()
    recv = received.view(ep, per_rank).sum(1).tolist()
    return Routing(torch.argsort(flat, stable=True), send, recv, local)


def dispatch(hidden: Tensor, routing: Routing, k: int, group: Any) -> Tensor:
    """The rows this rank's experts compute: every peer's pairs routed here, by source rank, then local expert."""
    return _collectives.all_to_all_rows(hidden[routing.order // k], routing.send, routing.recv, group)


def combine_rows(rows: Tensor, routing: Routing, group: Any) -> Tensor:
    """The rows computed on their experts' ranks back on this rank, in (token, choice) pair order."""
    back = _collectives.all_to_all_rows(rows, routing.recv, routing.send, group)
    return back[torch.argsort(routing.order)]


def combine(rows: Tensor, routing: Routing, top_k_weights: Tensor, group: Any) -> Tensor:
    """Each token's output from its experts' ``rows`` (computed on their ranks): ``Σ_j weight_j · y_j``."""
    pairs = combine_rows(rows, routing, group)
    n, k = top_k_weights.shape
    return (pairs.view(n, k, -1) * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(1)


def _joined(out: Tensor, rows: Tensor, params: Iterator[nn.Parameter]) -> Tensor:
    """``out`` (exactly: plus zeros) joined to the autograd graph of the received ``rows`` and of this rank's
    experts: a rank no row reached (its experts' code returns zeros without history) still runs the reverse
    all-to-alls in the backward, as its peers do."""
    for t in (rows, *(p.to_local() if isinstance(p, DTensor) else p for p in params)):
        if t.requires_grad:
            out = out + t.reshape(-1)[:0].sum().to(out.dtype)
    return out


def is_dense(module: nn.Module) -> bool:
    """Dense stacked experts (:mod:`lightning_parallel.anatomy.experts`): called as ``experts(rows)``, every own
    parameter stacked by expert, weights 3-D (not a router's ``(E, H)`` weight)."""
    params = list(inspect.signature(type(module).forward).parameters)[1:]
    own = list(module.parameters(recurse=False))
    whole = own and len(stacked(module, module.num_experts)) == len(own) and any(p.dim() >= 3 for p in own)
    return len(params) == 1 and bool(whole)


def stacked(module: nn.Module, num_experts: int) -> list[str]:
    """The module's own parameters stacked by expert (dim 0 of size ``num_experts``): what :func:`shard_experts`
    cuts."""
    return [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == num_experts]


def check_experts(num_experts: int, ep: int, where: str) -> None:
    """Refuse a split the experts cannot take, naming the numbers and the argument."""
    if num_experts % ep:
        raise ConfigurationError(
            f"{where} has {num_experts} experts, which expert_parallel_size={ep} does not divide; choose an"
            f" expert_parallel_size that divides {num_experts}"
        )


#: the expert-parallel mesh axis's name (a part of dp x sp: the set-up broadcasts along dp and sp leave its shards
#: alone) and that of the ranks holding the same experts
EP_AXIS, REPLICA_AXIS = "dp_sp_ep", "dp_sp_replicate"

#: while a block is traced (:func:`tracing`): each experts module's path in the traced copy, by ``id``
_TRACED: dict[int, str] = {}


@contextmanager
def tracing(block: nn.Module) -> Iterator[None]:
    """While ``block`` (a copy) is traced, its expert-parallel calls are one op each (:func:`experts_call`):
    their all-to-alls have sizes only the data decide, which ``torch.export`` cannot trace."""
    _TRACED.update({id(m): name for name, m in block.named_modules()})
    try:
        yield
    finally:
        _TRACED.clear()


@torch.library.custom_op("lightning_parallel::experts", mutates_args=())
def experts_call(hidden: Tensor, top_k_index: Optional[Tensor], top_k_weights: Optional[Tensor], path: str) -> Tensor:
    """An expert-parallel experts call (the module at ``path`` in the block) as one op of a traced graph; the
    traced program calls the module there instead (:func:`call_experts`), so this body never runs."""
    raise RuntimeError("lightning_parallel::experts runs only inside a traced program")


@experts_call.register_fake
def _(hidden: Tensor, top_k_index: Optional[Tensor], top_k_weights: Optional[Tensor], path: str) -> Tensor:
    return hidden.new_empty(hidden.shape)


def call_experts(block: nn.Module, hidden: Tensor, top_k_index: Optional[Tensor], top_k_weights: Optional[Tensor],
                 path: str) -> Tensor:  # fmt: skip
    """What a traced program runs for :func:`experts_call`: the block's experts module at ``path``."""
    experts = block.get_submodule(path)
    return experts(hidden) if top_k_index is None else experts(hidden, top_k_index, top_k_weights)  # type: ignore


class ExpertParallelForward:
    """An experts module's call under expert parallelism (module docstring): its class forward runs on the local
    parts of its expert parameters (DTensors sharded by expert over the ep mesh), on the rows sent here."""

    def __init__(self, module: nn.Module, num_experts: int, mesh: DeviceMesh, replicas: Any = None) -> None:
        self.module, self.num_experts, self.mesh = module, num_experts, mesh
        self.replicas = replicas  # the group of the ranks holding the same experts (:func:`over_replicas`)
        self.dense = len(inspect.signature(type(module).forward).parameters) == 2  # (self, rows): is_dense

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        bound = inspect.signature(type(self.module).forward).bind(self.module, *args, **kwargs)
        if self.dense:
            hidden, top_k_index, top_k_weights = list(bound.arguments.values())[1], None, None
        else:
            hidden, top_k_index, top_k_weights = list(bound.arguments.values())[1:4]
        if torch.compiler.is_exporting() and id(self.module) in _TRACED:
            return experts_call(hidden, top_k_index, top_k_weights, _TRACED[id(self.module)])
        if top_k_index is None:
            return self._dense(hidden)
        group = self.mesh.get_group()
        routing = route(top_k_index, self.num_experts, group)
        rows = dispatch(hidden, routing, top_k_index.shape[-1], group)
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        out = self._own(rows, routing.local.unsqueeze(1), ones)
        return combine(_joined(out, rows, self.module.parameters()), routing, top_k_weights, group)

    def _own(self, *args: Tensor) -> Tensor:
        """The module's class forward on its local experts."""
        mine = {f"module.{n}": p.to_local() for n, p in self.module.named_parameters() if isinstance(p, DTensor)}
        return torch.func.functional_call(ClassForward(self.module), mine, args, strict=False)  # type: ignore

    def _dense(self, hidden: Tensor) -> Tensor:
        """Dense experts (:func:`_dense`): each rank's block of rows for expert e goes to e's rank, which computes
        its experts on every rank's rows (block e: the ranks' rows in rank order), and back."""
        group, ep = self.mesh.get_group(), self.mesh.size()
        per_rank, n = self.num_experts // ep, hidden.shape[0] // self.num_experts
        sizes = _collectives.all_to_all_counts(torch.full((ep,), n, device=hidden.device), group).tolist()
        rows = _collectives.all_to_all_rows(hidden, [per_rank * n] * ep, [per_rank * m for m in sizes], group)
        blocks = [r.view(per_rank, m, -1) for r, m in zip(rows.split([per_rank * m for m in sizes]), sizes)]
        out = self._own(torch.cat(blocks, dim=1).flatten(0, 1))
        back = out.view(per_rank, sum(sizes), -1).split(sizes, dim=1)
        mine = torch.cat([b.flatten(0, 1) for b in back])
        return _collectives.all_to_all_rows(mine, [per_rank * m for m in sizes], [per_rank * n] * ep, group)

    def __deepcopy__(self, memo: dict) -> ExpertParallelForward:
        """A copy of the module (a block's verification copy) calls its own copy's experts."""
        return ExpertParallelForward(memo.get(id(self.module), self.module), self.num_experts, self.mesh, self.replicas)


# ------------------------------------------------------------------------------ a home-written mixture
class _ExpertCall(Shared):
    """An expert of a cut mixture: its call is answered by the mixture's :class:`ListExperts`."""

    def __init__(self, mixture: ListExperts, index: int) -> None:
        self.mixture, self.index = mixture, index

    def __call__(self, rows: Tensor) -> Tensor:
        return self.mixture.answer(self.index, rows)


class ListExperts:
    """A home-written mixture's forward under expert parallelism (module docstring): its own forward, run to
    record its experts' calls, then again with each call's rows computed on their expert's rank."""

    def __init__(self, module: nn.Module, experts: nn.ModuleList, mesh: DeviceMesh, replicas: Any = None) -> None:
        self.module, self.experts, self.mesh, self.replicas = module, experts, mesh, replicas
        self.calls: list[tuple[int, Tensor]] = []
        self.answers: Optional[list[Tensor]] = None  # the second run's (None: the first's)
        self.recording = False
        self.tails: dict[tuple[int, ...], tuple[int, ...]] = {}  # an expert's output's trailing shape, by its input's
        for i, expert in enumerate(experts):
            expert.forward = _ExpertCall(self, i)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_exporting():
            if id(self.module) in _TRACED and len(args) == 1 and not kwargs and isinstance(args[0], Tensor):
                # one op of the traced block, run by the mixture at its place (its output shaped as its input:
                # a mixture added to the residual stream; the block's verification checks it)
                return experts_call(args[0], None, None, _TRACED[id(self.module)])
            raise Unsupported(
                f"{type(self.module).__name__} (a home-written mixture under expert parallelism) runs its forward"
                " twice around one all-to-all, which torch.export cannot trace; while a block is traced, only a"
                " mixture called on one tensor is one op"
            )
        own = type(self.module).forward
        device = next((p.device for p in self.module.parameters() if not p.is_meta), torch.device("cpu"))
        self.calls, self.answers, self.recording = [], None, True
        try:  # its random draws (a router's noise) are the second run's
            with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
                own(self.module, *args, **kwargs)
        finally:
            self.recording = False
        answers = self._exchange()
        self.answers, calls = answers, len(answers)
        try:
            out = own(self.module, *args, **kwargs)
            left = len(self.answers)
        finally:
            self.calls, self.answers = [], None
        if left:
            raise ConfigurationError(
                f"{type(self.module).__name__} called its experts {calls - left} time(s) in its second run and {calls}"
                " in its first: expert parallelism needs a mixture whose forward calls its experts alike each time"
            )
        return out

    def answer(self, index: int, rows: Tensor) -> Tensor:
        """An expert's call: recorded (answered with zeros) in the first run, its computed rows in the second."""
        if self.recording:
            self.calls.append((index, rows))
            return rows.new_zeros(rows.shape[:-1] + self._out_tail(rows))
        if self.answers is None:
            raise RuntimeError(
                f"expert {index} of {type(self.module).__name__} was called outside its mixture's forward: under"
                " expert parallelism its rank may not hold it"
            )
        if not self.answers or self.calls[0][0] != index or not torch.equal(self.calls[0][1], rows):
            raise ConfigurationError(
                f"{type(self.module).__name__} called expert {index} on {tuple(rows.shape)} rows in its second run,"
                " not on the rows of its first: expert parallelism needs a mixture whose forward calls its experts"
                " alike each time, each on rows that no expert's output computed (not one expert after another)"
            )
        self.calls.pop(0)
        return self.answers.pop(0)

    def _out_tail(self, rows: Tensor) -> tuple[int, ...]:
        """The trailing shape of an expert's output (a local expert on no rows, once per input shape)."""
        key = tuple(rows.shape[1:])
        if key not in self.tails:
            mine = next(e for e in self.experts if not any(p.is_meta for p in e.parameters()))
            with torch.no_grad():
                self.tails[key] = tuple(type(mine).forward(mine, rows[:0]).shape[1:])
        return self.tails[key]

    def _exchange(self) -> list[Tensor]:
        """Every recorded call's rows to its expert's rank, computed there, and back (one all-to-all pair)."""
        group, total = self.mesh.get_group(), len(self.experts)
        if not self.calls:  # (every token chooses an expert: only an empty batch calls none)
            raise ConfigurationError(f"{type(self.module).__name__} called none of its experts")
        index = torch.cat([torch.full((len(r),), e, dtype=torch.long, device=r.device) for e, r in self.calls])
        hidden = torch.cat([r.reshape(len(r), -1) for _, r in self.calls])
        routing = route(index.unsqueeze(1), total, group)
        rows = dispatch(hidden, routing, 1, group)
        per_rank, first = total // self.mesh.size(), self.mesh.get_local_rank() * (total // self.mesh.size())
        shape = self.calls[0][1].shape[1:]
        order = torch.argsort(routing.local, stable=True)
        sizes = torch.bincount(routing.local, minlength=per_rank).tolist()
        outs = [
            type(self.experts[first + j]).forward(self.experts[first + j], chunk.view(-1, *shape))
            for j, chunk in enumerate(rows[order].split(sizes))
            if sizes[j]  # an expert no row reached is not called (its gradient stays None, as on one device)
        ]
        width = math.prod(self._out_tail(self.calls[0][1]))
        computed = torch.cat([o.reshape(len(o), -1) for o in outs]) if outs else rows.new_zeros(0, width)
        mine = [p for j in range(per_rank) for p in self.experts[first + j].parameters()]
        back = combine_rows(_joined(computed[torch.argsort(order)], rows, iter(mine)), routing, group)
        return [a.view(len(r), *self._out_tail(r)) for a, (_, r) in zip(back.split([len(r) for _, r in self.calls]),
                                                                              self.calls)]  # fmt: skip

    def __deepcopy__(self, memo: dict) -> ListExperts:
        """A copy of the mixture (a block's verification copy) answers its own copy's experts."""
        module, experts = memo.get(id(self.module), self.module), memo.get(id(self.experts), self.experts)
        return ListExperts(module, experts, self.mesh, self.replicas)


def shard_expert_list(module: nn.Module, experts: nn.ModuleList, mesh: DeviceMesh, replicas: Any = None) -> None:
    """Keep this rank's ``E/ep`` experts of the home-written mixture ``module`` (the others to meta) and make its
    call dispatch and combine over the 1-D ``mesh`` (:class:`ListExperts`; ``replicas``: the group of the ranks
    holding the same experts); in place."""
    ep, rank = mesh.size(), mesh.get_local_rank()
    check_experts(len(experts), ep, type(module).__name__)
    per_rank = len(experts) // ep
    for i, expert in enumerate(experts):
        if not rank * per_rank <= i < (rank + 1) * per_rank:
            expert.to(torch.device("meta"))
    module.forward = ListExperts(module, experts, mesh, replicas)


def shard_experts(module: nn.Module, mesh: DeviceMesh, replicas: Any = None) -> list[str]:
    """Keep this rank's experts of ``module`` (stacked experts: :mod:`lightning_parallel.anatomy.experts`) as
    DTensors sharded by expert over the 1-D ``mesh`` (no communication: every rank holds the same whole values), and
    make its call dispatch and combine over it (``replicas``: the group of the ranks holding the same experts); in
    place. Returns the names of the parameters sharded."""
    total: int = module.num_experts  # type: ignore[assignment]
    ep, rank = mesh.size(), mesh.get_local_rank()
    check_experts(total, ep, type(module).__name__)
    per_rank = total // ep
    names = stacked(module, total)
    for name in names:
        whole = getattr(module, name)
        # a copy: a view would keep the whole tensor alive (and give the DTensor its offset: deepcopy fails)
        mine = whole.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
        sharded = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False, shape=whole.shape, stride=whole.stride())
        setattr(module, name, nn.Parameter(sharded, requires_grad=whole.requires_grad))
    module.num_experts = per_rank  # what the module's own code loops over: its local experts
    module.forward = ExpertParallelForward(module, total, mesh, replicas)
    return names


# ------------------------------------------------------------------------------ a block's verification
def expert_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter, Any]]:
    """The expert-parallel parameters this rank holds in ``module`` (a block or its copy), by name, each with the
    group of the ranks holding the same experts."""
    out = []
    for prefix, m in module.named_modules():
        call = m.__dict__.get("forward")
        if isinstance(call, ExpertParallelForward):
            held = [(n, p) for n, p in m.named_parameters(recurse=False) if isinstance(p, DTensor)]
        elif isinstance(call, ListExperts):
            held = [(f"{c}.{n}", p) for c, child in m.named_children() if child is call.experts
                    for n, p in child.named_parameters() if not p.is_meta]  # fmt: skip
        else:
            continue
        out += [(f"{prefix}.{n}" if prefix else n, p, call.replicas) for n, p in held]
    return out


def over_replicas(module: nn.Module, grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """A block verification's expert gradients, each summed over the ranks holding the same experts (a collective
    over those groups; the other gradients as they are).

    A verification runs each rank's input through the block and through the composed copy, and the experts of both
    see every rank of their ep group: an expert's gradient on its rank is its group's tokens'. Under sequence
    parallelism a replica's sp ranks hold the same whole input, which the block (the reference) runs whole on each
    and the copy one shard on each; summed over every rank holding the same experts, the block's gradient is sp
    times the copy's (which :func:`lightning_parallel.anatomy.verify.single_process_gradients` multiplies by sp),
    whatever ranks the ep groups take."""
    out = dict(grads)
    for name, p, replicas in expert_parameters(module):
        if replicas is None:
            continue
        present = _collectives.any_over_group([name in grads], replicas)[0]
        if present:
            g = grads[name].clone() if name in grads else torch.zeros_like(p)
            _collectives.all_reduce_sum_([g.to_local() if isinstance(g, DTensor) else g], replicas)
            out[name] = g
    return out


__all__ = [
    "EP_AXIS",
    "REPLICA_AXIS",
    "ExpertParallelForward",
    "ListExperts",
    "Routing",
    "call_experts",
    "check_experts",
    "combine",
    "combine_rows",
    "dispatch",
    "expert_parameters",
    "experts_call",
    "is_dense",
    "over_replicas",
    "route",
    "shard_expert_list",
    "shard_experts",
    "stacked",
    "tracing",
]
