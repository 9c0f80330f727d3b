// The elementwise kernels of elementwise.cu (strided copies and casts, binary ops with broadcasting, unary ops
// forward and backward, dropout, masked_fill) and the element functions it passes to detail::vector_map (Note
// [vector elementwise maps]). Included by elementwise.cu inside its anonymous namespace (in tg::backend::cuda); it
// includes nothing itself (it sits inside a namespace): the includer supplies acc_t, Geo, math, scalar_cast,
// ::tg::detail::philox_words / uniform_from_bits, TG_GRID_STRIDE and the CUDA built-ins (elementwise.cu through
// common.cuh, typegrad/core/random.hpp and its using declarations). tests/cuda/test_elementwise_emulated.cpp
// supplies host versions of them and runs these kernels' bodies, unchanged, on the CPU.

// ---- kernels --------------------------------------------------------------------------------------------
template <class S, class T>
__global__ void copy_kernel(const S* src, T* dst, std::int64_t n, Geo g) {
  TG_GRID_STRIDE(i, n) {
    std::int64_t off[2];
    g.offsets(i, off);
    dst[off[1]] = scalar_cast<T>(src[off[0]]);
  }
}
template <class S, class T>
__global__ void copy_contiguous_kernel(const S* src, T* dst, std::int64_t n) {
  TG_GRID_STRIDE(i, n) dst[i] = scalar_cast<T>(src[i]);
}

template <class T>
__global__ void binary_kernel(math::Binary op, const T* a, const T* b, T* out, std::int64_t n, Geo g) {
  using A = acc_t<T>;
  TG_GRID_STRIDE(i, n) {
    std::int64_t off[2];
    g.offsets(i, off);
    const A x = scalar_cast<A>(a[off[0]]), y = scalar_cast<A>(b[off[1]]);
    out[i] = scalar_cast<T>(math::apply<A>(op, x, y));
  }
}

template <class T>
__global__ void unary_forward_kernel(math::Unary op, const T* x, T* y, std::int64_t n, Geo g) {
  using A = acc_t<T>;
  TG_GRID_STRIDE(i, n) y[i] = scalar_cast<T>(math::apply<A>(op, scalar_cast<A>(x[g.offset(i, 0)])));
}

template <class T>
__global__ void unary_backward_kernel(math::Unary op, const T* saved, const T* dy, T* dx, std::int64_t n, Geo g) {
  using A = acc_t<T>;
  const bool out_saved = math::uses_output(op);
  TG_GRID_STRIDE(i, n) {
    std::int64_t off[2];
    g.offsets(i, off);
    const A s = scalar_cast<A>(saved[off[0]]);
    // the saved value goes in the slot math::grad reads (x or y), as on the CPU
    const A d = out_saved ? math::grad<A>(op, A(0), s) : math::grad<A>(op, s, A(0));
    dx[i] = scalar_cast<T>(scalar_cast<A>(dy[off[1]]) * d);
  }
}

/// Dropout over n elements whose mask starts at word position `offset` (Note [dropout replays its mask]): one
/// thread per Philox counter, which decides its four words' elements (the first and the last counter may hold
/// fewer of them); a grid for (offset % 4 + n + 3) / 4 items covers them once (any grid does, striding). With
/// `base` not null the position is offset + *base (Note [the Philox base in memory]).
template <class T>
__global__ void dropout_kernel(const T* x, T* y, std::int64_t n, Geo g, std::uint64_t seed, std::uint64_t offset,
                               const std::uint64_t* base, float p, acc_t<T> scale) {
  using A = acc_t<T>;
  if (base) offset += *base;
  const std::int64_t lead = static_cast<std::int64_t>(offset % 4);  // the first counter's words before element 0
  TG_GRID_STRIDE(c, (lead + n + 3) / 4) {
    const auto w = ::tg::detail::philox_words(seed, offset / 4 + static_cast<std::uint64_t>(c));
    for (int j = 0; j < 4; ++j) {
      const std::int64_t i = 4 * c + j - lead;
      if (i < 0 || i >= n) continue;
      const bool keep = math::dropout_keep(::tg::detail::uniform_from_bits(w[j]), p);
      y[i] = scalar_cast<T>(keep ? scalar_cast<A>(x[g.offset(i, 0)]) * scale : A(0));
    }
  }
}

template <class T>
__global__ void masked_fill_kernel(const T* x, const std::uint8_t* mask, T value, T* y, std::int64_t n, Geo g) {
  TG_GRID_STRIDE(i, n) {
    std::int64_t off[2];
    g.offsets(i, off);
    y[i] = mask[off[1]] ? value : x[off[0]];
  }
}

// The element functions of the kernels above, for detail::vector_map on contiguous operands (Note [vector
// elementwise maps]): the same expressions, so the same bits.
template <class T>
struct CastTo {
  template <class S>
  __device__ T operator()(S x) const {
    return scalar_cast<T>(x);
  }
};
template <class T>
struct BinaryFn {
  math::Binary op;
  __device__ T operator()(T a, T b) const {
    using A = acc_t<T>;
    return scalar_cast<T>(math::apply<A>(op, scalar_cast<A>(a), scalar_cast<A>(b)));
  }
};
template <class T>
struct UnaryFn {
  math::Unary op;
  __device__ T operator()(T x) const {
    using A = acc_t<T>;
    return scalar_cast<T>(math::apply<A>(op, scalar_cast<A>(x)));
  }
};
template <class T>
struct UnaryGradFn {
  math::Unary op;
  bool out_saved;
  __device__ T operator()(T saved, T dy) const {
    using A = acc_t<T>;
    const A s = scalar_cast<A>(saved);
    const A d = out_saved ? math::grad<A>(op, A(0), s) : math::grad<A>(op, s, A(0));
    return scalar_cast<T>(scalar_cast<A>(dy) * d);
  }
};
