"""The rotary table (layers/rotary.py `RopeTable`): the model's cos/sin by position."""

import pytest
import torch

from musespark.layers.rotary import RopeTable, cos_sin, inv_frequencies


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_table_gives_each_position_its_own_value_whatever_the_step(head_dim):
    inv = inv_frequencies(500000.0, head_dim)
    table = RopeTable(inv)
    g = torch.Generator().manual_seed(0)
    alone = {}
    for p in [0, 1, 7, 1023, 1024, 5000, 3]:  # grows past its first size, then looks back
        cos, sin = table.lookup(torch.tensor([p]))
        assert cos.shape == sin.shape == (1, head_dim) and cos.is_contiguous() and sin.is_contiguous()
        alone[p] = (cos[0], sin[0])
    batch = torch.randint(0, 6000, (37,), generator=g)
    batch[:7] = torch.tensor(list(alone))
    cos, sin = table.lookup(batch, int(batch.max()))
    for i, p in enumerate(batch.tolist()):
        if p in alone:  # the same bits as the position alone
            assert torch.equal(cos[i], alone[p][0]) and torch.equal(sin[i], alone[p][1])
    # The formula: cos_sin's, in float32 (to the last ulp where torch's cos/sin are vectorized).
    want_cos, want_sin = cos_sin(batch, inv)
    assert torch.allclose(cos, want_cos, rtol=0, atol=1e-6) and torch.allclose(sin, want_sin, rtol=0, atol=1e-6)
    if head_dim % 32 == 0:
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_rope_table_falls_back_past_its_largest_size():
    inv = inv_frequencies(10000.0, 64)
    table = RopeTable(inv)
    far = torch.tensor([RopeTable.MAX_POSITIONS + 5, 2])
    cos, sin = table.lookup(far)
    want = cos_sin(far, inv)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    assert table.table.shape[1] == 0  # nothing was tabulated for it
    empty = table.lookup(torch.empty(0, dtype=torch.long))
    assert empty[0].shape == (0, 64)
