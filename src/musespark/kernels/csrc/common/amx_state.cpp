// The AMX tile state of a process and its threads (gemm/gemm_kernels.h declares it): Linux's
// permission to use the tiles, and each thread's tile configuration in nested scopes.
// Compiled for AVX-512 as the tile kernels are (the tile primitives of common/amx_tiles.h);
// reached only on the amx_bf16 path (common/dispatch.h) or through common/isa.cpp's check.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../gemm/gemm_kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,prfchw")

#include "amx_tiles.h"

namespace musespark_amx {
namespace {

thread_local int tile_depth = 0;  // open tiles_begin scopes of this thread

}  // namespace

void tiles_begin() {
  if (tile_depth++ == 0) Hardware::configure();
}

void tiles_end() {
  if (--tile_depth == 0) Hardware::release();
}

bool request_permission() {
  // Linux (5.16+) hands out the tile data state per process on request
  // (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18); without it a tile instruction
  // faults. Asked once; the answer is kept.
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

}  // namespace musespark_amx
