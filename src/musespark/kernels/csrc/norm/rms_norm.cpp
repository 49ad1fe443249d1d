// `rms_norm`: the RMSNorm family (norm/rows.h) as one torch op, one pass per row, for the
// norms outside the fused blocks (the embedding norm, the final norm).
//
// x [R, H] (bf16 or fp32); gain [H] fp32 (gain_center + weight) or empty; -> [R, H] in
// out_dtype (bf16 or fp32), computed in fp32 with one rounding at the store:
//   plain:        y = x * rsqrt(mean(x^2) + eps) * gain * scale
//   input_scaled: v = x * gain; y = v * rsqrt(mean(v^2) + eps) * scale
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/ops.h"
#include "../common/pool.h"
#include "rows.h"

#include <vector>

namespace musespark_ops {  // entry point: common/ops.h

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& gain, double eps, bool input_scaled,
                    double scale, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2, "rms_norm: x must be [R, H]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rms_norm: x must be fp32 or bf16");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "rms_norm: out_dtype must be fp32 or bf16");
  const bool has_gain = gain.has_value() && gain->defined();
  TORCH_CHECK(!input_scaled || has_gain, "rms_norm: input_scaled needs a gain");
  at::Tensor g;
  if (has_gain) {
    g = gain->contiguous();
    TORCH_CHECK(g.scalar_type() == at::kFloat && g.dim() == 1 && g.size(0) == x.size(1),
                "rms_norm: gain must be float32 [H]");
  }
  auto xc = x.contiguous();
  const int64_t R = xc.size(0), H = xc.size(1);
  auto y = musespark_pool::empty({R, H}, xc.options().dtype(out_dtype));
  const float* gp = has_gain ? g.data_ptr<float>() : nullptr;
  // fp32 in and out (an fp32 model's final norm): the sum of squares in double (norm/rows.h).
  const bool wide = xc.scalar_type() == at::kFloat && out_dtype == at::kFloat;
  auto go = [&](const auto* in, auto* out) {
    at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
      std::vector<float> tmp(H);
      for (int64_t r = r0; r < r1; ++r)
        musespark_rows::rms_row(in + r * H, H, gp, static_cast<float>(eps), input_scaled,
                                static_cast<float>(scale), tmp.data(), out + r * H, wide);
    });
  };
  auto with_out = [&](const auto* in) {
    if (out_dtype == at::kFloat)
      go(in, y.data_ptr<float>());
    else
      go(in, y.data_ptr<at::BFloat16>());
  };
  if (xc.scalar_type() == at::kFloat)
    with_out(xc.data_ptr<float>());
  else
    with_out(xc.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace musespark_ops

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? gain, float eps, bool input_scaled, float scale, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("rms_norm", &musespark_ops::rms_norm);
}
