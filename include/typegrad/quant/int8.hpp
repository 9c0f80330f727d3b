// int8 post-training quantization of a GPT for inference on the CPU: per-output-channel symmetric int8
// weights, int8 activations (per token at run time, or one calibrated scale per layer input), int8 x int8
// GEMMs with exact int32 accumulation (backend::cpu::gemm_s8_packed_dequant), and a safetensors format.
//   tg::quant::QuantizedGPT q = tg::quant::quantize(model, {.activations = tg::quant::ActivationScheme::dynamic_per_token});
//   auto logits = q.forward<tg::fp32>(idx);   q.save("model.int8.safetensors");   // (B,T) -> (B,T,V), no tape
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "typegrad/autodiff/tape.hpp"
#include "typegrad/core/tensor.hpp"
#include "typegrad/detail/cuda/gemm_int8.hpp"
#include "typegrad/nn/gpt.hpp"
#include "typegrad/ops/attention.hpp"
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/embedding.hpp"
#include "typegrad/ops/layernorm.hpp"
#include "typegrad/ops/matmul.hpp"
#include "typegrad/ops/unary.hpp"

namespace tg::backend::cpu {
class PackedInt8Weights;
}

namespace tg::quant {

// Note [int8 quantization]
// Weights. Each output channel n of a linear layer's W [N,K] gets the scale s_n = max_k |W[n,k]| / 127
// (1 for an all-zero row) and q[n,k] = round(W[n,k] / s_n), rounded to nearest even, in [-127, 127]
// (symmetric: -128 is never used, so negation is exact). |W - s_n·q| <= s_n / 2 per element.
// Activations. Before each quantized product its input x [M,K] is quantized the same way, per row (token):
//   dynamic_per_token   s_m = max_k |x[m,k]| / 127, computed at run time for every row;
//   static_per_tensor   one scale per layer input, s = a / 127 with a the largest |x| seen over the
//                       calibration batches (QuantizedGPT::calibrate); values beyond a saturate at ±127.
// Product. y[m,n] = (Σ_k qx[m,k] · qW[n,k]) · s_m · s_n + b_n: the sum is exact in int32 (Note [int8 GEMM]),
// then two fp32 multiplies and the bias add. What stays in fp32: the token and position embeddings, the
// LayerNorms, the attention (scores, softmax and the weighted sum), GELU, the residual adds, and the LM head
// unless QuantizeOptions::lm_head (it is tied to the token embedding, which the lookup keeps in fp32).
// Quantized layers: every block's attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj (and the LM head).

enum class ActivationScheme { dynamic_per_token, static_per_tensor };
/// "dynamic" | "static".
std::string_view activation_scheme_name(ActivationScheme s);

struct QuantizeOptions {
  ActivationScheme activations = ActivationScheme::dynamic_per_token;
  bool lm_head = false;  ///< also quantize the LM head (an int8 copy of the tied token embedding)
};

/// Per-output-channel symmetric int8 weights: q [N,K], scale [N] (Note [int8 quantization]).
struct Int8Weights {
  Tensor<std::int8_t> q;
  Tensor<fp32> scale;
};
/// Quantizes W [N,K] (fp32, any strides) per output channel (the quotients W/s in fp64, so |W - s·q| <= s/2
/// exactly). Non-finite weights are an error naming `what`.
Int8Weights quantize_weights(const Tensor<fp32>& W, const std::string& what = "weight");
/// s_n · q[n,k], fp32 [N,K].
Tensor<fp32> dequantize_weights(const Int8Weights& w);

/// x [M,K] (row stride ldx) -> q [M,K] (row stride K) with scale[m] = max_k |x[m,k]| / 127 (1 for a zero row);
/// the quotients x/s are rounded to fp32 first, so |x - s·q| <= s/2 + |x|·2^-24.
void quantize_rows(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx, std::int8_t* q, float* scale);
/// x [M,K] -> q [M,K] with the one scale `scale` (> 0), saturating at ±127.
void quantize_with_scale(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx, float scale, std::int8_t* q);

/// y = x·Wᵀ + b with int8 weights and activations (Note [int8 quantization]). Immutable after calibration.
class QuantizedLinear {
 public:
  /// `bias`: [out], or an undefined tensor (Tensor<fp32>()) for none.
  QuantizedLinear(Int8Weights w, Tensor<fp32> bias, std::optional<float> input_scale = std::nullopt);
  ~QuantizedLinear();
  QuantizedLinear(QuantizedLinear&&) noexcept;
  QuantizedLinear& operator=(QuantizedLinear&&) noexcept;

  /// x (..., K) fp32 -> (..., N) fp32. With an observer on, also records max |x| (calibration).
  Tensor<fp32> forward(const Tensor<fp32>& x) const;
  std::int64_t in_features() const { return w_.q.size(1); }
  std::int64_t out_features() const { return w_.q.size(0); }
  const Int8Weights& weights() const { return w_; }
  const Tensor<fp32>& bias() const { return bias_; }  ///< undefined when the layer has none
  bool has_bias() const { return bias_.defined(); }
  /// The static input scale; nothing under dynamic per-token scales.
  std::optional<float> input_scale() const { return input_scale_; }
  void set_input_scale(std::optional<float> s);
  /// Calibration: while observing, forward records the largest |x| it sees.
  void observe(bool on) const;
  float observed_absmax() const { return absmax_; }
  /// int8 weights, their scales and the bias.
  std::int64_t bytes() const;

 private:
  Int8Weights w_;
  Tensor<fp32> bias_;
  std::unique_ptr<backend::cpu::PackedInt8Weights> packed_;
  std::optional<float> input_scale_;
  mutable bool observing_ = false;
  mutable float absmax_ = 0.f;
};

namespace detail {
/// A transformer block of a quantized GPT on device D: fp32 LayerNorms, int8 linear layers of type Linear.
template <Device D, class Linear>
struct Int8Block {
  Tensor<fp32, D> ln_1_w, ln_1_b, ln_2_w, ln_2_b;
  Linear c_attn, c_proj, c_fc, mlp_proj;
};

/// The quantized GPT's forward on device D (Note [int8 quantization]): nn::GPT's forward<fp32> with each
/// linear layer of the blocks (and the LM head when `lm_head`) replaced by its int8 form. No tape.
template <Device D, class Linear>
Tensor<fp32, D> int8_gpt_forward(const nn::GPTConfig& c, const Tensor<fp32, D>& wte, const Tensor<fp32, D>& wpe,
                                 const std::vector<Int8Block<D, Linear>>& blocks, const Tensor<fp32, D>& ln_f_w,
                                 const Tensor<fp32, D>& ln_f_b, const Linear* lm_head, const Tensor<std::int64_t>& idx) {
  TG_CHECK(idx.dim() == 2, "QuantizedGPT::forward: idx must be (B,T), got ", idx.shape());
  const std::int64_t B = idx.size(0), T_ = idx.size(1), C = c.n_embd, H = c.n_head, hs = C / H;
  TG_CHECK(T_ <= c.block_size, "QuantizedGPT::forward: sequence length ", T_, " exceeds block_size ", c.block_size);
  NoGrad no_grad;
  Tensor<fp32, D> x = add(embedding(wte, idx), embedding(wpe, Tensor<std::int64_t>::arange(T_)));  // (B,T,C)
  for (const Int8Block<D, Linear>& b : blocks) {
    const Tensor<fp32, D> qkv = b.c_attn.forward(layernorm(x, b.ln_1_w, b.ln_1_b));  // (B,T,3C)
    auto heads = [&](std::int64_t part) { return qkv.narrow(2, part * C, C).reshape({B, T_, H, hs}).transpose(1, 2).contiguous(); };
    const Tensor<fp32, D> y = causal_attention(heads(0), heads(1), heads(2));  // (B,H,T,hs)
    x = add(x, b.c_proj.forward(y.transpose(1, 2).reshape({B, T_, C})));
    x = add(x, b.mlp_proj.forward(gelu_tanh(b.c_fc.forward(layernorm(x, b.ln_2_w, b.ln_2_b)))));
  }
  x = layernorm(x, ln_f_w, ln_f_b);
  return lm_head ? lm_head->forward(x) : linear(x, wte);  // (B,T,V)
}
}  // namespace detail

/// A GPT for inference with int8 linear layers (Note [int8 quantization]): forward<fp32>(idx) gives the
/// logits as nn::GPT::forward<fp32> does, without a tape, so train::evaluate and generation take it as is.
class QuantizedGPT {
 public:
  /// The quantized copy of `model` (weights quantized now; static activation scales come from calibrate()).
  QuantizedGPT(const nn::GPT& model, const QuantizeOptions& options);
  QuantizedGPT(QuantizedGPT&&) noexcept;
  QuantizedGPT& operator=(QuantizedGPT&&) noexcept;
  ~QuantizedGPT();

  template <FloatingElement T>
  Tensor<T> forward(const Tensor<std::int64_t>& idx) const {
    static_assert(std::is_same_v<T, fp32>, "QuantizedGPT::forward computes fp32 logits: call forward<tg::fp32>");
    return forward_fp32(idx);
  }
  Tensor<fp32> forward_fp32(const Tensor<std::int64_t>& idx) const;

  /// Static activation scales: runs the batches (B,T) through the model with dynamic scales, recording each
  /// quantized layer's largest input |x|, then fixes s = max / 127 per layer. Needs at least one batch.
  void calibrate(const std::vector<Tensor<std::int64_t>>& batches);
  bool calibrated() const;

  const nn::GPTConfig& config() const { return config_; }
  const QuantizeOptions& options() const { return options_; }
  /// The quantized layers with their GPT-2 names ("h.0.attn.c_attn", ..., "lm_head").
  std::vector<std::pair<std::string, const QuantizedLinear*>> layers() const;
  /// Bytes of the model as stored (int8 weights and their scales, the fp32 rest).
  std::int64_t bytes() const;
  /// Each part, for a copy on another device (CudaQuantizedGPT).
  const Tensor<fp32>& wte() const { return wte_; }
  const Tensor<fp32>& wpe() const { return wpe_; }
  const Tensor<fp32>& ln_f_weight() const { return ln_f_w_; }
  const Tensor<fp32>& ln_f_bias() const { return ln_f_b_; }
  using Block = detail::Int8Block<cpu, QuantizedLinear>;
  const std::vector<Block>& blocks() const { return blocks_; }
  const QuantizedLinear* lm_head() const { return lm_head_.get(); }

  /// Writes the model as safetensors (Note [int8 safetensors]), atomically, with checksums.
  void save(const std::string& path) const;
  /// Reads a file written by save(); every tensor's name, dtype, shape and scale is checked first, and a
  /// bad file is an error naming it and what is wrong.
  static QuantizedGPT load(const std::string& path);

 private:
  QuantizedGPT() = default;
  nn::GPTConfig config_;
  QuantizeOptions options_;
  Tensor<fp32> wte_, wpe_, ln_f_w_, ln_f_b_;
  std::vector<Block> blocks_;
  std::unique_ptr<QuantizedLinear> lm_head_;  // with QuantizeOptions::lm_head
  bool calibrating_ = false;                  // calibrate(): the layers run with dynamic scales meanwhile
};

/// A quantized linear layer on a GPU: the int8 weights, their scales, the bias and the static input scale of a
/// QuantizedLinear copied to the device; forward quantizes the input there and runs cuBLASLt's int8 GEMM with
/// the same dequantization (Note [int8 GEMM on the GPU]), so it computes what the CPU layer computes.
class CudaQuantizedLinear {
 public:
  explicit CudaQuantizedLinear(const QuantizedLinear& l)
      : q_(l.weights().q.template to<cuda>()),
        scale_(l.weights().scale.template to<cuda>()),
        input_scale_(l.input_scale()) {
    if (l.has_bias()) bias_ = l.bias().template to<cuda>();
  }
  /// x (..., K) fp32 on the GPU -> (..., N).
  Tensor<fp32, cuda> forward(const Tensor<fp32, cuda>& x) const {
    const std::int64_t K = q_.size(1), N = q_.size(0);
    TG_CHECK(x.dim() >= 1 && x.size(-1) == K, "CudaQuantizedLinear: the input's last dimension must be ", K, ", got shape ", x.shape());
    const Tensor<fp32, cuda> xc = x.detach().contiguous();
    const std::int64_t M = xc.numel() / std::max<std::int64_t>(K, 1);
    Shape out_shape = x.shape();
    out_shape[out_shape.size() - 1] = N;
    Tensor<fp32, cuda> y = Tensor<fp32, cuda>::empty(out_shape);
    if (M == 0) return y;
    Tensor<std::int8_t, cuda> qx = Tensor<std::int8_t, cuda>::empty({M, K});
    Tensor<fp32, cuda> sx = input_scale_ ? Tensor<fp32, cuda>::full({M}, *input_scale_) : Tensor<fp32, cuda>::empty({M});
    if (input_scale_) backend::cuda::quantize_int8_with_scale(xc.data(), M, K, K, *input_scale_, qx.data());
    else backend::cuda::quantize_rows_int8(xc.data(), M, K, K, qx.data(), sx.data());
    backend::cuda::gemm_s8_dequant(M, N, K, qx.data(), K, sx.data(), q_.data(), K, scale_.data(),
                                   bias_.defined() ? bias_.data() : nullptr, y.data(), N);
    return y;
  }

 private:
  Tensor<std::int8_t, cuda> q_;
  Tensor<fp32, cuda> scale_, bias_;
  std::optional<float> input_scale_;
};

/// A QuantizedGPT on a GPU (its tensors copied there; calibrate and save the CPU model): forward<fp32>(idx)
/// gives the logits on the device, as BasicGPT<cuda>::forward<fp32> does, so train::evaluate takes it.
class CudaQuantizedGPT {
 public:
  explicit CudaQuantizedGPT(const QuantizedGPT& q)
      : config_(q.config()),
        wte_(q.wte().to<cuda>()),
        wpe_(q.wpe().to<cuda>()),
        ln_f_w_(q.ln_f_weight().to<cuda>()),
        ln_f_b_(q.ln_f_bias().to<cuda>()) {
    TG_CHECK(q.options().activations == ActivationScheme::dynamic_per_token || q.calibrated(),
             "CudaQuantizedGPT: calibrate the model's static activation scales before copying it to the GPU");
    for (const QuantizedGPT::Block& b : q.blocks())
      blocks_.push_back({b.ln_1_w.to<cuda>(), b.ln_1_b.to<cuda>(), b.ln_2_w.to<cuda>(), b.ln_2_b.to<cuda>(),
                         CudaQuantizedLinear(b.c_attn), CudaQuantizedLinear(b.c_proj), CudaQuantizedLinear(b.c_fc),
                         CudaQuantizedLinear(b.mlp_proj)});
    if (q.lm_head()) lm_head_.emplace(*q.lm_head());
  }
  template <FloatingElement T>
  Tensor<T, cuda> forward(const Tensor<std::int64_t>& idx) const {
    static_assert(std::is_same_v<T, fp32>, "CudaQuantizedGPT::forward computes fp32 logits: call forward<tg::fp32>");
    return detail::int8_gpt_forward(config_, wte_, wpe_, blocks_, ln_f_w_, ln_f_b_, lm_head_ ? &*lm_head_ : nullptr, idx);
  }
  const nn::GPTConfig& config() const { return config_; }

 private:
  nn::GPTConfig config_;
  Tensor<fp32, cuda> wte_, wpe_, ln_f_w_, ln_f_b_;
  std::vector<detail::Int8Block<cuda, CudaQuantizedLinear>> blocks_;
  std::optional<CudaQuantizedLinear> lm_head_;
};

/// quantize(model, options) and, for static activation scales, calibrate(calibration): the inference model.
/// Static scales without calibration batches are an error.
QuantizedGPT quantize(const nn::GPT& model, const QuantizeOptions& options,
                      const std::vector<Tensor<std::int64_t>>& calibration = {});

}  // namespace tg::quant
