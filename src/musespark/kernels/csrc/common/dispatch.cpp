// The dispatch table (common/dispatch.h): one row per kernel path, one entry per operation.
#include "dispatch.h"

#include <atomic>
#include <cstring>

#include "../attention/attention_kernels.h"
#include "../gemm/gemm_kernels.h"
#include "../nvfp4/nvfp4.h"

namespace musespark_dispatch {
namespace {

namespace avx512 = musespark_avx512;
namespace amx = musespark_amx;

// Indexed by Path.
const Kernels kTable[kPaths] = {
    {
        "avx2",
        /*bf16_dots=*/nullptr,
        /*bf16_panels=*/nullptr,
        /*panel_superblocks=*/false,
        /*widened=*/nullptr,
        /*nvfp4_rows=*/musespark_nvfp4::rows,
        /*nvfp4_pairs=*/false,
        /*nvfp4_rows_bf16=*/nullptr,
        /*decode_fits=*/nullptr,
        /*decode_attention=*/nullptr,
        /*prefill_rows=*/nullptr,
        /*prefill_tiles_fit=*/nullptr,
        /*prefill_rows_tiles=*/nullptr,
        /*tiles_begin=*/nullptr,
        /*tiles_end=*/nullptr,
    },
    {
        "avx512",
        nullptr,
        nullptr,
        false,
        avx512::widened_rows,
        avx512::nvfp4_rows,
        true,
        nullptr,
        nullptr,  // decode attention: the AVX-512 kernel multiplies bf16 by vdpbf16ps
        nullptr,
        nullptr,
        nullptr,
        nullptr,
        nullptr,
        nullptr,
    },
    {
        "avx512_bf16",
        avx512::bf16_dots,
        avx512::bf16_panels,
        false,
        nullptr,
        avx512::nvfp4_rows,
        true,
        avx512::nvfp4_rows_bf16,
        avx512::decode_attention_fits,
        avx512::decode_attention,
        avx512::prefill_attention_rows,
        nullptr,
        nullptr,
        nullptr,
        nullptr,
    },
    {
        "amx_emulated",
        avx512::bf16_dots,
        amx::bf16_panels_emulated,
        true,
        nullptr,
        avx512::nvfp4_rows,
        true,
        avx512::nvfp4_rows_bf16,
        avx512::decode_attention_fits,
        avx512::decode_attention,
        avx512::prefill_attention_rows,
        amx::prefill_attention_fits,
        amx::prefill_attention_rows_emulated,
        nullptr,  // the software model keeps no tile state
        nullptr,
    },
    {
        "amx_bf16",
        avx512::bf16_dots,
        amx::bf16_panels,
        true,
        nullptr,
        avx512::nvfp4_rows,
        true,
        avx512::nvfp4_rows_bf16,
        avx512::decode_attention_fits,
        avx512::decode_attention,
        avx512::prefill_attention_rows,
        amx::prefill_attention_fits,
        amx::prefill_attention_rows,
        amx::tiles_begin,
        amx::tiles_end,
    },
};

std::atomic<const Kernels*> current{&kTable[kAvx2]};

}  // namespace

const Kernels& kernels() { return *current.load(std::memory_order_relaxed); }

Path path() { return static_cast<Path>(current.load(std::memory_order_relaxed) - kTable); }

void set_path(Path p) { current.store(&kTable[p], std::memory_order_relaxed); }

Path path_named(const char* name) {
  for (int p = 0; p < kPaths; ++p)
    if (std::strcmp(kTable[p].name, name) == 0) return static_cast<Path>(p);
  return kPaths;
}

}  // namespace musespark_dispatch
