"""Hugging Face blocks (transformers >= 5), from the model's own metadata instead of attribute names:

- **Tensor parallelism**: the block's entries of the config's ``base_model_tp_plan`` (``"layers.*.self_attn
  .q_proj": "colwise"``), applied with plain DTensor styles; the model's own forward runs on the shards
  (Hugging Face forwards shape their projections by ``-1`` heads). A family whose forward uses its global
  head count (GPT-J) fails verification and falls through to the traced graph.
- **Attention through the registry**: the config's ``_attn_implementation`` is pointed at
  ``lightning_parallel_<original>``, registered with ``AttentionInterface`` together with the original's mask
  function in ``AttentionMaskInterface`` (a registered attention function without its mask function would
  silently drop the mask). Outside the block layer it runs the original; under sequence parallelism it is
  :func:`lightning_parallel.sequence_parallel.attend` (Ulysses or ring) around the original, called by the
  model's own forward; while HelixPipe traces the block it is one custom op, where the graph is cut.
- **Sequence arguments**: the Hugging Face calling convention (``position_embeddings``, ``position_ids``,
  ``cache_position`` carry the sequence; ``attention_mask`` stays whole for the attention).
- **MLP**: the block's ``mlp``.

Over 400 lines because every Hugging Face family's anatomy is read from the model's own metadata (configs,
attention interface, tensor-parallel plans, caches) in this one place, rather than per family.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, fx, nn

from lightning_parallel.anatomy.hf_config import PREFIX, configs_of
from lightning_parallel.block_protocol import AttentionCall, Shared, Split, argument
from lightning_parallel.errors import ConfigurationError, Unsupported

STYLES = {  # base_model_tp_plan style -> this library's module style
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_replicated_output",
    "rowwise_split_input": "rowwise_replicated_input",
    "packed_colwise": "packed_colwise",
    "packed_rowwise": "packed_rowwise",  # a 3-D expert weight (experts, in, gate|up): its packed last dim
    "replicated_with_grad_allreduce": "replicated_partial_grad",
    "moe_tp_experts": "experts_partial_output",
}
SEQUENCE_KWARGS = {"position_ids": -1, "cache_position": -1}  # and position_embeddings=(cos, sin): dim -2
#: flash-attn's variable-length arguments (documents of a packed batch), as transformers passes them
VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: a per-head parameter an attention call takes (learned sinks, GPT-OSS: ``s_aux=self.sinks``); a traced call keeps it
#: as one of its tensors, so tensor parallelism shards it with the heads (traced/tensor.py)
SINKS = ("s_aux",)


@dataclass
class _Route:
    """Where this call of the registered attention function goes (set by the block layer around a block)."""

    shard: Any = None  # a sequence shard: distributed attention
    trace: dict[str, tuple[str, dict]] | None = None  # tracing: key -> (module path, static kwargs)
    block: nn.Module | None = None
    calls: int = 0
    names: dict[int, str] = field(default_factory=dict)
    chained: int = 0  # calls of a recurrent mixer whose state passed between sp ranks (lightning_parallel.lasp)


_ROUTE: ContextVar[_Route | None] = ContextVar("lightning_parallel_hf_route", default=None)


@contextmanager
def routed(route: _Route) -> Iterator[_Route]:
    token = _ROUTE.set(route)
    try:
        yield route
    finally:
        _ROUTE.reset(token)


def _original(module: nn.Module, name: str) -> Any:
    """The attention function the model would call for implementation ``name``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _attention(original: str) -> Any:
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  **kwargs: Any) -> tuple[Tensor, None]:  # fmt: skip
        fn = _original(module, original)
        route = _ROUTE.get()
        if route is None:
            return fn(module, query, key, value, attention_mask, **kwargs)
        route.calls += 1
        if route.trace is not None:
            return _traced(route, module, query, key, value, attention_mask, original, kwargs), None
        shard = route.shard
        sliding = kwargs.get("sliding_window")
        if shard.mode == "ring" and attention_mask is None and sliding is not None and shard.length > sliding:
            raise ConfigurationError(
                f"sequence_parallel_mode='ring' needs the sliding window ({sliding}) as an explicit mask; the"
                f" {type(module).__name__} call passed none: use sequence_parallel_mode='ulysses'"
            )

        sinks = _sinks(module, kwargs)
        whole = dict(kwargs)
        if shard.mode == "ulysses" and isinstance(kwargs.get("position_ids"), Tensor):
            # the function sees the whole sequence (for 1/sp of the heads): flash-attention's variable-length path
            # reads the documents from the whole row's positions
            whole["position_ids"] = shard.gather(kwargs["position_ids"], -1)

        def inner(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            own, kw = module, whole
            if sinks:  # this rank's head group (Ulysses: rank r holds heads r*H/sp...) and their sinks alone
                group = q.shape[1]
                heads = slice(shard.mesh.get_local_rank() * group, (shard.mesh.get_local_rank() + 1) * group)
                own, kw = _SinksOf.cut(module, kwargs, heads)
                kw = {**whole, **kw}
            return fn(own, q, k, v, attention_mask, **kw)[0].transpose(1, 2)

        def info() -> AttentionCall:
            causal = getattr(module, "is_causal", True) and attention_mask is None
            own = kwargs["s_aux"] if "s_aux" in sinks else module.sinks if sinks else None
            return AttentionCall(causal, kwargs.get("scaling"), kwargs.get("dropout", 0.0), attention_mask,
                                 kwargs.get("softcap"), own)  # fmt: skip

        from lightning_parallel.sequence_parallel import attend

        return attend(shard, query, key, value, inner, info).transpose(1, 2).contiguous(), None

    attention.__name__ = f"{PREFIX}{original}"
    return attention


def _experts_plan(name: str) -> dict[str, str]:
    """transformers 5's routed experts, ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)`` applied with
    ``F.linear``: every expert's hidden size sharded (gate|up rank-aligned), the partial output summed."""
    return {f"{name}.gate_up_proj": "packed_colwise", f"{name}.down_proj": "rowwise", name: "experts_partial_output"}


def _experts(block: nn.Module, hidden: int) -> list[str]:
    """The block's modules holding exactly transformers 5's standard expert weights (see :func:`_experts_plan`);
    a layout of another kind (biases, interleaved gate and up, ``(E, H, 2I)``) is left replicated."""
    found = []
    for name, module in block.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if set(params) != {"gate_up_proj", "down_proj"} or any(True for c in module.children() for _ in c.parameters()):
            continue
        gate_up, down = params["gate_up_proj"], params["down_proj"]
        if gate_up.dim() == down.dim() == 3 and gate_up.shape[2] == hidden == down.shape[1]:
            if gate_up.shape[1] == 2 * down.shape[2]:
                found.append(name)
    return found


def _sinks(module: nn.Module, kwargs: dict) -> list[str]:
    """Where an attention call takes learned sinks (a logit per head in the softmax's denominator, GPT-OSS):
    ``module.sinks`` (the eager function reads it) and the ``s_aux=`` argument (flash-attention's)."""
    found = ["sinks"] if isinstance(getattr(module, "sinks", None), Tensor) else []
    return found + (["s_aux"] if isinstance(kwargs.get("s_aux"), Tensor) else [])


class _SinksOf:
    """An attention module as one Ulysses rank's head group sees it: its ``sinks`` cut to those heads (the
    function reads them per head); every other attribute its own. The gradient of the cut flows into the
    module's parameter, each rank's into its heads, and the sequence-parallel sum of block gradients adds
    them up."""

    def __init__(self, module: nn.Module, sinks: Tensor) -> None:
        self.__dict__.update(_module=module, sinks=sinks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    @classmethod
    def cut(cls, module: nn.Module, kwargs: dict, heads: slice) -> tuple[Any, dict]:
        """The module and the keyword arguments with their sinks cut to ``heads``."""
        own = cls(module, module.sinks[heads]) if isinstance(getattr(module, "sinks", None), Tensor) else module
        kw = {"s_aux": kwargs["s_aux"][heads]} if isinstance(kwargs.get("s_aux"), Tensor) else {}
        return own, kw


def register(original: str) -> str:
    """Register ``lightning_parallel_<original>`` (attention and mask function); returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"{PREFIX}{original}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        if original not in ALL_MASK_ATTENTION_FUNCTIONS:
            raise Unsupported(f"transformers has no mask function for attention implementation {original!r}")
        AttentionInterface.register(name, _attention(original))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


# ------------------------------------------------------------------------------ the cut (tracing)
@torch.library.custom_op("lightning_parallel::hf_attention", mutates_args=())
def hf_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, extras: list[Tensor],
                 call: str) -> Tensor:  # fmt: skip
    """A Hugging Face attention call as one op of a traced graph (HelixPipe's cut): ``extras`` are the call's
    other tensor arguments (``position_ids``, flash-attention's ``cu_seq_lens_*``: the documents of a packed
    row), named in the trace's record of ``call``. The split replaces it by the call itself, so this body only
    runs if a graph is executed unsplit."""
    raise RuntimeError("lightning_parallel::hf_attention runs only inside a split traced graph")


@hf_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, extras: list[Tensor], call: str) -> Tensor:
    B, H, T, _ = query.shape
    return query.new_empty(B, T, H, value.shape[-1])


def _traced(route: _Route, module: nn.Module, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, original: str,
            kwargs: dict) -> Tensor:  # fmt: skip
    parameters = sorted(n for n, value in kwargs.items() if isinstance(value, nn.Parameter) and n not in SINKS)
    if parameters:
        raise Unsupported(f"its attention call takes parameters of the block ({parameters})")
    assert route.trace is not None and route.block is not None
    if not route.names:
        route.names = {id(m): n for n, m in route.block.named_modules()}
    static = {n: value for n, value in kwargs.items() if not isinstance(value, Tensor)}
    tensors = sorted(n for n, value in kwargs.items() if isinstance(value, Tensor))
    key = f"call{len(route.trace)}"
    route.trace[key] = (route.names[id(module)], {**static, "_original": original, "_tensors": tensors})
    return torch.ops.lightning_parallel.hf_attention(q, k, v, mask, [kwargs[n] for n in tensors], key)


def resolve_calls(gm: fx.GraphModule, calls: dict[str, tuple[str, dict]]) -> None:
    """Make each traced attention op of ``gm`` call the model's attention function with the block's module
    (``(q, k, v, mask, extras, block)``: q, k, v stay the first arguments, as for SDPA)."""
    block = next(n for n in gm.graph.nodes if n.op == "placeholder")
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.lightning_parallel.hf_attention.default:
            q, k, v, mask, extras, key = node.args
            path, kwargs = calls[key]
            node.target = _call(path, kwargs)
            node.args = (q, k, v, mask, extras, block)
    gm.recompile()


def _call(path: str, kwargs: dict) -> Any:
    kwargs = dict(kwargs)
    original, names = kwargs.pop("_original"), kwargs.pop("_tensors")

    def hf_attention_call(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, extras: list[Tensor],
                          block: nn.Module) -> Tensor:  # fmt: skip
        module = block.get_submodule(path)
        tensors = dict(zip(names, extras))
        own: Any = module
        if isinstance(tensors.get("s_aux"), Tensor) and isinstance(getattr(module, "sinks", None), Tensor):
            own = _SinksOf(module, tensors["s_aux"])  # the call's sinks (a rank's heads'): what the function reads
        return _original(module, original)(own, q, k, v, mask, **kwargs, **tensors)[0]

    hf_attention_call.hf_attention_call = True  # type: ignore[attr-defined]  (what the graph analysis cuts at)
    return hf_attention_call


# ---------------------------------------------------------------------------------------- anatomy
def anatomy_of(block: nn.Module, sample: tuple[Tensor, tuple, dict], config: Any) -> HuggingFaceAnatomy:
    if "transformers" not in sys.modules:
        raise Unsupported("not a Hugging Face block (transformers is not imported)")
    configs = configs_of(block)
    if not configs:
        raise Unsupported("not a Hugging Face block (no PretrainedConfig on it)")
    if config.tp_sequence_parallel:
        raise Unsupported(
            "tp_sequence_parallel=True: the model's own forward shapes its projections by the whole sequence"
        )
    ring = config.sp > 1 and config.sp_mode == "ring"
    return HuggingFaceAnatomy(configs[0], sample, family_level=not config.split, ring=ring)


class HuggingFaceAnatomy(Shared):
    name = "hugging_face"

    def __init__(self, hf_config: Any, sample: tuple[Tensor, tuple, dict], family_level: bool,
                 ring: bool = False) -> None:  # fmt: skip
        self.hf_config, self.sample, self.family_level, self.ring = hf_config, sample, family_level, ring
        self.original = getattr(hf_config, "_attn_implementation", None) or "eager"
        if self.original.startswith(PREFIX):
            self.original = self.original[len(PREFIX) :]

    def heads(self, block: nn.Module) -> tuple[int, int]:
        c = self.hf_config
        heads = getattr(c, "num_attention_heads", None)
        if heads is None:
            raise Unsupported("its config names no num_attention_heads")
        return heads, getattr(c, "num_key_value_heads", None) or heads

    def sequence_dim(self, block: nn.Module) -> int:
        return 1

    def sequence_args(self, block: nn.Module, args: tuple, kwargs: dict, index: Tensor) -> tuple[tuple, dict]:
        self._check_documents(block, args, kwargs)
        local = dict(kwargs)
        if isinstance(local.get("position_embeddings"), (tuple, list)):
            local["position_embeddings"] = tuple(t.index_select(-2, index) for t in local["position_embeddings"])
        for name, dim in SEQUENCE_KWARGS.items():
            if isinstance(local.get(name), Tensor):
                local[name] = local[name].index_select(dim, index)
        return args, local

    def _check_documents(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        """Refuse ring attention on a packed batch whose documents reach the attention other than by a mask:
        flash-attention's variable-length path takes them from ``cu_seq_lens_*`` (``DataCollatorWithFlattening(
        return_flash_attn_kwargs=True)``) or from restarting ``position_ids`` and builds no mask, and the ring's
        own kernel computes chunk pairs under the call's mask. (Ulysses gives the function the whole sequence and
        the whole row's ``position_ids``; other implementations build the document mask, which both modes split.)"""
        from lightning_parallel.anatomy.flash import flash_like
        from lightning_parallel.packing import is_packed

        if not self.ring or not flash_like(self.original):
            return
        if isinstance(argument(block, args, kwargs, "attention_mask"), Tensor):
            return
        varlen = sorted(n for n in VARLEN_KWARGS if kwargs.get(n) is not None)
        position_ids = kwargs.get("position_ids")
        if varlen or (isinstance(position_ids, Tensor) and is_packed(position_ids)):
            given = ", ".join(varlen) if varlen else "position_ids that restart (packed documents)"
            raise ConfigurationError(
                f"sequence_parallel_mode='ring' cannot split this packed batch's attention: {type(block).__name__}"
                f" calls attn_implementation={self.original!r} with {given} and no mask, and the ring's chunk pairs"
                " would attend across documents; use sequence_parallel_mode='ulysses' (the function then sees whole"
                " rows), or attn_implementation='sdpa' (transformers builds the document mask, which the ring splits)"
            )

    def attention_mask(self, block: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """The call's ``attention_mask`` when it is a tensor (whole sequence, original order), else ``None``."""
        mask = argument(block, args, kwargs, "attention_mask")
        return mask if isinstance(mask, Tensor) else None

    def _plan_entries(self, block: nn.Module, names: set[str]) -> dict[str, str]:
        """The config's ``base_model_tp_plan`` entries for ``names`` of this block, in transformers' style names."""
        plan = getattr(self.hf_config, "base_model_tp_plan", None) or {}
        entries = ((key.split(".*.", 1)[1], style) for key, style in plan.items() if ".*." in key)  # not embedding/head
        return {name: style for name, style in entries if name in names}

    def tp_plan_styles(self, block: nn.Module) -> dict[str, str]:
        """The config's ``base_model_tp_plan`` entries of this block's modules (empty without one)."""
        return self._plan_entries(block, {n for n, _ in block.named_modules()})

    def tp_plan(self, block: nn.Module) -> dict[str, str]:
        from lightning_parallel import tensor_parallel as tp

        if not getattr(self.hf_config, "base_model_tp_plan", None):
            raise Unsupported(f"its config ({type(self.hf_config).__name__}) has no base_model_tp_plan")
        names = {n for n, _ in block.named_modules()} | {n for n, _ in block.named_parameters()}
        out = {}
        for name, style in self._plan_entries(block, names).items():
            if style == "mla_kv_a_proj":  # latent attention's kv down projection: [compressed kv | rope key]
                rope = getattr(self.hf_config, "qk_rope_head_dim", None)
                if not isinstance(rope, int):
                    raise Unsupported(f"base_model_tp_plan['layers.*.{name}'] = 'mla_kv_a_proj' needs the config's"
                                      " qk_rope_head_dim")  # fmt: skip
                out[name] = f"{tp.TAIL_GRAD}:{rope}"
                continue
            if style not in STYLES:
                raise Unsupported(f"base_model_tp_plan['layers.*.{name}'] = {style!r} is not one of {sorted(STYLES)}")
            out[name] = STYLES[style]
        if not out:
            raise Unsupported("no entry of its base_model_tp_plan names a module of the block")
        for name in _experts(block, self.hf_config.hidden_size):
            if not any(entry == name or entry.startswith(f"{name}.") for entry in out):
                out.update(_experts_plan(name))
        return out

    def _route(self, block: nn.Module, config: Any) -> None:
        """Point the block's configs at the registered attention function (the real model's config is the
        model's: its mask creation then uses the registered mask function, the same as the original's)."""
        name = register(self.original)
        for c in configs_of(block):
            c._attn_implementation = name

    def local_forward(self, block: nn.Module, config: Any, tp_layout: Any, prefix: str) -> Any:
        from lightning_parallel import tensor_parallel as tp
        from lightning_parallel.mlp_chunks import chunk_mlp

        if config.tp > 1 and not config.tp_plan and not self.tp_plan_styles(block) and self.original != "sdpa":
            # no plan names the block's modules and the graph would not show its attention (GPT-OSS's eager
            # function, with sinks): the plan derived from the graph traced with the model's attention call as one
            # op (an SDPA block is served by the traced source, whose graph shows SDPA itself)
            return self.traced(block)[0].local_forward(block, config, tp_layout, prefix)
        if config.tp > 1:
            plan = tp.expand_plan(block, dict(config.tp_plan)) if config.tp_plan else self.tp_plan(block)
            tp.check_heads(block, self.heads(block), config.tp)
            tp.check_divisible(block, plan, config.tp)
            tp.shard_modules(block, prefix, plan, config.tp_mesh, tp_layout)
        if config.mlp_chunks > 1:
            mlp = getattr(block, "mlp", None)
            if not isinstance(mlp, nn.Module):
                raise Unsupported("the block has no `mlp` submodule to chunk")
            chunk_mlp(mlp, "forward", config.mlp_chunks, -2, type(block).__name__)
        if config.sp > 1:
            self._route(block, config)
            from lightning_parallel.lasp import Chained, recurrent_mixers

            for mixer in recurrent_mixers(block):
                mixer.forward = Chained(mixer, _chain_shard)
        return _HFForward()

    def routed_trace(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> Any:
        """The block traced with its attention call as one op (``lightning_parallel::hf_attention``, resolved to a
        call of the model's attention function with the block's module): HelixPipe's cut, and the attention the
        traced tensor-parallel plan shards by heads."""
        return self._routed(block, x, args, kwargs)[0]

    def _routed(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> tuple[Any, dict]:
        from lightning_parallel.anatomy.traced.program import trace

        name = register(self.original)
        calls: dict[str, tuple[str, dict]] = {}
        saved = [(c, c._attn_implementation) for c in configs_of(block)]
        try:
            for c, _ in saved:
                c._attn_implementation = name
            program = trace(
                block, x, args, kwargs, attention_route=lambda copy: routed(_Route(trace=calls, block=copy))
            )
        finally:
            for c, value in saved:
                c._attn_implementation = value
        if not calls:
            raise Unsupported("the block does not call transformers' attention registry")
        resolve_calls(program.gm, calls)
        return program, calls

    def traced(self, block: nn.Module) -> tuple[Any, dict]:
        """The block's :class:`~lightning_parallel.anatomy.traced.TracedAnatomy` over :meth:`routed_trace`, and
        the trace's record of its attention calls."""
        from lightning_parallel.anatomy.traced import TracedAnatomy

        x, args, kwargs = self.sample
        program, calls = self._routed(block, x, args, kwargs)
        return TracedAnatomy(program, type(block).__name__, tracer=self.routed_trace), calls

    def helix_split(self, block: nn.Module, config: Any, tp_layout: Any = None, prefix: str = "") -> Split:
        """The block traced with its attention call as one op (the cut), split there (HelixPipe)."""
        traced, calls = self.traced(block)
        if config.mlp_module is None and isinstance(getattr(block, "mlp", None), nn.Module):
            config = replace(config, mlp_module="mlp")  # the family's MLP, as local_forward chunks it (a mixture too)
        # a plan given is applied or refused, never ignored: tp_plan= (the traced split compares it), else the model's
        wanted = ("the config's base_model_tp_plan", self.tp_plan_styles(block)) if not config.tp_plan else None
        split = traced.helix_split(block, config, tp_layout, prefix, wanted)
        return replace(split, name="hugging_face", heads_dim=2, attention_call=_call_of(*calls.values()))


def _call_of(traced: tuple[str, dict]) -> Any:
    """The parameters of a traced attention call (ring attention's arguments), as :func:`_attention` reads them."""
    path, static = traced

    def call(block: nn.Module, args: tuple, kwargs: dict) -> AttentionCall:
        mask = argument(block, args, kwargs, "attention_mask")
        mask = mask if isinstance(mask, Tensor) else None
        module = block.get_submodule(path)
        if mask is None and static.get("sliding_window") is not None:
            raise ConfigurationError(
                f"sequence_parallel_mode='ring' needs the sliding window ({static['sliding_window']}) as an explicit"
                f" mask; the {type(module).__name__} call passed none: use sequence_parallel_mode='ulysses'"
            )
        causal = getattr(module, "is_causal", True) and mask is None
        return AttentionCall(causal, static.get("scaling"), static.get("dropout", 0.0), mask, static.get("softcap"))

    return call


class _HFForward(Shared):
    """The model's own forward; with a sequence shard, its registered attention function distributes."""

    def __call__(self, block: nn.Module, x: Tensor, args: tuple, kwargs: dict, shard: Any = None) -> Any:
        if shard is None:
            return type(block).forward(block, x, *args, **kwargs)
        with routed(_Route(shard=shard)) as route:
            out = type(block).forward(block, x, *args, **kwargs)
        if route.calls == 0 and route.chained == 0:
            raise Unsupported("the block does not call transformers' attention registry")
        return out


def _chain_shard() -> Any:
    """The sequence shard a recurrent mixer's state is chained over in this call (None outside one)."""
    route = _ROUTE.get()
    if route is None or route.shard is None:
        return None
    route.chained += 1
    return route.shard
