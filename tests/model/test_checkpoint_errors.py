"""Loading checkpoints: every error path has a clear message; towers, prefixes, tying and
dtypes are handled as docs/spec.md §1 says. Small checkpoints are written by our own writer, no
transformers needed; bad files are crafted with `safetensors.torch` directly."""

import json
import pickle
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import musespark
from musespark.checkpoint import expected_shapes, save_checkpoint
from musespark.config import ModelConfig
from musespark.model import MuseSparkForCausalLM, init_random_weights

NESTED = "model.language_model."
PROMPT = [1, 5, 9, 17, 33, 2, 40, 63, 12, 7, 3]  # longer than the sliding window (4)


def small_config(**overrides) -> ModelConfig:
    kwargs = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        moe_hidden_size=16,
        moe_intermediate_size=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        bos_token_id=1,
        eos_token_id=2,
        mlp_layer_types=("dense", "sparse"),
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def build_model(cfg: ModelConfig, seed: int) -> MuseSparkForCausalLM:
    model = MuseSparkForCausalLM(cfg)
    init_random_weights(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def ref():
    """One random model and its reference fp32 logits."""
    cfg = small_config()
    model = build_model(cfg, seed=3)
    return model, model.prompt_logits(PROMPT)


@pytest.fixture(scope="module")
def saved(ref, tmp_path_factory):
    """Pristine nested and flat checkpoints of the reference model (never modified)."""
    model, _ = ref
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "nested": save_checkpoint(model.state_dict(), model.config, root / "nested", nested=True),
        "flat": save_checkpoint(model.state_dict(), model.config, root / "flat", nested=False),
    }


@pytest.fixture
def nested_copy(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved["nested"], tmp_path / "nested"))


@pytest.fixture
def flat_copy(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved["flat"], tmp_path / "flat"))


def weights(path: Path) -> Path:
    return path / "model.safetensors"


def rewrite(path: Path, edit) -> None:
    """Load model.safetensors, apply `edit(tensors)`, write it back."""
    tensors = load_file(str(weights(path)))
    edit(tensors)
    save_file(tensors, str(weights(path)), metadata={"format": "pt"})


def load(path, dtype="float32"):
    """The torch backend, as the reference models here: these tests compare loaded weights
    through exact logits, which only one computation gives bit for bit."""
    return musespark.load_model(path, dtype=dtype, backend="torch")


# ============================================================================ errors


def test_missing_tensor_names_tensor_and_shape(nested_copy):
    name = NESTED + "layers.1.mlp.experts.down_proj"
    rewrite(nested_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError) as info:
        load(nested_copy)
    msg = str(info.value)
    assert "missing" in msg
    assert "'layers.1.mlp.experts.down_proj'" in msg
    assert "[4, 16, 24]" in msg  # [E, Hm, Im]
    assert "model.safetensors" in msg
    # only the one missing tensor is reported
    assert "q_proj" not in msg and "more" not in msg


def test_many_missing_tensors_are_summarised(nested_copy):
    def drop_layer0(t):
        for k in [k for k in t if k.startswith(NESTED + "layers.0.")]:
            del t[k]

    rewrite(nested_copy, drop_layer0)
    with pytest.raises(
        ValueError,
        match=r"missing tensor\(s\) 'layers\.0\.input_layernorm\.weight' "
        r"\(expected shape \[32\]\).* and 8 more",
    ) as info:
        load(nested_copy)
    assert str(info.value).count("expected shape") == 5


def test_untied_checkpoint_without_lm_head_is_missing_it(flat_copy):
    rewrite(flat_copy, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing.*'lm_head\.weight' \(expected shape \[64, 32\]\)"):
        load(flat_copy)


@pytest.mark.parametrize(
    "bogus",
    [
        NESTED + "layers.0.self_attn.bogus.weight",
        NESTED + "layers.2.input_layernorm.weight",  # a layer this config does not have
        NESTED + "layers.0.mlp.gate.weight",  # router on a dense layer
        "something_else.weight",
    ],
)
def test_unexpected_text_tensor(nested_copy, bogus):
    rewrite(nested_copy, lambda t: t.__setitem__(bogus, torch.zeros(32)))
    with pytest.raises(ValueError, match=re.escape(f"unexpected tensor {bogus!r}")) as info:
        load(nested_copy)
    assert str(weights(nested_copy)) in str(info.value)


@pytest.mark.parametrize("prefix", [NESTED, "model."])
def test_wrong_shape_names_tensor_shapes_and_file(saved, tmp_path, prefix):
    form = "nested" if prefix == NESTED else "flat"
    path = Path(shutil.copytree(saved[form], tmp_path / form))
    name = prefix + "layers.0.self_attn.k_proj.weight"
    rewrite(path, lambda t: t.__setitem__(name, torch.zeros(32, 32)))
    with pytest.raises(ValueError) as info:
        load(path)
    msg = str(info.value)
    assert repr(name) in msg
    assert "has shape [32, 32], expected [16, 32]" in msg
    assert str(weights(path)) in msg


def test_wrong_shape_in_a_shard_names_that_shard(ref, tmp_path):
    model, _ = ref
    path = save_checkpoint(model.state_dict(), model.config, tmp_path / "sharded", max_shard_bytes=8192)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = NESTED + "layers.1.mlp.gate.weight"
    shard = index["weight_map"][name]
    assert len(set(index["weight_map"].values())) > 2
    tensors = load_file(str(path / shard))
    tensors[name] = torch.zeros(5, 32)
    save_file(tensors, str(path / shard))
    with pytest.raises(ValueError) as info:
        load(path)
    msg = str(info.value)
    assert str(path / shard) in msg
    assert f"{name!r} has shape [5, 32], expected [4, 32]" in msg


def test_sharded_checkpoint_with_missing_shard(ref, tmp_path):
    model, _ = ref
    path = save_checkpoint(model.state_dict(), model.config, tmp_path / "sharded", max_shard_bytes=8192)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json.*do not exist.*" + re.escape(shard.name)):
        load(path)


def test_tensor_in_two_shards(ref, tmp_path):
    model, _ = ref
    path = save_checkpoint(model.state_dict(), model.config, tmp_path / "sharded", max_shard_bytes=8192)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = NESTED + "norm.weight"
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    tensors = load_file(str(path / other))
    tensors[name] = torch.ones(32)
    save_file(tensors, str(path / other))
    with pytest.raises(ValueError, match=re.escape(repr(name)) + " appears twice"):
        load(path)


def test_integer_tensor_is_rejected(nested_copy):
    name = NESTED + "norm.weight"
    rewrite(nested_copy, lambda t: t.__setitem__(name, torch.zeros(32, dtype=torch.int32)))
    with pytest.raises(ValueError, match=re.escape(repr(name)) + r" has dtype torch\.int32, expected a float"):
        load(nested_copy)


def test_directory_without_config(nested_copy):
    (nested_copy / "config.json").unlink()
    with pytest.raises(ValueError, match=re.escape(str(nested_copy)) + r".*no config\.json"):
        load(nested_copy)


def test_path_that_does_not_exist(tmp_path):
    path = tmp_path / "no" / "such" / "checkpoint"
    with pytest.raises(ValueError, match=re.escape(repr(str(path))) + " does not exist"):
        load(path)


def test_path_that_is_a_file(nested_copy):
    with pytest.raises(ValueError, match=re.escape(repr(str(weights(nested_copy)))) + " is not a directory"):
        load(weights(nested_copy))


def test_directory_without_weights(nested_copy):
    weights(nested_copy).unlink()
    with pytest.raises(ValueError, match=re.escape(str(nested_copy)) + r".*no weights found"):
        load(nested_copy)


def _file_bytes(path: Path) -> bytes:
    return weights(path).read_bytes()


def test_truncated_file_data(nested_copy):
    data = _file_bytes(nested_copy)
    weights(nested_copy).write_bytes(data[: len(data) - 100])
    with pytest.raises(
        ValueError,
        match=re.escape(str(weights(nested_copy)))
        + r": not a valid safetensors file \(tensor '.*' ends at byte \d+ but the file has "
        + str(len(data) - 100)
        + r" bytes; truncated\?\)",
    ):
        load(nested_copy)


def test_truncated_inside_header(nested_copy):
    data = _file_bytes(nested_copy)
    weights(nested_copy).write_bytes(data[:200])
    with pytest.raises(
        ValueError, match=re.escape(str(weights(nested_copy))) + r".*header length \d+ does not fit in a 200-byte file"
    ):
        load(nested_copy)


@pytest.mark.parametrize("size", [0, 5])
def test_truncated_before_header_length(nested_copy, size):
    weights(nested_copy).write_bytes(_file_bytes(nested_copy)[:size])
    with pytest.raises(
        ValueError, match=re.escape(str(weights(nested_copy))) + rf".*file is {size} bytes, too short for a header"
    ):
        load(nested_copy)


def test_garbage_header_bytes(nested_copy):
    data = _file_bytes(nested_copy)
    (header_len,) = struct.unpack("<Q", data[:8])
    garbage = bytes((i * 37 + 201) % 256 for i in range(header_len))
    weights(nested_copy).write_bytes(data[:8] + garbage + data[8 + header_len :])
    with pytest.raises(
        ValueError,
        match=re.escape(str(weights(nested_copy))) + r": not a valid safetensors file \(header is not valid JSON",
    ):
        load(nested_copy)


def test_header_length_bigger_than_file(nested_copy):
    data = _file_bytes(nested_copy)
    bad_len = len(data) * 2
    weights(nested_copy).write_bytes(struct.pack("<Q", bad_len) + data[8:])
    with pytest.raises(
        ValueError,
        match=re.escape(str(weights(nested_copy)))
        + rf".*header length {bad_len} does not fit in a {len(data)}-byte file",
    ):
        load(nested_copy)


def test_header_offsets_inconsistent_with_shape(nested_copy):
    data = _file_bytes(nested_copy)
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    name = NESTED + "norm.weight"
    begin, _ = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, begin + 4]  # [32] fp32 needs 128 bytes
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    assert len(raw) == header_len
    weights(nested_copy).write_bytes(data[:8] + raw + data[8 + header_len :])
    with pytest.raises(ValueError, match=re.escape(repr(name)) + r" of dtype F32 and shape \[32\] needs 128 bytes"):
        load(nested_copy)


@pytest.mark.parametrize("pickle_name", ["pytorch_model.bin", "model.pt"])
def test_pickle_checkpoint_is_refused(nested_copy, monkeypatch, pickle_name):
    weights(nested_copy).unlink()
    (nested_copy / pickle_name).write_bytes(b"this is not loaded by anyone\x00\x01\x02")

    def never(*args, **kwargs):
        raise AssertionError("the loader tried to unpickle")

    monkeypatch.setattr(torch, "load", never)
    monkeypatch.setattr(pickle, "load", never)
    monkeypatch.setattr(pickle, "loads", never)
    monkeypatch.setattr(pickle, "Unpickler", never)
    with pytest.raises(ValueError) as info:
        load(nested_copy)
    msg = str(info.value)
    assert pickle_name in msg
    assert "never unpickles" in msg
    assert "safetensors" in msg


@pytest.mark.parametrize("dtype", ["int8", "float64", torch.int8, torch.float64])
def test_bad_dtype_argument(saved, dtype):
    with pytest.raises(ValueError, match=r"dtype.*" + re.escape(repr(dtype) if isinstance(dtype, str) else str(dtype))):
        musespark.load_model(saved["nested"], dtype=dtype)


@pytest.mark.parametrize("form", ["nested", "flat"])
def test_bad_config_json_in_checkpoint(saved, tmp_path, form):
    path = Path(shutil.copytree(saved[form], tmp_path / form))
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"] if form == "nested" else config
    text["num_key_value_heads"] = 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=re.escape(str(path / "config.json")) + r".*'num_attention_heads'.*'num_key_value_heads'.*got 2 and 3",
    ):
        load(path)


def test_invalid_json_config_in_checkpoint(nested_copy):
    (nested_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(str(nested_copy / "config.json")) + ".*invalid JSON"):
        load(nested_copy)


def test_config_that_disagrees_with_weights(nested_copy):
    """A config with a different width than the weights: a shape error, not a crash."""
    config = json.loads((nested_copy / "config.json").read_text())
    config["text_config"]["vocab_size"] = 65
    (nested_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"'(lm_head\.weight|model\.language_model\.embed_tokens\.weight)' "
        r"has shape \[64, 32\], expected \[65, 32\]",
    ):
        load(nested_copy)


# ============================================================================ successes


@pytest.mark.parametrize("form", ["nested", "flat"])
def test_tower_tensors_are_skipped(saved, ref, tmp_path, form):
    path = Path(shutil.copytree(saved[form], tmp_path / form))

    def add_towers(t):
        t["model.vision_tower.blocks.0.weight"] = torch.randn(7, 3)
        t["model.audio_tower.x.weight"] = torch.randn(5)
        t["model.vision_adapter.proj.weight"] = torch.randn(2, 2)
        t["model.multi_modal_projector.linear.weight"] = torch.randn(4, 9)
        t["model.audio_tower.ids"] = torch.arange(6)  # not even a float tensor

    rewrite(path, add_towers)
    assert "model.vision_tower.blocks.0.weight" in load_file(str(weights(path)))
    model = load(path)
    torch.testing.assert_close(model.prompt_logits(PROMPT), ref[1], rtol=0, atol=0)


def test_flat_and_nested_load_identically(saved, ref):
    assert all(k.startswith((NESTED, "lm_head.")) for k in load_file(str(weights(saved["nested"]))))
    flat_keys = set(load_file(str(weights(saved["flat"]))))
    assert not any(k.startswith(NESTED) for k in flat_keys)
    assert "model.embed_tokens.weight" in flat_keys
    a, b = load(saved["nested"]), load(saved["flat"])
    la, lb = a.prompt_logits(PROMPT), b.prompt_logits(PROMPT)
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    torch.testing.assert_close(la, ref[1], rtol=0, atol=0)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb), na


def test_loaded_weights_equal_saved_weights(saved, ref):
    model = load(saved["nested"])
    want = ref[0].state_dict()
    got = model.state_dict()
    assert set(got) == set(expected_shapes(model.config)) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_tied_flat_checkpoint_has_no_lm_head_and_ties(tmp_path):
    cfg = small_config(tie_word_embeddings=True)
    model = build_model(cfg, seed=11)
    assert torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    path = save_checkpoint(model.state_dict(), cfg, tmp_path / "tied", nested=False)
    on_disk = load_file(str(weights(path)))
    assert "lm_head.weight" not in on_disk
    assert "model.embed_tokens.weight" in on_disk
    loaded = load(path)
    assert torch.equal(loaded.lm_head.weight, loaded.embed_tokens.weight)
    assert loaded.lm_head.weight.data_ptr() == loaded.embed_tokens.weight.data_ptr()  # one matrix, not a copy
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight)
    torch.testing.assert_close(loaded.prompt_logits(PROMPT), model.prompt_logits(PROMPT), rtol=0, atol=0)


def test_tied_config_with_lm_head_on_disk_uses_it(tmp_path):
    """docs/spec.md §1: when lm_head.weight is present, use it even if the config says tied
    (transformers' nested model saves a separate, possibly different, head)."""
    cfg = small_config(tie_word_embeddings=True)
    model = build_model(cfg, seed=12)
    state = dict(model.state_dict())
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(5)) * 0.5
    state["lm_head.weight"] = head
    path = save_checkpoint(state, cfg, tmp_path / "tied_nested", nested=True)
    assert torch.equal(load_file(str(weights(path)))["lm_head.weight"], head)
    loaded = load(path)
    assert torch.equal(loaded.lm_head.weight, head)
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight)
    assert not torch.equal(loaded.lm_head.weight, loaded.embed_tokens.weight)
    # the logits are those of the same weights in an untied model
    untied = MuseSparkForCausalLM(small_config(tie_word_embeddings=False))
    untied.load_state_dict(state)
    untied.materialize_constants()
    untied.eval()
    torch.testing.assert_close(loaded.prompt_logits(PROMPT), untied.prompt_logits(PROMPT), rtol=0, atol=0)


FP32_TENSORS = ("post_attention_residual_gate.gate", "post_feedforward_residual_gate.gate")


@pytest.mark.parametrize(
    "dtype_name, dtype",
    [
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("float32", torch.float32),
        ("fp16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype_handling(saved, ref, dtype_name, dtype):
    original = ref[0]
    model = musespark.load_model(saved["nested"], dtype=dtype_name)
    assert model.dtype == dtype
    assert model.embed_tokens.weight.dtype == dtype
    assert model.lm_head.weight.dtype == dtype
    assert model.layers[0].self_attn.q_proj.weight.dtype == dtype
    assert model.layers[1].mlp.experts.gate_up_proj.dtype == dtype
    for i, layer in enumerate(model.layers):
        for attr in FP32_TENSORS:
            got = getattr(layer, attr.split(".")[0]).gate
            assert got.dtype == torch.float32, (i, attr)
            # exact fp32 values: never rounded through the model dtype on the way in
            assert torch.equal(got, getattr(original.layers[i], attr.split(".")[0]).gate), (i, attr)
    router = model.layers[1].mlp.gate
    assert router.weight.dtype == torch.float32
    assert router.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(router.weight, original.layers[1].mlp.gate.weight)
    assert torch.equal(router.e_score_correction_bias, original.layers[1].mlp.gate.e_score_correction_bias)
    torch.testing.assert_close(model.embed_tokens.weight, original.embed_tokens.weight.to(dtype), rtol=0, atol=0)
    logits = model.prompt_logits(PROMPT)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_dtype_auto_follows_the_checkpoint(ref, tmp_path):
    model, _ = ref
    path = save_checkpoint(model.state_dict(), model.config, tmp_path / "fp16", dtype=torch.float16)
    assert load_file(str(weights(path)))[NESTED + "embed_tokens.weight"].dtype == torch.float16
    assert load_file(str(weights(path)))[NESTED + "layers.0.post_attention_residual_gate.gate"].dtype == torch.float32
    loaded = musespark.load_model(path, dtype="auto")
    assert loaded.embed_tokens.weight.dtype == torch.float16
    assert loaded.layers[1].mlp.gate.weight.dtype == torch.float32
    # the default without "auto" stays bfloat16
    assert musespark.load_model(path).embed_tokens.weight.dtype == torch.bfloat16


def test_sharded_checkpoint_loads_identically(ref, tmp_path):
    model, logits = ref
    path = save_checkpoint(model.state_dict(), model.config, tmp_path / "sharded", max_shard_bytes=8192)
    assert not weights(path).exists()
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 2
    torch.testing.assert_close(load(path).prompt_logits(PROMPT), logits, rtol=0, atol=0)


def test_progress_reports_every_tensor_in_bytes(saved):
    calls = []
    musespark.load_model(saved["nested"], dtype="float32", progress=lambda done, total: calls.append((done, total)))
    tensors = len(expected_shapes(small_config()))
    total = sum(f.stat().st_size for f in Path(saved["nested"]).glob("*.safetensors"))
    assert len(calls) == tensors + 1 and all(t == total for _, t in calls)  # one call per tensor, then the end
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[0] > 0 and done[-1] == total
