"""The project speaks of itself: tracked files outside tests/ name no working session or issue number
(history is cited by commit and date), no path of a developer's machine, and no reference document
that lives outside the repository (the repo's own pages are under docs/)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# What may not appear, with why.
FORBIDDEN = {
    "a working session or issue number": re.compile(r"\b[Ss]essions? [0-9]+|\b[Ii]ssues? [0-9]+"),
    "a path of a developer's machine": re.compile(r"/work/|/root/|/tmp/[a-z]|\.pyenv/|/home/[a-z]"),
    "a reference document outside the repo": re.compile(r"\b(MUSE_CHAT|NVFP4|PARALLEL|DSPARK|SPEC|DESIGN)\.md\b"),
}
# Weights, and a tokenizer's vocabulary (its tokens are data, not text about anything).
SKIP_SUFFIXES = {".safetensors"}
SKIP_NAMES = {"tokenizer.json"}


def offending_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, what it names, the line) for every forbidden mention in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            if pattern.search(line):
                found.append((number, what, line.strip()))
    return found


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"not a git checkout ({err})")
    paths = [REPO / p for p in out.splitlines() if not p.startswith("tests/")]
    return [p for p in paths if p.suffix not in SKIP_SUFFIXES and p.name not in SKIP_NAMES and p.is_file()]


def test_the_checker_finds_each_kind_of_mention():
    text = "ok line\nas measured in session 12\nsee /work/main/src\nper NVFP4.md §3\nsee docs/nvfp4.md §3\n"
    assert [(n, what) for n, what, _ in offending_lines(text)] == [
        (2, "a working session or issue number"),
        (3, "a path of a developer's machine"),
        (4, "a reference document outside the repo"),
    ]


def test_tracked_files_speak_of_the_project_only():
    files = tracked_text_files()
    assert any(p.name == "README.md" for p in files)
    bad = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        bad += [f"{path.relative_to(REPO)}:{n}: {what}: {line[:160]}" for n, what, line in offending_lines(text)]
    assert not bad, "\n".join(bad)
