"""Deferred blocks kept on meta until their first call (docs/design.md, "Deferred initialisation"): under
tensor parallelism and helix what a rank keeps of a block is known only once the block's anatomy has
verified at its first call, so a deferred block is *pending* until then and materialises there, one at a
time, by the rule of :mod:`lightning_parallel.materialize`.

Values loaded while a block is pending (a checkpoint's restore, ``load_pretrained``) are not read then:
each load registers a *source* (:meth:`PendingBlocksMixin.defer_restore`), a function from state-dict names
to the tensors it has, and a block reads its own keys from every source, in order, when it materialises;
a restored optimizer's state for the block's parameters is read there too. So resuming never holds more
than the blocks' share plus the one block materialising.

A block built eagerly (not on meta) is pending the same way where the device is not the host: it stays
where it was built (host memory) through set-up, which broadcasts its values one block at a time through
the device, and moves to the device at its first call; so no device holds more than its share plus one
block, as with a deferred block (:meth:`PendingBlocksMixin.keeps_on_host`)."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any, Optional

import torch

from lightning_parallel import _collectives
from lightning_parallel.blocks import BlockConfig
from lightning_parallel.errors import ConfigurationError
from lightning_parallel.init_replay import InitTape
from lightning_parallel.materialize import _direct, check_set, materialize_
from lightning_parallel.mesh import DP, SP, TP
from lightning_parallel.tensor_parallel import local
from lightning_parallel.trunk import Trunk, materialised_to

#: state-dict names (of the LightningModule) -> the tensors a source holds of them
Source = Callable[[list[str]], dict[str, torch.Tensor]]
#: parameter names -> per optimizer, the restored state of those it holds (``{name: {key: value}}``)
OptimizerSource = Callable[[list[str]], list[dict[str, dict[str, Any]]]]


class PendingBlocksMixin:
    """Mixed into ``HybridParallelStrategy``, which sets ``_pending`` at set-up (:func:`pending_blocks`)."""

    _pending: list[torch.nn.Module]
    _pending_hooks: dict[int, list[Any]]
    _borrowed: dict[int, list[tuple[torch.nn.Module, str, bool, torch.Tensor]]]
    _constructed: set[tuple[int, int]]
    _lent: dict[int, bool]
    _host_data: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]
    _sources: list[Source]
    _optimizer_source: Optional[OptimizerSource]
    _materialized: list[Any]
    _init_seed: int
    _tape: Optional[InitTape]
    _mesh: Any

    def _hook_pending(self) -> None:
        before, after = _first_call_hook(self), _after_call_hook(self)
        self._pending_hooks = {
            id(b): [b.register_forward_pre_hook(before), b.register_forward_hook(after, always_call=True)]
            for b in self._pending
        }
        self._borrowed, self._lent = {}, {}  # id(block) -> whether its next lend broadcasts from rank 0
        self._host_data = {}  # id(block) -> its tensors' host memory while lent to the device

    def defer_restore(self, model: Optional[Source] = None, optimizer: Optional[OptimizerSource] = None) -> None:
        """Values loaded now for the model (``model``: added after the earlier sources, so it wins where both
        hold a key) or for the optimizers (``optimizer``: replaces an earlier one) reach a pending block when it
        materialises; nothing is read now. Without pending blocks nothing is kept."""
        if not self._pending:
            return
        if model is not None:
            self._sources.append(model)
        if optimizer is not None:
            self._optimizer_source = optimizer

    def pending_names(self) -> set[str]:
        """The LightningModule's state-dict names of the deferred (meta) pending blocks' tensors."""
        lm = self.lightning_module
        deferred = [b for b in self._pending if _has_meta(b)]
        if not deferred or lm is None:
            return set()
        prefix = {id(m): n for n, m in lm.named_modules()}
        return {k for b in deferred for k in b.state_dict(prefix=f"{prefix[id(b)]}.", keep_vars=True)}

    def keeps_on_host(self) -> bool:
        """Whether eager blocks stay in host memory until their first call: where the device is not the host."""
        return self.root_device.type != "cpu"  # type: ignore[attr-defined]

    def _on_host(self) -> list[torch.nn.Module]:
        return [b for b in self._pending if not _has_meta(b)]

    def _host_tensors(self) -> set[int]:
        """The ids of the tensors of eager blocks held on the host until their first call."""
        return {id(t) for b in self._on_host() for t in [*b.parameters(), *b.buffers()]}

    def _sync_host_blocks(self) -> None:
        """Set-up's broadcast from rank 0 (``_sync_module_states``) for the eager blocks kept on the host: one
        block at a time through the device (a backend such as NCCL sends device memory only)."""
        host = torch.device("cpu")
        for block in self._on_host():
            materialised_to(block, self.root_device)  # type: ignore[attr-defined]
            self._broadcast_block(block)
            materialised_to(block, host)

    def states_to_device(self) -> None:
        """Lightning's ``_optimizers_to_device`` at set-up, except for the parameters kept on the host (their
        state, e.g. built at construction, moves with them at their first call)."""
        from lightning.fabric.utilities.apply_func import move_data_to_device
        from lightning_utilities.core.apply_func import apply_to_collection

        host, device = self._host_tensors(), self.root_device  # type: ignore[attr-defined]
        for opt in self.optimizers:  # type: ignore[attr-defined]
            for p, state in opt.state.items():
                if id(p) in host:
                    continue
                if not isinstance(state, MutableMapping):  # a custom optimizer's state
                    opt.state[p] = apply_to_collection(state, torch.Tensor, move_data_to_device, device)
                    continue
                for key, value in state.items():
                    if key != "step":  # where torch wants it (pytorch/pytorch#74424)
                        state[key] = move_data_to_device(value, device)

    def _to_device(self, block: torch.nn.Module) -> None:
        """An eager block's first call: it moves to the device with its optimizer state (restored on the host, or
        built at construction), cast as ``Optimizer.load_state_dict`` places state (``step`` too where the
        group is fused or capturable). Outside inference mode (a first call in evaluation under NCCL): the
        parameters are for training."""
        with torch.inference_mode(False), torch.no_grad():
            materialised_to(block, self.root_device)  # type: ignore[attr-defined]
            params = {id(p) for p in block.parameters()}
            for opt in self.optimizers:  # type: ignore[attr-defined]
                for group in opt.param_groups:
                    settings = [{**{k: v for k, v in group.items() if k != "params"}, "params": [0]}]
                    for p in group["params"]:
                        if id(p) in params and p in opt.state:
                            opt.state[p] = {k: _cast(p, v, settings, k) for k, v in opt.state[p].items()}

    def _deferred_blocks(
        self, config: BlockConfig, trunk: Trunk, local: list[tuple[int, torch.nn.Module]]
    ) -> list[torch.nn.Module]:
        """The blocks of a deferred model materialised at their first call, not at set-up: tensor parallelism
        shards a block only once its first call has verified the stack, so materialising every block at set-up
        would hold them all whole."""
        return [b for _, b in local] if config.tp_mesh is not None or self._shards_after_commit else []

    def materialize_pending(self, blocks: Optional[list[torch.nn.Module]] = None, check: bool = False) -> None:
        """Materialise the deferred blocks still on meta (``blocks``: those among them; default: all), by the
        rule of set-up (the same values: they depend on the seed and the module names only; no collective
        runs, except the first call's broadcast below), then reads the block's keys from the sources
        (:meth:`defer_restore`: a checkpoint restored, ``load_pretrained``) and the restored optimizer state
        of its parameters. Called at a block's first call, before an optimizer step, and (for the blocks on
        meta, :meth:`materialize_deferred`) before anything reads or writes the model's values as a whole (a
        save, a plain checkpoint file's restore, ``full_state_dict``). The optimizers hold
        the new parameters in place of the meta ones. ``check``: refuse tensors nothing initialised now (their
        first call: nothing can restore them later), and make every rank start from rank 0's values of the
        block (as set-up's broadcast does for what is materialised there: a reset that does not draw from
        torch's seeded generator would differ between ranks); every rank holding the block calls it then, in
        the same order. Otherwise they are checked when the next loop starts. Runs outside inference mode
        (a first call in evaluation): the parameters are for training too."""
        todo = [b for b in self._pending if blocks is None or any(b is x for x in blocks)]
        if not todo:
            return
        lm = self.lightning_module
        assert lm is not None
        prefix = {id(m): n for n, m in lm.named_modules()}
        for block in todo:
            if not _has_meta(block):  # an eager block kept on the host: its values are synchronised already
                self._to_device(block)
                self._pending = [b for b in self._pending if b is not block]
                for handle in self._pending_hooks.pop(id(block)):
                    handle.remove()
                continue
            name = prefix[id(block)]
            before = dict(block.named_parameters())
            with torch.inference_mode(False):  # parameters and optimizer state for training
                record = materialize_(lm, self.root_device, self._init_seed, only=[block], tape=self._tape)
                if check:
                    self._broadcast_block(block)
                self._restore_values(block, name)
                after = dict(block.named_parameters())
                self._pending = [b for b in self._pending if b is not block]
                for handle in self._pending_hooks.pop(id(block)):
                    handle.remove()
                new = [(before[n], after[n], f"{name}.{n}") for n in before if after[n] is not before[n]]
                self._replace_parameters(new)
                self._fresh_state([(old, p) for old, p, _ in new])
                self._restore_optimizer_state(block, name)
            if check and (message := check_set(record)) is not None:
                raise ConfigurationError(message)
            if not check:
                self._materialized.append(record)
        if not self._pending:  # nothing left to restore or replay: the sources' references and the tape go
            self._sources, self._optimizer_source, self._tape = [], None, None

    def _restore_values(self, block: torch.nn.Module, name: str) -> None:
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

    def _restore_optimizer_state(self, block: torch.nn.Module, name: str) -> None:
        """The restored optimizer state of a just-materialised block's parameters, cast as
        ``Optimizer.load_state_dict`` casts it (floating state to the parameter's dtype and device)."""
        if self._optimizer_source is None:
            return
        params = {f"{name}.{n}": p for n, p in block.named_parameters()}
        for opt, saved in zip(self.optimizers, self._optimizer_source(list(params))):  # type: ignore[attr-defined]
            for group in opt.param_groups:
                held = {id(p) for p in group["params"]}
                settings = [{**{k: v for k, v in group.items() if k != "params"}, "params": [0]}]
                for key, state in saved.items():
                    p = params[key]
                    if id(p) in held:
                        opt.state[p] = {k: _cast(p, v, settings, k) for k, v in state.items()}

    def _drop_constructed_state(self, trainer: Any) -> None:
        """Set-up, once the optimizers are built: state an optimizer created at construction (Adagrad's ``sum``)
        for a deferred pending parameter is on meta; it is dropped and built again per parameter when its
        block materialises (:meth:`_fresh_state`), or, where the optimizer's class cannot do that, every
        deferred block materialises now and the optimizers are built again (held whole until their first call)."""
        deferred = [p for b in self._pending for p in b.parameters() if p.is_meta]
        built = [o for o in self.optimizers if any(o.state.get(p) for p in deferred)]  # type: ignore[attr-defined]
        if not all(builds_state_again(o) for o in built):
            self.materialize_deferred()
            self.setup_optimizers(trainer)  # type: ignore[attr-defined]
            return
        self._constructed = {(id(o), id(p)) for o in built for p in deferred if o.state.get(p)}
        for opt in built:
            for p in deferred:
                opt.state.pop(p, None)

    def _fresh_state(self, replaced: list[tuple[torch.nn.Parameter, torch.nn.Parameter]]) -> None:
        """State an optimizer built at construction (Adagrad's ``sum``) for a pending parameter was made on meta
        and dropped at set-up (``_constructed``): it is built for the materialised one, by a throw-away optimizer
        of the same class and group settings."""
        for opt in self.optimizers:  # type: ignore[attr-defined]
            for old, new in replaced:
                if (id(opt), id(old)) in self._constructed:
                    self._constructed.discard((id(opt), id(old)))
                    if state := constructed_state(opt, new):
                        opt.state[new] = state

    def materialize_deferred(self) -> None:
        """The pending blocks on meta materialise (:meth:`materialize_pending`); eager ones kept on the host
        stay there (their values are readable and writable where they are)."""
        self.materialize_pending([b for b in self._pending if _has_meta(b)])

    def _broadcast_block(self, block: torch.nn.Module, axes: tuple[str, ...] = (DP, SP, TP)) -> None:
        """Rank 0's values of a block just materialised, along the mesh axes whose ranks all hold it whole."""
        if self._mesh is None:
            return
        tensors = [local(t.data) for t in [*block.parameters(), *block.buffers()] if not t.is_meta]
        for axis in axes:
            if self._mesh[axis].size() > 1:
                _collectives.broadcast_(tensors, self._mesh.get_group(axis))

    def _materialize_at_first_call(self, block: torch.nn.Module) -> None:
        if not any(b is block for b in self._pending):  # a copy of a pending block (a probe): nothing to do
            return
        if self._lends_pending():
            self._borrow(block)
        else:
            self.materialize_pending([block], check=True)

    def _lends_pending(self) -> bool:
        """Whether a pending block called now is lent (materialised for this call only) rather than kept: helix
        evaluating before its first step has split the blocks (every stage runs every block then)."""
        return False

    def _borrow(self, block: torch.nn.Module) -> None:
        """Materialise a pending block for one call, by the rule of :meth:`materialize_pending` (the same values,
        rank 0's, the sources' restored ones; uninitialised tensors refused); after the call
        (:meth:`_give_back`) it is on meta again, still pending, so no rank holds more than one block whole."""
        lm = self.lightning_module
        assert lm is not None
        if not _has_meta(block):  # an eager block kept on the host: on the device for the call
            tensors = [*block.parameters(), *block.buffers()]
            self._host_data[id(block)] = [(t, t.data) for t in tensors]  # given back as they are, no copy
            self._borrowed[id(block)] = []
            with torch.inference_mode(False), torch.no_grad():
                materialised_to(block, self.root_device)
            return
        name = next(n for n, m in lm.named_modules() if m is block)
        meta = [(module, attr, is_param, t) for module in block.modules() for attr, t, is_param in _direct(module)]
        self._borrowed[id(block)] = meta
        try:
            with torch.inference_mode(False):
                record = materialize_(lm, self.root_device, self._init_seed, only=[block], tape=self._tape)
                if self._lent.get(id(block), True):  # the first lend, or the ranks' values differed then
                    self._lent[id(block)] = not self._agrees_with_rank_0(block)
                self._restore_values(block, name)
            if (message := check_set(record)) is not None:
                raise ConfigurationError(message)
        except BaseException:
            self._give_back(block)
            raise

    def _agrees_with_rank_0(self, block: torch.nn.Module) -> bool:
        """Broadcast rank 0's values of a block just materialised (:meth:`_broadcast_block`); whether every rank
        had them already (then a later lend of the block needs no collective: its rule gives them again). A
        collective over the world: every rank lends the block (helix before its first step)."""
        own = [t.detach().clone() for t in [*block.parameters(), *block.buffers()]]
        self._broadcast_block(block)
        same = all(torch.equal(a, b) for a, b in zip(own, [*block.parameters(), *block.buffers()]))
        return all(_collectives.all_gather_object(same))

    def _give_back(self, block: torch.nn.Module) -> None:
        if id(block) not in self._borrowed:
            return
        for module, attr, is_param, t in self._borrowed.pop(id(block)):
            (module._parameters if is_param else module._buffers)[attr] = t
        with torch.inference_mode(False), torch.no_grad():
            for t, data in self._host_data.pop(id(block), []):  # an eager block: its host memory again
                t.data = data


def _cast(param: torch.Tensor, value: Any, settings: list[dict[str, Any]], key: str) -> Any:
    if not torch.is_tensor(value):
        return value
    return torch.optim.Optimizer._process_value_according_to_param_policy(param, value, 0, settings, key)


def constructed_state(opt: torch.optim.Optimizer, param: torch.nn.Parameter) -> dict[str, Any]:
    """The state ``type(opt)`` builds in its constructor for ``param`` under the settings of its group."""
    group = next((g for g in opt.param_groups if any(q is param for q in g["params"])), None)
    if group is None:  # not this optimizer's parameter
        return {}
    fresh = type(opt)([{**{k: v for k, v in group.items() if k != "params"}, "params": [param]}])
    return dict(fresh.state.get(param, {}))


def builds_state_again(opt: torch.optim.Optimizer) -> bool:
    """Whether :func:`constructed_state` can build ``opt``'s constructor state again (its class takes a list
    of param groups alone, as torch's optimizers do)."""
    try:
        for group in opt.param_groups:
            probe = torch.nn.Parameter(torch.empty(1, device="meta"))
            type(opt)([{**{k: v for k, v in group.items() if k != "params"}, "params": [probe]}])
    except Exception:  # noqa: BLE001  (any refusal: the caller materialises instead)
        return False
    return True


def _first_call_hook(strategy: PendingBlocksMixin) -> Callable[[torch.nn.Module, Any], None]:
    """A forward pre-hook materialising a deferred block at its first call; a function, so that a copy of the
    block (``copy.deepcopy``) shares it rather than copying the strategy (a copy is never pending: no-op)."""

    def hook(block: torch.nn.Module, args: Any) -> None:
        strategy._materialize_at_first_call(block)

    return hook


def _after_call_hook(strategy: PendingBlocksMixin) -> Callable[[torch.nn.Module, Any, Any], None]:
    """A forward hook putting a block lent for one call (:meth:`PendingBlocksMixin._borrow`) back on meta."""

    def hook(block: torch.nn.Module, args: Any, output: Any) -> None:
        strategy._give_back(block)

    return hook


def _self_contained(root: torch.nn.Module, block: torch.nn.Module) -> bool:
    """No tensor of ``block`` is also held by a module outside it: one materialised alone would split a tie."""
    inside = {id(t) for t in [*block.parameters(), *block.buffers()]}
    own = {id(m) for m in block.modules()}
    for module in root.modules():
        if id(module) not in own:
            tensors = [*module._parameters.values(), *module._buffers.values()]
            if any(t is not None and id(t) in inside for t in tensors):
                return False
    return True


def _has_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _on_cpu(module: torch.nn.Module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def pending_blocks(root: torch.nn.Module, candidates: list[torch.nn.Module], host: bool) -> list[torch.nn.Module]:
    """The candidates that are self-contained (no tie would split) and deferred (a tensor on meta), or, with
    ``host``, built eagerly in host memory."""
    return [b for b in candidates if (_has_meta(b) or (host and _on_cpu(b))) and _self_contained(root, b)]
