// Communicators (include/typegrad/dist/comm.hpp): the single-process world, the MPI one (when built with MPI),
// world() and the failure exits (Note [communicators]).
#include "typegrad/dist/comm.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "typegrad/config.hpp"

#if TG_HAVE_MPI
#include <mpi.h>
#endif

namespace tg::dist {

namespace {
using detail::total_count;
void copy_bytes(void* dst, const void* src, std::size_t n) {
  if (n && dst != src) std::memmove(dst, src, n);
}
}  // namespace

void Communicator::check_counts(const char* what, std::span<const std::int64_t> counts) const {
  TG_CHECK(static_cast<int>(counts.size()) == size(), "dist::", what, ": ", counts.size(), " counts given for ", size(),
           " ranks (one count per rank)");
  for (auto c : counts) TG_CHECK(c >= 0, "dist::", what, ": a count is negative (", c, ")");
}

std::vector<std::string> Communicator::all_gather_strings(const std::string& mine) {
  const int n = size();
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(n), 0), ones(static_cast<std::size_t>(n), 1);
  std::int64_t my_len = static_cast<std::int64_t>(mine.size());
  all_gather(Buffer{&my_len, 1, DType::i64, DeviceKind::cpu}, Buffer{lengths.data(), n, DType::i64, DeviceKind::cpu}, ones);
  std::string all(static_cast<std::size_t>(total_count(lengths)), '\0');
  std::string copy = mine;
  all_gather(Buffer{copy.data(), my_len, DType::u8, DeviceKind::cpu}, Buffer{all.data(), static_cast<std::int64_t>(all.size()), DType::u8, DeviceKind::cpu},
             lengths);
  std::vector<std::string> out;
  std::size_t at = 0;
  for (auto len : lengths) {
    out.push_back(all.substr(at, static_cast<std::size_t>(len)));
    at += static_cast<std::size_t>(len);
  }
  return out;
}

// ---- the single-process world ---------------------------------------------------------------------

Work SingleProcess::reduce_scatter_async(Buffer send, Buffer recv, std::span<const std::int64_t> counts, ReduceOp) {
  check_counts("reduce_scatter", counts);
  TG_CHECK(send.count == counts[0] && recv.count == counts[0], "dist::reduce_scatter: the buffers hold ", send.count, " and ",
           recv.count, " elements, the counts say ", counts[0]);
  TG_CHECK(send.device == DeviceKind::cpu || send.data == recv.data,
           "dist::reduce_scatter: the single-process world copies host buffers only (pass the same buffer twice on a GPU)");
  copy_bytes(recv.data, send.data, detail::buffer_bytes(send.dtype, send.count));
  return {};
}

Work SingleProcess::all_gather_async(Buffer send, Buffer recv, std::span<const std::int64_t> counts) {
  check_counts("all_gather", counts);
  TG_CHECK(send.count == counts[0] && recv.count == counts[0], "dist::all_gather: the buffers hold ", send.count, " and ",
           recv.count, " elements, the counts say ", counts[0]);
  TG_CHECK(send.device == DeviceKind::cpu || send.data == recv.data,
           "dist::all_gather: the single-process world copies host buffers only (pass the same buffer twice on a GPU)");
  copy_bytes(recv.data, send.data, detail::buffer_bytes(send.dtype, send.count));
  return {};
}

Work SingleProcess::broadcast_async(Buffer, int root) {
  TG_CHECK(root == 0, "dist::broadcast: root ", root, " is not a rank of a world of size 1");
  return {};
}
void SingleProcess::send(Buffer, int peer, int) { throw Error("dist::send: no rank ", peer, " in a world of size 1"); }
void SingleProcess::recv(Buffer, int peer, int) { throw Error("dist::recv: no rank ", peer, " in a world of size 1"); }

// ---- failure exits ----------------------------------------------------------------------------------

namespace {
bool g_mpi_active = false;  // MPI_Init ran and MPI_Finalize has not
}

void abort_world(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
#if TG_HAVE_MPI
  if (g_mpi_active) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  std::_Exit(code);
}

void communication_failed(const Communicator& comm, const std::string& what) {
  std::fflush(stdout);
  std::fprintf(stderr, "typegrad dist: rank %d of %d (%s): %s\n", comm.rank(), comm.size(), comm.backend().c_str(), what.c_str());
  abort_world(5);
}

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"})
    if (const char* e = std::getenv(v); e && *e) return true;
  return false;
}

bool have_mpi() { return TG_HAVE_MPI; }

// ---- MPI ----------------------------------------------------------------------------------------------

#if TG_HAVE_MPI
namespace {

template <class Half>
void half_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const Half*>(in);
  auto* b = static_cast<Half*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Half(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

class MpiCommunicator;

// An MPI operation of one or more stages (all_reduce: reduce-scatter, then all-gather), each a non-blocking
// request started when the previous one completes; `after` runs when the last completes.
class MpiWork final : public Work::Impl {
 public:
  using Stage = std::function<int(MPI_Request*)>;  // starts the stage, returns MPI's error code
  MpiWork(const MpiCommunicator& comm, std::string what) : comm_(comm), what_(std::move(what)) {}
  ~MpiWork() override {
    if (installed_ && !done_) wait();  // a dropped handle still completes (the buffers may go next)
  }
  /// Starts the first stage.
  void install(std::vector<Stage> stages, std::function<void()> after) {
    stages_ = std::move(stages);
    after_ = std::move(after);
    installed_ = true;
    start_next();
  }
  bool test() override;
  void wait() override;
  std::vector<std::int64_t> scratch_storage;  // buffers the stages use (kept alive here)
  std::vector<int> counts, displs;

 private:
  void start_next();
  void check(int rc, const char* during);
  const MpiCommunicator& comm_;
  std::string what_;
  std::vector<Stage> stages_;
  std::size_t next_ = 0;
  std::function<void()> after_;
  MPI_Request req_ = MPI_REQUEST_NULL;
  bool installed_ = false, done_ = false;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        throw Error("dist: MPI_Init_thread failed");
      owns_init_ = true;
    }
    g_mpi_active = true;
    comm_ = MPI_COMM_WORLD;
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Type_contiguous(2, MPI_BYTE, &half_type_);
    MPI_Type_commit(&half_type_);
    MPI_Op_create(&half_sum<bf16>, 1, &bf16_sum_);
    MPI_Op_create(&half_sum<fp16>, 1, &fp16_sum_);
  }
  /// A sub-communicator of `parent` (split): shares the parent's 16-bit type and sums.
  MpiCommunicator(MPI_Comm comm, const MpiCommunicator& parent)
      : comm_(comm), sub_(true), half_type_(parent.half_type_), bf16_sum_(parent.bf16_sum_), fp16_sum_(parent.fp16_sum_) {
    set_timeout(parent.timeout());
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (sub_) {
      if (!finalized) MPI_Comm_free(&comm_);
      return;
    }
    if (!finalized) {
      MPI_Op_free(&bf16_sum_);
      MPI_Op_free(&fp16_sum_);
      MPI_Type_free(&half_type_);
    }
    if (owns_init_ && !finalized) MPI_Finalize();
    g_mpi_active = false;
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm sub = MPI_COMM_NULL;
    const int rc = MPI_Comm_split(comm_, color, key, &sub);
    if (rc != MPI_SUCCESS) communication_failed(*this, "split failed: " + error_string(rc));
    return std::make_unique<MpiCommunicator>(sub, *this);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  DeviceKind device() const override { return DeviceKind::cpu; }

  Work all_reduce_async(Buffer buf, ReduceOp op) override {
    check_host("all_reduce", buf);
    TG_CHECK(buf.count <= INT32_MAX, "dist::all_reduce: ", buf.count, " elements is more than one MPI call moves (2^31 - 1); use smaller buckets");
    // One non-blocking collective per call: every rank starts its collectives in program order, as MPI
    // requires (a call made of two MPI collectives, the second started on completion of the first, would
    // let two calls in flight start their second halves in different orders on different ranks).
    auto work = std::make_unique<MpiWork>(*this, "all_reduce");
    const MPI_Datatype type = type_of(buf.dtype);
    const MPI_Op mop = op_of(buf.dtype);
    std::function<void()> after;
    if (op == ReduceOp::avg) after = [=, this] { scale(buf, 1.0 / size_); };
    return restart(std::move(work),
                   {[=, this](MPI_Request* r) { return MPI_Iallreduce(MPI_IN_PLACE, buf.data, static_cast<int>(buf.count), type, mop, comm_, r); }},
                   std::move(after));
  }

  Work reduce_scatter_async(Buffer send, Buffer recv, std::span<const std::int64_t> counts, ReduceOp op) override {
    check_host("reduce_scatter", send);
    check_host("reduce_scatter", recv);
    check_counts("reduce_scatter", counts);
    TG_CHECK(send.count == total_count(counts) && recv.count == counts[static_cast<std::size_t>(rank_)] && send.dtype == recv.dtype,
             "dist::reduce_scatter: send holds ", send.count, " and recv ", recv.count, " elements; the counts sum to ", total_count(counts),
             " with ", counts[static_cast<std::size_t>(rank_)], " for rank ", rank_);
    auto work = std::make_unique<MpiWork>(*this, "reduce_scatter");
    set_counts(*work, counts, "reduce_scatter");
    MpiWork* w = work.get();
    const MPI_Datatype type = type_of(send.dtype);
    const MPI_Op mop = op_of(send.dtype);
    std::function<void()> after;
    if (op == ReduceOp::avg) after = [=, this] { scale(recv, 1.0 / size_); };
    return restart(std::move(work),
                   {[=, this](MPI_Request* r) { return MPI_Ireduce_scatter(send.data, recv.data, w->counts.data(), type, mop, comm_, r); }},
                   std::move(after));
  }

  Work all_gather_async(Buffer send, Buffer recv, std::span<const std::int64_t> counts) override {
    check_host("all_gather", send);
    check_host("all_gather", recv);
    check_counts("all_gather", counts);
    TG_CHECK(recv.count == total_count(counts) && send.count == counts[static_cast<std::size_t>(rank_)] && send.dtype == recv.dtype,
             "dist::all_gather: send holds ", send.count, " and recv ", recv.count, " elements; the counts sum to ", total_count(counts),
             " with ", counts[static_cast<std::size_t>(rank_)], " for rank ", rank_);
    auto work = std::make_unique<MpiWork>(*this, "all_gather");
    set_counts(*work, counts, "all_gather");
    MpiWork* w = work.get();
    const MPI_Datatype type = type_of(send.dtype);
    const std::size_t esize = dtype_size(send.dtype);
    const bool in_place = static_cast<char*>(send.data) ==
                          static_cast<char*>(recv.data) + esize * static_cast<std::size_t>(w->displs[static_cast<std::size_t>(rank_)]);
    return restart(std::move(work),
                   {[=, this](MPI_Request* r) {
                     return MPI_Iallgatherv(in_place ? MPI_IN_PLACE : send.data, w->counts[static_cast<std::size_t>(rank_)], type, recv.data,
                                            w->counts.data(), w->displs.data(), type, comm_, r);
                   }},
                   {});
  }

  Work broadcast_async(Buffer buf, int root) override {
    check_host("broadcast", buf);
    TG_CHECK(root >= 0 && root < size_, "dist::broadcast: root ", root, " is not a rank (world size ", size_, ")");
    TG_CHECK(buf.count <= INT32_MAX, "dist::broadcast: ", buf.count, " elements is more than one MPI call moves (2^31 - 1)");
    auto work = std::make_unique<MpiWork>(*this, "broadcast");
    const MPI_Datatype type = type_of(buf.dtype);
    return restart(std::move(work),
                   {[=, this](MPI_Request* r) { return MPI_Ibcast(buf.data, static_cast<int>(buf.count), type, root, comm_, r); }}, {});
  }

  void send(Buffer buf, int peer, int tag) override { point_to_point("send", buf, peer, tag, true).wait(); }
  void recv(Buffer buf, int peer, int tag) override { point_to_point("recv", buf, peer, tag, false).wait(); }
  Work send_async(Buffer buf, int peer, int tag) override { return point_to_point("send", buf, peer, tag, true); }
  Work recv_async(Buffer buf, int peer, int tag) override { return point_to_point("recv", buf, peer, tag, false); }
  void barrier() override {
    auto work = std::make_unique<MpiWork>(*this, "barrier");
    Work w = restart(std::move(work), {[this](MPI_Request* r) { return MPI_Ibarrier(comm_, r); }}, {});
    w.wait();
  }

  /// MPI's message for an error code.
  static std::string error_string(int rc) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
    return std::string(msg, static_cast<std::size_t>(len));
  }

 private:
  void check_host(const char* what, const Buffer& b) const {
    TG_CHECK(b.device == DeviceKind::cpu, "dist::", what, ": the MPI communicator moves host buffers; CUDA tensors go through NCCL");
  }
  MPI_Datatype type_of(DType d) const {
    switch (d) {
      case DType::f64: return MPI_DOUBLE;
      case DType::f32: return MPI_FLOAT;
      case DType::f16:
      case DType::bf16: return half_type_;
      case DType::i64: return MPI_INT64_T;
      case DType::i32: return MPI_INT32_T;
      case DType::u8: return MPI_UINT8_T;
      case DType::i8: return MPI_INT8_T;
    }
    throw Error("dist: no MPI type for ", dtype_name(d));
  }
  MPI_Op op_of(DType d) const {
    if (d == DType::bf16) return bf16_sum_;
    if (d == DType::f16) return fp16_sum_;
    return MPI_SUM;
  }
  static void scale(Buffer b, double s) {
    switch (b.dtype) {
      case DType::f64: for (std::int64_t i = 0; i < b.count; ++i) static_cast<double*>(b.data)[i] *= s; return;
      case DType::f32: for (std::int64_t i = 0; i < b.count; ++i) static_cast<float*>(b.data)[i] = static_cast<float>(static_cast<float*>(b.data)[i] * s); return;
      case DType::bf16: for (std::int64_t i = 0; i < b.count; ++i) { auto& v = static_cast<bf16*>(b.data)[i]; v = bf16(static_cast<float>(static_cast<float>(v) * s)); } return;
      case DType::f16: for (std::int64_t i = 0; i < b.count; ++i) { auto& v = static_cast<fp16*>(b.data)[i]; v = fp16(static_cast<float>(static_cast<float>(v) * s)); } return;
      default: throw Error("dist: ReduceOp::avg needs a floating-point buffer, this one is ", dtype_name(b.dtype));
    }
  }
  void set_counts(MpiWork& w, std::span<const std::int64_t> counts, const char* what) const {
    w.counts.resize(counts.size());
    w.displs.resize(counts.size());
    std::int64_t at = 0;
    for (std::size_t i = 0; i < counts.size(); ++i) {
      TG_CHECK(counts[i] <= INT32_MAX && at <= INT32_MAX, "dist::", what, ": ", counts[i], " elements at offset ", at,
               " is beyond what one MPI call addresses (2^31 - 1); use smaller buckets");
      w.counts[i] = static_cast<int>(counts[i]);
      w.displs[i] = static_cast<int>(at);
      at += counts[i];
    }
  }
  Work restart(std::unique_ptr<MpiWork> work, std::vector<MpiWork::Stage> stages, std::function<void()> after);
  Work point_to_point(const char* what, Buffer buf, int peer, int tag, bool sending) {
    check_host(what, buf);
    TG_CHECK(peer >= 0 && peer < size_ && peer != rank_, "dist::", what, ": peer ", peer, " is not another rank (world size ", size_,
             ", this is rank ", rank_, ")");
    TG_CHECK(buf.count <= INT32_MAX, "dist::", what, ": ", buf.count, " elements is more than one MPI call moves");
    auto work = std::make_unique<MpiWork>(*this, what);
    const MPI_Datatype type = type_of(buf.dtype);
    Work w = restart(std::move(work),
                     {[=, this](MPI_Request* r) {
                       return sending ? MPI_Isend(buf.data, static_cast<int>(buf.count), type, peer, tag, comm_, r)
                                      : MPI_Irecv(buf.data, static_cast<int>(buf.count), type, peer, tag, comm_, r);
                     }},
                     {});
    return w;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool sub_ = false;
  int rank_ = 0, size_ = 1;
  bool owns_init_ = false;
  MPI_Datatype half_type_{};
  MPI_Op bf16_sum_{}, fp16_sum_{};
};

// The stages are installed after construction: they capture the Work's own count arrays.
Work MpiCommunicator::restart(std::unique_ptr<MpiWork> work, std::vector<MpiWork::Stage> stages, std::function<void()> after) {
  work->install(std::move(stages), std::move(after));
  return Work(std::move(work));
}

}  // namespace

// MpiWork's members, after MpiCommunicator is complete.
namespace {
void MpiWork::check(int rc, const char* during) {
  if (rc != MPI_SUCCESS)
    communication_failed(comm_, what_ + " failed while " + during + ": " + MpiCommunicator::error_string(rc) +
                                    " (another rank probably ended; its own message says why)");
}
void MpiWork::start_next() {
  if (next_ >= stages_.size()) {
    done_ = true;
    if (after_) after_();
    return;
  }
  check(stages_[next_++](&req_), "starting");
}
bool MpiWork::test() {
  while (!done_) {
    if (req_ == MPI_REQUEST_NULL) {
      start_next();
      continue;
    }
    int flag = 0;
    check(MPI_Test(&req_, &flag, MPI_STATUS_IGNORE), "in progress");
    if (!flag) return false;
    req_ = MPI_REQUEST_NULL;
    start_next();
  }
  return true;
}
void MpiWork::wait() {
  const auto t0 = std::chrono::steady_clock::now();
  for (long spins = 0; !test(); ++spins) {
    if (spins < 2000) continue;  // a short spin: most completions are quick
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 20000 ? 20 : 200));
    const auto waited = std::chrono::steady_clock::now() - t0;
    if (waited > comm_.timeout())
      communication_failed(comm_, what_ + " waited more than " + std::to_string(comm_.timeout().count()) +
                                      " s for the other ranks: one probably died or is stuck (raise the limit with --dist-timeout)");
  }
}
}  // namespace
#endif  // TG_HAVE_MPI

Communicator& world() {
  static std::unique_ptr<Communicator> w = []() -> std::unique_ptr<Communicator> {
    if (!launched_by_mpi()) return std::make_unique<SingleProcess>();
#if TG_HAVE_MPI
    return std::make_unique<MpiCommunicator>();
#else
    throw Error("dist: this process was started by an MPI launcher, but typegrad was built without MPI (install libopenmpi-dev and "
                "rebuild)");
#endif
  }();
  return *w;
}

}  // namespace tg::dist
