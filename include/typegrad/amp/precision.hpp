// Precision policies as types: which element type holds the parameters, runs the forward/backward math,
// carries the gradients to the optimizer, and accumulates sums. One run-time boundary (with_precision)
// turns a CLI string into one of them.
//   using P = tg::amp::bf16_mixed;            // fp32 masters, bf16 compute, fp32 gradients and accumulation
//   tg::amp::with_precision("bf16", [&]<class Policy>() { train<Policy>(); });
#pragma once

#include <string_view>
#include <type_traits>

#include "typegrad/core/dtype.hpp"
#include "typegrad/core/error.hpp"

namespace tg::amp {

/// How fp32 matrix products may run on a GPU: IEEE fp32 FMAs, or TF32 tensor cores (products of inputs
/// rounded to 10 mantissa bits, sums in fp32; about 8x the fp32 rate on an H100/H200). CPUs have no TF32 unit:
/// there fp32 GEMMs are always IEEE.
enum class Fp32Matmul { ieee, tf32 };

// Note [precision policies]
// Precision<Param, Compute, Grad, Accum, Fp32Matmul = ieee>:
//   Param   the master copy the optimizer updates (fp32; fp64 allowed for numerical checks);
//   Compute the storage type of activations and of the per-step low-precision weight copies that the
//           GEMMs read (autocast.hpp says which ops run in it);
//   Grad    the type gradients have when they reach the masters (the optimizer reads these);
//   Accum   the type sums and dot products accumulate in (GEMMs, norms, reductions, losses).
// The named policies keep Param = Grad = Accum = fp32 and differ only in Compute. An fp16 compute type
// has 5 exponent bits: gradients below 2^-24 flush to zero, so a policy with fp16 compute requires a
// loss scaler (scaler.hpp, Note [loss scaling]); bf16 has fp32's exponent range and does not.
// The fifth parameter lets an fp32 policy ask for TF32 tensor cores in its GPU GEMMs (tf32_policy); nothing
// else asks for them (Fp32MatmulScope applies the choice, fp32_matmul.hpp).
template <FloatingElement Param, FloatingElement Compute, FloatingElement Grad, FloatingElement Accum,
          Fp32Matmul Matmul = Fp32Matmul::ieee>
struct Precision {
  static_assert(std::is_same_v<Param, fp32> || std::is_same_v<Param, fp64>,
                "tg::amp::Precision: Param (the master weights) must be tg::fp32 or tg::fp64; keep 16-bit types "
                "for Compute");
  static_assert(std::is_same_v<Grad, Param>,
                "tg::amp::Precision: Grad must equal Param (the optimizer reads master-typed gradients)");
  static_assert(std::is_same_v<Accum, fp32> || std::is_same_v<Accum, fp64>,
                "tg::amp::Precision: Accum must be tg::fp32 or tg::fp64 (16-bit sums lose the small terms)");
  static_assert(Matmul == Fp32Matmul::ieee || std::is_same_v<Compute, fp32>,
                "tg::amp::Precision: TF32 (Fp32Matmul::tf32) is a mode of fp32 compute; 16-bit compute types "
                "already run on tensor cores");
  using param_type = Param;
  using compute_type = Compute;
  using grad_type = Grad;
  using accum_type = Accum;
  /// Whether the compute type needs a loss scaler (fp16's 5-bit exponent).
  static constexpr bool requires_loss_scaling = std::is_same_v<Compute, fp16>;
  /// Whether the forward runs on low-precision copies of the masters.
  static constexpr bool uses_weight_copies = !std::is_same_v<Compute, Param>;
  /// How fp32 GEMMs run on a GPU (Fp32Matmul).
  static constexpr Fp32Matmul fp32_matmul = Matmul;
};

using fp32_policy = Precision<fp32, fp32, fp32, fp32>;
using bf16_mixed = Precision<fp32, bf16, fp32, fp32>;
using fp16_mixed = Precision<fp32, fp16, fp32, fp32>;
/// fp32 everywhere, with TF32 tensor cores for the GPU's fp32 GEMMs (on a CPU: the same as fp32_policy).
using tf32_policy = Precision<fp32, fp32, fp32, fp32, Fp32Matmul::tf32>;

template <class P>
struct is_precision : std::false_type {};
template <class Pa, class C, class G, class A, Fp32Matmul M>
struct is_precision<Precision<Pa, C, G, A, M>> : std::true_type {};
template <class P>
concept PrecisionPolicy = is_precision<P>::value;

/// The policy's CLI name: "fp32", "tf32", "bf16", "fp16" for the named policies, else the compute type's name.
template <PrecisionPolicy P>
constexpr std::string_view policy_name() {
  if constexpr (std::is_same_v<P, fp32_policy>) return "fp32";
  else if constexpr (std::is_same_v<P, bf16_mixed>) return "bf16";
  else if constexpr (std::is_same_v<P, fp16_mixed>) return "fp16";
  else if constexpr (std::is_same_v<P, tf32_policy>) return "tf32";
  else return dtype_traits<typename P::compute_type>::name;
}

/// The one run-time -> type boundary for precision: calls f.template operator()<Policy>() for "fp32",
/// "tf32", "bf16" or "fp16" and returns its result; any other name is a tg::Error naming the choices.
template <class F>
decltype(auto) with_precision(std::string_view name, F&& f) {
  if (name == "fp32") return f.template operator()<fp32_policy>();
  if (name == "tf32") return f.template operator()<tf32_policy>();
  if (name == "bf16") return f.template operator()<bf16_mixed>();
  if (name == "fp16") return f.template operator()<fp16_mixed>();
  throw Error("precision: unknown precision '", name, "' (expected fp32, tf32, bf16 or fp16)");
}

}  // namespace tg::amp
