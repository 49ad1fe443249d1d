"""`python -m musespark.kernels`: build (or find cached) the native CPU kernels now."""

import time

from .. import env, hugepages
from ..cpu_features import detected_isa, isa
from .cpu import amx_unusable_reason, batch_invariant, cache_dir, kernel_path, native_ops

start = time.perf_counter()
ops = native_ops()
print(
    f"musespark CPU kernels: {'ready' if ops is not None else 'unavailable'} "
    f"({time.perf_counter() - start:.1f} s, {cache_dir()})"
)
print(
    f"ISA: detected {detected_isa()}, allowed {isa()}; kernel path {kernel_path()}; "
    f"batch invariant {'yes' if batch_invariant() else f'no ({env.BATCH_INVARIANT}=0)'}"
)
if amx_unusable_reason():
    print(f"AMX tiles unused: {amx_unusable_reason()}")
print(
    f"expert panels (avx512_bf16 path): {env.EXPERT_PANELS}={env.expert_panels()} "
    "(auto: packed when the copy fits in a quarter of the available memory)"
)
print(f"huge pages for the weights: {hugepages.describe()}")
