// `prefill_attention(q, k, v, q_start, k_start, window, scale)`: the rows of one prefill
// chunk attending over their keys, on paths with a prompt attention kernel (common/dispatch.h:
// avx512_bf16, and amx with tiles for head dims that fit them; elsewhere the caller keeps SDPA).
//
// q [n, nH, D] bf16: query t sits at position q_start + t; k, v [m, nKV, D] bf16: key i at
// position k_start + i (the sequence's reachable keys, gathered in order). Query t sees the
// keys at positions in (pos - window, pos] (window 0: all up to pos). Head h reads KV head
// h / (nH / nKV). Scores q.k in fp32 (bf16 products are exact), times `scale`; online
// softmax in fp32 (exp: the Cephes polynomial, ~1e-7); the weights P are rounded to bf16
// for the P V product (as flash attention does for bf16), the normalizer sums the same
// rounded weights; the output is rounded once to bf16. D: a multiple of 16 up to 128, or 256.
// A row that reaches no key (never in the engine: a query sees itself) gets zeros.
//
// Each row is computed alone over its keys in order, 32 at a time from a multiple of 16
// (the online softmax's max rises once per 32 keys), so its result does not depend on the
// other rows of the chunk.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/dispatch.h"
#include "../common/pool.h"

#include <cstring>
#include <vector>

namespace {

// K packed for Q K^T: per block of 16 keys and per pair of dimensions j, 16 lanes of
// (k[2j], k[2j+1]); V packed for P V: per pair of keys and per 16 dimensions, 16 lanes of
// (v_key0[d], v_key1[d]). Keys past m are zeros.
void pack(const uint16_t* k, const uint16_t* v, int64_t m, int64_t nKV, int64_t D, int64_t h, uint16_t* kp,
          uint16_t* vp) {
  const int64_t blocks = (m + 15) / 16, pairs = D / 2, chunks = D / 16;
  std::memset(kp, 0, blocks * 16 * D * sizeof(uint16_t));
  std::memset(vp, 0, blocks * 16 * D * sizeof(uint16_t));
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t* kr = k + (i * nKV + h) * D;
    const uint16_t* vr = v + (i * nKV + h) * D;
    const int64_t b = i / 16, lane = i % 16;
    for (int64_t j = 0; j < pairs; ++j) {
      kp[((b * pairs + j) * 16 + lane) * 2] = kr[2 * j];
      kp[((b * pairs + j) * 16 + lane) * 2 + 1] = kr[2 * j + 1];
    }
    const int64_t pair = i / 2, which = i % 2;
    for (int64_t d = 0; d < D; ++d) vp[((pair * chunks + d / 16) * 16 + d % 16) * 2 + which] = vr[d];
  }
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_start,
                             int64_t k_start, int64_t window, double scale) {
  const musespark_dispatch::Kernels& kernels = musespark_dispatch::kernels();
  TORCH_CHECK(kernels.prefill_rows != nullptr, "prefill_attention: needs the avx512_bf16 kernel path");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.scalar_type() == at::kBFloat16 &&
                  k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prefill_attention: q [n, nH, D], k and v [m, nKV, D] must be bfloat16");
  const int64_t n = q.size(0), nH = q.size(1), D = q.size(2), m = k.size(0), nKV = k.size(1);
  TORCH_CHECK(k.size(2) == D && D % 16 == 0 && (D <= 128 || D == 256) && nKV > 0 && nH % nKV == 0,
              "prefill_attention: head_dim must match and be a multiple of 16 up to 128, or 256; nH divisible by nKV");
  TORCH_CHECK(window >= 0 && q_start >= 0 && k_start >= 0, "prefill_attention: negative position or window");
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto out = musespark_pool::empty({n, nH, D}, q.options());
  if (n == 0) return out;
  // Keys packed to a multiple of 32 (zeros past m): the AMX kernel reads blocks of 32.
  const int64_t G = nH / nKV, blocks = (m + 31) / 32 * 2, per_head = blocks * 16 * D;
  std::vector<uint16_t> kp(nKV * per_head), vp(nKV * per_head);
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  const auto* kptr = reinterpret_cast<const uint16_t*>(kc.data_ptr<at::BFloat16>());
  const auto* vptr = reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, nKV, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) pack(kptr, vptr, m, nKV, D, h, kp.data() + h * per_head, vp.data() + h * per_head);
  });
  constexpr int64_t kTokens = 32;  // tokens of one head per task
  const int64_t tasks_per_head = (n + kTokens - 1) / kTokens;
  const bool tiles = kernels.prefill_rows_tiles != nullptr && kernels.prefill_tiles_fit(D);
  const musespark_dispatch::PrefillRows rows = tiles ? kernels.prefill_rows_tiles : kernels.prefill_rows;
  const bool scope = tiles && kernels.tiles_begin != nullptr;  // the tile configuration once per thread
  at::parallel_for(0, nH * tasks_per_head, 1, [&](int64_t w0, int64_t w1) {
    if (scope) kernels.tiles_begin();
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t head = w / tasks_per_head, t0 = (w % tasks_per_head) * kTokens;
      const int64_t t1 = std::min(n, t0 + kTokens), h = head / G;
      rows(qp, nH, D, head, kp.data() + h * per_head, vp.data() + h * per_head, m, q_start, k_start, window,
           static_cast<float>(scale), t0, t1, op);
    }
    if (scope) kernels.tiles_end();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, int q_start, int k_start, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
}
