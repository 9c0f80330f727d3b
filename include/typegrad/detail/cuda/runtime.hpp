// The CUDA backend's host-side interface: device queries, streams and events, copies, fill (the caching
// device allocator is tg::allocator<cuda>()).
// Declared always; defined by backends/cuda when TG_HAVE_CUDA, otherwise each call throws a tg::Error
// that says the build has no CUDA backend (device_count() then returns 0, so GPU tests can skip).
//   if (tg::backend::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
//   tg::backend::cuda::copy_host_to_device(dst, src, bytes);
//   tg::backend::cuda::Stream side;  { tg::backend::cuda::StreamGuard on(side); /* ops run on `side` */ }
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "typegrad/core/allocator.hpp"
#include "typegrad/core/dtype.hpp"
#include "typegrad/detail/cuda/step_graphs.hpp"
#include "typegrad/detail/kernels/core.hpp"

namespace tg::backend::cuda {

/// Number of usable CUDA devices; 0 when there is no driver, no device, or no CUDA backend.
int device_count();
/// "NVIDIA H200, sm_90, 139 GiB" or the reason there is none.
std::string device_description();
/// Makes device `index` (0 .. device_count()-1) the calling thread's current device (cudaSetDevice): a
/// data-parallel rank picks its GPU before anything is allocated.
void set_device(int index);
/// The calling thread's current device (cudaGetDevice).
int current_device();

// Note [CUDA streams]
// Every kernel, cuBLAS(Lt) call, memset and copy of the backend is issued on the calling thread's current
// stream: the legacy default stream (nullptr) unless a StreamGuard selects a Stream. Work on one stream runs
// in issue order; work on different streams may overlap and is ordered only through events (Event::record
// on one stream, Event::wait on another) or synchronization. Calls that hand data to the host
// (copy_device_to_host, item(), the optimizers' read-backs) synchronize the
// current stream only. The caching allocator keeps one free list per stream: a block freed after its use
// on stream s is handed out again only to allocations made while s is current, so reuse is ordered after
// the use. A tensor allocated on one stream and used on another must not be freed before that use has
// completed (wait on an event or synchronize first) - the contract PyTorch's record_stream automates.

/// A CUDA stream of the current device (non-blocking with respect to the legacy default stream).
/// Destroying it first waits for its work, so its handle cannot be reused early, then gives the caching
/// allocator's free blocks of the stream back to the driver after their devices' work (no later allocation could
/// take them: Note [CUDA streams]); blocks still in use that were allocated on it are released with the rest of the
/// cache once freed (detail::forget_stream).
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  /// The cudaStream_t, as an opaque pointer (this header does not include the CUDA runtime).
  void* handle() const { return handle_; }
  /// Waits for everything issued on this stream so far.
  void synchronize() const;

 private:
  void* handle_ = nullptr;
};

/// The calling thread's current stream (nullptr: the legacy default stream).
void* current_stream();
/// Waits for everything issued on the current stream so far.
void synchronize_stream();
/// Whether the calling thread's current stream is being captured into a CUDA graph (Note [CUDA graphs of a step]).
/// A stream whose capture status cannot be asked counts as captured: the callers then skip what would invalidate a
/// capture (synchronizing the device, standing in for a failed launch).
bool current_stream_capturing() noexcept;

namespace detail {
/// The caching allocator forgets `stream`, whose work has finished (Stream's destructor): its free blocks are
/// returned to the driver once their devices finish their work (outside a capture; inside one they stay cached), and
/// its blocks in use, once freed, stay on a list no allocation takes until the cache is released.
void forget_stream(void* stream) noexcept;
}  // namespace detail

/// Makes `s` the calling thread's current stream for the guard's lifetime (the previous one comes back).
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& s);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  void* previous_;
};

/// A point in a stream's work: record it on one stream, wait for it on another or on the host.
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  /// Marks the work issued so far on the current stream.
  void record();
  /// Makes later work on the current stream wait for the recorded point (the host does not wait).
  void wait() const;
  /// Blocks the host until the recorded point is reached.
  void synchronize() const;
  /// Milliseconds between `earlier`'s recorded point and this one (both recorded and reached).
  float elapsed_ms_since(const Event& earlier) const;

 private:
  void* handle_ = nullptr;
};

/// Ordered on the current stream like a kernel; `src` may be reused as soon as this returns (small uploads go
/// through pinned staging without waiting, large ones wait for the copy: Note [asynchronous uploads]).
void copy_host_to_device(void* dst, const void* src, std::size_t bytes);
/// Returns when the data is on the host (waits for the current stream's earlier work).
void copy_device_to_host(void* dst, const void* src, std::size_t bytes);
void copy_device_to_device(void* dst, const void* src, std::size_t bytes);
void synchronize();
/// Starts and stops the profiler's collection (cudaProfilerStart / cudaProfilerStop): under
/// `ncu --profile-from-start off` only the kernels between the two are profiled (bench_cuda_gpt's timed steps).
void profiler_start();
void profiler_stop();

// Note [CUDA graphs of a step]
// A compiled GPU step (CompileOptions::cuda_graphs, Note [compiled steps]) runs as CUDA graphs: each call's work
// is captured on its stream (cudaStreamBeginCapture, relaxed mode) instead of launched, and launched as one
// graph per stretch of the step between host reads. A read (a download, item(), a synchronization) ends the
// stretch's capture; its graph updates the executable graph of the same stretch from the last call
// (cudaGraphExecUpdate: the nodes' arguments, with the arena's fixed addresses mostly the same) or, when its
// shape changed, is instantiated anew; it is launched; then the read runs and the next stretch's capture
// begins. A stretch of more launches than CompileOptions::graph_chunk is cut into graphs of that many, so that
// the GPU runs one while the host captures the next (a whole stretch would leave the GPU idle while it is
// captured). So every call runs its own host code and captures what it launches: a graph is never replayed with
// stale arguments, whatever the step's data does. What a launch-bound step saves: the GPU runs each stretch's
// kernels back to back, and the host records nodes instead of launching kernels. A step whose boundary is
// decided on the device (train::StepOptions::device_boundary) is one stretch before its one read (and the
// refresh of its 16-bit weight copies after it).
// Uploads during a capture (token ids, tables, the step inputs) are copied into pinned blocks that the step's
// graphs own, at the same offsets every call, and read by the graph's copy nodes when it runs; two pools serve
// alternate calls, and a call first waits for the graphs of the call before last (which read its pool). Not
// captured: work on another stream inside the step (a side stream, NCCL's), which a capture on one stream does
// not order; train_gpt refuses --cuda-graphs with --dist, --tp and --pp. A call the capture cannot take (an event
// query or a synchronization that is not a read) invalidates it: the stretch's work did not run, and the error
// says so. The bookkeeping is detail::GraphCapture (step_graphs.hpp), tested on the CPU.

/// The CUDA graphs of one compiled step (Note [CUDA graphs of a step]): begin() before the step's work on the
/// current stream (a Stream, not the legacy default stream), end() after it. The bookkeeping is
/// detail::GraphCapture (step_graphs.hpp); this class gives it the CUDA runtime and the thread's reads and uploads.
class StepGraphs {
 public:
  StepGraphs();
  ~StepGraphs();
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;
  /// Waits for the last call's graphs, then begins capturing the step's first stretch on the current stream.
  void begin();
  /// Ends the open stretch's capture and launches it (the work is queued, not finished, on return).
  void end();
  /// After an exception inside the step: ends the open capture and drops it (its work does not run).
  void abandon() noexcept;
  /// The most launches one graph takes (0: a whole stretch between reads); see detail::GraphCapture::set_chunk.
  void set_chunk(std::size_t launches);
  /// Before each launch of the step (CompiledStep tells it through the launch watch): cuts a long stretch.
  void note_launch();
  const GraphStats& stats() const;
  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// fill and add_inplace are declared once for both devices (detail/kernels/core.hpp).

}  // namespace tg::backend::cuda
