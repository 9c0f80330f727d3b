// The bookkeeping of a compiled step's CUDA graphs (Note [CUDA graphs of a step], runtime.hpp): which stretch of
// the step is being captured, when a read closes it, whether its executable graph is updated or made anew, which
// pinned block an upload goes to and when a pool may be written again. Plain C++: the CUDA calls are behind
// GraphDriver (backends/cuda/runtime.cu implements it with the runtime API), so tests run this on the CPU with a
// driver of their own (tests/cuda/test_step_graphs.cpp).
//   GraphCapture g(driver);  g.begin(stream);  /* launches */  g.before_read(); /* read */ g.after_read();  g.end();
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "typegrad/core/error.hpp"

namespace tg::backend::cuda {

/// What a StepGraphs did, summed over its calls (Note [CUDA graphs of a step]).
struct GraphStats {
  std::int64_t calls = 0;         ///< steps run through graphs
  std::int64_t launches = 0;      ///< graphs launched (a step: one per stretch between host reads)
  std::int64_t nodes = 0;         ///< their nodes (kernels, copies, memsets), in all
  std::int64_t updated = 0;       ///< launches of an executable graph updated from the new capture
  std::int64_t instantiated = 0;  ///< executable graphs made anew (a stretch's first call, or a changed shape)
  std::int64_t uploads = 0;       ///< host-to-device copies captured from the graphs' pinned blocks
  std::int64_t upload_bytes = 0;
};

namespace detail {

/// The CUDA calls GraphCapture makes (handles are opaque pointers: cudaStream_t, cudaGraph_t, ...).
class GraphDriver {
 public:
  virtual ~GraphDriver() = default;
  virtual void begin_capture(void* stream) = 0;
  /// Ends the capture on `stream`: its graph and node count. Throws a tg::Error saying why when the capture failed
  /// (nothing to destroy then).
  virtual void* end_capture(void* stream, std::size_t* nodes) = 0;
  /// Ends the capture on `stream` and drops what it captured (after an exception; never throws).
  virtual void drop_capture(void* stream) noexcept = 0;
  virtual void destroy_graph(void* graph) noexcept = 0;
  /// Updates `exec` in place from `graph`: false when their shapes differ (nothing changed then).
  virtual bool update(void* exec, void* graph) noexcept = 0;
  virtual void* instantiate(void* graph) = 0;
  virtual void destroy_exec(void* exec) noexcept = 0;
  virtual void launch(void* exec, void* stream) = 0;
  virtual void* host_alloc(std::size_t bytes) = 0;  // pinned
  virtual void host_free(void* p) noexcept = 0;
  virtual void* event_create() = 0;
  virtual void event_destroy(void* event) noexcept = 0;
  /// Records `event` after the work queued on `stream`; false when that failed (nothing thrown).
  virtual bool event_record(void* event, void* stream) noexcept = 0;
  virtual void event_wait(void* event) = 0;  // the host waits for it
  virtual void stream_wait(void* stream) noexcept = 0;  // the host waits for the stream's work
};

/// One compiled step's graphs (Note [CUDA graphs of a step]): begin() before the step's work, before_read() and
/// after_read() around each read inside it, note_launch() before each launch (a stretch longer than the chunk is
/// cut there, so the GPU starts on its first graph while the host captures the next), end() after it; abandon()
/// after an exception.
class GraphCapture {
 public:
  static constexpr std::size_t kBlockBytes = std::size_t{1} << 20;  // a pinned block's least size
  static constexpr std::size_t kAlign = 256;                         // an upload's offset in its block

  explicit GraphCapture(GraphDriver& driver) : d_(&driver) {
    for (auto& p : pools_) p.done = d_->event_create();
  }
  ~GraphCapture() {
    abandon();
    for (auto& p : pools_) {
      if (p.pending) {
        try {
          d_->event_wait(p.done);  // the graphs still reading the pool's blocks
        } catch (...) {
        }
      }
      for (auto& b : p.blocks) d_->host_free(b.host);
      d_->event_destroy(p.done);
    }
    for (void* e : execs_)
      if (e) d_->destroy_exec(e);
  }
  GraphCapture(const GraphCapture&) = delete;
  GraphCapture& operator=(const GraphCapture&) = delete;

  /// Begins the step's first stretch on `stream` (a Stream: null, the legacy default stream, cannot be captured),
  /// after the call before last's graphs, which read the pinned pool this call writes.
  void begin(void* stream) {
    TG_CHECK(!active_, "CUDA graphs: begin() while the step's capture is open");
    TG_CHECK(stream != nullptr, "CUDA graphs: a step is captured on a Stream (StreamGuard), not on the legacy default stream");
    pool_ ^= 1;
    Pool& p = pools_[pool_];
    if (p.pending) {
      d_->event_wait(p.done);
      p.pending = false;
    }
    p.block = 0;
    p.used = 0;
    stream_ = stream;
    stretch_ = 0;
    open();
    active_ = true;
  }
  /// Ends the open stretch and launches it; the step's graphs are queued on return.
  void end() {
    TG_CHECK(active_, "CUDA graphs: end() without begin()");
    try {
      if (capturing_) close();
    } catch (...) {
      abandon();  // the state closed; the stretches launched before still guard their pool
      throw;
    }
    active_ = false;
    Pool& p = pools_[pool_];
    if (!d_->event_record(p.done, stream_)) {
      d_->stream_wait(stream_);  // nothing marks the graphs' end: wait for them, so the pool is free
      throw Error("CUDA graphs: recording the end of the step's graphs failed");
    }
    p.pending = true;
    ++stats_.calls;
  }
  /// After an exception inside the step: the open stretch's capture is dropped (its work does not run) and the state
  /// closed; never throws.
  void abandon() noexcept {
    if (!active_) return;
    if (capturing_) {
      d_->drop_capture(stream_);
      capturing_ = false;
    }
    active_ = false;
    Pool& p = pools_[pool_];  // the stretches launched before the failure may still read the pool
    if (d_->event_record(p.done, stream_)) p.pending = true;
    else d_->stream_wait(stream_);
  }
  /// A read inside the step (a download, a synchronization): the open stretch is captured up to here and launched.
  void before_read() {
    if (capturing_) close();
  }
  /// After the read: the next stretch's capture begins.
  void after_read() {
    if (active_ && !capturing_) open();
  }
  /// The most launches a graph takes (0: a whole stretch between reads). A stretch of more is cut into graphs of
  /// this many, so that the GPU runs one while the host captures the next.
  void set_chunk(std::size_t launches) { chunk_ = launches; }
  /// Before a launch on the stream under capture: past the chunk, the open graph is launched and the next begun.
  void note_launch() {
    if (!capturing_) return;
    if (chunk_ > 0 && in_graph_ >= chunk_) {
      close();
      open();
    }
    ++in_graph_;
  }
  /// Whether uploads on `stream` are captured now (they go through pinned()).
  bool capturing_on(void* stream) const { return capturing_ && stream == stream_; }
  /// `bytes` of this call's pinned pool for a captured upload (offsets aligned to kAlign, the same every call that
  /// uploads the same sizes in the same order).
  void* pinned(std::size_t bytes) {
    Pool& p = pools_[pool_];
    const std::size_t need = (std::max<std::size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
    while (p.block < p.blocks.size() && p.used + need > p.blocks[p.block].bytes) {
      ++p.block;
      p.used = 0;
    }
    if (p.block == p.blocks.size()) {
      const std::size_t size = std::max(need, kBlockBytes);
      p.blocks.push_back({d_->host_alloc(size), size});
      p.used = 0;
    }
    void* at = static_cast<char*>(p.blocks[p.block].host) + p.used;
    p.used += need;
    ++stats_.uploads;
    stats_.upload_bytes += static_cast<std::int64_t>(bytes);
    return at;
  }
  bool active() const { return active_; }
  bool capturing() const { return capturing_; }
  const GraphStats& stats() const { return stats_; }

 private:
  struct Pool {
    struct Block {
      void* host = nullptr;
      std::size_t bytes = 0;
    };
    std::vector<Block> blocks;
    std::size_t block = 0, used = 0;
    void* done = nullptr;  // recorded after the graphs of the last call that wrote this pool
    bool pending = false;
  };

  void open() {
    d_->begin_capture(stream_);
    capturing_ = true;
    in_graph_ = 0;
  }
  /// Ends the open stretch's capture, updates or instantiates its executable graph, launches it.
  void close() {
    capturing_ = false;
    std::size_t nodes = 0;
    void* const g = d_->end_capture(stream_, &nodes);
    struct Drop {
      GraphDriver* d;
      void* g;
      ~Drop() { d->destroy_graph(g); }
    } drop{d_, g};
    if (nodes == 0) return;  // two reads in a row: nothing between them
    const std::size_t k = stretch_++;
    if (execs_.size() <= k) execs_.resize(k + 1, nullptr);
    void*& e = execs_[k];
    if (e != nullptr) {  // the nodes' arguments from the new capture; launches already queued keep the old ones
      if (d_->update(e, g)) {
        ++stats_.updated;
      } else {  // another shape of the stretch: made anew
        d_->destroy_exec(e);
        e = nullptr;
      }
    }
    if (e == nullptr) {
      e = d_->instantiate(g);
      ++stats_.instantiated;
    }
    d_->launch(e, stream_);
    ++stats_.launches;
    stats_.nodes += static_cast<std::int64_t>(nodes);
  }

  GraphDriver* d_;
  void* stream_ = nullptr;
  bool active_ = false;      // between begin() and end()
  bool capturing_ = false;   // a stretch's capture is open on stream_
  std::size_t stretch_ = 0;  // the next graph's index in this call
  std::size_t chunk_ = 0;    // set_chunk()
  std::size_t in_graph_ = 0;  // launches noted in the open graph
  std::vector<void*> execs_;  // by stretch, from the last calls
  Pool pools_[2];             // alternate calls: one call's uploads are written while the last one's graphs run
  int pool_ = 0;
  GraphStats stats_;
};

}  // namespace detail
}  // namespace tg::backend::cuda
