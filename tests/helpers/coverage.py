"""The coverage matrix: strategy columns, and one cell's run (parity with one process, or the clear error a
configuration gets), shared by the matrix test, the adapters-off test and docs/coverage.md."""

from __future__ import annotations

import re
from dataclasses import dataclass

from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy
from tests.helpers.distributed import RankFailed
from tests.helpers.parity import assert_parity
from tests.helpers.zoo import HF_FAMILIES

# name -> (strategy factory, data-parallel size, ranks)
COLUMNS = {
    "pipeline": (lambda: PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), 1, 2),
    "helix": (lambda: HelixParallelStrategy(pipeline_parallel_size=2), 1, 2),
    "tensor_parallel": (lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 1, 2),
    "ulysses": (lambda: HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2), 1, 2),
    "ring": (
        lambda: HybridParallelStrategy(data_parallel_size=1, sequence_parallel_size=2, sequence_parallel_mode="ring"),
        1,
        2,
    ),
    "hybrid": (lambda: HybridParallelStrategy(data_parallel_size=2, recompute="no_attention", mlp_chunks=2), 2, 2),
    "helix_tp": (lambda: HelixParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2), 1, 4),
    "full_tp": (
        lambda: HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, data_parallel_sharding="full"),
        2,
        4,
    ),
    "expert_parallel": (lambda: HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=2), 2, 2),
}
#: the columns that apply to some rows only (the others show "n/a"): expert parallelism to the mixtures of experts
ONLY = {"expert_parallel": {"hf:mixtral", "hf:qwen3_moe", "hf:gpt_oss", "hf:deepseek_v3", "hf:llama4",
                            "packed:hf:mixtral"}}  # fmt: skip


def applies(row: str, column: str) -> bool:
    return column not in ONLY or row in ONLY[column]


COLUMN_TITLES = {
    "pipeline": "pipeline pp=2",
    "helix": "helix p=2",
    "tensor_parallel": "tensor_parallel tp=2",
    "ulysses": "sequence_parallel Ulysses sp=2",
    "ring": "sequence_parallel ring sp=2",
    "hybrid": "hybrid dp=2, no_attention, mlp_chunks=2",
    "helix_tp": "helix p=2 x tp=2",
    "full_tp": "hybrid dp=2 x tp=2, data_parallel_sharding='full'",
    "expert_parallel": "expert_parallel dp=2, ep=2 (mixtures)",
}
# the library's own errors: a cell that fails must end with one of these, never an internal traceback
CLEAR = re.compile(r"lightning_parallel\.errors\.(AnatomyError|ConfigurationError): (.+(\n  - .+)*)")


@dataclass
class Cell:
    status: str  # "parity" or "error"
    anatomy: str  # the anatomy that served, or "" (none needed)
    message: str = ""


#: the first loss (before any update: only the forward's rounding differs) must agree to this relative bound, which a
#: layer computed as its sibling would exceed (SmolLM3's layer without rotary under the 'llama' adapter: 6.7e-6);
#: the float32 parity bound (1e-5 + 1e-5 x |loss|) alone would pass a 1e-5 relative difference
FIRST_LOSS_RTOL = 2e-6


def run_cell(row: str, column: str, factory: object = None) -> Cell:
    """Train ``row`` under ``column`` against one process (float32 with SGD, docs/design.md "Parity tests"; the first
    loss within :data:`FIRST_LOSS_RTOL`). A failing rank's error is returned if it is one of the library's clear
    errors; anything else propagates."""
    from tests.helpers.parity import reference

    make, dp, world = COLUMNS[column]
    try:
        records = assert_parity(row, factory or make, world, data_parallel_size=dp, dtype="float32", steps=2)
    except RankFailed as failure:
        match = CLEAR.search(str(failure))
        if match is None:
            raise
        return Cell("error", "", match.group(2))
    first = reference(row, "float32", "sgd", 2, 8, ()).losses[0].double()
    for rank, r in enumerate(records):
        off = abs(float(r.losses[0].double() - first)) / abs(float(first))
        assert off <= FIRST_LOSS_RTOL, f"{row} under {column}, rank {rank}: first loss off by {off:.3g} relative"
    names = sorted({n for r in records for n in r.anatomy})
    return Cell("parity", ", ".join(names))


ROW_TITLES = {
    "hf:gpt2": "Hugging Face GPT-2",
    "hf:llama": "Hugging Face Llama",
    "hf:qwen2": "Hugging Face Qwen2",
    "hf:qwen3": "Hugging Face Qwen3",
    "hf:mistral": "Hugging Face Mistral (sliding window 8)",
    "hf:gemma3": "Hugging Face Gemma 3 (sliding + full layers)",
    "hf:phi3": "Hugging Face Phi-3",
    "hf:neox": "Hugging Face GPT-NeoX",
    "hf:opt": "Hugging Face OPT",
    "hf:falcon": "Hugging Face Falcon (new decoder architecture)",
    "hf:gptj": "Hugging Face GPT-J",
    "hf:mixtral": "Hugging Face Mixtral (MoE)",
    "hf:qwen3_moe": "Hugging Face Qwen3-MoE (routed top-k, 3-D expert weights)",
    "hf:gpt_oss": "Hugging Face GPT-OSS (attention sinks, sliding + full layers, biased experts)",
    "hf:deepseek_v3": "Hugging Face DeepSeek-V3 (latent attention, shared expert)",
    "hf:llama4": "Hugging Face Llama 4 (shared expert, 3-D experts sharded by its tp plan)",
    "hf:falcon_h1": "Hugging Face Falcon-H1 (attention and Mamba-2 side by side)",
    "hf:bert": "Hugging Face BERT (masked LM)",
    "litgpt": "litgpt GPT",
    "timm:vit": "timm VisionTransformer (torchvision stubbed, see below)",
    "lightning:demo": "Lightning demo Transformer (encoder-decoder)",
    "home:rope": "home-written, RoPE inside the block",
    "home:fused": "home-written, fused q\\|k\\|v, heads in `nh`",
    "home:alibi": "home-written attention by hand: ALiBi bias, causal mask buffer, no SDPA",
}
PACKED_ROWS = ("packed:gpt", "packed:llama", *(f"packed:hf:{family}" for family in HF_FAMILIES))
"""The same strategies on packed rows (several documents per row, tests/helpers/packed.py): the example decoders
and the Hugging Face causal LMs (each builds its document mask from ``position_ids``, as on one device)."""
_PACKED_TITLES = {
    "packed:gpt": "example GPT",
    "packed:llama": "example Llama",
    "packed:hf:opt": "Hugging Face OPT (its mask ignores `position_ids`: documents attend across, as on one device)",
}
ROW_TITLES.update({row: _PACKED_TITLES.get(row) or ROW_TITLES[row.removeprefix("packed:")] for row in PACKED_ROWS})
_SHORT = {"the traced graph": "traced", "hugging_face": "HF metadata"}


def markdown(results: dict[tuple[str, str], Cell]) -> str:
    """The matrix as Markdown tables (plain batches, then packed rows): a cell is parity (with the anatomy that
    served it) or the clear error."""
    errors: list[str] = []
    lines = _table([r for r in ROW_TITLES if not r.startswith("packed:")], results, errors)
    packed = _table([r for r in ROW_TITLES if r.startswith("packed:")], results, errors)
    if len(packed) > 2:
        lines += ["", "Packed rows (3 documents of uneven lengths per row of 32 tokens, `position_ids` restarting at each,"
                  " as `DataCollatorWithFlattening` lays them out; tests/helpers/packed.py):", "", *packed]  # fmt: skip
    passed = sum(c.status == "parity" for c in results.values())
    lines += [
        "",
        f"{passed} of {len(results)} cells reproduce single-process training ({100 * passed / len(results):.0f} %).",
    ]
    lines += [""] + [f"[{i}] {e}" for i, e in enumerate(errors, 1)]
    lines += ["", "timm: PyPI's torchvision for torch 2.13 cannot load beside the CPU build of torch 2.13 (\"operator"
              " torchvision::nms does not exist\"), and timm imports it at module level; the row imports timm's real"
              " VisionTransformer with tests/helpers/torchvision_stub.py standing in for torchvision, which ViT never"
              " calls."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _table(rows: list[str], results: dict[tuple[str, str], Cell], errors: list[str]) -> list[str]:
    rows = [r for r in rows if any((r, c) in results for c in COLUMNS)]
    lines = ["| model | " + " | ".join(COLUMN_TITLES[c] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for row in rows:
        cells = []
        for column in COLUMNS:
            cell = results.get((row, column))
            if cell is None:
                cells.append("not run" if applies(row, column) else "n/a")
            elif cell.status == "parity":
                served = ", ".join(
                    _SHORT.get(a.strip(), a.strip().replace("adapter ", "adapter "))
                    for a in cell.anatomy.split(",")
                    if a.strip()
                )
                cells.append("parity" + (f" ({served})" if served else ""))
            else:
                lines_ = cell.message.splitlines()
                reason = lines_[-1].split(": ", 1)[-1] if len(lines_) > 1 else lines_[0]  # why the last source failed
                errors.append(f"{ROW_TITLES[row]}, {COLUMN_TITLES[column]}: {lines_[0]} ... {reason}")
                cells.append(f"clear error [{len(errors)}]")
        lines.append(f"| {ROW_TITLES[row]} | " + " | ".join(cells) + " |")
    return lines
