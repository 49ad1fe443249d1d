// The fused blocks' shared pieces that are not inline (blocks/block.h states them).
#include "block.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <vector>

#include "../common/pool.h"
#include "../gemm/jobs.h"
#include "../norm/rows.h"

namespace musespark_block {

// Reads and checks a weight argument; `experts`: a leading expert dimension. The caller
// checks N and K against the model (check_shape).
Weight weight_arg(at::TensorList parts, bool experts, const char* name) {
  const int64_t d = experts ? 3 : 2;
  Weight w;
  TORCH_CHECK(parts.size() >= 1 && parts.size() <= 3, name,
              ": expected [bf16 weight], [bf16 weight, panels] or [NVFP4 codes, block scales, global scales], got ",
              parts.size(), " tensors");
  const Tensor& a = parts[0];
  TORCH_CHECK(a.dim() == d && a.is_contiguous(), name, " must be a contiguous ", d, "-D tensor, got ", a.sizes());
  w.E = experts ? a.size(0) : 1;
  w.N = a.size(d - 2);
  w.w = static_cast<const uint8_t*>(a.data_ptr());
  if (parts.size() <= 2) {
    TORCH_CHECK(a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kFloat, name,
                " must be bfloat16 or float32 (or NVFP4), got ", a.scalar_type());
    w.fp32 = a.scalar_type() == at::kFloat;
    w.K = a.size(d - 1);
    w.w_stride = w.N * w.K * static_cast<int64_t>(a.element_size());
    if (parts.size() == 2) {
      w.packed = musespark_gemv::panels_arg(parts[1], a, name);
      w.packed_stride = parts[1].numel() / w.E;
    }
    return w;
  }
  const Tensor &sc = parts[1], &gl = parts[2];
  w.K = a.size(d - 1) * 2;
  TORCH_CHECK(a.scalar_type() == at::kByte, name, ": NVFP4 codes must be uint8, got ", a.scalar_type());
  TORCH_CHECK(sc.dim() == d && sc.is_contiguous() && sc.element_size() == 1 &&
                  (sc.scalar_type() == at::kByte || sc.scalar_type() == at::kFloat8_e4m3fn) &&
                  (!experts || sc.size(0) == w.E) && sc.size(d - 2) == w.N && sc.size(d - 1) * 16 == w.K,
              name, ": NVFP4 block scales must be contiguous e4m3 [", experts ? "E, " : "", w.N, ", ", w.K / 16,
              "], got ", sc.sizes());
  TORCH_CHECK(gl.scalar_type() == at::kFloat && gl.is_contiguous() && gl.numel() >= w.E && gl.numel() % w.E == 0,
              name, ": NVFP4 global scales must be contiguous float32, a multiple of ", w.E, " elements");
  w.G = gl.numel() / w.E;
  TORCH_CHECK(w.N % w.G == 0, name, ": ", w.G, " global scales do not divide ", w.N, " rows");
  w.scales = static_cast<const uint8_t*>(sc.data_ptr());
  w.globals = gl.data_ptr<float>();
  w.w_stride = w.N * w.K / 2;
  w.s_stride = w.N * w.K / 16;
  return w;
}

float* scratch(Slot slot, int64_t n) {
  static thread_local std::vector<float> buffers[kSlots];
  std::vector<float>& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < n) b.resize(n);
  return b.data();
}

// h[t] = bf16(rms(s[t]) * gain) (fp32 models: unrounded), kept as floats for the products:
// [T, H] in scratch slot kNormed.
float* pre_norm(const float* s, int64_t T, int64_t H, const float* gain, float eps, bool bf16) {
  float* h = scratch(kNormed, T * H);
  for_rows(T, H, [&](int64_t t, float* tmp) {
    rms_row(s + t * H, H, gain, eps, false, 1.f, tmp, h + t * H, !bf16);
    round_row(h + t * H, H, bf16);
  });
  return h;
}

// The stream update shared by both halves of a layer, into a new stream:
// s' = alpha * s + beta * norm(b), norm weightless (gain null) or input-scaled by gain.
// b [T, H] is the block's fp32 output, rounded here (in place, row by row while it is in
// cache) to the model's values.
Tensor residual(const Tensor& s, float* b, const float* gain, float eps, const Tensor& alpha,
                       const Tensor& beta, bool bf16) {
  const int64_t T = s.size(0), H = s.size(1);
  Tensor out = musespark_pool::empty(s.sizes(), s.options());
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float *ap = alpha.data_ptr<float>(), *bp = beta.data_ptr<float>();
  for_rows(T, 2 * H, [&](int64_t t, float* tmp) {
    round_row(b + t * H, H, bf16);
    rms_row(b + t * H, H, gain, eps, gain != nullptr, 1.f, tmp, tmp + H, !bf16);
    gated_residual_row(sp + t * H, tmp + H, ap, bp, H, op + t * H);
  });
  return out;
}

}  // namespace musespark_block
