// Without the CUDA backend every device call reports that clearly; device_count() is 0 so GPU tests skip.
#include "typegrad/config.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/detail/cuda/runtime.hpp"

#if !TG_HAVE_CUDA
namespace tg::backend::cuda {
namespace {
[[noreturn]] void no_backend(const char* what) {
  throw Error(what, ": typegrad was built without the CUDA backend (install the CUDA toolkit and configure with TG_CUDA=ON)");
}
}  // namespace
int device_count() { return 0; }
std::string device_description() { return "no CUDA backend in this build"; }
void copy_host_to_device(void*, const void*, std::size_t) { no_backend("copy_host_to_device"); }
void copy_device_to_host(void*, const void*, std::size_t) { no_backend("copy_device_to_host"); }
void copy_device_to_device(void*, const void*, std::size_t) { no_backend("copy_device_to_device"); }
void synchronize() { no_backend("synchronize"); }
template <class T>
void fill(T*, std::int64_t, T) {
  no_backend("fill");
}
template <class T>
void add_inplace(T*, const T*, std::int64_t) {
  no_backend("add_inplace");
}
template void add_inplace<double>(double*, const double*, std::int64_t);
template void add_inplace<float>(float*, const float*, std::int64_t);
template void add_inplace<fp16>(fp16*, const fp16*, std::int64_t);
template void add_inplace<bf16>(bf16*, const bf16*, std::int64_t);
#define TG_X(type, e, name, st) template void fill<type>(type*, std::int64_t, type);
TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X
}  // namespace tg::backend::cuda
#endif
