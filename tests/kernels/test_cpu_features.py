"""ISA detection (CPUID via /proc/cpuinfo) and the MUSESPARK_ISA override: reported by
`python -m musespark.kernels` and in benchmark JSON; only lower levels may be forced."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from musespark import cpu_features as cf
from musespark import env


def test_detected_level_matches_the_flags(monkeypatch):
    monkeypatch.delenv(env.ISA, raising=False)  # the CPU's own level, whatever the run lowered it to
    f, level = cf.cpu_flags(), cf.detected_isa()
    assert level in cf.ISA_LEVELS
    if level != "none":
        assert {"avx2", "fma"} <= f
    if cf.ISA_LEVELS.index(level) >= cf.ISA_LEVELS.index("avx512"):
        assert {"avx512f", "avx512bw", "avx512vl"} <= f
    if level in ("avx512_bf16", "amx_bf16"):
        assert "avx512_bf16" in f and cf.has_native_bf16()


def test_override_lowers_but_never_raises(monkeypatch):
    have = cf.detected_isa()
    monkeypatch.setenv(env.ISA, "none")
    assert cf.isa() == "none" and not cf.has_native_bf16()
    monkeypatch.setenv(env.ISA, "bogus")
    with pytest.raises(ValueError, match="MUSESPARK_ISA"):
        cf.isa()
    higher = cf.ISA_LEVELS[cf.ISA_LEVELS.index(have) + 1 :] if have != cf.ISA_LEVELS[-1] else ()
    for level in higher:
        monkeypatch.setenv(env.ISA, level)
        with pytest.raises(ValueError, match="at most"):
            cf.isa()


def test_kernels_report_the_path_and_honour_isa_none():
    env = dict(os.environ, MUSESPARK_ISA="none")
    out = subprocess.run(
        [sys.executable, "-m", "musespark.kernels"], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "unavailable" in out.stdout and "allowed none; kernel path none" in out.stdout


def test_the_override_lowers_the_kernel_path():
    """MUSESPARK_ISA=avx2 runs the AVX2 kernels even where the CPU has AVX-512-BF16."""
    if cf.detected_isa() == "none":
        pytest.skip("kernel path avx2: this CPU has no AVX2+FMA")
    env = dict(os.environ, MUSESPARK_ISA="avx2")
    out = subprocess.run(
        [sys.executable, "-m", "musespark.kernels"], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "allowed avx2; kernel path avx2" in out.stdout


def test_batch_invariance_is_the_default_and_the_variable_is_checked(monkeypatch):
    from musespark.kernels import cpu

    monkeypatch.delenv(env.BATCH_INVARIANT, raising=False)
    assert cpu.batch_invariant()
    monkeypatch.setenv(env.BATCH_INVARIANT, "0")
    assert not cpu.batch_invariant()
    monkeypatch.setenv(env.BATCH_INVARIANT, "yes")
    with pytest.raises(ValueError, match="MUSESPARK_BATCH_INVARIANT"):
        cpu.batch_invariant()
