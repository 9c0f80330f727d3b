// The GPT model (GPT-2 architecture): token + position embeddings, pre-LN blocks of causal self-attention
// (fused QKV) and a GELU MLP, a final LayerNorm and an LM head tied to the token embedding. BasicGPT<D> holds
// its parameters on device D (GPT is the CPU model); BasicGPT<cuda>(cpu_model) copies a model to the GPU.
//   tg::Generator gen(1337);  tg::nn::GPT model(tg::nn::GPTConfig::preset("tiny", 256), gen);
//   auto logits = model.forward<tg::fp32>(idx);              // idx (B,T) int64 -> (B,T,V)
#pragma once

#include <cmath>
#include <string>

#include "typegrad/autodiff/checkpoint.hpp"
#include "typegrad/nn/layers.hpp"
#include "typegrad/ops/attention.hpp"
#include "typegrad/ops/dropout.hpp"
#include "typegrad/ops/dropout_add.hpp"
#include "typegrad/ops/padded_rows.hpp"
#include "typegrad/ops/linear_gelu.hpp"
#include "typegrad/ops/unary.hpp"

namespace tg::nn {

struct GPTConfig {
  std::int64_t vocab_size = 256;
  std::int64_t block_size = 128;  // the longest sequence (position embeddings)
  std::int64_t n_layer = 4;
  std::int64_t n_head = 4;
  std::int64_t n_embd = 128;
  float dropout = 0.0f;
  /// The token embedding's rows are stored padded to a multiple of this (Note [padded vocabulary]); 1: none.
  std::int64_t vocab_multiple = 1;

  /// The rows the token embedding is stored with: vocab_size rounded up to a multiple of vocab_multiple.
  std::int64_t padded_vocab() const { return (vocab_size + vocab_multiple - 1) / vocab_multiple * vocab_multiple; }

  /// Presets: "tiny" (~1M parameters with a byte vocabulary), "small" (~10M), "gpt2" (124M, GPT-2 small:
  /// L=12, H=12, C=768, T=1024, vocabulary 50257 padded to 50304; rows stored padded to a multiple of 128).
  /// `vocab` overrides the vocabulary (0 keeps the preset's: 256 for tiny/small, 50304 for gpt2).
  static GPTConfig preset(const std::string& name, std::int64_t vocab = 0) {
    GPTConfig c;
    if (name == "tiny") {
      c = {256, 128, 4, 4, 128, 0.0f};
    } else if (name == "small") {
      c = {256, 256, 6, 6, 384, 0.0f};
    } else if (name == "gpt2") {
      c = {50304, 1024, 12, 12, 768, 0.0f};
      c.vocab_multiple = 128;  // GPT-2's tokenizer (50257) trains on 50304 stored rows: aligned LM-head GEMMs
    } else {
      throw Error("GPTConfig::preset: unknown model '", name, "' (expected tiny, small or gpt2)");
    }
    if (vocab > 0) c.vocab_size = vocab;
    return c;
  }
  void validate() const {
    TG_CHECK(n_embd % n_head == 0, "GPTConfig: n_embd ", n_embd, " is not divisible by n_head ", n_head);
    TG_CHECK(vocab_size > 0 && block_size > 0 && n_layer > 0, "GPTConfig: sizes must be positive");
    TG_CHECK(dropout >= 0.f && dropout < 1.f, "GPTConfig: dropout must be in [0, 1), got ", dropout);
    TG_CHECK(vocab_multiple >= 1 && vocab_multiple <= 65536, "GPTConfig: vocab_multiple must be in [1, 65536], got ", vocab_multiple);
  }
};

/// Causal multi-head self-attention with a fused QKV projection c_attn [3C, C] and output projection c_proj.
template <Device D = cpu>
class BasicCausalSelfAttention {
 public:
  BasicCausalSelfAttention() = default;
  template <Device S>
  explicit BasicCausalSelfAttention(const BasicCausalSelfAttention<S>& o)
      : c_attn_(o.c_attn()), c_proj_(o.c_proj()), n_head_(o.n_head()) {}
  BasicCausalSelfAttention(const GPTConfig& c, Generator& gen)
      : c_attn_(c.n_embd, 3 * c.n_embd, gen),
        // GPT-2: residual projections scaled by 1/sqrt(2·n_layer) at init.
        c_proj_(c.n_embd, c.n_embd, gen, 0.02f / std::sqrt(2.0f * static_cast<float>(c.n_layer))),
        n_head_(c.n_head) {}

  template <FloatingElement T>
  Tensor<T, D> forward(const Tensor<T, D>& x) const {  // (B,T,C)
    // the heads read straight from the fused projection's (B,T,3C) output and written as (B,T,C): the values
    // of splitting into (B,H,T,hs) heads and merging them back, without the layout copies
    return c_proj_.forward(causal_attention_qkv(c_attn_.forward(x), n_head_));
  }
  void collect_parameters(const std::string& prefix, std::vector<DeviceParameter<D>>& out) const {
    c_attn_.collect_parameters(join_name(prefix, "c_attn"), out);
    c_proj_.collect_parameters(join_name(prefix, "c_proj"), out);
  }
  const BasicLinear<D>& c_attn() const { return c_attn_; }
  const BasicLinear<D>& c_proj() const { return c_proj_; }
  std::int64_t n_head() const { return n_head_; }

 private:
  BasicLinear<D> c_attn_, c_proj_;
  std::int64_t n_head_ = 1;
};
using CausalSelfAttention = BasicCausalSelfAttention<cpu>;

/// GELU MLP: c_fc [4C, C] -> GELU (tanh approximation, as GPT-2) -> c_proj [C, 4C].
template <Device D = cpu>
class BasicMLP {
 public:
  BasicMLP() = default;
  template <Device S>
  explicit BasicMLP(const BasicMLP<S>& o) : c_fc_(o.c_fc()), c_proj_(o.c_proj()) {}
  BasicMLP(const GPTConfig& c, Generator& gen)
      : c_fc_(c.n_embd, 4 * c.n_embd, gen),
        c_proj_(4 * c.n_embd, c.n_embd, gen, 0.02f / std::sqrt(2.0f * static_cast<float>(c.n_layer))) {}
  /// c_proj(gelu_tanh(c_fc(x))), the weights read as the layers' forwards read them. On the GPU one op (Note
  /// [the fused GELU MLP]: cuBLASLt's GELU epilogue forward, its DGELU_BGRAD and BGRADB epilogues backward). On
  /// the CPU, where that op would run the same kernels, linear_gelu_tanh then c_proj's forward: two nodes, so
  /// the output's gradient is freed before the GELU's backward runs. Layers of which one has a bias and the
  /// other not take that pair on every device.
  template <FloatingElement T>
  Tensor<T, D> forward(const Tensor<T, D>& x) const {  // (B,T,C)
    const auto w_fc = amp::param_as<T>(c_fc_.weight()), w_proj = amp::param_as<T>(c_proj_.weight());
    if constexpr (!std::is_same_v<D, cpu>) {
      if (c_fc_.has_bias() && c_proj_.has_bias())
        return mlp_gelu_tanh(x, w_fc, amp::param_as<T>(c_fc_.bias()), w_proj, amp::param_as<T>(c_proj_.bias()));
      if (!c_fc_.has_bias() && !c_proj_.has_bias()) return mlp_gelu_tanh(x, w_fc, w_proj);
    }
    const Tensor<T, D> h = c_fc_.has_bias() ? linear_gelu_tanh(x, w_fc, amp::param_as<T>(c_fc_.bias()))
                                            : linear_gelu_tanh(x, w_fc);  // (B,T,4C)
    return c_proj_.forward(h);
  }
  void collect_parameters(const std::string& prefix, std::vector<DeviceParameter<D>>& out) const {
    c_fc_.collect_parameters(join_name(prefix, "c_fc"), out);
    c_proj_.collect_parameters(join_name(prefix, "c_proj"), out);
  }
  const BasicLinear<D>& c_fc() const { return c_fc_; }
  const BasicLinear<D>& c_proj() const { return c_proj_; }

 private:
  BasicLinear<D> c_fc_, c_proj_;
};
using MLP = BasicMLP<cpu>;

/// Pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(·)); dropout on both residual branches.
template <Device D = cpu>
class BasicBlock {
 public:
  BasicBlock() = default;
  BasicBlock(const GPTConfig& c, Generator& gen) : ln_1_(c.n_embd), attn_(c, gen), ln_2_(c.n_embd), mlp_(c, gen), dropout_(c.dropout) {}
  template <Device S>
  explicit BasicBlock(const BasicBlock<S>& o)
      : ln_1_(o.ln_1()), attn_(o.attn()), ln_2_(o.ln_2()), mlp_(o.mlp()), dropout_(o.dropout_p()) {}
  template <FloatingElement T>
  Tensor<T, D> forward(const Tensor<T, D>& x, Generator& dropout_gen, bool training) const {
    // h = x + dropout(attn(ln_1(x))) and ln_2(h) in one pass, then h + dropout(mlp(·)) in one pass: the
    // unfused ops' values bit for bit (Notes [fused residual add and LayerNorm], [fused dropout and residual add])
    const AddLayerNorm<T, D> h = ln_2_.forward_add(x, dropout(attn_.forward(ln_1_.forward(x)), dropout_, dropout_gen, training));
    return dropout_add(h.sum, mlp_.forward(h.out), dropout_, dropout_gen, training);
  }
  void collect_parameters(const std::string& prefix, std::vector<DeviceParameter<D>>& out) const {
    ln_1_.collect_parameters(join_name(prefix, "ln_1"), out);
    attn_.collect_parameters(join_name(prefix, "attn"), out);
    ln_2_.collect_parameters(join_name(prefix, "ln_2"), out);
    mlp_.collect_parameters(join_name(prefix, "mlp"), out);
  }
  const BasicLayerNorm<D>& ln_1() const { return ln_1_; }
  const BasicCausalSelfAttention<D>& attn() const { return attn_; }
  const BasicLayerNorm<D>& ln_2() const { return ln_2_; }
  const BasicMLP<D>& mlp() const { return mlp_; }
  float dropout_p() const { return dropout_; }

 private:
  BasicLayerNorm<D> ln_1_;
  BasicCausalSelfAttention<D> attn_;
  BasicLayerNorm<D> ln_2_;
  BasicMLP<D> mlp_;
  float dropout_ = 0.f;
};
using Block = BasicBlock<cpu>;

template <Device D = cpu>
class BasicGPT {
 public:
  BasicGPT(const GPTConfig& config, Generator& gen) : config_(config) {
    config_.validate();
    wte_ = BasicEmbedding<D>(config.vocab_size, config.n_embd, gen, 0.02f, config.padded_vocab());  // Note [padded vocabulary]
    wpe_ = BasicEmbedding<D>(config.block_size, config.n_embd, gen);
    for (std::int64_t i = 0; i < config.n_layer; ++i) blocks_.emplace_back(config_, gen);
    ln_f_ = BasicLayerNorm<D>(config.n_embd);
  }
  /// A copy of `other` (weights, configuration) on device D: a GPU model that starts
  /// from a CPU model's initialization or checkpoint.
  template <Device S>
  explicit BasicGPT(const BasicGPT<S>& other)
      : config_(other.config()), wte_(other.wte()), wpe_(other.wpe()), ln_f_(other.ln_f()) {
    for (const auto& b : other.blocks()) blocks_.emplace_back(b);
  }

  /// Logits (B,T,V) for token ids idx (B,T), the blocks under the activation-checkpointing policy C
  /// (Note [checkpoint regions]). Dropout draws from `dropout_gen` when training.
  template <FloatingElement T, ActivationCheckpointing C = NoCheckpoint>
  Tensor<T, D> forward(const Tensor<std::int64_t>& idx, Generator& dropout_gen, bool training = true) const {
    TG_CHECK(idx.dim() == 2, "GPT::forward: idx must be (B,T), got ", idx.shape());
    const std::int64_t T_ = idx.size(1);
    TG_CHECK(T_ <= config_.block_size, "GPT::forward: sequence length ", T_, " exceeds block_size ", config_.block_size);
    const Tensor<std::int64_t> pos = Tensor<std::int64_t>::arange(T_);
    Tensor<T, D> x = add(wte_.template forward<T>(idx), wpe_.template forward<T>(pos));  // (B,T,C) + (T,C)
    x = dropout(x, config_.dropout, dropout_gen, training);
    for (const BasicBlock<D>& b : blocks_) x = checkpointed<C>(b, x, dropout_gen, training);
    x = ln_f_.forward(x);
    const Tensor<T, D> head = amp::param_as<T>(wte_.weight());  // tied LM head: logits = x·wteᵀ
    const std::int64_t V = config_.vocab_size, P = config_.padded_vocab();
    if (P == V) return linear(x, head);
    // Note [padded vocabulary]: the GEMM on P rows (the fp32 master's own padded storage, or a zero-padded 16-bit
    // copy), the logits narrowed to the real vocabulary.
    return narrow_classes(linear(x, padded_rows(head, P, /*storage_tail_is_zero=*/true)), V);
  }
  template <FloatingElement T>
  Tensor<T, D> forward(const Tensor<std::int64_t>& idx) const {
    Generator unused(0);
    return forward<T>(idx, unused, false);
  }

  /// GPT-2's names: wte.weight, wpe.weight, h.{i}.ln_1.weight, h.{i}.attn.c_attn.weight, ..., ln_f.bias.
  /// The LM head is tied to wte and not listed separately.
  std::vector<DeviceParameter<D>> named_parameters() const {
    std::vector<DeviceParameter<D>> out;
    wte_.collect_parameters("wte", out);
    wpe_.collect_parameters("wpe", out);
    for (std::size_t i = 0; i < blocks_.size(); ++i) blocks_[i].collect_parameters("h." + std::to_string(i), out);
    ln_f_.collect_parameters("ln_f", out);
    return out;
  }
  const GPTConfig& config() const { return config_; }
  const std::vector<BasicBlock<D>>& blocks() const { return blocks_; }
  const BasicEmbedding<D>& wte() const { return wte_; }
  const BasicEmbedding<D>& wpe() const { return wpe_; }
  const BasicLayerNorm<D>& ln_f() const { return ln_f_; }

 private:
  GPTConfig config_;
  BasicEmbedding<D> wte_, wpe_;
  std::vector<BasicBlock<D>> blocks_;
  BasicLayerNorm<D> ln_f_;
};
using GPT = BasicGPT<cpu>;

}  // namespace tg::nn
