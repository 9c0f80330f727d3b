// tg::dist's NCCL communicator (typegrad/dist/nccl.hpp, Note [communicators]): collectives over CUDA buffers
// on the communicator's own stream, ordered after the caller's current stream by an event; Work::wait()
// orders the caller's stream after them and watches for a dead peer. Built without NCCL (TG_HAVE_NCCL=0)
// make_nccl_communicator throws instead.
#include "typegrad/dist/nccl.hpp"

#if TG_HAVE_NCCL
#include <nccl.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "check.cuh"
#include "common.cuh"
#include "typegrad/core/dtype.hpp"
#include "typegrad/detail/cuda/runtime.hpp"

/// Checks an NCCL call: anything but ncclSuccess throws tg::Error naming the call and NCCL's message.
#define TG_NCCL_CHECK(call)                                                                                 \
  do {                                                                                                      \
    const ncclResult_t tg_nccl_status_ = (call);                                                            \
    if (tg_nccl_status_ != ncclSuccess)                                                                     \
      throw ::tg::Error("NCCL error at ", __FILE__, ":", __LINE__, ": ", #call, " failed: ",                 \
                        ncclGetErrorString(tg_nccl_status_));                                               \
  } while (0)

namespace tg::dist {
namespace {

using detail::total_count;

/// b[i] *= s, rounded as the MPI communicator's average rounds it (src/dist/comm.cpp: the product in double
/// of the element as a float, then to float, then to the element type).
template <class T>
__global__ void scale_kernel(T* b, std::int64_t n, double s) {
  TG_GRID_STRIDE(i, n) {
    if constexpr (std::is_same_v<T, double>) b[i] *= s;
    else b[i] = T(static_cast<float>(static_cast<double>(static_cast<float>(b[i])) * s));
  }
}
void scale_on(Buffer b, double s, cudaStream_t stream) {
  if (b.count == 0) return;
  const unsigned grid = backend::cuda::detail::grid_for(b.count);
  const int threads = backend::cuda::detail::kThreads;
  switch (b.dtype) {
    case DType::f64: scale_kernel<<<grid, threads, 0, stream>>>(static_cast<double*>(b.data), b.count, s); break;
    case DType::f32: scale_kernel<<<grid, threads, 0, stream>>>(static_cast<float*>(b.data), b.count, s); break;
    case DType::bf16: scale_kernel<<<grid, threads, 0, stream>>>(static_cast<bf16*>(b.data), b.count, s); break;
    case DType::f16: scale_kernel<<<grid, threads, 0, stream>>>(static_cast<fp16*>(b.data), b.count, s); break;
    default: throw Error("dist: ReduceOp::avg needs a floating-point buffer, this one is ", dtype_name(b.dtype));
  }
  TG_CUDA_CHECK(cudaGetLastError());
}

cudaStream_t caller_stream() { return static_cast<cudaStream_t>(backend::cuda::current_stream()); }

ncclDataType_t type_of(DType d) {
  switch (d) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i64: return ncclInt64;
    case DType::i32: return ncclInt32;
    case DType::u8: return ncclUint8;
    case DType::i8: return ncclInt8;
  }
  throw Error("dist: no NCCL type for ", dtype_name(d));
}

class NcclCommunicator;

// One call's completion: an event recorded on the communicator's stream after the call.
class NcclWork final : public Work::Impl {
 public:
  NcclWork(NcclCommunicator& comm, const char* what, cudaEvent_t done) : comm_(comm), what_(what), done_(done) {}
  ~NcclWork() override;
  bool test() override;
  void wait() override;
  bool order_on_device() override;

 private:
  bool poll();  // whether the event was reached; a CUDA or NCCL error ends the process
  NcclCommunicator& comm_;
  const char* what_;
  cudaEvent_t done_;
  bool waited_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(Communicator& bootstrap) : rank_(bootstrap.rank()), size_(bootstrap.size()) {
    TG_CHECK(bootstrap.device() == DeviceKind::cpu, "dist: the NCCL communicator is set up over a communicator of host buffers (the MPI "
             "world), not a '", bootstrap.backend(), "' one of CUDA buffers");
    set_timeout(bootstrap.timeout());
    // Note [NCCL start-up]: ncclCommInitRank is a collective, and so is the unique id's broadcast. A rank that
    // fails before them (no GPU, no memory for the stream or the barrier word, rank 0 without an id) would leave
    // the others waiting there until the bootstrap's timeout ended them with a message that names the wait,
    // not the cause. So each rank first does what can fail on its own, then the ranks exchange their outcomes
    // over the bootstrap (MPI) and all stop together, each naming every rank that failed and why.
    ncclUniqueId id{};
    std::string problem;
    try {
      TG_CHECK(backend::cuda::device_count() > 0, "the NCCL communicator needs a GPU: ", backend::cuda::device_description());
      TG_CUDA_CHECK(cudaGetDevice(&device_));
      TG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      TG_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
      TG_CUDA_CHECK(cudaMalloc(&barrier_, sizeof(int)));
      TG_CUDA_CHECK(cudaMemset(barrier_, 0, sizeof(int)));
      if (rank_ == 0) TG_NCCL_CHECK(ncclGetUniqueId(&id));
    } catch (const std::exception& e) {
      problem = e.what();
      if (problem.empty()) problem = "an error without a message";
    }
    try {
      const std::vector<std::string> outcomes = bootstrap.all_gather_strings(problem);
      std::string failed;
      for (std::size_t r = 0; r < outcomes.size(); ++r)
        if (!outcomes[r].empty()) failed += "\n  rank " + std::to_string(r) + ": " + outcomes[r];
      TG_CHECK(failed.empty(), "dist: the NCCL communicator was not set up, because ranks failed before it:", failed);
      bootstrap.broadcast(Buffer{&id, static_cast<std::int64_t>(sizeof id), DType::u8, DeviceKind::cpu}, 0);
      // ncclCommInitRank waits for every rank: one that fails inside it leaves the others waiting in NCCL's
      // bootstrap, which has no timeout, so a failure there ends every rank (a world of one throws).
      if (const ncclResult_t init = ncclCommInitRank(&comm_, size_, id, rank_); init != ncclSuccess) {
        comm_ = nullptr;
        const std::string why = std::string("ncclCommInitRank failed on rank ") + std::to_string(rank_) + ": " +
                                ncclGetErrorString(init) + " (" + ncclGetLastError(nullptr) + ")";
        if (size_ > 1) communication_failed(bootstrap, "the NCCL communicator was not set up: " + why);
        throw Error("dist: ", why);
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~NcclCommunicator() override { release(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  DeviceKind device() const override { return DeviceKind::cuda; }

  Work all_reduce_async(Buffer buf, ReduceOp op) override {
    check_device("all_reduce", buf);
    const ncclRedOp_t rop = op_of("all_reduce", buf.dtype, op);
    return issue("all_reduce", [&] {
      TG_NCCL_CHECK(ncclAllReduce(buf.data, buf.data, static_cast<std::size_t>(buf.count), type_of(buf.dtype), rop, comm_, stream_));
      if (op == ReduceOp::avg) scale_on(buf, 1.0 / size_, stream_);
    });
  }

  // Equal counts: one ncclReduceScatter. Otherwise one ncclReduce per rank r (root r, the counts[r] elements
  // after the first r parts), grouped so NCCL runs them as one operation.
  Work reduce_scatter_async(Buffer send, Buffer recv, std::span<const std::int64_t> counts, ReduceOp op) override {
    check_device("reduce_scatter", send);
    check_device("reduce_scatter", recv);
    check_counts("reduce_scatter", counts);
    const auto mine = counts[static_cast<std::size_t>(rank_)];
    TG_CHECK(send.count == total_count(counts) && recv.count == mine && send.dtype == recv.dtype, "dist::reduce_scatter: send holds ",
             send.count, " and recv ", recv.count, " elements; the counts sum to ", total_count(counts), " with ", mine, " for rank ", rank_);
    const ncclRedOp_t rop = op_of("reduce_scatter", send.dtype, op);
    const ncclDataType_t type = type_of(send.dtype);
    return issue("reduce_scatter", [&] {
      if (equal(counts)) {
        TG_NCCL_CHECK(ncclReduceScatter(send.data, recv.data, static_cast<std::size_t>(mine), type, rop, comm_, stream_));
        if (op == ReduceOp::avg) scale_on(recv, 1.0 / size_, stream_);
        return;
      }
      group([&] {
        std::int64_t at = 0;
        for (int r = 0; r < size_; ++r) {
          const auto c = counts[static_cast<std::size_t>(r)];
          if (c) TG_NCCL_CHECK(ncclReduce(static_cast<char*>(send.data) + detail::buffer_bytes(send.dtype, at), r == rank_ ? recv.data : nullptr,
                                          static_cast<std::size_t>(c), type, rop, r, comm_, stream_));
          at += c;
        }
      });
      if (op == ReduceOp::avg) scale_on(recv, 1.0 / size_, stream_);
    });
  }

  // Equal counts: one ncclAllGather. Otherwise one ncclBroadcast per rank r (root r, into recv after the first r
  // parts; NCCL reads sendbuff on the root only, so the other ranks pass their destination), grouped.
  Work all_gather_async(Buffer send, Buffer recv, std::span<const std::int64_t> counts) override {
    check_device("all_gather", send);
    check_device("all_gather", recv);
    check_counts("all_gather", counts);
    const auto mine = counts[static_cast<std::size_t>(rank_)];
    TG_CHECK(recv.count == total_count(counts) && send.count == mine && send.dtype == recv.dtype, "dist::all_gather: send holds ",
             send.count, " and recv ", recv.count, " elements; the counts sum to ", total_count(counts), " with ", mine, " for rank ", rank_);
    const ncclDataType_t type = type_of(send.dtype);
    return issue("all_gather", [&] {
      if (equal(counts)) {
        TG_NCCL_CHECK(ncclAllGather(send.data, recv.data, static_cast<std::size_t>(mine), type, comm_, stream_));
        return;
      }
      group([&] {
        std::int64_t at = 0;
        for (int r = 0; r < size_; ++r) {
          const auto c = counts[static_cast<std::size_t>(r)];
          void* part = static_cast<char*>(recv.data) + detail::buffer_bytes(recv.dtype, at);
          if (c) TG_NCCL_CHECK(ncclBroadcast(r == rank_ ? send.data : part, part, static_cast<std::size_t>(c), type, r, comm_, stream_));
          at += c;
        }
      });
    });
  }

  Work broadcast_async(Buffer buf, int root) override {
    check_device("broadcast", buf);
    TG_CHECK(root >= 0 && root < size_, "dist::broadcast: root ", root, " is not a rank (world size ", size_, ")");
    return issue("broadcast", [&] {
      TG_NCCL_CHECK(ncclBroadcast(buf.data, buf.data, static_cast<std::size_t>(buf.count), type_of(buf.dtype), root, comm_, stream_));
    });
  }

  // NCCL has no tags: messages between two ranks match in the order they are posted.
  void send(Buffer buf, int peer, int) override { point_to_point("send", buf, peer, true).wait(); }
  void recv(Buffer buf, int peer, int) override { point_to_point("recv", buf, peer, false).wait(); }
  // NCCL has no tags; a send and a receive issued on the one stream run in order, so a pipeline's paired
  // exchange goes through exchange_async, which groups them.
  Work send_async(Buffer buf, int peer, int) override { return point_to_point("send", buf, peer, true); }
  Work recv_async(Buffer buf, int peer, int) override { return point_to_point("recv", buf, peer, false); }
  // One ncclGroupStart / ncclGroupEnd around the send and the receive: NCCL then progresses both at once, so two
  // neighbours that each send first (stage s its activation to s + 1 while s + 1 sends its gradient to s) do not
  // each wait for the other's receive. One event completes both.
  Exchange exchange_async(Buffer send, int to, int, Buffer recv, int from, int) override {
    check_peer("exchange (send)", send, to);
    check_peer("exchange (receive)", recv, from);
    Exchange e;
    e.received = issue("exchange", [&] {
      group([&] {
        TG_NCCL_CHECK(ncclSend(send.data, static_cast<std::size_t>(send.count), type_of(send.dtype), to, comm_, stream_));
        TG_NCCL_CHECK(ncclRecv(recv.data, static_cast<std::size_t>(recv.count), type_of(recv.dtype), from, comm_, stream_));
      });
    });
    return e;
  }
  void barrier() override {
    check_device("barrier", Buffer{barrier_, 1, DType::i32, DeviceKind::cuda});
    issue("barrier", [&] { TG_NCCL_CHECK(ncclAllReduce(barrier_, barrier_, 1, ncclInt32, ncclSum, comm_, stream_)); }).wait();
  }

  /// Ends the process after `what` (a timeout, or an error of CUDA or of NCCL). The NCCL communicator is not
  /// aborted first: ncclCommAbort joins NCCL's threads and synchronizes its streams, which can itself wait for a
  /// peer that is gone, while ending the process (MPI_Abort) tears down the CUDA context and its kernels anyway.
  [[noreturn]] void fail(const std::string& what) { communication_failed(*this, what); }
  /// NCCL's error from its background checks (a peer or the network gone), ncclSuccess while there is none.
  ncclResult_t async_error() const {
    ncclResult_t e = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &e) != ncclSuccess) return ncclSystemError;
    return e;
  }

 private:
  void check_device(const char* what, const Buffer& b) const {
    TG_CHECK(b.device == DeviceKind::cuda, "dist::", what, ": the NCCL communicator moves CUDA buffers; host tensors go through MPI");
    int current = -1;
    TG_CUDA_CHECK(cudaGetDevice(&current));
    TG_CHECK(current == device_, "dist::", what, ": the NCCL communicator was made on CUDA device ", device_, ", the current device is ",
             current);
  }
  // ReduceOp::avg is NCCL's sum, then one scale by 1/size() on the communicator's stream (scale_on), as the
  // MPI communicator does; defined on floating-point buffers only. (ncclAvg multiplies each rank's input by
  // 1/size() rounded to the element type before the sum: in bf16 a bias of 2^-9 for 3 ranks.)
  static ncclRedOp_t op_of(const char* what, DType d, ReduceOp op) {
    if (op == ReduceOp::sum) return ncclSum;
    TG_CHECK(d == DType::f32 || d == DType::f64 || d == DType::f16 || d == DType::bf16, "dist::", what,
             ": ReduceOp::avg needs a floating-point buffer, this one is ", dtype_name(d));
    return ncclSum;
  }
  bool equal(std::span<const std::int64_t> counts) const {
    for (auto c : counts)
      if (c != counts[0]) return false;
    return true;
  }
  // Runs `calls` between ncclGroupStart and ncclGroupEnd (the group is closed when a call throws).
  template <class Calls>
  static void group(Calls&& calls) {
    TG_NCCL_CHECK(ncclGroupStart());
    try {
      calls();
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    TG_NCCL_CHECK(ncclGroupEnd());
  }
  // The comm stream waits for the work issued so far on the caller's stream, runs `calls`, then records the
  // Work's event: the collective reads its inputs after their producers and its completion is observable.
  template <class Calls>
  Work issue(const char* what, Calls&& calls) {
    TG_CUDA_CHECK(cudaEventRecord(ready_, caller_stream()));
    TG_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    calls();
    cudaEvent_t done = nullptr;
    TG_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    auto work = std::make_unique<NcclWork>(*this, what, done);
    TG_CUDA_CHECK(cudaEventRecord(done, stream_));
    return Work(std::move(work));
  }
  void check_peer(const char* what, const Buffer& buf, int peer) const {
    check_device(what, buf);
    TG_CHECK(peer >= 0 && peer < size_ && peer != rank_, "dist::", what, ": peer ", peer, " is not another rank (world size ", size_,
             ", this is rank ", rank_, ")");
  }
  Work point_to_point(const char* what, Buffer buf, int peer, bool sending) {
    check_peer(what, buf, peer);
    const auto n = static_cast<std::size_t>(buf.count);
    const ncclDataType_t type = type_of(buf.dtype);
    return issue(what, [&] {
      if (sending) TG_NCCL_CHECK(ncclSend(buf.data, n, type, peer, comm_, stream_));
      else TG_NCCL_CHECK(ncclRecv(buf.data, n, type, peer, comm_, stream_));
    });
  }
  // Destroys what was made; a communicator with an error pending is aborted (destroying it would wait on it).
  void release() noexcept {
    if (comm_) {
      if (async_error() == ncclSuccess) (void)ncclCommDestroy(comm_);
      else (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    if (barrier_) (void)cudaFree(barrier_);
    if (ready_) (void)cudaEventDestroy(ready_);
    if (stream_) (void)cudaStreamDestroy(stream_);
    barrier_ = nullptr;
    ready_ = nullptr;
    stream_ = nullptr;
  }

  int rank_, size_;
  int device_ = -1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;  // recorded on the caller's stream before each call
  int* barrier_ = nullptr;       // one device int, all-reduced by barrier()
};

// A dropped handle still orders the caller's stream after the call (its buffers may be freed next).
NcclWork::~NcclWork() {
  if (!waited_) wait();
  (void)cudaEventDestroy(done_);
}

bool NcclWork::poll() {
  const cudaError_t q = cudaEventQuery(done_);
  if (q == cudaSuccess) return true;
  if (q != cudaErrorNotReady)
    comm_.fail(std::string(what_) + " failed on the GPU: " + cudaGetErrorName(q) + " (" + cudaGetErrorString(q) + ")");
  if (const ncclResult_t e = comm_.async_error(); e != ncclSuccess && e != ncclInProgress)
    comm_.fail(std::string(what_) + " failed in NCCL: " + ncclGetErrorString(e) + " (another rank probably ended; its own message says why)");
  return false;
}

bool NcclWork::test() { return poll(); }

// Note [device-ordered waits]: the caller's stream waits on the event; the host wait (with its error and
// timeout checks) stays for wait().
bool NcclWork::order_on_device() {
  if (const cudaError_t e = cudaStreamWaitEvent(caller_stream(), done_, 0); e != cudaSuccess)
    comm_.fail(std::string(what_) + ": ordering the caller's stream failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  return true;
}

// The caller's stream waits on the event (the device orders later work after the call); the host then waits
// too, polling NCCL's error state, so a peer that died ends this process after the timeout instead of hanging.
void NcclWork::wait() {
  waited_ = true;
  if (const cudaError_t e = cudaStreamWaitEvent(caller_stream(), done_, 0); e != cudaSuccess)
    comm_.fail(std::string(what_) + ": ordering the caller's stream failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  const auto t0 = std::chrono::steady_clock::now();
  for (long spins = 0; !poll(); ++spins) {
    if (spins < 2000) continue;  // a short spin: most completions are quick
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 20000 ? 20 : 200));
    if (std::chrono::steady_clock::now() - t0 > comm_.timeout())
      comm_.fail(std::string(what_) + " waited more than " + std::to_string(comm_.timeout().count()) +
                 " s for the other ranks: one probably died or is stuck (raise the limit with --dist-timeout)");
  }
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap) { return std::make_unique<NcclCommunicator>(bootstrap); }

}  // namespace tg::dist

#else  // !TG_HAVE_NCCL

std::unique_ptr<tg::dist::Communicator> tg::dist::make_nccl_communicator(Communicator&) {
  throw Error("dist: typegrad was built without NCCL (nccl.h or libnccl was not found next to the CUDA toolkit), so there is no NCCL "
              "communicator");
}

#endif
