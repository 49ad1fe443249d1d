"""Peak resident memory while loading stays below 1.3x the final model size.

Measured in a fresh process: the kernel's high-water mark (VmHWM) is reset just before
`load_model` and read just after, so imports do not count.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from musespark.checkpoint import save_checkpoint
from musespark.config import ModelConfig
from musespark.model import MuseSparkForCausalLM, init_random_weights

CFG = ModelConfig(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    moe_hidden_size=512,
    moe_intermediate_size=512,
    num_local_experts=16,
    num_experts_per_tok=2,
    sliding_window=64,
    bos_token_id=1,
    eos_token_id=2,
    mlp_layer_types=("dense", "sparse", "sparse"),
)

PROBE = textwrap.dedent("""
    import json, sys, torch
    import musespark
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS high-water mark
    model = musespark.load_model(sys.argv[1], dtype=sys.argv[2])
    peak = status("VmHWM:")
    size = sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())
    size += sum(b.numel() * b.element_size() for b in model.buffers() if b is not None)
    print(json.dumps({"before": before, "peak": peak, "size": size}))
""")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    model = MuseSparkForCausalLM(CFG)
    init_random_weights(model, seed=0)
    path = tmp_path_factory.mktemp("big")
    save_checkpoint(model.state_dict(), CFG, path, dtype=torch.float32, max_shard_bytes=64 << 20)
    del model
    return path


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peak_memory_while_loading(checkpoint, dtype):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(checkpoint), dtype], capture_output=True, text=True, check=True
    )
    m = json.loads(out.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["before"]
    assert m["size"] > 50 << 20, "model too small for a meaningful measurement"
    assert growth < 1.3 * m["size"], f"peak grew by {growth / 2**20:.0f} MiB for a {m['size'] / 2**20:.0f} MiB model"
