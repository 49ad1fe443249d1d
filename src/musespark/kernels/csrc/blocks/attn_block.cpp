// Fused attention-side blocks `attn_in` and `attn_out` (see blocks/block.h).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../common/ops.h"
#include "../common/pool.h"
#include "../common/simd.h"
#include "../gemm/jobs.h"
#include "block.h"
#include "tp_comm.h"

#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace musespark_ops {  // entry points: common/ops.h

using namespace musespark_block;

// s [T, H] fp32 -> (q [T, nH, D], k [T, nKV, D], v [T, nKV, D], g [T, nH, D]) bf16 (fp32 when
// `bf16` is false: an fp32 model, every "bf16(...)" below is then the fp32 value itself):
//   h = bf16(rms(s) * gain);  q, k, v, g = bf16(h W^T);
//   q = bf16(rope(rms(q_head) * qk_scale)), k = bf16(rope(rms(k_head))) (no rope without cos/sin).
// `eps` is the model's rms_norm_eps (input norm and QK-norm).
std::tuple<Tensor, Tensor, Tensor, Tensor> attn_in(const Tensor& s, const Tensor& gain, double eps, at::TensorList q_proj,
                                                   at::TensorList k_proj, at::TensorList v_proj, at::TensorList gate_proj,
                                                   int64_t num_heads, int64_t num_kv_heads, double qk_scale,
                                                   const c10::optional<Tensor>& cos,
                                                   const c10::optional<Tensor>& sin, bool bf16,
                                                   const c10::optional<Tensor>& prompt_rows) {
  check_stream(s, "attn_in");
  const int64_t T = s.size(0), H = s.size(1);
  const uint8_t* prompt = musespark_gemv::prompt_flags(prompt_rows, T, "attn_in");
  const Weight wq = weight_arg(q_proj, false, "attn_in: q_proj"), wk = weight_arg(k_proj, false, "attn_in: k_proj"),
               wv = weight_arg(v_proj, false, "attn_in: v_proj"), wg = weight_arg(gate_proj, false, "attn_in: gate_proj");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && wq.N % num_heads == 0,
              "attn_in: q_proj rows must split into num_heads heads");
  const int64_t D = wq.N / num_heads, nH = num_heads, nKV = num_kv_heads;
  check_vector(gain, H, "attn_in: gain");
  check_shape(wq, nH * D, H, "attn_in: q_proj");
  check_shape(wk, nKV * D, H, "attn_in: k_proj");
  check_shape(wv, nKV * D, H, "attn_in: v_proj");
  check_shape(wg, nH * D, H, "attn_in: gate_proj");
  const bool rope = cos.has_value() && cos->defined();
  if (rope) {
    TORCH_CHECK(sin.has_value() && sin->defined() && D % 2 == 0, "attn_in: rotary needs cos and sin, even head_dim");
    for (const Tensor* c : {&cos.value(), &sin.value()})
      TORCH_CHECK(c->dim() == 2 && c->size(0) == T && c->size(1) == D && c->scalar_type() == at::kFloat &&
                      c->is_contiguous(),
                  "attn_in: cos/sin must be contiguous float32 [T, head_dim]");
  }
  const float e = static_cast<float>(eps);
  const float* h = pre_norm(s.data_ptr<float>(), T, H, gain.data_ptr<float>(), e, bf16);
  // One row of `proj` is [q | k | v | g].
  const int64_t W = (2 * nH + 2 * nKV) * D, ok = nH * D, ov = ok + nKV * D, og = ov + nKV * D;
  float* proj = scratch(kProj, T * W);
  run_jobs({wq.job(h, T, proj, W, bf16, 0, prompt), wk.job(h, T, proj + ok, W, bf16, 0, prompt),
            wv.job(h, T, proj + ov, W, bf16, 0, prompt), wg.job(h, T, proj + og, W, bf16, 0, prompt)});
  auto opts = s.options().dtype(bf16 ? at::kBFloat16 : at::kFloat);
  Tensor q = musespark_pool::empty({T, nH, D}, opts), k = musespark_pool::empty({T, nKV, D}, opts),
         v = musespark_pool::empty({T, nKV, D}, opts), g = musespark_pool::empty({T, nH, D}, opts);
  const float* cp = rope ? cos->data_ptr<float>() : nullptr;
  const float* sp = rope ? sin->data_ptr<float>() : nullptr;
  const float qs = static_cast<float>(qk_scale);
  // Out: at::BFloat16 (one rounding per stored value) or float.
  auto fill = [&](auto* qp, auto* kp, auto* vp, auto* gp) {
    using Out = std::remove_pointer_t<decltype(qp)>;
    for_rows(T, 3 * D, [&](int64_t t, float* tmp) {
      float* row = proj + t * W;
      round_row(row, W, bf16);  // the projections' outputs are in the model's dtype
      float *r = tmp, *scratch = tmp + D, *norm = tmp + 2 * D;
      auto head = [&](const float* x, float scale, Out* out) {
        rms_row(x, D, nullptr, e, false, scale, norm, r, !bf16);
        if (rope) rope_row(r, cp + t * D, sp + t * D, D, scratch);
        musespark_simd::store_row(r, out, D);
      };
      for (int64_t i = 0; i < nH; ++i) head(row + i * D, qs, qp + (t * nH + i) * D);
      for (int64_t i = 0; i < nKV; ++i) head(row + ok + i * D, 1.f, kp + (t * nKV + i) * D);
      musespark_simd::store_row(row + ov, vp + t * nKV * D, nKV * D);
      musespark_simd::store_row(row + og, gp + t * nH * D, nH * D);
    });
  };
  if (bf16)
    fill(q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), g.data_ptr<at::BFloat16>());
  else
    fill(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>());
  return {q, k, v, g};
}

// s [T, H] fp32, o and g [T, nH, D] bf16 (an fp32 model: fp32, nothing rounded) -> s' [T, H] fp32:
//   x = bf16(rms(o_head) * sigmoid(g));  a = bf16(x Wo^T);  s' = alpha * s + beta * rms(a).
// `eps` is the O-norm's (rms_norm_eps), `post_eps` the weightless post-attention norm's.
Tensor attn_out(const Tensor& s, const Tensor& o, const Tensor& g, at::TensorList o_proj, double eps,
                const Tensor& alpha, const Tensor& beta, double post_eps, const c10::optional<Tensor>& prompt_rows) {
  check_stream(s, "attn_out");
  const int64_t T = s.size(0), H = s.size(1);
  const uint8_t* prompt = musespark_gemv::prompt_flags(prompt_rows, T, "attn_out");
  const bool bf16 = o.scalar_type() == at::kBFloat16;
  TORCH_CHECK(o.dim() == 3 && o.size(0) == T && (bf16 || o.scalar_type() == at::kFloat) && o.is_contiguous() &&
                  g.sizes() == o.sizes() && g.scalar_type() == o.scalar_type() && g.is_contiguous(),
              "attn_out: o and g must be contiguous bfloat16 (or float32) [T, heads, head_dim] alike");
  const int64_t nH = o.size(1), D = o.size(2);
  TORCH_CHECK(D % 8 == 0, "attn_out: head_dim must be a multiple of 8, got ", D);
  const Weight wo = weight_arg(o_proj, false, "attn_out: o_proj");
  check_shape(wo, H, nH * D, "attn_out: o_proj");
  check_residual(s, alpha, beta);
  const float e = static_cast<float>(eps);
  float *x = scratch(kAct, T * nH * D), *a = scratch(kOut, T * H);
  auto gate = [&](const auto* op, const auto* gp) {
    for_rows(T, D, [&](int64_t t, float* tmp) {
      for (int64_t i = 0; i < nH; ++i) {
        const int64_t base = (t * nH + i) * D;
        rms_row(op + base, D, nullptr, e, false, 1.f, tmp, x + base, !bf16);
        if (!bf16) {  // fp32: the gate in double, rounded once
          for (int64_t j = 0; j < D; ++j) {
            const double gj = static_cast<double>(gp[base + j]);
            x[base + j] = static_cast<float>(static_cast<double>(x[base + j]) / (1.0 + std::exp(-gj)));
          }
          continue;
        }
        for (int64_t j = 0; j < D; ++j) tmp[j] = static_cast<float>(gp[base + j]);
        for (int64_t j = 0; j < D; j += 8) {  // D % 8 == 0; sigmoid with the fused blocks' exp
          float* xj = x + base + j;
          _mm256_storeu_ps(xj, _mm256_mul_ps(_mm256_loadu_ps(xj), musespark_simd::sigmoid8(_mm256_loadu_ps(tmp + j))));
        }
        round_row(x + base, D, bf16);
      }
    });
  };
  if (bf16)
    gate(o.data_ptr<at::BFloat16>(), g.data_ptr<at::BFloat16>());
  else
    gate(o.data_ptr<float>(), g.data_ptr<float>());
  run_jobs({wo.job(x, T, a, H, bf16, 0, prompt)});
  if (musespark_tp::blocks_reduce()) musespark_tp::all_reduce(a, T * H);  // o_proj is row-parallel
  return residual(s, a, nullptr, static_cast<float>(post_eps), alpha, beta, bf16);
}

}  // namespace musespark_ops

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("attn_in(Tensor s, Tensor gain, float eps, Tensor[] wq, Tensor[] wk, Tensor[] wv, Tensor[] wg, int num_heads, "
        "int num_kv_heads, float qk_scale, Tensor? cos, Tensor? sin, bool bf16=True, Tensor? prompt_rows=None) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("attn_out(Tensor s, Tensor o, Tensor g, Tensor[] wo, float eps, Tensor alpha, Tensor beta, float post_eps, "
        "Tensor? prompt_rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("attn_in", &musespark_ops::attn_in);
  m.impl("attn_out", &musespark_ops::attn_out);
}
