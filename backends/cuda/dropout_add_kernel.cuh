// dropout_add's kernel (Note [fused dropout and residual add] in ops/dropout_add.hpp). Included by dropout_add.cu
// inside its anonymous namespace (in tg::backend::cuda); it includes nothing itself (it sits inside a namespace):
// the includer supplies acc_t, math, scalar_cast, ::tg::detail::philox_words / uniform_from_bits, TG_GRID_STRIDE,
// __fmul_rn / __dmul_rn and the CUDA built-ins (dropout_add.cu through common.cuh and typegrad/core/random.hpp).
// tests/cuda/test_elementwise_emulated.cpp supplies host versions of them and runs the kernel's body, unchanged,
// on the CPU.

// The product rounded on its own, never merged into a fused multiply-add with the add that follows: the
// unfused pair stores it first.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

template <class T>
__global__ void dropout_add_kernel(const T* x, const T* r, T* out, std::int64_t n, std::uint64_t seed,
                                   std::uint64_t offset, const std::uint64_t* base, float p, acc_t<T> scale) {
  using A = acc_t<T>;
  if (base) offset += *base;  // Note [the Philox base in memory]
  const std::int64_t lead = static_cast<std::int64_t>(offset % 4);  // as dropout_kernel: one thread per Philox counter
  TG_GRID_STRIDE(c, (lead + n + 3) / 4) {
    const auto w = ::tg::detail::philox_words(seed, offset / 4 + static_cast<std::uint64_t>(c));
    for (int j = 0; j < 4; ++j) {
      const std::int64_t i = 4 * c + j - lead;
      if (i < 0 || i >= n) continue;
      const bool keep = math::dropout_keep(::tg::detail::uniform_from_bits(w[j]), p);
      const T d = scalar_cast<T>(keep ? mul_rn(scalar_cast<A>(r[i]), scale) : A(0));
      out[i] = scalar_cast<T>(scalar_cast<A>(x[i]) + scalar_cast<A>(d));
    }
  }
}
