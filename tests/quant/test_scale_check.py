"""The NVFP4 scale check reads e4m3 block scales as raw bytes, in blocks, with the same
accept/reject rule and messages as the float check it replaces (docs/nvfp4.md §2 "Errors")."""

from __future__ import annotations

import pytest
import torch

from musespark.quant import nvfp4
from musespark.quant.nvfp4 import check_finite_scales, e4m3_has_nan


def float_rule(t: torch.Tensor) -> bool:
    """The rule as first written: convert to fp32 and ask for non-finite values."""
    return not bool(torch.isfinite(t.float()).all())


def test_every_e4m3_bit_pattern_is_judged_as_the_float_rule_judges_it():
    for byte in range(256):
        t = torch.tensor([0x38, byte, 0x00], dtype=torch.uint8).view(torch.float8_e4m3fn)
        assert e4m3_has_nan(t) == float_rule(t), hex(byte)


@pytest.mark.parametrize("where", [0, 63, 64, 999])
def test_a_nan_in_any_block_is_found(where):
    t = torch.full((10, 100), 0x70, dtype=torch.uint8)
    t.view(-1)[where] = 0xFF
    scales = t.view(torch.float8_e4m3fn)
    assert e4m3_has_nan(scales, block=64) and float_rule(scales)
    t.view(-1)[where] = 0xFE  # -448: finite (block scales' sign is not checked, as before)
    assert not e4m3_has_nan(scales, block=64) and not float_rule(scales)


def test_a_strided_slice_is_judged_by_its_own_elements():
    t = torch.full((4, 32), 0x40, dtype=torch.uint8)
    t[:, 31] = 0x7F  # NaN only in the column the slice leaves out
    scales = t.view(torch.float8_e4m3fn)[:, :16]
    assert not e4m3_has_nan(scales) and not float_rule(scales)
    assert e4m3_has_nan(t.view(torch.float8_e4m3fn)[:, 16:])


def _state(**over):
    ok = {
        "w.weight_scale": torch.full((4, 2), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "w.weight_scale_2": torch.tensor(0.01),
        "w.input_scale": torch.tensor(0.02),
    }
    return {**ok, **over}


BAD = {
    "NaN block scale": (
        dict(**{"w.weight_scale": torch.tensor([[0x38, 0x7F]] * 4, dtype=torch.uint8).view(torch.float8_e4m3fn)}),
        r"tensor 'w.weight_scale': NVFP4 scale holds NaN or inf; expected finite values",
    ),
    "negative NaN block scale": (
        dict(**{"w.weight_scale": torch.tensor([[0xFF, 0x38]] * 4, dtype=torch.uint8).view(torch.float8_e4m3fn)}),
        r"tensor 'w.weight_scale': NVFP4 scale holds NaN",
    ),
    "inf global scale": (dict(**{"w.weight_scale_2": torch.tensor(float("inf"))}), r"'w.weight_scale_2'.*NaN or inf"),
    "NaN input scale": (dict(**{"w.input_scale": torch.tensor(float("nan"))}), r"'w.input_scale'.*NaN or inf"),
    "zero global scale": (
        dict(**{"w.weight_scale_2": torch.tensor(0.0)}),
        r"global/input scale must be > 0, got min 0.0",
    ),
    "negative input scale": (dict(**{"w.input_scale": torch.tensor(-1.0)}), r"must be > 0, got min -1.0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_scales_are_refused_with_the_same_message(case):
    over, match = BAD[case]
    state = _state(**over)
    with pytest.raises(ValueError, match=match):
        check_finite_scales(state, list(state))


def test_good_scales_pass_including_negative_and_zero_block_scales():
    codes = torch.tensor([[0x00, 0xB8], [0x80, 0x7E]], dtype=torch.uint8)  # 0, -1, -0, 448
    state = _state(**{"w.weight_scale": codes.view(torch.float8_e4m3fn)})
    check_finite_scales(state, list(state))


def test_block_scales_are_never_widened(monkeypatch):
    """The check must not convert an e4m3 tensor to a wider dtype (+4 bytes per scale)."""
    widened = []
    real_to = torch.Tensor.to
    real_float = torch.Tensor.float

    def spy_float(self, *a, **k):
        if self.dtype == torch.float8_e4m3fn:
            widened.append(self.shape)
        return real_float(self, *a, **k)

    def spy_to(self, *a, **k):
        if self.dtype == torch.float8_e4m3fn:
            widened.append(self.shape)
        return real_to(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "float", spy_float)
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    state = _state(**{"w.weight_scale": torch.full((64, 64), 0x40, dtype=torch.uint8).view(torch.float8_e4m3fn)})
    check_finite_scales(state, list(state))
    assert widened == []
    assert nvfp4.SCALE_CHECK_BLOCK >= 1 << 20  # blocks large enough that the loop is not the cost
