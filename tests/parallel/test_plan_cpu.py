"""`musespark plan --device cpu`: one CPU server's resident bytes (with the cpu backend's packed
copies), KV budget and projected speed; `plan --model DIR` reads the checkpoint's quantization."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import musespark
from musespark.backends.cpu_args import WeightArgs
from musespark.bench.presets import preset_config
from musespark.cli import main
from musespark.layers.linear import Linear
from musespark.layers.moe import Experts
from musespark.parallel import plan_memory
from musespark.parallel.cpu_server import plan_cpu_server
from musespark.parallel.plan import GB
from musespark.quant.dense import DenseExperts, DenseLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from write_816b_slice import write_slice  # noqa: E402

OPEN = "muse-spark-open-816b"
NARROW = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2, moe_hidden=128, moe_intermediate=128)


@pytest.fixture(scope="module")
def slice_dir(tmp_path_factory):
    dst = tmp_path_factory.mktemp("plan") / "slice"
    summary = write_slice(dst, layers=3, vocab=512, bf16_expert_layers=[1], **NARROW)
    return dst, summary


def run_json(capsys, *argv: str) -> tuple[dict, str]:
    assert main(["plan", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1]), out


def test_816b_nvfp4_fits_a_768gb_server_and_prints_the_projection(capsys):
    c, out = run_json(capsys, "--preset", OPEN, "-q", "nvfp4", "--device", "cpu", "--memory", "768GB")
    assert c["fits"] and c["projection"] and "projection (not a measurement)" in out
    (gpu,) = plan_memory(preset_config(OPEN), quantization="nvfp4")
    assert c["weight_bytes"] == gpu.weight_bytes
    assert 528 < c["weight_bytes"] / GB < 530  # the released checkpoint's ~529 GB
    # the panel path's second copy of every dense weight and the head: +38.7 GB
    packed = c["packed_bytes"]
    assert abs((packed["dense_linears"] + packed["lm_head"]) / GB - 38.68) < 0.01
    assert packed["bf16_experts"] == 0 and not c["experts_packed"]  # 4 x 51.5 GB do not fit in what is left
    assert c["resident_bytes"] == c["weight_bytes"] + sum(packed.values())
    assert c["kv_cache_bytes"] == c["memory_bytes"] - c["resident_bytes"]
    per_token = gpu.kv_bytes_per_token
    assert c["kv_tokens"] == c["kv_cache_bytes"] // (per_token * 16) * 16
    # batch 1 reads the non-expert weights, 8 of 256 experts per layer, the head: ~54.4 GB
    assert 54 < c["decode_bytes_per_token"] / GB < 55
    assert c["decode_tokens_per_s"] == pytest.approx(250 * GB * 0.6 / c["decode_bytes_per_token"])
    assert c["prefill_macs_per_token"]["nvfp4_experts"] == 60 * 8 * 3 * 4096 * 4096
    assert "bandwidth assumed" in out


def test_stated_rates_change_the_projection(capsys):
    base = ["--preset", OPEN, "-q", "nvfp4", "--device", "cpu", "--memory", "768"]
    one, _ = run_json(capsys, *base, "--bandwidth", "300", "--cores", "32")
    two, out = run_json(capsys, *base, "--bandwidth", "600", "--sockets", "2", "--cores", "64", "--context", "4096")
    assert two["decode_bytes_per_token"] > one["decode_bytes_per_token"]  # 4096 tokens of KV read too
    assert two["decode_tokens_per_s"] == pytest.approx(600 * GB * 0.6 / two["decode_bytes_per_token"])
    assert two["prefill_tokens_per_s"] == pytest.approx(2 * one["prefill_tokens_per_s"])
    assert "NUMA" in out and not two["bandwidth_assumed"]
    avx2, _ = run_json(capsys, *base, "--cpu-path", "avx2")
    assert sum(avx2["packed_bytes"].values()) == 0 and avx2["resident_bytes"] == avx2["weight_bytes"]


def test_packed_bytes_are_what_the_cpu_backend_packs(slice_dir):
    """The plan's packed copies equal the extra tensors the cpu backend's weight arguments hold
    on a panel path (cpu_args.WeightArgs, bf16 experts packed too)."""
    dst, _ = slice_dir
    model = musespark.load_model(dst, backend="torch")
    args = WeightArgs(panels=True, pack_experts=True)
    extra = {"dense_linears": 0, "lm_head": 0, "bf16_experts": 0}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and isinstance(m.format, DenseLinear):
            extra["lm_head" if name == "lm_head" else "dense_linears"] += sum(
                t.numel() * t.element_size() for t in args.linear(m)[1:]
            )
        elif isinstance(m, Experts) and isinstance(m.format, DenseExperts):
            extra["bf16_experts"] += sum(t.numel() * t.element_size() for ts in args.experts(m) for t in ts[1:])
    assert extra["bf16_experts"] > 0
    cfg = model.config
    (rank,) = plan_memory(cfg, quantization="nvfp4", bf16_expert_layers=[1])
    server = plan_cpu_server(cfg, rank, 1.0, bf16_expert_layers={1}, quantized=True, expert_panels="1")
    assert server.packed_bytes == extra
    auto_small = plan_cpu_server(cfg, rank, 0.004, bf16_expert_layers={1}, quantized=True)
    auto_large = plan_cpu_server(cfg, rank, 10.0, bf16_expert_layers={1}, quantized=True)
    assert not auto_small.experts_packed and auto_large.experts_packed


def test_model_dir_reads_the_checkpoint_quantization(slice_dir, capsys):
    dst, summary = slice_dir
    gpu, out = run_json(capsys, "--model", str(dst))
    assert gpu["quantization"] == "nvfp4" and "nvfp4 checkpoint" in out
    assert gpu["max_weight_bytes"] == summary["bytes"]  # the NVFP4 bytes on disk, not bf16
    cpu, _ = run_json(capsys, "--model", str(dst), "--device", "cpu", "--memory", "1")
    assert cpu["weight_bytes"] == summary["bytes"]
    unquantized = plan_memory(musespark.load_model(dst, backend="torch").config)[0].weight_bytes
    assert unquantized > summary["bytes"]  # what plan --model reported before it read the quantization config


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--device", "cpu"], "--device cpu needs --memory GB"),
        (["--memory", "768GB"], "--memory need --device cpu"),
        (["--device", "cpu", "--memory", "768", "-tp", "2"], "one process"),
        (["--device", "cpu", "--memory", "768", "--device-memory", "80"], "not --device-memory"),
        (["--device", "cpu", "--memory", "768", "--efficiency", "1.5"], r"efficiency must be in \(0, 1\]"),
        (["--device", "cpu", "--memory", "768", "--sockets", "0"], "sockets must be an integer >= 1"),
    ],
)
def test_cpu_flag_errors(capsys, argv, message):
    assert main(["plan", "--preset", OPEN, *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_memory_size_spelling(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--preset", OPEN, "--device", "cpu", "--memory", "lots"])
    assert "expected a positive size in GB" in capsys.readouterr().err
    c, _ = run_json(capsys, "--preset", OPEN, "-q", "nvfp4", "--device", "cpu", "--memory", "1.5e3 GB")
    assert c["memory_bytes"] == 1500 * 10**9
