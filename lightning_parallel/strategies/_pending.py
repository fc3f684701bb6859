"""Deferred blocks kept on meta until their first call (docs/design.md, "Deferred initialisation"): under
tensor parallelism and helix what a rank keeps of a block is known only once the block's anatomy has
verified at its first call, so a deferred block is *pending* until then and materialises there, one at a
time, by the rule of :mod:`lightning_parallel.materialize`.

Values loaded while a block is pending (a checkpoint's restore, ``load_pretrained``) are not read then:
each load registers a *source* (:meth:`DeferredInit.defer_restore`), a function from state-dict names to the
tensors it has, and a block reads its own keys from every source, in order, when it materialises; a restored
optimizer's state for the block's parameters is read there too. So resuming never holds more than the blocks'
share plus the one block materialising.

A block built eagerly (not on meta) is pending the same way where the device is not the host: it stays
where it was built (host memory) through set-up, which broadcasts its values one block at a time through
the device, and moves to the device at its first call; so no device holds more than its share plus one
block, as with a deferred block (the strategies' ``keeps_on_host``).

:class:`DeferredInit` is the strategies' part that holds all of it on one rank: the tape of ``configure_model``
on meta, rank 0's seed, the records still to check, the pending blocks and their sources. The strategy gives it
what it needs of the strategy once, at set-up (:class:`Holder`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_parallel import _collectives
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.init_replay import InitTape
from lightning_parallel.materialize import _direct, check_set, materialize_
from lightning_parallel.tensor_parallel import local
from lightning_parallel.trunk import materialised_to

#: state-dict names (of the LightningModule) -> the tensors a source holds of them
Source = Callable[[list[str]], dict[str, Tensor]]
#: parameter names -> per optimizer, the restored state of those it holds (``{name: {key: value}}``)
OptimizerSource = Callable[[list[str]], list[dict[str, dict[str, Any]]]]


@dataclass(frozen=True)
class Holder:
    """What the pending blocks need of the strategy that holds them (given at set-up)."""

    module: nn.Module  # the LightningModule
    device: torch.device
    mesh: Callable[[], Optional[DeviceMesh]]  # the strategy's mesh now (none after teardown)
    whole_over: tuple[str, ...]  # the mesh axes whose ranks all hold a pending block whole
    optimizers: Callable[[], list[Optimizer]]
    replace: Callable[[list[tuple[nn.Parameter, nn.Parameter, str]]], None]  # the optimizers take new parameters
    first_call: Callable[[nn.Module], None]  # the strategy's hook to :meth:`DeferredInit.first_call`
    lends: Callable[[], bool]  # whether a block called now is lent for the call only (helix evaluating early)
    materialised: Callable[[], None]  # after a block materialised (expert parallelism shards its experts)


class DeferredInit:
    """Deferred initialisation on one rank (module docstring)."""

    def __init__(self) -> None:
        self.tape: Optional[InitTape] = None  # configure_model's calls on meta, replayed per tensor until all held
        self.seed = 0  # rank 0's seed, which deferred initialisation uses
        self.unchecked: list[Any] = []  # records of what was materialised, checked when the next loop starts
        self.check_due = False  # set by every rank's set-up: the check's collective runs on all of them
        self.blocks: list[nn.Module] = []  # the pending blocks
        self._holder: Optional[Holder] = None
        self._hooks: dict[int, list[Any]] = {}  # id(block) -> its hooks (materialise; lent: give back)
        self._borrowed: dict[int, list[tuple[nn.Module, str, bool, Tensor]]] = {}  # its meta tensors while lent
        self._lent: dict[int, bool] = {}  # id(block) -> whether its next lend (helix evaluation) broadcasts
        self._host_data: dict[int, list[tuple[Tensor, Tensor]]] = {}  # its host memory while lent to the device
        self._constructed: set[tuple[int, int]] = set()  # (optimizer, pending parameter): state made at construction
        self._sources: list[Source] = []  # values loaded while blocks were pending, read as each materialises
        self._optimizer_source: Optional[OptimizerSource] = None  # likewise, restored optimizer state

    def hold(self, blocks: list[nn.Module], holder: Holder, runners: list[nn.Module]) -> None:
        """At set-up: ``blocks`` (:func:`pending_blocks`) wait for their first call: in the block layer's commit
        where they have a runner (``runners``: the layer calls :attr:`Holder.first_call` before composing), else
        by a forward pre-hook (HelixPipe's blocks, run by its runtime, lent to an evaluation before the first
        step has split them)."""
        for handles in self._hooks.values():  # a set-up run again after one that failed
            for handle in handles:
                handle.remove()
        self.blocks, self._holder = list(blocks), holder
        self._hooks = {
            id(b): [
                b.register_forward_pre_hook(_first_call_hook(holder.first_call)),
                b.register_forward_hook(_after_call_hook(self), always_call=True),
            ]
            for b in self.blocks
            if not any(b is r for r in runners)
        }
        self._borrowed, self._lent, self._host_data = {}, {}, {}

    @property
    def _at(self) -> Holder:
        assert self._holder is not None, "no block is pending before set-up"
        return self._holder

    def defer_restore(self, model: Optional[Source] = None, optimizer: Optional[OptimizerSource] = None) -> None:
        """Values loaded now for the model (``model``: added after the earlier sources, so it wins where both
        hold a key) or for the optimizers (``optimizer``: replaces an earlier one) reach a pending block when it
        materialises; nothing is read now. Without pending blocks nothing is kept."""
        if not self.blocks:
            return
        if model is not None:
            self._sources.append(model)
        if optimizer is not None:
            self._optimizer_source = optimizer

    def names(self) -> set[str]:
        """The LightningModule's state-dict names of the deferred (meta) pending blocks' tensors."""
        deferred = self.on_meta()
        if not deferred:
            return set()
        prefix = {id(m): n for n, m in self._at.module.named_modules()}
        return {k for b in deferred for k in b.state_dict(prefix=f"{prefix[id(b)]}.", keep_vars=True)}

    def on_meta(self) -> list[nn.Module]:
        return [b for b in self.blocks if _has_meta(b)]

    def on_host(self) -> list[nn.Module]:
        return [b for b in self.blocks if not _has_meta(b)]

    def host_tensors(self) -> set[int]:
        """The ids of the tensors of eager blocks held on the host until their first call."""
        return {id(t) for b in self.on_host() for t in [*b.parameters(), *b.buffers()]}

    def sync_host_blocks(self) -> None:
        """Set-up's broadcast from rank 0 for the eager blocks kept on the host: one block at a time through the
        device (a backend such as NCCL sends device memory only)."""
        host = torch.device("cpu")
        for block in self.on_host():
            materialised_to(block, self._at.device)
            self._broadcast(block)
            materialised_to(block, host)

    # ------------------------------------------------------------------------------ materialising
    def first_call(self, block: nn.Module) -> None:
        """A pending block's first call: it materialises (or is lent for the call, :attr:`Holder.lends`)."""
        if not any(b is block for b in self.blocks):  # a copy of a pending block (a probe): nothing to do
            return
        if self._at.lends():
            self._borrow(block)
        else:
            self.materialize([block], check=True)

    def materialize(self, blocks: Optional[list[nn.Module]] = None, check: bool = False) -> None:
        """Materialise the pending blocks (``blocks``: those among them; default: all), by the rule of set-up
        (the same values: they depend on the seed and the module names only; no collective runs, except the
        first call's broadcast below), then read the block's keys from the sources (:meth:`defer_restore`: a
        checkpoint restored, ``load_pretrained``) and the restored optimizer state of its parameters. Called at
        a block's first call, before an optimizer step, and (for the blocks on meta) before anything reads or
        writes the model's values as a whole (a save, a plain checkpoint file's restore, ``full_state_dict``).
        An eager block kept on the host moves to the device. The optimizers hold the new parameters in place of
        the meta ones. ``check``: refuse tensors nothing initialised now (their first call: nothing can restore
        them later), and make every rank start from rank 0's values of the block (as set-up's broadcast does
        for what is materialised there: a reset that does not draw from torch's seeded generator would differ
        between ranks); every rank holding the block calls it then, in the same order. Otherwise they are
        checked when the next loop starts. Runs outside inference mode (a first call in evaluation): the
        parameters are for training too."""
        todo = [b for b in self.blocks if blocks is None or any(b is x for x in blocks)]
        if not todo:
            return
        at = self._at
        prefix = {id(m): n for n, m in at.module.named_modules()}
        for block in todo:
            if not _has_meta(block):  # an eager block kept on the host: its values are synchronised already
                self._to_device(block)
                self.blocks = [b for b in self.blocks if b is not block]
                for handle in self._hooks.pop(id(block), []):
                    handle.remove()
                continue
            name = prefix[id(block)]
            before = dict(block.named_parameters())
            with torch.inference_mode(False):  # parameters and optimizer state for training
                record = materialize_(at.module, at.device, self.seed, only=[block], tape=self.tape)
                if check:
                    self._broadcast(block)
                self._restore_values(block, name)
                after = dict(block.named_parameters())
                self.blocks = [b for b in self.blocks if b is not block]
                for handle in self._hooks.pop(id(block), []):
                    handle.remove()
                new = [(before[n], after[n], f"{name}.{n}") for n in before if after[n] is not before[n]]
                at.replace(new)
                self._fresh_state([(old, p) for old, p, _ in new])
                self._restore_optimizer_state(block, name)
                at.materialised()
            if check and (message := check_set(record)) is not None:
                raise ConfigurationError(message)
            if not check:
                self.unchecked.append(record)
        if not self.blocks:  # nothing left to restore or replay: the sources' references and the tape go
            self._sources, self._optimizer_source, self.tape = [], None, None

    def _to_device(self, block: nn.Module) -> None:
        """An eager block's first call: it moves to the device with its optimizer state (restored on the host, or
        built at construction), cast as ``Optimizer.load_state_dict`` places state (``step`` too where the
        group is fused or capturable). Outside inference mode (a first call in evaluation under NCCL): the
        parameters are for training."""
        with torch.inference_mode(False), torch.no_grad():
            materialised_to(block, self._at.device)
            params = {id(p) for p in block.parameters()}
            for opt in self._at.optimizers():
                for group in opt.param_groups:
                    for p in group["params"]:
                        if id(p) in params and p in opt.state:
                            opt.state[p] = _cast_state(p, opt.state[p], group)

    def _restore_values(self, block: nn.Module, name: str) -> None:
        """Copy into a just-materialised block what each source holds of it (whole tensors, original order)."""
        if not self._sources:
            return
        targets = block.state_dict(prefix=f"{name}.", keep_vars=True)
        with torch.no_grad():
            for source in self._sources:
                for key, value in source(list(targets)).items():
                    target = targets[key]
                    if tuple(value.shape) != tuple(target.shape):
                        raise ConfigurationError(
                            f"restoring {key!r}: the loaded tensor has shape {tuple(value.shape)}, the model's"
                            f" {tuple(target.shape)}"
                        )
                    target.copy_(value)

    def _restore_optimizer_state(self, block: nn.Module, name: str) -> None:
        """The restored optimizer state of a just-materialised block's parameters, cast as
        ``Optimizer.load_state_dict`` casts it (floating state to the parameter's dtype and device)."""
        if self._optimizer_source is None:
            return
        params = {f"{name}.{n}": p for n, p in block.named_parameters()}
        for opt, saved in zip(self._at.optimizers(), self._optimizer_source(list(params))):
            for group in opt.param_groups:
                held = {id(p) for p in group["params"]}
                for key, state in saved.items():
                    p = params[key]
                    if id(p) in held:
                        opt.state[p] = _cast_state(p, state, group)

    def drop_constructed_state(self) -> bool:
        """Set-up, once the optimizers are built: state an optimizer created at construction (Adagrad's ``sum``)
        for a deferred pending parameter is on meta; it is dropped and built again per parameter when its block
        materialises (:meth:`_fresh_state`). ``False`` where the optimizer's class cannot do that: the caller
        materialises every deferred block and builds the optimizers again (held whole until their first call)."""
        deferred = [p for b in self.blocks for p in b.parameters() if p.is_meta]
        built = [o for o in self._at.optimizers() if any(o.state.get(p) for p in deferred)] if deferred else []
        if not all(builds_state_again(o) for o in built):
            return False
        self._constructed = {(id(o), id(p)) for o in built for p in deferred if o.state.get(p)}
        for opt in built:
            for p in deferred:
                opt.state.pop(p, None)
        return True

    def _fresh_state(self, replaced: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        """State an optimizer built at construction (Adagrad's ``sum``) for a pending parameter was made on meta
        and dropped at set-up: it is built for the materialised one, by a throw-away optimizer of the same class
        and group settings."""
        for opt in self._at.optimizers():
            for old, new in replaced:
                if (id(opt), id(old)) in self._constructed:
                    self._constructed.discard((id(opt), id(old)))
                    if state := constructed_state(opt, new):
                        opt.state[new] = state

    def _broadcast(self, block: nn.Module) -> None:
        """Rank 0's values of a block just materialised, along the mesh axes whose ranks all hold it whole."""
        mesh = self._at.mesh()
        if mesh is None:
            return
        tensors = [local(t.data) for t in [*block.parameters(), *block.buffers()] if not t.is_meta]
        for axis in self._at.whole_over:
            if mesh[axis].size() > 1:
                _collectives.broadcast_(tensors, mesh.get_group(axis))

    # ------------------------------------------------------------------------------ lending
    def _borrow(self, block: nn.Module) -> None:
        """Materialise a pending block for one call, by the rule of :meth:`materialize` (the same values, rank
        0's, the sources' restored ones; uninitialised tensors refused); after the call (:meth:`give_back`) it is
        on meta again, still pending, so no rank holds more than one block whole."""
        at = self._at
        if not _has_meta(block):  # an eager block kept on the host: on the device for the call
            tensors = [*block.parameters(), *block.buffers()]
            self._host_data[id(block)] = [(t, t.data) for t in tensors]  # given back as they are, no copy
            self._borrowed[id(block)] = []
            with torch.inference_mode(False), torch.no_grad():
                materialised_to(block, at.device)
            return
        name = next(n for n, m in at.module.named_modules() if m is block)
        meta = [(module, attr, is_param, t) for module in block.modules() for attr, t, is_param in _direct(module)]
        self._borrowed[id(block)] = meta
        try:
            with torch.inference_mode(False):
                record = materialize_(at.module, at.device, self.seed, only=[block], tape=self.tape)
                if self._lent.get(id(block), True):  # the first lend, or the ranks' values differed then
                    self._lent[id(block)] = not self._agrees_with_rank_0(block)
                self._restore_values(block, name)
            if (message := check_set(record)) is not None:
                raise ConfigurationError(message)
        except BaseException:
            self.give_back(block)
            raise

    def _agrees_with_rank_0(self, block: nn.Module) -> bool:
        """Broadcast rank 0's values of a block just materialised (:meth:`_broadcast`); whether every rank had
        them already (then a later lend of the block needs no collective: its rule gives them again). A
        collective over the world: every rank lends the block (helix before its first step)."""
        own = [t.detach().clone() for t in [*block.parameters(), *block.buffers()]]
        self._broadcast(block)
        same = all(torch.equal(a, b) for a, b in zip(own, [*block.parameters(), *block.buffers()]))
        return all(_collectives.all_gather_object(same))

    def give_back(self, block: nn.Module) -> None:
        """After a lent block's call: its meta tensors (or its host memory) again."""
        if id(block) not in self._borrowed:
            return
        for module, attr, is_param, t in self._borrowed.pop(id(block)):
            (module._parameters if is_param else module._buffers)[attr] = t
        with torch.inference_mode(False), torch.no_grad():
            for t, data in self._host_data.pop(id(block), []):  # an eager block: its host memory again
                t.data = data


def _cast_state(param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
    """``state`` cast as ``Optimizer.load_state_dict`` casts it for ``param`` under ``group``'s settings."""
    settings = [{**{k: v for k, v in group.items() if k != "params"}, "params": [0]}]
    policy = torch.optim.Optimizer._process_value_according_to_param_policy
    return {k: policy(param, v, 0, settings, k) if torch.is_tensor(v) else v for k, v in state.items()}


def constructed_state(opt: Optimizer, param: nn.Parameter) -> dict[str, Any]:
    """The state ``type(opt)`` builds in its constructor for ``param`` under the settings of its group."""
    group = next((g for g in opt.param_groups if any(q is param for q in g["params"])), None)
    if group is None:  # not this optimizer's parameter
        return {}
    fresh = type(opt)([{**{k: v for k, v in group.items() if k != "params"}, "params": [param]}])
    return dict(fresh.state.get(param, {}))


def builds_state_again(opt: Optimizer) -> bool:
    """Whether :func:`constructed_state` can build ``opt``'s constructor state again (its class takes a list
    of param groups alone, as torch's optimizers do)."""
    try:
        for group in opt.param_groups:
            probe = nn.Parameter(torch.empty(1, device="meta"))
            type(opt)([{**{k: v for k, v in group.items() if k != "params"}, "params": [probe]}])
    except Exception:  # noqa: BLE001  (any refusal: the caller materialises instead)
        return False
    return True


def _first_call_hook(first_call: Callable[[nn.Module], None]) -> Callable[[nn.Module, Any], None]:
    """A forward pre-hook materialising a deferred block at its first call; a function, so that a copy of the
    block (``copy.deepcopy``) shares it rather than copying the strategy (a copy is never pending: no-op)."""

    def hook(block: nn.Module, args: Any) -> None:
        first_call(block)

    return hook


def _after_call_hook(deferred: DeferredInit) -> Callable[[nn.Module, Any, Any], None]:
    """A forward hook putting a block lent for one call (:meth:`DeferredInit._borrow`) back on meta."""

    def hook(block: nn.Module, args: Any, output: Any) -> None:
        deferred.give_back(block)

    return hook


def _self_contained(root: nn.Module, block: nn.Module) -> bool:
    """No tensor of ``block`` is also held by a module outside it: one materialised alone would split a tie."""
    inside = {id(t) for t in [*block.parameters(), *block.buffers()]}
    own = {id(m) for m in block.modules()}
    for module in root.modules():
        if id(module) not in own:
            tensors = [*module._parameters.values(), *module._buffers.values()]
            if any(t is not None and id(t) in inside for t in tensors):
                return False
    return True


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _on_cpu(module: nn.Module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def pending_blocks(root: nn.Module, candidates: list[nn.Module], host: bool) -> list[nn.Module]:
    """The candidates that are self-contained (no tie would split) and deferred (a tensor on meta), or, with
    ``host``, built eagerly in host memory."""
    return [b for b in candidates if (_has_meta(b) or (host and _on_cpu(b))) and _self_contained(root, b)]
