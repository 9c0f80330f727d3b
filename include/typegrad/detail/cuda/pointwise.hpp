// Elementwise expressions compiled at run time with NVRTC (Note [pointwise kernels through NVRTC]): the CUDA
// half of tg::pointwise. Plain C++ (no CUDA headers); backends/cuda/pointwise_nvrtc.cpp implements it.
//   std::string src = pointwise_source(DType::bf16, 3, "(tg_tanh(x0) * x2)");   // tg_pw_fwd and tg_pw_bwd
//   std::string why;  if (!pointwise_run(src, false, args, &why)) ...   // fall back to tensor ops
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>
#include <tuple>

#include "typegrad/core/dtype.hpp"

namespace tg::backend::cuda {

inline constexpr int kPointwiseMaxOperands = 8;
inline constexpr int kPointwiseMaxLiterals = 16;  // literals passed as launch arguments (more: written into the source)

/// One launch's operands and index space, passed by value to the generated kernel (its layout is repeated in
/// the generated source: every member 8 bytes wide).
struct PointwiseArgs {
  const void* in[kPointwiseMaxOperands] = {};  // the inputs (then, backward, the output's gradient, contiguous)
  void* out[kPointwiseMaxOperands] = {};       // forward: out[0]; backward: each input's gradient (null: unused)
  std::int64_t n = 0;                          // elements of the (broadcast) output
  std::int64_t nd = 0;                         // dims of the output
  std::int64_t size[8] = {};
  std::int64_t st[kPointwiseMaxOperands][8] = {};  // input k's strides over the output's dims (0: broadcast)
  double lit[kPointwiseMaxLiterals] = {};           // the expression's literal table, L[k] in the source
  /// Its fields for the launch watch (Note [launch watch]: an aggregate with array members names its fields).
  auto watch_fields() const { return std::tie(in, out, n, nd, size, st, lit); }
};

/// The CUDA translation unit for expression `expr` (over x0 .. x{K-1} and the literal table L, in the generated
/// names tg_exp, tg_lit<S>, ...), for element type `dtype`: kernels tg_pw_fwd and tg_pw_bwd.
std::string pointwise_source(DType dtype, int K, const std::string& expr);
/// `source` compiled by NVRTC to PTX for compute_80; throws tg::Error with NVRTC's log when it does not compile.
/// Needs no GPU (tests run it everywhere the backend is built).
std::string pointwise_ptx(const std::string& source);
/// NVRTC's target for a GPU of compute capability `cc` (major * 10 + minor) given the architectures it knows
/// (nvrtcGetSupportedArchs): {"sm_XY", true} for a cubin of the GPU's own architecture or else the highest known one
/// of its major below it; {"compute_XY", false} for PTX of the highest known architecture below the GPU (one newer
/// than the toolkit: the driver compiles it); {"", false} when every known architecture is newer than the GPU.
std::pair<std::string, bool> pointwise_target(int cc, const std::vector<int>& known);
/// Compiles `source` for the current GPU and loads both its kernels (once per source and device; a failure is
/// remembered too), then launches tg_pw_bwd (backward) or tg_pw_fwd on the current stream. False, with the reason
/// in *why, when NVRTC, the module load or the launch fails: the caller then runs the expression as tensor ops.
bool pointwise_run(const std::string& source, bool backward, const PointwiseArgs& args, std::string* why);
/// How many translation units pointwise_run has compiled (and tried to load) in this process.
std::int64_t pointwise_compiles();

}  // namespace tg::backend::cuda
