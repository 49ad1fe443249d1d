"""musespark.heap: glibc keeps a step's freed activation buffers for the next step."""

import os
import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="musespark.heap tunes glibc's malloc; this platform has no glibc")

# In a fresh interpreter (the settings are process-wide): the allocations of a prompt step's
# layer (q, k, v, gate, attention output, two new streams, of 1-8 MiB, freed in another order),
# 12 layers to warm up, then the minor page faults of 24 more. glibc's defaults unmap or trim
# such blocks when they are freed, so every layer faults its pages in again; kept in the heap,
# none does.
_PROBE = """
import resource, torch
from musespark import heap
state = heap.keep_freed_memory()
assert heap.describe() == state and heap.keep_freed_memory() == state  # once per process
def layer(s):
    q, k, v, g = (torch.empty(n).fill_(1.0) for n in (1 << 20, 1 << 18, 1 << 18, 1 << 20))
    o = torch.empty(1 << 20).fill_(1.0)
    del q, k, v
    s = torch.empty(2 << 20).fill_(1.0)
    del o, g
    return torch.empty(2 << 20).fill_(1.0)
s = torch.empty(2 << 20)
for _ in range(12):
    s = layer(s)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(24):
    s = layer(s)
print(state)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(**env: str) -> tuple[str, int]:
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stderr
    state, faults = run.stdout.split("\n")[:2]
    return state, int(faults)


@glibc
def test_prompt_sized_activations_fault_no_pages_once_warm():
    state, faults = _probe()
    assert state == "on (mmap threshold 32 MiB, trim threshold 256 MiB)"
    assert faults < 100, faults  # glibc alone: tens of thousands (the test below)


@glibc
def test_keep_heap_0_leaves_malloc_alone():
    state, faults = _probe(MUSESPARK_KEEP_HEAP="0")
    assert state == "off (MUSESPARK_KEEP_HEAP=0)"
    assert faults > 10_000, faults  # glibc's own behaviour: the probe above can tell the two apart
