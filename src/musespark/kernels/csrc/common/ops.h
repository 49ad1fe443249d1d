// The decoder-step entry points the decode plan (blocks/decode_plan.cpp) calls directly, without
// the dispatcher: the same functions the ops of the same names run (their formulas and checks
// are at their definitions: blocks/attn_block.cpp, blocks/ffn_block.cpp, norm/rms_norm.cpp,
// attention/decode_attention.cpp).
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace musespark_ops {

using at::Tensor;

std::tuple<Tensor, Tensor, Tensor, Tensor> attn_in(const Tensor& s, const Tensor& gain, double eps, at::TensorList q_proj,
                                                   at::TensorList k_proj, at::TensorList v_proj, at::TensorList gate_proj,
                                                   int64_t num_heads, int64_t num_kv_heads, double qk_scale,
                                                   const c10::optional<Tensor>& cos, const c10::optional<Tensor>& sin,
                                                   bool bf16, const c10::optional<Tensor>& prompt_rows);

Tensor attn_out(const Tensor& s, const Tensor& o, const Tensor& g, at::TensorList o_proj, double eps,
                const Tensor& alpha, const Tensor& beta, double post_eps, const c10::optional<Tensor>& prompt_rows);

Tensor ffn_dense(const Tensor& s, const Tensor& pre_gain, double eps, at::TensorList gate_proj,
                 at::TensorList up_proj, at::TensorList down_proj, const Tensor& post_gain, double post_eps,
                 const Tensor& alpha, const Tensor& beta, bool bf16, const c10::optional<Tensor>& prompt_rows);

Tensor ffn_moe(const Tensor& s, const Tensor& pre_gain, double eps, const Tensor& router, const Tensor& bias,
               int64_t top_k, double output_multiplier, double routed_scaling, at::TensorList pre_expert_proj,
               const Tensor& expert_in_gain, at::TensorList gate_up_proj, at::TensorList down_proj,
               const Tensor& expert_out_gain, at::TensorList post_expert_proj, const Tensor& post_gain,
               double post_eps, const Tensor& alpha, const Tensor& beta, bool bf16,
               const c10::optional<Tensor>& prompt_rows);

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& gain, double eps, bool input_scaled,
                    double scale, at::ScalarType out_dtype);

at::Tensor paged_decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                             at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, int64_t window, double scale);

}  // namespace musespark_ops
