// Elementwise kernels: 16-bit storage is widened to fp32 in registers and rounded once on store.
#include "typegrad/detail/cpu/kernels.hpp"
#include "typegrad/detail/cpu/row_pieces.hpp"

namespace tg::backend::cpu {

namespace {
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
}

template <class T>
void binary(math::Binary op, const T* a, const Shape& sa, const T* b, const Shape& sb, T* out, const Shape& out_shape) {
  using A = acc_t<T>;
  const std::int64_t n = out_shape.numel();
  if (n == 0) return;
  const int rank = out_shape.size();
  const std::int64_t inner = rank ? out_shape[rank - 1] : 1, outer = n / inner;
  const std::int64_t ia = rank ? sa[rank - 1] : 0, ib = rank ? sb[rank - 1] : 0;
  for_row_pieces(outer, inner, 1 << 15, [&](std::int64_t o, std::int64_t i0, std::int64_t i1) {
    const auto [ao, bo] = row_offsets(o, rank - 1, out_shape, sa, sb);
    const T* pa = a + ao;
    const T* pb = b + bo;
    T* po = out + o * inner;
    if (ia == 1 && ib == 1) {
      switch (op) {  // hoisted so the contiguous loops vectorize
        case math::Binary::add: for (std::int64_t i = i0; i < i1; ++i) po[i] = scalar_cast<T>(scalar_cast<A>(pa[i]) + scalar_cast<A>(pb[i])); break;
        case math::Binary::sub: for (std::int64_t i = i0; i < i1; ++i) po[i] = scalar_cast<T>(scalar_cast<A>(pa[i]) - scalar_cast<A>(pb[i])); break;
        case math::Binary::mul: for (std::int64_t i = i0; i < i1; ++i) po[i] = scalar_cast<T>(scalar_cast<A>(pa[i]) * scalar_cast<A>(pb[i])); break;
        case math::Binary::div: for (std::int64_t i = i0; i < i1; ++i) po[i] = scalar_cast<T>(scalar_cast<A>(pa[i]) / scalar_cast<A>(pb[i])); break;
      }
    } else {
      for (std::int64_t i = i0; i < i1; ++i)
        po[i] = scalar_cast<T>(math::apply<A>(op, scalar_cast<A>(pa[i * ia]), scalar_cast<A>(pb[i * ib])));
    }
  });
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_BINARY, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu
