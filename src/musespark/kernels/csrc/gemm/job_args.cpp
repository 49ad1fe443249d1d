// The ops' arguments that say how to multiply (gemm/jobs.h states them): prompt_rows and a
// weight's packed panels, checked against the weight.
#include <ATen/core/Tensor.h>

#include <vector>

#include "jobs.h"

namespace musespark_gemv {

const uint8_t* prompt_flags(const c10::optional<at::Tensor>& rows, int64_t T, const char* op) {
  if (!rows.has_value() || !rows->defined()) return nullptr;
  const at::Tensor& r = *rows;
  TORCH_CHECK(r.dim() == 1 && r.size(0) == T && r.is_contiguous() &&
                  (r.scalar_type() == at::kBool || r.scalar_type() == at::kByte),
              op, ": prompt_rows must be a contiguous bool or uint8 [", T, "] (one flag per row), got ",
              r.scalar_type(), " ", r.sizes());
  return static_cast<const uint8_t*>(r.data_ptr());
}

const uint32_t* panels_arg(const c10::optional<at::Tensor>& panels, const at::Tensor& w, const char* name) {
  if (!panels.has_value() || !panels->defined()) return nullptr;
  const at::Tensor& p = *panels;
  const bool experts = w.dim() == 3;
  TORCH_CHECK((w.dim() == 2 || experts) && w.scalar_type() == at::kBFloat16, name,
              ": panels go with a bfloat16 [N, K] weight (experts: [E, N, K]), got ", w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(-2), K = w.size(-1);
  std::vector<int64_t> want{(N + musespark_avx512::kPanelRows - 1) / musespark_avx512::kPanelRows, K / 2,
                            musespark_avx512::kPanelRows};
  if (experts) want.insert(want.begin(), w.size(0));
  TORCH_CHECK(p.scalar_type() == at::kInt && p.is_contiguous() && p.sizes() == at::IntArrayRef(want) && K % 2 == 0,
              name, ": panels must be the contiguous int32 ", at::IntArrayRef(want),
              " packing of the weight (musespark.kernels.cpu.pack_panels), got ", p.scalar_type(), " ", p.sizes());
  return reinterpret_cast<const uint32_t*>(p.data_ptr<int32_t>());
}

}  // namespace musespark_gemv
