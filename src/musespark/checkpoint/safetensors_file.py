"""Read tensors one at a time from a memory-mapped safetensors file, releasing pages.

We parse the (tiny, documented) safetensors header ourselves instead of using
`safetensors.safe_open` for one reason: after copying a tensor out we drop its pages
from our resident set (`madvise(MADV_DONTNEED)`), which keeps peak memory while loading
near the final model size. `safe_open` gives no handle on its mapping. Writing uses the
`safetensors` library.

Every offset is validated against the file size, so a truncated or corrupt file is a
clear `ValueError`, never a crash or a silent short read.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import hugepages

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024
_COPY_CHUNK_BYTES = 1 << 20  # a cast's bounce buffer
_READ_CHUNK_BYTES = 64 << 20  # bytes per positioned read
_PAGE = 4096

# One helper thread that faults in the next slice of a tensor being read while the reader
# copies the current one (`_fault_in`): the kernel zero-fills every fresh anonymous page before
# a read may copy into it, and on the machines measured that zeroing took as long as the copy
# (docs/cpu_816b.md): done on the other core, the two overlap.
_faulter: ThreadPoolExecutor | None = None
_faulter_lock = threading.Lock()


def _fault_ahead(t: torch.Tensor) -> Future:
    global _faulter
    with _faulter_lock:
        if _faulter is None:
            _faulter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="musespark-fault-in")
    return _faulter.submit(_fault_in, t)


def _fault_in(t: torch.Tensor) -> None:
    """Write a zero to every 4 KiB page of uint8 `t` (a slice about to be overwritten by a read),
    so that the pages exist (zero-filled by the kernel) before the read copies into them."""
    t[::_PAGE].fill_(0)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """An open safetensors file: `entries` from its header, `read(name)` for a tensor copy."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb")
        self._cast_buffer: torch.Tensor | None = None
        try:
            self.entries = self._parse_header()
            size = os.fstat(self._file.fileno()).st_size
            self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except BaseException:
            self._file.close()
            raise

    def _corrupt(self, why: str) -> ValueError:
        return ValueError(f"{self.path}: not a valid safetensors file ({why})")

    def _parse_header(self) -> dict[str, TensorEntry]:
        size = os.fstat(self._file.fileno()).st_size
        raw = self._file.read(8)
        if len(raw) < 8:
            raise self._corrupt(f"file is {size} bytes, too short for a header")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > _MAX_HEADER or 8 + header_len > size:
            raise self._corrupt(f"header length {header_len} does not fit in a {size}-byte file; truncated?")
        try:
            header = json.loads(self._file.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise self._corrupt(f"header is not valid JSON: {exc}") from None
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")
        data_start = 8 + header_len
        entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._corrupt(f"bad header entry for tensor {name!r}: {info!r}") from None
            numel = 1
            for d in shape:
                if d < 0:
                    raise self._corrupt(f"tensor {name!r} has a negative dimension in shape {shape}")
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if begin < 0 or end - begin != nbytes:
                raise self._corrupt(
                    f"tensor {name!r} of dtype {info['dtype']} and shape {list(shape)} needs {nbytes} bytes, "
                    f"header gives offsets [{begin}, {end}]"
                )
            if data_start + end > size:
                raise self._corrupt(
                    f"tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes; truncated?"
                )
            entries[name] = TensorEntry(name, dtype, shape, data_start + begin, data_start + end)
        return entries

    def read(self, name: str, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """A fresh tensor (not backed by the file) with `name`'s data, cast to `out_dtype`; a
        large one in huge pages (`musespark.hugepages`: the weights a decode step streams).

        The bytes come by positioned reads (`os.preadv`) in large slices: straight into the
        tensor when no cast is needed, else through one slice-sized buffer, so a conversion
        (e.g. an fp32 file into bf16) never holds a whole source tensor. Large sequential reads
        run at the disk's speed; faulting a mapping of the file in page by page ran at a
        fraction of it on the machines measured (docs/cpu.md)."""
        e = self.entries[name]
        target = out_dtype or e.dtype
        out = hugepages.empty(e.shape, target)
        nbytes = e.end - e.start
        if nbytes == 0:
            return out
        itemsize = _itemsize(e.dtype)
        if target == e.dtype:
            flat = out.view(-1).view(torch.uint8)
            dest = flat.numpy()
            ahead: Future | None = None
            for at in range(0, nbytes, _READ_CHUNK_BYTES):
                if ahead is not None:
                    ahead.result()
                ahead = None
                if at + _READ_CHUNK_BYTES < nbytes:  # the next slice's pages, on the helper thread
                    ahead = _fault_ahead(flat[at + _READ_CHUNK_BYTES : at + 2 * _READ_CHUNK_BYTES])
                self._read_into(memoryview(dest[at : at + _READ_CHUNK_BYTES]), e.start + at)
            if ahead is not None:
                ahead.result()
            return out
        flat = out.view(-1)
        step = max(1, _COPY_CHUNK_BYTES // itemsize)
        raw = self._bounce(min(step, flat.numel()) * itemsize)
        for i in range(0, flat.numel(), step):
            n = min(step, flat.numel() - i)
            self._read_into(memoryview(raw[: n * itemsize].numpy()), e.start + i * itemsize)
            flat[i : i + n].copy_(raw[: n * itemsize].view(e.dtype))
        return out

    def _bounce(self, nbytes: int) -> torch.Tensor:
        """This file's cast buffer (uint8), grown to `nbytes` at most once per size."""
        if self._cast_buffer is None or self._cast_buffer.numel() < nbytes:
            self._cast_buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._cast_buffer

    def _read_into(self, buf: memoryview, offset: int) -> None:
        """Fill `buf` from byte `offset` of the file (a short read is a truncated file), then
        drop those bytes from the page cache: the tensor now holds them, and a second copy
        in the cache would push the machine into reclaiming memory while it loads (a 8.9 GB
        checkpoint on a 24 GB machine: 25 s with the cache kept, 9.4 s dropped, 8.1 s to read
        the files into one reused buffer)."""
        fd = self._file.fileno()
        done = 0
        while done < len(buf):
            got = os.preadv(fd, [buf[done:]], offset + done)
            if got <= 0:
                raise self._corrupt(f"file ends at byte {offset + done}, inside a tensor's data")
            done += got
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, done, os.POSIX_FADV_DONTNEED)

    def read_shard(
        self, name: str, dim: int, pieces: tuple[tuple[int, int], ...], out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Only the (start, length) ranges of `name` along `dim`, concatenated, cast to
        `out_dtype`; ranges past the end are zero-filled. Only the pages those ranges
        touch are read (a rank of a sharded model never reads whole tensors)."""
        e = self.entries[name]
        target = out_dtype or e.dtype
        shape = list(e.shape)
        shape[dim] = sum(length for _, length in pieces)
        out = hugepages.zeros(tuple(shape), target)  # a large shard in huge pages, as `read`
        at = 0
        for start, length in pieces:
            have = max(0, min(length, e.shape[dim] - start))
            if have and e.end > e.start:
                assert self._mmap is not None
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    src = torch.frombuffer(
                        self._mmap, dtype=e.dtype, count=(e.end - e.start) // _itemsize(e.dtype), offset=e.start
                    ).view(e.shape)
                out.narrow(dim, at, have).copy_(src.narrow(dim, start, have))
                del src
            at += length
        return out

    def close(self) -> None:
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
