"""Where a block's anatomy comes from, in order; the first source that verifies wins:

1. an explicit ``adapter=`` (a hand-written adapter's name or the user's object); if it fails, that is
   the error (no fall-through);
2. the hand-written adapters whose attribute names match the block (fast paths);
3. Hugging Face blocks, from the model's own metadata (``config.base_model_tp_plan``, the
   attention-function registry): :mod:`lightning_parallel.anatomy.hugging_face`;
4. the block's own forward, where the user named what it lacks (``tp_plan=``, ``mlp_module=``);
5. the block's graph, traced on the first real input: :mod:`lightning_parallel.anatomy.traced`;
6. otherwise an :class:`~lightning_parallel.block_protocol.AnatomyError` naming the block class, every
   source tried, why each failed, and ``adapter=``.

The first block of a trunk decides the source; the trunk's other blocks try it first (then the others). A
block is verified unless a block of the same :func:`fingerprint` (every attribute and buffer of every submodule
that is not a parameter's value) already verified with that source: blocks of one class that differ in a
per-layer setting (rotary on or off, a window, ``layer_idx`` into the config's per-layer lists) are each
verified as themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_parallel import watchdog
from lightning_parallel.anatomy.adapters import ADAPTERS, AdapterAnatomy, matching_adapters, named_adapter
from lightning_parallel.anatomy.attends import attends
from lightning_parallel.anatomy.verify import verify
from lightning_parallel.errors import AnatomyError, ConfigurationError, Unsupported
from lightning_parallel.lasp import recurrent_mixers

SOURCES = ("adapters", "hugging_face", "own_forward", "traced")
_LABELS = {"adapters": "adapter ", "hugging_face": "hugging_face", "own_forward": "own forward", "traced": "traced"}


def candidates(
    block: nn.Module, sample: tuple[Tensor, tuple, dict], config: Any, winner: str | None = None,
    skip: tuple[str, ...] = (),
) -> Iterator[tuple[str, Any]]:  # fmt: skip
    """``(source, anatomy)`` in the order to try, or ``(source, Unsupported(reason))`` for a source that
    cannot serve; ``winner`` (the source an earlier block of the trunk verified with) first; ``skip``: sources
    not to try."""
    if config.adapter is not None:
        yield "adapter=", AdapterAnatomy(named_adapter(config.adapter))
        return
    if winner is not None:  # the trunk's winner first, then the others in order (each made only when reached)
        yield from ((s, a) for s, a in _all(block, sample, config, only=winner, skip=skip))
    yield from ((s, a) for s, a in _all(block, sample, config, skip=skip) if s != winner)


def _all(block: nn.Module, sample: tuple[Tensor, tuple, dict], config: Any,
         only: str | None = None, skip: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:  # fmt: skip
    """The sources in order, each anatomy made when reached (tracing costs); ``only``: that source alone."""
    for source in config.sources if config.sources is not None else SOURCES:
        if (only is not None and not only.startswith(_LABELS[source])) or source in skip:
            continue
        if source == "adapters":
            for adapter in matching_adapters(block):
                if only is None or only == f"adapter {adapter.name!r}":
                    yield f"adapter {adapter.name!r}", AdapterAnatomy(adapter)
        elif source == "hugging_face":
            from lightning_parallel.anatomy import hugging_face

            yield "hugging_face", _attempt(lambda: hugging_face.anatomy_of(block, sample, config))
        elif source == "own_forward" and (config.tp_plan is not None or config.mlp_module is not None):
            from lightning_parallel.anatomy.own import OwnAnatomy

            yield "own forward", _attempt(lambda: OwnAnatomy.of(block, config))
        elif source == "traced":
            from lightning_parallel.anatomy import traced

            yield "traced", _attempt(lambda: traced.anatomy_of(block, sample, config))


def chains(block: nn.Module, config: Any) -> bool:
    """Whether sequence parallelism passes a recurrent mixer's state between ranks in ``block``
    (:mod:`lightning_parallel.lasp`): such a block is verified in float64 through its own casts."""
    return config.sp > 1 and not config.split and bool(recurrent_mixers(block))


def _attempt(make: Any) -> Any:
    try:
        return make()
    except Unsupported as reason:
        return reason


def features(config: Any) -> str:
    wanted = ["HelixPipe's cut at the attention call"] if getattr(config, "split", False) else []
    if config.tp > 1:
        wanted.append(f"tensor parallelism (tensor_parallel_size={config.tp})")
    if config.sp > 1:
        wanted.append(f"sequence parallelism ({config.sp_mode}, sequence_parallel_size={config.sp})")
    if config.mlp_chunks > 1:
        wanted.append(f"a chunked MLP (mlp_chunks={config.mlp_chunks})")
    return ", ".join(wanted) or "nothing"


def explain(block: nn.Module, config: Any, reasons: list[str]) -> str:
    tried = "".join(f"\n  - {r}" for r in reasons) or " none applies"
    hints = []
    if config.mlp_chunks > 1 and config.tp == 1 and config.sp == 1 and not config.split:
        hints.append("name the MLP with mlp_module='path.in.block'")
    elif config.mlp_chunks > 1 and any("MLP" in r or "mlp_module" in r for r in reasons):
        hints.append(f"pass mlp_chunks=1 (the MLP unchunked; mlp_chunks={config.mlp_chunks} found no MLP to chunk)")
    if config.tp > 1 and config.sp == 1 and not config.tp_plan:
        hints.append("name the projections with tp_plan={'pattern': 'colwise' | 'rowwise' | 'colwise_qkv'}")
    elif config.tp > 1 and config.tp_plan:
        # the plan was given: it shards the projections, but the block's own forward must then run on the
        # local widths, which a reshape by a head count stored on the block (e.g. view(B, T, 3, nh, hd)) cannot
        hints.append(
            f"tp_plan={dict(config.tp_plan)} shards the projections, but a user plan runs the block's own forward,"
            " which must then work on 1/tensor_parallel_size of every sharded width (no reshape by a head count"
            " or width stored on the block); drop tp_plan to let the traced graph derive a plan that localises"
            " those reshapes"
        )
    return (
        f"no anatomy of {type(block).__name__} serves {features(config)}; tried:{tried}\n"
        f"{''.join(h + ', or ' for h in hints)}pass adapter= (one of {sorted(ADAPTERS)}, or an object with"
        " pre/attention_call/post, see lightning_parallel.anatomy.adapters.BlockAdapter)"
    )


def first_verified(
    block: nn.Module,
    sample: tuple[Tensor, tuple, dict],
    config: Any,
    winner: str | None,
    build: Callable[[Any], Callable[[nn.Module], tuple[Any, Any]]],
    groups: list[Any],
    proven: set[tuple] | None = None,
) -> tuple[str, Any]:
    """``(source, anatomy)`` of the first source (:mod:`lightning_parallel.anatomy.resolve`) whose candidate
    ``build(anatomy)`` verifies against ``block`` on ``sample``; an explicit ``adapter=`` that fails is the
    error; when none verifies, an :class:`AnatomyError` names every source tried and why. ``proven`` (kept by
    the caller across a trunk's blocks): ``(source, fingerprint)`` of the blocks verified so far; a source whose
    code serves the whole family (``family_level``: an adapter, the model's own forward) is not verified again
    on a block of a fingerprint it verified on (a traced graph is verified on every block it serves)."""
    with watchdog.bounded(f"the verification of {type(block).__name__} for {features(config)}"):
        x, args, kwargs = sample
        mark = fingerprint(block) if proven is not None else None
        seen = proven is not None and any(m == mark for _, m in proven)  # a block like it was verified
        checked = (config.split or config.sp > 1) and config.adapter is None and not seen
        attending = attends(block, sample) if checked else True
        chained = chains(block, config)
        if not attending and not chained:
            raise AnatomyError(
                f"no anatomy of {type(block).__name__} serves {features(config)}: the block computes no attention (no"
                " attention call and no softmax over scores in a call on the first batch); its tokens mix through a"
                " recurrent mixer (a linear attention, a state-space model) or not at all. HelixPipe cuts a block at"
                " its attention call; sequence parallelism splits attention, and passes a recurrent mixer's state"
                " between ranks only where it keeps it in transformers' cache; train it under pipeline,"
                " tensor_parallel or hybrid"
            )
        reasons: list[str] = []
        if not attending:  # a traced graph is split at attention; tracing a recurrent mixer costs tens of seconds
            reasons.append("traced: the block computes no attention, where a traced graph is split")
        for source, anatomy in candidates(block, sample, config, winner, skip=() if attending else ("traced",)):
            if isinstance(anatomy, Exception):
                reasons.append(f"{source}: {anatomy}")
                continue
            if proven is not None and (source, mark) in proven and getattr(anatomy, "family_level", False):
                return source, anatomy  # the family's code, verified on a block identical to this one
            try:
                verify(block, x, args, kwargs, build(anatomy), name=anatomy.name, groups=groups, through=chained)
            except ConfigurationError:
                raise
            except Exception as err:  # noqa: BLE001  (the next source may serve this block)
                if source == "adapter=":
                    raise type(err)(f"{err}; pass adapter= with one that matches this block family") from err
                reasons.append(f"{source}: {err}")
                continue
            if proven is not None:
                proven.add((source, mark))
            return source, anatomy
        raise AnatomyError(explain(block, config, reasons))


def fingerprint(block: nn.Module) -> tuple:
    """What a block computes besides its parameters' values: for every submodule, its class, every attribute that
    is not a parameter, buffer, submodule or hook (numbers, strings, flags, ``layer_idx``, tensors by value; a
    shared object such as the model's config by identity, another object by identity: never equal by accident),
    its buffers by value and its parameters' shapes and dtypes. Two blocks with equal fingerprints run the same
    code on the same settings; one differing attribute (rotary off in one layer, a window) tells them apart."""
    return tuple(
        (name, type(m), tuple((k, _mark(v)) for k, v in sorted(vars(m).items()) if not _machinery(k)),
         tuple((k, _mark(b)) for k, b in m._buffers.items()),
         tuple((k, _parameter_mark(p)) for k, p in m._parameters.items()))
        for name, m in block.named_modules()
    )  # fmt: skip


def _parameter_mark(p: Optional[torch.Tensor]) -> Optional[tuple]:
    return None if p is None else (tuple(p.shape), p.dtype, p.requires_grad)


def _machinery(key: str) -> bool:
    return key in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "forward", "training") or (
        key.endswith("_hooks") or key.endswith("_hooks_with_kwargs") or key.endswith("_always_called")
        or key.startswith("_state_dict") or key.startswith("_load_state_dict")
    )  # fmt: skip


def _mark(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, type)):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_mark(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((str(k), _mark(v)) for k, v in value.items()))
    if isinstance(value, Tensor):
        if value.device.type == "meta":  # no values yet: only the same tensor is the same
            return ("tensor", tuple(value.shape), value.dtype, id(value))
        raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", tuple(value.shape), value.dtype, hash(raw))
    return ("object", type(value).__name__, id(value))
