// What this CPU can run (common/isa.h), batch invariance, and the ops that choose the kernel
// path: `set_isa`, `isa_path`, `set_batch_invariant`.
#include "isa.h"

#include <cpuid.h>
#include <torch/library.h>

#include <atomic>
#include <string>

#include "../gemm/gemm_kernels.h"
#include "dispatch.h"

namespace musespark_isa {

namespace {
std::atomic<bool> invariant{true};

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool cpu_has_avx512_bf16() { return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16"); }

// AMX-TILE and AMX-BF16 in CPUID (leaf 7: EDX bits 24 and 22), their state enabled by the OS
// (XCR0 bits 17-18), and this process allowed to use it.
bool cpu_has_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (!__get_cpuid(1, &a1, &b1, &c1, &d1) || !(c1 & (1u << 27))) return false;  // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & (3u << 17)) == (3u << 17) && musespark_amx::request_permission();
}
}  // namespace

bool cpu_runs(int path) {
  using namespace musespark_dispatch;
  switch (path) {
    case kAvx2: return true;
    case kAvx512: return cpu_has_avx512();
    case kAvx512Bf16:
    case kAmxEmulated: return cpu_has_avx512_bf16();
    case kAmxBf16: return cpu_has_avx512_bf16() && cpu_has_amx();
    default: return false;
  }
}

bool batch_invariant() { return invariant.load(std::memory_order_relaxed); }
void set_batch_invariant(bool on) { invariant.store(on, std::memory_order_relaxed); }

}  // namespace musespark_isa

namespace {

// The kernels' code path (common/dispatch.h): "avx2", "avx512", "avx512_bf16", "amx_bf16", or
// "amx_emulated" (the amx_bf16 path with its tile instructions modelled in software: tests
// only). Returns the path now in use.
std::string set_isa(const std::string& path) {
  const musespark_dispatch::Path want = musespark_dispatch::path_named(path.c_str());
  TORCH_CHECK(want != musespark_dispatch::kPaths,
              "set_isa: expected 'avx2', 'avx512', 'avx512_bf16', 'amx_bf16' or 'amx_emulated', got '", path, "'");
  TORCH_CHECK(musespark_isa::cpu_runs(want), "set_isa: this CPU cannot run the ", path, " kernels");
  musespark_dispatch::set_path(want);
  return path;
}

std::string isa_path() { return musespark_dispatch::kernels().name; }

// Batch invariance on or off (common/isa.h); returns the previous setting.
bool set_batch_invariant(bool on) {
  const bool before = musespark_isa::batch_invariant();
  musespark_isa::set_batch_invariant(on);
  return before;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("set_isa(str path) -> str", &set_isa);  // no tensor arguments: catch-all kernels
  m.def("isa_path() -> str", &isa_path);
  m.def("set_batch_invariant(bool on) -> bool", &set_batch_invariant);
}
