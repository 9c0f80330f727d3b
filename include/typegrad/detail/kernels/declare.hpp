// The one mechanism by which every device's op kernels are declared, instantiated and dispatched
// (Note [kernels declared once]). A family header lists its kernels once; the backends define them and
// instantiate them from the dtype lists below; ops call them with TG_BACKEND.
//   #define TG_KERNELS_MYOP(K, ...) K(void, myop_forward, (const T* x, T* y, std::int64_t n), __VA_ARGS__)
//   TG_DECLARE_KERNELS(TG_KERNELS_MYOP)                              // include/typegrad/detail/kernels/<family>.hpp
//   TG_INSTANTIATE_KERNELS(TG_KERNELS_MYOP, TG_FLOATING_TYPES)       // backends/cpu/<family>.cpp, backends/cuda/<family>.cu
//   TG_BACKEND(D, myop_forward<T>(x.data(), y.data(), n));           // the op
#pragma once

#include <cstdint>
#include <type_traits>

#include "typegrad/config.hpp"
#include "typegrad/core/device.hpp"
#include "typegrad/detail/kernels/launch_watch.hpp"

// Note [kernels declared once]
// A kernel is a function template over the element type T, with the same signature on every device:
// raw device pointers, shapes and scalars. Its family header lists it once, as one entry of a list macro,
//   #define TG_KERNELS_<FAMILY>(K, ...) K(return type, name, (parameters using T), __VA_ARGS__) ...
// and TG_DECLARE_KERNELS(list) turns the list into
//   * tg::backend::<name>_kernel<T>: the kernel's function type (an alias template);
//   * tg::backend::cpu::<name><T> and tg::backend::cuda::<name><T>: the declarations each backend defines;
//     in a build without the CUDA backend (TG_HAVE_CUDA 0) the cuda one is instead an inline definition that
//     throws a tg::Error saying so, so a CPU-only build links without any stub file.
// A backend defines the kernel as an ordinary template (`template <class T> void name(params) { ... }` in
// backends/cpu/<family>.cpp or backends/cuda/<family>.cu) and instantiates it with
//   TG_INSTANTIATE_KERNELS(list, TYPES)   // TYPES: TG_FLOATING_TYPES, TG_ALL_TYPES, TG_FP32_TYPES, TG_FP32_FP64_TYPES
// which writes `template <name>_kernel<T> name<T>;` for each kernel and type: an explicit instantiation
// whose function type comes from the alias, so no signature is written again. A definition whose
// parameters differ from the list's is a compile error there. So a kernel's signature is written three
// times, each where it must be: the list, the CPU definition and the CUDA definition.
// Ops dispatch with TG_BACKEND(D, name<T>(args...)): an `if constexpr` on the device tag, an expression
// whose value is the kernel's result (Note [backend dispatch]).
//
// Where the list lives. The original op families keep theirs in detail/kernels/<family>.hpp. An op added
// through the one-op path (docs/adding-an-op.md: rope, swiglu) keeps its list in its own op header,
// ops/<op>.hpp, in a kernel section at the top: the list, TG_DECLARE_KERNELS, its autocast rule
// (TG_AUTOCAST_RULE, amp/rule.hpp) and any scalar math both backends share (TG_HOST_DEVICE functions).
// Everything that needs tensors and autodiff (the op itself) follows inside
//   #ifndef TG_KERNELS_ONLY ... #endif
// and a kernel file, backends/cpu/<op>.cpp or backends/cuda/<op>.cu, starts with
//   #define TG_KERNELS_ONLY
//   #include "typegrad/ops/<op>.hpp"
// so it sees only the kernel section: the backends stay raw pointers and shapes (no Tensor, no tape) and
// nvcc never parses the autodiff headers (an edit of the op's forward or backward still rebuilds the kernel
// files, but their preprocessed text is unchanged, so ccache answers them).
// (The op header is #pragma once: a kernel file defines TG_KERNELS_ONLY before its first include of it.
// Users and tests include the header plainly and get both sections.)

namespace tg::backend {
/// Thrown by every CUDA entry point of a build without the CUDA backend.
[[noreturn]] void no_cuda_backend(const char* what);
}  // namespace tg::backend

/// The element types kernels are instantiated for: TYPES(X, A) calls X(type, A) for each.
#define TG_FLOATING_TYPES(X, A) X(::tg::fp64, A) X(::tg::fp32, A) X(::tg::fp16, A) X(::tg::bf16, A)
/// Every type of the dtype master list (Note [the dtype master list]; kernels.cpp checks the two agree).
#define TG_ALL_TYPES(X, A)                                                                                \
  X(::tg::fp64, A) X(::tg::fp32, A) X(::tg::fp16, A) X(::tg::bf16, A) X(std::int64_t, A) X(std::int32_t, A) \
  X(std::uint8_t, A) X(std::int8_t, A)
#define TG_FP32_TYPES(X, A) X(float, A)
#define TG_FP32_FP64_TYPES(X, A) X(float, A) X(double, A)

#define TG_KERNEL_ALIAS_(RET, NAME, PARAMS, ...) \
  template <class T>                             \
  using NAME##_kernel = RET PARAMS;
#define TG_KERNEL_DECLARE_(RET, NAME, PARAMS, ...) \
  template <class T>                               \
  RET NAME PARAMS;
#if TG_HAVE_CUDA
#define TG_KERNEL_DECLARE_CUDA_(RET, NAME, PARAMS, ...) TG_KERNEL_DECLARE_(RET, NAME, PARAMS)
#else
#define TG_KERNEL_DECLARE_CUDA_(RET, NAME, PARAMS, ...) \
  template <class T>                                    \
  [[noreturn]] inline RET NAME PARAMS {                 \
    ::tg::backend::no_cuda_backend(#NAME);              \
  }
#endif

#define TG_KERNEL_WATCHED_(RET, NAME, PARAMS, ...) \
  template <class T>                               \
  inline constexpr ::tg::backend::Watched<&::tg::backend::cpu::NAME<T>> NAME{#NAME};
#define TG_KERNEL_WATCHED_CUDA_(RET, NAME, PARAMS, ...) \
  template <class T>                                    \
  inline constexpr ::tg::backend::Watched<&::tg::backend::cuda::NAME<T>> NAME{#NAME};

/// Declares the kernels of `LIST` (Note [kernels declared once]).
#define TG_DECLARE_KERNELS(LIST)                 \
  namespace tg::backend {                        \
  LIST(TG_KERNEL_ALIAS_, _)                      \
  }                                              \
  namespace tg::backend::cpu {                   \
  LIST(TG_KERNEL_DECLARE_, _)                    \
  }                                              \
  namespace tg::backend::watched {               \
  LIST(TG_KERNEL_WATCHED_, _)                    \
  }                                              \
  namespace tg::backend::cuda {                  \
  LIST(TG_KERNEL_DECLARE_CUDA_, _)               \
  }                                              \
  namespace tg::backend::watched_cuda {          \
  LIST(TG_KERNEL_WATCHED_CUDA_, _)               \
  }

#define TG_KERNEL_INSTANTIATE_ONE_(T, NAME) template ::tg::backend::NAME##_kernel<T> NAME<T>;
#define TG_KERNEL_INSTANTIATE_(RET, NAME, PARAMS, TYPES) TYPES(TG_KERNEL_INSTANTIATE_ONE_, NAME)
/// Instantiates every kernel of `LIST` for every type of `TYPES`, in the backend namespace it is used in,
/// after the kernels' definitions.
#define TG_INSTANTIATE_KERNELS(LIST, TYPES) LIST(TG_KERNEL_INSTANTIATE_, TYPES)

// Note [backend dispatch]
// An op calls its kernel as TG_BACKEND(D, kernel<T>(args...)): an `if constexpr` on the device tag that
// calls backend::cuda::kernel for tg::cuda and backend::cpu::kernel otherwise, as an expression (the
// kernel's result, if any, is the macro's value). Both backends declare every kernel with one signature
// (Note [kernels declared once]), so the op's code (checks, shapes, saved values) is shared. Each branch
// calls the kernel through backend::watched::kernel (CPU) or backend::watched_cuda::kernel (CUDA), which
// reports the launch to a watcher when one is installed (Note [launch watch], launch_watch.hpp) and
// otherwise just calls it.
#define TG_BACKEND(D, ...)                                                                          \
  [&]() -> decltype(auto) {                                                                         \
    if constexpr (std::is_same_v<D, ::tg::cuda>) return ::tg::backend::watched_cuda::__VA_ARGS__; \
    else return ::tg::backend::watched::__VA_ARGS__;                                                \
  }()
