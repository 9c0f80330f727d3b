// Without the CUDA backend every device call reports that clearly; device_count() is 0 so GPU tests skip.
// The op kernels need nothing here: their CUDA declarations are then inline definitions that throw (Note
// [kernels declared once]); this file holds the runtime's entry points, the CUDA-only launches and
// tg::dist::make_nccl_communicator.
#include "typegrad/config.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/detail/cuda/attention.hpp"
#include "typegrad/detail/cuda/gemm_int8.hpp"
#include "typegrad/detail/cuda/kernels.hpp"
#include "typegrad/detail/cuda/pointwise.hpp"
#include "typegrad/detail/cuda/runtime.hpp"
#include "typegrad/dist/nccl.hpp"

namespace tg::backend {
void no_cuda_backend(const char* what) {
  throw Error(what, ": typegrad was built without the CUDA backend (install the CUDA toolkit and configure with TG_CUDA=ON)");
}
}  // namespace tg::backend

#if !TG_HAVE_CUDA
namespace tg::backend::cuda {
namespace {
[[noreturn]] void no_backend(const char* what) { no_cuda_backend(what); }
}  // namespace
int device_count() { return 0; }
std::string device_description() { return "no CUDA backend in this build"; }
void set_device(int) { no_backend("set_device"); }
int current_device() { no_backend("current_device"); }
void copy_host_to_device(void*, const void*, std::size_t) { no_backend("copy_host_to_device"); }
std::string pointwise_source(DType, int, const std::string&) { no_backend("pointwise_source"); }
std::string pointwise_ptx(const std::string&) { no_backend("pointwise_ptx"); }
bool pointwise_run(const std::string&, bool, const PointwiseArgs&, std::string*) { no_backend("pointwise_run"); }
std::int64_t pointwise_compiles() { return 0; }
void copy_device_to_host(void*, const void*, std::size_t) { no_backend("copy_device_to_host"); }
void copy_device_to_device(void*, const void*, std::size_t) { no_backend("copy_device_to_device"); }
void synchronize() { no_backend("synchronize"); }
void profiler_start() { no_backend("profiler_start"); }
void profiler_stop() { no_backend("profiler_stop"); }
Stream::Stream() { no_backend("Stream"); }
Stream::~Stream() = default;
void Stream::synchronize() const { no_backend("Stream::synchronize"); }
void* current_stream() { return nullptr; }
bool current_stream_capturing() noexcept { return false; }
void synchronize_stream() { no_backend("synchronize_stream"); }
StreamGuard::StreamGuard(const Stream&) : previous_(nullptr) { no_backend("StreamGuard"); }
StreamGuard::~StreamGuard() = default;
Event::Event() { no_backend("Event"); }
Event::~Event() = default;
void Event::record() { no_backend("Event::record"); }
void Event::wait() const { no_backend("Event::wait"); }
void Event::synchronize() const { no_backend("Event::synchronize"); }
float Event::elapsed_ms_since(const Event&) const { no_backend("Event::elapsed_ms_since"); }
struct StepGraphs::Impl {
  GraphStats stats;  // never made: the constructor throws
};
StepGraphs::StepGraphs() { no_backend("StepGraphs"); }
StepGraphs::~StepGraphs() = default;
void StepGraphs::begin() { no_backend("StepGraphs::begin"); }
void StepGraphs::end() { no_backend("StepGraphs::end"); }
void StepGraphs::abandon() noexcept {}
void StepGraphs::set_chunk(std::size_t) { no_backend("StepGraphs::set_chunk"); }
void StepGraphs::note_launch() { no_backend("StepGraphs::note_launch"); }
const GraphStats& StepGraphs::stats() const { return impl_->stats; }
// ---- copies and the CUDA-only launches ------------------------------------------------------------------
void set_allow_tf32(bool allow) {  // turning TF32 off is what a build without CUDA already does
  if (allow) no_backend("set_allow_tf32");
}
bool allow_tf32() { return false; }
std::int64_t gelu_epilogue_calls() { return 0; }
std::int64_t bgrad_epilogue_calls() { return 0; }
std::int64_t dgelu_epilogue_calls() { return 0; }
std::int64_t padded_gemm_calls() { return 0; }
std::int64_t flash_attention_calls() { return 0; }
std::int64_t device_to_host_reads() { return 0; }
void set_flash_attention(bool enabled) {
  if (enabled) no_backend("set_flash_attention");
}
bool flash_attention_enabled() { return false; }
void set_flash_attention_kernels(FlashKernels k) {  // choosing the default set is a no-op, as turning attention off is
  if (k != FlashKernels::tiles) no_backend("set_flash_attention_kernels");
}
FlashKernels flash_attention_kernels() { return FlashKernels::tiles; }
bool unscale_and_check(float* const*, const std::int64_t*, int, float) { no_backend("unscale_and_check"); }
double sum_squares_multi(const float* const*, const std::int64_t*, int) { no_backend("sum_squares_multi"); }
void scale_multi(float* const*, const std::int64_t*, int, float) { no_backend("scale_multi"); }
// int8 quantizers and GEMMs (detail/cuda/gemm_int8.hpp)
void quantize_rows_int8(const float*, std::int64_t, std::int64_t, std::int64_t, std::int8_t*, float*) {
  no_backend("quantize_rows_int8");
}
void quantize_int8_with_scale(const float*, std::int64_t, std::int64_t, std::int64_t, float, std::int8_t*) {
  no_backend("quantize_int8_with_scale");
}
void gemm_s8s8s32_nt(std::int64_t, std::int64_t, std::int64_t, const std::int8_t*, std::int64_t, const std::int8_t*,
                     std::int64_t, std::int32_t*, std::int64_t) {
  no_backend("gemm_s8s8s32_nt");
}
void gemm_s8s8s32_nt_reference(std::int64_t, std::int64_t, std::int64_t, const std::int8_t*, std::int64_t,
                               const std::int8_t*, std::int64_t, std::int32_t*, std::int64_t) {
  no_backend("gemm_s8s8s32_nt_reference");
}
void gemm_s8_dequant(std::int64_t, std::int64_t, std::int64_t, const std::int8_t*, std::int64_t, const float*,
                     const std::int8_t*, std::int64_t, const float*, const float*, float*, std::int64_t) {
  no_backend("gemm_s8_dequant");
}
std::int64_t int8_padded_gemm_calls() { return 0; }
std::int64_t int8_gemm_fallback_calls() { return 0; }
}  // namespace tg::backend::cuda
namespace tg::dist {
std::unique_ptr<Communicator> make_nccl_communicator(Communicator&) {
  throw Error("dist: typegrad was built without CUDA, so there is no NCCL communicator");
}
}  // namespace tg::dist
#endif
