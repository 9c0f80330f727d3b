// Without the CUDA backend every device call reports that clearly; device_count() is 0 so GPU tests skip.
#include "typegrad/config.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/detail/cuda/kernels.hpp"
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
Stream::Stream() { no_backend("Stream"); }
Stream::~Stream() = default;
void Stream::synchronize() const { no_backend("Stream::synchronize"); }
void* current_stream() { return nullptr; }
void synchronize_stream() { no_backend("synchronize_stream"); }
StreamGuard::StreamGuard(const Stream&) : previous_(nullptr) { no_backend("StreamGuard"); }
StreamGuard::~StreamGuard() = default;
Event::Event() { no_backend("Event"); }
Event::~Event() = default;
void Event::record() { no_backend("Event::record"); }
void Event::wait() const { no_backend("Event::wait"); }
void Event::synchronize() const { no_backend("Event::synchronize"); }
float Event::elapsed_ms_since(const Event&) const { no_backend("Event::elapsed_ms_since"); }
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
// ---- op kernels (detail/cuda/kernels.hpp) ----------------------------------------------------------------
template <class S, class T>
void copy_strided(const S*, const Shape&, T*, const Shape&, const Shape&) { no_backend("copy_strided"); }
template <class T>
void binary(math::Binary, const T*, const Shape&, const T*, const Shape&, T*, const Shape&) { no_backend("binary"); }
template <class T>
void unary_forward(math::Unary, const T*, const Shape&, T*, const Shape&) { no_backend("unary_forward"); }
template <class T>
void unary_backward(math::Unary, const T*, const Shape&, const T*, const Shape&, T*, const Shape&) { no_backend("unary_backward"); }
template <class T>
void dropout_forward(const T*, const Shape&, T*, const Shape&, std::uint64_t, std::uint64_t, double) { no_backend("dropout_forward"); }
template <class T>
void masked_fill(const T*, const Shape&, const std::uint8_t*, const Shape&, T, T*, const Shape&) { no_backend("masked_fill"); }
template <class T>
void reduce_sum(const T*, T*, std::int64_t, std::int64_t, std::int64_t) { no_backend("reduce_sum"); }
template <class T>
void reduce_max(const T*, T*, std::int64_t*, std::int64_t, std::int64_t, std::int64_t) { no_backend("reduce_max"); }
template <class T>
void max_backward(const T*, const std::int64_t*, T*, std::int64_t, std::int64_t, std::int64_t) { no_backend("max_backward"); }
template <class T>
void softmax_forward(const T*, T*, std::int64_t, std::int64_t, bool) { no_backend("softmax_forward"); }
template <class T>
void softmax_backward(const T*, const T*, T*, std::int64_t, std::int64_t, bool) { no_backend("softmax_backward"); }
template <class T>
void layernorm_forward(const T*, const T*, const T*, T*, accum_t<T>*, accum_t<T>*, std::int64_t, std::int64_t, double) {
  no_backend("layernorm_forward");
}
template <class T>
void layernorm_backward(const T*, const T*, const accum_t<T>*, const accum_t<T>*, const T*, T*, T*, T*, std::int64_t,
                        std::int64_t) {
  no_backend("layernorm_backward");
}
template <class T>
void rmsnorm_forward(const T*, const T*, T*, accum_t<T>*, std::int64_t, std::int64_t, double) { no_backend("rmsnorm_forward"); }
template <class T>
void embedding_forward(const T*, const std::int64_t*, T*, std::int64_t, std::int64_t) { no_backend("embedding_forward"); }
template <class T>
void embedding_backward(const T*, const std::int64_t*, T*, std::int64_t, std::int64_t, std::int64_t) {
  no_backend("embedding_backward");
}
template <class T>
double cross_entropy_forward(const T*, const std::int64_t*, accum_t<T>*, std::int64_t, std::int64_t, std::int64_t,
                             std::int64_t*) {
  no_backend("cross_entropy_forward");
}
template <class T>
void cross_entropy_backward(const T*, const std::int64_t*, const accum_t<T>*, double, T*, std::int64_t, std::int64_t,
                            std::int64_t) {
  no_backend("cross_entropy_backward");
}
void set_allow_tf32(bool allow) {  // turning TF32 off is what a build without CUDA already does
  if (allow) no_backend("set_allow_tf32");
}
bool allow_tf32() { return false; }
std::int64_t gelu_epilogue_calls() { return 0; }
std::int64_t padded_gemm_calls() { return 0; }
template <class T>
void matmul_strided(const T*, const Shape&, const T*, const Shape&, T*, const Shape&, const Shape&, std::int64_t,
                    std::int64_t, std::int64_t) {
  no_backend("matmul_strided");
}
template <class T>
void linear_forward(const T*, std::int64_t, std::int64_t, const T*, std::int64_t, std::int64_t, const T*, T*,
                    std::int64_t, std::int64_t, std::int64_t) {
  no_backend("linear_forward");
}
template <class T>
void linear_gelu_tanh_forward(const T*, std::int64_t, std::int64_t, const T*, std::int64_t, std::int64_t, const T*, T*,
                              T*, std::int64_t, std::int64_t, std::int64_t) {
  no_backend("linear_gelu_tanh_forward");
}
template <class T>
void attention_forward(const T*, const T*, const T*, T*, accum_t<T>*, std::int64_t, std::int64_t, std::int64_t, double,
                       bool) {
  no_backend("attention_forward");
}
template <class T>
void attention_backward(const T*, const T*, const T*, const T*, const T*, const accum_t<T>*, T*, T*, T*, std::int64_t,
                        std::int64_t, std::int64_t, double, bool) {
  no_backend("attention_backward");
}

void adam_step_multi(const AdamTensor*, int, double, double, double, double, double, bool, long long) {
  no_backend("adam_step_multi");
}
bool unscale_and_check(float* const*, const std::int64_t*, int, float) { no_backend("unscale_and_check"); }
void sgd_step_multi(const SgdTensor*, int, const SgdScalars&) { no_backend("sgd_step_multi"); }
void lamb_step_multi(const LambTensor*, int, const LambScalars&, double*) { no_backend("lamb_step_multi"); }
void adafactor_step_multi(const AdafactorTensor*, int, const AdafactorScalars&) { no_backend("adafactor_step_multi"); }
template <class T>
void sgd_step(T*, const T*, T*, std::int64_t, const SgdScalars&) {
  no_backend("sgd_step");
}
template <class T>
double lamb_step(T*, const T*, T*, T*, std::int64_t, const LambScalars&) {
  no_backend("lamb_step");
}
template <class T>
void adafactor_step_factored(T*, const T*, T*, T*, T*, std::int64_t, std::int64_t, const AdafactorScalars&) {
  no_backend("adafactor_step_factored");
}
template <class T>
void adafactor_step_full(T*, const T*, T*, T*, std::int64_t, const AdafactorScalars&) {
  no_backend("adafactor_step_full");
}
template void sgd_step<float>(float*, const float*, float*, std::int64_t, const SgdScalars&);
template double lamb_step<float>(float*, const float*, float*, float*, std::int64_t, const LambScalars&);
template void adafactor_step_factored<float>(float*, const float*, float*, float*, float*, std::int64_t, std::int64_t,
                                             const AdafactorScalars&);
template void adafactor_step_full<float>(float*, const float*, float*, float*, std::int64_t, const AdafactorScalars&);

#define TG_INSTANTIATE(T)                                                                                          \
  template void binary<T>(math::Binary, const T*, const Shape&, const T*, const Shape&, T*, const Shape&);        \
  template void unary_forward<T>(math::Unary, const T*, const Shape&, T*, const Shape&);                          \
  template void unary_backward<T>(math::Unary, const T*, const Shape&, const T*, const Shape&, T*, const Shape&);  \
  template void dropout_forward<T>(const T*, const Shape&, T*, const Shape&, std::uint64_t, std::uint64_t, double); \
  template void masked_fill<T>(const T*, const Shape&, const std::uint8_t*, const Shape&, T, T*, const Shape&);    \
  template void reduce_sum<T>(const T*, T*, std::int64_t, std::int64_t, std::int64_t);                            \
  template void reduce_max<T>(const T*, T*, std::int64_t*, std::int64_t, std::int64_t, std::int64_t);             \
  template void max_backward<T>(const T*, const std::int64_t*, T*, std::int64_t, std::int64_t, std::int64_t);     \
  template void softmax_forward<T>(const T*, T*, std::int64_t, std::int64_t, bool);                               \
  template void softmax_backward<T>(const T*, const T*, T*, std::int64_t, std::int64_t, bool);                    \
  template void layernorm_forward<T>(const T*, const T*, const T*, T*, accum_t<T>*, accum_t<T>*, std::int64_t,     \
                                     std::int64_t, double);                                                       \
  template void rmsnorm_forward<T>(const T*, const T*, T*, accum_t<T>*, std::int64_t, std::int64_t, double);      \
  template void layernorm_backward<T>(const T*, const T*, const accum_t<T>*, const accum_t<T>*, const T*, T*, T*,  \
                                      T*, std::int64_t, std::int64_t);                                            \
  template void embedding_forward<T>(const T*, const std::int64_t*, T*, std::int64_t, std::int64_t);              \
  template void embedding_backward<T>(const T*, const std::int64_t*, T*, std::int64_t, std::int64_t, std::int64_t); \
  template double cross_entropy_forward<T>(const T*, const std::int64_t*, accum_t<T>*, std::int64_t, std::int64_t, \
                                           std::int64_t, std::int64_t*);                                          \
  template void cross_entropy_backward<T>(const T*, const std::int64_t*, const accum_t<T>*, double, T*,           \
                                          std::int64_t, std::int64_t, std::int64_t);                              \
  template void matmul_strided<T>(const T*, const Shape&, const T*, const Shape&, T*, const Shape&, const Shape&,  \
                                  std::int64_t, std::int64_t, std::int64_t);                                      \
  template void linear_forward<T>(const T*, std::int64_t, std::int64_t, const T*, std::int64_t, std::int64_t,      \
                                  const T*, T*, std::int64_t, std::int64_t, std::int64_t);                        \
  template void linear_gelu_tanh_forward<T>(const T*, std::int64_t, std::int64_t, const T*, std::int64_t,          \
                                            std::int64_t, const T*, T*, T*, std::int64_t, std::int64_t,            \
                                            std::int64_t);                                                        \
  template void attention_forward<T>(const T*, const T*, const T*, T*, accum_t<T>*, std::int64_t, std::int64_t,    \
                                     std::int64_t, double, bool);                                                 \
  template void attention_backward<T>(const T*, const T*, const T*, const T*, const T*, const accum_t<T>*, T*, T*, \
                                      T*, std::int64_t, std::int64_t, std::int64_t, double, bool);
TG_CUDA_FLOAT_TYPES(TG_INSTANTIATE)
#undef TG_INSTANTIATE
#define TG_COPY_PAIR(S, T) template void copy_strided<S, T>(const S*, const Shape&, T*, const Shape&, const Shape&);
#define TG_X(type, e, name, st) TG_CUDA_COPY_TARGETS(TG_COPY_PAIR, type)
TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X
#undef TG_COPY_PAIR
}  // namespace tg::backend::cuda
#endif
