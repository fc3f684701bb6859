"""The repository stands on its own: a LICENSE matching pyproject.toml, and docstrings and comments that
cite only what a reader of the repository can open (no internal review tags, tracker numbers or files
outside the repository)."""

from __future__ import annotations

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
