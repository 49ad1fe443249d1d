"""Arrows one way: every import between the units of src/musespark points down one declared order.

A unit is a subpackage (`engine`, `kernels`, ...) or a top-level module (`config.py`,
`cli.py`); the package root (`musespark/__init__.py`: the lazily re-exported public API and
`__version__`) is the unit `__init__`. Every import of a musespark module counts, wherever it
is written: at module level, inside a function, under `if TYPE_CHECKING:`, absolute or
relative, and `importlib.import_module("musespark....")` with a literal name. An import inside
one unit is free; between two units it must go from a higher line of `ORDER` to a lower one.
Units on one line may not import each other. A unit that is not declared fails the test: a
new subpackage is placed in the order on purpose, not by accident.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "musespark"
ROOT_UNIT = "__init__"

# Top to bottom. Why this order:
# * applications first: `__main__` runs `cli`, whose sub-commands live beside it (generate_cli,
#   serve_cli, plan_cli); they run the benchmarks (`bench`), the server and the quantize tool
#   (`apps`); the benchmarks quantize presets.
# * the package root re-exports the offline API (engine, model, config) and holds
#   `__version__`, which the server and the benchmarks report.
# * `engine` drives everything below; `structured` (grammar masks) and `parsers` (tool and
#   reasoning output) are the engine's helpers and import the model's sampler at most.
# * `model` builds the decoder from `layers` and hands it a compute `backend`; backends type
#   the model's modules with their own Protocols (backends/modules.py), never model/.
# * `layers` hold weights through the formats of `quant`; `kernels` take tensors only;
#   `parallel` (rank state, collectives, process spawning) sits below every module that
#   shards; `checkpoint` names and reads tensors; `startup` draws progress (the kernel build's
#   notice, the weight bar); the leaves are plain settings, the shared value parsers of the
#   command line (`cli_parsing`) and errors.
ORDER: list[tuple[str, ...]] = [
    ("__main__",),
    ("cli",),
    ("generate_cli", "serve_cli", "plan_cli"),
    ("plan_cpu_cli",),
    ("bench", "server"),
    ("apps",),
    (ROOT_UNIT,),
    ("engine",),
    ("structured", "parsers"),
    ("model",),
    ("backends",),
    ("layers",),
    ("quant",),
    ("kernels",),
    ("parallel",),
    ("checkpoint",),
    ("cpu_features", "hugepages", "startup"),
    ("config", "sampling_params", "env", "cli_parsing"),
    ("errors",),
]


def _module_of(rel: Path) -> tuple[list[str], bool]:
    """src-relative file path -> (dotted module parts, whether it is a package __init__)."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        return parts[:-1], True
    return parts, False


def _unit(parts: list[str], units: set[str]) -> str | None:
    """The unit a module (dotted parts, or a name imported from a package) belongs to."""
    if not parts or parts[0] != PACKAGE:
        return None
    if len(parts) == 1 or parts[1] not in units:
        return ROOT_UNIT  # the package itself, or a name defined in its __init__ (`__version__`)
    return parts[1]


def _imports(tree: ast.AST, parts: list[str], is_pkg: bool) -> list[tuple[int, list[str]]]:
    """Every musespark module (or package name) the file imports: (line, dotted parts)."""
    package = parts if is_pkg else parts[:-1]
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            else:
                base = []
            base = base + (node.module.split(".") if node.module else [])
            if base == [PACKAGE] or (node.level and not node.module):
                found += [(node.lineno, base + [a.name]) for a in node.names]  # `from .. import x`
            else:
                found.append((node.lineno, base))
        elif (
            isinstance(node, ast.Call)
            and (
                getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) == "import_module"
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value.split(".")))
    return found


def upward_imports(sources: dict[str, str], order: list[tuple[str, ...]]) -> list[str]:
    """`sources`: src-relative path ("musespark/engine/core.py") -> Python text. Returns one
    line per import that breaks `order` ("path:line: unit -> unit (module)"), and one per
    unit that `order` does not declare."""
    rank = {unit: i for i, line in enumerate(order) for unit in line}
    units: set[str] = set()
    for path in sources:
        parts, _ = _module_of(Path(path))
        units.add(parts[1] if len(parts) > 1 else ROOT_UNIT)
    problems = [f"unit {u!r} is not declared in the layer order" for u in sorted(units - set(rank))]
    for path, text in sorted(sources.items()):
        parts, is_pkg = _module_of(Path(path))
        src_unit = _unit(parts, units)
        for line, target in _imports(ast.parse(text, filename=path), parts, is_pkg):
            dst_unit = _unit(target, units)
            if dst_unit is None or dst_unit == src_unit or src_unit not in rank or dst_unit not in rank:
                continue
            if rank[dst_unit] <= rank[src_unit]:
                kind = "sideways" if rank[dst_unit] == rank[src_unit] else "upward"
                problems.append(f"{path}:{line}: {src_unit} -> {dst_unit} ({'.'.join(target)}): {kind}")
    return problems


def _tree_sources() -> dict[str, str]:
    files = sorted((SRC / PACKAGE).rglob("*.py"))
    assert files, f"no Python files under {SRC / PACKAGE}"
    return {str(f.relative_to(SRC)): f.read_text(encoding="utf-8") for f in files}


def test_every_import_between_units_points_down():
    problems = upward_imports(_tree_sources(), ORDER)
    assert not problems, "imports against the layer order (tests/project/test_layering.py ORDER):\n" + "\n".join(
        problems
    )


def test_every_declared_unit_exists_once():
    """A unit renamed or removed leaves no stale line in the order; none sits on two lines."""
    listed = [u for line in ORDER for u in line]
    assert len(listed) == len(set(listed)), (
        f"declared more than once: {sorted({u for u in listed if listed.count(u) > 1})}"
    )
    present = {
        p.stem if p.is_file() else p.name
        for p in (SRC / PACKAGE).iterdir()
        if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    declared = set(listed)
    assert declared <= present, f"declared but absent: {sorted(declared - present)}"


EXAMPLE_ORDER: list[tuple[str, ...]] = [("engine",), ("model",), ("kernels", "quant"), ("config",)]


def test_the_checker_catches_upward_sideways_and_hidden_imports():
    sources = {
        "musespark/__init__.py": "",
        "musespark/config.py": "import os\n",
        "musespark/engine/__init__.py": "from ..model import build\n",
        "musespark/model/__init__.py": (
            "from typing import TYPE_CHECKING\n"
            "from ..config import X\n"
            "if TYPE_CHECKING:\n"
            "    from musespark.engine.core import Engine\n"
        ),
        "musespark/model/load.py": "from . import build\n",
        "musespark/kernels/triton/attention.py": "def f():\n    from ...model import load\n",
        "musespark/kernels/cpu.py": "from ..quant import fmt\n",
        "musespark/quant/fmt.py": "import importlib\nm = importlib.import_module('musespark.engine')\n",
    }
    problems = upward_imports(sources, EXAMPLE_ORDER)
    assert problems == [
        "unit '__init__' is not declared in the layer order",
        "musespark/kernels/cpu.py:1: kernels -> quant (musespark.quant): sideways",
        "musespark/kernels/triton/attention.py:2: kernels -> model (musespark.model): upward",
        "musespark/model/__init__.py:4: model -> engine (musespark.engine.core): upward",
        "musespark/quant/fmt.py:2: quant -> engine (musespark.engine): upward",
    ]


def test_the_checker_resolves_names_imported_from_the_package_root():
    """`from .. import __version__` is the root unit; `from .. import engine` is the engine."""
    order = [("server",), (ROOT_UNIT,), ("engine",)]
    sources = {
        "musespark/__init__.py": "",
        "musespark/engine/core.py": "from .. import __version__\nfrom musespark import engine\n",
        "musespark/server/api.py": "from .. import __version__, engine\nimport musespark\n",
    }
    assert upward_imports(sources, order) == [
        "musespark/engine/core.py:1: engine -> __init__ (musespark.__version__): upward"
    ]
