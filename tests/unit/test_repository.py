"""The repository stands on its own: a LICENSE matching pyproject.toml, and docstrings and comments that
cite only what a reader of the repository can open (no internal review tags, tracker numbers or files
outside the repository)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"\breview [A-Z§]\d|\(review\b|DESIGN §|shared/|\bissue \d+\b|reference/[a-z-]+\.md")


def test_license_file_matches_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    assert declared == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_code_and_design_notes_cite_only_what_the_repository_holds():
    files = [*ROOT.glob("lightning_parallel/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py"),
             *ROOT.glob("examples/**/*.py"), ROOT / "docs" / "design.md"]  # fmt: skip
    found = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()[:80]}"
        for path in files
        if path != Path(__file__)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if CITATION.search(line)
    ]
    assert not found, "\n".join(found)


def _package_imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its body (function-level imports too), with the
    packages whose ``__init__`` such an import runs (a module's own parent packages excepted)."""
    package = ROOT / "lightning_parallel"
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (
                    ".".join(here[: len(here) - node.level + 1] + [node.module or ""]).strip(".")
                    if node.level
                    else node.module
                )
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                for i in range(2, len(parts) + 1):
                    name = ".".join(parts[:i])
                    if name in modules and name != module and not module.startswith(name + "."):
                        edges[module].add(name)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle (as a path that returns to its start), or ``None``."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


#: the package's floors, bottom-up: a module imports only from its own floor or one below (a top-level module or
#: folder of ``lightning_parallel`` is listed once; a new one must be placed here)
FLOORS: list[tuple[str, set[str]]] = [
    ("wire and mesh", {"errors", "_collectives", "_p2p", "mesh", "watchdog", "rng", "memory"}),
    ("tensors and files", {"block_protocol", "trunk", "partial", "flat_chunks", "offload", "packing", "token_mean",
                           "chunked_loss", "init_replay", "checkpoint", "export"}),
    ("parallel mechanics", {"ring_attention", "sequence_parallel", "tensor_parallel", "expert_parallel", "mlp_chunks",
                            "lasp", "recompute"}),
    ("anatomy", {"anatomy", "materialize"}),
    ("block layer", {"stack", "blocks"}),
    ("runtimes", {"pipeline"}),
    ("Lightning strategies", {"strategies", "lightning_patches"}),
    ("surface", {"callbacks", "plan", "pretrained", "__init__"}),
]  # fmt: skip


def _floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _upward(edges: dict[str, set[str]], floors: list[tuple[str, set[str]]]) -> list[str]:
    """Every import of a module on a higher floor than the importer's, as ``a (floor) -> b (floor)``."""
    level = {name: i for i, (_, names) in enumerate(floors) for name in names}
    return [
        f"{m} ({floors[level[_floor(m)]][0]}) -> {t} ({floors[level[_floor(t)]][0]})"
        for m, targets in sorted(edges.items())
        for t in sorted(targets)
        if level[_floor(t)] > level[_floor(m)]
    ]


def test_every_module_imports_only_from_its_floor_or_below():
    """The layers of docs/design.md ("The layers"): core never imports the strategies, the callbacks or the
    planner; each top-level module and folder sits on exactly one floor."""
    edges = _package_imports()
    listed = [name for _, names in FLOORS for name in names]
    assert len(listed) == len(set(listed)), "a name is on two floors"
    unplaced = sorted({_floor(m) for m in edges} - set(listed))
    assert not unplaced, f"place these in FLOORS: {unplaced}"
    up = _upward(edges, FLOORS)
    assert not up, "\n".join(up)


def test_the_floor_check_finds_an_upward_import():
    floors = [("low", {"a"}), ("high", {"b"})]
    edges = {"lightning_parallel.a.x": {"lightning_parallel.b"}, "lightning_parallel.b": {"lightning_parallel.a.x"}}
    assert _upward(edges, floors) == ["lightning_parallel.a.x (low) -> lightning_parallel.b (high)"]


def test_the_package_imports_form_no_circle():
    """The layers read bottom-up (collectives, mesh, trunk, the block-call protocol and the parallel mechanics,
    anatomy, block layer, runtimes, strategies): no module imports, even inside a function, one that imports it
    back."""
    edges = _package_imports()
    assert "lightning_parallel.mlp_chunks" in edges["lightning_parallel.anatomy.adapters"]  # a function-level import
    assert len(edges) > 50, sorted(edges)
    cycle = _cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def test_the_circle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
