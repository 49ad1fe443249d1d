"""The native kernels' sources (kernels/csrc/, by operation): every file built or hashed, every
file shipped in a wheel, and the layout rules the build depends on.

kernels/cpu.py compiles every .cpp under csrc/<operation>/ and hashes every .h there into the
cache key; torch's builder names each object file after its source's base name, so two
sources with one base name would overwrite each other's object; a wheel carries only the
files pyproject.toml's package data matches (tests/project/test_install.py installs one).
File checks only: no compiler needed."""

from __future__ import annotations

import tomllib
from pathlib import Path

from musespark.kernels import cpu

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "musespark"
CSRC = PACKAGE / "kernels" / "csrc"


def _files() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_every_kernel_file_is_built_or_hashed():
    files = _files()
    assert files, f"no kernel sources under {CSRC.relative_to(REPO)}"
    assert {p.suffix for p in files} <= {".cpp", ".h"}, [p.name for p in files if p.suffix not in (".cpp", ".h")]
    assert {p.resolve() for p in cpu._SOURCES} == {p.resolve() for p in files if p.suffix == ".cpp"}
    assert {p.resolve() for p in cpu._HEADERS} == {p.resolve() for p in files if p.suffix == ".h"}


def test_sources_have_unique_base_names():
    stems = [p.stem for p in cpu._SOURCES]
    assert sorted(stems) == sorted(set(stems)), [s for s in stems if stems.count(s) > 1]


def test_package_data_ships_every_kernel_file():
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["musespark"]
    shipped = {p for g in globs for p in PACKAGE.glob(g)}
    missing = [str(p.relative_to(PACKAGE)) for p in _files() if p not in shipped]
    assert not missing, f"not matched by [tool.setuptools.package-data]: {missing}"


def test_kernel_files_are_one_level_below_csrc_and_short():
    for p in _files():
        assert p.parent.parent == CSRC, f"{p.relative_to(CSRC)}: kernel files sit in csrc/<operation>/"
        lines = p.read_text().count("\n")
        assert lines <= 600, f"{p.relative_to(CSRC)}: {lines} lines (at most 600 per C++ file)"


# Umbrella headers that parse most of torch (and, for the first three, pybind11 and torch's
# Python bindings): every file that includes one costs seconds more to compile. The files
# include what they use: <ATen/core/Tensor.h>, <ATen/Parallel.h>, <ATen/ops/NAME.h> per at::
# function, <c10/...>.
HEAVY_HEADERS = ("torch/extension.h", "torch/python.h", "torch/all.h", "torch/torch.h", "ATen/ATen.h", "pybind11/")


def test_kernel_files_include_no_umbrella_headers():
    for p in _files():
        for line in p.read_text().splitlines():
            if line.startswith("#include"):
                assert not any(h in line for h in HEAVY_HEADERS), f"{p.relative_to(CSRC)}: {line}"


def test_only_registering_files_include_the_registration_headers():
    for p in _files():
        text = p.read_text()
        if "#include <torch/library.h>" in text:
            assert "TORCH_LIBRARY" in text, f"{p.relative_to(CSRC)}: <torch/library.h> without a TORCH_LIBRARY block"
        if "#include <torch/custom_class.h>" in text:
            assert "class_<" in text, f"{p.relative_to(CSRC)}: <torch/custom_class.h> without a custom class"
