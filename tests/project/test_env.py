"""One CPU plan: the environment variables that change what computes are read in one module
(`musespark/env.py`) and listed in docs/cpu.md; the reference code never looks at the CPU; the
row-count thresholds are one table that the kernels and Python both read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from musespark import env
from musespark.kernels import cpu

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "musespark"


def _python_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_compute_variables_are_named_only_in_the_env_module():
    names = set(env.COMPUTE)
    found = []
    for path in _python_files():
        if path == SRC / "env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert found == [], "\n".join(found)


def test_every_compute_variable_is_in_the_docs():
    text = (ROOT / "docs" / "cpu.md").read_text()
    section = text[text.index("## §4 Environment variables") : text.index("## §5")]
    listed = set(re.findall(r"^\| `([A-Z_]+)`", section, re.M))
    assert set(env.COMPUTE) <= listed, set(env.COMPUTE) - listed


@pytest.mark.parametrize(
    "name, value, reader",
    [
        (env.BATCH_INVARIANT, "yes", env.batch_invariant),
        (env.EXPERT_PANELS, "always", env.expert_panels),
    ],
)
def test_bad_values_name_the_variable(monkeypatch, name, value, reader):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}': expected"):
        reader()


def test_the_reference_code_never_tests_the_cpu():
    """The torch backend, the layers and the weight formats compute the same way on every CPU:
    only the CPU plan (and the kernels' own modules) may ask what the CPU can do."""
    reference = [*(SRC / "layers").glob("*.py"), *(SRC / "quant").glob("*.py"), SRC / "backends" / "torch_backend.py"]
    offenders = []
    for path in reference:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] + (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            )
            if any(n.split(".")[-1] in ("cpu_features", "env") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_thresholds_are_one_table():
    """Python reads the numbers the kernels compile in; no kernel source defines them again."""
    table = cpu.thresholds()
    assert {"kFp32FusedMaxRows", "kNvfp4NativeMaxRows", "kBf16GemmMaxRows", "kStreamMaxRows"} <= set(table)
    assert all(isinstance(v, int) and v > 0 for v in table.values())
    header = SRC / "kernels" / "csrc" / "common" / "thresholds.h"
    again = []
    for path in sorted((SRC / "kernels" / "csrc").rglob("*.[ch]*")):
        if path == header:
            continue
        for name in table:
            if re.search(rf"constexpr\s+\w+\s+{name}\s*=", path.read_text()):
                again.append(f"{path.relative_to(ROOT)}: {name}")
    assert again == [], again
