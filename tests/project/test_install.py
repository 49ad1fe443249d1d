"""A non-editable install works without the checkout: the wheel carries the bundled model
(package data), and `musespark generate` run from an unrelated directory uses it.

pip builds the wheel from a copy of the repository with the test environment's setuptools
(no build isolation, no index: nothing is downloaded) and installs it with `--target`
into a fresh directory put first on PYTHONPATH, so torch and the other dependencies come
from the test environment while musespark comes from the wheel. The native kernels' cache
is keyed by their source hash, so the installed copy reuses the one already built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_install_generates_from_any_directory(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    site = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-3000:]
    assert (site / "musespark" / "models" / "musespark-tiny" / "model.safetensors").is_file()

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MUSESPARK_MODEL", "PYTHONPATH")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import musespark; from musespark.engine.args import default_model_path; "
            "print(musespark.__file__); print(default_model_path())",
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    module, model = where.stdout.split()
    assert Path(module).is_relative_to(site) and Path(model).is_relative_to(site), where.stdout

    prompt = "def f():"
    out = subprocess.run(
        [str(site / "bin" / "musespark"), "generate", "--max-tokens", "4", prompt],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(prompt) and len(out.stdout.strip()) > len(prompt)
    assert "4 tokens" in out.stderr or "finish_reason=stop" in out.stderr
