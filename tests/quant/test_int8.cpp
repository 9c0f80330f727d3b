// int8 post-training quantization (quant/int8.hpp): the quantizers' error bound (checked in fp64), the
// quantized linear layer against an exact integer reference, the quantized GPT against the float model, its
// static calibration, and its safetensors file: round trip and hostile files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include <typegrad/io/model_config.hpp>
#include <typegrad/io/safetensors.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/ops/cross_entropy.hpp>
#include <typegrad/quant/int8.hpp>

#include "../nn/gpt_test_util.hpp"

namespace test_int8_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::quant::ActivationScheme;

tg::nn::GPTConfig small_config() {
  tg::nn::GPTConfig c = tg::nn::GPTConfig::preset("tiny", 61);
  c.n_layer = 2;
  c.n_embd = 64;
  c.n_head = 4;
  c.block_size = 24;
  return c;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("tg_test_int8_" + std::to_string(::getpid()) + "_" + name)).string();
}

void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << part << "'";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(Int8Quantize, WeightsWithinHalfAScalePerElement) {
  tg::Generator g(3);
  auto W = tg::Tensor<float>::normal({37, 53}, 0.f, 0.5f, g);
  W.data()[5] = 4.f;  // a large outlier in row 0
  for (std::int64_t k = 0; k < 53; ++k) W.data()[7 * 53 + k] = 0.f;  // an all-zero row
  const auto q = tg::quant::quantize_weights(W);
  ASSERT_EQ(q.q.shape(), tg::Shape({37, 53}));
  ASSERT_EQ(q.scale.shape(), tg::Shape({37}));
  EXPECT_EQ(q.scale.data()[7], 1.f);
  for (std::int64_t n = 0; n < 37; ++n) {
    double m = 0;
    for (std::int64_t k = 0; k < 53; ++k) m = std::max(m, std::fabs(static_cast<double>(W.data()[n * 53 + k])));
    const double s = q.scale.data()[n];
    if (m > 0) EXPECT_NEAR(s, m / 127.0, 1e-7 * s);
    bool reaches_max = m == 0;
    for (std::int64_t k = 0; k < 53; ++k) {
      const int v = q.q.data()[n * 53 + k];
      EXPECT_GE(v, -127);
      EXPECT_LE(v, 127);
      reaches_max = reaches_max || std::abs(v) == 127;
      const double err = std::fabs(static_cast<double>(W.data()[n * 53 + k]) - s * v);  // exact in fp64
      EXPECT_LE(err, s / 2) << "row " << n << " col " << k;
    }
    EXPECT_TRUE(reaches_max) << "row " << n << ": its largest weight maps to +-127";
  }
  const auto back = tg::quant::dequantize_weights(q);
  for (std::int64_t i = 0; i < W.numel(); ++i)  // plus the rounding of s·q to fp32
    EXPECT_LE(std::fabs(static_cast<double>(back.data()[i]) - W.data()[i]), q.scale.data()[i / 53] / 2 + std::fabs(back.data()[i]) * 0x1p-24);
  auto bad = W.clone();
  bad.data()[100] = NAN;
  expect_error([&] { tg::quant::quantize_weights(bad, "h.0.mlp.c_fc.weight"); }, "h.0.mlp.c_fc.weight holds a non-finite value");
}

TEST(Int8Quantize, RowsDynamicAndStatic) {
  tg::Generator g(4);
  const auto x = tg::Tensor<float>::normal({9, 33}, 0.f, 2.f, g);
  std::vector<std::int8_t> q(9 * 33);
  std::vector<float> s(9);
  tg::quant::quantize_rows(x.data(), 9, 33, 33, q.data(), s.data());
  for (std::int64_t m = 0; m < 9; ++m)
    for (std::int64_t k = 0; k < 33; ++k)
      EXPECT_LE(std::fabs(static_cast<double>(x.data()[m * 33 + k]) - static_cast<double>(s[m]) * q[m * 33 + k]),
                s[m] / 2.0 + std::fabs(x.data()[m * 33 + k]) * 0x1p-24);
  // Static: values beyond the scale's range saturate at +-127.
  tg::quant::quantize_with_scale(x.data(), 9, 33, 33, 0.01f, q.data());
  for (std::int64_t i = 0; i < 9 * 33; ++i) {
    const double want = std::clamp(std::nearbyint(static_cast<double>(x.data()[i]) / 0.01), -127.0, 127.0);
    EXPECT_EQ(q[i], static_cast<int>(want));
  }
  expect_error([&] { tg::quant::quantize_with_scale(x.data(), 9, 33, 33, 0.f, q.data()); }, "positive and finite");
}

// The layer's output equals the integer product of its quantized operands, scaled: computed here in fp64 from
// the same quantized values, it must agree to fp32 rounding.
TEST(Int8Linear, MatchesTheIntegerReference) {
  tg::Generator g(5);
  const auto W = tg::Tensor<float>::normal({19, 70}, 0.f, 0.2f, g);
  const auto b = tg::Tensor<float>::normal({19}, 0.f, 0.1f, g);
  const auto x = tg::Tensor<float>::normal({2, 5, 70}, 0.f, 1.f, g);
  for (bool with_bias : {true, false}) {
    const tg::quant::QuantizedLinear l(tg::quant::quantize_weights(W), with_bias ? b.clone() : tg::Tensor<float>());
    const auto y = l.forward(x);
    ASSERT_EQ(y.shape(), tg::Shape({2, 5, 19}));
    std::vector<std::int8_t> qx(10 * 70);
    std::vector<float> sx(10);
    tg::quant::quantize_rows(x.data(), 10, 70, 70, qx.data(), sx.data());
    for (std::int64_t m = 0; m < 10; ++m)
      for (std::int64_t n = 0; n < 19; ++n) {
        std::int64_t acc = 0;
        for (std::int64_t k = 0; k < 70; ++k) acc += qx[m * 70 + k] * l.weights().q.data()[n * 70 + k];
        const float want = static_cast<float>(acc) * sx[m] * l.weights().scale.data()[n] + (with_bias ? b.data()[n] : 0.f);
        EXPECT_EQ(y.data()[m * 19 + n], want) << m << "," << n;  // the same fp32 operations, in the same order
      }
    // ... and it is close to the float layer.
    const auto ref = with_bias ? tg::linear(x, W, b) : tg::linear(x, W);
    for (std::int64_t i = 0; i < y.numel(); ++i) EXPECT_NEAR(y.data()[i], ref.data()[i], 0.05);
  }
  const tg::quant::QuantizedLinear l(tg::quant::quantize_weights(W), b.clone());
  expect_error([&] { l.forward(tg::Tensor<float>::zeros({3, 69})); }, "last dimension must be 70");
  expect_error([&] { tg::quant::QuantizedLinear(tg::quant::quantize_weights(W), tg::Tensor<float>::zeros({18})); }, "bias must have shape [19]");
}

TEST(Int8GPT, DynamicAndStaticTrackTheFloatModel) {
  tg::Generator gen(6);
  const tg::nn::GPT model(small_config(), gen);
  const auto idx = tg::testing::random_tokens(2, 24, 61, 7);
  const auto tgt = tg::testing::random_tokens(2, 24, 61, 8);
  const double ref = tg::cross_entropy(model.forward<float>(idx), tgt).item();
  const auto dyn = tg::quant::quantize(model, {});
  const double l_dyn = tg::cross_entropy(dyn.forward<float>(idx), tgt).item();
  EXPECT_NEAR(l_dyn, ref, 0.01 * ref);
  EXPECT_EQ(dyn.layers().size(), 8u);
  EXPECT_FALSE(dyn.calibrated());
  expect_error([&] { tg::quant::quantize(model, {.activations = ActivationScheme::static_per_tensor}); }, "calibration batches");
  const auto st = tg::quant::quantize(model, {.activations = ActivationScheme::static_per_tensor, .lm_head = true},
                                      {tg::testing::random_tokens(2, 24, 61, 9), tg::testing::random_tokens(1, 20, 61, 10)});
  EXPECT_TRUE(st.calibrated());
  EXPECT_EQ(st.layers().size(), 9u);
  for (const auto& [name, l] : st.layers()) EXPECT_GT(*l->input_scale(), 0.f) << name;
  const double l_st = tg::cross_entropy(st.forward<float>(idx), tgt).item();
  EXPECT_NEAR(l_st, ref, 0.03 * ref);
  // int8 weights take a quarter of the bytes of the quantized layers' fp32 weights.
  EXPECT_LT(dyn.bytes(), 4 * tg::nn::count_parameters(model.named_parameters()));
}

TEST(Int8GPT, SaveLoadRoundTripGivesTheSameLogits) {
  tg::Generator gen(11);
  const tg::nn::GPT model(small_config(), gen);
  const auto idx = tg::testing::random_tokens(2, 17, 61, 12);
  for (bool is_static : {false, true}) {
    const auto q = tg::quant::quantize(
        model, {.activations = is_static ? ActivationScheme::static_per_tensor : ActivationScheme::dynamic_per_token, .lm_head = is_static},
        {tg::testing::random_tokens(2, 24, 61, 13)});
    const std::string path = temp_path(is_static ? "static.safetensors" : "dynamic.safetensors");
    q.save(path);
    const auto back = tg::quant::QuantizedGPT::load(path);
    const auto a = q.forward<float>(idx), b = back.forward<float>(idx);
    ASSERT_EQ(a.shape(), b.shape());
    for (std::int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.data()[i], b.data()[i]) << i;
    EXPECT_EQ(back.options().activations, q.options().activations);
    EXPECT_EQ(back.options().lm_head, q.options().lm_head);
    std::filesystem::remove(path);
  }
}

// A hostile or mistaken file: every problem is an error naming the file and the tensor, before anything is built.
TEST(Int8GPT, HostileFilesAreClearErrors) {
  tg::Generator gen(14);
  const tg::nn::GPT model(small_config(), gen);
  const auto q = tg::quant::quantize(model, {});
  const std::string good = temp_path("good.safetensors");
  q.save(good);
  const auto rd = tg::io::SafetensorsReader::open(good);
  // Rewrites the file with `edit` applied to the tensors (by name) and the metadata.
  auto rewrite = [&](const std::string& name, auto&& edit) {
    tg::io::SafetensorsWriter w;
    for (const auto& t : rd.tensors()) {
      const auto bytes = rd.bytes(t.name);
      std::vector<std::uint8_t> copy(bytes.begin(), bytes.end());
      edit(w, t, copy);
    }
    for (const auto& [k, v] : rd.metadata())
      if (k != "tg.crc32c") w.set_metadata(k, v);
    const std::string path = temp_path(name);
    w.write(path);
    return path;
  };
  auto keep = [](tg::io::SafetensorsWriter& w, const tg::io::TensorInfo& t, std::vector<std::uint8_t>& b) {
    w.add_bytes(t.name, t.dtype, t.shape, b);
  };
  const std::string scale = "h.0.attn.c_attn.weight_scale";
  // A scale of the wrong shape.
  auto p1 = rewrite("scale_shape.safetensors", [&](auto& w, const auto& t, auto& b) {
    if (t.name == scale) w.add("h.0.attn.c_attn.weight_scale", tg::Tensor<float>::ones({5}));
    else keep(w, t, b);
  });
  expect_error([&] { tg::quant::QuantizedGPT::load(p1); }, "tensor 'h.0.attn.c_attn.weight_scale' has shape [5], expected [192]");
  // An I8 tensor where a float parameter belongs.
  auto p2 = rewrite("i8_float.safetensors", [&](auto& w, const auto& t, auto& b) {
    if (t.name == "h.1.ln_2.weight") w.add("h.1.ln_2.weight", tg::Tensor<std::int8_t>::ones({64}));
    else keep(w, t, b);
  });
  expect_error([&] { tg::quant::QuantizedGPT::load(p2); }, "tensor 'h.1.ln_2.weight' is I8, expected F32 (a float parameter or scale)");
  // A float tensor where the int8 weights belong.
  auto p3 = rewrite("float_i8.safetensors", [&](auto& w, const auto& t, auto& b) {
    if (t.name == "h.0.mlp.c_fc.weight") w.add("h.0.mlp.c_fc.weight", tg::Tensor<float>::ones({256, 64}));
    else keep(w, t, b);
  });
  expect_error([&] { tg::quant::QuantizedGPT::load(p3); }, "tensor 'h.0.mlp.c_fc.weight' is F32, expected I8");
  // A non-positive scale; a missing and an extra tensor; -128 in the weights; another format.
  auto p4 = rewrite("neg_scale.safetensors", [&](auto& w, const auto& t, auto& b) {
    if (t.name == scale) std::memset(b.data(), 0, 4);
    keep(w, t, b);
  });
  expect_error([&] { tg::quant::QuantizedGPT::load(p4); }, "holds the scale 0 at flat index 0; scales must be positive");
  auto p5 = rewrite("missing.safetensors", [&](auto& w, const auto& t, auto& b) {
    if (t.name != "h.1.attn.c_proj.bias") keep(w, t, b);
  });
  expect_error([&] { tg::quant::QuantizedGPT::load(p5); }, "missing tensor 'h.1.attn.c_proj.bias'");
  auto p6 = rewrite("extra.safetensors", [&](auto& w, const auto& t, auto& b) {
    keep(w, t, b);
    if (t.name == scale) w.add("lm_head.weight", tg::Tensor<std::int8_t>::ones({61, 64}));
  });
  expect_error([&] { tg::quant::QuantizedGPT::load(p6); }, "unexpected tensor 'lm_head.weight'");
  auto p7 = rewrite("minus128.safetensors", [&](auto& w, const auto& t, auto& b) {
    if (t.name == "h.0.attn.c_proj.weight") b[3] = 0x80;
    keep(w, t, b);
  });
  expect_error([&] { tg::quant::QuantizedGPT::load(p7); }, "holds -128 at flat index 3");
  expect_error([&] { tg::quant::QuantizedGPT::load(temp_path("absent.safetensors")); }, "absent.safetensors");
  tg::io::SafetensorsWriter plain;
  plain.add("x", tg::Tensor<float>::ones({2}));
  plain.set_metadata("format", "pt");
  const std::string p8 = temp_path("plain.safetensors");
  plain.write(p8);
  expect_error([&] { tg::quant::QuantizedGPT::load(p8); }, "not an int8 model file");
  for (const auto& p : {good, p1, p2, p3, p4, p5, p6, p7, p8}) std::filesystem::remove(p);
}

}  // namespace

}  // namespace test_int8_cpp
