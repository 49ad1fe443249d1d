"""ModelConfig: released-schema defaults, both config shapes, validation, round-trips (docs/spec.md §1)."""

import json
import re

import pytest

from musespark.config import ModelConfig

# A small but complete text config, written the way config.json spells it.
SMALL_TEXT = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "post_norm_eps": 1e-7,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "sliding_window": 8,
    "mlp_layer_types": ["dense", "sparse", "sparse", "dense", "sparse", "sparse"],
    "qk_scale_factor": 2.5,
    "output_multiplier": 0.5,
    "final_logit_softcapping": 30.0,
    "residual_gate_temperature": 0.7,
    "moe_hidden_size": 32,
    "moe_intermediate_size": 48,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "hidden_act": "silu",
}


def flat(**overrides):
    return {"model_type": "muse_spark_text", **SMALL_TEXT, **overrides}


def nested(**overrides):
    return {
        "model_type": "muse_spark",
        "text_config": {"model_type": "muse_spark_text", **SMALL_TEXT, **overrides},
        "vision_config": {"hidden_size": 32, "num_hidden_layers": 1},
        "audio_config": {"hidden_sizes": [8, 8]},
    }


# ----------------------------------------------------------------------------- defaults


def test_defaults_match_released_schema():
    cfg = ModelConfig.from_dict({"model_type": "muse_spark_text"})
    assert cfg.vocab_size == 202048
    assert cfg.hidden_size == 8192
    assert cfg.intermediate_size == 16384
    assert cfg.num_hidden_layers == 62
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (128, 16, 64)
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.post_norm_eps == 1e-8
    assert cfg.rope_theta == 500000
    assert cfg.sliding_window == 2048
    assert cfg.qk_scale_factor == 5.4730064863875
    assert cfg.output_multiplier == 0.1767766952966369
    assert cfg.final_logit_softcapping == 20.0
    assert cfg.residual_gate_temperature == 0.3
    assert cfg.moe_hidden_size == 4096
    assert cfg.moe_intermediate_size == 4096
    assert (cfg.num_local_experts, cfg.num_experts_per_tok) == (256, 8)
    assert cfg.routed_scaling_factor == 1.0
    assert cfg.tie_word_embeddings is False
    assert cfg.bos_token_id == 200000
    assert cfg.eos_token_id == (200001,)
    assert cfg.hidden_act == "silu"


def test_defaults_same_from_nested_empty_text_config():
    assert ModelConfig.from_dict({"model_type": "muse_spark", "text_config": {}}) == ModelConfig.from_dict(
        {"model_type": "muse_spark_text"}
    )


@pytest.mark.parametrize("n", [1, 2, 4, 5, 7, 62])
def test_default_per_layer_lists(n):
    cfg = ModelConfig.from_dict(flat(num_hidden_layers=n, mlp_layer_types=None))
    theta = SMALL_TEXT["rope_parameters"]["rope_theta"]
    want_types = tuple("full_attention" if (n - 1 - i) % 4 == 0 else "sliding_attention" for i in range(n))
    want_theta = tuple(0.0 if (n - 1 - i) % 4 == 0 else theta for i in range(n))
    assert cfg.layer_types == want_types
    assert cfg.layer_rope_theta == want_theta
    assert cfg.mlp_layer_types == ("sparse",) * n
    # the last layer is always a full-attention NoPE layer
    assert cfg.layer_types[-1] == "full_attention" and cfg.layer_rope_theta[-1] == 0.0
    assert [cfg.is_sliding(i) for i in range(n)] == [t == "sliding_attention" for t in want_types]
    assert all(cfg.is_sparse(i) for i in range(n))


def test_default_62_layer_nope_positions():
    cfg = ModelConfig.from_dict({"model_type": "muse_spark_text"})
    nope = [i for i, t in enumerate(cfg.layer_rope_theta) if t == 0]
    assert nope == list(range(1, 62, 4))  # 61, 57, ..., 1
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == nope
    assert set(cfg.layer_rope_theta) == {0.0, 500000.0}


def test_explicit_per_layer_lists_are_kept():
    types = [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "full_attention",
    ]
    thetas = [1000.0, 0, 0, 2000.0, 10000.0, 0]
    cfg = ModelConfig.from_dict(flat(layer_types=types, layer_rope_theta=thetas))
    assert cfg.layer_types == tuple(types)
    assert cfg.layer_rope_theta == tuple(thetas)
    assert cfg.mlp_layer_types == tuple(SMALL_TEXT["mlp_layer_types"])


def test_rope_theta_from_older_schema():
    data = flat(rope_theta=1234.0)
    del data["rope_parameters"]
    cfg = ModelConfig.from_dict(data)
    assert cfg.rope_theta == 1234.0
    assert set(cfg.layer_rope_theta) == {0.0, 1234.0}


@pytest.mark.parametrize("eos, want", [(7, (7,)), ([7], (7,)), ([7, 9, 11], (7, 9, 11))])
def test_eos_int_or_list(eos, want):
    cfg = ModelConfig.from_dict(flat(eos_token_id=eos))
    assert cfg.eos_token_id == want
    assert isinstance(cfg.eos_token_id, tuple)


def test_unknown_fields_ignored():
    assert ModelConfig.from_dict(flat(some_future_field=[1, 2], architectures=["X"])) == ModelConfig.from_dict(flat())


# ----------------------------------------------------------------------------- shapes


def test_nested_and_flat_parse_the_same():
    a, b = ModelConfig.from_dict(nested()), ModelConfig.from_dict(flat())
    assert a == b
    assert a.num_hidden_layers == 6 and a.hidden_size == 64 and a.rope_theta == 10000.0
    assert a.eos_token_id == (2, 3) and a.tie_word_embeddings is True
    assert a.routed_scaling_factor == 2.0 and a.qk_scale_factor == 2.5


def test_nested_ignores_top_level_text_fields():
    """Only text_config matters in a nested config."""
    data = nested()
    data["hidden_size"] = 999
    data["vocab_size"] = 5
    assert ModelConfig.from_dict(data).hidden_size == 64
    assert ModelConfig.from_dict(data).vocab_size == 128


def test_nested_without_text_config_is_an_error():
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_dict({"model_type": "muse_spark", "vision_config": {}})


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("shape", [flat, nested])
@pytest.mark.parametrize(
    "field, value, pattern",
    [
        ("layer_types", ["full_attention"] * 5, r"'layer_types'.*num_hidden_layers=6.*got 5"),
        ("mlp_layer_types", ["dense"] * 7, r"'mlp_layer_types'.*num_hidden_layers=6.*got 7"),
        ("layer_rope_theta", [0.0, 1.0], r"'layer_rope_theta'.*num_hidden_layers=6.*got 2"),
        (
            "layer_types",
            ["full_attention", "local_attention"] + ["full_attention"] * 4,
            r"'layer_types'\[1\].*'local_attention'",
        ),
        ("mlp_layer_types", ["dense"] * 5 + ["moe"], r"'mlp_layer_types'\[5\].*'moe'"),
        ("layer_rope_theta", [0.0, -1.0, 0, 0, 0, 0], r"'layer_rope_theta'\[1\].*-1\.0"),
        ("num_key_value_heads", 3, r"'num_attention_heads'.*'num_key_value_heads'.*got 4 and 3"),
        ("hidden_act", "gelu", r"'hidden_act'.*'gelu'"),
        (
            "rope_parameters",
            {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},
            r"'rope_parameters\.rope_type'.*'yarn'",
        ),
        ("hidden_size", 0, r"'hidden_size'.*got 0"),
        ("vocab_size", -5, r"'vocab_size'.*got -5"),
        ("num_local_experts", 0, r"'num_local_experts'.*got 0"),
        ("num_hidden_layers", 0, r"'num_hidden_layers'.*got 0"),
        ("head_dim", 2.5, r"'head_dim'.*got 2\.5"),
        ("num_experts_per_tok", 9, r"'num_experts_per_tok'.*9 > 8"),
        ("rms_norm_eps", 0.0, r"'rms_norm_eps'.*got 0\.0"),
        ("head_dim", 15, r"'head_dim'.*even.*15"),
        ("layer_types", "full_attention", r"'layer_types'.*must be a list.*'full_attention'"),
    ],
)
def test_validation_errors_name_field_and_value(shape, field, value, pattern):
    data = shape(**{field: value})
    with pytest.raises(ValueError, match=pattern):
        ModelConfig.from_dict(data)


@pytest.mark.parametrize(
    "field, value, pattern",
    [
        ("hidden_size", 0, r"'hidden_size'.*got 0"),
        ("vocab_size", -5, r"'vocab_size'.*got -5"),
        ("num_local_experts", 0, r"'num_local_experts'.*got 0"),
        ("hidden_act", "gelu", r"'hidden_act'.*'gelu'"),
        ("layer_types", ("sliding_attention",) * 61, r"'layer_types'.*num_hidden_layers=62.*got 61"),
    ],
)
def test_constructor_validates_too(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        ModelConfig(**{field: value})


@pytest.mark.parametrize("model_type", ["llama", "muse_spark_vision", ""])
def test_unknown_model_type(model_type):
    with pytest.raises(ValueError, match=r"'model_type'.*" + re.escape(repr(model_type))):
        ModelConfig.from_dict({**flat(), "model_type": model_type})


def test_config_must_be_an_object():
    with pytest.raises(ValueError, match="JSON object.*list"):
        ModelConfig.from_dict([1, 2, 3])


def test_from_file_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "muse_spark_text", "hidden_size": 64,')
    with pytest.raises(ValueError, match=re.escape(str(path)) + r".*invalid JSON"):
        ModelConfig.from_file(path)


def test_from_file_invalid_config_names_file_and_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(nested(num_key_value_heads=3)))
    with pytest.raises(ValueError, match=re.escape(str(path)) + r".*'num_attention_heads'.*got 4 and 3"):
        ModelConfig.from_file(path)


def test_from_file_reads_a_valid_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(nested()))
    assert ModelConfig.from_file(path) == ModelConfig.from_dict(flat())


# ----------------------------------------------------------------------------- round-trips

ROUND_TRIP_CONFIGS = {
    "defaults": {},
    "small": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        rope_theta=10000.0,
        layer_rope_theta=(0.0, 5000.0, 10000.0),
        layer_types=("full_attention", "sliding_attention", "full_attention"),
        mlp_layer_types=("dense", "sparse", "dense"),
        sliding_window=5,
        moe_hidden_size=8,
        moe_intermediate_size=12,
        num_local_experts=4,
        num_experts_per_tok=4,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=(2, 7),
        qk_scale_factor=3.0,
        output_multiplier=0.25,
        final_logit_softcapping=15.0,
        residual_gate_temperature=0.5,
        routed_scaling_factor=2.5,
        rms_norm_eps=1e-6,
        post_norm_eps=1e-9,
        max_position_embeddings=4096,
    ),
    "single_eos": dict(
        num_hidden_layers=2, eos_token_id=(9,), hidden_size=16, head_dim=8, num_attention_heads=2, num_key_value_heads=2
    ),
}


@pytest.mark.parametrize("nested_form", [True, False])
@pytest.mark.parametrize("name", sorted(ROUND_TRIP_CONFIGS))
def test_to_dict_round_trip(name, nested_form):
    cfg = ModelConfig(**ROUND_TRIP_CONFIGS[name])
    data = cfg.to_dict(nested=nested_form)
    assert data["model_type"] == ("muse_spark" if nested_form else "muse_spark_text")
    assert ("text_config" in data) == nested_form
    # through JSON too, as a real config.json would be
    back = ModelConfig.from_dict(json.loads(json.dumps(data)))
    assert back == cfg
    # and the two shapes agree with each other
    assert ModelConfig.from_dict(cfg.to_dict(nested=not nested_form)) == back


def test_round_trip_keeps_nested_extras():
    data = nested()
    data["vision_config"] = {"hidden_size": 77, "marker": "keep-me"}
    cfg = ModelConfig.from_dict(data)
    out = cfg.to_dict(nested=True)
    assert out["vision_config"] == {"hidden_size": 77, "marker": "keep-me"}
    assert ModelConfig.from_dict(out) == cfg


def test_bos_token_id_none_round_trips():
    """`bos_token_id: int | None`: a config without a BOS token must stay without one.

    to_dict writes `"bos_token_id": null`; from_dict must not turn that into 200000.
    """
    cfg = ModelConfig(num_hidden_layers=2, bos_token_id=None)
    for nested_form in (True, False):
        back = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict(nested=nested_form))))
        assert back.bos_token_id is None, f"nested={nested_form}: bos_token_id came back as {back.bos_token_id!r}"
        assert back == cfg
