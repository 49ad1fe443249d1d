"""`python -m musespark.kernels`: build (or find cached) the native CPU kernels now."""

import time

from .cpu import cache_dir, native_ops

start = time.perf_counter()
ops = native_ops()
print(f"musespark CPU kernels: {'ready' if ops is not None else 'unavailable'} "
      f"({time.perf_counter() - start:.1f} s, {cache_dir()})")
