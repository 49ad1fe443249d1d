"""The cpu backend's argument caches: what the fused ops take from the model, built once and
reused while the model's tensors stay as they were.

A decode step calls four fused ops per layer, each with 10-25 arguments read from the
layer's modules. Reading them afresh costs 10-30 µs of Python per call (nn.Module attribute
lookups, the derived fp32 gains, the weight arguments' checks): ~0.5 ms of a ~9 ms bf16
batch-1 token on bench-small. So:

* `WeightArgs` holds each linear's and each expert set's weight argument
  (kernels/cpu_block.h `weight_arg`), with its packed panels where the kernels read them.
* `StepArgs` holds each (op, layer) argument tuple, with a fingerprint of the tensors it was
  built from; a call checks the fingerprint (a few µs) instead of rebuilding.

Both are rebuilt when a tensor moved or changed: a parameter, buffer or submodule replaced
(`module.weight = ...`), a tensor moved (`.to()`, which also resets the derived gains), or
written in place (`load_state_dict`, `copy_`; seen through the tensor's version counter,
which inference tensors do not keep: those must not be written in place). Plain attributes
(eps, head counts, routing constants) are read at build time only: they are part of the
architecture and never change after construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..kernels import cpu
from ..quant.nvfp4 import Nvfp4Experts, Nvfp4Linear


def _version(t: torch.Tensor) -> int | None:
    """The in-place write counter (None for inference tensors, which keep none)."""
    return None if t.is_inference() else t._version


# One check of a fingerprint: `container[name] is obj`, and for a tensor, its address and
# version as they were.
_Check = tuple[dict, str, Any, "int | None", "int | None"]


def fingerprint(owner: nn.Module, children: tuple[str, ...] | None = None) -> list[_Check]:
    """The checks that hold while `owner`'s named `children` (all of it when None) are the
    same modules, and every parameter, buffer and submodule under them is the same object,
    at the same address, unwritten."""
    checks: list[_Check] = []
    roots: list[nn.Module] = [owner]
    if children is not None:
        roots = [owner._modules[n] for n in children]
        checks += [(owner._modules, n, r, None, None) for n, r in zip(children, roots)]
    for root in roots:
        for m in root.modules():
            for d in (m._parameters, m._buffers, m._modules):
                for name, obj in d.items():
                    if isinstance(obj, torch.Tensor):
                        checks.append((d, name, obj, obj.data_ptr(), _version(obj)))
                    else:
                        checks.append((d, name, obj, None, None))
    return checks


def unchanged(checks: list[_Check]) -> bool:
    """Whether every check of a `fingerprint` still holds."""
    for d, name, obj, ptr, version in checks:
        if d.get(name) is not obj:
            return False
        if ptr is not None and (obj.data_ptr() != ptr or (version is not None and obj._version != version)):
            return False
    return True


# Module-tree changes anywhere in the process: a parameter, buffer or submodule registered,
# replaced or set to None (nn.Module.__setattr__ and register_* call torch's global
# registration hooks), counted once `count_structure_changes` has installed the hooks. The
# decode plan (cpu_decode.py) compares this count instead of walking the model every step.
_structure_changes = 0
_hooks_installed = False


def _changed(*_: Any) -> None:
    global _structure_changes
    _structure_changes += 1


def count_structure_changes() -> int:
    """The count of module-tree changes since the hooks were installed (here, at the first call)."""
    global _hooks_installed
    if not _hooks_installed:
        for register in (
            nn.modules.module.register_module_parameter_registration_hook,
            nn.modules.module.register_module_buffer_registration_hook,
            nn.modules.module.register_module_module_registration_hook,
        ):
            register(_changed)
        _hooks_installed = True
    return _structure_changes


def _still_valid(hit: tuple | None, owner: nn.Module, panels: bool) -> bool:
    """Whether a cache entry (owner, panels, checks, args) was made for this owner and path
    and its fingerprint still holds."""
    return hit is not None and hit[0] is owner and hit[1] == panels and unchanged(hit[2])


class WeightArgs:
    """The fused ops' weight arguments (kernels/cpu_block.h `weight_arg`) of each module.

    On the AVX-512-BF16 path a dense bf16 linear's argument is [weight, panels]: the weight
    packed once more (`cpu.pack_panels`, as many bytes again) for the panel kernel, which
    then multiplies every row of it, prompt or decode, 1.1-2x faster than the dot-product
    kernel (benchmarks/RESULTS.md, session 10). bf16 experts [E, N, K] are packed likewise
    when `pack_experts` (the backend's choice, `cpu.expert_panels`: they are most of a MoE
    model, so that holds it nearly twice). The panels are made at a weight's first use (the
    first step), not at load, which keeps one copy of the weights (tests/test_load_memory.py).
    `panels` follows the kernels' path (`refresh`, once per step)."""

    def __init__(self, ops: Any, pack_experts: bool = False) -> None:
        self.ops = ops
        self.pack_experts = pack_experts
        self._cache: dict[int, tuple[nn.Module, bool, list[_Check], Any]] = {}
        self.refresh()

    def refresh(self) -> None:
        self.panels = self.ops.isa_path() in cpu.PANEL_PATHS

    def _get(self, module: nn.Module, names: tuple[str, ...], build: Callable[..., Any]) -> Any:
        hit = self._cache.get(id(module))
        if _still_valid(hit, module, self.panels):
            return hit[3]
        args = build(*(getattr(module, n) for n in names))
        self._cache[id(module)] = (module, self.panels, fingerprint(module), args)
        return args

    def _dense(self, w: torch.Tensor) -> list[torch.Tensor]:
        if self.panels and w.dtype == torch.bfloat16 and w.shape[-1] % 2 == 0 and (w.dim() == 2 or self.pack_experts):
            return [w, cpu.pack_panels(w)]
        return [w]

    def linear(self, linear: nn.Module) -> list[torch.Tensor]:
        if isinstance(linear.format, Nvfp4Linear):
            return self._get(
                linear,
                ("weight", "weight_scale", "weight_scale_2"),
                lambda w, s, g: [w, s.view(torch.uint8), g.reshape(1)],
            )
        return self._get(linear, ("weight",), self._dense)

    def experts(self, experts: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """gate|up and down (NVFP4: gate|up has two global scales per expert, down one)."""
        if isinstance(experts.format, Nvfp4Experts):
            names = (
                "gate_up_proj",
                "gate_up_proj_weight_scale",
                "gate_up_proj_weight_scale_2",
                "down_proj",
                "down_proj_weight_scale",
                "down_proj_weight_scale_2",
            )
            return self._get(
                experts,
                names,
                lambda gu, gus, gug, d, ds, dg: ([gu, gus.view(torch.uint8), gug], [d, ds.view(torch.uint8), dg]),
            )
        return self._get(experts, ("gate_up_proj", "down_proj"), lambda gu, d: (self._dense(gu), self._dense(d)))


class StepArgs:
    """Each (op, owner) argument tuple, reused while the owner's children it was built from
    are unchanged (`fingerprint`) and the weight arguments' path (`WeightArgs.panels`) is the
    same. `get(op, owner, build)`: `build()` returns the tuple and the names of the owner's
    children it read (each op names its own, so a call checks only those)."""

    def __init__(self, weights: WeightArgs) -> None:
        self.weights = weights
        self._cache: dict[tuple[str, int], tuple[nn.Module, bool, list[_Check], tuple]] = {}

    def get(self, op: str, owner: nn.Module, build: Callable[[], tuple[tuple, tuple[str, ...]]]) -> tuple:
        hit = self._cache.get((op, id(owner)))
        panels = self.weights.panels
        if _still_valid(hit, owner, panels):
            return hit[3]
        args, children = build()
        # The fingerprint is taken after building: building materializes derived buffers.
        self._cache[(op, id(owner))] = (owner, panels, fingerprint(owner, children), args)
        return args

    def checks(self, op: str, owner: nn.Module) -> list[_Check]:
        """The fingerprint of the tuple `get(op, owner, ...)` returned last: while it holds,
        `get` returns that same tuple (the decode plan, cpu_decode.py, holds it)."""
        return self._cache[(op, id(owner))][2]
