// e^x in fp32 without libm calls or branches, so that loops over it vectorize, and the row helpers built on
// it (row max, sum of exponentials, scaled exponentials) for the CPU backend's softmax, cross-entropy,
// attention and unary kernels (backends/cpu/nn.cpp, attention.cpp, unary.cpp). A private helper of the
// backend, not part of the API.
//
// Note [vectorizable exp]
// libm's expf is one call per element, which keeps every loop that uses it scalar: in a GPT-2 training step
// on 2 threads (B=4, T=64, fp32) the cross-entropy over 50257 logits and GELU's exponentials took about 8%
// of the step in __expf_fma alone (perf, 2026-12-04). exp_f32 computes e^x as 2^n · e^r: n = round(x·log2 e)
// (the 1.5·2^23 trick, exact for |x·log2 e| < 2^22), r = x − n·ln 2 with ln 2 in two parts (Cody and
// Waite; n·ln2_hi is exact for |n| <= 2^8), e^r by its degree-7 Taylor polynomial on |r| <= ln2/2 (the
// truncation error, r^8/8! <= 5.2e-9 relative, is below half an fp32 ulp), and 2^n as the product of two
// powers of two built in the exponent field, so that results in the subnormal range round once, as a
// multiplication does. The argument is clamped to [-104, 89]: beyond those e^x rounds to 0 or overflows
// to inf in fp32 anyway, and the clamped values give exactly that. NaN is returned as is. Against the
// exact e^x (tests/cpu/test_vec_exp.cpp, every 97th fp32 value of the normal range): at most 1.18 ulp
// (a correctly rounded exp is at most 0.5), and subnormal results within one subnormal step. The compiler
// must not reassociate (x + C) − C, which holds without -ffast-math (the project never uses it).
#pragma once

#include <bit>
#include <cstdint>
#include <limits>

#include "typegrad/detail/cpu/kernels.hpp"

namespace tg::backend::cpu::vec {

inline float exp_f32(float x) {
  const bool nan = x != x;
  float c = nan ? 0.f : x;
  c = c < -104.f ? -104.f : c;
  c = c > 89.f ? 89.f : c;
  const float n = (c * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(c·log2 e), in [-150, 128]
  const float r = (c - n * 0.693145751953125f) - n * 1.428606820309417232e-6f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const std::int32_t ni = static_cast<std::int32_t>(n), n1 = ni >> 1, n2 = ni - n1;  // each in [-75, 64]
  const float s1 = std::bit_cast<float>((n1 + 127) << 23), s2 = std::bit_cast<float>((n2 + 127) << 23);
  const float out = p * s1 * s2;
  return nan ? x : out;
}

/// tanh(x) with no branch and no libm call, so loops over it vectorize (Note [vectorized unary ops]): for
/// |x| < 0.4 the odd Taylor polynomial to x^15 (the next term is below 3e-10 of x there), above it
/// (1 - e)/(1 + e) with e = exp_f32(-2|x|) ≤ e^-0.8 (so 1 - e loses no digits) and the sign of x. Within a few
/// ulp of the correctly rounded tanh (tests/cpu/test_vec_exp.cpp); ±1 at ±inf, NaN for NaN, -0 for -0.
inline float tanh_f32(float x) {
  const float a = x < 0.f ? -x : x;
  const float z = x * x;
  float p = -929569.f / 638512875.f;
  p = p * z + 21844.f / 6081075.f;
  p = p * z - 1382.f / 155925.f;
  p = p * z + 62.f / 2835.f;
  p = p * z - 17.f / 315.f;
  p = p * z + 2.f / 15.f;
  p = p * z - 1.f / 3.f;
  const float small = x == 0.f ? x : x + x * z * p;  // ±0 kept (x·z·p would turn -0 into +0)
  const float e = exp_f32(-2.f * a);
  const float big = (1.f - e) / (1.f + e);
  const float large = x < 0.f ? -big : big;
  return a < 0.4f ? small : large;  // NaN: a < 0.4 is false, and e, big are NaN
}

/// Elements per chunk of the row helpers: 16-bit inputs are widened into a chunk-sized fp32 buffer first
/// (their conversions branch on NaN and subnormals, which would keep the exp loop scalar).
inline constexpr std::int64_t kExpChunk = 256;
/// Lanes of the sums: one zmm register of fp32 partial sums, added in a fixed order at the end.
inline constexpr int kSumLanes = 16;

/// max_j x[j] over n contiguous values (-inf for n == 0), NaNs skipped as the scalar `v > m ? v : m` loop
/// skips them: kSumLanes running maxima, so the loop vectorizes (one scalar chain of compares would not).
template <class T>
float max_of(const T* x, std::int64_t n) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  alignas(64) float buf[kExpChunk];
  float lanes[kSumLanes];
  for (float& l : lanes) l = kNegInf;
  for (std::int64_t i0 = 0; i0 < n; i0 += kExpChunk) {
    const std::int64_t m = n - i0 < kExpChunk ? n - i0 : kExpChunk;
    const float* v = buf;
    if constexpr (std::is_same_v<T, float>) {
      v = x + i0;
    } else {
      for (std::int64_t j = 0; j < m; ++j) buf[j] = scalar_cast<float>(x[i0 + j]);
    }
    const std::int64_t full = m / kSumLanes * kSumLanes;
    for (std::int64_t j = 0; j < full; j += kSumLanes)
      for (int l = 0; l < kSumLanes; ++l) lanes[l] = v[j + l] > lanes[l] ? v[j + l] : lanes[l];
    for (std::int64_t j = full; j < m; ++j) lanes[j - full] = v[j] > lanes[j - full] ? v[j] : lanes[j - full];
  }
  float best = kNegInf;
  for (float l : lanes) best = l > best ? l : best;
  return best;
}

/// Σ_j e^(x[j] − shift) over n contiguous values, summed in fp32 in kSumLanes interleaved partial sums
/// (a fixed order: the result does not depend on the thread count).
template <class T>
float sum_exp(const T* x, std::int64_t n, float shift) {
  alignas(64) float buf[kExpChunk];
  float lanes[kSumLanes] = {};
  for (std::int64_t i0 = 0; i0 < n; i0 += kExpChunk) {
    const std::int64_t m = n - i0 < kExpChunk ? n - i0 : kExpChunk;
    if constexpr (std::is_same_v<T, float>) {
      for (std::int64_t j = 0; j < m; ++j) buf[j] = exp_f32(x[i0 + j] - shift);
    } else {
      for (std::int64_t j = 0; j < m; ++j) buf[j] = scalar_cast<float>(x[i0 + j]);
      for (std::int64_t j = 0; j < m; ++j) buf[j] = exp_f32(buf[j] - shift);
    }
    const std::int64_t full = m / kSumLanes * kSumLanes;
    for (std::int64_t j = 0; j < full; j += kSumLanes)
      for (int l = 0; l < kSumLanes; ++l) lanes[l] += buf[j + l];
    for (std::int64_t j = full; j < m; ++j) lanes[j - full] += buf[j];
  }
  for (int w = kSumLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

/// out[j] = T(scale · e^(x[j] − shift)) over n contiguous values (out may be x).
template <class T>
void exp_scaled(const T* x, std::int64_t n, float shift, float scale, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    for (std::int64_t j = 0; j < n; ++j) out[j] = scale * exp_f32(x[j] - shift);
  } else {
    alignas(64) float buf[kExpChunk];
    for (std::int64_t i0 = 0; i0 < n; i0 += kExpChunk) {
      const std::int64_t m = n - i0 < kExpChunk ? n - i0 : kExpChunk;
      for (std::int64_t j = 0; j < m; ++j) buf[j] = scalar_cast<float>(x[i0 + j]);
      for (std::int64_t j = 0; j < m; ++j) buf[j] = scale * exp_f32(buf[j] - shift);
      for (std::int64_t j = 0; j < m; ++j) out[i0 + j] = scalar_cast<T>(buf[j]);
    }
  }
}

}  // namespace tg::backend::cpu::vec
