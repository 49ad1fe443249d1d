"""What every benchmark reports besides its figures: machine, versions, commit, command."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .. import env
from ..cpu_features import AVX2_ONLY_ENV, cpu_model

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float], scale: float = 1000.0, ps: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """mean and pNN of `values` times `scale` (seconds -> ms by default); NaN when empty."""
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in ps}}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in ps}}


def _repo_root() -> Path | None:
    for parent in Path(__file__).resolve().parents:
        if (parent / ".git").exists():
            return parent
    return None


def git_commit() -> str | None:
    """The checkout's HEAD commit (what `git rev-parse HEAD` prints), or None outside a checkout."""
    root = _repo_root()
    if root is None:
        return None
    git = root / ".git"
    try:  # read .git directly first: no subprocess, works without git installed
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        packed = git / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        return out or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpu": cpu_model(), "cpu_count": os.cpu_count()}
    try:
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        info["torch_num_threads"] = torch.get_num_threads()
        # What PyTorch (and so transformers) runs on: its vector ISA and whether its bf16 matmuls go through
        # oneDNN. Both follow the CPU unless capped by the variables of AVX2_ONLY_ENV, recorded below.
        info["torch_isa"] = torch.backends.cpu.get_cpu_capability()
        info["torch_onednn_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    limits = {name: os.environ[name] for name in AVX2_ONLY_ENV if name in os.environ}
    if limits:
        info["isa_limits"] = limits
    from .. import hugepages
    from ..cpu_features import detected_isa

    info["isa"] = detected_isa()
    info["hugepages"] = hugepages.describe()
    if "musespark.kernels.cpu" in sys.modules:  # only when this run used the kernels (no build here)
        kernels = sys.modules["musespark.kernels.cpu"]
        info["kernel_path"] = kernels.kernel_path() if kernels._tried else "not loaded"
        info["batch_invariant"] = kernels.batch_invariant()
        chosen = kernels.expert_panels_chosen  # None: no cpu backend was made in this run
        info["expert_panels"] = env.expert_panels() + (
            "" if chosen is None else ": packed" if chosen else ": not packed"
        )
    return info


def versions() -> dict[str, str | None]:
    from importlib import metadata

    from .. import __version__

    out: dict[str, str | None] = {"python": platform.python_version(), "musespark": __version__}
    for name in ("torch", "numpy", "transformers", "httpx", "xgrammar"):
        mod = sys.modules.get(name)  # the imported one wins; else what is installed (bench serve imports no torch)
        version = getattr(mod, "__version__", None) if mod is not None else None
        if version is None:
            try:
                version = metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
        out[name] = str(version) if version is not None else None
    return out


def environment() -> dict[str, Any]:
    """The keys every benchmark's JSON line ends with."""
    return {
        "machine": machine(),
        "versions": versions(),
        "commit": git_commit(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def print_json(result: dict[str, Any]) -> None:
    """Print the result (plus the environment) as the last line of output."""
    print(json.dumps({**result, **environment()}), flush=True)


def parse_range(text: str) -> tuple[int, int]:
    """'N' -> (N, N); 'LO,HI' -> (LO, HI) with 1 <= LO <= HI."""
    import argparse

    try:
        parts = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want N or LO,HI, got {text!r}") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError(f"want N or LO,HI with 1 <= LO <= HI, got {text!r}")
    return parts[0], parts[1]
