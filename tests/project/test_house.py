"""The house rules that a reader meets file by file: no Python module under src/ over 450 lines
(split by concept), and no process-global hooks on torch's modules (a backend derives what it
needs once, when it is chosen; nothing watches the model afterwards). The C++ sources' limit is
checked with the kernels (tests/kernels/test_kernel_sources.py)."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "musespark"
MAX_PYTHON_LINES = 450
# torch.nn.modules.module's process-wide hooks: every module of every model would run them.
GLOBAL_HOOK = re.compile(r"register_module_(forward|forward_pre|full_backward|full_backward_pre|\w+_registration)_hook")


def long_files(root: Path, limit: int) -> list[str]:
    return [
        f"{p.relative_to(root)}: {n} lines"
        for p in sorted(root.rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit
    ]


def test_no_python_module_is_over_the_limit():
    assert any(SRC.rglob("*.py"))
    assert not long_files(SRC, MAX_PYTHON_LINES), long_files(SRC, MAX_PYTHON_LINES)


def test_the_size_check_can_fail(tmp_path):
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_PYTHON_LINES + 1))
    (tmp_path / "small.py").write_text("x = 1\n")
    assert long_files(tmp_path, MAX_PYTHON_LINES) == [f"big.py: {MAX_PYTHON_LINES + 1} lines"]


def test_no_process_global_module_hooks():
    found = [
        f"{p.relative_to(SRC)}:{i}"
        for p in sorted(SRC.rglob("*.py"))
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if GLOBAL_HOOK.search(line)
    ]
    assert not found, found
    assert GLOBAL_HOOK.search("nn.modules.module.register_module_parameter_registration_hook(f)")
