// Device queries, streams and events, host<->device copies and fill.
#include <atomic>
#include <string>

#include <cuda_profiler_api.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "check.cuh"
#include "vector_map.cuh"
#include "typegrad/detail/cuda/runtime.hpp"
#include "typegrad/detail/kernels/launch_watch.hpp"

namespace tg::backend::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

void set_device(int index) {
  const int n = device_count();
  if (index < 0 || index >= n) throw Error("set_device: device ", index, " does not exist (", n, " CUDA devices)");
  TG_CUDA_CHECK(cudaSetDevice(index));
}

int current_device() {
  int d = 0;
  TG_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

std::string device_description() {
  int n = 0;
  const cudaError_t st = cudaGetDeviceCount(&n);
  if (st != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(st);
  }
  if (n == 0) return "no CUDA device";
  cudaDeviceProp p{};
  const int d = current_device();  // the one this thread uses (set_device), not always the first
  TG_CUDA_CHECK(cudaGetDeviceProperties(&p, d));
  const std::string which = n > 1 ? "device " + std::to_string(d) + " of " + std::to_string(n) + ": " : "";
  return which + p.name + ", sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.totalGlobalMem >> 30) + " GiB";
}

// ---- streams and events (Note [CUDA streams]) ------------------------------------------------------------
namespace {
thread_local cudaStream_t t_current_stream = nullptr;
}  // namespace

// ---- CUDA graphs of a step (Note [CUDA graphs of a step]) --------------------------------------------------
namespace {
/// detail::GraphCapture's CUDA calls.
class CudaGraphDriver final : public detail::GraphDriver {
 public:
  void begin_capture(void* stream) override {
    TG_CUDA_CHECK(cudaStreamBeginCapture(static_cast<cudaStream_t>(stream), cudaStreamCaptureModeRelaxed));
  }
  void* end_capture(void* stream, std::size_t* nodes) override {
    cudaGraph_t g = nullptr;
    const cudaError_t st = cudaStreamEndCapture(static_cast<cudaStream_t>(stream), &g);
    if (st != cudaSuccess || g == nullptr) {
      (void)cudaGetLastError();
      if (g) (void)cudaGraphDestroy(g);
      throw Error("CUDA graphs: the capture of a stretch of the step failed (", cudaGetErrorString(st),
                  "): its work did not run. A call that a capture cannot take ran inside the step (an event query, a "
                  "synchronization that is not a read, work on another stream); run the step without CUDA graphs "
                  "(Note [CUDA graphs of a step])");
    }
    const cudaError_t counted = cudaGraphGetNodes(g, nullptr, nodes);
    if (counted != cudaSuccess) {
      (void)cudaGraphDestroy(g);
      TG_CUDA_CHECK(counted);
    }
    return g;
  }
  void drop_capture(void* stream) noexcept override {
    cudaGraph_t dropped = nullptr;
    (void)cudaStreamEndCapture(static_cast<cudaStream_t>(stream), &dropped);
    if (dropped) (void)cudaGraphDestroy(dropped);
    (void)cudaGetLastError();
  }
  void destroy_graph(void* graph) noexcept override { (void)cudaGraphDestroy(static_cast<cudaGraph_t>(graph)); }
  bool update(void* exec, void* graph) noexcept override {
    cudaGraphExecUpdateResultInfo info{};
    if (cudaGraphExecUpdate(static_cast<cudaGraphExec_t>(exec), static_cast<cudaGraph_t>(graph), &info) == cudaSuccess) return true;
    (void)cudaGetLastError();
    return false;
  }
  void* instantiate(void* graph) override {
    cudaGraphExec_t e = nullptr;
    TG_CUDA_CHECK(cudaGraphInstantiate(&e, static_cast<cudaGraph_t>(graph), 0));
    return e;
  }
  void destroy_exec(void* exec) noexcept override { (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec)); }
  void launch(void* exec, void* stream) override {
    TG_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), static_cast<cudaStream_t>(stream)));
  }
  void* host_alloc(std::size_t bytes) override {
    void* p = nullptr;
    TG_CUDA_CHECK(cudaMallocHost(&p, bytes));
    return p;
  }
  void host_free(void* p) noexcept override { (void)cudaFreeHost(p); }
  void* event_create() override {
    cudaEvent_t e = nullptr;
    TG_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void event_destroy(void* event) noexcept override { (void)cudaEventDestroy(static_cast<cudaEvent_t>(event)); }
  bool event_record(void* event, void* stream) noexcept override {
    if (cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)) == cudaSuccess) return true;
    (void)cudaGetLastError();
    return false;
  }
  void event_wait(void* event) override { TG_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event))); }
  void stream_wait(void* stream) noexcept override { (void)cudaStreamSynchronize(static_cast<cudaStream_t>(stream)); }
};
}  // namespace

struct StepGraphs::Impl {
  CudaGraphDriver driver;
  detail::GraphCapture capture{driver};
  detail::GraphCapture* previous = nullptr;  // the thread's step under capture before this one (none, normally)
};

namespace {
thread_local detail::GraphCapture* t_graphs = nullptr;  // the calling thread's step under capture

/// Runs `wait`, a read of the device (a download, a synchronization): inside a step under capture, the open
/// stretch is captured up to here and launched first, and the next stretch's capture begins after the read.
/// (Note [CUDA graphs of a step])
template <class Wait>
void as_read(Wait&& wait) {
  if (t_graphs) t_graphs->before_read();
  wait();
  if (t_graphs) t_graphs->after_read();
}
}  // namespace

StepGraphs::StepGraphs() : impl_(std::make_unique<Impl>()) {}
StepGraphs::~StepGraphs() { abandon(); }
void StepGraphs::begin() {
  Impl& g = *impl_;
  g.capture.begin(t_current_stream);
  g.previous = t_graphs;
  t_graphs = &g.capture;
}
void StepGraphs::end() {
  Impl& g = *impl_;
  struct Leave {  // the thread's capture state is closed whatever end() does
    Impl& g;
    ~Leave() {
      if (t_graphs == &g.capture) t_graphs = g.previous;
    }
  } leave{g};
  g.capture.end();
}
void StepGraphs::abandon() noexcept {
  Impl& g = *impl_;
  g.capture.abandon();
  if (t_graphs == &g.capture) t_graphs = g.previous;
}
const GraphStats& StepGraphs::stats() const { return impl_->capture.stats(); }
void StepGraphs::set_chunk(std::size_t launches) { impl_->capture.set_chunk(launches); }
void StepGraphs::note_launch() { impl_->capture.note_launch(); }

Stream::Stream() {
  cudaStream_t s = nullptr;
  TG_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  handle_ = s;
}
Stream::~Stream() {
  auto* s = static_cast<cudaStream_t>(handle_);
  (void)cudaStreamSynchronize(s);  // errors of the stream's work were reported by the calls that issued it
  (void)cudaGetLastError();
  detail::forget_stream(s);  // its cached blocks: no later allocation is made on this stream
  (void)cudaStreamDestroy(s);
}
void Stream::synchronize() const {
  as_read([&] {  // Note [CUDA graphs of a step]
    TG_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)));
  });
}

void* current_stream() { return t_current_stream; }
bool current_stream_capturing() noexcept {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(t_current_stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}
void synchronize_stream() {
  as_read([&] {  // Note [CUDA graphs of a step]
    TG_CUDA_CHECK(cudaStreamSynchronize(t_current_stream));
  });
}

StreamGuard::StreamGuard(const Stream& s) : previous_(t_current_stream) {
  t_current_stream = static_cast<cudaStream_t>(s.handle());
}
StreamGuard::~StreamGuard() { t_current_stream = static_cast<cudaStream_t>(previous_); }

Event::Event() {
  cudaEvent_t e = nullptr;
  TG_CUDA_CHECK(cudaEventCreate(&e));
  handle_ = e;
}
Event::~Event() { (void)cudaEventDestroy(static_cast<cudaEvent_t>(handle_)); }
void Event::record() { TG_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_), t_current_stream)); }
void Event::wait() const {
  TG_CUDA_CHECK(cudaStreamWaitEvent(t_current_stream, static_cast<cudaEvent_t>(handle_), 0));
}
void Event::synchronize() const {
  as_read([&] {  // Note [CUDA graphs of a step]
    TG_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
  });
}
float Event::elapsed_ms_since(const Event& earlier) const {
  float ms = 0.f;
  TG_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(earlier.handle_), static_cast<cudaEvent_t>(handle_)));
  return ms;
}

// ---- copies: on the current stream; each returns when its data is where the caller expects it ------------
// Note [asynchronous uploads]
// The host buffer of an upload may be freed as soon as copy_host_to_device returns. Waiting for the copy to
// land (a stream synchronization) guarantees that, but it also drains everything queued before it: a training
// step uploads its token ids, targets and embedding-gradient orders several times per micro-batch, and each
// wait left the GPU idle until the host had launched the next kernels. So an upload of at most kStagedMax bytes
// is copied into a pinned staging block on the host and sent from there with cudaMemcpyAsync, ordered on the
// current stream like a kernel (every later kernel on that stream sees the data; another stream must wait on an
// event, as for any kernel's output). A block is reused once the event recorded after its copy has completed;
// the blocks live as long as the process (kStagingCap in all; past it, and for larger uploads such as weights,
// the upload waits as before).
namespace {
constexpr std::size_t kStagedMax = std::size_t{4} << 20;
constexpr std::size_t kStagingCap = std::size_t{64} << 20;
struct StagingBlock {
  void* host = nullptr;
  std::size_t bytes = 0;
  cudaEvent_t done = nullptr;  // created on `device`: an event is recorded only on its own device's streams
  int device = 0;
  bool in_flight = false;
};
std::mutex g_staging_mutex;
std::vector<StagingBlock> g_staging;  // never freed: pinned memory must not be released after CUDA shuts down
std::size_t g_staging_bytes = 0;

/// Whether the block's last copy has completed (clears the not-ready status cudaEventQuery leaves behind).
bool staging_free(StagingBlock& b) {
  if (!b.in_flight) return true;
  const cudaError_t st = cudaEventQuery(b.done);
  if (st == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  TG_CUDA_CHECK(st);
  b.in_flight = false;
  return true;
}

/// A free pinned block of the current device of at least `bytes` (the smallest such), a new one, or null past
/// kStagingCap. (Pinned memory serves every device; the block's event belongs to one.)
StagingBlock* staging_block(std::size_t bytes) {
  int device = 0;
  TG_CUDA_CHECK(cudaGetDevice(&device));
  StagingBlock* best = nullptr;
  for (StagingBlock& b : g_staging)
    if (b.device == device && b.bytes >= bytes && (!best || b.bytes < best->bytes) && staging_free(b)) best = &b;
  if (best) return best;
  std::size_t size = 4096;
  while (size < bytes) size *= 2;
  if (g_staging_bytes + size > kStagingCap) return nullptr;
  StagingBlock b;
  b.bytes = size;
  b.device = device;
  TG_CUDA_CHECK(cudaMallocHost(&b.host, size));
  TG_CUDA_CHECK(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
  g_staging_bytes += size;
  g_staging.push_back(b);
  return &g_staging.back();
}
}  // namespace

void copy_host_to_device(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if (detail::GraphCapture* g = t_graphs; g && g->capturing_on(t_current_stream)) {
    // Note [CUDA graphs of a step]: a copy node reading the step's own pinned block, written now
    void* block = g->pinned(bytes);
    report_launch("copy_host_to_device", false, dst, static_cast<const void*>(block), bytes);  // Note [launch watch]
    std::memcpy(block, src, bytes);
    TG_CUDA_CHECK(cudaMemcpyAsync(dst, block, bytes, cudaMemcpyHostToDevice, t_current_stream));
    return;
  }
  if (bytes <= kStagedMax) {  // Note [asynchronous uploads]
    const std::lock_guard<std::mutex> lock(g_staging_mutex);
    if (StagingBlock* b = staging_block(bytes)) {
      // Note [launch watch]: a graph's copy node would read the staging block, whose address it bakes in
      report_launch("copy_host_to_device", false, dst, static_cast<const void*>(b->host), bytes);
      std::memcpy(b->host, src, bytes);
      TG_CUDA_CHECK(cudaMemcpyAsync(dst, b->host, bytes, cudaMemcpyHostToDevice, t_current_stream));
      if (const cudaError_t st = cudaEventRecord(b->done, t_current_stream); st != cudaSuccess) {
        // The copy may still be reading the block, and nothing marks its end: wait for it, so the block is
        // free for the next upload, then report the failure.
        (void)cudaStreamSynchronize(t_current_stream);
        TG_CUDA_CHECK(st);
      }
      b->in_flight = true;
      return;
    }
  }
  // The host buffer may be freed as soon as this returns, so the copy is complete before it does: a wait on the
  // host, which a graph cannot make (reported as a read, Note [launch watch]).
  report_launch("copy_host_to_device_waited", true, dst, src, bytes);
  TG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, t_current_stream));
  TG_CUDA_CHECK(cudaStreamSynchronize(t_current_stream));
}
namespace {
std::atomic<std::int64_t> g_host_reads{0};
}  // namespace
std::int64_t device_to_host_reads() { return g_host_reads.load(); }
void copy_device_to_host(void* dst, const void* src, std::size_t bytes) {
  g_host_reads.fetch_add(1, std::memory_order_relaxed);
  report_launch("copy_device_to_host", true, dst, src, bytes);  // Note [launch watch]: a read
  as_read([&] {  // Note [CUDA graphs of a step]
    TG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, t_current_stream));
    TG_CUDA_CHECK(cudaStreamSynchronize(t_current_stream));
  });
}
void copy_device_to_device(void* dst, const void* src, std::size_t bytes) {  // stream-ordered
  report_launch("copy_device_to_device", false, dst, src, bytes);  // Note [launch watch]
  TG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, t_current_stream));
}
void synchronize() {
  as_read([&] {  // Note [CUDA graphs of a step]
    TG_CUDA_CHECK(cudaDeviceSynchronize());
  });
}
void profiler_start() { TG_CUDA_CHECK(cudaProfilerStart()); }
void profiler_stop() { TG_CUDA_CHECK(cudaProfilerStop()); }

namespace {
template <class T>
__global__ void fill_kernel(T* dst, std::int64_t n, T value) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = value;
}
}  // namespace

template <class T>
void fill(T* dst, std::int64_t n, T value) {
  if (n == 0) return;
  // all-zero bits (0, +0.0, false): the memset engine's path, at memory bandwidth
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(&value);
  if (std::all_of(bytes, bytes + sizeof(T), [](unsigned char b) { return b == 0; })) {
    TG_CUDA_CHECK(cudaMemsetAsync(dst, 0, static_cast<std::size_t>(n) * sizeof(T), t_current_stream));
    return;
  }
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<std::int64_t>((n + threads - 1) / threads, 65535));
  fill_kernel<T><<<blocks, threads, 0, t_current_stream>>>(dst, n, value);
  TG_CUDA_CHECK(cudaGetLastError());
}

namespace {
/// dst[i] + src[i] in the accumulation type (fp64 for fp64: a float sum would round fp64 gradients).
template <class T>
struct AddFn {
  __device__ T operator()(T a, T b) const {
    using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
    return scalar_cast<T>(scalar_cast<A>(a) + scalar_cast<A>(b));
  }
};
template <class T>
__global__ void add_inplace_kernel(T* dst, const T* src, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = AddFn<T>{}(dst[i], src[i]);
}
}  // namespace

template <class T>
void add_inplace(T* dst, const T* src, std::int64_t n) {
  if (n == 0) return;
  if (detail::vector_map_fits(dst, dst, src)) return detail::vector_map(AddFn<T>{}, dst, n, static_cast<const T*>(dst), src);
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<std::int64_t>((n + threads - 1) / threads, 65535));
  add_inplace_kernel<T><<<blocks, threads, 0, t_current_stream>>>(dst, src, n);
  TG_CUDA_CHECK(cudaGetLastError());
}
TG_INSTANTIATE_KERNELS(TG_KERNELS_FILL, TG_ALL_TYPES)
TG_INSTANTIATE_KERNELS(TG_KERNELS_ADD_INPLACE, TG_FLOATING_TYPES)

}  // namespace tg::backend::cuda
