// The RMSNorm family in one pass per row, for the few rows of a decode step (where
// PyTorch's half-dozen small ops per norm cost more than the arithmetic).
//
// x [R, H] (bf16 or fp32); gain [H] fp32 (gain_center + weight) or empty; -> [R, H] in
// out_dtype (bf16 or fp32), computed in fp32 with one rounding at the store:
//   plain:        y = x * rsqrt(mean(x^2) + eps) * gain * scale
//   input_scaled: v = x * gain; y = v * rsqrt(mean(v^2) + eps) * scale
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

template <typename In, typename Out>
void rows(const In* x, int64_t R, int64_t H, const float* gain, double eps, bool input_scaled, double scale,
          Out* y) {
  std::vector<float> v(H);
  const float s = static_cast<float>(scale);
  for (int64_t r = 0; r < R; ++r) {
    const In* xr = x + r * H;
    float sq = 0.f;
    for (int64_t j = 0; j < H; ++j) {
      v[j] = static_cast<float>(xr[j]);
      if (input_scaled) v[j] *= gain[j];
      sq += v[j] * v[j];
    }
    const float inv = 1.f / std::sqrt(sq / static_cast<float>(H) + static_cast<float>(eps));
    Out* yr = y + r * H;
    for (int64_t j = 0; j < H; ++j) {
      float t = v[j] * inv;
      if (gain && !input_scaled) t *= gain[j];
      if (s != 1.f) t *= s;
      yr[j] = static_cast<Out>(t);
    }
  }
}

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
  auto y = at::empty({R, H}, xc.options().dtype(out_dtype));
  const float* gp = has_gain ? g.data_ptr<float>() : nullptr;
  auto go = [&](auto* in) {
    if (out_dtype == at::kFloat)
      rows(in, R, H, gp, eps, input_scaled, scale, y.data_ptr<float>());
    else
      rows(in, R, H, gp, eps, input_scaled, scale, y.data_ptr<at::BFloat16>());
  };
  if (xc.scalar_type() == at::kFloat)
    go(xc.data_ptr<float>());
  else
    go(xc.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? gain, float eps, bool input_scaled, float scale, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
