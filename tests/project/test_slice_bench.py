"""benchmarks/slice_816b.py on a narrow slice: it writes the slice, measures every phase, checks
native against torch in two processes, projects the 816B model, deletes what it wrote and ends
with one JSON line. The numbers are not checked (they are not pass/fail), only reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from musespark.kernels import cpu

ROOT = Path(__file__).resolve().parents[2]
NARROW = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2, moe_hidden=128, moe_intermediate=128)


@pytest.mark.skipif(cpu.native_ops() is None, reason="the cpu backend needs the native kernels")
def test_slice_benchmark_reports_every_phase(tmp_path):
    dst = tmp_path / "slice"
    widths = [f"--{k.replace('_', '-')}={v}" for k, v in NARROW.items()]
    args = ["--write", str(dst), "--delete", "--layers", "2", "--vocab", "512", "--bf16-expert-layers", "1"]
    args += ["--batches", "1,4", "--steps", "1", "--prefill-len", "8", "--bandwidth-mb", "16", "--check"]
    args += ["--check-steps", "2", *widths]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "benchmarks/slice_816b.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not dst.exists()  # --delete
    assert out["config"]["num_hidden_layers"] == 2 and out["written"]["bf16_expert_layers"] == [1]
    load = out["load"]
    assert load["checkpoint_bytes"] > out["written"]["bytes"] and load["peak_rss_bytes"] > 0
    assert len(load["load_s"]) == len(load["cold_read_s"]) == 1
    assert sorted(out["decode"]) == ["1", "4"]
    # batch 1 reads the dense weights and top_k experts a layer; 4 tokens choose more of them
    assert out["decode"]["1"]["distinct_experts_per_layer"] == 2
    assert out["decode"]["4"]["step_bytes"] > out["decode"]["1"]["step_bytes"]
    assert out["prefill"]["tokens"] == 8
    check = out["check"]
    assert check["backends"] == ["cpu", "torch"] and check["finite"] and len(check["greedy_native"]) == 2
    proj = out["projection_816b"]
    assert proj["projection"] is True and proj["layers"] == 62 and proj["bf16_expert_layers"] == [0, 61]
    assert 5.2e11 < proj["checkpoint_bytes"] < 5.4e11  # the released ~529 GB
