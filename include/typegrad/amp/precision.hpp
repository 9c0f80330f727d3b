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

// Note [precision policies]
// Precision<Param, Compute, Grad, Accum>:
//   Param   the master copy the optimizer updates (fp32; fp64 allowed for numerical checks);
//   Compute the storage type of activations and of the per-step low-precision weight copies that the
//           GEMMs read (autocast.hpp says which ops run in it);
//   Grad    the type gradients have when they reach the masters (the optimizer reads these);
//   Accum   the type sums and dot products accumulate in (GEMMs, norms, reductions, losses).
// The named policies keep Param = Grad = Accum = fp32 and differ only in Compute. An fp16 compute type
// has 5 exponent bits: gradients below 2^-24 flush to zero, so a policy with fp16 compute requires a
// loss scaler (scaler.hpp, Note [loss scaling]); bf16 has fp32's exponent range and does not.
template <FloatingElement Param, FloatingElement Compute, FloatingElement Grad, FloatingElement Accum>
struct Precision {
  static_assert(std::is_same_v<Param, fp32> || std::is_same_v<Param, fp64>,
                "tg::amp::Precision: Param (the master weights) must be tg::fp32 or tg::fp64; keep 16-bit types "
                "for Compute");
  static_assert(std::is_same_v<Grad, Param>,
                "tg::amp::Precision: Grad must equal Param (the optimizer reads master-typed gradients)");
  static_assert(std::is_same_v<Accum, fp32> || std::is_same_v<Accum, fp64>,
                "tg::amp::Precision: Accum must be tg::fp32 or tg::fp64 (16-bit sums lose the small terms)");
  using param_type = Param;
  using compute_type = Compute;
  using grad_type = Grad;
  using accum_type = Accum;
  /// Whether the compute type needs a loss scaler (fp16's 5-bit exponent).
  static constexpr bool requires_loss_scaling = std::is_same_v<Compute, fp16>;
  /// Whether the forward runs on low-precision copies of the masters.
  static constexpr bool uses_weight_copies = !std::is_same_v<Compute, Param>;
};

using fp32_policy = Precision<fp32, fp32, fp32, fp32>;
using bf16_mixed = Precision<fp32, bf16, fp32, fp32>;
using fp16_mixed = Precision<fp32, fp16, fp32, fp32>;

template <class P>
struct is_precision : std::false_type {};
template <class Pa, class C, class G, class A>
struct is_precision<Precision<Pa, C, G, A>> : std::true_type {};
template <class P>
concept PrecisionPolicy = is_precision<P>::value;

/// The policy's CLI name: "fp32", "bf16", "fp16" for the named policies, else "<param>/<compute>".
template <PrecisionPolicy P>
constexpr std::string_view policy_name() {
  if constexpr (std::is_same_v<P, fp32_policy>) return "fp32";
  else if constexpr (std::is_same_v<P, bf16_mixed>) return "bf16";
  else if constexpr (std::is_same_v<P, fp16_mixed>) return "fp16";
  else return dtype_traits<typename P::compute_type>::name;
}

/// The one run-time -> type boundary for precision: calls f.template operator()<Policy>() for "fp32",
/// "bf16" or "fp16" and returns its result; any other name is a tg::Error naming the choices.
template <class F>
decltype(auto) with_precision(std::string_view name, F&& f) {
  if (name == "fp32") return f.template operator()<fp32_policy>();
  if (name == "bf16") return f.template operator()<bf16_mixed>();
  if (name == "fp16") return f.template operator()<fp16_mixed>();
  throw Error("precision: unknown precision '", name, "' (expected fp32, bf16 or fp16)");
}

}  // namespace tg::amp
