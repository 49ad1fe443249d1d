"""NVFP4 checkpoints (docs/nvfp4.md): decoding bit-exact against an independent
float64 reference written here from the spec, the quantizer's round trip through a saved
checkpoint, both quantization-config forms with their exclude lists, the loading errors of
malformed checkpoints, and the bundled model quantized end to end (bits per byte and greedy
text against bf16)."""

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import musespark
from musespark.cli import main as cli_main
from musespark.engine.args import bundled_model_path
from musespark.quant import DENSE
from musespark.quant.config import Nvfp4Config, Nvfp4WeightFormats, parse_quantization_config
from musespark.quant.nvfp4 import Nvfp4Experts, Nvfp4Linear
from musespark.quant.nvfp4_math import (
    dequantize,
    pack_codes,
    quantize,
    quantize_activation,
    round_to_e2m1,
    unpack_codes,
)
from musespark.quant.quantize import quantize_experts, quantize_linear

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

P = "model.language_model."

# ----------------------------------------------------------------- the spec, in float64

E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_e2m1(code: int) -> float:
    """Bit 3 sign, bits 2-1 exponent, bit 0 mantissa (docs/nvfp4.md §2 table)."""
    e, m = (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    assert mag == E2M1_MAGNITUDES[code & 7]
    return -mag if code & 8 else mag


def ref_e4m3(byte: int) -> float:
    """`s eeee mmm`, bias 7; e == 0: m * 2^-9; 0x7F/0xFF NaN; no infinity."""
    s, e, m = byte >> 7, (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return math.nan
    v = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def ref_dequantize(packed: np.ndarray, scale_bytes: np.ndarray, ws2: np.ndarray) -> np.ndarray:
    """[N, K/2] uint8, [N, K/16] e4m3 bytes, fp32 global broadcasting to [N, K/16] -> fp32 [N, K]:
    t = fp32(S * ws2), w = fp32(E2M1 * t) (each product exact in float64, then rounded once)."""
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)  # low nibble first
    e2m1 = np.array([ref_e2m1(c) for c in range(16)])[codes]
    s = np.array([ref_e4m3(b) for b in range(256)])[scale_bytes]
    t = (s * ws2.astype(np.float64)).astype(np.float32).astype(np.float64)
    return (e2m1 * np.repeat(t, 16, axis=1)).astype(np.float32)


def ref_round_e2m1(v: float) -> int:
    """Nearest E2M1 magnitude, ties to the even code, saturating at 6; sign bit for v < 0."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1_MAGNITUDES[c] - a), c & 1))
    return best | (8 if v < 0 else 0)


def random_case(gen: torch.Generator, n: int, k: int):
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale_bytes = torch.randint(0, 256, (n, k // 16), generator=gen, dtype=torch.uint8)
    scale_bytes[(scale_bytes & 0x7F) == 0x7F] = 0x38  # no NaN scales (1.0 instead)
    scale_bytes[0, :] = torch.arange(k // 16, dtype=torch.uint8) % 8  # subnormals (and zero) in row 0
    packed[1, :8] = 0  # a zero block
    packed[2, :] = 0x77  # +6 everywhere
    packed[3, :] = 0xFF  # -6 everywhere
    return packed, scale_bytes


@pytest.mark.parametrize("ws2", [1.0 / 2688, 0.37, 2.0**-120, 3.0e4])
def test_dequantization_is_bit_exact_against_the_spec(ws2):
    gen = torch.Generator().manual_seed(0)
    packed, scale_bytes = random_case(gen, 16, 256)
    g = torch.tensor(ws2, dtype=torch.float32)
    ours = dequantize(packed, scale_bytes.view(torch.float8_e4m3fn), g)
    ref = ref_dequantize(packed.numpy(), scale_bytes.numpy(), np.float32(ws2))
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy().view(np.uint32), ref.view(np.uint32))  # bit for bit, signs of zero too


def test_per_row_global_scales_and_scale_layout_by_hand():
    # Row n, block b gets scale byte 0x38 + 8*b (1, 2, 4, 8); row 1 has global 2, row 0 global 1.
    codes = torch.zeros(2, 64, dtype=torch.uint8)
    codes[:, ::16] = 2  # the first element of each block is 1.0
    codes[1, 1] = 15  # row 1, element 1: -6
    scale = torch.tensor([[0x38, 0x40, 0x48, 0x50]] * 2, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = dequantize(pack_codes(codes), scale, torch.tensor([[1.0], [2.0]]))
    assert w[0, ::16].tolist() == [1.0, 2.0, 4.0, 8.0]
    assert w[1, ::16].tolist() == [2.0, 4.0, 8.0, 16.0]
    assert w[1, 1].item() == -12.0 and w.count_nonzero() == 9


def test_nibble_order_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    assert pack_codes(codes).tolist() == [[0x21, 0xF3]]
    assert unpack_codes(torch.tensor([[0x21, 0xF3]], dtype=torch.uint8)).tolist() == codes.tolist()


def test_e2m1_rounding_ties_to_even_and_saturates():
    ties = {0.25: 0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0, 5.01: 6.0, 6.0: 6.0, 1e9: 6.0}
    v = torch.tensor(list(ties), dtype=torch.float32)
    got = [ref_e2m1(int(c)) for c in round_to_e2m1(v)]
    assert got == list(ties.values())
    assert round_to_e2m1(torch.tensor([-0.1, -7.0])).tolist() == [8, 15]  # -0 keeps the sign bit; -6
    x = torch.randn(4000, generator=torch.Generator().manual_seed(1)) * 3
    x = torch.cat([x, torch.arange(-6.5, 6.5, 0.25)])  # every midpoint exactly
    assert round_to_e2m1(x).tolist() == [ref_round_e2m1(float(a)) for a in x]


def test_weight_quantization_follows_the_recipe():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(8, 64, generator=gen)
    w[0, :16] = 0  # a zero block gets scale 1.0 and zero codes
    w[1, :16] = 1e-12  # a tiny block: the scale clamps to 2^-9
    ws2 = w.abs().amax() / 2688
    packed, scale = quantize(w, ws2)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (8, 4)
    assert scale[0, 0].float() == 1.0 and scale[1, 0].float() == 2.0**-9
    # the largest element is stored as +-6 * 448 * ws2 = amax (up to fp32 rounding)
    deq = dequantize(packed, scale, ws2)
    i = w.abs().argmax()
    assert scale.flatten()[i // 16].float() == 448 and deq.flatten()[i].item() == pytest.approx(
        w.flatten()[i].item(), rel=1e-6
    )
    s = scale.float().repeat_interleave(16, dim=1) * ws2  # each element within half an E2M1 step (1/6 of 6*s)
    assert ((deq - w).abs() <= s * 1.0 + 1e-12).all()


def test_activation_quantization_by_hand():
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.1, -6.0, 0, 0, 0, 0, 0, 0]])
    values, sf = quantize_activation(x, torch.tensor(1.0))  # gs = 1: sf = e4m3(6 / 6) = 1
    assert sf.float().tolist() == [[1.0]]
    assert values.tolist()[0][:10] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -6.0]
    values, sf = quantize_activation(torch.zeros(1, 32), torch.tensor(0.5))
    assert sf.float().tolist() == [[0.0, 0.0]] and not values.any()


# ----------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def bundled():
    return musespark.load_model(bundled_model_path(), backend="torch")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The bundled model quantized by the CLI: {"experts": dir, "linear": dir}."""
    out = {}
    for scope in ("experts", "linear"):
        dst = tmp_path_factory.mktemp("nvfp4") / scope
        assert (
            cli_main(
                [
                    "quantize",
                    "--format",
                    "nvfp4",
                    str(bundled_model_path()),
                    str(dst),
                    "--scope",
                    scope,
                    "--calibration-prompts",
                    "4",
                ]
            )
            == 0
        )
        out[scope] = dst
    return out


def test_the_checkpoint_has_the_spec_layout(quantized):
    path = quantized["experts"]
    t = load_file(str(path / "model.safetensors"))
    e = P + "layers.2.mlp.experts."
    assert t[e + "gate_up_proj"].dtype == torch.uint8 and t[e + "gate_up_proj"].shape == (8, 512, 64)
    assert t[e + "gate_up_proj_weight_scale"].dtype == torch.float8_e4m3fn
    assert t[e + "gate_up_proj_weight_scale"].shape == (8, 512, 8)
    assert t[e + "gate_up_proj_weight_scale_2"].shape == (8, 2) and t[e + "down_proj_weight_scale_2"].shape == (8,)
    assert t[e + "gate_up_proj_input_scale"].shape == (8, 2) and t[e + "down_proj_input_scale"].shape == (8,)
    assert t[e + "down_proj"].shape == (8, 128, 128) and t[e + "down_proj_weight_scale"].shape == (8, 128, 16)
    assert t[P + "layers.5.mlp.experts.gate_up_proj"].dtype == torch.bfloat16  # the last layer's experts
    assert t[P + "layers.2.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert t[P + "layers.2.mlp.gate.weight"].dtype == torch.float32
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "modelopt" and cfg["quant_algo"] == "NVFP4"
    assert P + "layers.5.mlp.experts*" in cfg["ignore"] and "lm_head" in cfg["ignore"]
    hf = json.loads((path / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "modelopt" and hf["quantization"]["exclude_modules"] == cfg["ignore"]
    assert (path / "tokenizer.json").is_file() and (path / "generation_config.json").is_file()
    lin = load_file(str(quantized["linear"] / "model.safetensors"))
    a = P + "layers.1.self_attn."
    shared = {lin[a + f"{p}.weight_scale_2"].item() for p in ("q_proj", "k_proj", "v_proj", "gate_proj")}
    assert len(shared) == 1 and lin[a + "q_proj.weight_scale_2"].shape == ()  # one global scale per fused qkv
    assert lin[P + "layers.0.mlp.gate_proj.weight_scale_2"] == lin[P + "layers.0.mlp.up_proj.weight_scale_2"]
    assert lin["lm_head.weight"].dtype == torch.bfloat16


def test_round_trip_gives_the_quantizers_values(quantized):
    src = load_file(str(bundled_model_path() / "model.safetensors"))
    model = musespark.load_model(quantized["linear"], backend="torch")
    e = "layers.3.mlp.experts"
    ex = dict(model.named_modules())[e]
    assert isinstance(ex.format, Nvfp4Experts) and ex.gate_up_proj.dtype == torch.uint8  # kept packed
    ours = quantize_experts(src[P + e + ".gate_up_proj"], src[P + e + ".down_proj"], None, None)
    for name, t in ours.items():
        assert torch.equal(
            getattr(ex, name).view(torch.uint8) if t.dtype == torch.float8_e4m3fn else getattr(ex, name),
            t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
        ), name
    gate_up, down = ex.format.dequantized(ex, 5)
    g = ours["gate_up_proj_weight_scale_2"][5].repeat_interleave(256)[:, None]
    assert torch.equal(gate_up, dequantize(ours["gate_up_proj"][5], ours["gate_up_proj_weight_scale"][5], g))
    q = model.layers[1].self_attn.o_proj
    assert isinstance(q.format, Nvfp4Linear)
    w = src[P + "layers.1.self_attn.o_proj.weight"]
    ref = quantize_linear(w, w.float().abs().amax(), None)
    assert torch.equal(q.weight, ref["weight"]) and torch.equal(q.weight_scale_2, ref["weight_scale_2"])
    assert torch.equal(q.format.dequantized(q), dequantize(ref["weight"], ref["weight_scale"], ref["weight_scale_2"]))
    assert model.lm_head.format is DENSE.linear and model.layers[0].mlp.down_proj.format is not DENSE.linear


# ----------------------------------------------------------------- configs and exclude lists

FORM_A = {
    "producer": {"name": "modelopt", "version": "0.47.0"},
    "quantization": {
        "quant_algo": "nvfp4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head", P + "layers.0.mlp.experts*", P + "layers.*.self_attn*"],
    },
}


def test_exclude_semantics():
    cfg = parse_quantization_config(FORM_A)
    assert cfg.quant_algo == "NVFP4" and cfg.input_scales
    assert cfg.is_excluded("lm_head") and cfg.is_excluded("layers.0.mlp.experts")
    assert not cfg.is_excluded("layers.1.mlp.experts") and not cfg.is_excluded("layers.0.mlp.pre_expert_proj")
    assert cfg.is_excluded("layers.7.self_attn.q_proj")  # fnmatch
    assert Nvfp4Config("NVFP4", ("layers.3.mlp.down",)).is_excluded("layers.3.mlp.down_proj")  # substring (vLLM's)
    assert Nvfp4Config("NVFP4", ("model.layers.2.mlp.experts",)).is_excluded("layers.2.mlp.experts")  # flat names
    formats = Nvfp4WeightFormats(cfg, "w4a4")
    assert formats.experts("layers.0.mlp.experts") is DENSE.experts
    assert isinstance(formats.experts("layers.2.mlp.experts"), Nvfp4Experts)
    assert isinstance(formats.linear("layers.0.mlp.gate_proj"), Nvfp4Linear)


def test_form_b_and_the_w4a16_downgrade():
    form_b = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {"group_size": 16}, "input_activations": {"group_size": 16}}
        },
    }
    assert parse_quantization_config(form_b).quant_algo == "NVFP4"
    form_b["config_groups"]["group_0"]["input_activations"] = None
    cfg = parse_quantization_config(form_b)
    assert cfg.quant_algo == "W4A16_NVFP4" and not cfg.input_scales
    with pytest.raises(ValueError, match="w4a4.*W4A16_NVFP4"):
        Nvfp4WeightFormats(cfg, "w4a4")


@pytest.mark.parametrize(
    "raw,match",
    [
        ({**FORM_A, "producer": None}, "'producer'"),
        ({"quantization": FORM_A["quantization"]}, "'producer'"),
        ({**FORM_A, "quantization": {**FORM_A["quantization"], "quant_algo": "FP8"}}, "'quantization.quant_algo'.*FP8"),
        ({**FORM_A, "quantization": {**FORM_A["quantization"], "group_size": 32}}, "'quantization.group_size'.*32"),
        (
            {**FORM_A, "quantization": {k: v for k, v in FORM_A["quantization"].items() if k != "exclude_modules"}},
            "'quantization.exclude_modules' is missing",
        ),
        ({**FORM_A, "quantization": {**FORM_A["quantization"], "kv_cache_quant_algo": "FP8"}}, "kv_cache_quant_algo"),
        ({"quant_method": "fp8"}, "'quant_method'"),
        ({"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}, "'quant_algo'.*INT4_AWQ"),
    ],
)
def test_config_errors_name_the_key(raw, match):
    with pytest.raises(ValueError, match=match):
        parse_quantization_config(raw)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_both_config_forms_and_places_load_alike(quantized, tmp_path):
    ids = list(range(5, 60))
    expected = musespark.load_model(quantized["experts"], backend="torch").prompt_logits(ids)
    form_a = copy_checkpoint(quantized["experts"], tmp_path / "a")  # only hf_quant_config.json
    cfg = json.loads((form_a / "config.json").read_text())
    del cfg["quantization_config"]
    (form_a / "config.json").write_text(json.dumps(cfg))
    nested = copy_checkpoint(quantized["experts"], tmp_path / "b")  # text_config.quantization_config, no hf file
    cfg_b = json.loads((nested / "config.json").read_text())
    cfg_b["text_config"]["quantization_config"] = cfg_b.pop("quantization_config")
    (nested / "config.json").write_text(json.dumps(cfg_b))
    (nested / "hf_quant_config.json").unlink()
    for path in (form_a, nested):
        model = musespark.load_model(path, backend="torch")
        assert isinstance(model.layers[1].mlp.experts.format, Nvfp4Experts)
        assert model.layers[5].mlp.experts.format is DENSE.experts  # excluded
        assert torch.equal(model.prompt_logits(ids), expected)


# ----------------------------------------------------------------- malformed checkpoints


def mutate(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    copy_checkpoint(src, dst)
    if edit_tensors is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


E2 = P + "layers.2.mlp.experts."


def _per_expert(t):
    gu, down = t.pop(E2 + "gate_up_proj"), t.pop(E2 + "down_proj")
    for k in [k for k in t if k.startswith(E2) and "post_expert_norm" not in k]:
        del t[k]
    for e in range(gu.shape[0]):
        t[E2 + f"{e}.gate_proj.weight"] = gu[e, :256].contiguous()
        t[E2 + f"{e}.up_proj.weight"] = gu[e, 256:].contiguous()
        t[E2 + f"{e}.down_proj.weight"] = down[e].contiguous()


def _nan(name, index, byte=None):
    def edit(t):
        if byte is None:
            t[name][index] = float("nan")
        else:
            t[name].view(torch.uint8)[index] = byte

    return edit


def _unexclude_last_experts(cfg):
    cfg["quantization_config"]["ignore"].remove(P + "layers.5.mlp.experts*")


MALFORMED = {
    "wrong shape": (
        dict(edit_tensors=lambda t: t.update({E2 + "gate_up_proj_weight_scale_2": torch.ones(8)})),
        rf"{E2}gate_up_proj_weight_scale_2.*shape \[8\], expected \[8, 2\]",
    ),
    "per-expert names": (dict(edit_tensors=_per_expert), rf"{E2}0\.(gate|up|down)_proj\.weight.*per-expert.*fused"),
    "missing scale": (
        dict(edit_tensors=lambda t: t.pop(E2 + "down_proj_weight_scale")),
        r"missing tensor.*layers\.2\.mlp\.experts\.down_proj_weight_scale",
    ),
    "bf16 under a module not excluded": (
        dict(edit_config=_unexclude_last_experts),
        rf"{P}layers\.5\.mlp\.experts\.(gate_up|down)_proj.*bfloat16.*not in the.*exclude",
    ),
    "NaN global scale": (
        dict(edit_tensors=_nan(E2 + "gate_up_proj_weight_scale_2", (3, 1))),
        r"layers\.2\.mlp\.experts\.gate_up_proj_weight_scale_2.*NaN",
    ),
    "NaN block scale": (
        dict(edit_tensors=_nan(E2 + "down_proj_weight_scale", (0, 0, 0), 0x7F)),
        r"layers\.2\.mlp\.experts\.down_proj_weight_scale'.*NaN",
    ),
    "codes as floats": (
        dict(edit_tensors=lambda t: t.update({E2 + "down_proj": t[E2 + "down_proj"].float()})),
        rf"{E2}down_proj.*float32",
    ),
    "K % 16": (
        dict(edit_config=lambda c: c["text_config"].update(moe_intermediate_size=136)),
        r"layers\.1\.mlp\.experts.*moe_intermediate_size.*multiple of 16, got 136",
    ),
    "unknown quant_algo": (
        dict(edit_config=lambda c: c["quantization_config"].update(quant_algo="MXFP4")),
        r"'quant_algo'.*MXFP4",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoints_name_the_tensor(quantized, tmp_path, case):
    edits, match = MALFORMED[case]
    path = mutate(quantized["experts"], tmp_path / "bad", **edits)
    with pytest.raises(ValueError, match=match):
        musespark.load_model(path, backend="torch")


# ----------------------------------------------------------------- the bundled model, end to end

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]


@pytest.fixture(scope="module")
def validation():
    """8 windows of 256 tokens from the held-out stdlib files, and the token byte lengths."""
    import tiny_corpus as tc
    from tokenizers import Tokenizer
    from train_tiny import eval_windows

    tok = Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    root = tc.stdlib_root()
    files = [r for r in tc.list_files(root) if tc.is_validation(r)][:6]
    stream = torch.tensor(tc.encode_docs(tok, [(root / r).read_text(encoding="utf-8") for r in files]))
    return tok, eval_windows(stream, 256, 8), torch.tensor(tc.token_byte_lengths(tok))


def evaluate(model, validation):
    from train_tiny import bits_per_byte

    tok, windows, byte_len = validation
    bpb, _ = bits_per_byte(model, windows, byte_len)
    greedy = [model.greedy_continuation(tok.encode(p).ids, 24) for p in PROMPTS]
    return bpb, greedy


@pytest.mark.parametrize("scope,tolerance", [("experts", 0.03), ("linear", 0.08)])
@pytest.mark.parametrize("mode", ["weight-only", "w4a4"])
def test_quantized_bundled_model_stays_close_to_bf16(bundled, quantized, validation, scope, tolerance, mode):
    base_bpb, base_greedy = evaluate(bundled, validation)
    model = musespark.load_model(quantized[scope], backend="auto", nvfp4_mode=mode)
    bpb, greedy = evaluate(model, validation)
    agree = sum(a == b for g, h in zip(greedy, base_greedy) for a, b in zip(g, h)) / sum(map(len, base_greedy))
    print(
        f"\nnvfp4 scope={scope} mode={mode}: bits/byte {bpb:.4f} vs bf16 {base_bpb:.4f} "
        f"({100 * (bpb / base_bpb - 1):+.2f}%), greedy token agreement {agree:.0%}"
    )
    assert abs(bpb / base_bpb - 1) < tolerance
    assert all(len(g) == 24 for g in greedy)


def test_separate_gate_and_up_global_scales_decode_per_half():
    gen = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn(2, 64, 32, generator=gen), torch.randn(2, 32, 32, generator=gen)
    gate_up[:, 32:] *= 10  # up rows much larger than gate rows
    tensors = quantize_experts(gate_up, down, torch.tensor(1.0), torch.tensor(2.0), share_gate_up=False)
    ws2 = tensors["gate_up_proj_weight_scale_2"]
    assert ws2.shape == (2, 2) and (ws2[:, 1] > 5 * ws2[:, 0]).all()
    module = torch.nn.Module()
    for name, t in tensors.items():
        setattr(module, name, t)
    gu, _ = Nvfp4Experts("e", "weight-only").dequantized(module, 1)
    assert torch.equal(
        gu[:32], dequantize(tensors["gate_up_proj"][1, :32], tensors["gate_up_proj_weight_scale"][1, :32], ws2[1, 0])
    )
    assert torch.equal(
        gu[32:], dequantize(tensors["gate_up_proj"][1, 32:], tensors["gate_up_proj_weight_scale"][1, 32:], ws2[1, 1])
    )
    shared = quantize_experts(gate_up, down, None, None)["gate_up_proj_weight_scale_2"]
    assert torch.equal(shared[:, 0], shared[:, 1]) and "gate_up_proj_input_scale" in tensors


def test_matches_modelopt_bit_for_bit():
    """The external oracle: nvidia-modelopt (a test dependency; its pure-Python wheel runs on
    the CPU) quantizes the same tensors to the same bytes."""
    import importlib

    nvfp4_tensor = importlib.import_module("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    src = load_file(str(bundled_model_path() / "model.safetensors"))
    for w in (
        torch.randn(32, 128, generator=torch.Generator().manual_seed(4)).bfloat16(),
        src[P + "layers.2.mlp.experts.gate_up_proj"][3],
        src[P + "layers.2.self_attn.q_proj.weight"],
    ):
        qt, scale, ws2 = nvfp4_tensor.NVFP4QTensor.quantize(w.clone(), 16)
        ours = quantize_linear(w, w.float().abs().amax(), None)
        assert torch.equal(ws2.float().reshape(()), ours["weight_scale_2"])
        assert torch.equal(qt._quantized_data, ours["weight"])
        assert torch.equal(scale.view(torch.uint8), ours["weight_scale"].view(torch.uint8))


def test_quantize_cli_calibration_file_and_refusals(quantized, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int\n")
    dst = tmp_path / "from_file"
    assert (
        cli_main(
            ["quantize", "--format", "nvfp4", str(bundled_model_path()), str(dst), "--calibration-file", str(prompts)]
        )
        == 0
    )
    assert "on 2 prompts" in capsys.readouterr().out
    model = musespark.load_model(dst, backend="torch", nvfp4_mode="w4a4")
    assert model.layers[1].mlp.experts.gate_up_proj_input_scale.min() > 0
    assert cli_main(["quantize", "--format", "nvfp4", str(quantized["experts"]), str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert cli_main(["quantize", "--format", "nvfp4", str(bundled_model_path()), str(dst)]) == 2
    assert "not empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="nvfp4_mode"):
        musespark.load_model(bundled_model_path(), nvfp4_mode="w8a8")


def test_engine_serves_an_nvfp4_checkpoint_in_both_modes(tmp_path):
    """LLM(model=NVFP4 checkpoint, nvfp4_mode=...) picks the format from the checkpoint's config."""
    from musespark import LLM, SamplingParams
    from musespark.apps.quantize import quantize_checkpoint
    from musespark.engine.args import bundled_model_path

    dst = tmp_path / "q"
    quantize_checkpoint(bundled_model_path(), dst, scope="experts", calibration_prompts=2)
    texts = []
    for mode in ("weight-only", "w4a4"):
        llm = LLM(model=dst, nvfp4_mode=mode, max_model_len=128)
        experts = llm.engine.model.layers[1].mlp.experts
        assert type(experts.format).__name__ == "Nvfp4Experts"
        texts.append(llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text)
    assert all(texts)
