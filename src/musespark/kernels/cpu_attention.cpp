// Paged decode attention on x86 CPUs with AVX2+FMA: one query per sequence, keys and
// values read in place from the block-paged cache (no gather, no mask tensor).
//
// q [B, nH, D] fp32; k_cache, v_cache [num_blocks, block_size, nKV, D] (bf16 or fp32);
// block_tables [B, max_blocks] int64; seq_lens [B] int64. Sequence b's query sits at
// position seq_lens[b] - 1 and sees keys at positions [max(0, pos - window + 1), pos]
// (window 0: all). Head h reads KV head h / (nH / nKV). Scores and the softmax are fp32,
// exactly softmax(scale * q.k) @ v; the result is fp32 [B, nH, D]. D % 8 == 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_simd.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

using musespark_simd::hsum;
using musespark_simd::load8;

template <typename T>
void attend(const float* q, int64_t G, int64_t D, const T* k_cache, const T* v_cache, int64_t slot_stride,
            const int64_t* table, int64_t block_size, int64_t first, int64_t last, float scale, float* out) {
  const int64_t L = last - first + 1;
  std::vector<float> scores(static_cast<size_t>(G * L));
  std::vector<int64_t> slots(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    const int64_t p = first + i;
    slots[i] = table[p / block_size] * block_size + p % block_size;
  }
  for (int64_t i = 0; i < L; ++i) {
    const T* key = k_cache + slots[i] * slot_stride;
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), load8(key + d), acc);
      scores[g * L + i] = hsum(acc) * scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * L;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < L; ++i) m = std::max(m, s[i]);
    float total = 0.f;
    for (int64_t i = 0; i < L; ++i) {
      s[i] = std::exp(s[i] - m);
      total += s[i];
    }
    const float inv = 1.f / total;
    for (int64_t i = 0; i < L; ++i) s[i] *= inv;
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* s = scores.data() + g * L;
    for (int64_t d = 0; d < D; d += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < L; ++i)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(s[i]), load8(v_cache + slots[i] * slot_stride + d), acc);
      _mm256_storeu_ps(out + g * D + d, acc);
    }
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_decode_attention: q must be contiguous float32 [B, nH, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: k_cache/v_cache must be contiguous [num_blocks, block_size, nKV, D] alike");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: block_tables and seq_lens must be contiguous int64");
  const int64_t B = q.size(0), nH = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), nKV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0 && nH % nKV == 0,
              "paged_decode_attention: head_dim must match and be a multiple of 8; nH divisible by nKV");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "paged_decode_attention: batch sizes differ");
  const int64_t G = nH / nKV, max_blocks = block_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && (lens[b] - 1) / block_size < max_blocks,
                "paged_decode_attention: seq_lens[", b, "]=", lens[b], " does not fit the block table");
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t slot_stride = nKV * D;
  const float s = static_cast<float>(scale);
  auto run = [&](auto* kc, auto* vc) {
    at::parallel_for(0, B * nKV, 1, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t b = w / nKV, h = w % nKV;
        const int64_t last = lens[b] - 1;
        const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
        attend(qp + (b * nH + h * G) * D, G, D, kc + h * D, vc + h * D, slot_stride, tables + b * max_blocks,
               block_size, first, last, s, op + (b * nH + h * G) * D);
      }
    });
  };
  if (k_cache.scalar_type() == at::kBFloat16)
    run(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else if (k_cache.scalar_type() == at::kFloat)
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else
    TORCH_CHECK(false, "paged_decode_attention: the cache must be bfloat16 or float32");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
