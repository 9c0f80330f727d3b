// int8 post-training quantization (Note [int8 quantization] in quant/int8.hpp): weight and activation
// quantizers, the quantized linear layer, the quantized GPT's forward, calibration, and its safetensors format.
#include "typegrad/quant/int8.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "typegrad/detail/cpu/gemm_int8.hpp"
#include "typegrad/io/model_config.hpp"
#include "typegrad/io/safetensors.hpp"

namespace tg::quant {

namespace {

constexpr float kQMax = 127.f;

/// round-to-nearest-even of v (|v| <= 127.5 after the clamp below), as an int8 in [-127, 127].
/// (|v| <= 127 after the clamp: adding and removing 1.5·2^23 leaves v rounded to an integer, ties to even, in
/// the default rounding mode; plain adds, so the loop vectorizes where nearbyint would be a call.)
inline std::int8_t round_to_int8(float v) {
  constexpr float kRound = 12582912.f;  // 1.5 · 2^23
  v = std::min(std::max(v, -kQMax), kQMax);
  return static_cast<std::int8_t>(static_cast<int>((v + kRound) - kRound));
}

/// Quantizes n values with one scale: q = round(x / s), clamped to [-127, 127]. The quotient is rounded to fp32
/// first, so |x - s·q| <= s/2 + |x|·2^-24 (activations: the hot path, vectorized: divide, clamp, round to
/// nearest even, convert).
inline void quantize_span(const float* x, std::int64_t n, float s, std::int8_t* q) {
#pragma omp simd
  for (std::int64_t k = 0; k < n; ++k) q[k] = round_to_int8(x[k] / s);
}
/// The same with the quotient in fp64, so |x - s·q| <= s/2 holds exactly (weights: quantized once).
inline void quantize_span_exact(const float* x, std::int64_t n, float s, std::int8_t* q) {
  for (std::int64_t k = 0; k < n; ++k)
    q[k] = static_cast<std::int8_t>(std::nearbyint(std::clamp(static_cast<double>(x[k]) / static_cast<double>(s), -127.0, 127.0)));
}

inline float absmax(const float* x, std::int64_t n) {
  float m = 0.f;
#pragma omp simd reduction(max : m)
  for (std::int64_t k = 0; k < n; ++k) m = std::max(m, std::fabs(x[k]));
  return m;
}

/// The scale of a row whose largest magnitude is m: m / 127, or 1 for a zero row (any scale quantizes it to 0).
inline float scale_of(float m) { return m > 0.f ? m / kQMax : 1.f; }

}  // namespace

std::string_view activation_scheme_name(ActivationScheme s) {
  return s == ActivationScheme::dynamic_per_token ? "dynamic" : "static";
}

// ---- quantizers ---------------------------------------------------------------------------------------
Int8Weights quantize_weights(const Tensor<fp32>& W, const std::string& what) {
  TG_CHECK(W.dim() == 2, "quantize_weights: ", what, " must be 2-D [out, in], got shape ", W.shape());
  const Tensor<fp32> w = W.detach().contiguous();
  const std::int64_t N = w.size(0), K = w.size(1);
  Int8Weights out{Tensor<std::int8_t>::empty({N, K}), Tensor<fp32>::empty({N})};
  const float* src = w.data();
  for (std::int64_t i = 0; i < N * K; ++i)
    TG_CHECK(std::isfinite(src[i]), "quantize_weights: ", what, " holds a non-finite value (", src[i], ") at flat index ", i);
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const float s = scale_of(absmax(src + n * K, K));
    out.scale.data()[n] = s;
    quantize_span_exact(src + n * K, K, s, out.q.data() + n * K);
  }
  return out;
}

Tensor<fp32> dequantize_weights(const Int8Weights& w) {
  const std::int64_t N = w.q.size(0), K = w.q.size(1);
  Tensor<fp32> out = Tensor<fp32>::empty({N, K});
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t k = 0; k < K; ++k) out.data()[n * K + k] = w.scale.data()[n] * static_cast<float>(w.q.data()[n * K + k]);
  return out;
}

void quantize_rows(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx, std::int8_t* q, float* scale) {
#pragma omp parallel for schedule(static) if (M * K > 32768)
  for (std::int64_t m = 0; m < M; ++m) {
    const float s = scale_of(absmax(x + m * ldx, K));
    scale[m] = s;
    quantize_span(x + m * ldx, K, s, q + m * K);
  }
}

void quantize_with_scale(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx, float scale, std::int8_t* q) {
  TG_CHECK(std::isfinite(scale) && scale > 0.f, "quantize_with_scale: the scale must be positive and finite, got ", scale);
#pragma omp parallel for schedule(static) if (M * K > 32768)
  for (std::int64_t m = 0; m < M; ++m) quantize_span(x + m * ldx, K, scale, q + m * K);
}

// ---- QuantizedLinear ------------------------------------------------------------------------------------
QuantizedLinear::QuantizedLinear(Int8Weights w, Tensor<fp32> bias, std::optional<float> input_scale)
    : w_(std::move(w)), bias_(std::move(bias)) {
  TG_CHECK(w_.q.dim() == 2 && w_.q.is_contiguous(), "QuantizedLinear: the int8 weights must be a contiguous [out, in] tensor, got ",
           w_.q.shape());
  TG_CHECK(w_.scale.dim() == 1 && w_.scale.size(0) == w_.q.size(0), "QuantizedLinear: ", w_.q.size(0),
           " output channels need ", w_.q.size(0), " weight scales, got shape ", w_.scale.shape());
  TG_CHECK(w_.q.size(1) <= backend::cpu::kInt8MaxK, "QuantizedLinear: ", w_.q.size(1), " input features exceed the int8 GEMM's K limit ",
           backend::cpu::kInt8MaxK);
  for (std::int64_t n = 0; n < w_.scale.numel(); ++n)
    TG_CHECK(std::isfinite(w_.scale.data()[n]) && w_.scale.data()[n] > 0.f, "QuantizedLinear: weight scale ", n,
             " must be positive and finite, got ", w_.scale.data()[n]);
  if (bias_.defined()) {
    TG_CHECK(bias_.dim() == 1 && bias_.size(0) == w_.q.size(0), "QuantizedLinear: the bias must have shape [", w_.q.size(0),
             "], got ", bias_.shape());
    bias_ = bias_.detach().contiguous();
  }
  w_.scale = w_.scale.contiguous();
  set_input_scale(input_scale);
  packed_ = std::make_unique<backend::cpu::PackedInt8Weights>(w_.q.data(), w_.q.size(0), w_.q.size(1), w_.q.size(1));
}
QuantizedLinear::~QuantizedLinear() = default;
QuantizedLinear::QuantizedLinear(QuantizedLinear&&) noexcept = default;
QuantizedLinear& QuantizedLinear::operator=(QuantizedLinear&&) noexcept = default;

void QuantizedLinear::set_input_scale(std::optional<float> s) {
  if (s) TG_CHECK(std::isfinite(*s) && *s > 0.f, "QuantizedLinear: the input scale must be positive and finite, got ", *s);
  input_scale_ = s;
}

void QuantizedLinear::observe(bool on) const {
  observing_ = on;
  if (on) absmax_ = 0.f;
}

std::int64_t QuantizedLinear::bytes() const {
  return w_.q.numel() + 4 * (w_.scale.numel() + (has_bias() ? bias_.numel() : 0) + (input_scale_ ? 1 : 0));
}

Tensor<fp32> QuantizedLinear::forward(const Tensor<fp32>& x) const {
  const std::int64_t K = in_features(), N = out_features();
  TG_CHECK(x.dim() >= 1 && x.size(-1) == K, "QuantizedLinear: the input's last dimension must be ", K, ", got shape ", x.shape());
  const Tensor<fp32> xc = x.detach().contiguous();
  const std::int64_t M = xc.numel() / std::max<std::int64_t>(K, 1);
  Shape out_shape = x.shape();
  out_shape[out_shape.size() - 1] = N;
  Tensor<fp32> y = Tensor<fp32>::empty(out_shape);
  if (M == 0) return y;
  if (observing_) absmax_ = std::max(absmax_, absmax(xc.data(), xc.numel()));
  Tensor<std::int8_t> qx = Tensor<std::int8_t>::empty({M, K});
  Tensor<fp32> sx = Tensor<fp32>::empty({M});
  if (input_scale_) {
    quantize_with_scale(xc.data(), M, K, K, *input_scale_, qx.data());
    std::fill(sx.data(), sx.data() + M, *input_scale_);
  } else {
    quantize_rows(xc.data(), M, K, K, qx.data(), sx.data());
  }
  backend::cpu::gemm_s8_packed_dequant(M, qx.data(), K, sx.data(), *packed_, w_.scale.data(),
                                       has_bias() ? bias_.data() : nullptr, y.data(), N);
  return y;
}

// ---- QuantizedGPT ---------------------------------------------------------------------------------------
namespace {
QuantizedLinear quantize_linear(const nn::Linear& l, const std::string& name) {
  return QuantizedLinear(quantize_weights(l.weight(), name + ".weight"), l.has_bias() ? l.bias().detach().clone() : Tensor<fp32>());
}
Tensor<fp32> copy_of(const Tensor<fp32>& t) { return t.detach().clone(); }
}  // namespace

QuantizedGPT::QuantizedGPT(const nn::GPT& model, const QuantizeOptions& options) : config_(model.config()), options_(options) {
  config_.dropout = 0.f;  // inference
  wte_ = copy_of(model.wte().weight());
  wpe_ = copy_of(model.wpe().weight());
  ln_f_w_ = copy_of(model.ln_f().weight());
  ln_f_b_ = copy_of(model.ln_f().bias());
  for (std::size_t i = 0; i < model.blocks().size(); ++i) {
    const nn::Block& b = model.blocks()[i];
    const std::string p = "h." + std::to_string(i);
    blocks_.push_back(Block{copy_of(b.ln_1().weight()), copy_of(b.ln_1().bias()), copy_of(b.ln_2().weight()), copy_of(b.ln_2().bias()),
                            quantize_linear(b.attn().c_attn(), p + ".attn.c_attn"), quantize_linear(b.attn().c_proj(), p + ".attn.c_proj"),
                            quantize_linear(b.mlp().c_fc(), p + ".mlp.c_fc"), quantize_linear(b.mlp().c_proj(), p + ".mlp.c_proj")});
  }
  if (options_.lm_head)
    lm_head_ = std::make_unique<QuantizedLinear>(quantize_weights(wte_, "lm_head.weight"), Tensor<fp32>());
}
QuantizedGPT::QuantizedGPT(QuantizedGPT&&) noexcept = default;
QuantizedGPT& QuantizedGPT::operator=(QuantizedGPT&&) noexcept = default;
QuantizedGPT::~QuantizedGPT() = default;

Tensor<fp32> QuantizedGPT::forward_fp32(const Tensor<std::int64_t>& idx) const {
  TG_CHECK(options_.activations == ActivationScheme::dynamic_per_token || calibrating_ || calibrated(),
           "QuantizedGPT::forward: static activation scales are not calibrated yet (call calibrate with some batches)");
  return detail::int8_gpt_forward(config_, wte_, wpe_, blocks_, ln_f_w_, ln_f_b_, lm_head_.get(), idx);
}

std::vector<std::pair<std::string, const QuantizedLinear*>> QuantizedGPT::layers() const {
  std::vector<std::pair<std::string, const QuantizedLinear*>> out;
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    const std::string p = "h." + std::to_string(i);
    out.emplace_back(p + ".attn.c_attn", &blocks_[i].c_attn);
    out.emplace_back(p + ".attn.c_proj", &blocks_[i].c_proj);
    out.emplace_back(p + ".mlp.c_fc", &blocks_[i].c_fc);
    out.emplace_back(p + ".mlp.c_proj", &blocks_[i].mlp_proj);
  }
  if (lm_head_) out.emplace_back("lm_head", lm_head_.get());
  return out;
}

bool QuantizedGPT::calibrated() const {
  for (const auto& [name, l] : layers())
    if (!l->input_scale()) return false;
  return true;
}

void QuantizedGPT::calibrate(const std::vector<Tensor<std::int64_t>>& batches) {
  TG_CHECK(!batches.empty(), "QuantizedGPT::calibrate: static activation scales need at least one calibration batch");
  TG_CHECK(options_.activations == ActivationScheme::static_per_tensor,
           "QuantizedGPT::calibrate: the model uses dynamic per-token activation scales, which need no calibration");
  const auto ls = layers();
  for (const auto& [name, l] : ls) {
    const_cast<QuantizedLinear*>(l)->set_input_scale(std::nullopt);  // dynamic while observing
    l->observe(true);
  }
  calibrating_ = true;
  try {
    for (const Tensor<std::int64_t>& b : batches) forward_fp32(b);
  } catch (...) {
    calibrating_ = false;
    for (const auto& [name, l] : ls) l->observe(false);
    throw;
  }
  calibrating_ = false;
  for (const auto& [name, l] : ls) {
    l->observe(false);
    const float m = l->observed_absmax();
    TG_CHECK(std::isfinite(m), "QuantizedGPT::calibrate: the input of ", name, " reached a non-finite value");
    const_cast<QuantizedLinear*>(l)->set_input_scale(scale_of(m));
  }
}

std::int64_t QuantizedGPT::bytes() const {
  std::int64_t n = 4 * (wte_.numel() + wpe_.numel() + ln_f_w_.numel() + ln_f_b_.numel());
  for (const Block& b : blocks_) n += 4 * (b.ln_1_w.numel() + b.ln_1_b.numel() + b.ln_2_w.numel() + b.ln_2_b.numel());
  for (const auto& [name, l] : layers()) n += l->bytes();
  return n;
}

// Note [int8 safetensors]
// A quantized GPT is one safetensors file with checksums (Note [checksums]):
//   metadata  "format" "typegrad.int8", "format_version" "1", "tg.model" (io::gpt_config_json),
//             "tg.activations" "dynamic" | "static", "tg.lm_head" "fp32" | "int8"
//   tensors   wte.weight, wpe.weight, ln_f.*, h.{i}.ln_{1,2}.*       F32, as in a float checkpoint
//             <layer>.weight        I8 [out, in]   for h.{i}.attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
//             <layer>.weight_scale  F32 [out]      each > 0 and finite
//             <layer>.bias          F32 [out]
//             <layer>.input_scale   F32 [1]        static scales only
//             lm_head.weight, lm_head.weight_scale (and lm_head.input_scale)   with "tg.lm_head" "int8"
// Loading rebuilds the expected set of names, dtypes and shapes from the metadata and checks the file
// against it before anything is built: a missing or extra tensor, a wrong dtype (an I8 tensor where a float
// parameter belongs, or the reverse), a wrong shape or a bad scale is an error naming the file and tensor.

namespace {
constexpr const char* kInt8Format = "typegrad.int8";
constexpr const char* kInt8FormatVersion = "1";

struct Expected {
  DType dtype;
  Shape shape;
};
}  // namespace

void QuantizedGPT::save(const std::string& path) const {
  io::SafetensorsWriter w;
  w.add("wte.weight", wte_);
  w.add("wpe.weight", wpe_);
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    const std::string p = "h." + std::to_string(i);
    w.add(p + ".ln_1.weight", blocks_[i].ln_1_w);
    w.add(p + ".ln_1.bias", blocks_[i].ln_1_b);
    w.add(p + ".ln_2.weight", blocks_[i].ln_2_w);
    w.add(p + ".ln_2.bias", blocks_[i].ln_2_b);
  }
  w.add("ln_f.weight", ln_f_w_);
  w.add("ln_f.bias", ln_f_b_);
  for (const auto& [name, l] : layers()) {
    w.add(name + ".weight", l->weights().q);
    w.add(name + ".weight_scale", l->weights().scale);
    if (l->has_bias()) w.add(name + ".bias", l->bias());
    if (l->input_scale()) w.add(name + ".input_scale", Tensor<fp32>::full({1}, *l->input_scale()));
  }
  w.set_metadata("format", kInt8Format);
  w.set_metadata("format_version", kInt8FormatVersion);
  w.set_metadata("tg.model", io::gpt_config_json(config_));
  w.set_metadata("tg.activations", std::string(activation_scheme_name(options_.activations)));
  w.set_metadata("tg.lm_head", options_.lm_head ? "int8" : "fp32");
  w.write(path);
}

QuantizedGPT QuantizedGPT::load(const std::string& path) {
  const io::SafetensorsReader rd = io::SafetensorsReader::open(path);
  auto fail = [&](auto&&... parts) -> void { throw Error("int8 model: ", path, ": ", parts...); };
  if (rd.metadata_value("format") != std::string(kInt8Format))
    fail("not an int8 model file (metadata \"format\" is ", rd.metadata_value("format").value_or("absent"), ", expected '", kInt8Format,
         "'; train_gpt --quantize ... --quantize-save writes one)");
  if (rd.metadata_value("format_version") != std::string(kInt8FormatVersion))
    fail("unsupported format_version ", rd.metadata_value("format_version").value_or("(absent)"), ", this build reads ", kInt8FormatVersion);
  rd.verify_checksums(/*required=*/true);
  const auto model_json = rd.metadata_value("tg.model");
  if (!model_json) fail("metadata \"tg.model\" is missing");
  QuantizedGPT q;
  q.config_ = io::gpt_config_from_json(*model_json, path);
  const auto acts = rd.metadata_value("tg.activations").value_or("");
  if (acts != "dynamic" && acts != "static") fail("metadata \"tg.activations\" must be 'dynamic' or 'static', got '", acts, "'");
  q.options_.activations = acts == "static" ? ActivationScheme::static_per_tensor : ActivationScheme::dynamic_per_token;
  const auto head = rd.metadata_value("tg.lm_head").value_or("");
  if (head != "fp32" && head != "int8") fail("metadata \"tg.lm_head\" must be 'fp32' or 'int8', got '", head, "'");
  q.options_.lm_head = head == "int8";

  // Every tensor the metadata implies, then the file against it.
  const nn::GPTConfig& c = q.config_;
  const std::int64_t C = c.n_embd;
  const bool is_static = q.options_.activations == ActivationScheme::static_per_tensor;
  std::map<std::string, Expected> expect;
  expect["wte.weight"] = {DType::f32, {c.vocab_size, C}};
  expect["wpe.weight"] = {DType::f32, {c.block_size, C}};
  expect["ln_f.weight"] = {DType::f32, {C}};
  expect["ln_f.bias"] = {DType::f32, {C}};
  auto quantized = [&](const std::string& name, std::int64_t out, std::int64_t in, bool bias) {
    expect[name + ".weight"] = {DType::i8, {out, in}};
    expect[name + ".weight_scale"] = {DType::f32, {out}};
    if (bias) expect[name + ".bias"] = {DType::f32, {out}};
    if (is_static) expect[name + ".input_scale"] = {DType::f32, {1}};
  };
  for (std::int64_t i = 0; i < c.n_layer; ++i) {
    const std::string p = "h." + std::to_string(i);
    for (const char* ln : {".ln_1", ".ln_2"}) {
      expect[p + ln + ".weight"] = {DType::f32, {C}};
      expect[p + ln + ".bias"] = {DType::f32, {C}};
    }
    quantized(p + ".attn.c_attn", 3 * C, C, true);
    quantized(p + ".attn.c_proj", C, C, true);
    quantized(p + ".mlp.c_fc", 4 * C, C, true);
    quantized(p + ".mlp.c_proj", C, 4 * C, true);
  }
  if (q.options_.lm_head) quantized("lm_head", c.vocab_size, C, false);
  for (const io::TensorInfo& t : rd.tensors())
    if (!expect.count(t.name)) fail("unexpected tensor '", t.name, "' (not part of a quantized GPT of this configuration)");
  for (const auto& [name, e] : expect) {
    if (!rd.contains(name)) fail("missing tensor '", name, "'");
    const io::TensorInfo& t = rd.info(name);
    if (t.dtype != e.dtype)
      fail("tensor '", name, "' is ", dtype_safetensors_name(t.dtype), ", expected ", dtype_safetensors_name(e.dtype),
           e.dtype == DType::i8 ? " (the int8 weights of a quantized layer)" : " (a float parameter or scale)");
    if (!(t.shape == e.shape)) fail("tensor '", name, "' has shape ", t.shape, ", expected ", e.shape);
    if (e.dtype == DType::f32) {
      const Tensor<fp32> v = rd.get<fp32>(name);
      const bool is_scale = name.ends_with("_scale");
      for (std::int64_t k = 0; k < v.numel(); ++k) {
        const float x = v.data()[k];
        if (!std::isfinite(x)) fail("tensor '", name, "' holds a non-finite value at flat index ", k);
        if (is_scale && !(x > 0.f)) fail("tensor '", name, "' holds the scale ", x, " at flat index ", k, "; scales must be positive");
      }
    } else {
      const auto bytes = rd.bytes(name);
      for (std::size_t k = 0; k < bytes.size(); ++k)
        if (static_cast<std::int8_t>(bytes[k]) == -128)
          fail("tensor '", name, "' holds -128 at flat index ", k, "; symmetric int8 weights lie in [-127, 127]");
    }
  }
  // Build.
  q.wte_ = rd.get<fp32>("wte.weight");
  q.wpe_ = rd.get<fp32>("wpe.weight");
  q.ln_f_w_ = rd.get<fp32>("ln_f.weight");
  q.ln_f_b_ = rd.get<fp32>("ln_f.bias");
  auto layer = [&](const std::string& name, bool bias) {
    std::optional<float> s;
    if (is_static) s = rd.get<fp32>(name + ".input_scale").data()[0];
    return QuantizedLinear({rd.get<std::int8_t>(name + ".weight"), rd.get<fp32>(name + ".weight_scale")},
                           bias ? rd.get<fp32>(name + ".bias") : Tensor<fp32>(), s);
  };
  for (std::int64_t i = 0; i < c.n_layer; ++i) {
    const std::string p = "h." + std::to_string(i);
    q.blocks_.push_back(Block{rd.get<fp32>(p + ".ln_1.weight"), rd.get<fp32>(p + ".ln_1.bias"), rd.get<fp32>(p + ".ln_2.weight"),
                              rd.get<fp32>(p + ".ln_2.bias"), layer(p + ".attn.c_attn", true), layer(p + ".attn.c_proj", true),
                              layer(p + ".mlp.c_fc", true), layer(p + ".mlp.c_proj", true)});
  }
  if (q.options_.lm_head) q.lm_head_ = std::make_unique<QuantizedLinear>(layer("lm_head", false));
  return q;
}

QuantizedGPT quantize(const nn::GPT& model, const QuantizeOptions& options, const std::vector<Tensor<std::int64_t>>& calibration) {
  QuantizedGPT q(model, options);
  if (options.activations == ActivationScheme::static_per_tensor) {
    TG_CHECK(!calibration.empty(), "quantize: static activation scales need calibration batches (or use dynamic per-token scales)");
    q.calibrate(calibration);
  }
  return q;
}

}  // namespace tg::quant
