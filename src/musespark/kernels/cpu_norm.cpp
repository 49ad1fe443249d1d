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

// The attention's per-head QK-norm and rotary embedding in one pass:
// x [T, heads, D] (bf16 or fp32), cos/sin [T, D] fp32 (or empty: no rotary) ->
// rope(rms(x) * scale) [T, heads, D] in out_dtype, with rope(r) = r * cos + rotate_half(r) * sin.
at::Tensor head_norm_rope(const at::Tensor& x, const c10::optional<at::Tensor>& cos,
                          const c10::optional<at::Tensor>& sin, double eps, double scale, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 3 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "head_norm_rope: x must be fp32 or bf16 [T, heads, D]");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "head_norm_rope: out_dtype must be fp32 or bf16");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2;
  const bool rope = cos.has_value() && cos->defined();
  at::Tensor c, s;
  if (rope) {
    c = cos->contiguous();
    s = sin.value().contiguous();
    TORCH_CHECK(D % 2 == 0 && c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat && c.dim() == 2 &&
                    c.size(0) == T && c.size(1) == D && s.sizes() == c.sizes(),
                "head_norm_rope: cos/sin must be float32 [T, D]");
  }
  auto y = rms_norm(x.reshape({T * NH, D}), c10::nullopt, eps, false, scale, at::kFloat).view({T, NH, D});
  if (rope) {
    float* yp = y.data_ptr<float>();
    const float* cp = c.data_ptr<float>();
    const float* sp = s.data_ptr<float>();
    std::vector<float> r(D);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < NH; ++h) {
        float* row = yp + (t * NH + h) * D;
        for (int64_t i = 0; i < half; ++i) r[i] = -row[half + i];
        for (int64_t i = half; i < D; ++i) r[i] = row[i - half];
        for (int64_t i = 0; i < D; ++i) row[i] = row[i] * cp[t * D + i] + r[i] * sp[t * D + i];
      }
  }
  return out_dtype == at::kFloat ? y : y.to(out_dtype);
}

// The gated residual with its branch's norm: s [T, H] fp32, branch [T, H] (bf16/fp32),
// alpha/beta [H] fp32, gain [H] fp32 or empty -> alpha * s + beta * norm(branch), fp32.
at::Tensor gated_residual(const at::Tensor& s, const at::Tensor& branch, const at::Tensor& alpha,
                          const at::Tensor& beta, const c10::optional<at::Tensor>& gain, double eps, bool input_scaled) {
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kFloat && s.sizes() == branch.sizes(),
              "gated_residual: s must be float32 [T, H] like branch");
  TORCH_CHECK(alpha.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat && alpha.numel() == s.size(1) &&
                  beta.numel() == s.size(1),
              "gated_residual: alpha/beta must be float32 [H]");
  auto n = rms_norm(branch, gain, eps, input_scaled, 1.0, at::kFloat);
  auto sc = s.contiguous();
  auto a = alpha.contiguous(), b = beta.contiguous();
  const int64_t T = sc.size(0), H = sc.size(1);
  const float *sp = sc.data_ptr<float>(), *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  float* np = n.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < H; ++j) {
      const float x = ap[j] * sp[t * H + j], y = bp[j] * np[t * H + j];
      np[t * H + j] = x + y;
    }
  return n;
}

// The attention output's O-norm and sigmoid gate: o, g [T, heads, D] -> rms(o) * sigmoid(g) in out_dtype.
at::Tensor norm_gate(const at::Tensor& o, const at::Tensor& g, double eps, at::ScalarType out_dtype) {
  TORCH_CHECK(o.dim() == 3 && o.sizes() == g.sizes(), "norm_gate: o and g must be [T, heads, D] alike");
  const int64_t T = o.size(0), NH = o.size(1), D = o.size(2);
  auto y = rms_norm(o.reshape({T * NH, D}), c10::nullopt, eps, false, 1.0, at::kFloat);
  auto gf = g.to(at::kFloat).contiguous();
  float* yp = y.data_ptr<float>();
  const float* gp = gf.data_ptr<float>();
  for (int64_t i = 0; i < T * NH * D; ++i) yp[i] = yp[i] * (1.f / (1.f + std::exp(-gp[i])));
  return y.view({T, NH, D}).to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? gain, float eps, bool input_scaled, float scale, ScalarType out_dtype) -> Tensor");
  m.def("gated_residual(Tensor s, Tensor branch, Tensor alpha, Tensor beta, Tensor? gain, float eps, "
        "bool input_scaled) -> Tensor");
  m.def("norm_gate(Tensor o, Tensor g, float eps, ScalarType out_dtype) -> Tensor");
  m.def("head_norm_rope(Tensor x, Tensor? cos, Tensor? sin, float eps, float scale, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("head_norm_rope", &head_norm_rope);
  m.impl("gated_residual", &gated_residual);
  m.impl("norm_gate", &norm_gate);
}
