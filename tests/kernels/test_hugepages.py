"""Large weights live in memory advised for transparent huge pages (musespark.hugepages)."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from musespark import env, hugepages
from musespark.checkpoint.safetensors_file import SafetensorsFile

linux_thp = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")),
    reason="huge-page advice needs Linux's MADV_HUGEPAGE",
)


def vma_flags(t: torch.Tensor) -> list[str]:
    """The VmFlags of the mapping that holds t's first byte (/proc/self/smaps)."""
    addr = t.data_ptr()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds address {addr:#x}")


@linux_thp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32])
def test_a_large_tensor_starts_on_a_huge_page_in_advised_memory(dtype: torch.dtype) -> None:
    t = hugepages.empty((3, 1000, 1000), dtype)  # 6-12 MB, not a multiple of 2 MiB
    assert t.shape == (3, 1000, 1000) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert "hg" in vma_flags(t)  # MADV_HUGEPAGE was applied to its mapping
    values = torch.arange(t.numel()).reshape(t.shape).to(dtype)
    t.copy_(values)
    assert torch.equal(t, values)


@linux_thp
def test_a_small_tensor_or_the_switch_off_gives_plain_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    small = hugepages.empty((100, 100), torch.float32)
    assert small.shape == (100, 100) and "hg" not in vma_flags(small)
    monkeypatch.setenv(env.HUGEPAGES, "0")
    assert not hugepages.enabled()
    off = hugepages.empty((1024, 1024), torch.float32)
    assert off.shape == (1024, 1024) and "hg" not in vma_flags(off)


@linux_thp
def test_the_mapping_lives_as_long_as_the_tensor() -> None:
    view = hugepages.empty((1 << 20,), torch.float32)[10:20]
    view.fill_(3.0)
    import gc

    gc.collect()
    assert torch.equal(view, torch.full((10,), 3.0))


@linux_thp
def test_checkpoint_weights_and_packed_panels_are_read_into_advised_memory(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from musespark.kernels import cpu

    w = torch.randn(1024, 1536).bfloat16()  # 3 MiB
    save_file({"big": w, "small": torch.randn(8, 8)}, str(tmp_path / "m.safetensors"))
    with SafetensorsFile(tmp_path / "m.safetensors") as f:
        big, small = f.read("big"), f.read("small")
    assert torch.equal(big, w) and "hg" in vma_flags(big) and "hg" not in vma_flags(small)
    panels = cpu.pack_panels(big)
    assert "hg" in vma_flags(panels)
    # The layout pack_panels documents: the pair (w[64p + c, 2q], w[64p + c, 2q + 1]) at panel_word(q, c, K / 2).
    pairs = w.view(torch.int32)
    for p, q, c in [(0, 0, 0), (3, 17, 5), (15, 767, 63)]:
        assert panels[p].flatten()[cpu.panel_word(q, c, 768)] == pairs[64 * p + c, q]


def test_zeros_reads_as_zeros_whichever_memory_it_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    for on in ("1", "0"):
        monkeypatch.setenv(env.HUGEPAGES, on)
        t = hugepages.zeros((1536, 1024), torch.float32)
        assert t.shape == (1536, 1024) and not t.any()


@linux_thp
def test_describe_reports_the_switch_and_the_system_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.HUGEPAGES, "0")
    assert hugepages.describe() == f"off ({env.HUGEPAGES}=0)"
    monkeypatch.setenv(env.HUGEPAGES, "1")
    sysfs = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sysfs.exists():
        assert hugepages.describe() == "on (THP mode unknown)"
        return
    mode = sysfs.read_text().split("[")[1].split("]")[0]
    assert hugepages.describe() == ("no effect (THP never)" if mode == "never" else f"on (THP {mode})")


@linux_thp
def test_a_shard_is_read_into_advised_memory_with_its_pieces_in_order(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    w = torch.randn(1000, 1536)  # 5.9 MB
    save_file({"w": w}, str(tmp_path / "s.safetensors"))
    with SafetensorsFile(tmp_path / "s.safetensors") as f:
        rows = f.read_shard("w", 0, ((100, 300), (900, 200)))  # the second piece runs 100 rows past the end
        cols = f.read_shard("w", 1, ((0, 1000),), torch.bfloat16)
    want = torch.cat([w[100:400], w[900:], torch.zeros(100, 1536)])
    assert torch.equal(rows, want) and "hg" in vma_flags(rows)
    assert torch.equal(cols, w[:, :1000].bfloat16()) and cols.is_contiguous()


def test_a_refused_mapping_falls_back_to_torch_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hugepages.mmap, "mmap", refuse)
    t = hugepages.zeros((1024, 1024), torch.float32)
    assert t.shape == (1024, 1024) and not t.any()


@pytest.mark.parametrize("chunk", [4096, 3 * 4096 + 17, 1 << 22])
def test_a_tensor_read_in_many_slices_has_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Reads of several slices (the next slice's pages faulted in on the helper thread meanwhile)
    give the file's bytes, whether the slices end on a page or not; a truncated file still fails."""
    from safetensors.torch import save_file

    from musespark.checkpoint import safetensors_file

    monkeypatch.setattr(safetensors_file, "_READ_CHUNK_BYTES", chunk)
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-(2**31), 2**31 - 1, (1000, 777), dtype=torch.int32, generator=gen)  # 3.0 MiB
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    with SafetensorsFile(tmp_path / "m.safetensors") as f:
        assert torch.equal(f.read("w"), w)
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 5])
    with pytest.raises(ValueError, match="truncated|ends at byte"):
        SafetensorsFile(tmp_path / "cut.safetensors").read("w")
