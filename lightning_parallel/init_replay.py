"""A model's own initialisation, recorded on the meta device and replayed one tensor at a time.

Lightning's large-model idiom builds the model in ``configure_model``; the strategies here run it on the meta
device so that no rank ever holds the whole model. On meta nothing is computed: the constructors' resets, the
model's own ``self.apply(self._init_weights)``, ``nn.init.*`` on a built module, a RoPE table computed from
``arange``, all write no values and draw nothing from torch's generator. :class:`InitTape`, a
``TorchFunctionMode`` open around ``configure_model``, records every torch call that makes or writes a meta tensor,
in order: a program whose variables are storages.

:meth:`InitTape.close` runs that program once on throw-away tensors, one call at a time (zeros of each input's
shape and strides), from rank 0's generator state at ``configure_model``'s start, and keeps the generator's state
before and after every call that draws from it. It leaves the generator where building the model eagerly leaves
it.

:meth:`InitTape.value` then computes one tensor alone: the calls that write its storage, and (transitively) those
that write the storages they read, replayed in program order on real tensors, each drawing call from its recorded
state. The state every replayed call ends in must equal the recorded one (unchanged, for a call that drew nothing
then), a check that fails on any draw that depends on values the throw-away run did not have. So every tensor
the tape covers gets exactly the value one process's eager ``configure_model`` gives it, and a rank holds its
share plus one slice of the program (usually one tensor) at a time.

transformers' ``init_weights`` skips a model's ``_init_weights`` when it is built on meta (it asks
``torch.tensor([]).device``); asked from there, the tape answers with the host device, so that initialisation
runs on meta, is recorded, and replays as one process's.

The idea is torchdistx's ``deferred_init`` (record operations on fake tensors, materialise module by module),
written over ``TorchFunctionMode`` with storages as the program's variables.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_parallel.errors import ConfigurationError

CPU = torch.device("cpu")
_IS_META = torch._C.TensorBase.__dict__["is_meta"]  # read by the nn.init functions that skip meta tensors
# torch.nn.init functions that return at once on a meta tensor (no torch call to see): their frame is recorded
_SKIPPING = {
    f.__code__: f
    for f in (nn.init._no_grad_trunc_normal_, nn.init.dirac_, nn.init.orthogonal_, nn.init.sparse_)  # type: ignore[attr-defined]
}
_ALLOCATES = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}  # storage, no values
_NOT_VALUES = {"requires_grad_", "share_memory_", "retain_grad_"}  # in place, but no value written


def _key(t: Tensor) -> int:
    """The identity of ``t``'s storage (views and ``nn.Parameter`` wrappers share it)."""
    return t.untyped_storage()._cdata


def _in_place(name: str, kwargs: dict[str, Any]) -> bool:
    return (name.endswith("_") and not name.startswith("__") and name not in _NOT_VALUES) or (
        name == "__setitem__" or kwargs.get("out") is not None
    )


def _meta_leaves(tree: Any) -> list[Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor) and x.is_meta]


def _user_line() -> str:
    """The first frame outside torch and this package: where the user's code made the call."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("torch", "lightning_parallel")):
            return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _asked_by_hugging_face_init() -> bool:
    """Whether transformers' ``init_weights`` asks (through ``torch.tensor([]).device``) for the device a model is
    built on: it skips a model's ``_init_weights`` on meta, and here that initialisation is recorded instead."""
    asking = sys._getframe(2)
    caller = asking.f_back
    return (
        asking.f_code.co_name == "get_torch_context_manager_or_global_device"
        and asking.f_globals.get("__name__", "").startswith("transformers.")
        and caller is not None
        and caller.f_code.co_name == "init_weights"
    )


@dataclass
class _Call:
    """One recorded torch call: ``func(*args, **kwargs)`` with meta tensors in them and in ``outputs``."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: Any
    reads: frozenset[int]
    writes: frozenset[int]
    dtype: torch.dtype  # the default dtype then (the precision plugin's, under Lightning)
    where: str
    refusal: Optional[str] = None
    before: Optional[Tensor] = None  # the generator's state before and after, for a call that draws
    after: Optional[Tensor] = None


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device``'s type (the one an eager ``configure_model`` there draws from)."""
    if device.type == "cpu":
        return torch.default_generator
    return torch.get_device_module(device.type).default_generators[device.index or 0]  # type: ignore[no-any-return]


class InitTape(TorchFunctionMode):
    """Records the torch calls that make or write meta tensors (module docstring). Open it innermost, inside the
    ``torch.device("meta")`` context, so factories are recorded without the device that context adds."""

    def __init__(self, device: torch.device = CPU) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        self._writers: dict[int, list[int]] = {}  # storage -> indices of the calls writing it (making, views)
        self._valued: set[int] = set()  # storages some call writes values into
        self._unreplayable: Optional[str] = None  # why no value can be replayed exactly
        self._generator = generator(device)
        self._seen = self._generator.get_state()
        self._moved: list[tuple[int, Tensor, str]] = []  # (before call i, the state, where): a reseed, a real draw

    def _watch(self) -> None:
        """Note the generator's state where the user's code changed it between recorded calls
        (``torch.manual_seed``, a draw on a real tensor): the throw-away run takes it there, or refuses."""
        now = self._generator.get_state()
        if not torch.equal(now, self._seen):
            self._moved.append((len(self.calls), now, _user_line()))
            self._seen = now

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        self._watch()
        if getattr(func, "__self__", None) is _IS_META and args and args[0].is_meta:
            self._skipped_init(args[0])
        if func is torch.tensor and _asked_by_hugging_face_init():
            kwargs = {**kwargs, "device": "cpu"}  # (module docstring: a Hugging Face model's init on meta)
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name not in _NOT_VALUES:
            self._record(func, args, kwargs, out, name)
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict[str, Any], out: Any, name: str) -> None:
        inputs = _meta_leaves((args, kwargs))
        in_place = _in_place(name, kwargs)
        targets = [inputs[0]] if in_place and inputs else []
        outputs = _meta_leaves(out)
        if not outputs and not targets:
            return  # reads only (sizes, dims) or a result off meta
        reads = frozenset(_key(t) for t in inputs)
        writes = frozenset(_key(t) for t in [*outputs, *targets])
        # values: written in place, or a new storage made by a call that computes (not a bare allocation)
        valued = {_key(t) for t in targets} | {
            k for k in (_key(t) for t in outputs) if k not in reads and name not in _ALLOCATES
        }
        refusal = None
        if kwargs.get("generator") is not None:
            refusal = "draws from an explicit generator= (replaying it would draw from that generator again)"
        self._add(_Call(func, args, kwargs, out, reads, writes, torch.get_default_dtype(), _user_line(), refusal),
                  valued)  # fmt: skip

    def _add(self, call: _Call, valued: set[int]) -> None:
        index = len(self.calls)
        self.calls.append(call)
        for k in call.writes:
            self._writers.setdefault(k, []).append(index)
        self._valued |= valued

    def _skipped_init(self, tensor: Tensor) -> None:
        """An ``nn.init`` function that returns at once on meta (``trunc_normal_``, ``orthogonal_``, ...): record
        the function with the arguments its frame holds."""
        frame = sys._getframe(2)
        fn = _SKIPPING.get(frame.f_code)
        if fn is None:
            return
        names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
        kwargs = {n: frame.f_locals[n] for n in names}
        key = _key(tensor)
        refusal = None
        if kwargs.get("generator") is not None:
            refusal = "draws from an explicit generator= (replaying it would draw from that generator again)"
        call = _Call(fn, (), kwargs, tensor, frozenset({key}), frozenset({key}), torch.get_default_dtype(),
                     _user_line(), refusal)  # fmt: skip
        self._add(call, {key})

    # -- the throw-away run ---------------------------------------------------------------------------------

    def close(self, device: torch.device, state: Tensor) -> None:
        """Run the program on throw-away tensors from generator ``state`` (rank 0's at ``configure_model``'s
        start), keeping each drawing call's states; the generator ends where an eager build leaves it."""
        gen = generator(device)
        self._watch()  # (a change after the last call)
        moved = {i: (s, where) for i, s, where in self._moved}
        gen.set_state(state)
        drawn = False
        with torch.no_grad(), torch.device(device):
            for i, call in enumerate([*self.calls, None]):
                if i in moved:
                    self._moved_to(gen, *moved[i], drawn)
                if call is None:
                    break
                before = gen.get_state()
                args, kwargs = tree_map(lambda x: _zeros_like(x, device), (call.args, call.kwargs))
                try:
                    with _default_dtype(call.dtype):
                        call.func(*args, **kwargs)
                except Exception as err:  # noqa: BLE001  (a call that needs real values: replayed with them)
                    if not torch.equal(gen.get_state(), before):
                        self._unreplayable = (
                            f"a call at {call.where} ({getattr(call.func, '__name__', call.func)}) draws from torch's"
                            f" generator but cannot run again without the values it read ({err})"
                        )
                    continue
                after = gen.get_state()
                if not torch.equal(after, before):
                    call.before, call.after, drawn = before, after, True

    def _moved_to(self, gen: torch.Generator, state: Tensor, where: str, drawn: bool) -> None:
        """The user's code set or advanced the generator at ``where``. Before any recorded draw the state it left
        is the eager build's too (a ``torch.manual_seed``); after one, that state missed the draws meta skipped."""
        if drawn:
            self._unreplayable = (
                f"configure_model changes torch's generator at {where} (torch.manual_seed, or a draw on a tensor"
                " off the meta device) after the model's initialisation drew from it on meta, so the draws after"
                " it cannot be placed as one process makes them"
            )
        else:
            gen.set_state(state)

    # -- one tensor ------------------------------------------------------------------------------------------

    def covers(self, t: Tensor) -> bool:
        """Whether some recorded call writes values into ``t``'s storage."""
        return t.is_meta and _key(t) in self._valued

    def value(self, t: Tensor, device: torch.device) -> Tensor:
        """``t``'s value as one process's eager build gives it, on ``device`` (a tensor of ``t``'s own)."""
        if self._unreplayable is not None:
            raise ConfigurationError(
                f"configure_model ran on the meta device, and its initialisation cannot be replayed exactly:"
                f" {self._unreplayable}; {_WAYS}"
            )
        key = _key(t)
        gen = generator(device)
        saved = gen.get_state()
        real: dict[int, Tensor] = {}
        try:
            with torch.no_grad(), torch.device(device):
                for call in self._slice(key):
                    self._replay(call, real, gen, device)
        finally:
            gen.set_state(saved)
        base = real[key]
        out = base.as_strided(t.size(), t.stride(), t.storage_offset())
        whole = out.is_contiguous() and out.storage_offset() == 0
        return out if whole and out.untyped_storage().nbytes() == out.numel() * out.element_size() else out.clone()

    def _slice(self, key: int) -> list[_Call]:
        """The calls writing storage ``key`` and, transitively, those writing the storages they read."""
        seen: set[int] = set()
        todo, done = [key], set()
        while todo:
            k = todo.pop()
            if k in done:
                continue
            done.add(k)
            for i in self._writers.get(k, []):
                if i not in seen:
                    seen.add(i)
                    todo.extend(self.calls[i].reads)
        return [self.calls[i] for i in sorted(seen)]

    def _replay(self, call: _Call, real: dict[int, Tensor], gen: torch.Generator, device: torch.device) -> None:
        name = getattr(call.func, "__name__", str(call.func))
        if call.refusal is not None:
            raise ConfigurationError(f"the model's initialisation at {call.where} {call.refusal}; {_WAYS}")

        def to_real(x: Any) -> Any:
            if not (isinstance(x, Tensor) and x.is_meta):
                return x
            base = real.get(_key(x))
            if base is None or base.dtype != x.dtype:
                raise ConfigurationError(
                    f"the model's initialisation at {call.where} ({name}) reads a meta tensor made outside"
                    f" configure_model (or viewed as another dtype), which cannot be replayed; {_WAYS}"
                )
            return base.as_strided(x.size(), x.stride(), x.storage_offset())

        args, kwargs = tree_map(to_real, (call.args, call.kwargs))
        if call.before is not None:
            gen.set_state(call.before)
        before = gen.get_state()
        with _default_dtype(call.dtype):
            out = call.func(*args, **kwargs)
        if not torch.equal(gen.get_state(), before if call.after is None else call.after):
            raise ConfigurationError(
                f"the model's initialisation at {call.where} ({name}) draws from torch's generator by amounts"
                f" that depend on the values it reads, so it cannot be replayed exactly; {_WAYS}"
            )
        for m, r in zip(tree_flatten(call.outputs)[0], tree_flatten(out)[0]):
            if isinstance(m, Tensor) and m.is_meta and isinstance(r, Tensor):
                if r.is_meta:
                    raise ConfigurationError(f"the model's initialisation at {call.where} ({name}) asks for the"
                                             f" meta device itself; {_WAYS}")  # fmt: skip
                real.setdefault(_key(m), r)


_WAYS = (
    "pass configure_model_on_meta=False to the strategy (every rank then builds the whole model in"
    " configure_model), or build the model in the LightningModule's __init__"
)


def _zeros_like(x: Any, device: torch.device) -> Any:
    if not (isinstance(x, Tensor) and x.is_meta):
        return x
    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=device).zero_()
