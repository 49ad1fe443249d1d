"""benchmarks/nvfp4_fallback.py at a tiny width: it writes an all-NVFP4 slice, times the torch
backend against the native cpu backend per decode step (and the previous formula with
--previous), removes the slice and ends with one JSON line. The ratios are reported, not checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from musespark.kernels import cpu

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2, moe_hidden=128, moe_intermediate=128)


@pytest.mark.skipif(cpu.native_ops() is None, reason="the comparison needs the native kernels")
def test_fallback_benchmark_reports_both_backends_per_decode_step(tmp_path):
    widths = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    args = ["--vocab", "512", "--batches", "1,4", "--steps", "2", "--prompt-len", "4", "--previous", "--threads", "1"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/nvfp4_fallback.py", *args, *widths, "--dir", str(tmp_path)],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "nvfp4_fallback" and out["slice"]["experts"] == 8 and out["threads"] == 1
    assert sorted(out["decode"]) == ["1", "4"]
    for batch, r in out["decode"].items():
        for name in ("cpu", "torch", "torch_previous"):
            assert len(r["steps_ms"][name]) == 2 and r[f"{name}_ms_per_step"] > 0
        assert r["torch_over_cpu"] == pytest.approx(r["torch_ms_per_step"] / r["cpu_ms_per_step"], rel=1e-2)
        assert r["torch_over_cpu_process_time"] > 0 and r["cpu_process_ms_per_step"] > 0
        assert 0 < r["torch_experts_ms_per_step"] <= r["torch_ms_per_step"]
        assert r["max_logit_diff_over_max_logit"] < 0.05, batch  # the same model on both backends
        assert r["torch_logits_identical_to_previous"] is True
    assert (tmp_path / "slice" / "config.json").exists()  # --dir keeps what it wrote
