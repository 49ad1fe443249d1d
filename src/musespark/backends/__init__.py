"""Compute backends, chosen once per model (`select_backend`) and handed to it.

* `torch` — the reference formulas in plain PyTorch; every dtype and device.
* `cpu`   — the native kernels (`kernels/`) on x86-64 CPUs with AVX2 and FMA.
* `triton` — Triton kernels at the decoder's boundaries (`kernels/triton/`) for a model on a
  CUDA device (on the CPU only under TRITON_INTERPRET=1, for tests); never chosen by `auto`.
* `auto`  — `cpu` for a model on the CPU when the kernels are available (they are not
  under `MUSESPARK_CPU_KERNELS=0`, without a compiler, or on other CPUs), else `torch`
  (`torch` for a pipeline stage or for tensor-parallel ranks on several hosts).

A new device or kernel family is one more `Backend` subclass and one more name here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import BACKENDS as BACKEND_NAMES
from ..config import BackendName
from .base import Backend
from .torch_backend import TorchBackend

if TYPE_CHECKING:
    from .modules import DecoderModel


def select_backend(name: str | Backend, model: DecoderModel) -> Backend:
    """The backend `name` for `model` (a Backend instance is returned as it is).
    Raises ValueError naming `backend` for an unknown name or one that cannot run here."""
    if isinstance(name, Backend):
        return name
    if name == "triton":
        from .triton_backend import TritonBackend

        return TritonBackend(model)  # raises ValueError where it cannot run
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {list(BACKEND_NAMES)}, got {name!r}")
    if name == "torch":
        return TorchBackend()
    par = model.parallel
    # The native kernels compute whole layers: one process, or the tensor/expert-parallel ranks
    # of one host, which sum their partial products inside the fused blocks over shared memory
    # (kernels/tp_comm.py). Pipeline stages and ranks across hosts run torch.
    if par.world_size > 1 and not (par.pp_size == 1 and par.comm is not None):
        if name == "cpu":
            raise ValueError(
                "backend='cpu' runs one process or the tensor-parallel ranks of one host (no pipeline "
                "parallelism); use backend='torch' or 'auto'"
            )
        return TorchBackend()
    from ..kernels import cpu
    from .cpu_backend import CpuBackend

    if name == "auto" and (model.device.type != "cpu" or cpu.native_ops() is None):
        return TorchBackend()
    return CpuBackend(model)


__all__ = ["BACKEND_NAMES", "Backend", "BackendName", "TorchBackend", "select_backend"]
