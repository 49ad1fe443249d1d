"""NVFP4 weights decoded in row blocks straight to the compute dtype, with the bits of
`nvfp4_math.dequantize(...).to(dtype)` (the reference's rounding) but without its fp32 copy of
the whole weight: the torch backend's product for NVFP4 linears and experts (docs/nvfp4.md §4).

How one block of rows is decoded, with a handful of tensor ops into reused buffers:
1. each packed byte (two codes) indexes a 256-entry table of 8-byte entries, each the fp32
   pair (E2M1[low nibble], E2M1[high nibble]): the block's E2M1 values in element order;
2. those are multiplied by t = f32(block scale) * f32(global), computed as the reference
   computes it (the e4m3 -> fp32 conversion looked up in a 256-entry table of its own results),
   and each fp32 product is rounded once to the output dtype.
Every weight is the reference's fp32 product E2M1 * t rounded once, so the bits are the same.

Memory: the temporaries hold one block (`BLOCK_ELEMENTS` weights, about 6 bytes each) and are
kept per thread; the output is the weight in the compute dtype.
"""

from __future__ import annotations

import math
import threading

import torch

from .nvfp4_math import BLOCK, E2M1_VALUES, dequantize

# Weights decoded per block: the temporaries of one block (6 bytes a weight, 1.5 MiB) stay
# within a core's L2 cache, and each op still spans enough elements to use every thread.
BLOCK_ELEMENTS = 1 << 18
# The largest decoded weight a thread keeps for reuse (`scratch`): a real-width expert's gate_up
# in bf16 is 64 MiB, a head over a 202k vocabulary 3.2 GiB (not kept).
SCRATCH_MAX_BYTES = 256 << 20


def _pair_table() -> torch.Tensor:
    """int64 [256]: entry b holds the fp32 pair (E2M1[b & 15], E2M1[b >> 4]), low nibble first."""
    b = torch.arange(256)
    pairs = torch.stack([E2M1_VALUES[b & 15], E2M1_VALUES[b >> 4]], dim=-1).contiguous()
    return pairs.view(torch.int64).view(256)


_PAIRS = _pair_table()
# float32 [256]: each e4m3 byte's value, by torch's exact conversion (looked up: converting
# float8 tensors element by element is several times slower).
_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """This thread's reusable buffer `name`, viewed as `shape` and `dtype`: for a decoded weight
    that one product uses and drops (a fresh tensor of megabytes costs a page fault per 4 KiB
    page on every call). The next request for `name` in this thread overwrites it; it grows to
    the largest size asked for, so a thread keeps one expert's (or linear's) decoded weights,
    at most `SCRATCH_MAX_BYTES` each: a larger weight (an NVFP4 head) gets a new tensor."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > SCRATCH_MAX_BYTES:
        return torch.empty(shape, dtype=dtype)
    buffers = _local.__dict__.setdefault("scratch", {})
    buf = buffers.get(name)
    if buf is None or buf.numel() < nbytes:
        with torch.inference_mode(False):  # a normal tensor: reused both inside inference mode and outside
            buf = buffers[name] = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes].view(dtype).view(shape)


def _block_t(block_scale: torch.Tensor, g: torch.Tensor, work: _Workspace) -> torch.Tensor:
    """e4m3 [n, K/16] and fp32 g [n, K/16] -> t = f32(block scale) * g, the reference's t bit for
    bit, in `work`."""
    n = block_scale.numel()
    index, t = work.scale_index[:n], work.t[:n]
    index.copy_(block_scale.reshape(-1).view(torch.uint8))
    torch.index_select(_E4M3, 0, index, out=t)
    return t.view(block_scale.shape).mul_(g)


class _Workspace:
    """Temporaries for blocks of up to `rows` rows of `half` packed bytes."""

    def __init__(self, rows: int, half: int) -> None:
        self.index = torch.empty(rows * half, dtype=torch.int32)
        self.pairs = torch.empty(rows * half, dtype=torch.int64)
        self.scale_index = torch.empty(rows * half // (BLOCK // 2), dtype=torch.int32)
        self.t = torch.empty(rows * half // (BLOCK // 2), dtype=torch.float32)


_local = threading.local()  # each thread's workspace, reused: fresh large buffers cost page faults


def _workspace(rows: int, half: int) -> _Workspace:
    """This thread's workspace, grown to hold `rows` x `half` bytes (at most one block's worth)."""
    work = getattr(_local, "work", None)
    if work is None or work.index.numel() < rows * half:
        with torch.inference_mode(False):  # normal tensors: reused both inside inference mode and outside
            work = _local.work = _Workspace(rows, half)
    return work


def _decode_block(packed: torch.Tensor, t: torch.Tensor, out: torch.Tensor, work: _Workspace | None = None) -> None:
    """packed uint8 [n, K/2], t fp32 [n, K/16] -> out [n, K] (any float dtype, contiguous rows):
    each weight the fp32 product E2M1[code] * t of its block, rounded once to out's dtype."""
    n, half = packed.shape
    work = work or _Workspace(n, half)
    index, pairs = work.index[: n * half], work.pairs[: n * half]
    index.copy_(packed.reshape(-1))
    torch.index_select(_PAIRS, 0, index, out=pairs)
    values = pairs.view(torch.float32).view(n, -1, BLOCK)  # [n, K/16, 16]: element order
    if out.dtype == torch.float32:
        torch.mul(values, t.unsqueeze(-1), out=out.view(n, -1, BLOCK))
    else:  # the fp32 products in place, then one rounding copy (torch.mul into `out` would allocate)
        out.view(n, -1, BLOCK).copy_(values.mul_(t.unsqueeze(-1)))


def dequantize_to(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    block_elements: int | None = None,
) -> torch.Tensor:
    """packed uint8 [N, K/2], block_scale e4m3 [N, K/16], global_scale fp32 broadcasting against
    [N, K/16] (0-d, or [N, 1]) -> the weight [N, K] in `dtype` (into `out` when given), bit for bit
    `nvfp4_math.dequantize(packed, block_scale, global_scale).to(dtype)`; decoded
    `block_elements` weights (default `BLOCK_ELEMENTS`) at a time, at least one row."""
    if packed.dim() != 2:
        raise ValueError(f"dequantize_to decodes one 2-D weight, got packed codes of shape {list(packed.shape)}")
    N, half = packed.shape
    K = 2 * half
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=packed.device)
    if packed.device.type != "cpu":  # the table lives on the CPU; elsewhere the formula itself
        return out.copy_(dequantize(packed, block_scale, global_scale))
    g = torch.broadcast_to(global_scale.float(), (N, K // BLOCK))  # a view: per row or shared
    limit = BLOCK_ELEMENTS if block_elements is None else block_elements
    rows = max(1, min(N, limit // max(K, 1)))
    work = _workspace(rows, half)
    for r in range(0, N, rows):
        s = slice(r, min(r + rows, N))
        _decode_block(packed[s], _block_t(block_scale[s], g[s], work), out[s], work)
    return out
