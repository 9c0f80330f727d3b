// dropout_add's CPU kernel (Note [fused dropout and residual add] in ops/dropout_add.hpp): the contiguous
// operands cut into pieces shared by the OpenMP threads (row_pieces.hpp), dropout_forward's keep rule and
// scale, the dropped-out value rounded to T and then added in the elementwise ops' register type. The file is
// compiled with -ffp-contract=off (CMakeLists.txt): the product is rounded before the add, as the unfused pair.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#define TG_KERNELS_ONLY
#include "typegrad/ops/dropout_add.hpp"
#include "typegrad/core/random.hpp"
#include "typegrad/detail/cpu/kernels.hpp"
#include "typegrad/detail/cpu/philox_block.hpp"
#include "typegrad/detail/cpu/row_pieces.hpp"
#include "typegrad/detail/math.hpp"

namespace tg::backend::cpu {

template <class T>
void dropout_add_forward(const T* x, const T* r, T* out, std::int64_t n, std::uint64_t seed, std::uint64_t offset,
                         const std::uint64_t* base, double p) {
  if (base) offset += *base;  // Note [the Philox base in memory]
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const float pf = static_cast<float>(p);
  const A scale = static_cast<A>(1.0 / (1.0 - p));
  for_row_pieces(1, n, 1 << 15, [&](std::int64_t, std::int64_t i0, std::int64_t i1) {
    bool keep[kDropoutBlock];  // Note [dropout masks in vectors]
    for (std::int64_t b = i0; b < i1; b += kDropoutBlock) {
      const int m = static_cast<int>(std::min<std::int64_t>(kDropoutBlock, i1 - b));
      dropout_keep_block(seed, offset + static_cast<std::uint64_t>(b), m, pf, keep);
      if constexpr (std::is_same_v<T, A>) {
        for (int j = 0; j < m; ++j) {
          const std::int64_t i = b + j;
          out[i] = x[i] + (keep[j] ? r[i] * scale : A(0));
        }
      } else {  // 16-bit T: one conversion per loop, so that each loop vectorizes (the same roundings)
        alignas(64) A d[kDropoutBlock], s[kDropoutBlock];
        for (int j = 0; j < m; ++j) d[j] = scalar_cast<A>(r[b + j]);
        for (int j = 0; j < m; ++j) d[j] = keep[j] ? d[j] * scale : A(0);
        for (int j = 0; j < m; ++j) d[j] = scalar_cast<A>(scalar_cast<T>(d[j]));  // the dropped-out value as T
        for (int j = 0; j < m; ++j) s[j] = scalar_cast<A>(x[b + j]) + d[j];
        for (int j = 0; j < m; ++j) out[b + j] = scalar_cast<T>(s[j]);
      }
    }
  });
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_DROPOUT_ADD, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu
