"""`plan_memory` / `musespark plan`: per-rank memory of a TP/EP/PP deployment, from the config.

The 816B figures are docs/parallel.md §10's table (GB = 1e9 bytes); the small-model check ties
the plan to what a real checkpoint holds."""

from __future__ import annotations

import json

import pytest
import torch

from musespark.bench.presets import CONFIG_ONLY, make_checkpoint, preset_config
from musespark.checkpoint.names import keeps_fp32
from musespark.cli import main
from musespark.config import ModelConfig
from musespark.parallel import expert_range, plan_memory, pp_layer_split
from musespark.parallel.plan import GB, layer_params, total_params

OPEN = "muse-spark-open-816b"

# docs/parallel.md §10: (tp, pp) -> per-rank GB: attn, pool+unpool, router, embed/head, experts, total; bf16 then NVFP4.
TABLE = {
    (8, 1): dict(attn=3.38, pool=8.32, router=0.52, embed_head=0.83, experts=(199.72, 60.80), total=(212.8, 73.9)),
    (16, 1): dict(attn=1.69, pool=8.32, router=0.52, embed_head=0.41, experts=(99.86, 30.40), total=(110.8, 41.4)),
    (8, 2): dict(attn=1.69, pool=4.16, router=0.26, embed_head=0.41, experts=(99.86, 30.40), total=(106.4, 36.9)),
}
NVFP4_SPLIT = {(8, 1): (54.36, 6.44), (16, 1): (27.18, 3.22), (8, 2): (27.18, 3.22)}


@pytest.fixture(scope="module")
def open_cfg() -> ModelConfig:
    return preset_config(OPEN)


def close(value: float, expected: float, rel: float = 0.01) -> bool:
    return abs(value - expected) <= rel * expected


def test_open_preset_config(open_cfg):
    cfg = open_cfg
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (202048, 8192, 62, 128)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.num_local_experts, cfg.num_experts_per_tok) == (16, 64, 256, 8)
    assert (cfg.moe_hidden_size, cfg.moe_intermediate_size, cfg.tie_word_embeddings) == (4096, 4096, False)
    assert all(cfg.is_sparse(i) for i in range(62))
    full = [i for i in range(62) if not cfg.is_sliding(i)]
    assert len(full) == 16 and all((61 - i) % 4 == 0 for i in full) and cfg.sliding_window == 2048
    assert layer_params(cfg) == 816_680_189_440
    assert total_params(cfg) == 819_990_552_064


def test_open_preset_has_no_checkpoint(tmp_path):
    assert OPEN in CONFIG_ONLY
    with pytest.raises(ValueError, match="config only"):
        make_checkpoint(OPEN, cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("tp,pp", sorted(TABLE))
@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_parallel_md_table(open_cfg, tp, pp, quant):
    want = TABLE[tp, pp]
    q = quant is not None
    plans = plan_memory(open_cfg, tp=tp, ep=True, pp=pp, quantization=quant)
    assert len(plans) == tp * pp and [r.rank for r in plans] == list(range(tp * pp))
    for r in plans:
        w = {k: v / GB for k, v in r.weights.items()}
        assert r.experts[1] - r.experts[0] == 256 // tp
        assert close(w["attention"], want["attn"])
        assert close(w["pooler_unpooler"], want["pool"])
        assert close(w["router"] + w["router_bias"], want["router"])
        assert close(w["embedding"] + w["lm_head"], want["embed_head"])
        assert close(w["experts"], want["experts"][q])
        assert close(r.weight_bytes / GB, want["total"][q])
        if q:  # the NVFP4 experts + the experts of the BF16 layers 0 and 61
            nv, bf = NVFP4_SPLIT[tp, pp]
            assert close(r.experts_quantized_bytes / GB, nv)
            assert close((r.weights["experts"] - r.experts_quantized_bytes) / GB, bf)
        # KV: 2·(nKV/t)·D values per layer; 16 full layers (8 KiB/token at t=8), 46 sliding (46 MiB/seq)
        per_layer = 2 * (16 // tp) * 64 * 2
        n_full = sum(not open_cfg.is_sliding(i) for i in range(*r.layers))
        assert r.kv_bytes_per_token == n_full * per_layer
        assert r.kv_bytes_per_seq_sliding == (r.layers[1] - r.layers[0] - n_full) * per_layer * 2048
    if pp == 1:
        assert plans[0].kv_bytes_per_token == 8192 * 8 // tp
        assert plans[0].kv_bytes_per_seq_sliding == 46 * 2**20 * 8 // tp
    else:  # embedding on stage 0, lm_head on stage 1
        assert plans[0].weights["lm_head"] == 0 and plans[-1].weights["embedding"] == 0


def test_pp_split_matches_vllm(open_cfg):
    assert pp_layer_split(62, 2) == [31, 31]
    assert pp_layer_split(62, 4) == [15, 16, 16, 15]
    assert pp_layer_split(10, 4) == [2, 3, 3, 2]
    assert pp_layer_split(7, 4) == [2, 2, 2, 1]
    plans = plan_memory(open_cfg, tp=1, pp=4)
    assert [r.layers for r in plans] == [(0, 15), (15, 31), (31, 47), (47, 62)]
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        pp_layer_split(3, 4)


def test_expert_remainder_goes_to_low_ranks():
    assert [expert_range(8, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        moe_hidden_size=16,
        moe_intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        bos_token_id=1,
        eos_token_id=2,
    )
    plans = plan_memory(cfg, tp=3, ep=True)
    assert [r.experts[1] - r.experts[0] for r in plans] == [3, 3, 2]
    one = 3 * 32 * 16 * 2 * 2  # per expert per layer, bf16, 2 sparse layers
    assert [r.weights["experts"] for r in plans] == [3 * one, 3 * one, 2 * one]
    assert sum(r.weights["experts"] for r in plans) == plan_memory(cfg)[0].weights["experts"]
    with pytest.raises(ValueError, match="num_local_experts"):
        plan_memory(ModelConfig(**{**_fields(cfg), "num_local_experts": 2}), tp=3, ep=True)


def _fields(cfg: ModelConfig) -> dict:
    return {
        k: getattr(cfg, k)
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "moe_hidden_size",
            "moe_intermediate_size",
            "num_experts_per_tok",
            "sliding_window",
            "bos_token_id",
            "eos_token_id",
        )
    }


def test_kv_heads_must_divide(open_cfg):
    for tp in (3, 32):
        with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} must divide num_key_value_heads=16"):
            plan_memory(open_cfg, tp=tp)


def test_tp_shards_sum_to_whole(open_cfg):
    whole = plan_memory(open_cfg)[0].weights
    for ep in (False, True):
        plans = plan_memory(open_cfg, tp=4, ep=ep)
        for part in ("attention", "experts", "embedding", "lm_head"):
            assert sum(r.weights[part] for r in plans) == whole[part]
        for part in ("pooler_unpooler", "router", "router_bias", "norms_gates"):
            assert all(r.weights[part] == whole[part] for r in plans)  # replicated


def test_device_memory(open_cfg):
    r = plan_memory(open_cfg, tp=8, ep=True, quantization="nvfp4", device_memory_gb=141, max_model_len=131072)[0]
    free = 141 * GB - r.weight_bytes
    assert r.kv_cache_bytes == free and r.fits
    assert r.kv_tokens == free // (8192 * 16) * 16
    assert r.max_seqs_at_max_len == free // (131072 * 8192 + 2048 * 46 * 512)
    big = plan_memory(open_cfg, tp=8, ep=True, device_memory_gb=141)[0]
    assert not big.fits and big.kv_tokens == 0 and big.notes


def test_plan_equals_checkpoint_bytes():
    """tp=1: the plan's weight bytes are the bytes of every tensor a checkpoint holds."""
    from musespark.engine.args import bundled_model_path
    from musespark.model import MuseSparkForCausalLM, load_model

    model = load_model(bundled_model_path(), dtype="bfloat16", backend="torch")
    held = sum(t.numel() * t.element_size() for t in _checkpoint_tensors(model))
    assert plan_memory(model.config, dtype="bfloat16")[0].weight_bytes == held

    # A random small config with tied embeddings and a dense layer, built on meta (nothing allocated).
    cfg = ModelConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_hidden_size=32,
        moe_intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        mlp_layer_types=("dense", "sparse", "sparse"),
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.device("meta"):
        meta = MuseSparkForCausalLM(cfg)
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        held = sum(t.numel() * (4 if keeps_fp32(n) else size) for n, t in _named_checkpoint_tensors(meta))
        assert plan_memory(cfg, dtype=dtype)[0].weight_bytes == held


def _named_checkpoint_tensors(model):
    """Parameters (shared ones once) and persistent buffers: what a checkpoint holds."""
    seen = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        module = model.get_submodule(name.rpartition(".")[0])
        if t is None or name.rpartition(".")[2] in module._non_persistent_buffers_set or id(t) in seen:
            continue
        seen.add(id(t))
        yield name, t


def _checkpoint_tensors(model):
    return [t for _, t in _named_checkpoint_tensors(model)]


def test_cli_plan_json(capsys):
    assert main(["plan", "--preset", OPEN, "-tp", "8", "-ep", "-pp", "2", "--quantization", "nvfp4", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["world_size"] == 16 and len(out["ranks"]) == 16
    assert close(out["max_weight_bytes"] / GB, 36.9)
    assert any(line.startswith("0-7 ") and "30.40" in line and "36.93" in line for line in lines)
    assert main(["plan", "--preset", OPEN, "-tp", "3"]) == 2
    assert "tensor_parallel_size=3" in capsys.readouterr().err
