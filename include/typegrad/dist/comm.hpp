// Communicators: one interface for collectives between the processes of a run (all-reduce, reduce-scatter,
// all-gather, broadcast, send/recv, barrier; sum or mean; blocking or async with a handle), implemented by
// MPI for CPU buffers, NCCL for CUDA buffers, and a single-process world that needs neither.
//   tg::dist::Communicator& world = tg::dist::world();        // MPI under mpirun/srun, else world size 1
//   world.all_reduce(t, tg::dist::ReduceOp::avg);  auto w = world.all_reduce_async(buffer_of(t));  w.wait();
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "typegrad/core/device.hpp"
#include "typegrad/core/dtype.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/core/tensor.hpp"

namespace tg::dist {

// Note [communicators]
// A Communicator is one group of processes (ranks 0 .. size-1) and the collectives over raw buffers of one
// element type (fp32, fp64, bf16, fp16, int64, int32, uint8) on one device. Every rank calls the same
// collectives in the same order with the same counts (MPI's and NCCL's rule); a mismatch is undefined there,
// so the layers above (DataParallel) derive every call from state all ranks share. ReduceOp::avg is the sum
// divided by size(), applied after the sum (so it is the sum's rounding, then one division). 16-bit sums are
// added in fp32 and rounded once per pairwise addition.
//   * MPI (src/dist/comm.cpp, Debian's OpenMPI): CPU buffers; each call is one of MPI's non-blocking
//     collectives (so calls in flight start in program order on every rank, as MPI requires), progressed
//     by Work::test() and completed by Work::wait(). Every rank ends an all-reduce with the same bits (the
//     tests check it for 2 and 3 ranks), so DDP replicas that start equal stay equal. A wait longer than
//     the timeout (set_timeout, default 300 s) ends the
//     process with a message naming the call: a rank that died or hangs never leaves the others waiting
//     forever. Errors inside MPI are returned, not fatal, and become the same message.
//   * NCCL (backends/cuda/nccl.cu): CUDA buffers; work runs on the communicator's own stream, ordered after
//     the caller's stream by an event, and Work::wait() makes the caller's stream wait for it. Its unique id
//     is broadcast over the MPI world, after the ranks have agreed that each could set itself up (Note [NCCL
//     start-up] in backends/cuda/nccl.cu: a rank's failure stops every rank with the cause, none waits for it).
//     A send and a receive to be in flight together go through exchange_async (one NCCL group).
//   * SingleProcess: size 1; every collective is the identity (a copy where input and output differ), so a
//     program written for N ranks runs alone unchanged, with no MPI daemon.

enum class ReduceOp { sum, avg };

/// A raw buffer: `count` elements of `dtype` at `data` on `device`.
struct Buffer {
  void* data = nullptr;
  std::int64_t count = 0;
  DType dtype = DType::f32;
  DeviceKind device = DeviceKind::cpu;
};

namespace detail {
/// counts[0] + ... + counts[n-1].
inline std::int64_t total_count(std::span<const std::int64_t> counts) {
  std::int64_t n = 0;
  for (auto c : counts) n += c;
  return n;
}
/// The bytes of `n` elements of `d`.
inline std::size_t buffer_bytes(DType d, std::int64_t n) { return dtype_size(d) * static_cast<std::size_t>(n); }
}  // namespace detail

/// A contiguous tensor's elements as a Buffer.
template <Element T, Device D>
Buffer buffer_of(const Tensor<T, D>& t) {
  TG_CHECK(t.is_contiguous(), "dist: a communicated tensor must be contiguous, its shape is ", t.shape(), " with strides ",
           t.strides());
  return {static_cast<void*>(t.data()), t.numel(), dtype_traits<T>::dtype, device_traits<D>::kind};
}

// Note [device-ordered waits]
// A collective on a GPU runs on the communicator's stream. Work::wait() orders the caller's stream after it and
// then waits on the host, polling NCCL's error state, so that a dead peer ends the process after the timeout
// instead of hanging. Work::order_on_device() does the first half only: the device runs the caller's later work
// after the collective, the host goes on queueing, and the Work stays pending until its wait(), which still
// checks the collective. A step whose boundary is decided on the device (Note [the device boundary across
// ranks]) reads nothing until its one read, so DataParallel orders its bucket reductions and the boundary's
// sums on the device while the step runs and waits for them on the host in settle(), which DeviceBoundary::read()
// calls before its download. Communicators without a device stream (MPI, the CPU's) have nothing to order:
// there order_on_device() is wait().

/// An operation in flight. test() progresses it and says whether it finished; wait() blocks until it has
/// (then the output buffer holds the result). A default-constructed Work is already complete.
class Work {
 public:
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual bool test() = 0;
    virtual void wait() = 0;
    /// Orders the device's later work after this operation without waiting on the host; false when there is
    /// no device stream to order (the caller then waits).
    virtual bool order_on_device() { return false; }
  };
  Work() = default;
  explicit Work(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  bool test() { return !impl_ || impl_->test(); }
  void wait() {
    if (impl_) impl_->wait();
    impl_.reset();
  }
  /// The device's later work runs after this operation (Note [device-ordered waits]); the Work stays pending
  /// for wait() on a GPU, and is waited for here elsewhere.
  void order_on_device() {
    if (impl_ && impl_->order_on_device()) return;
    wait();
  }
  bool pending() const { return impl_ != nullptr; }

 private:
  std::unique_ptr<Impl> impl_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// "mpi", "nccl" or "single".
  virtual std::string backend() const = 0;
  /// The device whose buffers this communicator moves.
  virtual DeviceKind device() const = 0;

  /// In place: every rank's `buf` becomes the elementwise sum (or mean) over the ranks.
  virtual Work all_reduce_async(Buffer buf, ReduceOp op) = 0;
  /// `send` holds counts[0] + ... + counts[size-1] elements; rank r receives the reduction of its part (the
  /// counts[r] elements after the first r parts) in `recv` (counts[r] elements). Counts may be 0.
  virtual Work reduce_scatter_async(Buffer send, Buffer recv, std::span<const std::int64_t> counts, ReduceOp op) = 0;
  /// Rank r's `send` (counts[r] elements) lands in every rank's `recv` after the parts of ranks 0 .. r-1.
  /// `send` may alias that part of `recv` (in place).
  virtual Work all_gather_async(Buffer send, Buffer recv, std::span<const std::int64_t> counts) = 0;
  /// Every rank's `buf` becomes root's.
  virtual Work broadcast_async(Buffer buf, int root) = 0;
  virtual void send(Buffer buf, int peer, int tag) = 0;
  virtual void recv(Buffer buf, int peer, int tag) = 0;
  /// Non-blocking send and receive (a pipeline stage posts both before waiting, so neighbours never wait on
  /// each other's sends).
  virtual Work send_async(Buffer buf, int peer, int tag) = 0;
  virtual Work recv_async(Buffer buf, int peer, int tag) = 0;
  /// A send to `to` and a receive from `from` posted together: a pipeline stage's exchange with a neighbour,
  /// which may at the same moment post the mirror exchange. The default posts send_async, then recv_async
  /// (non-blocking MPI completes them in either order); NCCL, whose send and receive on one stream would
  /// otherwise run one after the other (two ranks sending to each other first would wait on each other
  /// forever), issues the two as one group. Wait on both Works: under NCCL `received` completes both and `sent`
  /// is already complete.
  struct Exchange {
    Work sent, received;
  };
  virtual Exchange exchange_async(Buffer send, int to, int send_tag, Buffer recv, int from, int recv_tag) {
    Exchange e;
    e.sent = send_async(send, to, send_tag);
    e.received = recv_async(recv, from, recv_tag);
    return e;
  }
  virtual void barrier() = 0;
  /// A communicator of the ranks that pass the same `color`, ranked by `key` (then by rank here): MPI_Comm_split.
  /// A collective over this communicator. Rank r of a process grid gets its tensor-, pipeline- and
  /// data-parallel groups this way.
  virtual std::unique_ptr<Communicator> split(int color, int key) {
    (void)color;
    (void)key;
    throw Error("dist::split: the ", backend(), " communicator cannot be split");
  }

  void all_reduce(Buffer buf, ReduceOp op) { all_reduce_async(buf, op).wait(); }
  void reduce_scatter(Buffer send, Buffer recv, std::span<const std::int64_t> counts, ReduceOp op) {
    reduce_scatter_async(send, recv, counts, op).wait();
  }
  void all_gather(Buffer send, Buffer recv, std::span<const std::int64_t> counts) { all_gather_async(send, recv, counts).wait(); }
  void broadcast(Buffer buf, int root) { broadcast_async(buf, root).wait(); }

  template <Element T, Device D>
  void all_reduce(const Tensor<T, D>& t, ReduceOp op) {
    all_reduce(buffer_of(t), op);
  }
  template <Element T, Device D>
  void broadcast(const Tensor<T, D>& t, int root) {
    broadcast(buffer_of(t), root);
  }
  /// Sums (or averages) host doubles over the ranks, in place.
  void all_reduce(std::span<double> values, ReduceOp op) {
    all_reduce(Buffer{values.data(), static_cast<std::int64_t>(values.size()), DType::f64, DeviceKind::cpu}, op);
  }
  /// Every rank's string, in rank order (host only; for start-up checks and messages).
  std::vector<std::string> all_gather_strings(const std::string& mine);

  /// How long a wait may take before the process ends with a message (Note [communicators]).
  void set_timeout(std::chrono::seconds s) { timeout_ = s; }
  std::chrono::seconds timeout() const { return timeout_; }

 protected:
  /// Checks the arguments every implementation shares (names the call in the message).
  void check_counts(const char* what, std::span<const std::int64_t> counts) const;

 private:
  std::chrono::seconds timeout_{300};
};

/// The size-1 world: collectives are identities (Note [communicators]).
class SingleProcess final : public Communicator {
 public:
  explicit SingleProcess(DeviceKind device = DeviceKind::cpu) : device_(device) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }
  DeviceKind device() const override { return device_; }
  Work all_reduce_async(Buffer, ReduceOp) override { return {}; }
  Work reduce_scatter_async(Buffer send, Buffer recv, std::span<const std::int64_t> counts, ReduceOp op) override;
  Work all_gather_async(Buffer send, Buffer recv, std::span<const std::int64_t> counts) override;
  Work broadcast_async(Buffer, int root) override;
  void send(Buffer, int peer, int) override;
  void recv(Buffer, int peer, int) override;
  Work send_async(Buffer b, int peer, int tag) override {
    send(b, peer, tag);
    return {};
  }
  Work recv_async(Buffer b, int peer, int tag) override {
    recv(b, peer, tag);
    return {};
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override { return std::make_unique<SingleProcess>(device_); }

 private:
  DeviceKind device_;
};

/// Whether this process was started by an MPI launcher (mpirun, mpiexec, srun): its environment names a rank.
bool launched_by_mpi();
/// Whether typegrad was built with MPI (TG_HAVE_MPI).
bool have_mpi();
/// The process world: MPI's COMM_WORLD when launched by an MPI launcher (MPI is initialised on first use and
/// finalised at exit), else a SingleProcess. Started by a launcher without MPI support built in: an error.
Communicator& world();
/// Ends every rank of the world now with `code` (MPI_Abort under MPI; exit otherwise), after flushing
/// stdout and stderr. For an error on one rank that the others cannot see.
[[noreturn]] void abort_world(int code);

/// Ends the process after a communication failure or timeout: one line on stderr naming the rank and `what`,
/// then abort_world(5).
[[noreturn]] void communication_failed(const Communicator& comm, const std::string& what);

}  // namespace tg::dist
