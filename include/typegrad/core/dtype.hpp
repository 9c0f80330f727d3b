// Scalar types and their traits: fp64, fp32, fp16, bf16 (plus integer index types).
//   tg::bf16 h(1.5f); float f = static_cast<float>(h);         // round-to-nearest-even both ways
//   static_assert(tg::dtype_traits<tg::fp16>::size == 2);
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>
#include <type_traits>

#include "typegrad/detail/macros.hpp"

namespace tg {

namespace detail {
TG_HOST_DEVICE TG_INLINE std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
TG_HOST_DEVICE TG_INLINE float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Note [16-bit conversions]
// fp32 -> fp16 / bf16 rounds to nearest, ties to even (IEEE 754 roundTiesToEven), overflows to inf,
// and produces fp16 subnormals exactly. NaN stays NaN with its payload truncated (a payload that would
// truncate to zero becomes the quiet bit), so every 16-bit pattern survives 16 -> 32 -> 16 unchanged.
// These are the bit-exact reference; vectorized kernels must agree with them.
TG_HOST_DEVICE inline std::uint16_t fp32_to_fp16_bits(float f) {
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t mag = x & 0x7fffffffu;
  if (mag >= 0x7f800000u) {  // inf or NaN
    if (mag == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    std::uint32_t payload = (mag >> 13) & 0x3ffu;
    if (payload == 0) payload = 0x200u;
    return static_cast<std::uint16_t>(sign | 0x7c00u | payload);
  }
  if (mag >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (mag < 0x38800000u) {  // below 2^-14: fp16 subnormal (or zero)
    // Adding 0.5 puts the fp16 subnormal unit 2^-24 in the last place of the fp32 mantissa, so the
    // FPU's own round-to-nearest-even does the rounding; the result's low bits are the fp16 mantissa.
    const float shifted = bits_float(mag) + 0.5f;
    return static_cast<std::uint16_t>(sign | (float_bits(shifted) - 0x3f000000u));
  }
  const std::uint32_t odd = (mag >> 13) & 1u;
  const std::uint32_t rounded = mag + 0x0fffu + odd - (112u << 23);  // rebias 127 -> 15, round
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}

TG_HOST_DEVICE inline float fp16_bits_to_fp32(std::uint16_t h) {
  const std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return bits_float(sign | float_bits(v));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

TG_HOST_DEVICE inline std::uint16_t fp32_to_bf16_bits(float f) {
  const std::uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign and the top payload bits, stay NaN
    std::uint32_t upper = x >> 16;
    if ((upper & 0x7fu) == 0) upper |= 0x40u;
    return static_cast<std::uint16_t>(upper);
  }
  const std::uint32_t odd = (x >> 16) & 1u;
  return static_cast<std::uint16_t>((x + 0x7fffu + odd) >> 16);
}

TG_HOST_DEVICE TG_INLINE float bf16_bits_to_fp32(std::uint16_t b) {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

struct FromBits {};
}  // namespace detail

/// IEEE 754 binary16. Trivially copyable, 2 bytes, layout-compatible with CUDA's __half.
struct fp16 {
  std::uint16_t bits = 0;
  fp16() = default;
  constexpr fp16(detail::FromBits, std::uint16_t b) : bits(b) {}
  TG_HOST_DEVICE explicit fp16(float f) : bits(detail::fp32_to_fp16_bits(f)) {}
  TG_HOST_DEVICE explicit fp16(double d) : fp16(static_cast<float>(d)) {}
  TG_HOST_DEVICE explicit fp16(int i) : fp16(static_cast<float>(i)) {}
  TG_HOST_DEVICE explicit operator float() const { return detail::fp16_bits_to_fp32(bits); }
  TG_HOST_DEVICE explicit operator double() const { return static_cast<double>(static_cast<float>(*this)); }
  static constexpr fp16 from_bits(std::uint16_t b) { return fp16(detail::FromBits{}, b); }
};

/// bfloat16: the top half of an fp32. Trivially copyable, layout-compatible with CUDA's __nv_bfloat16.
struct bf16 {
  std::uint16_t bits = 0;
  bf16() = default;
  constexpr bf16(detail::FromBits, std::uint16_t b) : bits(b) {}
  TG_HOST_DEVICE explicit bf16(float f) : bits(detail::fp32_to_bf16_bits(f)) {}
  TG_HOST_DEVICE explicit bf16(double d) : bf16(static_cast<float>(d)) {}
  TG_HOST_DEVICE explicit bf16(int i) : bf16(static_cast<float>(i)) {}
  TG_HOST_DEVICE explicit operator float() const { return detail::bf16_bits_to_fp32(bits); }
  TG_HOST_DEVICE explicit operator double() const { return static_cast<double>(static_cast<float>(*this)); }
  static constexpr bf16 from_bits(std::uint16_t b) { return bf16(detail::FromBits{}, b); }
};

static_assert(sizeof(fp16) == 2 && std::is_trivially_copyable_v<fp16>);
static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable_v<bf16>);

using fp32 = float;
using fp64 = double;

// Note [the dtype master list]
// One list of every element type; it generates the run-time enum (used in files and messages), the
// names, the sizes and the trait specializations. Add a type here and everything follows.
//   X(type, enum name, printed name, safetensors name)
#define TG_FOR_EACH_DTYPE(X)            \
  X(::tg::fp64, f64, "fp64", "F64")     \
  X(::tg::fp32, f32, "fp32", "F32")     \
  X(::tg::fp16, f16, "fp16", "F16")     \
  X(::tg::bf16, bf16, "bf16", "BF16")   \
  X(std::int64_t, i64, "int64", "I64")  \
  X(std::int32_t, i32, "int32", "I32")  \
  X(std::uint8_t, u8, "uint8", "U8")    \
  X(std::int8_t, i8, "int8", "I8")

/// The run-time element type, for files, messages and the one dispatch boundary.
enum class DType : std::uint8_t {
#define TG_X(type, e, name, st) e,
  TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X
};

constexpr std::string_view dtype_name(DType d) {
  switch (d) {
#define TG_X(type, e, name, st) \
  case DType::e:                \
    return name;
    TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X
  }
  return "?";
}
constexpr std::string_view dtype_safetensors_name(DType d) {
  switch (d) {
#define TG_X(type, e, name, st) \
  case DType::e:                \
    return st;
    TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X
  }
  return "?";
}
constexpr std::size_t dtype_size(DType d) {
  switch (d) {
#define TG_X(type, e, name, st) \
  case DType::e:                \
    return sizeof(type);
    TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X
  }
  return 0;
}

template <class T>
struct dtype_traits;  // specialized for every type of the master list; anything else is not an element type

template <>
struct dtype_traits<fp64> {
  static constexpr DType dtype = DType::f64;
  static constexpr std::string_view name = "fp64";
  static constexpr std::size_t size = 8;
  static constexpr bool is_floating = true;
  using accum_type = double;
  static constexpr double max_finite() { return std::numeric_limits<double>::max(); }
  static constexpr double epsilon() { return std::numeric_limits<double>::epsilon(); }
};
template <>
struct dtype_traits<fp32> {
  static constexpr DType dtype = DType::f32;
  static constexpr std::string_view name = "fp32";
  static constexpr std::size_t size = 4;
  static constexpr bool is_floating = true;
  using accum_type = float;
  static constexpr double max_finite() { return std::numeric_limits<float>::max(); }
  static constexpr double epsilon() { return std::numeric_limits<float>::epsilon(); }
};
template <>
struct dtype_traits<fp16> {
  static constexpr DType dtype = DType::f16;
  static constexpr std::string_view name = "fp16";
  static constexpr std::size_t size = 2;
  static constexpr bool is_floating = true;
  using accum_type = float;
  static constexpr double max_finite() { return 65504.0; }
  static constexpr double epsilon() { return 0.0009765625; }  // 2^-10
  static constexpr double min_normal() { return 6.103515625e-05; }  // 2^-14
};
template <>
struct dtype_traits<bf16> {
  static constexpr DType dtype = DType::bf16;
  static constexpr std::string_view name = "bf16";
  static constexpr std::size_t size = 2;
  static constexpr bool is_floating = true;
  using accum_type = float;
  static constexpr double max_finite() { return 3.3895313892515355e38; }  // (2 - 2^-7) * 2^127
  static constexpr double epsilon() { return 0.0078125; }  // 2^-7
};
#define TG_INT_TRAITS(T, E, N)                                                                  \
  template <>                                                                                   \
  struct dtype_traits<T> {                                                                      \
    static constexpr DType dtype = DType::E;                                                    \
    static constexpr std::string_view name = N;                                                 \
    static constexpr std::size_t size = sizeof(T);                                              \
    static constexpr bool is_floating = false;                                                  \
    using accum_type = std::int64_t;                                                            \
    static constexpr double max_finite() { return static_cast<double>(std::numeric_limits<T>::max()); } \
    static constexpr double epsilon() { return 1.0; }                                           \
  };
TG_INT_TRAITS(std::int64_t, i64, "int64")
TG_INT_TRAITS(std::int32_t, i32, "int32")
TG_INT_TRAITS(std::uint8_t, u8, "uint8")
TG_INT_TRAITS(std::int8_t, i8, "int8")
#undef TG_INT_TRAITS

template <class T>
concept Element = requires { dtype_traits<T>::dtype; };
template <class T>
concept FloatingElement = Element<T> && dtype_traits<T>::is_floating;
template <class T>
concept IndexElement = std::is_same_v<T, std::int64_t> || std::is_same_v<T, std::int32_t>;

template <class T>
using accum_t = typename dtype_traits<T>::accum_type;

/// Converts between any two element types (through fp32 for the 16-bit ones).
template <class To, class From>
TG_HOST_DEVICE TG_INLINE To scalar_cast(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<From, fp16> || std::is_same_v<From, bf16>) {
    return scalar_cast<To>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, fp16> || std::is_same_v<To, bf16>) {
    return To(static_cast<float>(v));
  } else {
    return static_cast<To>(v);
  }
}

}  // namespace tg
