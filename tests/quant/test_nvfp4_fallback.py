"""The torch backend's NVFP4 products (quant/nvfp4.py, quant/nvfp4_decode.py): decoded in row
blocks straight to the compute dtype, each routed expert once per step, never the experts no
token chose, with the same bits as the formula the torch backend used before (decode the whole
weight to fp32, round it to the activation dtype, multiply), which is kept here as the oracle."""

import pytest
import torch
import torch.nn.functional as F

from musespark.config import ModelConfig
from musespark.layers.linear import Linear
from musespark.layers.moe import Experts
from musespark.layers.norm import input_scaled_rms_norm
from musespark.quant import nvfp4, nvfp4_decode
from musespark.quant.nvfp4 import Nvfp4Experts, Nvfp4Linear
from musespark.quant.nvfp4_decode import dequantize_to

# ------------------------------------------------------------ the formula the oracle keeps

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def old_dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The whole weight in fp32: t = f32(scale) * f32(global); w = E2M1[code] * t (low nibble first)."""
    t = scale.float() * global_scale.float()
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    w = E2M1[codes.long()].unflatten(-1, (-1, 16))
    return (w * t.unsqueeze(-1)).flatten(-2)


def old_expert(module, e: int, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
    rows = module.gate_up_proj.shape[1] // 2
    g = module.gate_up_proj_weight_scale_2[e].float().repeat_interleave(rows)[:, None]
    gate_up = old_dequantize(module.gate_up_proj[e], module.gate_up_proj_weight_scale[e], g).to(x.dtype)
    down = old_dequantize(module.down_proj[e], module.down_proj_weight_scale[e], module.down_proj_weight_scale_2[e])
    down = down.to(x.dtype)
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    h = F.silu(gate) * up
    return F.linear(h.float(), down.float()) if partial else F.linear(h, down)


def old_experts_forward(module, u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One rank's MoE sum as the torch backend computed it: tokens grouped by expert (stable
    sort), one product pair per expert with tokens, post-norm, weights, slots summed in order."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=module.num_experts).tolist()
    x = u[order // k]
    ys, start = [], 0
    for e, n in enumerate(counts):
        if n:
            ys.append(old_expert(module, e, x[start : start + n]))
            start += n
    norm = module.post_expert_norm
    y = input_scaled_rms_norm(torch.cat(ys), norm.eps, norm.weight, norm.gain_center, torch.float32)
    y = y * weights.reshape(-1)[order, None]
    rank = ids.argsort(dim=1).argsort(dim=1).reshape(-1)
    z = torch.empty_like(y).index_copy_(0, (order // k) * k + rank[order], y).view(T, k, -1)
    out = z[:, 0]
    for r in range(1, k):
        out = out + z[:, r]
    return out


# ------------------------------------------------------------------------ random weights


def random_scales(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Every finite e4m3 byte, signs, zero and subnormals included (NaN bytes become 1.0)."""
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x38
    return b.view(torch.float8_e4m3fn)


def random_experts(gen: torch.Generator, E: int = 6, I: int = 32, Hm: int = 48) -> Experts:
    cfg = ModelConfig(num_local_experts=E, moe_hidden_size=Hm, moe_intermediate_size=I, num_experts_per_tok=2)
    module = Experts(cfg, Nvfp4Experts("layers.0.mlp.experts", "weight-only"))
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randint(0, 256, (E, 2 * I, Hm // 2), generator=gen, dtype=torch.uint8))
        module.gate_up_proj_weight_scale.copy_(random_scales(gen, (E, 2 * I, Hm // 16)))
        module.gate_up_proj_weight_scale_2.copy_(torch.rand(E, 2, generator=gen) * 0.02 + 1e-4)
        module.down_proj.copy_(torch.randint(0, 256, (E, Hm, I // 2), generator=gen, dtype=torch.uint8))
        module.down_proj_weight_scale.copy_(random_scales(gen, (E, Hm, I // 16)))
        module.down_proj_weight_scale_2.copy_(torch.rand(E, generator=gen) * 0.02 + 1e-4)
        module.post_expert_norm.weight.copy_(torch.randn(Hm, generator=gen) * 0.1)
    return module


def routing(gen: torch.Generator, T: int, E: int, k: int, unused: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] distinct expert ids per token that never name `unused`, and their weights."""
    allowed = torch.tensor([e for e in range(E) if e not in unused])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:k]] for _ in range(T)])
    return torch.rand(T, k, generator=gen), ids


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", [1.0 / 2688, 0.37, 2.0**-120, 3.0e4, 2.0**110])
def test_blocked_decoding_has_the_bits_of_the_whole_fp32_decode(dtype, g):
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (37, 96), generator=gen, dtype=torch.uint8)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every byte value, in rows 0-2
    scale = random_scales(gen, (37, 12))
    per_row = torch.rand(37, 1, generator=gen) * g
    for global_scale in (torch.tensor(g), per_row):
        expected = old_dequantize(packed, scale, global_scale).to(dtype)
        for rows in (1, 5, 64):  # blocks smaller than, not dividing, and larger than N
            got = dequantize_to(packed, scale, global_scale, dtype, block_elements=rows * 192)
            assert same_bits(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_linear_keeps_its_bits(dtype):
    gen = torch.Generator().manual_seed(1)
    lin = Linear(64, 40, Nvfp4Linear("layers.0.self_attn.q_proj", "weight-only"))
    with torch.no_grad():
        lin.weight.copy_(torch.randint(0, 256, (40, 32), generator=gen, dtype=torch.uint8))
        lin.weight_scale.copy_(random_scales(gen, (40, 4)))
        lin.weight_scale_2.fill_(0.013)
    for T in (1, 3, 8, 17):
        x = torch.randn(T, 64, generator=gen).to(dtype)
        expected = F.linear(x, old_dequantize(lin.weight, lin.weight_scale, lin.weight_scale_2).to(dtype))
        assert same_bits(lin(x), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_experts_keep_their_bits(dtype):
    """Batches of 1 to 33 tokens; with 6 experts and top-2 several tokens share an expert, and
    experts 1 and 4 get none."""
    gen = torch.Generator().manual_seed(2)
    module = random_experts(gen)
    for T in (1, 2, 8, 33):
        weights, ids = routing(gen, T, module.num_experts, 2, unused={1, 4})
        u = torch.randn(T, module.hidden, generator=gen).to(dtype)
        assert same_bits(module(u, weights, ids), old_experts_forward(module, u, weights, ids))
    x = torch.randn(5, module.hidden, generator=gen).to(dtype)
    for partial in (False, True):  # a tensor-parallel slice's unrounded fp32 down product too
        assert same_bits(module.format.apply(module, 3, x, partial), old_expert(module, 3, x, partial))


def test_each_routed_expert_is_decoded_once_per_step_in_bounded_blocks(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    module = random_experts(gen, E=8, I=32, Hm=64)
    calls: list[int] = []
    decoded_rows: dict[int, int] = {}
    real = nvfp4_decode.dequantize_to

    def counting(packed, scale, global_scale, dtype, out=None, block_elements=None):
        calls.append(packed.data_ptr())
        return real(packed, scale, global_scale, dtype, out, block_elements)

    monkeypatch.setattr(nvfp4, "dequantize_to", counting)
    real_block = nvfp4_decode._decode_block

    def block(packed, t, out, *rest):
        decoded_rows[packed.data_ptr()] = decoded_rows.get(packed.data_ptr(), 0) + packed.shape[0]
        assert packed.shape[0] * packed.shape[1] * 2 <= max(nvfp4_decode.BLOCK_ELEMENTS, packed.shape[1] * 2)
        return real_block(packed, t, out, *rest)

    monkeypatch.setattr(nvfp4_decode, "_decode_block", block)
    monkeypatch.setattr(nvfp4_decode, "BLOCK_ELEMENTS", 64 * 8)  # 8 rows of gate_up per block
    T = 12
    weights, ids = routing(gen, T, 8, 2, unused={0, 5, 6})
    module(torch.randn(T, 64, generator=gen).bfloat16(), weights, ids)
    routed = sorted(set(ids.flatten().tolist()))
    # two decodes (gate_up, down) per routed expert, none for the others, whatever its token count
    assert len(calls) == 2 * len(routed)
    expected = {module.gate_up_proj[e].data_ptr() for e in routed} | {module.down_proj[e].data_ptr() for e in routed}
    assert set(calls) == expected
    assert sum(decoded_rows.values()) == len(routed) * (2 * 32 + 64)  # every row of a routed expert once


def test_w4a4_products_keep_their_bits():
    """The W4A4 mode multiplies E2M1 * block scale in fp32: decoded in blocks too, same bits."""
    from musespark.quant.nvfp4_math import quantize_activation

    gen = torch.Generator().manual_seed(4)
    module = random_experts(gen)
    module.format = Nvfp4Experts("layers.0.mlp.experts", "w4a4")
    module.gate_up_proj_input_scale = torch.nn.Parameter(torch.rand(6, 2, generator=gen) * 0.01 + 1e-3)
    module.down_proj_input_scale = torch.nn.Parameter(torch.rand(6, generator=gen) * 0.01 + 1e-3)
    one = torch.tensor(1.0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, module.hidden, generator=gen).to(dtype)
        a1, a2 = module.gate_up_proj_input_scale.float().max(), module.down_proj_input_scale.float().max()
        ws2 = module.gate_up_proj_weight_scale_2[2].float()
        gu = F.linear(
            quantize_activation(x, a1)[0],
            old_dequantize(module.gate_up_proj[2], module.gate_up_proj_weight_scale[2], one),
        )
        gate, up = gu.chunk(2, dim=-1)
        h = (F.silu(gate * (a1 * ws2[0])) * (up * (a1 * ws2[1]))).to(dtype)
        y = F.linear(
            quantize_activation(h, a2)[0], old_dequantize(module.down_proj[2], module.down_proj_weight_scale[2], one)
        )
        expected = (y * (a2 * module.down_proj_weight_scale_2[2].float())).to(dtype)
        assert same_bits(module.format.apply(module, 2, x), expected)


def test_scratch_buffers_are_reused_per_thread_up_to_a_bound(monkeypatch):
    import threading

    a = nvfp4_decode.scratch("test.slot", (8, 32), torch.bfloat16)
    b = nvfp4_decode.scratch("test.slot", (4, 32), torch.float32)  # same bytes, another view
    assert a.data_ptr() == b.data_ptr() and b.shape == (4, 32) and b.dtype == torch.float32
    other: list[int] = []
    thread = threading.Thread(
        target=lambda: other.append(nvfp4_decode.scratch("test.slot", (8, 32), a.dtype).data_ptr())
    )
    thread.start()
    thread.join()
    assert other[0] != a.data_ptr()  # each thread its own
    monkeypatch.setattr(nvfp4_decode, "SCRATCH_MAX_BYTES", 1024)
    big = nvfp4_decode.scratch("test.big", (64, 64), torch.bfloat16)  # 8 KiB: over the bound, not kept
    assert big.shape == (64, 64) and big.dtype == torch.bfloat16
    assert "test.big" not in nvfp4_decode._local.scratch


def test_buffers_made_in_inference_mode_serve_outside_it_and_back():
    """The per-thread workspace and scratch are kept across calls: those first made inside
    `torch.inference_mode` (the engine's steps) must still take writes outside it (a test, a
    training script), and the other way round, with the same bits each time."""
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=g)
    scales = torch.randint(0x20, 0x40, (64, 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    want = old_dequantize(packed, scales, torch.tensor(0.37)).to(torch.bfloat16)
    for inference in (True, False, True):
        with torch.inference_mode(inference):
            assert torch.equal(dequantize_to(packed, scales, torch.tensor(0.37), torch.bfloat16), want)
            nvfp4_decode.scratch("test-buffer", (64, 256), torch.bfloat16).fill_(1.0)
