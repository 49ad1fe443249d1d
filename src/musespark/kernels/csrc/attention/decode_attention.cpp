// Paged decode attention: one query per sequence, keys and values read in place from the
// block-paged cache (no gather, no mask tensor). The ops and the split of the work; the
// kernels are attention/decode_avx2.cpp and the dispatch table's decode_attention.
//
// q [B, nH, D] fp32; k_cache, v_cache [num_blocks, block_size, nKV, D] (bf16, fp32, or float8
// e4m3 read as stored, the fp8 KV cache's scale 1.0: layers/kv_quant.py; through the AVX2
// kernel);
// block_tables [B, max_blocks] int64; seq_lens [B] int64. Sequence b's query sits at
// position seq_lens[b] - 1 and sees keys at positions [max(0, pos - window + 1), pos]
// (window 0: all). Head h reads KV head h / (nH / nKV). Scores and the softmax are fp32:
// softmax(scale * q.k) @ v, exp by a polynomial good to ~1e-7 relative; the result is
// fp32 [B, nH, D]. D % 8 == 0. `paged_decode_step` is the same attention for a decode step
// of one layer in one call: it first writes the step's keys and values into the cache, takes
// q in the cache's dtype (bf16 or fp32; either over an fp8 cache) and returns q's dtype.
//
// Dispatch (common/dispatch.h): on paths with a decode_attention kernel (avx512_bf16, amx), a
// bf16 cache whose queries hold bf16 values (a bf16 model's) takes it where decode_fits
// (musespark_avx512::decode_attention, D % 32 == 0): Q K^T by
// vdpbf16ps (each product exact, fp32 sums in another fixed order), a 16-lane softmax, and
// P V by fp32 FMAs in key order, normalized at the end. Each row's result still depends on
// nothing else in the batch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/dispatch.h"
#include "../common/ops.h"
#include "../common/simd.h"
#include "decode_avx2.h"

namespace {

using musespark_attention::attend_head;

// A work unit's cost beyond its keys (setup, softmax, output), counted as this many keys.
constexpr int64_t kUnitFixedKeys = 16;

// Sequence b's query row (nH * D values) as bf16 bits when the AVX-512 kernel takes it:
// a bf16 cache and every value of the row a bf16 value (a bf16 model's). Decided per
// sequence, never per work unit, so a row's path does not depend on the batch.
inline bool bf16_query(const float* q, int64_t n, std::vector<uint16_t>& out) {
  out.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const at::BFloat16 b(q[i]);
    if (static_cast<float>(b) != q[i]) return false;
    out[i] = b.x;
  }
  return true;
}

// One sequence's nh adjacent KV heads (their G query heads each) over its keys at
// positions [first, last]: the AVX-512 kernel when `qb` (those heads' queries as bf16 bits)
// is given, else attend_head per head. Each head's result is the same whatever nh.
template <typename T>
void attend(const float* q, const uint16_t* qb, int64_t nh, int64_t G, int64_t D, const T* k_cache,
            const T* v_cache, int64_t slot_stride, const int64_t* table, int64_t block_size, int64_t first,
            int64_t last, float scale, float* out) {
  const int64_t L = last - first + 1;
  std::vector<float> scores(static_cast<size_t>(nh * G * L));
  std::vector<int64_t> slots(static_cast<size_t>(L));
  for (int64_t p = first, i = 0; p <= last;) {  // block by block: one division per block
    const int64_t base = table[p / block_size] * block_size - p / block_size * block_size;
    const int64_t end = std::min(last + 1, (p / block_size + 1) * block_size);
    for (; p < end; ++p, ++i) slots[i] = base + p;
  }
  if (qb != nullptr) {
    musespark_dispatch::kernels().decode_attention(qb, nh, G, D, reinterpret_cast<const uint16_t*>(k_cache),
                                                   reinterpret_cast<const uint16_t*>(v_cache), slot_stride,
                                                   slots.data(), L, scale, scores.data(), out);
    return;
  }
  for (int64_t h = 0; h < nh; ++h)
    attend_head(q + h * G * D, G, D, k_cache + h * D, v_cache + h * D, slot_stride, slots.data(), L, scale,
                scores.data(), out + h * G * D);
}

// The arguments both ops share: caches, block tables and lengths that fit each other, and
// every block a query reaches (its window's) inside the cache.
void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, int64_t window, int64_t B, int64_t nH, int64_t D, const char* op) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              op, ": k_cache/v_cache must be contiguous [num_blocks, block_size, nKV, D] alike");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kFloat ||
                  k_cache.scalar_type() == at::kFloat8_e4m3fn,
              op, ": the cache must be bfloat16, float32 or float8_e4m3fn");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && seq_lens.dim() == 1 && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous(),
              op, ": block_tables [B, max_blocks] and seq_lens [B] must be contiguous int64");
  const int64_t block_size = k_cache.size(1), nKV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0 && nH % nKV == 0, op,
              ": head_dim must match and be a multiple of 8; nH divisible by nKV");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, op, ": batch sizes differ");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1), num_blocks = k_cache.size(0);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && (lens[b] - 1) / block_size < max_blocks, op, ": seq_lens[", b, "]=", lens[b],
                " does not fit the block table");
    const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    for (int64_t j = first / block_size; j <= (lens[b] - 1) / block_size; ++j)
      TORCH_CHECK(tables[b * max_blocks + j] >= 0 && tables[b * max_blocks + j] < num_blocks, op,
                  ": block_tables[", b, ", ", j, "]=", tables[b * max_blocks + j], " is not a block of the cache");
  }
}

// The kernel behind both ops: q [B, nH, D] fp32, or bf16 (then the AVX-512 kernel reads its
// bits directly; the AVX2 kernel widens each sequence's row) -> fp32 [B, nH, D].
at::Tensor decode_core(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window, double scale) {
  const int64_t B = q.size(0), nH = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), nKV = k_cache.size(2);
  const int64_t G = nH / nKV, max_blocks = block_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  auto out = at::empty({B, nH, D}, q.options().dtype(at::kFloat));
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  const float* qp = q_bf16 ? nullptr : q.data_ptr<float>();
  const uint16_t* q16 = q_bf16 ? reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()) : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t slot_stride = nKV * D;
  const float s = static_cast<float>(scale);
  auto run = [&](auto* kc, auto* vc) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
    const musespark_dispatch::Kernels& kernels = musespark_dispatch::kernels();
    const bool avx512 = std::is_same_v<T, at::BFloat16> && kernels.decode_attention != nullptr &&
                        kernels.decode_fits(D, nH);
    // Work units: whole sequences (their KV heads' rows are adjacent in the cache: one
    // stream) when there are enough of them for the threads, else (sequence, KV head) pairs.
    // Each thread takes a run of units of near-equal cost (keys read + kUnitFixedKeys), so
    // short and long sequences spread evenly; where a unit runs never changes its result.
    const int64_t threads = at::get_num_threads();
    const int64_t nh = B >= 2 * threads ? nKV : 1, units = nKV / nh;
    auto reach = [&](int64_t b) {  // [first, last] key positions of sequence b
      const int64_t last = lens[b] - 1;
      return std::make_pair(window > 0 ? std::max<int64_t>(0, last - window + 1) : 0, last);
    };
    std::vector<int64_t> bounds{0};
    int64_t total = 0, done = 0;
    for (int64_t b = 0; b < B; ++b) total += (reach(b).second - reach(b).first + 1 + kUnitFixedKeys) * units;
    for (int64_t w = 0; w < B * units && static_cast<int64_t>(bounds.size()) < threads; ++w) {
      const auto [first, last] = reach(w / units);
      done += last - first + 1 + kUnitFixedKeys;
      if (done * threads >= total * static_cast<int64_t>(bounds.size())) bounds.push_back(w + 1);
    }
    while (static_cast<int64_t>(bounds.size()) <= threads) bounds.push_back(B * units);
    at::parallel_for(0, threads, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> widened;
      std::vector<uint16_t> qb;
      for (int64_t w = bounds[p0]; w < bounds[p1]; ++w) {
        const int64_t b = w / units, h = (w % units) * nh;
        const auto [first, last] = reach(b);
        const float* qrow = qp ? qp + b * nH * D : nullptr;
        const uint16_t* qbits = nullptr;
        if (q16 != nullptr) {  // a bf16 query: its own bits, or widened for the AVX2 kernel
          if (avx512) {
            qbits = q16 + b * nH * D;
          } else {
            widened.resize(static_cast<size_t>(nH * D));
            for (int64_t i = 0; i < nH * D; ++i) widened[i] = musespark_simd::bf16_to_float(q16[b * nH * D + i]);
            qrow = widened.data();
          }
        } else if (avx512 && bf16_query(qrow, nH * D, qb)) {
          qbits = qb.data();
        }
        attend(qrow ? qrow + h * G * D : nullptr, qbits ? qbits + h * G * D : nullptr, nh, G, D, kc + h * D,
               vc + h * D, slot_stride, tables + b * max_blocks, block_size, first, last, s,
               op + (b * nH + h * G) * D);
      }
    });
  };
  if (k_cache.scalar_type() == at::kBFloat16)
    run(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else if (k_cache.scalar_type() == at::kFloat8_e4m3fn)
    run(k_cache.data_ptr<c10::Float8_e4m3fn>(), v_cache.data_ptr<c10::Float8_e4m3fn>());
  else
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_decode_attention: q must be contiguous float32 [B, nH, D]");
  check_cache(k_cache, v_cache, block_tables, seq_lens, window, q.size(0), q.size(1), q.size(2),
              "paged_decode_attention");
  return decode_core(q, k_cache, v_cache, block_tables, seq_lens, window, scale);
}

}  // namespace

namespace musespark_ops {  // entry point: common/ops.h

namespace {
// Rows x [B, n] (bf16 or fp32) into the fp8 cache rows `slot` (n values each), as
// layers/kv_quant.py's to_cache does: saturated at +-448, then rounded to nearest even (c10's
// conversion, the one torch's cast uses), scale 1.0.
void write_fp8(const at::Tensor& x, at::Tensor& cache, const int64_t* slot, int64_t B, int64_t n) {
  auto* dst = cache.data_ptr<c10::Float8_e4m3fn>();
  auto put = [&](auto* src) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n; ++i)
        dst[slot[b] * n + i] = c10::Float8_e4m3fn(std::clamp(static_cast<float>(src[b * n + i]), -448.f, 448.f));
  };
  if (x.scalar_type() == at::kBFloat16)
    put(x.data_ptr<at::BFloat16>());
  else
    put(x.data_ptr<float>());
}
}  // namespace

// One decode step of a layer in one call: the new keys and values k, v [B, nKV, D] (q's dtype)
// are written at slot_mapping [B] (flat slot = block * block_size + offset; into an fp8 cache
// saturated and rounded as layers/kv_quant.py's to_cache), then every sequence's query q
// [B, nH, D] (the cache's dtype, or bf16/fp32 over an fp8 cache) attends as in
// paged_decode_attention; the result is q's dtype (bf16: rounded once from fp32).
at::Tensor paged_decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                             at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, int64_t window, double scale) {
  const char* op = "paged_decode_step";
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() &&
                  (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat) &&
                  (fp8 || q.scalar_type() == k_cache.scalar_type()),
              op, ": q must be contiguous [B, nH, D] in the cache's dtype (bf16 or fp32; any of them for fp8)");
  const int64_t B = q.size(0), nH = q.size(1), D = q.size(2);
  check_cache(k_cache, v_cache, block_tables, seq_lens, window, B, nH, D, op);
  const int64_t nKV = k_cache.size(2), slots = k_cache.size(0) * k_cache.size(1);
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == nKV && t->size(2) == D && t->is_contiguous() &&
                    t->scalar_type() == q.scalar_type(),
                op, ": k and v must be contiguous [B, nKV, D] in q's dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == B && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous(),
              op, ": slot_mapping must be contiguous int64 [B]");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < slots, op, ": slot_mapping[", b, "]=", slot[b], " is outside the cache");
  if (fp8) {
    write_fp8(k, k_cache, slot, B, nKV * D);
    write_fp8(v, v_cache, slot, B, nKV * D);
  } else {
    const int64_t row = nKV * D * static_cast<int64_t>(k.element_size());
    auto* kc = static_cast<char*>(k_cache.data_ptr());
    auto* vc = static_cast<char*>(v_cache.data_ptr());
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(kc + slot[b] * row, static_cast<const char*>(k.data_ptr()) + b * row, static_cast<size_t>(row));
      std::memcpy(vc + slot[b] * row, static_cast<const char*>(v.data_ptr()) + b * row, static_cast<size_t>(row));
    }
  }
  at::Tensor out = decode_core(q, k_cache, v_cache, block_tables, seq_lens, window, scale);
  if (q.scalar_type() == at::kFloat) return out;
  auto rounded = at::empty({B, nH, D}, q.options());
  musespark_simd::to_bf16_bits(out.data_ptr<float>(), reinterpret_cast<uint16_t*>(rounded.data_ptr<at::BFloat16>()),
                               out.numel());
  return rounded;
}

}  // namespace musespark_ops

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "int window, float scale) -> Tensor");
  m.def("paged_decode_step(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_step", &musespark_ops::paged_decode_step);
}
