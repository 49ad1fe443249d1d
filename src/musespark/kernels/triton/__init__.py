"""Triton kernels for the decoder's boundaries.

One file per kernel; each holds the `@triton.jit` kernel and its typed launcher, which takes
tensors and plain numbers only (nothing of the model's: the triton backend unpacks the
modules into them). What each must compute, the torch reference formulas in the launcher's
signature, is `musespark.backends.triton_reference` (`reference_<kernel>`):

* `norm_residual` — post-norm -> gated residual -> next pre-norm (and a plain RMSNorm)
* `qk_norm_rope`  — per-head QK-norm, query scale, rotate-half RoPE, optional paged K/V write
* `o_norm_gate`   — per-head O-norm times sigmoid(gate)
* `routing`       — fp32 router logits, sigmoid, bias top-k, renormalise, scale
* `experts`       — grouped expert SwiGLU GEMMs, per-expert post-norm, weighted ordered sum
* `attention`     — paged attention (chunked prefill and decode; sliding windows)

Triton is optional: `available()` says whether it imports; nothing here is imported by the
engine unless the triton backend is chosen. On CPU tensors the kernels run only under
`TRITON_INTERPRET=1` (tests). Invariants every kernel keeps, interpreted or compiled:
loads are widened to fp32 at once, every sum runs in fp32, and a value rounded to bf16 is
rounded to nearest-even explicitly (`_common.round_bf16`) before it is stored.
"""

from __future__ import annotations

import importlib

from ... import env


def available() -> bool:
    """Whether `triton` imports here."""
    try:
        importlib.import_module("triton.language")  # imports triton too; a broken install fails here
    except Exception:  # ImportError, or a broken install
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return env.triton_interpreting()


__all__ = ["available", "interpreting"]
