// A decode step of a whole model in one native call: embedding norm, every decoder layer,
// final norm.
//
// `DecodePlan` (torch.classes.musespark_cpu.DecodePlan; built and kept valid by
// backends/cpu_decode.py) holds each layer's arguments for attn_in, paged_decode_step,
// attn_out and ffn_dense or ffn_moe: the tuples the step-by-step path passes to those ops
// (backends/cpu_backend.py), and the embedding and final norm's. `run` calls the functions
// behind the ops (common/ops.h) in the same order with the same arguments, so its output is bit
// for bit the step-by-step one.
//
// Why: at batch 1 the weights of a step stream in ~7 ms on bench-small, and the ~50 op calls
// around them cost ~2 ms more in Python: argument conversion and dispatch (5-10 µs per call)
// and the model's and the backend's glue, all slow with the caches cold from the weights,
// while the other threads wait (benchmarks/RESULTS.md, at e4f6249). Here that is one call.
#include <ATen/core/Tensor.h>
#include <ATen/ops/clone.h>
#include <ATen/ops/embedding.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "../common/ops.h"

#include <optional>
#include <vector>

namespace {

using at::Tensor;
using Tensors = std::vector<Tensor>;

// One decoder layer's arguments, in each op's schema order (blocks/attn_block.cpp,
// attention/decode_attention.cpp, blocks/ffn_block.cpp). `rope` and `group` index `run`'s per-step lists.
struct Layer {
  bool has_in = false, has_attention = false, has_out = false, has_ffn = false;
  // attn_in; rope: the index of this layer's (cos, sin) in run's lists, -1 for none (NoPE)
  Tensor in_gain;
  double in_eps = 0, qk_scale = 0;
  Tensors wq, wk, wv, wg;
  int64_t heads = 0, kv_heads = 0, rope = -1;
  // paged_decode_step; group: the index of this layer's slot mapping and block tables
  Tensor k_cache, v_cache;
  int64_t group = 0, window = 0;
  double scale = 0;
  // attn_out
  Tensors wo;
  double o_eps = 0, o_post_eps = 0;
  Tensor o_alpha, o_beta;
  // ffn_dense (sparse false) or ffn_moe (sparse true): pre-norm, weights, post-norm, gate
  bool sparse = false;
  Tensor pre_gain, post_gain, f_alpha, f_beta;
  double pre_eps = 0, post_eps = 0;
  Tensors w_gate, w_up, w_down;  // dense
  Tensor router, bias, expert_in_gain, expert_out_gain;  // sparse
  int64_t top_k = 0;
  double multiplier = 0, scaling = 0;
  Tensors w_pre, gate_up, down, w_post;
};

struct DecodePlan : torch::CustomClassHolder {
  std::vector<Layer> layers;
  // The embedding [V, H] bf16 and its norm's eps (undefined: the caller embeds, `run` takes
  // the stream); the final norm's gain [H] fp32 and eps.
  Tensor embedding, final_gain;
  double embed_eps = 0, final_eps = 0;

  Layer& layer(int64_t i) {
    TORCH_CHECK(i >= 0 && i < 4096, "DecodePlan: layer index ", i, " out of range");
    if (i >= static_cast<int64_t>(layers.size())) layers.resize(static_cast<size_t>(i) + 1);
    return layers[static_cast<size_t>(i)];
  }

  // One decode row per query: `input` is the token ids [B] int64 if the plan embeds
  // (set_embedding), else the stream [B, H] fp32 -> {the final norm's output y [B, H] in the
  // model's dtype (bf16 or fp32), then a copy of the fp32 stream after each layer in
  // `aux_layers` (ascending)}. cos, sin: the step's rotary tables [B, D] fp32 (Layer::rope
  // indexes them); slot_mappings [B] and block_tables [B, n] int64 per KV group (Layer::group
  // indexes them); seq_lens [B]: the keys row b sees. Rows of one sequence (speculative
  // verification) repeat its block table with their own lengths: each layer writes every
  // row's K/V before any row attends (paged_decode_step), and a row sees only its prefix.
  Tensors run(const Tensor& input, const Tensors& cos, const Tensors& sin, const Tensors& slot_mappings,
              const Tensors& block_tables, const Tensor& seq_lens, bool bf16,
              const std::optional<Tensor>& prompt_rows, const std::vector<int64_t>& aux_layers) const {
    TORCH_CHECK(!layers.empty() && final_gain.defined(), "DecodePlan.run: the plan has no layers or no final norm");
    TORCH_CHECK(cos.size() == sin.size(), "DecodePlan.run: cos and sin must be lists of the same length");
    TORCH_CHECK(slot_mappings.size() == block_tables.size(),
                "DecodePlan.run: slot_mappings and block_tables must be lists of the same length");
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& L = layers[i];
      TORCH_CHECK(L.has_in && L.has_attention && L.has_out && L.has_ffn, "DecodePlan.run: layer ", i,
                  " is missing some of attn_in, attention, attn_out, ffn");
      TORCH_CHECK(L.rope < static_cast<int64_t>(cos.size()), "DecodePlan.run: layer ", i, " reads rotary table ",
                  L.rope, " of ", cos.size());
      TORCH_CHECK(L.group < static_cast<int64_t>(slot_mappings.size()), "DecodePlan.run: layer ", i,
                  " reads KV group ", L.group, " of ", slot_mappings.size());
    }
    // The embedding norm: RMS without weight, to the fp32 stream (CpuBackend.embed).
    Tensor s = embedding.defined()
                   ? musespark_ops::rms_norm(at::embedding(embedding, input), std::nullopt, embed_eps, false, 1.0,
                                             at::kFloat)
                   : input;
    for (size_t i = 1; i < aux_layers.size(); ++i)
      TORCH_CHECK(aux_layers[i - 1] < aux_layers[i], "DecodePlan.run: aux_layers must be ascending");
    Tensors out(1);
    size_t next_aux = 0;
    for (size_t li = 0; li < layers.size(); ++li) {
      const Layer& L = layers[li];
      std::optional<Tensor> c, sn;
      if (L.rope >= 0) c = cos[L.rope], sn = sin[L.rope];
      auto [q, k, v, g] = musespark_ops::attn_in(s, L.in_gain, L.in_eps, L.wq, L.wk, L.wv, L.wg, L.heads,
                                                 L.kv_heads, L.qk_scale, c, sn, bf16, prompt_rows);
      Tensor k_cache = L.k_cache, v_cache = L.v_cache;  // handles: the op writes through them
      Tensor o = musespark_ops::paged_decode_step(q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache,
                                                  slot_mappings[L.group], block_tables[L.group], seq_lens,
                                                  L.window, L.scale);
      s = musespark_ops::attn_out(s, o.contiguous(), g, L.wo, L.o_eps, L.o_alpha, L.o_beta, L.o_post_eps,
                                  prompt_rows);
      if (L.sparse)
        s = musespark_ops::ffn_moe(s, L.pre_gain, L.pre_eps, L.router, L.bias, L.top_k, L.multiplier, L.scaling,
                                   L.w_pre, L.expert_in_gain, L.gate_up, L.down, L.expert_out_gain, L.w_post,
                                   L.post_gain, L.post_eps, L.f_alpha, L.f_beta, bf16, prompt_rows);
      else
        s = musespark_ops::ffn_dense(s, L.pre_gain, L.pre_eps, L.w_gate, L.w_up, L.w_down, L.post_gain,
                                     L.post_eps, L.f_alpha, L.f_beta, bf16, prompt_rows);
      if (next_aux < aux_layers.size() && aux_layers[next_aux] == static_cast<int64_t>(li)) {
        out.push_back(s.clone());  // a copy: later layers may update s in place
        ++next_aux;
      }
    }
    TORCH_CHECK(next_aux == aux_layers.size(), "DecodePlan.run: aux_layers must be layer indices in [0, ",
                layers.size(), ")");
    out[0] = musespark_ops::rms_norm(s, final_gain, final_eps, false, 1.0, bf16 ? at::kBFloat16 : at::kFloat);
    return out;
  }
};

using Plan = c10::intrusive_ptr<DecodePlan>;

}  // namespace

// Each setter takes the layer index, then its op's arguments between the activations and the
// trailing flags (the tuples backends/cpu_backend.py builds), then the plan's indices.
TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<>())
      .def("set_embedding",
           [](const Plan& self, Tensor weight, double eps) {
             TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
                         "DecodePlan.set_embedding: weight must be bfloat16 [V, H]");
             self->embedding = weight, self->embed_eps = eps;
           })
      .def("set_final_norm",
           [](const Plan& self, Tensor gain, double eps) { self->final_gain = gain, self->final_eps = eps; })
      .def("set_attn_in",
           [](const Plan& self, int64_t i, Tensor gain, double eps, Tensors wq, Tensors wk, Tensors wv, Tensors wg,
              int64_t heads, int64_t kv_heads, double qk_scale, int64_t rope) {
             Layer& L = self->layer(i);
             L.in_gain = gain, L.in_eps = eps, L.wq = wq, L.wk = wk, L.wv = wv, L.wg = wg;
             L.heads = heads, L.kv_heads = kv_heads, L.qk_scale = qk_scale, L.rope = rope;
             L.has_in = true;
           })
      .def("set_attention",
           [](const Plan& self, int64_t i, Tensor k_cache, Tensor v_cache, int64_t group, int64_t window,
              double scale) {
             TORCH_CHECK(group >= 0, "DecodePlan.set_attention: group must be >= 0, got ", group);
             Layer& L = self->layer(i);
             L.k_cache = k_cache, L.v_cache = v_cache, L.group = group, L.window = window, L.scale = scale;
             L.has_attention = true;
           })
      .def("set_attn_out",
           [](const Plan& self, int64_t i, Tensors wo, double eps, Tensor alpha, Tensor beta, double post_eps) {
             Layer& L = self->layer(i);
             L.wo = wo, L.o_eps = eps, L.o_alpha = alpha, L.o_beta = beta, L.o_post_eps = post_eps;
             L.has_out = true;
           })
      .def("set_ffn_dense",
           [](const Plan& self, int64_t i, Tensor pre_gain, double eps, Tensors w_gate, Tensors w_up, Tensors w_down,
              Tensor post_gain, double post_eps, Tensor alpha, Tensor beta) {
             Layer& L = self->layer(i);
             L.sparse = false, L.pre_gain = pre_gain, L.pre_eps = eps, L.w_gate = w_gate, L.w_up = w_up;
             L.w_down = w_down, L.post_gain = post_gain, L.post_eps = post_eps, L.f_alpha = alpha, L.f_beta = beta;
             L.has_ffn = true;
           })
      .def("set_ffn_moe",
           [](const Plan& self, int64_t i, Tensor pre_gain, double eps, Tensor router, Tensor bias, int64_t top_k,
              double multiplier, double scaling, Tensors w_pre, Tensor expert_in_gain, Tensors gate_up, Tensors down,
              Tensor expert_out_gain, Tensors w_post, Tensor post_gain, double post_eps, Tensor alpha, Tensor beta) {
             Layer& L = self->layer(i);
             L.sparse = true, L.pre_gain = pre_gain, L.pre_eps = eps, L.router = router, L.bias = bias;
             L.top_k = top_k, L.multiplier = multiplier, L.scaling = scaling, L.w_pre = w_pre;
             L.expert_in_gain = expert_in_gain, L.gate_up = gate_up, L.down = down;
             L.expert_out_gain = expert_out_gain, L.w_post = w_post, L.post_gain = post_gain, L.post_eps = post_eps;
             L.f_alpha = alpha, L.f_beta = beta;
             L.has_ffn = true;
           })
      .def("run", [](const Plan& self, Tensor input, Tensors cos, Tensors sin, Tensors slot_mappings,
                     Tensors block_tables, Tensor seq_lens, bool bf16, std::optional<Tensor> prompt_rows,
                     std::vector<int64_t> aux_layers) {
        return self->run(input, cos, sin, slot_mappings, block_tables, seq_lens, bf16, prompt_rows, aux_layers);
      });
}
